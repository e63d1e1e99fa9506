"""Baselines and lower bounds on the same Problem."""

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from moegraph.schedules.baselines import BASELINES, greedy, list_schedule, megascale, sequential, warm_starts
from moegraph.schedules.bound import jackson_preemptive, lower_bound, memory_lower_bound
from moegraph.schedules.problem import build_problem
from moegraph.schedules.solution import check_solution, makespan_ticks, peak_memory_bytes, solution_ends
from schedules_fakes import barrier_graph, cost_model, crossing_graph, moe_layer, tiny_chain

COST = cost_model()
GRAPHS = {"tiny": tiny_chain, "barrier": barrier_graph, "moe": moe_layer,
          "moe_re": lambda: moe_layer(recompute=True), "moe_c3": lambda: moe_layer(chunks=3, recompute=True),
          "crossing": crossing_graph}


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("streams", [("comm",), ("comm.intra", "comm.inter")])
def test_baselines_are_valid_and_above_the_bound(graph, streams):
    p = build_problem(GRAPHS[graph](), COST, comm_streams=streams)
    lb = lower_bound(p).ticks
    spans = {}
    for name, fn in BASELINES.items():
        sol = fn(p)
        check_solution(p, sol)
        spans[name] = makespan_ticks(p, sol)
        assert spans[name] >= lb, name
    assert spans["sequential"] >= max(spans["greedy"], spans["megascale"]) or graph == "crossing"


def test_sequential_overlaps_nothing_and_uses_defaults():
    p = build_problem(moe_layer(recompute=True), COST)
    sol = sequential(p)
    ends = solution_ends(p, sol)
    spans = sorted((sol.start[t.index], ends[t.index]) for t in p.tasks if ends[t.index] > sol.start[t.index])
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert all(sol.mode[t.index] == t.default_mode for t in p.tasks)
    assert makespan_ticks(p, sol) == sum(t.modes[t.default_mode].ticks for t in p.tasks)


def test_greedy_overlaps_collectives_with_compute():
    p = build_problem(moe_layer(chunks=3), COST)
    sol = greedy(p)
    ends = solution_ends(p, sol)
    comm = [(sol.start[t.index], ends[t.index]) for t in p.tasks if t.kind == "comm"]
    comp = [(sol.start[t.index], ends[t.index]) for t in p.tasks
            if t.kind == "compute" and ends[t.index] > sol.start[t.index]]
    assert any(a < d and c < b for a, b in comm for c, d in comp)
    assert makespan_ticks(p, sol) < makespan_ticks(p, sequential(p))


def test_megascale_runs_dgrad_before_wgrad_and_recompute_under_gradient_comm():
    p = build_problem(moe_layer(recompute=True), COST)
    sol = megascale(p)
    by = p.by_name
    # both fc2 gradients wait for the same input; the data gradient (critical path) goes first
    assert sol.start[by["fc2.dgrad"].index] < sol.start[by["fc2.wgrad"].index]
    # recompute runs while the first gradient all-gather is in flight
    ends = solution_ends(p, sol)
    ag = by["rs.bwd"].index
    assert sol.start[by["ln2.re"].index] < ends[ag]


@pytest.mark.parametrize("graph", ["moe_re", "moe_c3"])
def test_memory_aware_schedules_keep_the_budget(graph):
    p0 = build_problem(GRAPHS[graph](), COST)
    worst = max(peak_memory_bytes(p0, f(p0)) for f in BASELINES.values())
    budget = int(worst * 0.9)
    p = build_problem(GRAPHS[graph](), COST, memory_budget_bytes=budget)
    sols = warm_starts(p, budget)
    assert sols
    for s in sols:
        check_solution(p, s)
        assert peak_memory_bytes(p, s) <= budget


def test_copy_engine_warm_starts():
    p = build_problem(moe_layer(chunks=3), COST)
    sols = {s.method: s for s in warm_starts(p)}
    assert set(sols) == {"greedy+ce", "megascale+ce"}
    for s in sols.values():
        check_solution(p, s)
        for t in p.tasks:
            if t.kind == "comm":
                assert t.modes[s.mode[t.index]].sm == min(m.sm for m in t.modes)


def test_memory_aware_gives_up_below_the_least_peak():
    p = build_problem(crossing_graph(), COST)
    least = min(peak_memory_bytes(p, f(p)) for f in BASELINES.values())
    assert warm_starts(p, least - 1) == []


@pytest.mark.parametrize("graph", GRAPHS)
def test_memory_lower_bound_below_every_schedule(graph):
    p = build_problem(GRAPHS[graph](), COST)
    lb, why = memory_lower_bound(p)
    assert lb > 0 and why
    for f in BASELINES.values():
        assert peak_memory_bytes(p, f(p)) >= lb


