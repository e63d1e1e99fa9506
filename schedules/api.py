"""compile_graph: Graph + CostModel -> a verified-by-construction Schedule (what the CLI calls).

Every call builds the Problem once, runs the three baselines and the lower bound (so every
schedule file carries them), then either returns a baseline (method != "cpsat") or solves
with CP-SAT warm-started from the best baseline that fits the memory budget. CP-SAT's own
result is never worse than that warm start (a staged solve, moegraph.schedules.cpsat), and the
file reports it apart from the returned schedule: ``summary.solver`` holds the solver's status,
its own makespan and the warm start it began from; ``summary.method`` (``source`` in
``compile --json``) names where the returned schedule came from: ``cpsat`` only when the solver
beat its warm start, else the warm start itself (its method, e.g. ``sequential``; the status
says CP-SAT found nothing better, or no schedule, within its effort). On a large
merged micro-batch step the solver's result then goes through the window search
(moegraph.schedules.lns; ``summary.solver.lns``), never worse, within the memory budget if any.

Under a memory budget the schedule compiled without one (same method and effort) comes first:
if it fits, it is returned (recording the budget), so a budget that does not bind never makes
the step slower. Only a binding budget is solved with the memory constraint.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

from moegraph.cost import CostModel
from moegraph.ir import Graph, Strategy
from moegraph.options import format_bytes, format_bytes_apart
from moegraph.config import LAUNCH_ORDERS, METHODS, STEP_METHODS, LaunchOrder
from moegraph.layers import LayerKinds, costed_kinds, layer_count
from moegraph.microbatch import micro_batch_count
from moegraph.passes.stack import stack_kinds
from moegraph.schedules import lns
from moegraph.schedules.baselines import BASELINES, MICROBATCH_BASELINES, baselines_for, warm_starts
from moegraph.schedules.bound import Bound, lower_bound, memory_lower_bound
from moegraph.schedules.cpsat import CpSatResult, SolverOptions, min_peak_memory, solve
from moegraph.schedules.dp_order import dp_warm_starts
from moegraph.schedules.launch import follows_launch, with_launch_order
from moegraph.schedules.periodic import (SLIDE_ORDERS, Carry, alike_edge_collectives, can_slide, carrying_problem, is_stack,
                                         tile_layers)
from moegraph.schedules.problem import DEFAULT_COMM_STREAMS, MemoryBudgetError, Problem, ScheduleError, build_problem
from moegraph.schedules.solution import (Solution, barrier_ticks, check_solution, makespan_ticks, peak_memory_bytes,
                                         solution_ends)
from moegraph.schedules.schedule_file import Schedule, ScheduledNode, ScheduledValue, exposed_comm, graph_header, round_us
from moegraph.strategy import node_fields

__all__ = ["CompileResult", "compile_graph", "compile_problem", "METHODS", "MICROBATCH_METHODS", "build_schedule", "strategy_label",
           "list_warm_starts"]

MICROBATCH_METHODS = STEP_METHODS
"""Methods for a merged micro-batch step graph only (moegraph.microbatch): the paired baselines."""
if set(METHODS) != {"cpsat", *BASELINES} or set(STEP_METHODS) != set(MICROBATCH_BASELINES):
    # the method names CompileConfig offers (moegraph.config) are the ones implemented here
    raise ImportError(f"moegraph.config's methods {METHODS + STEP_METHODS} differ from the schedulers "
                      f"{('cpsat', *BASELINES, *MICROBATCH_BASELINES)}")
_BASELINE_ORDER = ("megascale", "greedy", "sequential")  # tie-break among equally good baselines
_log = logging.getLogger(__name__)   # progress of long solves (compile prints it on stderr)


@dataclass(frozen=True)
class CompileResult:
    schedule: Schedule
    wall_s: float
    """Seconds spent in compile_graph (not in the file: it varies between runs)."""
    status: str
    """OPTIMAL / FEASIBLE (CP-SAT's status; when it did not beat its warm start, followed by
    ", CP-SAT found nothing better in T s" or ", CP-SAT found no schedule in T s" and the warm
    start is the source), or BASELINE for method != 'cpsat'; "; no budget needed: ..." when the
    schedule compiled without the memory budget fits it."""
    wall_cap_hit: bool = False
    """The wall-clock safety cap (cpsat.WALL_CAP_FACTOR) stopped the search before its
    deterministic limit: the result may then differ between runs."""

    @property
    def source(self) -> str:
        """Where the returned schedule came from: 'cpsat' (CP-SAT beat its warm start), else the
        warm start's name (a baseline, a list or periodic schedule), or 'min-peak-memory'."""
        return self.schedule.summary["method"]


