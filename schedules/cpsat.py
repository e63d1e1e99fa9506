"""The CP-SAT model of a Problem: optional intervals per mode, streams, SMs, memory.

Variables (named after their node, handles in ``CpHandles`` keyed by node name):
    start[n], end[n]         ticks; domain cut by precedence-implied heads and tails
    mode[n=sm]               one literal per mode (exactly one true)
    run[n]                   the node's interval (size = the chosen mode's ticks): NoOverlap per stream
    run[n@sm]                optional fixed-size interval of one mode, demand = SMs it holds:
                             AddCumulative over all of them with capacity sm_count
    barrier                  = max end of forward nodes; backward sources start after it
    makespan                 >= every end (+ tail); the objective
    live[v]                  a value's interval, start at its producer's start (0, or the
                             barrier for the seed gradient), end >= each consumer's end (the
                             makespan for outputs): AddCumulative over bytes <= budget

A collective's alone modes (hw.comm_overlap_stretch > 1) join the compute stream's NoOverlap:
it then runs at its plain time with no compute beside it; its other modes are stretched.

Compute slowed by concurrent collectives is the SM cumulative: a compute node at full SMs
fills the capacity, so any collective holding SMs beside it forces a slowed mode
(sm_count - b SMs for base * sm_count / (sm_count - b)). Copy-engine collectives (0 SMs)
overlap freely.

Warm start in two stages (``solve``): CP-SAT's own search may drop a hint (it tries a hint
for a few conflicts, then searches elsewhere: a complete, feasible hint of a 221-node layer
ended with no solution at all). So stage 1 solves with every hinted variable fixed to the hint
(``fix_variables_to_their_hinted_value``): a pure feasibility check of the warm start inside
the model, which also fills in every auxiliary variable; stage 2 searches the full model with
that complete solution as its hint and ``makespan <= stage 1's``. The result is the better of
the two stage solutions, so CP-SAT's own result is never worse than its warm start.

Determinism: ``interleave_search`` (subsolvers, LNS included, take turns in batches of fixed
deterministic work; one thread by default), a fixed random seed and a *deterministic* time
limit (``max_deterministic_time``, CP-SAT's work counter) instead of a wall-clock one; the
same model then follows the same search path on every run. A wall-clock cap
(``WALL_CAP_FACTOR``) only guards against a stalled machine; a result cut by it is flagged
``wall_cap_hit`` (reported by ``compile --json``; such a result may differ between runs).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from moegraph.solver_limits import DTIME_PER_SECOND, WALL_CAP_FACTOR, set_time_limit  # noqa: F401 - re-exported
from moegraph.schedules.bound import Bound, heads_tails, lower_bound
from moegraph.schedules.problem import COMPUTE, Problem, ScheduleError, Task, chunk_symmetry
from moegraph.schedules.solution import (Solution, barrier_ticks, canonical_chunk_order, makespan_ticks, settle_alone,
                                        solution_ends)

__all__ = ["CpHandles", "CpSatResult", "Held", "SolverOptions", "build_model", "solve", "min_peak_memory", "staged_solve",
           "sub_problem",
           "DTIME_PER_SECOND", "WALL_CAP_FACTOR"]

REDUNDANT_TAILS = True
"""Add makespan >= end + tail for every task (not only sinks)."""


@dataclass(frozen=True)
class SolverOptions:
    time_limit_s: float = 10.0
    """Search effort, converted to deterministic time (DTIME_PER_SECOND per second)."""
    workers: int = 1
    """Threads for the interleaved search (deterministic for any count; 1 on the 2-core box)."""
    random_seed: int = 0
    log: bool = False

    def __post_init__(self):
        if not (isinstance(self.time_limit_s, (int, float)) and math.isfinite(self.time_limit_s)
                and self.time_limit_s > 0):
            raise ScheduleError(f"time_limit_s={self.time_limit_s!r} must be a positive number")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ScheduleError(f"workers={self.workers!r} must be a positive int")


@dataclass
class TaskVars:
    start: cp_model.IntVar
    end: cp_model.LinearExprT
    run: cp_model.IntervalVar | None           # None for zero-duration tasks
    lits: list                                 # per mode (constant True when there is one mode)
    mode_runs: list                            # per mode optional (or fixed) interval


@dataclass
class CpHandles:
    model: cp_model.CpModel
    horizon: int
    tasks: dict[str, TaskVars]
    makespan: cp_model.IntVar
    barrier: cp_model.IntVar
    live_end: dict[str, cp_model.LinearExprT] = field(default_factory=dict)
    memory_unit: int = 1
    peak: cp_model.IntVar | None = None
    chunk_groups: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class CpSatResult:
    status: str                    # OPTIMAL | FEASIBLE | INFEASIBLE | UNKNOWN | MODEL_INVALID
    solution: Solution | None
    objective: int | None          # ticks (makespan) or memory units (peak), as solved
    bound: int                     # proven lower bound on the objective, same unit
    wall_s: float
    deterministic_time: float
    wall_cap_hit: bool
    hint_objective: int | None = None
    """Stage 1's objective: the warm start as the model prices it (None: no hint, or the hint
    is infeasible in the model, e.g. above the memory budget)."""


def _memory_unit(problem: Problem) -> int:
    """gcd of all value sizes: live sums are multiples of it, so sizes/unit <= budget//unit
    is exact."""
    return math.gcd(*(v.nbytes for v in problem.mem_values)) or 1


@dataclass(frozen=True)
class Held:
    """The rest of a larger schedule around a sub-problem (``sub_problem``), for its memory:
    the tasks of ``problem`` outside ``keep`` stay at ``solution``'s starts and modes, so the
    live intervals they bound are fixed demand in the sub-problem's memory constraint, and
    those they share with the sub-problem's tasks are bounded by constants on that side.
    (moegraph.schedules.lns holds everything before a window this way.)"""

    problem: Problem
    """The full problem; its memory values and budget are the ones constrained."""
    keep: tuple[int, ...]
    """Original indices of the sub-problem's tasks (as passed to ``sub_problem``)."""
    solution: Solution
    """A solution of ``problem`` within its budget: where the held tasks run."""
    since: int
    """The caller's guarantee that before this tick the live memory is ``solution``'s (every
    sub-problem task starts at or after it, or is constrained to its start in ``solution``).
    Every held task ends by it (checked), so a value held entirely by held tasks is dead by
    then and left out of the model."""

    def __post_init__(self):
        n = len(self.problem.tasks)
        if list(self.keep) != sorted(set(self.keep)) or not all(0 <= i < n for i in self.keep):
            raise ScheduleError("Held.keep must be ascending, distinct task indices of Held.problem")
        if len(self.solution.start) != len(self.problem.tasks):
            raise ScheduleError(f"Held.solution has {len(self.solution.start)} starts for "
                                f"{len(self.problem.tasks)} tasks")
        ends, keep = solution_ends(self.problem, self.solution), set(self.keep)
        late = [t.name for t in self.problem.tasks if t.index not in keep and ends[t.index] > self.since]
        if late:
            raise ScheduleError(f"held task {late[0]!r} ends after Held.since={self.since}: a task running "
                                f"then belongs in keep (held at its start)")


