"""Per-module parallelism (Strategy.attn_nodes = N; moegraph.token_layout): the attention runs TP or
SP on the G = n/N ranks of a node, on b/N of the batch, while the experts stay EP over all n ranks.

The layout's slices by explicit indexing; the lowering's groups, axes and bytes; numerics against the
eager module in the interpreter (4 gloo ranks in tests/test_runtime.py, whole models in
tests/test_model.py); the attention's collectives priced on NVLink; the refusals."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_interpreted_matches_eager, eager_step, rel_err, small_layer
from moegraph.config import CompileConfig
from moegraph.cost import CostModel
from moegraph.interpreter import interpret
from moegraph.ir import ConfigError, OpKind, Role, Strategy
from moegraph.pass_steps import Dispatch
from moegraph.passes import run_pipeline
from moegraph.registry import load_hardware
from moegraph.schedules.driver import lower
from moegraph.token_layout import gathered_tokens, shard_tokens, unshard_tokens
from moegraph.tracer import trace_module

TOL = 1e-5
B, S, H = 4, 16, 64
H100 = CostModel(load_hardware("h100"))


def test_rank_holds_its_nodes_rows_and_its_local_sequence_shard():
    x = torch.arange(B * S).view(B, S)                    # token (row, position) -> row * S + position
    folded = Strategy("tp", "ep", "a2a", 4, attn_nodes=2)  # 2 nodes of 2 ranks
    assert torch.equal(shard_tokens(x, folded, 0), x[0:2, 0:8])
    assert torch.equal(shard_tokens(x, folded, 3), x[2:4, 8:16])       # node 1, local rank 1
    assert torch.equal(unshard_tokens([shard_tokens(x, folded, r) for r in range(4)], folded), x)
    assert torch.equal(gathered_tokens(x, folded), torch.cat([x[0:2, 0:8], x[0:2, 8:16], x[2:4, 0:8], x[2:4, 8:16]], 1))
    flat = Strategy("tp", "ep", "a2a", 4)                 # N = 1: MegaScale-MoE's [b, s/n] shards
    assert torch.equal(shard_tokens(x, flat, 3), x[:, 12:16])
    with pytest.raises(ValueError, match="3 rows, not divisible by attn_nodes=2"):
        shard_tokens(x[:3], folded, 0)


@pytest.mark.parametrize("attn", ["tp", "sp"])
@pytest.mark.parametrize("n,nodes,extra,passes", [
    (4, 2, {}, ""),
    (4, 2, {"ep_nodes": 2}, "chunk=2,sar=paper,gate-reorder"),   # with the node-spanning dispatch
    (2, 2, {}, ""),                                               # one rank per node: attention unsharded
    (4, 4, {}, ""),
    (4, 4, {"ep_nodes": 2}, "gate-reorder"),                    # attentions finer than the dispatch's nodes
    (4, 2, {"dp": 2}, "sar=paper"),                              # the rail sum, then the DP sync
])
def test_matches_eager_in_the_interpreter(attn, n, nodes, extra, passes, rng):
    layer = small_layer(n, seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
    x, dy = torch.randn(B, S, H, generator=rng), torch.randn(B, S, H, generator=rng)
    assert_interpreted_matches_eager(layer, Strategy(attn, "ep", "a2a", n, dtype="fp32", attn_nodes=nodes, **extra),
                                     x, dy, TOL, passes, H100)


def test_a_gqa_model_spans_more_ranks_than_it_has_kv_heads():
    """Qwen3-235B-A22B has 4 kv heads: its attention cannot span 32 ranks, but EP32 over 8 nodes of
    4 ranks can, each node's attention tensor-parallel over its 4 ranks on b/8 of the batch."""
    config = dict(model="qwen3-235b-a22b", batch=8, seq=4096, hardware="h100", passes=())
    # the refusal names the fold that works: the fewest groups whose ranks divide the heads
    with pytest.raises(ConfigError, match=r"n=32 does not divide kv_heads=4; the experts can still span n=32: with "
                                          r"dispatch='a2a', attn_nodes=8 \(--attn-nodes 8\) runs the attention on n/8=4"):
        lower(CompileConfig(strategy=Strategy("tp", "ep", "a2a", 32), **config))
    with pytest.raises(ConfigError, match=r"runs the attention on n/8=4 ranks over b/8 of the batch \(--batch a "
                                          r"multiple of 8: b=2\); or a multiple of 8 if fewer than 4 GPUs share a "
                                          r"node$"):       # and the batch it needs, when it lacks it; the node's limit
        lower(CompileConfig(strategy=Strategy("tp", "ep", "a2a", 32), **config | {"batch": 2}))
    with pytest.raises(ConfigError, match=r"n=16 does not divide kv_heads=8$"):     # no hint: 8 experts cannot span 16
        lower(CompileConfig(strategy=Strategy("tp", "ep", "a2a", 16), **config | {"model": "mixtral-8x7b"}))
    g = lower(CompileConfig(strategy=Strategy("tp", "ep", "a2a", 32, attn_nodes=8), **config)).graph
    h = g.dims.h
    assert g.value["hidden"].shape == (1, 1024, h)                        # [b/N, s/G, h]
    attn = [nd for nd in g.nodes if nd.is_comm and nd.block == "attention" and nd.role is not Role.WGRAD]
    assert attn and {(nd.group, nd.attr("axis")) for nd in attn} == {(4, "attn")}
    gather = g.node["ln1_ag"]                                             # [b/N, s/G, h] -> [b/N, s, h]
    assert gather.comm_bytes == 1 * 4096 * h * 2 * 3 // 4
    assert {H100.scope(nd) for nd in attn} == {"intra"}                   # priced on NVLink
    dispatch = g.node["dispatch_a2a"]                                     # the experts: every rank's tokens
    assert (dispatch.group, dispatch.attr("axis", "mp")) == (32, "mp")
    # the attention's shards are the same on every node: their gradients are summed over attn_dp,
    # one rank per node: across the NICs
    summed = [nd for nd in g.nodes if nd.attr("axis", None) == "attn_dp"]
    sharded = {p for p, spec in g.params if spec.shard_dim is not None and spec.shard_ranks == 4}
    assert sharded and {nd.name.removesuffix(".grad_attn_dp_allreduce") for nd in summed} == sharded
    assert {(nd.op, nd.group, H100.scope(nd)) for nd in summed} == {(OpKind.ALL_REDUCE, 8, "inter")}