def strategy_label(s: Strategy) -> str:
    return (f"attn={s.attn} ffn={s.ffn} dispatch={s.dispatch} n={s.n} chunks={s.chunks} remat={s.remat} "
            f"dtype={s.dtype}" + node_fields(s))


def compile_graph(graph: Graph, cost: CostModel, *, memory_budget_bytes: int | None = None, time_limit_s: float = 10.0,
                  comm_streams: Sequence[str] = DEFAULT_COMM_STREAMS, method: str = "cpsat",
                  workers: int = 1, launch_order: LaunchOrder = "free") -> CompileResult:
    """Schedule one layer graph. method: one of METHODS. time_limit_s: CP-SAT search effort
    (deterministic seconds, see moegraph.schedules.cpsat); under a memory budget that binds, two
    solves of it (compile_problem). launch_order: "free" (a hardware queue per stream), or one
    queue fed in a fixed order (moegraph.schedules.launch). Raises ScheduleError (MemoryBudgetError
    for a budget no schedule meets) on expected failures."""
    t0 = time.perf_counter()
    if method not in METHODS + MICROBATCH_METHODS:
        raise ScheduleError(f"method={method!r} is not one of {', '.join(METHODS + MICROBATCH_METHODS)}")
    if launch_order not in LAUNCH_ORDERS:
        raise ScheduleError(f"launch_order={launch_order!r} is not one of {', '.join(LAUNCH_ORDERS)}")
    opts = SolverOptions(time_limit_s=time_limit_s, workers=workers)
    problem = build_problem(graph, cost, comm_streams=comm_streams, memory_budget_bytes=memory_budget_bytes)
    if launch_order != "free":
        problem = with_launch_order(problem, launch_order)
    schedule, status, cap_hit = compile_problem(problem, method, opts)
    return CompileResult(schedule, time.perf_counter() - t0, status, cap_hit)


def compile_problem(problem: Problem, method: str, opts: SolverOptions) -> tuple[Schedule, str, bool]:
    """(schedule, status, wall-clock cap hit) for one method on a built Problem. Under a memory
    budget, the CP-SAT schedule compiled without it when that one fits (module doc)."""
    budget = problem.memory_budget_bytes
    least = None if budget is None else check_memory_bound(problem)   # a budget below it: no work
    free_cap_hit = False
    # the periodic warm starts (CP-SAT on 1- and 2-layer units, built without a budget) are the
    # same for both solves below: computed once
    # (not under one hardware queue: a tiled unit ignores the step's launch order)
    periodic = _periodic(problem, opts) if method == "cpsat" and is_stack(problem.graph) and not problem.launch else []
    if budget is not None:
        if method == "cpsat":     # the baselines ignore the budget: nothing to gain from a second run
            free, status, free_cap_hit = _compile(dataclasses.replace(problem, memory_budget_bytes=None), method,
                                                  opts, periodic=periodic)
            if free.summary["peak_memory_bytes"] <= budget:
                return (dataclasses.replace(free, memory_budget_bytes=budget).with_hash(),
                        f"{status}; no budget needed: the schedule without one peaks at "
                        f"{format_bytes(free.summary['peak_memory_bytes'])}", free_cap_hit)
    schedule, status, cap_hit = _compile(problem, method, opts, least, periodic=periodic)
    # either solve stopped by the wall-clock cap may have changed which one is returned
    return schedule, status, cap_hit or free_cap_hit


def check_memory_bound(problem: Problem) -> int:
    """The sound lower bound on ``problem``'s peak memory (bound.memory_lower_bound); raises
    MemoryBudgetError (proven) when it exceeds the memory budget: no schedule fits."""
    least, why = memory_lower_bound(problem)
    budget = problem.memory_budget_bytes
    if budget is not None and least > budget:
        shown = format_bytes_apart(budget, least)
        raise MemoryBudgetError(f"memory budget {shown[0]} is below the least feasible peak memory "
                                f"{shown[1]} for this graph (a sound lower bound: {why})", least, True)
    return least


