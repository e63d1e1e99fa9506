"""Cost model against hand computations on h800.

h800 numbers used below (typed from hardware.yaml / Hardware defaults, not read from code):
P = 989e12 FLOP/s, W = 3.4e12 B/s, B_nvlink = 200e9 B/s, B_nic = 50e9 B/s, alpha = 2 us intra /
5 us inter, kernel = 4 us, copy engine +10 us, gemm_eff 0.75, mem_eff 0.8, ring_eff 0.726 intra
and inter, a2a_eff 0.55 intra / 0.427 inter, copy_engine_eff 0.6, ring saturation 16 SMs, a2a
saturation 24 SMs, 132 SMs. These are the constant-efficiency values hardware.yaml held before
the shape and size curves (issue 29); ``flat_h800`` restores them with every curve switched off,
so the formulas below are checked by hand; tests/test_cost_shapes.py checks the curves.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from moegraph.cost import CostModel, interpolate
from moegraph.ir import collective_bytes
from moegraph.ir import Node, OpKind, Phase
from moegraph.registry import load_hardware

from helpers import flat_h800

MiB = 2**20


@pytest.fixture(scope="module")
def h800() -> CostModel:
    return CostModel(flat_h800())


def compute(op=OpKind.GEMM, flops=0, mem_bytes=0) -> Node:
    return Node(name=f"x.{op.value}", op=op, phase=Phase.FORWARD, inputs=(), outputs=("y",),
                flops=flops, mem_bytes=mem_bytes)


def comm(op, comm_bytes, group=8, **attrs) -> Node:
    node = Node(name=f"c.{op.value}", op=op, phase=Phase.FORWARD, inputs=(), outputs=("y",),
                comm_bytes=comm_bytes, group=group)
    return node.with_attrs(**attrs) if attrs else node


def test_gemm_compute_bound(h800):
    # [4096, 4096] x [4096, 4096] bf16: 2*4096^3 FLOPs -> 185.29 us; 3*4096^2*2 B -> 37.0 us
    node = compute(flops=2 * 4096**3, mem_bytes=3 * 4096 * 4096 * 2)
    assert h800.node_time_us(node) == pytest.approx(4 + 185.2901294, rel=1e-7)


def test_gemm_memory_bound(h800):
    # [8, 4096] x [4096, 4096]: 0.36 us of math, 33685504 B of traffic -> 12.384 us
    node = compute(flops=2 * 8 * 4096 * 4096, mem_bytes=(2 * 8 * 4096 + 4096 * 4096) * 2)
    assert h800.node_time_us(node) == pytest.approx(16.3843765, rel=1e-7)


def test_sm_budget_ignored_for_compute(h800):
    node = compute(flops=10**12)
    assert h800.node_time_us(node, sm_budget=16) == h800.node_time_us(node)


def test_memory_bound_ops_use_mem_eff(h800):
    node = compute(OpKind.RMSNORM, flops=5 * 2**20, mem_bytes=2 * 4 * MiB)  # 8 MiB / (3.4e12 * 0.8)
    assert h800.node_time_us(node) == pytest.approx(4 + 3.0840470588, rel=1e-7)


def test_memory_bound_op_flops_count_at_peak(h800):
    # the documented rule: their FLOPs are priced at peak (eff 1); binding only if mem is tiny
    node = compute(OpKind.SWIGLU, flops=989 * 10**6, mem_bytes=8)
    assert h800.node_time_us(node) == pytest.approx(4 + 1.0)


def test_grouped_gemm_and_attention_efficiencies(h800):
    flops = 10**12
    assert h800.node_time_us(compute(OpKind.GROUPED_GEMM, flops)) == pytest.approx(4 + 1e6 / (989 * 0.65))
    assert h800.node_time_us(compute(OpKind.ATTENTION, flops)) == pytest.approx(4 + 1e6 / (989 * 0.55))
    assert h800.node_time_us(compute(OpKind.ROUTER, flops)) == pytest.approx(4 + 1e6 / (989 * 0.75))


def test_split_is_free(h800):
    assert h800.node_time_us(compute(OpKind.SPLIT, mem_bytes=10**9)) == 0.0


AG_BYTES = 64 * MiB * 7 // 8  # all-gather of a 64 MiB tensor over 8 ranks: 58720256 B sent


@pytest.mark.parametrize("budget, expected", [
    (16, 422.4094766),   # 4 + 7*2 + 58720256 / (200e9 * 0.726)
    (8, 826.8189532),    # half the SMs of saturation -> half the bandwidth
    (32, 422.4094766),   # past saturation: no faster
    (0, 517.3354667),    # copy engines: 4 + 14 + 10 + 58720256 / (200e9 * 0.6)
])
def test_all_gather(h800, budget, expected):
    assert h800.node_time_us(comm(OpKind.ALL_GATHER, AG_BYTES), budget) == pytest.approx(expected, rel=1e-7)


def test_copy_engines_never_outrun_a_saturated_ring(h800):
    """copy_engine_eff above the ring's (H100: 380 vs 370 GB/s, hardware.yaml) gives budget 0 the
    saturated ring's wire time, not more: 4 + 14 + 10 + 58720256 / (200e9 * 0.726) = 432.4094766
    (all-gather); 4 + 14 + 10 + 58720256 / (200e9 * 0.55) = 561.8205091 (all-to-all)."""
    fast = CostModel(dataclasses.replace(h800.hw, copy_engine_eff=0.9))
    assert fast.node_time_us(comm(OpKind.ALL_GATHER, AG_BYTES), 0) == pytest.approx(432.4094766, rel=1e-7)
    assert fast.node_time_us(comm(OpKind.ALL_TO_ALL, AG_BYTES), 0) == pytest.approx(561.8205091, rel=1e-7)


@pytest.mark.parametrize("budget, expected", [
    (24, 551.8205091),   # 4 + 14 + 58720256 / (200e9 * 0.55): intra-node a2a_eff
    (16, 818.7307636),   # 16/24 of saturation: 18 + 533.8205091 * 24/16
    (0, 673.9228160),    # 4 + 14 + 10 + bytes / (200e9 * 0.55 * 0.6/0.726)
])
def test_all_to_all(h800, budget, expected):
    assert h800.node_time_us(comm(OpKind.ALL_TO_ALL, AG_BYTES), budget) == pytest.approx(expected, rel=1e-7)


A2A_BYTES = 14_680_064  # mixtral-8x7b's dispatch all-to-all, s=8192, n=8 (docs/cost_model.md)


@pytest.mark.parametrize("group, attrs, expected", [
    (8, {}, 151.4551273),                 # intra (NVLink): 4 + 7*2 + 14680064 / (200e9 * 0.55)
    (16, {}, 766.5908197),                # inter (NIC):    4 + 15*5 + 14680064 / (50e9 * 0.427)
    (8, {"scope": "inter"}, 726.5908197),  # scope attr wins: 4 + 7*5 + 14680064 / (50e9 * 0.427)
])
def test_all_to_all_efficiency_by_scope(h800, group, attrs, expected):
    """Issue 14 item 6: the two-node IB all-to-all efficiency (0.427) no longer prices NVLink."""
    node = comm(OpKind.ALL_TO_ALL, A2A_BYTES, group=group, **attrs)
    assert h800.node_time_us(node, 24) == pytest.approx(expected, rel=1e-7)


def test_ring_efficiency_by_scope():
    """The ring fields are separate too: change one and only its scope's time moves."""
    hw = dataclasses.replace(flat_h800(), ring_eff_inter=0.5)
    cm = CostModel(hw)
    assert cm.node_time_us(comm(OpKind.ALL_GATHER, AG_BYTES), 16) == pytest.approx(422.4094766, rel=1e-7)
    assert cm.node_time_us(comm(OpKind.REDUCE_SCATTER, AG_BYTES, scope="inter"), 16) == \
        pytest.approx(4 + 35 + 58720256 / (50e9 * 0.5) * 1e6, rel=1e-7)
    assert cm.node_time_us(comm(OpKind.ALL_REDUCE, AG_BYTES, scope="inter"), 16) == \
        pytest.approx(4 + 70 + 58720256 / (50e9 * 0.5) * 1e6, rel=1e-7)


