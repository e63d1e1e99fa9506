"""The window search (moegraph.schedules.lns) on a merged micro-batch step small enough to solve
exactly: it must beat a warm start known to be suboptimal, never go below the proven optimum,
reach that optimum when one window holds every task, and give a file the verifier accepts. Under
a memory budget a window's model holds the tasks outside it as fixed memory demand: every
window result stays within the budget (verify_schedule), and the model stays window-sized."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moegraph.passes.stack import stack_layers
from moegraph.ir import OpKind, Role, Strategy, verify
from moegraph.passes.microbatch import merge_microbatches
from moegraph.registry import load_model
from moegraph.schedules import api, lns
from moegraph.schedules.api import build_schedule, compile_graph
from moegraph.schedules.baselines import sequential
from moegraph.schedules.bound import lower_bound
from moegraph.schedules.cpsat import SolverOptions, solve
from moegraph.schedules.problem import ScheduleError, build_problem
from moegraph.schedules.solution import makespan_ticks, peak_memory_bytes
from moegraph.schedules.verify import verify_schedule
from moegraph.tracer import trace_model
from helpers import flat_h800
from moegraph.cost import CostModel
from schedules_fakes import B, GRAD, PARAM, PGRAD, MiniBuilder

COST = CostModel(flat_h800())   # the constant efficiencies the hand counts below were made with (issue 29)


def _ag_rs_layer(n: int = 8, T: int = 1024, h: int = 2048):
    """fc1 -> all-gather -> fc2 -> reduce-scatter and its backward (dgrad/wgrad split): 4 GEMMs
    and 4 collectives per micro-batch, a layer whose output has its input's shape (stackable)."""
    g = MiniBuilder("ag_rs_layer", n)
    x, w1, w2 = g.inp("x", (T, h)), g.inp("w1", (h, h), PARAM), g.inp("w2", (h, h), PARAM)
    y = g.gemm("fc1", x, w1, g.val("y", (T, h)), T, h, h)
    y_ag = g.comm("ag", OpKind.ALL_GATHER, y, g.val("y_ag", (T * n, h)))
    z_ag = g.gemm("fc2", y_ag, w2, g.val("z_ag", (T * n, h)), T * n, h, h)
    z = g.comm("rs", OpKind.REDUCE_SCATTER, z_ag, g.val("z", (T, h)))
    dz = g.inp("dz", (T, h), GRAD)
    dz_ag = g.comm("rs.bwd", OpKind.ALL_GATHER, dz, g.val("dz_ag", (T * n, h), GRAD), B, Role.DGRAD)
    dy_ag = g.gemm("fc2.dgrad", dz_ag, w2, g.val("dy_ag", (T * n, h), GRAD), T * n, h, h, B, Role.DGRAD)
    dw2 = g.gemm("fc2.wgrad", y_ag, dz_ag, g.val("dw2", (h, h), PGRAD), h, T * n, h, B, Role.WGRAD)
    dy = g.comm("ag.bwd", OpKind.REDUCE_SCATTER, dy_ag, g.val("dy", (T, h), GRAD), B, Role.DGRAD)
    dx = g.gemm("fc1.dgrad", dy, w1, g.val("dx", (T, h), GRAD), T, h, h, B, Role.DGRAD)
    dw1 = g.gemm("fc1.wgrad", x, dy, g.val("dw1", (h, h), PGRAD), h, T, h, B, Role.WGRAD)
    g.outputs += [z, dx, dw1, dw2]
    g.saved |= {x, y_ag}
    return verify(dataclasses.replace(g.build(), grads=(("w1", dw1), ("w2", dw2))))


@pytest.fixture(scope="module")
def merged():
    p = build_problem(merge_microbatches(_ag_rs_layer(), 2), COST)
    assert len(p.tasks) == 20
    return p


def _optimum(p) -> int:
    # 10 deterministic s: proven optimal since reduce-scatters lost their copy-engine mode (5 s stops FEASIBLE)
    r = solve(p, SolverOptions(time_limit_s=10))
    assert r.status == "OPTIMAL"
    return r.objective


def test_windows_cover_every_rank_from_the_end():
    assert lns.windows(20, 8) == [(12, 20), (8, 16), (4, 12), (0, 8)]
    assert lns.windows(5, 8) == [(0, 5)]
    with pytest.raises(ScheduleError, match="at least 2"):
        lns.windows(5, 1)