def _compile(problem: Problem, method: str, opts: SolverOptions, least: int | None = None, *,
             periodic: Sequence[Solution] = ()) -> tuple[Schedule, str, bool]:
    """compile_problem's work for the budget ``problem`` holds (None: none); ``least``: the
    memory bound check_memory_bound found (given with a budget); ``periodic``: the stack's
    periodic warm starts (``_periodic``), computed once by the caller."""
    bound = lower_bound(problem)
    budget = problem.memory_budget_bytes
    if method in MICROBATCH_BASELINES and method not in baselines_for(problem):
        raise ScheduleError(f"method={method!r} pairs micro-batches: it needs --micro-batches M >= 2")
    base = {name: fn(problem) for name, fn in baselines_for(problem).items()}
    # under one hardware queue a baseline whose start order breaks the launch order is no
    # schedule of this problem (sequential under "megatron-1f1b"): left out
    base = {name: s for name, s in base.items() if follows_launch(problem, s.start) is None}
    if method != "cpsat" and method not in base:
        raise ScheduleError(f"the {method} baseline does not start its kernels in launch order {problem.launch_order!r}")
    span = {name: makespan_ticks(problem, s) for name, s in base.items()}
    peak = {name: peak_memory_bytes(problem, s) for name, s in base.items()}
    fits = {name: budget is None or peak[name] <= budget for name in base}
    solver_info: dict[str, Any] = {"status": "NOT_RUN", "objective_bound_us": None, "makespan_us": None,
                                   "warm_start": None, "warm_start_makespan_us": None}

    if method != "cpsat":
        if not fits[method]:
            shown = format_bytes_apart(peak[method], budget, least)
            raise MemoryBudgetError(f"the {method} schedule peaks at {shown[0]}, above the memory budget {shown[1]} "
                                    f"(the least feasible peak is at least {shown[2]}); method='cpsat' schedules "
                                    f"within the budget", least, False)
        return build_schedule(problem, base[method], bound, dict(span), solver_info), "BASELINE", False

    # Warm start: the shortest schedule within the budget among the baselines and extra list
    # schedules (copy-engine collectives; memory-checked ones under a budget), and on a stack
    # of layers 1- and 2-layer CP-SAT schedules tiled over the layers (moegraph.schedules.periodic).
    cands = {n: base[n] for n in (*_BASELINE_ORDER, *(n for n in base if n not in _BASELINE_ORDER))}
    extra = [s for s in list_warm_starts(problem, budget) + list(periodic) if follows_launch(problem, s.start) is None]
    for s in extra:
        cands[s.method] = s
        span[s.method], peak[s.method] = makespan_ticks(problem, s), peak_memory_bytes(problem, s)
        fits[s.method] = budget is None or peak[s.method] <= budget
    order = list(cands)
    ok = [n for n in order if fits[n]]
    best = min(ok, key=lambda n: (span[n], order.index(n))) if ok else None
    hint_name = best or min(order, key=lambda n: (span[n], order.index(n)))
    _log.info("CP-SAT on %d tasks, effort %g s, from the %s schedule (%.1f us)", len(problem.tasks),
              opts.time_limit_s, hint_name, round_us(span[hint_name] * problem.tick_us))   # as the summary rounds
    result = solve(problem, opts, hint=cands[hint_name], horizon=span[best] if best else None)
    _log.info("CP-SAT %s%s", result.status, "" if result.solution is None else
              f": {round_us(makespan_ticks(problem, result.solution) * problem.tick_us):.1f} us")
    result, lns_info = _window_search(problem, result, opts)
    solver_info = _solver_info(problem, result, bound, hint_name, span[hint_name]) | lns_info
    if result.solution is not None and (best is None or makespan_ticks(problem, result.solution) < span[best]):
        sol, status = result.solution, result.status
    elif best is not None:
        # CP-SAT did not beat its warm start (or, when the model rejected the hint, found
        # nothing): the warm start itself is returned, under its own name, never as "cpsat"
        found = "nothing better" if result.solution is not None else "no schedule"
        sol, status = cands[best], f"{result.status}, CP-SAT found {found} in {opts.time_limit_s:g} s"
    else:
        sol, status = _memory_fallback(problem, opts, result, cands, peak)
    if result.wall_cap_hit:
        status += " (wall-clock cap hit)"
    schedule = build_schedule(problem, sol, bound, {n: span[n] for n in base}, solver_info)
    return schedule, status, result.wall_cap_hit


