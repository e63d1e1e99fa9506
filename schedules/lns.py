"""Large-neighbourhood search: CP-SAT re-solves one window of a complete schedule at a time.

On a merged micro-batch step graph (moegraph.microbatch: 1,000-1,700 tasks) CP-SAT's search of
the whole model returns its warm start unchanged within the time limit (its own LNS
neighbourhoods did not find improvements there). A window of ~60 tasks consecutive in time,
with the rest of the schedule held,
is a model CP-SAT packs well (DeepSeek-V3, 4 layers, M=4, h800: the last 112 tasks re-solved
took 191,674 -> 188,728 us, while a window of 400-560 tasks found nothing in the same effort).
compile_graph runs it on large merged steps (schedules.api), with or without a memory budget.

The neighbourhood of window [i, i + W) (tasks ranked by their incumbent start, ties by index):
    before the window  start and mode fixed to the incumbent's;
    in the window      free (start, mode);
    after the window   mode fixed; on its stream each starts after the end of the task before it
                       in the incumbent's order there, so they keep their sequence and slide
                       left as far as the window lets them.
Every solution of that model is a solution of the full model (build_model, memory budget
included) plus constraints, and the incumbent is one of them (the staged solve's hint), so a
window never returns a worse schedule; only strictly shorter ones are accepted.

Only the tasks that can still move are in the model: those ranked from the window on, and the
earlier ones still running at the window's first start t0 (held at their starts). Under a
memory budget the tasks left out are held too (cpsat.Held): they all end by t0, so a value
between two of them is dead by then and left out, and one shared with a task in the model has
its held end as a constant in its max; values dead by t0 are left out (before t0 nothing moves, so
the live memory there is the incumbent's, within the budget). So a window under a budget is
as small as one without: on mixtral-8x7b's merged step (4 layers, M=4, 1,012 tasks), the 10
windows of 60 tasks from the end hold 60-330 tasks (the window and the tasks after it).

Windows go from the end of the schedule towards its start, overlapping by half: the exposed
communication of a merged step is in the cool-down (the step-level gradient all-reduces wait
for the last micro-batch's weight gradients), and an earlier window keeps the later tasks'
order and modes, so it keeps what a later window found. Deterministic: a fixed window
sequence, each solve under a deterministic time limit (moegraph.schedules.cpsat).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from moegraph.schedules.cpsat import CpHandles, CpSatResult, Held, SolverOptions, build_model, staged_solve, sub_problem
from moegraph.schedules.problem import Problem, ScheduleError
from moegraph.schedules.solution import Solution, makespan_ticks, peak_memory_bytes, solution_ends

__all__ = ["LnsResult", "Neighbourhood", "improve", "neighbourhood", "windows", "WINDOW_TASKS", "WINDOW_EFFORT_S", "LNS_SHARE"]

_log = logging.getLogger(__name__)   # one line per window (compile prints it on stderr)

WINDOW_TASKS = 60
"""Tasks per window. DeepSeek-V3 merged (1,684 tasks), from interleave4+ends (187,365.4 us), 10
windows at 3 s: 40 tasks 186,931.7 (26 s wall), 60: 186,698.5 (44 s), 100: 187,148.7, 150:
187,259.4 (201 s wall, cap hit); 20 windows of 60 found nothing more. A suffix of 112 tasks at
20 s gained 2,945 us, of 250 tasks 304, of 416 and 564 nothing (docs/scheduler.md)."""
WINDOW_EFFORT_S = 3.0
"""Search effort per window (``time_limit_s`` units, DTIME_PER_SECOND each). The last 100-task
window of DeepSeek-V3's merged step (from interleave4+ce) gains 2,063 us at 3 and 0 at 1."""
LNS_SHARE = 3.0
"""Multiple of ``time_limit_s`` the whole window sequence gets on top of the full-model solve:
``LNS_SHARE * time_limit_s / WINDOW_EFFORT_S`` windows (at least one), from the end."""


@dataclass(frozen=True)
class LnsResult:
    solution: Solution
    improved: int
    """Windows whose re-solve was accepted (strictly shorter)."""
    windows: int
    wall_s: float
    deterministic_time: float
    wall_cap_hit: bool


def windows(n: int, size: int) -> list[tuple[int, int]]:
    """Rank ranges [lo, hi) of size ``size`` (the last one may be shorter), overlapping by half,
    from the end of the ranking towards its start; one window of everything when n <= size."""
    if size < 2:
        raise ScheduleError(f"window size {size!r} must be at least 2 tasks")
    if n <= size:
        return [(0, n)]
    step = size // 2
    out, hi = [], n
    while True:
        lo = max(hi - size, 0)
        out.append((lo, hi))
        if lo == 0:
            return out
        hi -= step