def test_window_search_beats_a_suboptimal_warm_start(merged):
    p = merged
    warm = sequential(p)
    # by hand: sequential runs every task alone, one after another
    assert makespan_ticks(p, warm) == sum(t.modes[t.default_mode].ticks for t in p.tasks) == 243_512
    best = _optimum(p)
    # by hand: the 8 collectives (22,021 ticks each at their fastest) share one stream, the
    # first waits for an fc1, the last is followed by an fc1 backward (1,559 each)
    assert best >= 8 * 22_021 + 2 * 1_559
    assert best < makespan_ticks(p, warm)           # the warm start is suboptimal
    r = lns.improve(p, warm, SolverOptions(time_limit_s=1), size=8, share=4, effort_s=1)
    assert r.windows == 4 and r.improved >= 1
    span = makespan_ticks(p, r.solution)
    assert best <= span < makespan_ticks(p, warm)
    again = lns.improve(p, warm, SolverOptions(time_limit_s=1), size=8, share=4, effort_s=1)
    assert again.solution == r.solution                 # deterministic
    schedule = build_schedule(p, r.solution, lower_bound(p), {}, {})
    assert verify_schedule(schedule) == []
    # one window holding every task is the full model from the warm start: the optimum
    whole = lns.improve(p, warm, SolverOptions(time_limit_s=5), size=len(p.tasks), share=1, effort_s=5)
    assert makespan_ticks(p, whole.solution) == best


@pytest.mark.slow
def test_compile_runs_the_window_search_on_merged_steps(monkeypatch):
    monkeypatch.setattr(api, "LNS_MIN_TASKS", 0)   # the traced tiny model's merged step: 107 tasks
    graph = stack_layers(trace_model(load_model("tiny"), Strategy("sp", "ep", "ag-rs", 2), seq=64), 1)
    r = compile_graph(merge_microbatches(graph, 2), COST, time_limit_s=0.2)
    solver = r.schedule.summary["solver"]
    assert r.status == "FEASIBLE" and solver["lns"]["windows"] == 1
    assert r.schedule.summary["makespan_us"] == solver["makespan_us"] <= solver["lns"]["makespan_before_us"]
    assert verify_schedule(r.schedule) == []


@pytest.mark.slow
def test_compile_runs_the_window_search_under_a_memory_budget(monkeypatch):
    """compile_graph under a budget (the sequential baseline's peak on the tiny model's merged step)
    runs the window search too, and its schedule verifies within the budget."""
    monkeypatch.setattr(api, "LNS_MIN_TASKS", 0)
    graph = merge_microbatches(stack_layers(trace_model(load_model("tiny"), Strategy("sp", "ep", "ag-rs", 2), seq=64), 1), 2)
    budget = peak_memory_bytes(build_problem(graph, COST), sequential(build_problem(graph, COST)))
    r = compile_graph(graph, COST, time_limit_s=0.2, memory_budget_bytes=budget)
    solver = r.schedule.summary["solver"]
    assert solver["lns"]["windows"] == 1
    assert r.schedule.summary["makespan_us"] <= solver["lns"]["makespan_before_us"]
    assert r.schedule.summary["peak_memory_bytes"] <= budget
    assert verify_schedule(r.schedule) == []


def _verified(p, sol) -> list[str]:
    return verify_schedule(build_schedule(p, sol, lower_bound(p), {}, {}))


def test_window_search_keeps_the_memory_budget(merged):
    warm = sequential(merged)
    budget = peak_memory_bytes(merged, warm)
    opts = SolverOptions(time_limit_s=1)
    free = lns.improve(merged, warm, opts, size=8, share=4, effort_s=1)
    assert peak_memory_bytes(merged, free.solution) > budget       # without it the budget would break
    p = build_problem(merged.graph, COST, memory_budget_bytes=budget)
    r = lns.improve(p, warm, opts, size=8, share=4, effort_s=1)
    assert peak_memory_bytes(p, r.solution) <= budget
    assert makespan_ticks(p, r.solution) < makespan_ticks(p, warm)
    assert _verified(p, r.solution) == []