def list_warm_starts(problem: Problem, budget: int | None = None) -> list[Solution]:
    """Every list-schedule warm start: the DP-aware rules (schedules.dp_order), then
    baselines.warm_starts' (copy-engine, memory-checked and interleaved rules)."""
    return [*dp_warm_starts(problem, budget), *warm_starts(problem, budget)]


LNS_MIN_TASKS = 400
"""Merged micro-batch step graphs of at least this many tasks get the window search
(moegraph.schedules.lns) after the full-model solve: below it the full model is small enough
for CP-SAT's own search (and the small graphs of the test suite keep their quick solves). Under
a memory budget too: a window's model holds the tasks outside it with their live values as
fixed demand (cpsat.Held), so it stays the size of a window without a budget."""


def _window_search(problem: Problem, result: CpSatResult, opts: SolverOptions) -> tuple[CpSatResult, dict[str, Any]]:
    """On a large merged micro-batch step, CP-SAT's full-model result improved window by window
    (``lns.improve``; never worse). Returns the result to report and ``summary.solver.lns``."""
    if (result.solution is None or result.status == "OPTIMAL" or micro_batch_count(problem.graph) < 2
            or len(problem.tasks) < LNS_MIN_TASKS or problem.launch):    # windows ignore the launch order
        return result, {}
    before = makespan_ticks(problem, result.solution)
    r = lns.improve(problem, result.solution, opts)
    after = makespan_ticks(problem, r.solution)
    info = {"lns": {"windows": r.windows, "improved": r.improved,
                    "makespan_before_us": round_us(before * problem.tick_us)}}
    return dataclasses.replace(result, solution=r.solution, objective=after, wall_s=result.wall_s + r.wall_s,
                               deterministic_time=result.deterministic_time + r.deterministic_time,
                               wall_cap_hit=result.wall_cap_hit or r.wall_cap_hit), info


def _periodic(problem: Problem, opts: SolverOptions) -> list[Solution]:
    """Periodic warm starts for a stack of L layers: for each unit of K layers (K = u * P for u in
    UNIT_LAYERS, P the period of the layer kinds' pattern: 1 for identical layers) dividing L
    (K < L), the stack of the unit's K layers solved by CP-SAT (from its best list schedule, no
    memory budget: each candidate's peak is checked against the budget like every warm start's)
    and tiled over the L layers (moegraph.schedules.periodic). Each unit solve gets LAYER_SHARE of
    the effort; deterministic, so the candidates are too. A pattern that does not repeat (dense
    first layers: P = L) gives none."""
    kinds = costed_kinds(problem.graph)   # the stack's layers, aux-loss routers included
    L, P = layer_count(problem.graph), kinds.period()
    units = [u * P for u in UNIT_LAYERS if not L % (u * P) and u * P < L]
    _log.info("periodic warm starts for %d layers (kinds repeat every %d): CP-SAT on %s-layer units, effort %g s "
              "each", L, P, " and ".join(map(str, units)) or "no", opts.time_limit_s * LAYER_SHARE)
    out: list[Solution] = []
    smaller: tuple[Problem, Solution] | None = None      # the last unit solved (K ascending)
    for K in units:
        unit = build_problem(stack_kinds(LayerKinds(kinds.graphs, kinds.pattern[:K])) if K > 1 else kinds.graphs[0],
                             problem.cost, comm_streams=problem.streams[1:])
        cands = [*(fn(unit) for fn in BASELINES.values()), *list_warm_starts(unit)]
        if smaller is not None and K % layer_count(smaller[0].graph) == 0:
            # the smaller unit's schedule tiled over this one: CP-SAT starts from it, so the larger
            # unit only adds the overlap between its layers (2 mixtral-8x7b h800 layers from
            # 13,140.3 us tiled instead of 13,683.2 listed: 12,508.4 in the same effort)
            cands.append(tile_layers(unit, *smaller))
        hint = min(cands, key=lambda s: makespan_ticks(unit, s))  # first of equals: deterministic
        r = solve(unit, dataclasses.replace(opts, time_limit_s=opts.time_limit_s * LAYER_SHARE), hint=hint,
                  horizon=makespan_ticks(unit, hint))
        sol = r.solution if r.solution is not None else hint
        smaller = (unit, sol)
        _log.info("periodic warm start: %d-layer unit %s (%.1f us), tiled over %d layers", K, r.status,
                  makespan_ticks(unit, sol) * unit.tick_us, L)
        # with DP collectives also the DP-aware tiling: each period's DP sync slides under the
        # later periods' backward (moegraph.schedules.periodic)
        # (both orders of the slid tasks: neither wins on every step, periodic.SlideOrder)
        variants = [{}] + ([{"dp_slide": True, "slide_order": o} for o in SLIDE_ORDERS] if can_slide(unit) else [])
        carry = _carrying(problem, unit, sol, opts)
        if carry is not None:
            variants.append({"carry": carry})
        for kw in variants:
            tiled = tile_layers(problem, unit, sol, **kw)
            check_solution(problem, tiled)  # feasible by construction; a failure here is a bug
            out.append(tiled)
    return out