def test_dispatch_auto_keeps_the_all_to_all_a_folded_attention_needs():
    """A folded attention's experts take tokens from every rank's own rows: only the all-to-all
    can carry them. dispatch=auto keeps it (and tries the node-spanning all-to-all only where each
    attention group lies within one of its nodes); dispatch=ag-rs is refused in one line naming the
    field. Until 2026-11-28 'auto' tried ag-rs and its re-lowering failed the whole compile."""
    config = dict(model="qwen3-235b-a22b", batch=8, seq=4096, hardware="h100")
    strategy = Strategy("tp", "ep", "a2a", 32, attn_nodes=8)
    out = lower(CompileConfig(strategy=strategy, passes=(Dispatch("auto"),), **config))
    report = out.report["dispatch"]
    assert report["chosen"] == "a2a" and set(report["predicted_us"]) == {"a2a", "a2a ep_nodes=4"}
    assert out.graph.strategy.attn_nodes == 8 and out.graph.strategy.ep_nodes == report["ep_nodes"]
    # n = 4 lies within one node: only the flat all-to-all
    g = trace_module(small_layer(4), Strategy("tp", "ep", "a2a", 4, attn_nodes=2), batch=B, seq=S)
    _, rep = run_pipeline(g, "dispatch=auto", cost=H100)
    assert set(rep["dispatch"]["predicted_us"]) == {"a2a"}
    with pytest.raises(Exception, match="dispatch='ag-rs' with attn_nodes=2: these need the all-to-all"):
        run_pipeline(g, "dispatch=ag-rs", cost=H100)


