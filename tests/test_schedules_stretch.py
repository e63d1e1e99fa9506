"""Collectives that run longer beside compute (hw.comm_overlap_stretch): the scheduler overlaps a
collective only where that pays, the verifier prices durations from the timeline."""

import dataclasses

import pytest

from moegraph.cost import CostModel
from moegraph.ir import OpKind
from moegraph.registry import RegistryError
from moegraph.schedules import compile_graph, verify_schedule
from moegraph.schedules.baselines import greedy, sequential
from moegraph.schedules.problem import ScheduleError, build_problem
from moegraph.schedules.solution import overlaps_compute
from moegraph.schedules.solution import Solution, check_solution, makespan_ticks, settle_alone
from schedules_fakes import MiniBuilder, PARAM, hardware, moe_layer, tiny_chain

CPU = hardware("cpu-2core-gloo")


def _cost(stretch: float) -> CostModel:
    return CostModel(dataclasses.replace(CPU, comm_overlap_stretch=stretch))


def side_by_side():
    """One GEMM and one all-gather that do not depend on each other: run them one after the
    other, or together (GEMM slowed by the collective's SMs, collective stretched)."""
    g = MiniBuilder("side_by_side", n=2)
    x = g.inp("x", (512, 512))
    w = g.inp("w", (512, 512), PARAM)
    y = g.inp("y", (2048, 256))
    g.outputs.append(g.gemm("mm", x, w, g.val("z", (512, 512)), 512, 512, 512))
    g.outputs.append(g.comm("ag", OpKind.ALL_GATHER, y, g.val("y_ag", (4096, 256))))
    return g.build()


def _times(cost: CostModel, graph):
    node = {n.name: n for n in graph.nodes}
    S, b = cost.sm_count(), CPU.comm_sm_budgets[0]
    mm = cost.node_time_us(node["mm"])
    ag = cost.node_time_us(node["ag"], b)
    return mm, mm * S / (S - b), ag


@pytest.mark.parametrize("stretch", [1.0, 1.25, 2.0, 3.0])
def test_cpsat_overlaps_only_where_the_stretch_leaves_a_gain(stretch):
    graph = side_by_side()
    cost = _cost(stretch)
    mm, mm_slowed, ag = _times(cost, graph)
    apart, together = mm + ag, max(mm_slowed, ag * stretch)
    assert abs(apart - together) > 0.05 * apart          # the sizes make the choice clear-cut
    s = compile_graph(graph, cost, time_limit_s=2.0).schedule
    assert verify_schedule(s) == []
    assert s.summary["makespan_us"] == pytest.approx(min(apart, together), abs=0.03)
    a, m = s.node["ag"], s.node["mm"]
    overlapped = a.start_us < m.end_us and m.start_us < a.end_us
    assert overlapped == (together < apart)
    assert a.end_us - a.start_us == pytest.approx(ag * (stretch if overlapped else 1.0), abs=0.011)


def test_stretch_one_adds_no_modes():
    p1 = build_problem(side_by_side(), _cost(1.0))
    p2 = build_problem(side_by_side(), _cost(1.5))
    ag1, ag2 = p1.by_name["ag"], p2.by_name["ag"]
    assert [m.alone for m in ag1.modes] == [False]
    assert sorted(m.alone for m in ag2.modes) == [False, True]
    beside = next(m for m in ag2.modes if not m.alone)
    alone = next(m for m in ag2.modes if m.alone)
    assert beside.duration_us == pytest.approx(1.5 * alone.duration_us)
    assert not ag2.modes[ag2.default_mode].alone     # baselines that overlap use the beside mode


def test_sequential_runs_collectives_alone_and_greedy_settles():
    p = build_problem(tiny_chain(n=2), _cost(1.4))
    seq = sequential(p)
    check_solution(p, seq)
    assert all(t.modes[seq.mode[t.index]].alone for t in p.tasks if t.kind == "comm")
    gr = greedy(p)
    check_solution(p, gr)
    beside = overlaps_compute(p, gr)
    for t in p.tasks:
        if t.kind == "comm":
            assert t.modes[gr.mode[t.index]].alone == (not beside[t.index])


def test_settle_alone_shortens_and_check_rejects_unsettled():
    p = build_problem(side_by_side(), _cost(2.0))
    mm, ag = p.by_name["mm"], p.by_name["ag"]
    beside_k = next(k for k, m in enumerate(ag.modes) if not m.alone)
    alone_k = next(k for k, m in enumerate(ag.modes) if m.alone)
    start, mode = [0, 0], [0, 0]
    start[ag.index], mode[ag.index] = mm.modes[0].ticks, beside_k   # after the GEMM, priced beside it
    unsettled = Solution("hand", tuple(start), tuple(mode))
    with pytest.raises(ScheduleError, match="'ag' runs alone but is priced beside compute"):
        check_solution(p, unsettled)
    settled = settle_alone(p, unsettled)
    assert settled.mode[ag.index] == alone_k
    assert makespan_ticks(p, settled) < makespan_ticks(p, unsettled)
    check_solution(p, settled)
    start[ag.index], mode[ag.index] = 0, alone_k                   # beside the GEMM, priced alone
    mode[mm.index] = next(k for k, m in enumerate(mm.modes) if m.sm < p.sm_count)
    with pytest.raises(ScheduleError, match="'ag' runs in its alone mode beside compute"):
        check_solution(p, Solution("hand", tuple(start), tuple(mode)))


def test_verifier_prices_overlapped_collectives_stretched():
    cost = _cost(1.25)
    s = compile_graph(side_by_side(), cost, time_limit_s=2.0).schedule
    a = s.node["ag"]
    assert a.start_us < s.node["mm"].end_us          # overlapped (see the parametrised test)
    plain = cost.node_time_us(next(n for n in side_by_side().nodes if n.name == "ag"), a.sm_budget)
    nodes = tuple(dataclasses.replace(n, end_us=round(n.start_us + plain + 0.005, 6)) if n.name == "ag" else n
                  for n in s.nodes)
    bad = dataclasses.replace(s, nodes=nodes)
    bad = dataclasses.replace(bad, summary=dict(bad.summary, makespan_us=max(n.end_us for n in nodes))).with_hash()
    v = [x for x in verify_schedule(bad) if x.check == "duration"]
    assert v and "'ag'" in v[0].message and "beside compute (x1.25)" in v[0].message


@pytest.mark.parametrize("method", ["cpsat", "sequential", "greedy", "megascale"])
@pytest.mark.slow
def test_layer_schedules_verify_with_stretch(method):
    s = compile_graph(moe_layer(n=2, chunks=2, recompute=True), _cost(1.3), method=method,
                      time_limit_s=2.0).schedule
    assert verify_schedule(s) == []


@pytest.mark.slow
def test_cpsat_never_longer_than_sequential_with_stretch():
    cost = _cost(2.5)
    graph = moe_layer(n=2, chunks=2)
    s = compile_graph(graph, cost, time_limit_s=2.0).schedule
    assert s.summary["makespan_us"] <= s.summary["baselines"]["sequential"] + 1e-6


@pytest.mark.parametrize("bad", [0.9, 11, "x", True])
def test_bad_stretch_is_rejected(bad):
    with pytest.raises(RegistryError, match="comm_overlap_stretch"):
        dataclasses.replace(CPU, comm_overlap_stretch=bad)