def build_model(problem: Problem, *, horizon: int | None = None, hint: Solution | None = None,
                objective: str = "makespan", bound: Bound | None = None, symmetry: bool = True,
                held: Held | None = None) -> CpHandles:
    """objective: "makespan" (memory budget as a constraint, if any) or "peak_memory"
    (minimise the peak live bytes; no budget). symmetry: order interchangeable chunks by
    their first task's start (problem.chunk_symmetry). held: ``problem`` is
    ``sub_problem(held.problem, held.keep)`` and its memory is accounted as held.problem's, with
    the tasks outside it fixed (``Held``)."""
    if objective not in ("makespan", "peak_memory"):
        raise ValueError(f"objective={objective!r} is not one of 'makespan', 'peak_memory'")
    if held is not None and (problem.mem_values or len(problem.tasks) != len(held.keep)
                             or any(t.name != held.problem.tasks[i].name for t, i in zip(problem.tasks, held.keep))):
        raise ScheduleError("build_model(held=...) takes sub_problem(held.problem, held.keep) as its problem")
    tasks = problem.tasks
    H = problem.horizon if horizon is None else horizon
    bound = bound or lower_bound(problem)
    head, tail = heads_tails(problem)
    fwd_lb = bound.forward.ticks
    m = cp_model.CpModel()
    tv: dict[str, TaskVars] = {}
    for t in tasks:
        lo = head[t.index] + (fwd_lb if t.side == 1 else 0)
        hi = H - tail[t.index] - t.min_ticks - (bound.backward.ticks if t.side == 0 else 0)
        hi = max(hi, lo)  # an infeasible horizon shows up as INFEASIBLE, not a model error
        start = m.new_int_var(lo, hi, f"start[{t.name}]")
        tv[t.name] = _task_vars(m, t, start, lo, hi)
    mk = m.new_int_var(bound.ticks, max(H, bound.ticks), "makespan")
    barrier = m.new_int_var(fwd_lb if any(t.side == 0 for t in tasks) else 0, max(H, fwd_lb), "barrier")

    for t in tasks:
        for p in t.preds:
            m.add(tv[t.name].start >= tv[tasks[p].name].end)
    fwd = [t for t in tasks if t.side == 0]
    fwd_sinks = [t for t in fwd if not any(tasks[s].side == 0 for s in t.succs)]
    if fwd_sinks:
        m.add_max_equality(barrier, [tv[t.name].end for t in fwd_sinks])
    else:
        m.add(barrier == 0)
    for t in tasks:  # for sinks (tail 0) required, for the others precedence-implied cuts
        v = tv[t.name]
        sink = not any(tasks[s].side == t.side for s in t.succs)
        if t.side == 0 and (sink or REDUNDANT_TAILS):
            m.add(barrier >= v.end + tail[t.index])
        elif t.side == 1 and (sink or REDUNDANT_TAILS):
            m.add(mk >= v.end + tail[t.index])
        if t.side == 1:
            if not any(tasks[p].side == 1 for p in t.preds):
                m.add(v.start >= barrier)
    m.add(mk >= barrier + bound.backward.ticks)

    for stream in problem.streams:
        runs = [tv[t.name].run for t in tasks if t.stream == stream and tv[t.name].run is not None]
        if stream == COMPUTE:  # a collective in its alone mode excludes compute like a compute node
            runs += [iv for t in tasks if t.kind == "comm"
                     for mode, iv in zip(t.modes, tv[t.name].mode_runs) if mode.alone and mode.ticks > 0]
        if len(runs) > 1:
            m.add_no_overlap(runs)
    _sm_constraints(problem, m, tv)
    for a, b in zip(problem.launch, problem.launch[1:]):   # one hardware queue (moegraph.schedules.launch)
        m.add(tv[tasks[b].name].start >= tv[tasks[a].name].start)

    groups = chunk_symmetry(problem) if symmetry and not problem.launch else None
    if groups:
        firsts = [tv[tasks[g[0]].name].start for g in groups]
        for a, b in zip(firsts, firsts[1:]):
            m.add(a <= b)
        if hint is not None:
            hint = canonical_chunk_order(problem, hint, groups)

    h = CpHandles(model=m, horizon=H, tasks=tv, makespan=mk, barrier=barrier, chunk_groups=groups)
    if objective == "peak_memory" or problem.memory_budget_bytes is not None:
        _memory(problem, h, peak=objective == "peak_memory", held=held)
    if objective == "makespan":
        m.minimize(mk)
    else:
        m.minimize(h.peak)
    if hint is not None:
        _add_hint(problem, h, hint)
    return h