def test_all_reduce_is_rs_plus_ag_latency(h800):
    node = comm(OpKind.ALL_REDUCE, 2 * 64 * MiB * 7 // 8)  # 4 + 2*7*2 + 117440512 / (200e9*0.726)
    assert h800.node_time_us(node, 16) == pytest.approx(840.8189532, rel=1e-7)


def test_inter_node_by_group_and_by_attr(h800):
    node = comm(OpKind.ALL_GATHER, 64 * MiB * 15 // 16, group=16)  # 4 + 15*5 + B / (50e9 * 0.726)
    assert h800.node_time_us(node, 16) == pytest.approx(1812.1834711, rel=1e-7)
    forced = comm(OpKind.ALL_GATHER, AG_BYTES, scope="inter")  # 4 + 7*5 + B / (50e9 * 0.726)
    assert h800.node_time_us(forced, 16) == pytest.approx(4 + 35 + 1617.63790634, rel=1e-7)
    with pytest.raises(ValueError) as e:
        h800.node_time_us(comm(OpKind.ALL_GATHER, AG_BYTES, scope="rack"))
    assert str(e.value) == "node 'c.all_gather': scope 'rack' is not one of 'intra', 'inter'"


@pytest.mark.parametrize("budget", [0, 8, 16, 24, 32])
def test_a2a_slower_than_ring_for_equal_bytes(h800, budget):
    ring = h800.node_time_us(comm(OpKind.ALL_GATHER, AG_BYTES), budget)
    assert h800.node_time_us(comm(OpKind.ALL_TO_ALL, AG_BYTES), budget) > ring
    if budget > 0:
        assert h800.node_time_us(comm(OpKind.REDUCE_SCATTER, AG_BYTES), budget) == ring


@pytest.mark.parametrize("op", [OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE])
def test_reducing_collectives_have_no_copy_engine_budget(h800, op):
    """Copy engines move bytes but cannot add: a reduce-scatter or all-reduce holds SMs (the moving
    ones keep budget 0), named in one line when asked for 0."""
    assert h800.comm_sm_budgets(comm(op, AG_BYTES)) == (8, 16, 24, 32)
    assert h800.comm_sm_budgets(comm(OpKind.ALL_GATHER, AG_BYTES))[0] == 0
    with pytest.raises(ValueError, match=rf"sm_budget=0 is not allowed for 'c.{op.value}' \({op.value}\) on h800; "
                                         r"allowed: 8, 16, 24, 32$"):
        h800.node_time_us(comm(op, AG_BYTES), 0)


@pytest.mark.parametrize("op, saturation", [(OpKind.ALL_GATHER, 16), (OpKind.ALL_TO_ALL, 24)])
def test_time_falls_with_sms_until_saturation(h800, op, saturation):
    node = comm(op, AG_BYTES)
    budgets = [b for b in h800.comm_sm_budgets(node) if b > 0]
    times = [h800.node_time_us(node, b) for b in budgets]
    for (b0, t0), (b1, t1) in zip(zip(budgets, times), zip(budgets[1:], times[1:])):
        if b1 <= saturation:
            assert t1 < t0, (b0, b1)
        else:
            assert t1 == t0, (b0, b1)


def test_budgets_default_and_best(h800):
    ag, a2a = comm(OpKind.ALL_GATHER, AG_BYTES), comm(OpKind.ALL_TO_ALL, AG_BYTES)
    assert h800.comm_sm_budgets(ag) == (0, 8, 16, 24, 32)
    assert h800.default_sm_budget(ag) == 16 and h800.default_sm_budget(a2a) == 24
    assert h800.node_time_us(ag) == h800.node_time_us(ag, 16)
    # copy engines (0.6 of the link) never beat saturated SM rings (0.726): budget 0 only pays
    # off by leaving SMs to concurrent compute, which is the scheduler's trade-off to make
    assert h800.best_time_us(ag) == h800.node_time_us(ag, 16)
    tiny = comm(OpKind.ALL_GATHER, 7 * 1024)
    assert h800.best_time_us(tiny) == h800.node_time_us(tiny, 16)
    node = compute(flops=10**12)
    assert h800.best_time_us(node) == h800.node_time_us(node)
    cpu = CostModel(load_hardware("cpu-gloo"))
    assert cpu.default_sm_budget(ag) == 0


def test_budget_errors(h800):
    with pytest.raises(ValueError) as e:
        h800.node_time_us(comm(OpKind.ALL_GATHER, AG_BYTES), 12)
    assert str(e.value) == "sm_budget=12 is not allowed for 'c.all_gather' (all_gather) on h800; allowed: 0, 8, 16, 24, 32"
    with pytest.raises(ValueError) as e:
        h800.comm_sm_budgets(compute(flops=1))
    assert str(e.value) == "node 'x.gemm' (gemm) is not a collective; SM budgets apply to collectives only"


def test_interference_both_terms_by_hand():
    """Compute beside collectives holding b SMs: FLOPs on the SMs left, bytes on the HBM the
    collectives leave (h800: 2 bytes of HBM per byte sent at the NVLink rate b SMs reach)."""
    cm = CostModel(load_hardware("h800"))
    hw = cm.hw
    hbm = 3.4e12 * 0.8
    rate16 = 2 * 200e9 * 0.794                       # 16 SMs saturate a ring
    assert cm.hbm_slowdown(16) == pytest.approx(hbm / (hbm - rate16))
    assert cm.hbm_slowdown(8) == pytest.approx(hbm / (hbm - rate16 / 2))
    assert cm.hbm_slowdown(0) == 1.0
    gemm = compute(flops=10**13)                     # FLOP-bound: x 132/116
    alone = cm.node_time_us(gemm)
    assert cm.beside_comm_us(gemm, 16) == pytest.approx(4 + (alone - 4) * 132 / 116)
    copy = compute(op=OpKind.ADD, mem_bytes=10**9)   # memory-bound: x HBM share only (< 132/116)
    mem_us = 10**9 / hbm * 1e6
    assert cm.beside_comm_us(copy, 16) == pytest.approx(4 + mem_us * hbm / (hbm - rate16))
    assert cm.beside_comm_us(copy, 16) < cm.node_time_us(copy) * cm.compute_slowdown(16)
    # Lee et al. 2025 (arXiv:2507.03114) measure 18.9% compute slowdown on average beside NCCL on
    # A100/H100, 40% at most: the model's range at NCCL's 16-24 SMs for a FLOP-bound GEMM
    assert 1.10 < cm.beside_comm_us(gemm, 16) / alone < cm.beside_comm_us(gemm, 24) / alone < 1.40
    # a profile without comm_hbm_traffic (calibrated CPU ones) slows the whole node by the core share
    flat = CostModel(dataclasses.replace(hw, comm_hbm_traffic=0.0))
    assert flat.beside_comm_us(copy, 16) == pytest.approx(flat.node_time_us(copy) * 132 / 116)
    with pytest.raises(ValueError, match="is a collective"):
        cm.beside_comm_us(comm(OpKind.ALL_GATHER, AG_BYTES), 16)


def test_compute_slowdown(h800):
    assert h800.sm_count() == 132
    assert h800.compute_slowdown(0) == 1.0
    assert h800.compute_slowdown(16) == pytest.approx(132 / 116)
    assert h800.compute_slowdown(66) == pytest.approx(2.0)
    with pytest.raises(ValueError) as e:
        h800.compute_slowdown(132)
    assert str(e.value) == "sms_held_by_comm=132 leaves no SMs for compute (sm_count=132)"
    with pytest.raises(ValueError):
        h800.compute_slowdown(-1)


def test_kernel_latency_makes_chunking_cost(h800):
    whole = compute(flops=2 * 4096**3)
    quarter = compute(flops=2 * 4096**3 // 4)
    assert 4 * h800.node_time_us(quarter) == pytest.approx(h800.node_time_us(whole) + 3 * 4)


# --- curves ---------------------------------------------------------------------------------

POINTS = ((1e9, 0.2), (1e12, 0.8))


@pytest.mark.parametrize("size, eff", [
    (1e9, 0.2), (1e12, 0.8),               # at the points
    (10**10.5, 0.5),                       # halfway in log(size)
    (1e10, 0.2 + 0.6 / 3),                 # a third of the way in log
    (1e3, 0.2), (0, 0.2), (1e15, 0.8),     # clamped outside
])
def test_interpolate(size, eff):
    assert interpolate(POINTS, size) == pytest.approx(eff)


def test_interpolate_three_points():
    pts = ((1e3, 0.1), (1e6, 0.4), (1e9, 0.9))
    assert interpolate(pts, 1e6) == pytest.approx(0.4)
    assert interpolate(pts, 10**7.5) == pytest.approx(0.65)


def test_curve_replaces_scalar():
    hw = dataclasses.replace(flat_h800(), curves={"gemm_eff": POINTS,
                                                            "a2a_eff": ((1e3, 0.1), (1e9, 0.5))})
    cm = CostModel(hw)
    flops = 10**10.5  # eff 0.5 instead of 0.75
    assert cm.node_time_us(compute(flops=int(flops))) == pytest.approx(4 + flops / (989e12 * 0.5) * 1e6)
    # a2a at 1e6 bytes: halfway in log between 1e3 and 1e9 -> eff 0.3, at 24 SMs
    assert cm.node_time_us(comm(OpKind.ALL_TO_ALL, 10**6), 24) == \
        pytest.approx(4 + 14 + 1e6 / (200e9 * 0.3) * 1e6)
    # a measured curve (one link) prices both scopes: inter at 1e6 bytes, eff 0.3 on the NIC
    assert cm.node_time_us(comm(OpKind.ALL_TO_ALL, 10**6, scope="inter"), 24) == \
        pytest.approx(4 + 35 + 1e6 / (50e9 * 0.3) * 1e6)
    # curves absent for ring: scalar ring_eff stays
    assert cm.node_time_us(comm(OpKind.ALL_GATHER, AG_BYTES), 16) == pytest.approx(422.4094766)


def test_all_reduce_prefers_its_own_curve_then_ring():
    base = flat_h800()
    ring_only = CostModel(dataclasses.replace(base, curves={"ring_eff": ((1.0, 0.5),)}))
    both = CostModel(dataclasses.replace(base, curves={"ring_eff": ((1.0, 0.5),), "all_reduce_eff": ((1.0, 0.25),)}))
    node = comm(OpKind.ALL_REDUCE, 10**8)
    assert ring_only.node_time_us(node, 16) == pytest.approx(4 + 28 + 1e8 / (200e9 * 0.5) * 1e6)
    assert both.node_time_us(node, 16) == pytest.approx(4 + 28 + 1e8 / (200e9 * 0.25) * 1e6)


# --- every op kind has a rule; an op without one raises ---------------------------------------

@pytest.mark.parametrize("op", list(OpKind))
def test_every_op_kind_has_a_rule(h800, op):
    node = comm(op, AG_BYTES) if op.is_comm else compute(op, flops=10**9, mem_bytes=10**6)
    assert math.isfinite(h800.node_time_us(node)) and h800.node_time_us(node) >= 0


class _FakeOp:
    value = "mystery"
    is_comm = False

    def __repr__(self):
        return "OpKind.MYSTERY"


def test_op_without_rule_raises(h800):
    node = dataclasses.replace(compute(), op=_FakeOp())
    with pytest.raises(NotImplementedError) as e:
        h800.node_time_us(node)
    assert str(e.value) == "no cost rule for OpKind.MYSTERY"
    with pytest.raises(NotImplementedError):
        collective_bytes(OpKind.GEMM, 64, 8)


# --- collective_bytes -------------------------------------------------------------------------

def test_collective_bytes():
    assert collective_bytes(OpKind.ALL_GATHER, 64, 8) == 56
    assert collective_bytes(OpKind.REDUCE_SCATTER, 64, 8) == 56
    assert collective_bytes(OpKind.ALL_TO_ALL, 96, 4) == 72
    assert collective_bytes(OpKind.ALL_REDUCE, 64, 8) == 112
    with pytest.raises(ValueError) as e:
        collective_bytes(OpKind.ALL_GATHER, 10, 3)
    assert str(e.value) == "full_tensor_bytes=10 is not divisible by n=3"
    with pytest.raises(ValueError) as e:
        collective_bytes(OpKind.ALL_TO_ALL, 10, 1)
    assert str(e.value) == "collective group size n=1 must be >= 2"


# --- in-step weight streaming and gradient accumulation (issue 13 item 4) ---------------------

def _expert_wgrads(graph):
    return [nd for nd in graph.nodes if nd.op is OpKind.GROUPED_GEMM and nd.role.value == "wgrad"]


def test_old_and_datasheet_profiles_have_no_streaming_or_accumulation_term():
    for name in ("h800", "a100", "h20", "cpu-2core-gloo"):
        hw = load_hardware(name)
        assert (hw.in_step_stream_bw_bytes_s, hw.accumulate_bw_bytes_s) == (0.0, 0.0), name


def test_chunked_expert_wgrad_pays_weight_streaming_and_accumulation():
    from moegraph.ir import Strategy
    from moegraph.registry import load_model
    from moegraph.tracer import trace_model
    base = dataclasses.replace(load_hardware("cpu-2core-gloo-1gbit"), in_step_stream_bw_bytes_s=0.0,
                               accumulate_bw_bytes_s=0.0)
    hw = dataclasses.replace(base, in_step_stream_bw_bytes_s=8e9, accumulate_bw_bytes_s=2e9)
    plain, rated = CostModel(base), CostModel(hw)
    strat = dict(attn="sp", ffn="ep", dispatch="ag-rs", n=2, dtype="fp32")
    one = trace_model(load_model("small"), Strategy(**strat), batch=1, seq=512)
    two = trace_model(load_model("small"), Strategy(**strat, chunks=2), batch=1, seq=512)
    # small: 8 experts / 2 ranks = 4 local experts of [1024, 512] fp32 = 8 MiB per weight, one row
    # segment per expert (index map): each expert GEMM streams 8 MiB, once per chunk
    weight = 4 * 1024 * 512 * 4
    for nd in _expert_wgrads(one) + _expert_wgrads(two):
        assert nd.attr("stream_bytes") == weight, nd.name
        extra = weight / 8e9 * 1e6 + (weight / 2e9 * 1e6 if nd.attr("accumulate", False) else 0.0)
        assert rated.node_time_us(nd) == pytest.approx(plain.node_time_us(nd) + extra), nd.name
    summing = [nd for nd in _expert_wgrads(two) if nd.attr("accumulate", False)]
    assert len(summing) == 3 and all(nd.attr("accumulate_bytes") == weight for nd in summing)
    t1 = sum(rated.node_time_us(nd) for nd in _expert_wgrads(one))
    t2 = sum(rated.node_time_us(nd) for nd in _expert_wgrads(two))
    # chunking the layer in two adds three weight passes and three accumulations: >= 6.3 ms here
    assert t2 - t1 >= 3 * (weight / 8e9 + weight / 2e9) * 1e6 - 2 * 1e3
    assert t2 > 1.3 * t1


def test_all_to_all_fed_expert_gemm_streams_each_expert_per_source_rank():
    from moegraph.ir import Strategy
    from moegraph.registry import load_model
    from moegraph.tracer import trace_model
    g = trace_model(load_model("small"), Strategy(attn="tp", ffn="ep", dispatch="a2a", n=2, dtype="fp32"),
                    batch=1, seq=256)
    fc1 = next(nd for nd in g.nodes if nd.name == "fc1")
    assert fc1.attr("stream_bytes") == 2 * 4 * 1024 * 512 * 4      # 2 source ranks x 4 experts x 2 MiB


def test_a_node_without_the_byte_count_a_rate_needs_is_an_error():
    hw = dataclasses.replace(load_hardware("cpu-2core-gloo-1gbit"), in_step_stream_bw_bytes_s=8e9,
                             accumulate_bw_bytes_s=2e9)
    bare = compute(OpKind.GROUPED_GEMM, flops=10**9, mem_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"node 'x.grouped_gemm' \(grouped_gemm\) has stream_bytes=None, but profile "
                                         r"'cpu-2core-gloo-1gbit' prices it by in_step_stream_bw_bytes_s"):
        CostModel(hw).node_time_us(bare)
    summing = compute(OpKind.GEMM, flops=10**9).with_attrs(accumulate=True)
    with pytest.raises(ValueError, match="has accumulate_bytes=None"):
        CostModel(hw).node_time_us(summing)
    # without the rates the same nodes are priced as before
    plain = CostModel(dataclasses.replace(hw, in_step_stream_bw_bytes_s=0.0, accumulate_bw_bytes_s=0.0))
    assert plain.node_time_us(bare) > 0 and plain.node_time_us(summing) > 0
