"""Pipeline stages (passes/stages.py): layout, rank order, balance, the split pass, P2P pricing."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from moegraph.cost import CostModel
from moegraph.passes.edges import add_edges
from moegraph.passes.stack import stack_layers
from moegraph.ir import GraphError, OpKind, Strategy
from moegraph.passes.stages import (STAGE_ATTR, StageLayout, balance, rank_coords, split_stages, stage_graph,
                                    world_rank)
from moegraph.registry import load_hardware, load_model
from moegraph.tracer import trace_model

SMALL = load_model("small")


def step_graph(layers=4, n=2, cfg=SMALL):
    return add_edges(stack_layers(trace_model(cfg, Strategy("sp", "ep", "ag-rs", n), batch=1, seq=16), layers), vocab=100)


def test_world_rank_order_puts_a_stage_group_on_consecutive_ranks():
    n, dp, P = 4, 2, 3
    ranks = [world_rank(p, d, i, n=n, dp=dp) for p in range(P) for d in range(dp) for i in range(n)]
    assert ranks == list(range(P * n * dp))
    assert all(rank_coords(r, n=n, dp=dp) == (r // 8, r // 4 % 2, r % 4) for r in ranks)
    with pytest.raises(ValueError, match="outside n=4, dp=2"):
        world_rank(0, 2, 0, n=n, dp=dp)


def test_placements():
    loop = StageLayout.even(8, 2, 2)
    assert [loop.rank_of(s) for s in range(4)] == [0, 1, 0, 1] and loop.virtual == 2
    v = StageLayout.even(8, 2, 2, "v")
    assert [v.rank_of(s) for s in range(4)] == [0, 1, 1, 0] and v.stages_of(0) == (0, 3)
    assert StageLayout.even(7, 3).stages == ((0, 1, 2), (3, 4), (5, 6))


@pytest.mark.parametrize("stages, pp, placement, message", [
    (((0,), (1,), (2,)), 2, "loop", "3 stages do not split over pp=2"),
    (((0,), (2,)), 2, "loop", "must hold layers 0..1 in order"),
    (((0,), ()), 2, "loop", "stage 1 holds no layer"),
    (((0,), (1,), (2,), (3,), (4,), (5,)), 2, "v", "placement='v' puts two stages on each rank"),
])
def test_bad_layouts_name_the_problem(stages, pp, placement, message):
    with pytest.raises(ValueError, match=message):
        StageLayout(stages, pp, placement)


def brute_force(costs, stages, first, last):
    best = None
    L = len(costs)
    for cuts in itertools.combinations(range(1, L), stages - 1):
        bounds = (0, *cuts, L)
        loads = [sum(costs[bounds[k]:bounds[k + 1]]) for k in range(stages)]
        loads[0] += first
        loads[-1] += last
        best = max(loads) if best is None else min(best, max(loads))
    return best


def test_balance_is_optimal_against_brute_force():
    rng = random.Random(7)
    for _ in range(40):
        L = rng.randint(2, 9)
        S = rng.randint(1, L)
        costs = [rng.choice([1.0, 2.0, 3.5]) for _ in range(L)]
        first, last = rng.choice([0.0, 1.5]), rng.choice([0.0, 4.0])
        cut = balance(costs, S, first_extra=first, last_extra=last)
        loads = [sum(costs[i] for i in s) for s in cut]
        loads[0] += first
        loads[-1] += last
        assert max(loads) == pytest.approx(brute_force(costs, S, first, last))
        assert [i for s in cut for i in s] == list(range(L))


def test_balance_gives_the_head_stage_fewer_layers():
    cut = balance([1.0] * 7, 3, last_extra=2.0)
    assert [len(s) for s in cut] == [3, 3, 1]


def test_split_computes_the_same_function_with_one_p2p_per_boundary_tensor():
    g = step_graph()
    layout = StageLayout(((0,), (1, 2), (3,)), 3)
    res = split_stages(layout)(g)
    split = res.graph
    p2p = [n for n in split.nodes if n.op is OpKind.P2P]
    assert len(p2p) == 2 * 2                                 # two boundaries, forward and backward each
    assert {(n.attr(STAGE_ATTR), n.attr("to_stage"), n.phase.value) for n in p2p} == {
        (0, 1, "forward"), (1, 2, "forward"), (2, 1, "backward"), (1, 0, "backward")}
    for n in p2p:
        src, dst = split.value[n.inputs[0]], split.value[n.outputs[0]]
        assert (src.shape, src.dtype, src.kind) == (dst.shape, dst.dtype, dst.kind)
        assert n.comm_bytes == src.nbytes and n.group == 2
    # removing the transfers and renaming each received value back gives the original graph
    back = {n.outputs[0]: n.inputs[0] for n in p2p}
    rebuilt = [dataclasses.replace(n, inputs=tuple(back.get(v, v) for v in n.inputs),
                                   attrs=tuple((k, v) for k, v in n.attrs if k != STAGE_ATTR))
               for n in split.nodes if n.op is not OpKind.P2P]
    assert rebuilt == list(g.nodes)
    stage = {n.name: n.attr(STAGE_ATTR) for n in split.nodes}
    assert stage["edges.lm_head"] == 2 and stage["edges.embed.grad_gather"] == 0 and stage["l2.qkv_proj"] == 1


def test_stage_graphs_partition_the_nodes_and_receive_their_boundary():
    split = split_stages(StageLayout.even(4, 2))(step_graph()).graph
    parts = [stage_graph(split, k) for k in range(2)]
    assert sum(len(p.nodes) for p in parts) == sum(n.op is not OpKind.P2P for n in split.nodes)
    assert "l1.hidden_next@s1" in parts[1].inputs and "l1.hidden_next" in parts[0].outputs
    assert "l2.d_hidden_sum1@s0" in parts[0].inputs and "l2.d_hidden_sum1" in parts[1].outputs


def test_aux_loss_crosses_stages_and_is_refused_by_name():
    cfg = dataclasses.replace(SMALL, router_aux_loss_coef=0.01)
    with pytest.raises(GraphError, match="only neighbouring stages exchange tensors"):
        split_stages(StageLayout.even(4, 4))(step_graph(cfg=cfg))


def test_split_refuses_a_split_graph_and_a_layout_of_other_layers():
    split = split_stages(StageLayout.even(4, 2))(step_graph()).graph
    with pytest.raises(GraphError, match="split into stages already"):
        split_stages(StageLayout.even(4, 2))(split)
    with pytest.raises(GraphError, match=r"holds layers \[0, 1, 2, 3\], the layout 6"):
        split_stages(StageLayout.even(6, 2))(step_graph())


def test_p2p_priced_on_the_inter_stage_link():
    hw = load_hardware("h800")
    split = split_stages(StageLayout.even(4, 2))(step_graph()).graph
    node = next(n for n in split.nodes if n.op is OpKind.P2P)
    # kernel latency + one inter-node step + bytes over the pp link at the inter-node ring efficiency
    expected = hw.kernel_latency_us + hw.inter_node_latency_us + node.comm_bytes / (
        hw.pp_link_bw_bytes_s * hw.ring_eff_inter) * 1e6
    assert CostModel(hw).node_time_us(node) == pytest.approx(expected)
    slow = dataclasses.replace(hw, pp_link_bw_bytes_s=hw.pp_link_bw_bytes_s / 4)
    assert CostModel(slow).node_time_us(node) > CostModel(hw).node_time_us(node)


def test_p2p_on_an_emulated_link_has_the_links_whole_rate():
    """A profile calibrated over the emulated link (link_bit_s, one token bucket every rank shares):
    a lone send moves at the link's rate, not at the collectives' per-rank share (B * ring_eff)."""
    hw = load_hardware("cpu-2core-gloo-1gbit")
    split = split_stages(StageLayout.even(4, 2))(step_graph()).graph
    node = next(n for n in split.nodes if n.op is OpKind.P2P)
    comm = hw.in_step_factor("comm")
    assert hw.link_bit_s == 1e9 and hw.link_burst_bytes == 2 * 65536    # the 1gbit bucket (runtime/netns.py)
    hw = dataclasses.replace(hw, link_burst_bytes=0.0)                   # this boundary's 8 KiB fit in it
    expected = hw.kernel_latency_us + (hw.inter_node_latency_us + node.comm_bytes / (1e9 / 8) * 1e6) * comm
    assert CostModel(hw).node_time_us(node) == pytest.approx(expected)
    # the share rule (B * ring_eff) would be slower: 1gbit's collectives reach ~half the link each
    plain = dataclasses.replace(hw, link_bit_s=0.0)
    share = hw.kernel_latency_us + (hw.inter_node_latency_us + node.comm_bytes / (
        hw.nic_bw_bytes_s * hw.ring_eff_inter) * 1e6) * comm
    assert CostModel(plain).node_time_us(node) == pytest.approx(share)
    fixed = hw.kernel_latency_us + hw.inter_node_latency_us * comm
    assert CostModel(plain).node_time_us(node) - fixed > 1.5 * (CostModel(hw).node_time_us(node) - fixed)
    # the token bucket's depth passes at once: only the bytes beyond it take the link's time
    deep = dataclasses.replace(hw, link_burst_bytes=node.comm_bytes / 4)
    assert CostModel(deep).node_time_us(node) - fixed == pytest.approx(0.75 * (expected - fixed))
    drained = dataclasses.replace(hw, link_burst_bytes=2.0 * node.comm_bytes)
    assert CostModel(drained).node_time_us(node) == pytest.approx(fixed)
    # a measured pp link wins over the emulated link's rate
    given = dataclasses.replace(hw, pp_link_bw_bytes_s=50e6)
    assert CostModel(given).node_time_us(node) > CostModel(plain).node_time_us(node)