def _sm_constraints(problem: Problem, m: cp_model.CpModel, tv: dict[str, TaskVars]) -> None:
    """At every instant the SMs of running nodes sum to <= sm_count.

    A compute mode leaving r SMs to collectives conflicts exactly with collectives holding
    more than r. For each budget b a collective may hold and each comm stream, NoOverlap over
    {compute modes with r < b} + {that stream's collective modes with budget >= b} forbids
    exactly those pairs (compute-compute
    and same-stream collective pairs never overlap anyway). With one comm stream that is the
    whole constraint; with several, collectives on different streams add up, so an
    AddCumulative with capacity sm_count is added as well.
    """
    S = problem.sm_count
    runs = [(t, mode, iv) for t in problem.tasks for mode, iv in zip(t.modes, tv[t.name].mode_runs)
            if mode.ticks > 0 and iv is not None]
    budgets = sorted({mode.sm for t, mode, _ in runs if t.kind == "comm" and mode.sm > 0})
    # one NoOverlap per (budget, comm stream): collectives on different streams may run together
    # (their SMs add up in the cumulative below); one group over all streams forbade that
    for b in budgets:
        for stream in problem.streams[1:]:
            group = [iv for t, mode, iv in runs if (t.kind == "compute" and S - mode.sm < b)
                     or (t.kind == "comm" and t.stream == stream and mode.sm >= b)]
            if any(t.kind == "comm" and t.stream == stream and mode.sm >= b for t, mode, _ in runs) and len(group) > 1:
                m.add_no_overlap(group)
    if len(problem.streams) > 2:
        held = [(iv, mode.sm) for _, mode, iv in runs if mode.sm > 0]
        if held and sum(d for _, d in held) > S:
            m.add_cumulative([iv for iv, _ in held], [d for _, d in held], S)


