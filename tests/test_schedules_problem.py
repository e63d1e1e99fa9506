"""moegraph.schedules.problem: tasks, modes, streams, sides, memory intervals, chunk symmetry."""

import pytest

from moegraph.ir import OpKind
from moegraph.schedules.problem import COMPUTE, ScheduleError, build_problem, chunk_symmetry, to_ticks
from moegraph.schedules.solution import (Solution, canonical_chunk_order, check_solution, makespan_ticks, memory_profile,
                                         peak_memory_bytes)
from moegraph.schedules.baselines import megascale
from schedules_fakes import barrier_graph, cost_model, moe_layer, tiny_chain

COST = cost_model()


def test_ticks_round_up():
    assert to_ticks(0.0) == 0
    assert to_ticks(0.01) == 1
    assert to_ticks(0.010001) == 2
    assert to_ticks(0.02 * 3) == 6  # float noise below a femtosecond is ignored
    with pytest.raises(ScheduleError, match="not a finite non-negative"):
        to_ticks(-1.0)


def test_tasks_streams_sides_and_modes():
    p = build_problem(tiny_chain(), COST)
    by = p.by_name
    assert p.streams == (COMPUTE, "comm")
    assert by["ag"].stream == "comm" and by["ag"].kind == "comm"
    assert by["fc1"].stream == COMPUTE and by["fc1"].side == 0
    assert by["fc2.wgrad"].side == 1 and by["rs"].side == 1
    assert [p.tasks[i].name for i in by["fc2"].preds] == ["ag"]
    hw = COST.hw
    S = hw.sm_count
    # compute modes: sm_count - b for useful reserves, fastest first; the FLOP term on the SMs
    # left, the memory term on the HBM bandwidth the collectives leave (2 bytes per byte they
    # send at the NVLink rate their SMs reach), hand-computed from the profile's fields
    fc1 = by["fc1"]
    base = COST.node_time_us(fc1.node)
    assert fc1.modes[fc1.default_mode].sm == S
    flops_s = fc1.node.flops / (hw.peak_flops_bf16 * hw.gemm_eff * COST._shape(fc1.node, "gemm"))
    mem_s = fc1.node.mem_bytes / (hw.hbm_bw_bytes_s * hw.mem_eff)
    for m in fc1.modes:
        b = S - m.sm
        assert b in hw.comm_sm_budgets or m.sm == S
        rate = 2 * hw.nvlink_bw_bytes_s * hw.ring_eff_intra * min(1, b / hw.comm_sm_saturation)
        hbm = hw.hbm_bw_bytes_s * hw.mem_eff
        want = hw.kernel_latency_us + max(flops_s * S / m.sm, mem_s * hbm / (hbm - rate)) * 1e6
        assert m.duration_us == pytest.approx(want)
        assert base <= m.duration_us <= base * S / m.sm + 1e-9
        assert m.ticks == to_ticks(m.duration_us)
    assert [m.ticks for m in fc1.modes] == sorted(m.ticks for m in fc1.modes)
    # collectives: budgets from the cost model, default kept even if dominated
    ag = by["ag"]
    assert ag.modes[ag.default_mode].sm == COST.default_sm_budget(ag.node)
    for m in ag.modes:
        assert m.sm in COST.comm_sm_budgets(ag.node)
        assert m.duration_us == pytest.approx(COST.node_time_us(ag.node, m.sm))


def test_views_take_no_time_and_no_sms():
    p = build_problem(moe_layer(), COST)
    split = p.by_name["split_qkv"]
    assert split.node.op is OpKind.SPLIT
    assert [(m.sm, m.ticks) for m in split.modes] == [(0, 0)]