@pytest.mark.slow
def test_every_window_under_a_budget_verifies_and_one_needs_the_held_memory(merged):
    """Each window of the sequential schedule re-solved on its own, under a budget just above
    its peak: every result is a schedule of the whole step the verifier accepts (budget
    included). In some window the same re-solve without the budget goes above it, so there the
    held tasks' memory is what the window must respect, and some window still improves."""
    warm = sequential(merged)
    budget = peak_memory_bytes(merged, warm) + 1
    p = build_problem(merged.graph, COST, memory_budget_bytes=budget)
    opts = SolverOptions(time_limit_s=0.5)
    needed = improved = 0
    for lo, hi in lns.windows(len(p.tasks), 8):
        nb = lns.neighbourhood(p, warm, lo, hi)
        assert lo == 0 or len(nb.keep) < len(p.tasks)          # not the whole model
        r = lns._window(p, warm, lo, hi, opts)
        assert r.solution is not None                          # the incumbent is feasible in it
        assert _verified(p, r.solution) == []
        assert peak_memory_bytes(p, r.solution) <= budget
        assert makespan_ticks(p, r.solution) <= makespan_ticks(p, warm)
        improved += makespan_ticks(p, r.solution) < makespan_ticks(p, warm)
        free = lns._window(merged, warm, lo, hi, opts)
        needed += peak_memory_bytes(merged, free.solution) > budget
    assert needed >= 1 and improved >= 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lo=st.integers(0, 18), width=st.integers(2, 10), slack=st.integers(0, 3))
def test_random_windows_never_break_the_budget(merged, lo, width, slack):
    """Random windows, random warm starts (the best sequential or a CP-SAT window's result),
    budgets from the incumbent's peak up: the verifier never rejects a window's result."""
    warm = sequential(merged)
    unit = 2 ** 20
    budget = peak_memory_bytes(merged, warm) + slack * unit
    p = build_problem(merged.graph, COST, memory_budget_bytes=budget)
    hi = min(lo + width, len(p.tasks))
    r = lns._window(p, warm, lo, hi, SolverOptions(time_limit_s=0.2))
    assert r.solution is not None
    assert peak_memory_bytes(p, r.solution) <= budget
    assert _verified(p, r.solution) == []


def test_window_model_under_a_budget_is_window_sized():
    """A merged tiny-model step (M=4) under a budget: the last window's model holds about the
    window's tasks, not the step's, and it carries the memory cumulative."""
    graph = stack_layers(trace_model(load_model("tiny"), Strategy("sp", "ep", "ag-rs", 2), seq=64), 1)
    merged = merge_microbatches(graph, 4)
    free = build_problem(merged, COST)
    warm = sequential(free)
    budget = peak_memory_bytes(free, warm)
    p = build_problem(merged, COST, memory_budget_bytes=budget)
    n, size = len(p.tasks), 20
    assert n >= 150
    for lo, hi in lns.windows(n, size)[:2]:
        nb = lns.neighbourhood(p, warm, lo, hi)
        assert len(nb.keep) <= 2 * (n - lo) and len(nb.keep) <= n // 3
        assert nb.keep == lns.neighbourhood(free, warm, lo, hi).keep    # as small as without a budget
        live = [c for c in nb.handles.model.proto.constraints if c.name.startswith("live[")]
        assert live and len(live) < len(p.mem_values)      # held values dead before the window left out


def test_held_refuses_a_held_task_running_past_since(merged):
    """cpsat.Held's contract: every held task ends by ``since`` (the window search holds only
    tasks ended by its window's first start), so a value between held tasks is dead there and
    left out of the model. A task still running at ``since`` outside ``keep`` is refused, naming it."""
    from moegraph.schedules.cpsat import Held
    from moegraph.schedules.solution import solution_ends
    warm = sequential(merged)
    ends = solution_ends(merged, warm)
    first = min(range(len(merged.tasks)), key=lambda i: (warm.start[i], i))
    last = max(range(len(merged.tasks)), key=lambda i: (warm.start[i], i))
    since = warm.start[last]
    Held(merged, (last,), warm, since)                               # the others all end by the last start
    t = next(i for i in range(len(merged.tasks)) if i != last and ends[i] > ends[first])
    with pytest.raises(ScheduleError, match=f"held task {merged.tasks[t].name!r} ends after Held.since"):
        Held(merged, (last,), warm, ends[first])
