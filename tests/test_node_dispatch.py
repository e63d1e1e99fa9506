"""The node-spanning token dispatch (Strategy.ep_nodes > 1; moegraph.lowering.node_dispatch): its
index maps on hand-made routings, its lowering's bytes from first principles, its numerics against
the eager module (the interpreter here; 4 gloo ranks in tests/test_runtime.py), and its refusals."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_interpreted_matches_eager, small_layer
from moegraph.cost import CostModel
from moegraph.index_map import build_index_map
from moegraph.ir import ConfigError, OpKind, Strategy
from moegraph.passes import run_pipeline
from moegraph.registry import load_hardware, load_model
from moegraph.tracer import trace_model

TOL = 1e-5
B, S, H = 2, 16, 64
H800 = CostModel(load_hardware("h800"))


def test_by_node_map_sends_each_token_once_per_destination_node():
    # n = 4 ranks, 2 per node, 2 experts per rank: experts 0-3 on node 0, 4-7 on node 1
    experts = torch.tensor([[0, 5], [4, 6], [1, 3]])
    m = build_index_map(experts, "by_node", 2, rank=0, n=4, node_ranks=2)
    # token 0 goes to both nodes; token 1 twice to node 1 and token 2 twice to node 0: one row each
    assert m.flat.tolist() == [0, 4, 1, 2]               # token * k + its first slot on the node
    assert m.tokens.tolist() == [0, 2, 0, 1] and m.splits == (2, 2)


def test_in_node_map_keeps_this_nodes_experts_grouped_by_local_rank():
    relay = torch.tensor([[0, 5], [4, 6]])               # the tokens a rank of node 1 received
    m = build_index_map(relay, "in_node", 2, rank=3, n=4, node_ranks=2)
    assert m.flat.tolist() == [2, 1, 3]                  # experts 4, 5, 6: slots (1, 0), (0, 1), (1, 1)
    assert m.splits == (2, 1) and m.sources == 2         # local rank 0 holds experts 4-5, rank 1 6-7
    other = build_index_map(relay, "in_node", 2, rank=1, n=4, node_ranks=2)
    assert other.flat.tolist() == [0] and other.splits == (1, 0)


def test_deepseek_v3_over_8_nodes_sends_under_half_the_rows_over_the_nics():
    """EP64 over 8 nodes, 2048 tokens per rank, top-8 among 4 of 8 node-aligned groups: a token
    reaches 4 nodes and, its 8 experts uniform over them, 4 (1 - (3/4)^8) = 3.60 distinct ones."""
    cfg = load_model("deepseek-v3")
    strategy = Strategy("sp", "ep", "a2a", 64, ep_nodes=8)
    g = trace_model(cfg, strategy, batch=32, seq=4096)
    flat = trace_model(cfg, Strategy("sp", "ep", "a2a", 64), batch=32, seq=4096)
    T, k, h = 2048, cfg.top_k, cfg.hidden
    rows = math.ceil(T * 4 * (1 - 0.75 ** 8))
    rows = -(-rows // 8) * 8                             # the rail splits its buffer into 8 shards
    rail, node = g.node["node_a2a"], g.node["dispatch_a2a"]
    assert (rail.group, rail.attr("axis"), rail.attr("scope")) == (8, "rail", "inter")
    assert (node.group, node.attr("axis"), node.attr("scope")) == (8, "node", "intra")
    assert rail.comm_bytes == rows * h * 2 * 7 // 8
    assert node.comm_bytes == T * k * h * 2 * 7 // 8
    assert flat.node["dispatch_a2a"].comm_bytes == T * k * h * 2 * 63 // 64
    assert rail.comm_bytes < 0.5 * flat.node["dispatch_a2a"].comm_bytes
    assert H800.node_time_us(rail) + H800.node_time_us(node) < H800.node_time_us(flat.node["dispatch_a2a"])


@pytest.mark.parametrize("passes,dp", [("", 1), ("gate-reorder", 1), ("chunk=2,sar=paper", 1),
                                       ("gate-reorder,chunk=2,sar=paper,fuse=all", 1), ("gate-reorder,sar=paper", 2)])
def test_matches_eager_in_the_interpreter(passes, dp, rng):
    """2 nodes of 2 ranks (and, with dp=2, two such replicas: the node and rail groups per replica)."""
    layer = small_layer(4, seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
    x, dy = torch.randn(B, S, H, generator=rng), torch.randn(B, S, H, generator=rng)
    graph = assert_interpreted_matches_eager(layer, Strategy("sp", "ep", "a2a", 4, dtype="fp32", ep_nodes=2, dp=dp),
                                             x, dy, TOL, passes, H800)
    assert {n.attr("axis", None) for n in graph.nodes if n.op is OpKind.ALL_TO_ALL and n.block == "ffn"} == \
        {"rail", "node"}


def test_ep_fp8_compresses_both_hops_of_the_dispatch():
    g = trace_model(load_model("deepseek-v3"), Strategy("sp", "ep", "a2a", 64, ep_nodes=8), batch=32, seq=4096)
    report = run_pipeline(g, "compress=ep-fp8", cost=H800)[1]["compress"]
    # both hops, forward and the combine's gradient in backward (sorted names)
    assert report["compressed"] == ["combine_a2a.bwd", "dispatch_a2a", "node_a2a", "node_combine_a2a.bwd"]


@pytest.mark.parametrize("kw,message", [
    (dict(dispatch="ag-rs"), "ep_nodes=2 needs ffn='ep' and dispatch='a2a'"),
    (dict(n=8, ep_nodes=3), "ep_nodes=3 must divide n=8 into nodes of at least 2 ranks"),
    (dict(n=2, ep_nodes=2), "ep_nodes=2 must divide n=2 into nodes of at least 2 ranks"),
])
def test_a_strategy_the_dispatch_cannot_span_is_refused(kw, message):
    args = dict(attn="sp", ffn="ep", dispatch="a2a", n=4, ep_nodes=2) | kw
    with pytest.raises(ConfigError, match=message):
        Strategy(**args)


def test_dispatch_auto_keeps_the_all_to_all_when_it_spans_nodes():
    g = trace_model(load_model("mixtral-8x7b"), Strategy("sp", "ep", "a2a", 8, ep_nodes=2), batch=1, seq=8192)
    out, report = run_pipeline(g, "dispatch=auto", cost=H800)
    assert report["dispatch"]["chosen"] == "a2a" and out.strategy.ep_nodes == 2
    with pytest.raises(Exception, match="dispatch='ag-rs' with ep_nodes=2: these need the all-to-all"):
        run_pipeline(g, "dispatch=ag-rs", cost=H800)


def test_dispatch_auto_tries_the_node_spanning_all_to_all_when_the_group_spans_nodes():
    g = trace_model(load_model("deepseek-v2"), Strategy("sp", "ep", "a2a", 16), batch=8, seq=4096)
    out, report = run_pipeline(g, "dispatch=auto", cost=H800)
    r = report["dispatch"]
    assert set(r["predicted_us"]) == {"a2a", "ag-rs", "a2a ep_nodes=2"}          # 16 ranks: 2 nodes of 8
    assert r["predicted_us"]["a2a ep_nodes=2"] < r["predicted_us"]["a2a"]
    best = min(r["predicted_us"], key=r["predicted_us"].get)
    assert (r["chosen"], r["ep_nodes"]) == (("a2a", 2) if best == "a2a ep_nodes=2" else (best, 1))
    assert out.strategy.ep_nodes == r["ep_nodes"]
    one_node = run_pipeline(trace_model(load_model("deepseek-v2"), Strategy("sp", "ep", "a2a", 8), batch=4,
                                        seq=4096), "dispatch=auto", cost=H800)[1]["dispatch"]
    assert set(one_node["predicted_us"]) == {"a2a", "ag-rs"}