def test_the_attention_on_the_node_leaves_the_nics_to_the_experts():
    """DeepSeek-V3 EP64 on h100: with the attention TP over each node's 8 ranks its collectives leave
    the NICs (priced on NVLink), where SP over all 64 ranks sends them across nodes."""
    config = dict(model="deepseek-v3", batch=8, seq=4096, hardware="h100", passes=())

    def attention_comm_us(strategy):
        g = lower(CompileConfig(strategy=strategy, **config)).graph
        comm = [nd for nd in g.nodes if nd.is_comm and nd.block == "attention" and nd.role is not Role.WGRAD]
        return sum(H100.node_time_us(nd) for nd in comm), {H100.scope(nd) for nd in comm}

    flat_us, flat_scopes = attention_comm_us(Strategy("sp", "ep", "a2a", 64))
    node_us, node_scopes = attention_comm_us(Strategy("tp", "ep", "a2a", 64, attn_nodes=8))
    assert (flat_scopes, node_scopes) == ({"inter"}, {"intra"})
    assert node_us < 0.5 * flat_us


@pytest.mark.parametrize("kw,message", [
    (dict(dispatch="ag-rs"), "attn_nodes=2 needs ffn='ep' and dispatch='a2a'"),
    (dict(ffn="tp", dispatch="ag-rs"), "attn_nodes=2 needs ffn='ep' and dispatch='a2a'"),
    (dict(n=6, attn_nodes=4), "attn_nodes=4 must divide n=6"),
    (dict(n=8, ep_nodes=4), "attn_nodes=2 must be a multiple of ep_nodes=4"),
    (dict(attn_nodes=0), "attn_nodes=0 must be a positive integer"),
])
def test_a_strategy_the_attention_cannot_fold_is_refused(kw, message):
    args = dict(attn="tp", ffn="ep", dispatch="a2a", n=4, attn_nodes=2) | kw
    with pytest.raises(ConfigError, match=message):
        Strategy(**args)


def test_a_batch_the_nodes_cannot_split_is_refused():
    with pytest.raises(ConfigError, match="attn_nodes=2 does not divide the batch b=3"):
        trace_module(small_layer(4), Strategy("tp", "ep", "a2a", 4, attn_nodes=2), batch=3, seq=S)


def test_the_shards_gradient_sum_is_priced_on_the_link_its_ranks_span():
    """attn_dp's N ranks are strided over all n: within one node of 8 when n = 8 (NVLink), across
    nodes when n = 32 (the NICs), whatever N is (attr span = n)."""
    def summed_scopes(n, nodes):
        g = lower(CompileConfig(model="qwen3-235b-a22b", strategy=Strategy("tp", "ep", "a2a", n, attn_nodes=nodes),
                                batch=8, seq=4096, hardware="h100", passes=())).graph
        return {(nd.group, nd.attr("span"), H100.scope(nd)) for nd in g.nodes if nd.attr("axis", None) == "attn_dp"}
    assert summed_scopes(8, 2) == {(2, 8, "intra")}
    assert summed_scopes(32, 8) == {(8, 32, "inter")}


def test_a_compressed_reduce_scatter_stays_on_the_attentions_ranks(rng):
    """compress=tp-fp8 rewrites the attention's reduce-scatter into an FP8 all-to-all: it keeps axis
    'attn' and its group of G (it once fell back to the whole group, which the interpreter refuses),
    and the layer still rounds only within FP8's precision."""
    layer = small_layer(4, seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
    x, dy = torch.randn(B, S, H, generator=rng), torch.randn(B, S, H, generator=rng)
    graph = trace_module(layer, Strategy("tp", "ep", "a2a", 4, dtype="fp32", attn_nodes=2), batch=B, seq=S)
    out = run_pipeline(graph, "compress=tp-fp8", cost=H100)[0]
    rs = out.node["attn_rs"]
    assert (rs.op, rs.group, rs.attr("axis"), rs.attr("compressed")) == (OpKind.ALL_TO_ALL, 2, "attn", "fp8")
    res = interpret(out, {k: p.detach() for k, p in layer.named_parameters()}, x, dy)
    y, _, _ = eager_step(layer, x, dy)
    assert TOL < rel_err(res.output, y) < 2.0**-4