def _task_vars(m: cp_model.CpModel, t: Task, start, lo: int, hi: int) -> TaskVars:
    n = t.name
    if len(t.modes) == 1:
        ticks = t.modes[0].ticks
        run = m.new_fixed_size_interval_var(start, ticks, f"run[{n}]") if ticks > 0 else None
        return TaskVars(start, start + ticks, run, [m.new_constant(1)], [run])
    lits = [m.new_bool_var(f"mode[{n}={mode.sm}{'/alone' if mode.alone else ''}]") for mode in t.modes]
    m.add_exactly_one(lits)
    sizes = sorted({mode.ticks for mode in t.modes})
    size = m.new_int_var_from_domain(cp_model.Domain.from_values(sizes), f"size[{n}]")
    m.add(size == sum(mode.ticks * lit for mode, lit in zip(t.modes, lits)))
    end = m.new_int_var(lo + sizes[0], hi + sizes[-1], f"end[{n}]")
    run = m.new_interval_var(start, size, end, f"run[{n}]")
    mode_runs = [m.new_optional_fixed_size_interval_var(start, mode.ticks, lit,
                                                        f"run[{n}@{mode.sm}{'/alone' if mode.alone else ''}]")
                 for mode, lit in zip(t.modes, lits)]
    return TaskVars(start, end, run, lits, mode_runs)