def test_bound_parts():
    p = build_problem(tiny_chain(), COST)
    b = lower_bound(p)
    by = p.by_name
    fwd_cp = sum(by[n].min_ticks for n in ("fc1", "ag", "fc2"))
    assert b.forward.critical_path == fwd_cp
    assert b.backward.stream["compute"] >= sum(by[n].min_ticks for n in ("fc2.dgrad", "fc2.wgrad", "fc1.dgrad",
                                                                          "fc1.wgrad"))
    assert b.ticks == b.forward.ticks + b.backward.ticks
    assert b.us == pytest.approx(b.ticks * 0.01)


def _best_non_preemptive(jobs):
    """The non-preemptive optimum: an upper bound on the preemptive one."""
    best = None
    for order in itertools.permutations(range(len(jobs))):
        t, span = 0, 0
        for i in order:
            r, p, q = jobs[i]
            t = max(t, r) + p
            span = max(span, t + q)
        best = span if best is None else min(best, span)
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 10), st.integers(0, 20)), min_size=1, max_size=6))
def test_jackson_preemptive_is_between_simple_bounds_and_the_optimum(jobs):
    jps = jackson_preemptive(jobs)
    simple = min(r for r, _, _ in jobs) + sum(p for _, p, _ in jobs) + min(q for _, _, q in jobs)
    assert max(simple, max(r + p + q for r, p, q in jobs)) <= jps <= _best_non_preemptive(jobs)


def test_jackson_preemptive_example():
    # job 2 arrives at 1 with a long tail and preempts job 1: 0-1 j1, 1-3 j2 (end 3+10), 3-7 j1 (end 7)
    assert jackson_preemptive([(0, 5, 0), (1, 2, 10)]) == 13


# -- fair baselines: the collective budget suits the hardware ------------------------------------------

@pytest.fixture(scope="module")
def traced_layers():
    from moegraph.ir import Strategy
    from moegraph.registry import load_model
    from moegraph.tracer import trace_model
    model = load_model("mixtral-8x7b")
    return {f"{a}/{f}/{d}": trace_model(model, Strategy(attn=a, ffn=f, dispatch=d, n=8), batch=1, seq=8192)
            for a, f, d in (("sp", "ep", "ag-rs"), ("sp", "ep", "a2a"), ("tp", "tp", "ag-rs"))}


def _registry_hardware():
    from moegraph.registry import hardware_names
    return hardware_names()


@pytest.mark.parametrize("hw_name", _registry_hardware())
def test_overlapping_baselines_are_never_slower_than_sequential(traced_layers, hw_name):
    from moegraph.cost import CostModel
    from moegraph.passes import run_pipeline
    from moegraph.registry import load_hardware
    cost = CostModel(load_hardware(hw_name))
    for name, g in traced_layers.items():
        p = build_problem(run_pipeline(g, "gate-reorder,sar=paper", cost=cost)[0], cost)
        seq = makespan_ticks(p, sequential(p))
        for rule in (greedy, megascale):
            sol = rule(p)
            check_solution(p, sol)
            assert makespan_ticks(p, sol) <= seq, (name, rule.__name__)


def test_default_budgets_alone_lose_to_sequential_on_h20(traced_layers):
    """The case the budget choice exists for: on h20 (78 SMs) the default 16-24 SM budgets
    make the greedy rule slower than sequential; the fair greedy picks fewer SMs."""
    from moegraph.cost import CostModel
    from moegraph.passes import run_pipeline
    from moegraph.registry import load_hardware
    from moegraph.schedules.baselines import bottom_levels
    cost = CostModel(load_hardware("h20"))
    p = build_problem(run_pipeline(traced_layers["sp/ep/a2a"], "gate-reorder,sar=paper", cost=cost)[0], cost)
    level = bottom_levels(p)
    key = lambda t: (-level[t.index], t.index)  # noqa: E731
    fixed = list_schedule(p, "greedy", comm_key=key, compute_key=key, comm_mode="default")
    seq = makespan_ticks(p, sequential(p))
    assert makespan_ticks(p, fixed) > 1.05 * seq
    fair = greedy(p)
    assert makespan_ticks(p, fair) < seq
    held = {p.tasks[i].modes[fair.mode[i]].sm for i in range(len(p.tasks)) if p.tasks[i].kind == "comm"}
    assert max(held) < max(cost.hw.comm_sm_budgets)


@pytest.mark.parametrize("graph", GRAPHS)
def test_exclusive_list_schedule_matches_sequential(graph):
    """Collectives and compute taking turns leave nothing idle: exactly sequential's makespan
    on one comm stream (the guarantee behind the fair baselines)."""
    p = build_problem(GRAPHS[graph](), COST)
    key = lambda t: (t.index,)  # noqa: E731
    sol = list_schedule(p, "x", comm_key=key, compute_key=key, comm_mode="exclusive")
    check_solution(p, sol)
    assert makespan_ticks(p, sol) == makespan_ticks(p, sequential(p))