def improve(problem: Problem, incumbent: Solution, opts: SolverOptions, *, size: int = WINDOW_TASKS,
            share: float = LNS_SHARE, effort_s: float = WINDOW_EFFORT_S) -> LnsResult:
    """The incumbent improved window by window (module doc); never worse. The first
    max(1, floor(``share`` x ``opts.time_limit_s`` / ``effort_s``)) windows of ``windows``
    (from the end) are re-solved, each at ``effort_s``."""
    if not share > 0 or not effort_s > 0:
        raise ScheduleError(f"share={share!r} and effort_s={effort_s!r} must be positive")
    budget = problem.memory_budget_bytes
    if budget is not None and peak_memory_bytes(problem, incumbent) > budget:  # the windows hold its past
        raise ScheduleError(f"the incumbent peaks at {peak_memory_bytes(problem, incumbent)} bytes, above the memory "
                            f"budget {budget}: the window search improves a schedule within the budget")
    best, span = incumbent, makespan_ticks(problem, incumbent)
    count = max(1, int(share * opts.time_limit_s / effort_s))
    ws = windows(len(problem.tasks), size)[:count]
    per = dataclasses.replace(opts, time_limit_s=effort_s)
    _log.info("window search: %d windows of %d tasks, effort %g s each", len(ws), size, effort_s)
    improved, wall, dtime, cap = 0, 0.0, 0.0, False
    for k, (lo, hi) in enumerate(ws, 1):
        r = _window(problem, best, lo, hi, per)
        wall, dtime, cap = wall + r.wall_s, dtime + r.deterministic_time, cap or r.wall_cap_hit
        if r.solution is not None and makespan_ticks(problem, r.solution) < span:
            best, span, improved = r.solution, makespan_ticks(problem, r.solution), improved + 1
        _log.info("window search %d/%d (tasks %d-%d of %d): %.1f us", k, len(ws), lo, hi, len(problem.tasks),
                  span * problem.tick_us)
    return LnsResult(Solution(incumbent.method, best.start, best.mode), improved, len(ws), wall, dtime, cap)


@dataclass(frozen=True)
class Neighbourhood:
    """The model of one window (module doc): ``sub`` holds the tasks ``keep`` (original indices)."""

    keep: tuple[int, ...]
    sub: Problem
    handles: CpHandles


def neighbourhood(problem: Problem, sol: Solution, lo: int, hi: int) -> Neighbourhood:
    """The CP-SAT model of window [lo, hi) of ``sol``'s start ranking (module doc). Every free
    task starts at or after ``t0``, the window's earliest incumbent start; a task before the
    window that ends by ``t0`` then constrains nothing but through that, so it is left out of
    the model. Under a memory budget the left-out tasks are held (cpsat.Held): the live values
    they bound are constant intervals, and those dead by ``t0`` drop out, since before ``t0``
    the live memory is the incumbent's (everything running then is held at its start)."""
    tasks = problem.tasks
    rank = sorted(range(len(tasks)), key=lambda i: (sol.start[i], i))
    where = {i: r for r, i in enumerate(rank)}
    ends = solution_ends(problem, sol)
    t0 = sol.start[rank[lo]]
    keep = tuple(sorted(i for i in range(len(tasks)) if where[i] >= lo or ends[i] > t0))
    sub = sub_problem(problem, keep)
    held = Held(problem, keep, sol, t0) if problem.memory_budget_bytes is not None else None
    sub_sol = Solution(sol.method, tuple(sol.start[i] for i in keep), tuple(sol.mode[i] for i in keep))
    # symmetry breaking would reorder the hint's chunks (canonical_chunk_order), which the
    # fixed starts below forbid
    h = build_model(sub, hint=sub_sol, horizon=makespan_ticks(problem, sol), symmetry=False, held=held)
    m = h.model
    for t in sub.tasks:
        v, r = h.tasks[t.name], where[keep[t.index]]
        if r < lo:
            m.add(v.start == sub_sol.start[t.index])
        else:
            m.add(v.start >= t0)
        if (r < lo or r >= hi) and len(t.modes) > 1:
            m.add(v.lits[sub_sol.mode[t.index]] == 1)
    kept = set(keep)
    for stream in problem.streams:  # after the window: each stream's incumbent order kept
        seq = [i for i in rank if i in kept and tasks[i].stream == stream and ends[i] > sol.start[i]]
        for a, b in zip(seq, seq[1:]):
            if where[b] >= hi:
                m.add(h.tasks[tasks[b].name].start >= h.tasks[tasks[a].name].end)
    return Neighbourhood(keep, sub, h)


def _window(problem: Problem, sol: Solution, lo: int, hi: int, opts: SolverOptions) -> CpSatResult:
    """Re-solve window [lo, hi) of ``sol``'s start ranking (``neighbourhood``); the result is a
    solution of the whole ``problem``."""
    nb = neighbourhood(problem, sol, lo, hi)
    r = staged_solve(nb.sub, nb.handles, opts, sol.method, nb.handles.makespan, True)
    if r.solution is None:
        return r
    start, mode = list(sol.start), list(sol.mode)
    for j, i in enumerate(nb.keep):
        start[i], mode[i] = r.solution.start[j], r.solution.mode[j]
    return dataclasses.replace(r, solution=Solution(sol.method, tuple(start), tuple(mode)))