def _carrying(problem: Problem, unit: Problem, sol: Solution, opts: SolverOptions) -> Carry | None:
    """The unit's backward carrying one of the stack's alike edge collectives (the head's gradient
    buckets; moegraph.schedules.periodic, "Carried buckets"), solved by CP-SAT from the unit's
    backward with the bucket after it, at the stacked solve's effort; None without such
    collectives, or if carrying one costs the window as much as running it alone."""
    buckets = alike_edge_collectives(problem)
    if not buckets:
        return None
    carrying, hint, slot = carrying_problem(problem, unit, sol, buckets[0])
    check_solution(carrying, hint)          # the unit's backward then the bucket: feasible by construction
    r = solve(carrying, opts, hint=hint, horizon=makespan_ticks(carrying, hint))
    if r.solution is None or makespan_ticks(carrying, r.solution) >= makespan_ticks(carrying, hint):
        return None
    _log.info("carrying unit: %d-layer backward with one edge collective %.1f us (%.1f with it after, alone)",
              layer_count(unit.graph), makespan_ticks(carrying, r.solution) * unit.tick_us,
              makespan_ticks(carrying, hint) * unit.tick_us)
    return Carry(carrying, r.solution, slot, buckets)


UNIT_LAYERS = (1, 2)
"""Layers per tiled unit. One layer is always tiled (makespan exactly L x its schedule); two
let the unit's solve overlap neighbouring layers (mixtral-8x7b h800: 2 layers in 13,108 us at
the default limit vs 2 x 6,834.8 for one layer, docs/scheduler.md)."""
LAYER_SHARE = 2.0
"""Multiple of ``time_limit_s`` given to each unit solve behind the periodic warm starts (on
top of the stacked solve's full limit). The tiled unit is the whole schedule's steady state, so
its quality is what counts at scale: 32 mixtral-8x7b layers on h800 (with main's remat anchors
and collective efficiencies) went from 211,840.2 us at 0.5 and 1.0 to 205,661.3 us at 2.0,
1.059 -> 1.028 of the bound, for 53 s of CPU instead of 34 (docs/scheduler.md)."""


def _solver_info(problem: Problem, r: CpSatResult, bound: Bound, hint: str, hint_ticks: int) -> dict[str, Any]:
    """The solver's own result, whatever schedule is returned."""
    tick = problem.tick_us
    proven = max(r.bound, bound.ticks) if r.solution is not None else bound.ticks
    own = makespan_ticks(problem, r.solution) if r.solution is not None else None
    return {"status": r.status, "objective_bound_us": round_us(proven * tick),
            "makespan_us": None if own is None else round_us(own * tick),
            "warm_start": hint, "warm_start_makespan_us": round_us(hint_ticks * tick)}