def test_scoped_streams():
    p = build_problem(moe_layer(scope="inter"), COST, comm_streams=("comm.intra", "comm.inter"))
    assert p.streams == (COMPUTE, "comm.intra", "comm.inter")
    assert {t.stream for t in p.tasks if t.kind == "comm"} == {"comm.inter"}
    p = build_problem(moe_layer(), COST, comm_streams=("comm.intra", "comm.inter"))
    assert {t.stream for t in p.tasks if t.kind == "comm"} == {"comm.intra"}  # n=8 fits one node


def test_bad_options_are_named():
    with pytest.raises(ScheduleError, match=r"comm_streams=\['nccl'\] is not one of \['comm'\], "
                                            r"\['comm.intra', 'comm.inter'\]"):
        build_problem(tiny_chain(), COST, comm_streams=("nccl",))
    with pytest.raises(ScheduleError, match="memory_budget_bytes=0 must be a positive int or None"):
        build_problem(tiny_chain(), COST, memory_budget_bytes=0)


def test_memory_intervals():
    g = moe_layer()
    p = build_problem(g, COST)
    mv = {v.name: v for v in p.mem_values}
    assert "w_qkv" not in mv  # parameters are not scheduled memory
    assert mv["hidden"].start == "zero"
    assert mv["d_hidden_next"].start == "barrier"  # the seed gradient exists after forward
    assert mv["hidden_next"].until_makespan  # graph output
    assert "q" not in mv  # a view: no storage of its own ...
    ends = {p.tasks[i].name for i in mv["qkv"].ends}
    assert {"split_qkv", "rope", "a2a_qkv"} <= ends  # ... but its users keep the base alive
    assert "d_w_o" not in mv  # parameter gradients neither
    # a saved activation spans the barrier
    sol = megascale(p)
    prof = memory_profile(p, sol)
    assert max(b for _, b in prof) == peak_memory_bytes(p, sol) > 0
    assert prof[-1][1] == 0  # everything freed at the makespan


def test_forward_reading_backward_is_rejected():
    import dataclasses
    g = tiny_chain()
    nodes = list(g.nodes)
    fc2 = next(i for i, n in enumerate(nodes) if n.name == "fc2")
    # make forward fc2 read a backward value (bypassing ir.verify, which would reject a GRAD input)
    nodes[fc2] = dataclasses.replace(nodes[fc2], inputs=("y_ag", "dw2"))
    order = [n for n in nodes if n.name != "fc2"] + [nodes[fc2]]
    bad = dataclasses.replace(g, nodes=tuple(order))
    with pytest.raises(ScheduleError, match="forward node 'fc2' reads an output of backward node 'fc2.wgrad'"):
        build_problem(bad, COST)


def test_check_solution_catches_a_broken_solution():
    p = build_problem(barrier_graph(), COST)
    sol = megascale(p)
    check_solution(p, sol)
    early = p.by_name["early.dgrad"].index
    start = list(sol.start)
    start[early] = 0
    with pytest.raises(ScheduleError, match="'early.dgrad' starts before the barrier"):
        check_solution(p, Solution("x", tuple(start), sol.mode))


def test_chunk_symmetry_detected_and_relabelling_keeps_the_schedule():
    p = build_problem(moe_layer(chunks=3), COST)
    groups = chunk_symmetry(p)
    assert groups is not None and len(groups) == 3
    assert [p.tasks[g[0]].name for g in groups] == ["ag.c0", "ag.c1", "ag.c2"]
    for g in groups:  # aligned: the same role in every chunk
        assert [p.tasks[i].name.split(".c")[0] for i in g] == [p.tasks[i].name.split(".c")[0] for i in groups[0]]
    sol = megascale(p)
    canon = canonical_chunk_order(p, sol, groups)
    check_solution(p, canon)
    assert makespan_ticks(p, canon) == makespan_ticks(p, sol)
    assert peak_memory_bytes(p, canon) == peak_memory_bytes(p, sol)
    firsts = [canon.start[g[0]] for g in groups]
    assert firsts == sorted(firsts)


def test_no_symmetry_without_chunks():
    assert chunk_symmetry(build_problem(moe_layer(), COST)) is None
