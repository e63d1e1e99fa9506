"""Model families beyond Mixtral lower exactly (issue 12, item 3): fp32, 1e-5 relative against the
eager transformers module, output, input gradient and every parameter gradient.

Qwen2-MoE: q/k/v biases, an unnormalised top-k router, a sigmoid-gated dense shared expert.
OLMoE: q/k RMSNorm over the full projection width (a cross-rank reduction under attention tp).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

import runtime_workers as workers  # noqa: E402
from helpers import eager_step, max_grad_err, rel_err  # noqa: E402
from moegraph.cost import CostModel  # noqa: E402
from moegraph.interpreter import interpret  # noqa: E402
from moegraph.ir import OpKind, Phase, Strategy  # noqa: E402
from moegraph.passes import run_pipeline  # noqa: E402
from moegraph.registry import load_hardware  # noqa: E402
from moegraph.tracer import trace_module  # noqa: E402

TOL = 1e-5
B, S, H = workers.B, workers.S, workers.H
COMBOS = [(attn, ffn, dispatch) for attn in ("tp", "sp")
          for ffn, dispatch in (("ep", "a2a"), ("ep", "ag-rs"), ("tp", "ag-rs"))]


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)         # tiny tensors: one thread is fastest on a busy 2-core machine
    yield
    torch.set_num_threads(old)


def check(layer, call, strategy, rng, passes=""):
    x, dy = torch.randn(B, S, H, generator=rng), torch.randn(B, S, H, generator=rng)
    y_ref, dx_ref, grads_ref = eager_step(layer, x, dy, call=call)
    graph = trace_module(layer, strategy, batch=B, seq=S)
    if passes:
        graph, _ = run_pipeline(graph, passes, cost=CostModel(load_hardware("h800")))
    res = interpret(graph, {k: p.detach() for k, p in layer.named_parameters()}, x, dy)
    assert rel_err(res.output, y_ref) < TOL
    assert rel_err(res.input_grad, dx_ref) < TOL
    assert set(res.param_grads) == set(grads_ref)
    name, err = max_grad_err(res.param_grads, grads_ref)
    assert err < TOL, f"gradient of {name}: {err:.2e}"
    return graph


def _seed(rng) -> int:
    return int(torch.randint(0, 2**31, (1,), generator=rng))


@pytest.mark.parametrize("attn,ffn,dispatch", COMBOS)
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_family_matches_eager(family, attn, ffn, dispatch, n, rng):
    layer, call = workers.LAYERS[family](_seed(rng))
    check(layer, call, Strategy(attn, ffn, dispatch, n, dtype="fp32"), rng)


@pytest.mark.parametrize("attn,n", [("tp", 2), ("tp", 4), ("sp", 2), ("tp", 1)])
def test_olmoe_qk_norm_reduces_across_ranks_only_under_attention_tp(attn, n):
    layer, _ = workers.olmoe_layer(0)
    g = trace_module(layer, Strategy(attn, "ep", "a2a", n), batch=B, seq=S)
    fwd = [nd for nd in g.nodes if nd.phase is Phase.FORWARD and nd.block == "attention"]
    reduced = [nd.name for nd in fwd if nd.op is OpKind.ALL_REDUCE]
    if attn == "tp" and n > 1:
        assert reduced == ["q_norm_allreduce", "k_norm_allreduce"]
        assert g.node["q_norm_allreduce"].comm_bytes == 2 * (n - 1) * B * S * 4 // n   # [b, s, 1] fp32
        assert sum(nd.op is OpKind.RMSNORM_SHARDED for nd in fwd) == 2
    else:
        assert not reduced and sum(nd.op is OpKind.RMSNORM for nd in fwd) == 3    # input norm, q, k


@pytest.mark.parametrize("attn,ffn,dispatch", [("sp", "ep", "a2a"), ("tp", "tp", "ag-rs")])
def test_qwen2_moe_through_the_default_passes_and_chunks(attn, ffn, dispatch, rng):
    layer, call = workers.qwen2_moe_layer(_seed(rng))
    graph = check(layer, call, Strategy(attn, ffn, dispatch, 2, dtype="fp32"), rng,
                  passes="gate-reorder,chunk=2,sar=paper")
    assert graph.strategy.chunks == 2 and graph.strategy.gate == "before-fc2"


def test_qwen2_moe_variants_normalised_router_and_no_biases(rng):
    layer, call = workers.qwen2_moe_layer(_seed(rng), norm_topk_prob=True, qkv_bias=False)
    graph = check(layer, call, Strategy("sp", "ep", "a2a", 2, dtype="fp32"), rng)
    assert not any(nd.op is OpKind.BIAS for nd in graph.nodes)


def test_the_shared_expert_does_not_wait_for_the_dispatch():
    """Its forward GEMMs depend on the block input only, so a scheduler may overlap them with the
    dispatch all-to-all (Megatron-Core's shared-expert overlap)."""
    layer, _ = workers.qwen2_moe_layer(0)
    g = trace_module(layer, Strategy("sp", "ep", "a2a", 2), batch=B, seq=S)
    shared = [nd for nd in g.nodes if nd.phase is Phase.FORWARD and nd.name.startswith("shared_")
              and nd.name != "shared_add"]
    assert {nd.op for nd in shared} >= {OpKind.GEMM, OpKind.SWIGLU, OpKind.SIGMOID_GATE}

    def upstream(node, seen=None):
        seen = set() if seen is None else seen
        for p in g.predecessors(node):
            if p.name not in seen:
                seen.add(p.name)
                upstream(p, seen)
        return seen
    dispatch = {nd.name for nd in g.nodes if nd.op is OpKind.ALL_TO_ALL and nd.block == "ffn"
                and nd.phase is Phase.FORWARD}
    assert dispatch and all(not (upstream(nd) & dispatch) for nd in shared)
    assert upstream(g.node["shared_add"]) & dispatch           # the sum does wait for the combine


def test_qwen2_moe_dense_layer_is_named():
    from moegraph.lowering import LoweringError
    layer, _ = workers.qwen2_moe_layer(0, mlp_only_layers=[0])
    with pytest.raises(LoweringError, match=r"'mlp' \(transformers\.models\.qwen2_moe\.modeling_qwen2_moe\.Qwen2MoeMLP\)"):
        trace_module(layer, Strategy("sp", "ep", "a2a", 2), batch=B, seq=S)


def test_families_compiled_on_two_gloo_ranks_match_eager():
    """One small case per family through moegraph.compile (one process group for both)."""
    from moegraph.runtime.launch import spawn
    seed = int.from_bytes(os.urandom(3), "little")
    cases = [dict(attn="sp", ffn="ep", dispatch="a2a", model="qwen2_moe", passes="gate-reorder,sar=paper"),
             dict(attn="tp", ffn="tp", dispatch="ag-rs", model="olmoe", passes="gate-reorder,sar=paper")]
    results, _ = spawn(workers.check_cases, 2, args=(cases, seed), timeout_s=300)
    for res, ops in zip(results, ({"bias", "sigmoid_gate"}, {"square_sum", "rmsnorm_sharded", "all_reduce"})):
        assert res["max_rel_err_output"] < TOL, res
        assert res["max_rel_err_grads"] < TOL, res
        assert ops <= set(res["ops"]), res
