"""Evaluating a solution of a Problem on the tick grid: ends, makespan, barrier, live memory,
the overlap rule (``overlaps_compute``, ``settle_alone``), the solver side's own feasibility
check, and chunk relabelling. moegraph.schedules.verify re-derives all of this from the file.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from moegraph.schedules.problem import Problem, ScheduleError, Task

__all__ = ["Solution", "solution_ends", "makespan_ticks", "barrier_ticks", "memory_profile", "peak_memory_bytes",
           "alone_twin", "overlaps_compute", "settle_alone", "check_solution", "canonical_chunk_order"]


@dataclass(frozen=True)
class Solution:
    """A schedule on the tick grid: per task (in Problem.tasks order) its start and mode index."""

    method: str
    start: tuple[int, ...]
    mode: tuple[int, ...]


def solution_ends(problem: Problem, sol: Solution) -> tuple[int, ...]:
    return tuple(s + t.modes[m].ticks for s, t, m in zip(sol.start, problem.tasks, sol.mode))


def makespan_ticks(problem: Problem, sol: Solution) -> int:
    return max(solution_ends(problem, sol), default=0)


def barrier_ticks(problem: Problem, sol: Solution) -> int:
    ends = solution_ends(problem, sol)
    return max((ends[t.index] for t in problem.tasks if t.side == 0), default=0)


def memory_profile(problem: Problem, sol: Solution) -> list[tuple[int, int]]:
    """(tick, live bytes from this tick on) at every change, sorted by tick."""
    ends = solution_ends(problem, sol)
    span, barrier = max(ends, default=0), barrier_ticks(problem, sol)
    delta: dict[int, int] = {}
    for v in problem.mem_values:
        s = {"producer": sol.start[v.producer] if v.producer is not None else 0,
             "zero": 0, "barrier": barrier}[v.start]
        e = span if v.until_makespan else max((ends[i] for i in v.ends), default=s)
        if e > s:
            delta[s] = delta.get(s, 0) + v.nbytes
            delta[e] = delta.get(e, 0) - v.nbytes
    live, profile = 0, []
    for tick in sorted(delta):
        live += delta[tick]
        profile.append((tick, live))
    return profile


def peak_memory_bytes(problem: Problem, sol: Solution) -> int:
    return max((b for _, b in memory_profile(problem, sol)), default=0)


def alone_twin(task: Task, k: int) -> int:
    """Index of the alone mode with mode ``k``'s SMs (``k`` itself if it is alone, or if the task
    has no alone modes: no overlap stretch)."""
    if task.modes[k].alone or not any(m.alone for m in task.modes):
        return k
    sm = task.modes[k].sm
    twin = next((j for j, m in enumerate(task.modes) if m.alone and m.sm == sm), None)
    if twin is None:  # _prune keeps every twin; a hand-built Task without one is a bug
        raise ScheduleError(f"collective {task.name!r} has no alone mode with {sm} SMs")
    return twin


def overlaps_compute(problem: Problem, sol: Solution) -> list[bool]:
    """Per task: does some compute task taking time run during it (open intervals)?"""
    ends = solution_ends(problem, sol)
    busy = sorted((sol.start[t.index], ends[t.index]) for t in problem.tasks
                  if t.kind == "compute" and ends[t.index] > sol.start[t.index])
    starts = [b[0] for b in busy]
    out = []
    for t in problem.tasks:
        s, e = sol.start[t.index], ends[t.index]
        # compute spans are disjoint (one stream) and sorted: only the last one starting before
        # e can reach past s
        i = bisect.bisect_left(starts, e) - 1
        out.append(e > s and i >= 0 and busy[i][1] > s)
    return out


def settle_alone(problem: Problem, sol: Solution) -> Solution:
    """Put every collective that no compute overlaps into its alone mode (shorter, same start):
    still feasible (nothing starts earlier, nothing new overlaps), never longer."""
    beside = overlaps_compute(problem, sol)
    mode = tuple(alone_twin(t, sol.mode[t.index]) if t.kind == "comm" and not beside[t.index]
                 else sol.mode[t.index] for t in problem.tasks)
    return sol if mode == sol.mode else Solution(sol.method, sol.start, mode)


def check_solution(problem: Problem, sol: Solution) -> None:
    """Raise ScheduleError if ``sol`` breaks a dependency, the barrier, a stream or the SM
    capacity (the solver side's own check on the tick grid, run before a solution is
    written out; moegraph.schedules.verify re-checks the file independently)."""
    tasks = problem.tasks
    ends = solution_ends(problem, sol)
    barrier = barrier_ticks(problem, sol)
    for t in tasks:
        for p in t.preds:
            if sol.start[t.index] < ends[p]:
                raise ScheduleError(f"{sol.method}: {t.name!r} starts before its input from {tasks[p].name!r}")
        if t.side == 1 and sol.start[t.index] < barrier:
            raise ScheduleError(f"{sol.method}: {t.name!r} starts before the barrier")
    events: list[tuple[int, int, int]] = []
    for stream in problem.streams:
        spans = sorted((sol.start[t.index], ends[t.index], t.index) for t in tasks
                       if t.stream == stream and ends[t.index] > sol.start[t.index])
        for (s0, e0, a), (s1, _, b) in zip(spans, spans[1:]):
            if s1 < e0:
                raise ScheduleError(f"{sol.method}: {tasks[a].name!r} and {tasks[b].name!r} overlap on {stream}")
    for t in tasks:
        m = t.modes[sol.mode[t.index]]
        if m.ticks and m.sm:
            events += [(sol.start[t.index], 1, m.sm), (ends[t.index], 0, -m.sm)]
    used = 0
    for _, _, d in sorted(events):
        used += d
        if used > problem.sm_count:
            raise ScheduleError(f"{sol.method}: more than {problem.sm_count} SMs in use")
    if problem.launch:
        from moegraph.schedules.launch import follows_launch
        out_of_order = follows_launch(problem, sol.start)
        if out_of_order:
            raise ScheduleError(f"{sol.method}: {out_of_order}")
    beside = overlaps_compute(problem, sol)
    for t in tasks:
        k = sol.mode[t.index]
        if t.kind == "comm" and t.modes[k].alone and beside[t.index]:
            raise ScheduleError(f"{sol.method}: collective {t.name!r} runs in its alone mode beside compute")
        if t.kind == "comm" and not beside[t.index] and alone_twin(t, k) != k:
            raise ScheduleError(f"{sol.method}: collective {t.name!r} runs alone but is priced beside compute "
                                f"(settle_alone)")


def canonical_chunk_order(problem: Problem, sol: Solution, groups: tuple[tuple[int, ...], ...]) -> Solution:
    """Relabel chunks of ``sol`` so chunk c's first task starts no later than chunk c+1's
    (the order the CP-SAT symmetry-breaking constraints demand). Same schedule up to the
    chunk automorphism, so the same makespan and peak memory."""
    order = sorted(range(len(groups)), key=lambda c: (sol.start[groups[c][0]], c))
    start, mode = list(sol.start), list(sol.mode)
    for rank, c in enumerate(order):
        for src, dst in zip(groups[c], groups[rank]):
            start[dst], mode[dst] = sol.start[src], sol.mode[src]
    return Solution(sol.method, tuple(start), tuple(mode))
