"""Kimi Linear: Kimi Delta Attention linear-attention layers (GATED_DELTA layout 'kda': the gated delta
rule with a decay per key feature from a low-rank forget gate, short convolutions on q, k, v, a
sigmoid-gated RMSNorm from a low-rank output gate) and MLA full-attention layers without rotation
(NoPE), DeepSeek-V3's grouped sigmoid router; compiled whole and checked against eager: logits,
loss and every parameter's gradient, under attn sp and tp, at n=1 here and on 2 gloo ranks, on
sequences of one and of two chunks of the delta rule (16 and 80 tokens; chunks of 64); padded and
packed batches. The zoo's tiny model (tests/family_zoo.py) has one layer of each kind.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.kimi_linear")

from family_workers import batch_cases, family_cases  # noqa: E402
from delta_checks import TOL, check_batches, check_two_ranks, l2, perturbed_weight_matches_eager, refusal  # noqa: E402
from family_zoo import tiny_model  # noqa: E402
from helpers import RANK_BATCH  # noqa: E402
from moegraph.delta_kernels import chunked_delta_rule, gated_delta_flops  # noqa: E402
from moegraph.ir import OpKind, Phase, Strategy  # noqa: E402
from moegraph.tracer import trace_causal_lm  # noqa: E402

FAMILY, CLS = "kimi_linear", "KimiLinearForCausalLM"
LINEAR = "model.layers.0.self_attn"

pytestmark = pytest.mark.usefixtures("one_thread")


def _case(attn: str, ffn: str, dispatch: str, seq: int) -> dict:
    return dict(family=FAMILY, cls=CLS, attn=attn, ffn=ffn, dispatch=dispatch, seq=seq)


@pytest.mark.parametrize("chunk", [64, 16, 7])
def test_per_feature_delta_rule_matches_transformers_chunked_and_token_by_token(chunk):
    """moegraph's chunked delta rule with a decay per key feature against transformers' two KDA
    reference implementations (its chunked one and its recurrence token by token), over 150 positions
    (several chunks, the last one partial), 3 heads, in float64."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf
    gen = torch.Generator().manual_seed(5)
    b, S, H, dk, dv = 2, 150, 3, 8, 6
    q, k = (torch.randn(b, S, H, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, S, H, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(b, S, H, dk, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(b, S, H, generator=gen, dtype=torch.float64)
    chunked, _ = hf.chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    stepwise, _ = hf.recurrent_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=None,
                                                    output_final_state=False, use_qk_l2norm_in_kernel=True)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    ours = t(chunked_delta_rule(l2(t(q)) * dk ** -0.5, l2(t(k)), t(v), t(g), t(beta), chunk))
    for ref in (chunked, stepwise):        # transformers computes in fp32: its own error bounds ours
        assert float((ours - ref).norm() / ref.norm()) < 1e-6
    # a decay equal across the features is the per-head rule's
    same = chunked_delta_rule(l2(t(q)), l2(t(k)), t(v), t(g)[..., :1].expand(-1, -1, -1, dk), t(beta), chunk)
    assert torch.allclose(same, chunked_delta_rule(l2(t(q)), l2(t(k)), t(v), t(g)[..., 0], t(beta), chunk),
                          rtol=1e-12, atol=1e-12)


def test_per_feature_flops_weigh_both_products_by_feature():
    per_head = gated_delta_flops(b=1, s=64, k_heads=1, v_heads=1, k_dim=8, v_dim=8, conv=4)
    assert gated_delta_flops(b=1, s=64, k_heads=1, v_heads=1, k_dim=8, v_dim=8, conv=4, per_feature=True) == \
        per_head + 4 * 64 * 64 * 8


@pytest.mark.parametrize("attn,ffn,dispatch,seq", [
    ("sp", "ep", "a2a", 80), ("tp", "tp", "ag-rs", 80), ("tp", "ep", "a2a", 16), ("sp", "tp", "ag-rs", 16)])
def test_compiles_and_matches_eager_on_one_rank(attn, ffn, dispatch, seq):
    (res,) = family_cases(0, 1, [_case(attn, ffn, dispatch, seq)], seed=37)
    assert "refused" not in res, res
    assert res["logits"] < TOL and res["loss"] < TOL and res["grads"] < TOL, res


@pytest.mark.parametrize("attn", ["sp", "tp"])
def test_the_layers_lower_to_a_kda_core_and_an_unrotated_latent_attention(attn):
    """Layer 0: one GATED_DELTA forward of layout 'kda' (inputs q/k/v/b, the forget gate's and the output
    gate's projections, then the conv, A_log, dt_bias and norm weights) and its one backward kernel; the
    gates' down projections replicated, their up projections cut by heads under tp. Layer 1: MLA whose
    rotation has zero frequencies (Kimi's MLA applies no RoPE)."""
    from moegraph.layers import KINDS_META
    graph, _ = trace_causal_lm(tiny_model(FAMILY, CLS), Strategy(attn, "ep", "a2a", 2, dtype="fp32"), batch=2, seq=16)
    kinds = graph.meta_get(KINDS_META)
    linear, full = kinds.graphs
    delta = [n for n in linear.nodes if n.op is OpKind.GATED_DELTA]
    assert [n.phase for n in delta] == [Phase.FORWARD, Phase.BACKWARD] and len(delta[1].outputs) == 7
    core = delta[0]
    assert core.attr("layout") == "kda" and core.typed.k_heads == core.typed.v_heads == 2 and core.flops > 0
    params = dict(linear.params)
    assert params["f_a_proj.weight"].shard_dim is None and params["g_a_proj.weight"].shard_dim is None
    assert params["f_b_proj.weight"].shard_dim == (0 if attn == "tp" else None)
    assert [s.qualname.rsplit(".", 2)[-2] for s in params["in_proj.weight"].sources][:4] == \
        ["q_proj", "k_proj", "v_proj", "b_proj"]
    (heads,) = [n for n in full.nodes if n.op is OpKind.MLA_HEADS and n.phase is Phase.FORWARD]
    assert set(heads.attr("inv_freq")) == {0.0}
    assert not any(n.op is OpKind.GATED_DELTA for n in full.nodes)


def test_a_rotating_latent_attention_keeps_its_frequencies():
    """DeepSeek-V3's MLA calls its rotary function: its frequencies are theta's, not zero."""
    graph, _ = trace_causal_lm(tiny_model("deepseek_v3", "DeepseekV3ForCausalLM"),
                               Strategy("sp", "ep", "a2a", 1, dtype="fp32"), batch=2, seq=16)
    heads = [n for n in graph.nodes if n.op is OpKind.MLA_HEADS]      # its two layers alike: one graph
    assert heads and all(set(n.attr("inv_freq", None) or (1.0,)) != {0.0} for n in heads)


@pytest.mark.parametrize("name,change", [("forget_gate.A_log", lambda t: t + 0.7),
                                         ("forget_gate.dt_bias", lambda t: t - 1.5),
                                         ("forget_gate.f_b_proj.weight", lambda t: t * 3.0),
                                         ("conv1d.weight", lambda t: t.flip(-1))])
def test_decay_and_conv_weights_are_read(name, change):
    """Perturbing A_log, dt_bias, the forget gate's projection or the conv weights changes eager's logits,
    and the compiled model of the perturbed weights matches eager again (logits and every gradient,
    theirs included, nonzero)."""
    perturbed_weight_matches_eager(_case("sp", "ep", "a2a", 80), 43, f"{LINEAR}.{name}", change)


# n = 2 on gloo ranks (the suite's shared spawn): both strategies, one and two chunks of the delta rule; two
# token chunks (the delta rule's block left whole); a folded attention (attn_nodes=2)
N2_CASES = [_case("sp", "ep", "a2a", 80), _case("tp", "tp", "ag-rs", 80), _case("tp", "ep", "ag-rs", 16),
            _case("sp", "tp", "ag-rs", 16), dict(_case("sp", "ep", "a2a", 80), passes="chunk=2"),
            dict(_case("sp", "ep", "a2a", 80), attn_nodes=2)]
N2 = RANK_BATCH.add(2, "kimi_linear.family_cases", family_cases, N2_CASES, int.from_bytes(os.urandom(3), "little"))


def test_compiled_on_two_gloo_ranks_matches_eager(rank_results):
    check_two_ranks(rank_results, N2, N2_CASES)


BATCH_CASES = [_case("sp", "ep", "a2a", 16), _case("tp", "tp", "ag-rs", 16)]


def test_right_padded_and_packed_batches_match_eager_on_one_rank():
    """A padded token's input to Kimi Delta Attention is zero in eager (its projections, the gates'
    included, then give zeros); packed documents share one recurrence in eager as compiled."""
    check_batches(batch_cases(0, 1, BATCH_CASES, 59))


BATCHES_N2 = RANK_BATCH.add(2, "kimi_linear.batch_cases", batch_cases, BATCH_CASES,
                            int.from_bytes(os.urandom(3), "little"))


def test_right_padded_and_packed_batches_on_two_gloo_ranks_match_eager(rank_results):
    for results in rank_results(2, BATCHES_N2):
        check_batches(results)


# -- what is not modelled, refused by name --------------------------------------------------------

def test_a_conv_with_a_bias_is_refused_by_name():
    model = tiny_model(FAMILY, CLS)
    old = model.get_submodule(f"{LINEAR}.conv1d")
    model.get_submodule(LINEAR).conv1d = nn.Conv1d(old.in_channels, old.out_channels, old.kernel_size[0],
                                                   groups=old.groups, padding=old.padding[0], bias=True)
    text = refusal(model)
    assert "conv1d" in text and "bias-free causal depthwise convolution" in text, text


@pytest.mark.parametrize("where,act,text", [
    ("", "gelu", "KimiLinearDeltaAttention's activation 'gelu' is not modelled (silu is)"),
    (".o_norm", "silu", "KimiLinearRMSNormGated's activation 'silu' is not modelled (sigmoid is)")])
def test_another_activation_is_refused_by_name(where, act, text):
    model = tiny_model(FAMILY, CLS)
    model.get_submodule(f"{LINEAR}{where}").activation = act
    assert text in refusal(model)


def test_a_biased_gate_projection_is_refused_by_name():
    model = tiny_model(FAMILY, CLS)
    gate = model.get_submodule(f"{LINEAR}.forget_gate")
    gate.f_b_proj = nn.Linear(gate.f_b_proj.in_features, gate.f_b_proj.out_features, bias=True)
    assert "f_b_proj is not a bias-free linear" in refusal(model)


def test_a_head_count_n_does_not_divide_is_refused_by_name():
    text = refusal(tiny_model(FAMILY, CLS, linear_num_heads=3), attn="tp", n=2)
    assert text.startswith("KimiLinearForCausalLM: n/attn_nodes=2 does not divide the linear attention's key heads "
                           "(3)"), text


def test_the_numerical_check_refuses_a_delta_rule_it_does_not_describe(monkeypatch):
    """A near miss the structural reading cannot see (the forward's KDA called with half its beta) is
    refused by the numerical check against eager, naming the layer and the block."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    from moegraph.lowering import check
    rule = hf.chunk_kimi_delta_attention
    monkeypatch.setattr(hf, "chunk_kimi_delta_attention", lambda *a, beta, **kw: rule(*a, beta=beta / 2, **kw))
    monkeypatch.setattr(check, "_CHECKED", {})
    text = refusal(tiny_model(FAMILY, CLS))
    assert text.startswith("layer 0 (KimiLinearDecoderLayer): the lowered graph differs from the eager module at "
                           "'self_attn' (KimiLinearDeltaAttention)"), text


def test_a_kimi_linear_config_json_plans_its_kda_and_latent_layers(tmp_path):
    """A Kimi Linear config.json (its linear_attn_config naming the KDA and full-attention layers,
    1-indexed): a plan lowers both kinds (meta device: no numbers are checked)."""
    import json

    from moegraph.layers import KINDS_META
    from moegraph.registry import load_model
    from moegraph.tracer import trace_model
    path = tmp_path / "kimi.json"
    path.write_text(json.dumps({
        "model_type": "kimi_linear", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "first_k_dense_replace": 0, "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                                                           "kda_layers": [1, 2, 3], "full_attn_layers": [4]}}))
    cfg = load_model(str(path))
    assert (cfg.layers, cfg.heads, cfg.head_dim) == (4, 4, 24)
    for attn in ("sp", "tp"):
        kinds = trace_model(cfg, Strategy(attn, "ep", "a2a", 2), seq=256, layers=4).meta_get(KINDS_META)
        assert kinds.pattern == (0, 0, 0, 1)
        assert any(n.op is OpKind.GATED_DELTA and n.attr("layout") == "kda" for n in kinds.graphs[0].nodes)
        assert any(n.op is OpKind.MLA_HEADS for n in kinds.graphs[1].nodes)
