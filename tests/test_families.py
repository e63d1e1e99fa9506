"""Model families beyond Mixtral lower exactly (issue 12, item 3): fp32, 1e-5 relative against the
eager transformers module, output, input gradient and every parameter gradient.

Qwen2-MoE: q/k/v biases, an unnormalised top-k router, a sigmoid-gated dense shared expert.
OLMoE: q/k RMSNorm over the full projection width (a cross-rank reduction under attention tp).
DeepSeek-V3: multi-head latent attention, a sigmoid grouped router with a score-correction bias
(a buffer), a shared expert, and dense first layers.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import runtime_workers as workers  # noqa: E402
from helpers import RANK_BATCH, eager_step, fresh_seed, max_grad_err, rel_err  # noqa: E402
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


pytestmark = pytest.mark.usefixtures("one_thread")      # conftest: tiny tensors, one torch thread


def check(layer, call, strategy, rng, passes=""):
    x, dy = torch.randn(B, S, H, generator=rng), torch.randn(B, S, H, generator=rng)
    y_ref, dx_ref, grads_ref = eager_step(layer, x, dy, call=call)
    graph = trace_module(layer, strategy, batch=B, seq=S)
    if passes:
        graph, _ = run_pipeline(graph, passes, cost=CostModel(load_hardware("h800")))
    res = interpret(graph, {k: t.detach() for k, t in [*layer.named_parameters(), *layer.named_buffers()]}, x, dy)
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
@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "deepseek_v3", "deepseek_v3_dense"])
@pytest.mark.slow
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


def _gemma_normed_olmoe_layer(seed: int):
    """OLMoE's layer with every RMSNorm (input, post-attention, the full-width q and k norms) swapped
    for a Gemma-style one, which scales by 1 + weight (MiniMax-M3's class)."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLRMSNorm
    layer, call = workers.olmoe_layer(seed)
    gen = torch.Generator().manual_seed(seed)
    for owner, name in ((layer, "input_layernorm"), (layer, "post_attention_layernorm"),
                        (layer.self_attn, "q_norm"), (layer.self_attn, "k_norm")):
        old = getattr(owner, name)
        norm = MiniMaxM3VLRMSNorm(old.weight.shape[0], eps=old.variance_epsilon)
        with torch.no_grad():
            norm.weight.normal_(0, 0.2, generator=gen)
        setattr(owner, name, norm)
    return layer, call


@pytest.mark.parametrize("attn,n", [("tp", 2), ("sp", 2), ("tp", 1)])
def test_gemma_style_norms_scale_by_one_plus_weight_on_every_norm_path(attn, n, rng):
    """A norm scaling by 1 + weight lowers with offset 1 on each of its paths (the whole-row RMSNORM,
    OLMoE's q/k norm split across ranks under attention tp: RMSNORM_SHARDED) and matches eager;
    read as a plain RMSNorm (offset 0) every output would be off by the missing x / rms(x)."""
    layer, call = _gemma_normed_olmoe_layer(_seed(rng))
    graph = check(layer, call, Strategy(attn, "ep", "a2a", n, dtype="fp32"), rng)
    norms = [nd for nd in graph.nodes if nd.op in (OpKind.RMSNORM, OpKind.RMSNORM_SHARDED)]
    assert norms and all(nd.attr("offset") == 1.0 for nd in norms)
    assert any(nd.op is OpKind.RMSNORM_SHARDED for nd in norms) == (attn == "tp" and n > 1)


def test_a_plain_rmsnorm_carries_no_offset():
    layer, _ = workers.olmoe_layer(0)
    g = trace_module(layer, Strategy("tp", "ep", "a2a", 2), batch=B, seq=S)
    norms = [nd for nd in g.nodes if nd.op in (OpKind.RMSNORM, OpKind.RMSNORM_SHARDED)]
    assert norms and not any(nd.attr("offset", None) is not None for nd in norms)


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


@pytest.mark.parametrize("family,ops", [("qwen2_moe", {OpKind.GEMM, OpKind.SWIGLU, OpKind.SIGMOID_GATE}),
                                        ("deepseek_v3", {OpKind.GEMM, OpKind.SWIGLU})])
def test_the_shared_expert_does_not_wait_for_the_dispatch(family, ops):
    """Its forward GEMMs depend on the block input only, so a scheduler may overlap them with the
    dispatch all-to-all (Megatron-Core's shared-expert overlap)."""
    layer, _ = workers.LAYERS[family](0)
    g = trace_module(layer, Strategy("sp", "ep", "a2a", 2), batch=B, seq=S)
    shared = [nd for nd in g.nodes if nd.phase is Phase.FORWARD and nd.name.startswith("shared_")
              and nd.name != "shared_add"]
    assert {nd.op for nd in shared} == ops

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


@pytest.mark.parametrize("attn,ffn,dispatch", [("sp", "ep", "a2a"), ("tp", "tp", "ag-rs")])
def test_qwen2_moe_dense_layer_matches_eager(attn, ffn, dispatch, rng):
    """mlp_only_layers: a Qwen2MoeMLP instead of the MoE block (no router, no dispatch)."""
    layer, call = workers.qwen2_moe_layer(_seed(rng), mlp_only_layers=[0])
    graph = check(layer, call, Strategy(attn, ffn, dispatch, 2, dtype="fp32"), rng)
    assert graph.dims.experts == 0 and not any(nd.op is OpKind.ROUTER for nd in graph.nodes)


@pytest.mark.parametrize("family,attn,ffn,dispatch", [("deepseek_v3", "tp", "ep", "a2a"),
                                                      ("deepseek_v3_dense", "sp", "tp", "ag-rs")])
def test_deepseek_v3_through_the_default_passes_and_chunks(family, attn, ffn, dispatch, rng):
    layer, call = workers.LAYERS[family](_seed(rng))
    graph = check(layer, call, Strategy(attn, ffn, dispatch, 2, dtype="fp32"), rng,
                  passes="gate-reorder,chunk=2,sar=paper")
    assert graph.strategy.chunks == 2
    assert sum(nd.op is OpKind.MLA_HEADS and nd.phase is Phase.FORWARD for nd in graph.nodes) == 2   # one per chunk


def test_deepseek_v3_variants_direct_q_projection_rotate_half_rope_one_group(rng):
    """q_lora_rank=None (a plain q_proj, as DeepSeek-V2-Lite), rope_interleave=False, n_group=1,
    no renormalisation of the top-k scores."""
    layer, call = workers.deepseek_v3_layer(_seed(rng), q_lora_rank=None, rope_interleave=False, n_group=1,
                                            topk_group=1, norm_topk_prob=False)
    check(layer, call, Strategy("tp", "ep", "ag-rs", 2, dtype="fp32"), rng)


@pytest.mark.parametrize("layer_idx", [0, 60])
def test_deepseek_v3_at_its_real_size_lowers(layer_idx):
    """transformers' default DeepseekV3Config is DeepSeek-V3 671B (arXiv 2412.19437 §4.2): h=7168,
    128 heads, q/kv ranks 1536/512, q/k heads 128+64 wide, v heads 128; the first 3 layers dense
    (h_ffn 18432), the rest 256 routed experts (h_ffn 2048), top-8 of the best 4 of 8 groups, scores
    scaled by 2.5, one shared expert. Traced on the meta device (nothing allocated)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
    with torch.device("meta"):
        layer = m.DeepseekV3DecoderLayer(DeepseekV3Config(), layer_idx)
    n, s = 8, 4096
    g = trace_module(layer, Strategy("sp", "ep", "a2a", n), batch=1, seq=s)
    assert (g.dims.h, g.dims.heads, g.dims.head_dim) == (7168, 128, 192)
    assert g.value["q_b_proj.weight"].shape == (128 * 192, 1536) and g.value["kv_b_proj.weight"].shape == (128 * 256, 512)
    # Ulysses in: q and k 192 wide, v 128 wide per head, bf16, (n-1)/n of this rank's s/n tokens
    assert g.node["qkv_a2a"].comm_bytes == (n - 1) * (s // n) * 128 * (2 * 192 + 128) * 2 // n
    if layer_idx == 0:
        assert (g.dims.experts, g.dims.k, g.dims.ffn) == (0, 0, 18432)
        assert not any(nd.op in (OpKind.ROUTER, OpKind.GROUPED_GEMM) for nd in g.nodes)
    else:
        assert (g.dims.experts, g.dims.k, g.dims.ffn) == (256, 8, 2048)
        router = g.node["router"]
        assert (router.attr("scoring"), router.attr("groups"), router.attr("topk_groups"), router.attr("scale")) == \
            ("sigmoid", 8, 4, 2.5)
        assert g.value["shared.w1"].shape == (2048, 7168)


def test_deepseek_v3_router_bias_is_a_buffer_read_for_the_choice_only():
    layer, _ = workers.deepseek_v3_layer(0)
    g = trace_module(layer, Strategy("sp", "ep", "a2a", 2), batch=B, seq=S)
    assert g.param_spec["router.score_bias"].buffer and "router.score_bias" not in g.grad_of
    assert g.node["router"].inputs[2] == "router.score_bias"
    assert not any("router.score_bias" in nd.outputs for nd in g.nodes)


@pytest.mark.parametrize("attn,n", [("sp", 2), ("sp", 4), ("tp", 2)])
def test_mla_communication_follows_the_architecture(attn, n):
    """Ulysses moves each head's query and key (dn + dr wide) and value (dv wide): per rank
    (n-1)/n of b*(s/n)*H*(2(dn+dr) + dv) elements each way in, H*dv back. Under tp the replicated
    down projections' and norms' gradients are all-reduced and the heads never move."""
    layer, _ = workers.deepseek_v3_layer(0)
    g = trace_module(layer, Strategy(attn, "ep", "a2a", n, dtype="fp32"), batch=B, seq=S)
    heads, dn, dr, dv = 8, 12, 8, 16
    if attn == "sp":
        assert g.node["qkv_a2a"].comm_bytes == (n - 1) * B * (S // n) * heads * (2 * (dn + dr) + dv) * 4 // n
        assert g.node["attn_a2a"].comm_bytes == (n - 1) * B * S * heads * dv * 4 // n // n
    else:
        assert not any(nd.op is OpKind.ALL_TO_ALL and nd.block == "attention" for nd in g.nodes)
        reduced = {nd.name for nd in g.nodes if nd.op is OpKind.ALL_REDUCE}
        for p in ("q_a_proj.weight", "kv_a_proj.weight", "q_a_norm.weight", "kv_a_norm.weight"):
            assert f"{p}.grad_allreduce" in reduced
        assert g.value["q_b_proj.weight"].shape == (heads // n * (dn + dr), 24)    # cut by heads
    assert g.value["v_heads"].shape[-1] * (dn + dr) == g.value["q_heads"].shape[-1] * dv


# Every family on 2 gloo ranks: strategies, default passes on one case each, a routing that sends
# a rank no rows. Runs in the suite's shared 2-rank spawn (helpers.RankBatch).
SPECIAL = [(dict(attn="sp", ffn="ep", dispatch="a2a", model="qwen2_moe", passes="gate-reorder,sar=paper"),
            {"bias", "sigmoid_gate"}),
           (dict(attn="tp", ffn="tp", dispatch="ag-rs", model="olmoe", passes="gate-reorder,sar=paper"),
            {"square_sum", "rmsnorm_sharded", "all_reduce"}),
           (dict(attn="tp", ffn="ep", dispatch="a2a", model="deepseek_v3", passes="gate-reorder,sar=paper"),
            {"mla_heads", "router", "all_to_all"}),
           (dict(attn="sp", ffn="tp", dispatch="ag-rs", model="deepseek_v3_dense"), {"mla_heads", "reduce_scatter"}),
           (dict(attn="sp", ffn="ep", dispatch="a2a", model="deepseek_v3_skewed"), {"all_to_all"})]  # no rows back
FAMILY_CASES = [c for c, _ in SPECIAL] + workers.FAMILY_CASES
FAMILIES = RANK_BATCH.add(2, "families.check_cases", workers.check_cases, FAMILY_CASES,
                          fresh_seed())


def test_families_compiled_on_two_gloo_ranks_match_eager(rank_results):
    """Every strategy of every family through moegraph.compile on 2 gloo ranks (one process group
    for all; ~7 s on an idle 2-core machine), plus the default passes on one case each and a
    routing that sends a rank no rows. Every rank's results are checked, not only rank 0's."""
    per_rank = rank_results(2, FAMILIES)
    assert len(per_rank) == 2 and all(len(results) == len(FAMILY_CASES) for results in per_rank)
    for rank, results in enumerate(per_rank):
        for case, res in zip(FAMILY_CASES, results):
            assert res["max_rel_err_output"] < TOL, (rank, case, res)
            assert res["max_rel_err_grads"] < TOL, (rank, case, res)
        for (case, ops), res in zip(SPECIAL, results):
            assert ops <= set(res["ops"]), (rank, case, res)


def test_the_interpreter_names_a_buffer_it_was_not_given():
    layer, _ = workers.deepseek_v3_layer(0)
    g = trace_module(layer, Strategy("sp", "ep", "a2a", 2, dtype="fp32"), batch=B, seq=S)
    x = torch.randn(B, S, H)
    with pytest.raises(ValueError, match=r"^params lacks mlp\.gate\.e_score_correction_bias: pass every parameter"):
        interpret(g, dict(layer.named_parameters()), x, x)
