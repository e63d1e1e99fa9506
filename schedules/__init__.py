"""Schedules: the CP-SAT model, baselines, lower bound, verifier, schedule file and Gantt.

    from moegraph.schedules import compile_graph, verify_schedule, render, Schedule
    result = compile_graph(graph, CostModel(hw), time_limit_s=10)
    assert not verify_schedule(result.schedule)
    render(result.schedule, "layer.png")

Pipeline: problem (Graph + CostModel -> tasks, modes, memory intervals) -> baselines and
bound -> cpsat -> schedule_file; verify re-checks a file independently; gantt draws one.
docs/scheduler.md states the semantics and the model.
"""

from moegraph.schedules.api import METHODS, CompileResult, compile_graph
from moegraph.schedules.problem import MemoryBudgetError, ScheduleError
from moegraph.schedules.schedule_file import Schedule, ScheduleFormatError
from moegraph.schedules.verify import Violation, verify_schedule


def render(sched, path, compare=None, sources=()):
    """Draw ``sched`` to ``path`` (.png, .svg, .html or .json); see moegraph.schedules.gantt."""
    from moegraph.schedules.gantt import render as _render  # matplotlib is imported only when drawing
    return _render(sched, path, compare=compare, sources=sources)


__all__ = ["compile_graph", "CompileResult", "METHODS", "Schedule", "ScheduleFormatError", "ScheduleError",
           "MemoryBudgetError", "verify_schedule", "Violation", "render"]
