"""EmulatedComm (moegraph.runtime.emulated) on CPU: an n=2 rank graph run by one process, its
collectives replaced by same-sized copies; the same code the single-GPU overlap test runs."""

from __future__ import annotations

import pytest
import torch

from moegraph.ir import Node, OpKind, Phase, Role
from moegraph.runtime import RuntimeFailure
from moegraph.runtime.check import rel_err
from moegraph.runtime.emulated import TINY_SIZES, EmulatedComm, EmulatedCost, EmulatedRankGraph
from moegraph.runtime.trace import NodeTiming, StepTrace, hidden_comm_fraction


pytestmark = pytest.mark.usefixtures("one_thread")       # tests/conftest.py


@pytest.fixture(scope="module")
def rank_graph():
    return EmulatedRankGraph(TINY_SIZES, "cpu")


def _run(rg, schedule):
    ex = rg.executor(rg.plan(schedule))
    return rg.step(ex), ex


def test_emulated_rank_graph_runs_on_cpu_for_sequential_and_greedy(rank_graph):
    """The step completes with finite outputs of the graph's shapes; sequential and greedy plans
    issue the same copies of the same inputs, so they give identical numbers."""
    rg = rank_graph
    z = TINY_SIZES
    comm_nodes = [nd for nd in rg.graph.nodes if nd.is_comm]
    assert comm_nodes, "the rank graph has no collectives to emulate"
    steps = {}
    for schedule in ("sequential", "greedy"):
        st, ex = _run(rg, schedule)
        assert ex.comm.issued == len(comm_nodes)
        assert tuple(st.y.shape) == (z.b, z.s // z.n, z.h) and tuple(st.dx.shape) == (z.b, z.s // z.n, z.h)
        assert torch.isfinite(st.y).all() and torch.isfinite(st.dx).all()
        for (pname, _), p, g in zip(rg.graph.params, rg.params, st.grads):
            assert g is not None and g.shape == p.shape and torch.isfinite(g).all(), pname
        assert {t.name for t in st.trace.nodes} == {nd.name for nd in rg.graph.nodes}
        steps[schedule] = st
    seq, greedy = steps["sequential"], steps["greedy"]
    assert torch.equal(seq.y, greedy.y) and torch.equal(seq.dx, greedy.dx)
    assert all(torch.equal(a, b) for a, b in zip(seq.grads, greedy.grads))


def _node(op, mode=None, outputs=("out",)):
    attrs = (("mode", mode),) if mode else ()
    return Node("c", op, Phase.FORWARD, ("a", "b"), outputs, Role.FORWARD, group=2, attrs=attrs)


def test_emulated_collective_is_a_copy_of_its_inputs():
    """Outputs: the inputs, flattened, concatenated and repeated to the output shape, in the
    operand's dtype; the work is complete once issued (CPU)."""
    comm = EmulatedComm(2)
    a, b = torch.randn(2, 3), torch.randn(4)
    p = comm.issue(_node(OpKind.ALL_GATHER), [a, b], "comm", 0, [(4, 5)])
    (out,) = p.wait(1.0, 0)
    src = torch.cat([a.reshape(-1), b])
    assert out.shape == (4, 5) and out.dtype == a.dtype
    assert torch.equal(out.reshape(-1), torch.cat([src, src])[:20])
    assert p.works[0].is_completed() and p.issued_ns > 0


@pytest.mark.parametrize("op,mode,match", [
    (OpKind.ALL_TO_ALL, "tokens", "row counts depend on the routing"),
    (OpKind.ALL_TO_ALL, "experts", "no emulation of all_to_all mode 'experts'"),
    (OpKind.GEMM, None, "gemm is not a collective EmulatedComm emulates"),
])
def test_emulated_comm_refuses_what_it_cannot_size(op, mode, match):
    with pytest.raises(RuntimeFailure, match=match):
        EmulatedComm(2).issue(_node(op, mode), [torch.ones(4)], "comm", 0, [(4,)])


def test_emulated_comm_needs_other_ranks():
    with pytest.raises(ValueError, match="n=1 must be at least 2"):
        EmulatedComm(1)


def test_hidden_comm_fraction_counts_compute_beside_collectives():
    nodes = (NodeTiming("g1", "compute", 0, "forward", 0.0, 10.0),
             NodeTiming("c1", "comm", 0, "forward", 5.0, 15.0),         # 5 of 10 us beside g1
             NodeTiming("g2", "compute", 0, "forward", 15.0, 20.0),
             NodeTiming("c2", "comm", 0, "forward", 14.0, 24.0))        # 5 of 10 us beside g2, none beside g1
    frac = hidden_comm_fraction(StepTrace(0, "cpu", nodes))
    assert frac == pytest.approx((5.0 + 5.0) / 20.0)
    assert hidden_comm_fraction(StepTrace(0, "cpu", nodes[:1])) == 0.0


def test_fake_device_emulated_ag_rs_step_has_no_host_sync(rank_graph, monkeypatch):
    """The CUDA path of the executor with EmulatedComm, on the fake accelerator (tests/fake_cuda.py):
    no CPU tensor meets a device one, and nothing in an ag-rs (ffn=tp) step would block the host
    (value reads, device-to-host copies, data-dependent shapes, synchronize): what the GPU test
    checks with torch.cuda.set_sync_debug_mode. The numbers match the CPU run's (to 1e-5: the
    fake device runs SDPA's math backend, the CPU run may not)."""
    import fake_cuda as fc
    from moegraph.runtime.executor import Executor
    rg = rank_graph
    plan = rg.plan("greedy")
    cpu, _ = _run(rg, "greedy")
    state = fc.fake_streams(monkeypatch)
    with fc.FakeCuda() as mode:
        ex = Executor(rg.graph, plan, EmulatedComm(2), rank=0, n=2, device=torch.device("cuda", 0))
        params = [fc.to_fake(p) for p in rg.params]
        y, saved = ex.forward(fc.to_fake(rg.x), params)
        dx, grads = ex.backward(saved, fc.to_fake(rg.dy), params)
        got = fc.real(y), fc.real(dx), [fc.real(g) for g in grads]
    assert state.streams, "the CUDA path made no comm stream"
    assert not dict(+mode.syncs) and not dict(+state.syncs)
    assert rel_err(got[0], cpu.y) < 1e-5 and rel_err(got[1], cpu.dx) < 1e-5
    assert all(rel_err(g, c) < 1e-5 for g, c in zip(got[2], cpu.grads))


def test_the_plans_cost_model_is_told_what_the_emulated_run_runs():
    """EmulatedCost prices every collective at the rank graph's comm_us, with no SMs held and no
    stretch beside compute: each collective of a greedy plan is predicted to last exactly that.
    Compute is priced on the measured H200 profile at the FP32 rate (the graph is fp32, TF32 off):
    a compute node takes what the profile's own model gives it with the bf16 peak replaced by
    66.9 TFLOP/s and no GEMM tile factors (cuBLAS's bf16 tensor-core tiles); a grouped GEMM the device runs masked (every expert's product for every row,
    moegraph.grouped_gemm) is priced at ``experts`` times its FLOPs, one it runs natively at its own."""
    import dataclasses

    from moegraph.cost import CostModel
    from moegraph.ir import OpKind
    from moegraph.registry import load_hardware
    z = TINY_SIZES
    fp32 = CostModel(dataclasses.replace(load_hardware("nvidia-h200-2026-11-27"), peak_flops_bf16=66.9e12,
                                         gemm_tiles=(), gemm_k_half=0.0))
    tick = 0.01                                                         # the schedule's time grid, rounded up
    for masked in (True, False):
        rg = EmulatedRankGraph(z, "cpu", comm_us=321.0, masked=masked)
        plan = rg.plan("greedy")
        comm = [e for e in plan.entries if rg.graph.node[e.name].is_comm]
        assert comm and all(e.end_us - e.start_us == pytest.approx(321.0, abs=tick) and e.sm_budget == 0
                            for e in comm)
        for e in plan.entries:
            nd = rg.graph.node[e.name]
            if nd.is_comm:
                continue
            flops = nd.flops * (z.experts if masked and nd.op is OpKind.GROUPED_GEMM else 1)
            want = fp32.node_time_us(dataclasses.replace(nd, flops=flops))
            assert e.end_us - e.start_us == pytest.approx(want, abs=tick), e.name
        grouped = {nd.name for nd in rg.graph.nodes if nd.op is OpKind.GROUPED_GEMM}
        assert grouped and rg.cost.masked_groups == ({name: z.experts for name in grouped} if masked else {})
    assert rg.sleep_cycles() == 0                                       # the CPU path does not sleep
    # TINY's grouped GEMMs are memory-bound; at a FLOP-bound size the masked price is E times the FLOPs'
    nd = dataclasses.replace(rg.graph.node[min(grouped)], flops=10**12)
    cost = EmulatedCost(fp32.hw, 1.0, fp32_flops_s=66.9e12, masked_groups={nd.name: 4})
    assert cost.node_time_us(nd) == pytest.approx(fp32.node_time_us(dataclasses.replace(nd, flops=4 * 10**12)))
    assert cost.node_time_us(nd) > 3 * fp32.node_time_us(nd)
    assert not EmulatedRankGraph(z, "cpu").masked                       # on CPU the grouped GEMM is not masked


def test_predicted_hidden_fraction_reads_the_plans_times(rank_graph):
    """The share of comm time the plan's own predicted schedule overlaps with compute: none when
    every collective is moved past the last compute node, half when one of two collectives lies
    inside a compute node; a plan without times (sequential) has none."""
    import dataclasses
    rg = rank_graph
    plan = rg.plan("greedy")
    is_comm = {e.name: rg.graph.node[e.name].is_comm for e in plan.entries}
    end = max(e.end_us for e in plan.entries)
    comm = [e for e in plan.entries if is_comm[e.name]][:2]
    compute = [e for e in plan.entries if not is_comm[e.name]]
    long = max(compute, key=lambda e: e.end_us - e.start_us)
    span = long.end_us - long.start_us
    moved = {comm[0].name: (end + 10, end + 10 + span), comm[1].name: (long.start_us, long.end_us)}
    entries = tuple(dataclasses.replace(e, start_us=moved[e.name][0], end_us=moved[e.name][1])
                    if e.name in moved else e for e in plan.entries if not is_comm[e.name] or e.name in moved)
    assert rg.predicted_hidden_fraction(dataclasses.replace(plan, entries=entries)) == pytest.approx(0.5)
    late = tuple(dataclasses.replace(e, start_us=end + 10, end_us=end + 20) if is_comm[e.name] else e
                 for e in plan.entries)
    assert rg.predicted_hidden_fraction(dataclasses.replace(plan, entries=late)) == 0.0
    assert rg.predicted_hidden_fraction(rg.plan("sequential")) is None


def test_emulated_gather_of_several_values_keeps_each_operand_and_dtype():
    """ag-rs's routing gather (fp32 weights and int64 expert ids in one all-gather): each output is
    its own operand repeated, in its dtype, so the emulated ids stay valid expert ids."""
    comm = EmulatedComm(2)
    w, ids = torch.rand(1, 3, 2), torch.randint(0, 4, (1, 3, 2))
    node = Node("routing_ag", OpKind.ALL_GATHER, Phase.FORWARD, ("w", "e"), ("w_ag", "e_ag"), comm_bytes=1, group=2,
                attrs=(("dim", 1),))
    out_w, out_ids = comm.issue(node, [w, ids], "comm", 0, [(1, 6, 2), (1, 6, 2)]).wait(1.0, 0)
    assert out_ids.dtype == torch.int64 and torch.equal(out_ids.reshape(-1), ids.reshape(-1).repeat(2))
    assert out_w.dtype == w.dtype and torch.equal(out_w.reshape(-1), w.reshape(-1).repeat(2))