def _memory_fallback(problem: Problem, opts: SolverOptions, result: CpSatResult, base: dict[str, Solution],
                     peak: dict[str, int]) -> tuple[Solution, str]:
    """No baseline fits the budget and CP-SAT found no schedule: minimise peak memory instead.
    Either that yields a schedule within the budget, or the error states the least peak."""
    budget = problem.memory_budget_bytes
    order = list(base)
    lowest = min(order, key=lambda n: (peak[n], order.index(n)))
    _log.info("no schedule within the memory budget yet: minimising peak memory (CP-SAT)")
    mp, unit = min_peak_memory(problem, opts, hint=base[lowest])
    if mp.solution is not None:
        found = peak_memory_bytes(problem, mp.solution)
        if found <= budget:
            return mp.solution, f"FEASIBLE (min-peak-memory schedule; makespan search ended {result.status})"
    lo = max(mp.bound * unit, memory_lower_bound(problem)[0])
    if mp.status == "OPTIMAL" and mp.solution is not None:
        least = peak_memory_bytes(problem, mp.solution)
        shown = format_bytes_apart(budget, least)
        raise MemoryBudgetError(f"memory budget {shown[0]} is below the least feasible peak memory {shown[1]} "
                                f"for this graph (proven by a min-peak-memory CP-SAT solve)", least, True)
    hi = peak_memory_bytes(problem, mp.solution) if mp.solution is not None else min(peak.values())
    if result.status == "INFEASIBLE":
        shown = format_bytes_apart(budget, max(lo, budget + 1), hi)
        raise MemoryBudgetError(f"memory budget {shown[0]} is below the least feasible peak memory, which lies "
                                f"between {shown[1]} and {shown[2]} for this graph (CP-SAT proved the "
                                f"budget infeasible; the min-peak-memory solve did not finish in the time limit)",
                                max(lo, budget + 1), False)
    shown = format_bytes_apart(budget, lo, hi)
    raise MemoryBudgetError(f"no schedule within the memory budget {shown[0]} was found in the time limit; the "
                            f"least feasible peak memory lies between {shown[1]} and {shown[2]} for this graph "
                            f"(min-peak-memory CP-SAT solve, not proven); raise time_limit_s or the budget", lo, False)


def build_schedule(problem: Problem, sol: Solution, bound: Bound, baseline_span: dict[str, int],
                   solver_info: dict[str, Any]) -> Schedule:
    """The Schedule of a checked Solution (raises ScheduleError if the solution is broken)."""
    check_solution(problem, sol)
    graph, tick = problem.graph, problem.tick_us
    ends = solution_ends(problem, sol)
    nodes = []
    for t in problem.tasks:
        n, mode = t.node, t.modes[sol.mode[t.index]]
        nodes.append(ScheduledNode(
            name=n.name, op=n.op.value, role=n.role.value, phase=n.phase.value, kind=t.kind,
            inputs=tuple(n.inputs), outputs=tuple(n.outputs), flops=n.flops, mem_bytes=n.mem_bytes,
            comm_bytes=n.comm_bytes, group=n.group, attrs=_attrs(n.attrs), module=n.module, block=n.block,
            forward_of=n.forward_of, stream=t.stream, start_us=round_us(sol.start[t.index] * tick),
            end_us=round_us(ends[t.index] * tick), sm_budget=mode.sm))
    # Only values that exist in a run: graph inputs and node outputs (and what they view). A
    # declared value nothing produces holds no memory and feeds no node; leaving it out keeps
    # the verifier's coverage rule exact (each written value is an input or some node's output).
    produced = {o for n in graph.nodes for o in n.outputs} | set(graph.inputs)
    keep = set(produced)
    for name in produced:
        while graph.value[name].alias_of is not None and graph.value[name].alias_of not in keep:
            name = graph.value[name].alias_of
            keep.add(name)
    values = tuple(ScheduledValue(v.name, v.storage_bytes, v.kind.value, v.alias_of) for v in graph.values
                   if v.name in keep)
    summary = {
        "method": sol.method,
        "strategy": strategy_label(graph.strategy),
        "makespan_us": round_us(makespan_ticks(problem, sol) * tick),
        "lower_bound_us": round_us(bound.ticks * tick),
        "barrier_us": round_us(barrier_ticks(problem, sol) * tick),
        "exposed_comm_us": round_us(sum(e - s for s, e in exposed_comm(nodes))),
        "baselines": {k: round_us(v * tick) for k, v in sorted(baseline_span.items())},
        "peak_memory_bytes": peak_memory_bytes(problem, sol),
        "solver": solver_info,
    }
    if problem.launch_order != "free":
        summary["launch_order"] = problem.launch_order
    return Schedule(
        graph=graph_header(graph),
        hardware=problem.cost.hw.to_dict(), streams=problem.streams,
        memory_budget_bytes=problem.memory_budget_bytes, tick_us=tick, values=values, nodes=tuple(nodes),
        summary=summary).with_hash()


def _attrs(attrs: tuple[tuple[str, Any], ...]) -> dict:
    def thaw(v: Any) -> Any:
        return [thaw(x) for x in v] if isinstance(v, tuple) else v
    return {k: thaw(v) for k, v in attrs}