def _memory(problem: Problem, h: CpHandles, *, peak: bool, held: Held | None = None) -> None:
    """live[v] for every memory value under one AddCumulative (module doc). With ``held``,
    the values are held.problem's: a task outside the model contributes its start or end as a
    constant, so a value between two held tasks is dead by ``held.since`` (every held task
    ends by then) and left out, and the budget is held.problem's."""
    m, tv = h.model, h.tasks
    full = problem if held is None else held.problem
    tasks = full.tasks
    unit = _memory_unit(full)
    h.memory_unit = unit
    inside = set(range(len(tasks))) if held is None else set(held.keep)
    ends_held = None if held is None else solution_ends(full, held.solution)

    def start_of(i: int) -> cp_model.LinearExprT:
        return tv[tasks[i].name].start if i in inside else held.solution.start[i]

    def end_of(i: int) -> cp_model.LinearExprT:
        return tv[tasks[i].name].end if i in inside else ends_held[i]

    barrier, span = h.barrier, h.makespan
    if held is not None:  # the full step's barrier and makespan also count the held tasks' ends
        outside = [i for i in range(len(tasks)) if i not in inside]
        barrier = _max_of(m, h.barrier, [ends_held[i] for i in outside if tasks[i].side == 0], "barrier[all]")
        span = _max_of(m, h.makespan, [ends_held[i] for i in outside], "makespan[all]")
    ivs, dem = [], []
    for v in full.mem_values:
        if v.start == "producer":
            s = start_of(v.producer)
        elif v.start == "zero":
            s = 0
        elif v.start == "barrier":
            s = barrier
        else:
            raise ScheduleError(f"memory value {v.name!r} has start {v.start!r}, not producer, zero or barrier")
        ends = [end_of(i) for i in v.ends]
        if v.until_makespan:
            e = span
        elif held is not None and all(isinstance(x, int) for x in ends):
            if isinstance(s, int):
                continue  # between held tasks, which end by held.since (Held): its bytes are in the held past
            e = max(ends, default=s)  # from the barrier to held ends (empty: an unused input, never live)
        else:  # functionally determined, so the search never branches on it
            if held is not None:  # the held ends folded into one constant
                fixed = [x for x in ends if isinstance(x, int)]
                ends = [x for x in ends if not isinstance(x, int)] + ([max(fixed)] if fixed else [])
            e = m.new_int_var(0, h.horizon, f"live_end[{v.name}]")
            m.add_max_equality(e, ends)
        size = m.new_int_var(0, h.horizon, f"live_size[{v.name}]")
        ivs.append(m.new_interval_var(s, size, e, f"live[{v.name}]"))
        h.live_end[v.name] = e
        dem.append(v.nbytes // unit)
    total = sum(dem)
    if peak:
        h.peak = m.new_int_var(0, total, "peak_memory")
        if ivs:
            m.add_cumulative(ivs, dem, h.peak)
    else:
        cap = full.memory_budget_bytes // unit
        if ivs and total > cap:
            m.add_cumulative(ivs, dem, cap)


def _max_of(m: cp_model.CpModel, var: cp_model.IntVar, consts: list[int], name: str) -> cp_model.IntVar:
    """max(var, *consts): ``var`` itself when no constant exceeds its lower bound."""
    domain = list(var.proto.domain)  # the proto's repeated field has no negative indexing
    lo, hi = domain[0], domain[-1]
    if max(consts, default=lo) <= lo:
        return var
    v = m.new_int_var(max(consts), max(hi, *consts), name)
    m.add_max_equality(v, [var, max(consts)])
    return v


def _add_hint(problem: Problem, h: CpHandles, sol: Solution) -> None:
    m, tasks = h.model, problem.tasks
    ends = solution_ends(problem, sol)
    span, barrier = makespan_ticks(problem, sol), barrier_ticks(problem, sol)
    for t in tasks:
        v = h.tasks[t.name]
        m.add_hint(v.start, sol.start[t.index])
        if len(t.modes) > 1:
            for k, lit in enumerate(v.lits):
                m.add_hint(lit, k == sol.mode[t.index])
            m.add_hint(v.end, ends[t.index])
    m.add_hint(h.makespan, span)
    m.add_hint(h.barrier, barrier)
    for mv in problem.mem_values:
        e = h.live_end.get(mv.name)
        if e is None or mv.until_makespan:
            continue
        m.add_hint(e, max((ends[i] for i in mv.ends), default=0))


SUBSOLVERS = ("no_lp",)
"""The full-problem worker interleaved with CP-SAT's LNS workers (added by default). One is
enough to prove small layers optimal; each extra one takes 1-dtime turns from LNS, which is
what improves large (chunked) layers."""


def _parameters(solver: cp_model.CpSolver, opts: SolverOptions) -> None:
    """Deterministic: interleaved search (subsolvers take turns in fixed-size batches of
    deterministic work, in one thread unless workers > 1), a fixed seed, and a deterministic
    time limit. No LP: on these models the LP workers burnt up to 100x more wall time than
    they reported as deterministic time, and the propagation-only workers plus LNS found
    better schedules (docs/scheduler.md, "Solver parameters")."""
    p = solver.parameters
    p.random_seed = opts.random_seed
    set_time_limit(p, opts.time_limit_s)
    p.num_workers = opts.workers
    p.interleave_search = True
    p.subsolvers.extend(SUBSOLVERS)
    p.linearization_level = 0
    p.log_search_progress = opts.log


def _run(problem: Problem, h: CpHandles, opts: SolverOptions, method: str, *,
         fix_hint: bool = False) -> tuple[CpSatResult, list[int] | None]:
    """One solve; returns the result and the values of every model variable (a complete hint
    for a later stage), or None without a solution."""
    solver = cp_model.CpSolver()
    _parameters(solver, opts)
    solver.parameters.fix_variables_to_their_hinted_value = fix_hint
    t0 = time.perf_counter()
    code = solver.solve(h.model)
    wall = time.perf_counter() - t0
    status = solver.status_name(code)
    dtime = solver.deterministic_time
    cap_hit = (status not in ("OPTIMAL", "INFEASIBLE") and dtime < solver.parameters.max_deterministic_time * 0.999)
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        starts = tuple(int(solver.value(h.tasks[t.name].start)) for t in problem.tasks)
        modes = tuple(next(k for k, lit in enumerate(h.tasks[t.name].lits) if solver.boolean_value(lit))
                      if len(t.modes) > 1 else 0 for t in problem.tasks)
        sol = settle_alone(problem, Solution(method, starts, modes))
        bound = int(math.ceil(solver.best_objective_bound - 1e-6))
        return (CpSatResult(status, sol, int(round(solver.objective_value)), bound, wall, dtime, cap_hit),
                list(solver.response_proto.solution))
    return CpSatResult(status, None, None, 0, wall, dtime, cap_hit), None


def staged_solve(problem: Problem, h: CpHandles, opts: SolverOptions, method: str, objective: cp_model.IntVar,
            hinted: bool) -> CpSatResult:
    """Stage 1: the hint fixed; stage 2: the full search from stage 1's complete solution with
    ``objective <= stage 1's`` (module doc). Without a hint, or with one the model rejects,
    only the full search runs."""
    if not hinted:
        return _run(problem, h, opts, method)[0]
    first, values = _run(problem, h, opts, method, fix_hint=True)
    if first.solution is None:  # the warm start breaks the model (e.g. the memory budget)
        return _run(problem, h, opts, method)[0]
    h.model.clear_hints()
    proto = h.model.proto.solution_hint
    proto.vars.extend(range(len(values)))
    proto.values.extend(values)
    h.model.add(objective <= first.objective)
    second, _ = _run(problem, h, opts, method)
    # stage 1's bound is its fixed objective, not a bound on the problem: only stage 2 proves
    best, status = (second, second.status) if second.solution is not None else (first, "FEASIBLE")
    return CpSatResult(status, best.solution, best.objective, second.bound, first.wall_s + second.wall_s,
                       first.deterministic_time + second.deterministic_time,
                       first.wall_cap_hit or second.wall_cap_hit, first.objective)


def solve(problem: Problem, opts: SolverOptions = SolverOptions(), *, hint: Solution | None = None,
          horizon: int | None = None) -> CpSatResult:
    """Minimise the makespan (within the memory budget, if the problem has one); with a hint,
    never worse than the hint (staged, see the module doc). Without a memory budget the two
    sides of the barrier are solved apart (exact, ``_solve_by_sides``)."""
    sides = sorted({t.side for t in problem.tasks})
    if problem.memory_budget_bytes is None and sides == [0, 1] and SPLIT_AT_BARRIER:
        return _solve_by_sides(problem, opts, hint)
    h = build_model(problem, horizon=horizon, hint=hint)
    return staged_solve(problem, h, opts, "cpsat", h.makespan, hint is not None)


SPLIT_AT_BARRIER = True
"""Solve forward and backward apart when nothing couples them (no memory budget)."""


def side_problem(problem: Problem, side: int) -> tuple[Problem, tuple[int, ...]]:
    """The tasks of one side of the barrier as a Problem of their own (re-indexed; no memory
    values), and the original index of each of its tasks."""
    keep = tuple(t.index for t in problem.tasks if t.side == side)
    return sub_problem(problem, keep), keep


def sub_problem(problem: Problem, keep: tuple[int, ...]) -> Problem:
    """The tasks ``keep`` (original indices, ascending) as a Problem of their own: re-indexed,
    edges to tasks left out dropped, no memory values (the caller accounts for both)."""
    new = {old: i for i, old in enumerate(keep)}
    tasks = tuple(dataclasses.replace(problem.tasks[old], index=i,
                                      preds=tuple(new[p] for p in problem.tasks[old].preds if p in new),
                                      succs=tuple(new[c] for c in problem.tasks[old].succs if c in new))
                  for i, old in enumerate(keep))
    return dataclasses.replace(problem, tasks=tasks, mem_values=(), launch=tuple(new[i] for i in problem.launch if i in new))


def _forward_share(subs: list[tuple[Problem, tuple[int, ...], Solution | None]]) -> float:
    """Forward's fraction of the effort: by the room each side has (warm start minus analytic
    bound), at least 10% each; by task count without a warm start. On mixtral-8x7b chunk=8
    (h800) the forward warm start is 55% above its bound and the backward one 1%: effort by
    task count (37% forward) left the forward search short."""
    if any(h is None for _, _, h in subs):
        total = sum(len(keep) for _, keep, _ in subs)
        return len(subs[0][1]) / total
    room = [max(max(solution_ends(sub, h), default=0) - lower_bound(sub).ticks, 0) for sub, _, h in subs]
    if sum(room) == 0:
        return 0.5
    return min(max(room[0] / sum(room), 0.1), 0.9)


def _solve_by_sides(problem: Problem, opts: SolverOptions, hint: Solution | None) -> CpSatResult:
    """Exact decomposition at the barrier. Every backward node starts after every forward
    node ends, and without a memory budget nothing else links the two sides (streams and SMs
    are never shared across the barrier; backward constraints are unchanged by a shift in
    time). So makespan = forward span + backward span, each minimised on its own: two models of
    about half the size, far easier for CP-SAT than one. Forward gets its share of the effort
    (``_forward_share``), backward the rest."""
    barrier = barrier_ticks(problem, hint) if hint is not None else 0
    n = len(problem.tasks)
    start, mode = [0] * n, [0] * n
    subs = []
    for side in (0, 1):
        sub, keep = side_problem(problem, side)
        sub_hint = None
        if hint is not None:
            shift = barrier if side == 1 else 0
            sub_hint = Solution(hint.method, tuple(hint.start[i] - shift for i in keep), tuple(hint.mode[i] for i in keep))
        subs.append((sub, keep, sub_hint))
    forward_share = _forward_share(subs)
    parts: list[CpSatResult] = []
    offset = 0
    for side, (sub, keep, sub_hint) in enumerate(subs):
        # backward gets the rest, including what forward left unused by proving its optimum
        # early (deterministic time, so still reproducible)
        used = sum(r.deterministic_time for r in parts) / DTIME_PER_SECOND
        share = max(opts.time_limit_s * forward_share if side == 0 else opts.time_limit_s - used, 1e-3)
        h = build_model(sub, hint=sub_hint,
                        horizon=max(solution_ends(sub, sub_hint), default=0) if sub_hint is not None else None)
        r = staged_solve(sub, h, dataclasses.replace(opts, time_limit_s=share), "cpsat", h.makespan, sub_hint is not None)
        parts.append(r)
        if r.solution is None:
            break
        for j, i in enumerate(keep):
            start[i], mode[i] = r.solution.start[j] + offset, r.solution.mode[j]
        offset = max(solution_ends(sub, r.solution), default=0)
    wall = sum(r.wall_s for r in parts)
    dtime = sum(r.deterministic_time for r in parts)
    cap = any(r.wall_cap_hit for r in parts)
    if len(parts) < 2 or any(r.solution is None for r in parts):
        status = next(r.status for r in parts if r.solution is None)
        return CpSatResult(status, None, None, 0, wall, dtime, cap)
    status = "OPTIMAL" if all(r.status == "OPTIMAL" for r in parts) else "FEASIBLE"
    sol = Solution("cpsat", tuple(start), tuple(mode))
    hint_obj = (sum(r.hint_objective for r in parts)
                if all(r.hint_objective is not None for r in parts) else None)
    return CpSatResult(status, sol, sum(r.objective for r in parts), sum(r.bound for r in parts), wall, dtime, cap,
                       hint_obj)


def min_peak_memory(problem: Problem, opts: SolverOptions = SolverOptions(), *,
                    hint: Solution | None = None) -> tuple[CpSatResult, int]:
    """Minimise peak live bytes ignoring the makespan. Returns (result in memory units, unit)."""
    h = build_model(problem, hint=hint, objective="peak_memory")
    return staged_solve(problem, h, opts, "min-peak-memory", h.peak, hint is not None), h.memory_unit
