"""Every MoE causal LM in the installed transformers compiles and matches eager, or refuses in one line
naming the construct (issue 27, item 3). Tiny configs (tests/family_zoo.py: 2 layers, h=64, 8 experts).

Compiled families: the whole causal LM through moegraph.compile, logits, loss and every trainable
parameter's gradient against the eager model (fp32, 1e-5), at n=1 in this process and at n=2 on gloo
ranks in the suite's shared 2-rank spawn (helpers.RankBatch); the strategies rotate over the families
so that the six attn x ffn x dispatch combinations are each covered several times. The full matrix
(every family x every strategy x n in {1, 2}) is benchmarks/families_table.py's.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from family_workers import family_cases  # noqa: E402
from family_zoo import moe_causal_lms, tiny_model  # noqa: E402
from helpers import RANK_BATCH, eager_step, max_grad_err, rel_err  # noqa: E402
from moegraph.interpreter import interpret  # noqa: E402
from moegraph.ir import Strategy  # noqa: E402
from moegraph.lowering import LoweringError  # noqa: E402
from moegraph.tracer import trace_causal_lm, trace_module  # noqa: E402

TOL = 1e-5
COMBOS = [("sp", "ep", "a2a"), ("tp", "tp", "ag-rs"), ("tp", "ep", "ag-rs"), ("sp", "tp", "ag-rs"),
          ("tp", "ep", "a2a"), ("sp", "ep", "ag-rs")]

# the families that compile (the named ones among them: Qwen3-MoE, GPT-OSS, DeepSeek-V2,
# GLM-4.5, Granite MoE, ERNIE 4.5, HunYuan, dots.llm1, MiniMax-M2, Llama 4)
COMPILED = ("aria", "cohere2_moe", "deepseek_v2", "deepseek_v3", "dots1", "ernie4_5_moe", "exaone_moe", "flex_olmo",
            "flint", "glm4_moe", "glm4_moe_lite", "gpt_oss", "granitemoe", "granitemoeshared", "hunyuan_v1_moe", "hy_v3",
            "kolibri1", "laguna", "llama4", "mellum", "mimo_v2_flash", "minimax_m2",
            "mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "solar_open",
            "afmoe", "axk1", "granitemoe_swa", "dbrx", "mistral4",
            "minimax_m3_vl", "qwen3_next", "qwen3_5_moe", "lara_mini", "gemma4", "kimi_linear")   # last: appending keeps the other families' strategies (COMBOS by index)
LMS = dict(moe_causal_lms())

pytestmark = pytest.mark.usefixtures("one_thread")


def _case(i: int, family: str) -> dict:
    attn, ffn, dispatch = COMBOS[i % len(COMBOS)]
    return dict(family=family, cls=LMS[family], attn=attn, ffn=ffn, dispatch=dispatch)


def _missing(family: str) -> str:
    """Why a compiled family is not tested: an older transformers lacks the newest (5.17: 'flint')."""
    return f"transformers {transformers.__version__} has no model type {family!r}"


def test_at_least_twenty_installed_families_compile():
    assert len(COMPILED) >= 20
    missing = sorted(set(COMPILED) - set(LMS))
    if missing:
        pytest.skip(f"transformers {transformers.__version__} has no model type {', '.join(map(repr, missing))}")


@pytest.mark.parametrize("family", [f if f in LMS else pytest.param(f, marks=pytest.mark.skip(reason=_missing(f)))
                                    for f in COMPILED])
def test_family_compiles_and_matches_eager_on_one_rank(family):
    (res,) = family_cases(0, 1, [_case(COMPILED.index(family), family)], seed=11)
    assert "refused" not in res, res
    assert res["logits"] < TOL and res["loss"] < TOL, res
    assert res["grads"] < TOL, res


# a compiled family's other settings, at n=2 under a strategy of their own (strategy, config fields):
# Laguna's attention output gated per feature (its default, in COMPILED: one gate per head);
# GraniteMoeSWA with a theta per layer (in COMPILED: RoPE then NoPE), two rotary modules in rotary_embs
# Gemma 4 as its 26B-A4B config has it (tp at n=2): sliding and full layers, the full one with its own head
# dim and kv heads and values from k_proj (attention_k_eq_v), the final logit soft cap
GEMMA4_26B = dict(attention_k_eq_v=True, layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                  per_layer_config={1: {"head_dim": 16, "num_key_value_heads": 2}}, final_logit_softcapping=3.0)
VARIANTS = {"laguna": (4, dict(gating="per-element")), "granitemoe_swa": (1, dict(layer_rope_theta=[500.0, 10000.0])),
            "gemma4": (1, GEMMA4_26B)}

N2_CASES = [_case(i + 1, family) for i, family in enumerate(COMPILED) if family in LMS] + \
    [dict(_case(i, family), overrides=ov) for family, (i, ov) in VARIANTS.items() if family in LMS]
N2 = RANK_BATCH.add(2, "family_zoo.family_cases", family_cases, N2_CASES, int.from_bytes(os.urandom(3), "little"))


def test_families_compiled_on_two_gloo_ranks_match_eager(rank_results):
    per_rank = rank_results(2, N2)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(N2_CASES)
        for res in results:
            assert "refused" not in res, (rank, res)
            assert res["logits"] < TOL and res["loss"] < TOL and res["grads"] < TOL, (rank, res)


# mixed layer stacks, as the real configs have them (moegraph.layers.LayerKinds): GPT-OSS's
# alternating sliding-window and full attention, Llama 4's NoPE layer (every 4th, with its
# temperature tuning, exactly 1 at these lengths) and interleaved dense / MoE layers, DeepSeek-V3's
# dense first layer
MIXED = {
    "gpt_oss": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2),
    "llama4": dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0], interleave_moe_layer_step=2,
                   layer_types=["chunked_attention"] * 3 + ["full_attention"]),
    "deepseek_v3": dict(num_hidden_layers=3, first_k_dense_replace=1),
    # MiniMax-M3: a dense first layer whose MLP is one fused gate_up_proj with the clamped SwiGLU, as its
    # shared experts; every norm Gemma's (scaled by 1 + weight)
    "minimax_m3_vl": dict(num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
                          layer_types=["full_attention"] * 3),
}
MIXED["gemma4"] = dict(GEMMA4_26B, num_hidden_layers=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                       per_layer_config={3: {"head_dim": 16, "num_key_value_heads": 2}})
MIXED_ORDER = sorted(set(MIXED) - {"gemma4"}) + ["gemma4"]     # last: the others keep their strategies
MIXED_KINDS = {"gpt_oss": (0, 1, 0, 1), "llama4": (0, 1, 0, 2), "deepseek_v3": (0, 1, 1), "minimax_m3_vl": (0, 1, 1),
               "gemma4": (0, 0, 0, 1)}


@pytest.mark.slow
@pytest.mark.parametrize("family", MIXED_ORDER)
def test_mixed_layer_stacks_compile_and_match_eager_on_one_rank(family):
    from moegraph.layers import KINDS_META
    model = tiny_model(family, LMS[family], **MIXED[family])
    graph, _ = trace_causal_lm(model, Strategy("sp", "ep", "a2a", 1, dtype="fp32"), batch=2, seq=16)
    assert graph.meta_get(KINDS_META).pattern == MIXED_KINDS[family]
    (res,) = family_cases(0, 1, [dict(_case(COMPILED.index(family), family), overrides=MIXED[family])], seed=23)
    assert "refused" not in res, res
    assert res["logits"] < TOL and res["loss"] < TOL and res["grads"] < TOL, res


MIXED_N2 = RANK_BATCH.add(2, "family_zoo.mixed_cases", family_cases,
                          [dict(_case(i + 2, family), overrides=MIXED[family]) for i, family in enumerate(MIXED_ORDER)],
                          int.from_bytes(os.urandom(3), "little"))


def test_mixed_layer_stacks_on_two_gloo_ranks_match_eager(rank_results):
    for rank, results in enumerate(rank_results(2, MIXED_N2)):
        assert len(results) == len(MIXED)
        for res in results:
            assert "refused" not in res, (rank, res)
            assert res["logits"] < TOL and res["loss"] < TOL and res["grads"] < TOL, (rank, res)


REFUSED = sorted(set(LMS) - set(COMPILED))


@pytest.mark.parametrize("family", REFUSED)
def test_every_other_family_refuses_in_one_line_naming_a_construct(family):
    try:
        model = tiny_model(family, LMS[family])
    except Exception as err:  # noqa: BLE001 - the tiny config itself cannot be built from this family's defaults
        pytest.skip(f"{family}: no tiny config ({type(err).__name__})")
    with pytest.raises(LoweringError) as info:
        trace_causal_lm(model, Strategy("sp", "ep", "ag-rs", 1, dtype="fp32"), batch=2, seq=16)
    text = str(info.value)
    assert "\n" not in text and ("'" in text or "(" in text), text
    assert not any(s in text for s in ("Proxy", "symbolically traced", "TraceError")), text


# Cohere2-MoE (in COMPILED with its own defaults: attention and MoE in parallel on one norm, NoPE
# full-attention layers, the shared expert averaged with the routed ones, bias-free LayerNorms,
# the logits times logit_scale=0.0625): the model edges' LayerNorm and logit scale

def test_cohere2_moe_logit_scale_is_computed_by_the_compiled_model():
    """The compiled model multiplies its logits by the model's logit_scale (0.0625): against eager
    with the scale forced to 1 it differs (logits by 1 - 0.0625), with its own it matches."""
    if "cohere2_moe" not in LMS:
        pytest.skip(_missing("cohere2_moe"))
    from family_workers import compile_case, step_errors
    model, ids, compiled = compile_case(_case(0, "cohere2_moe"), 17)
    assert not isinstance(compiled, str), compiled
    assert type(model.model.norm).__name__ == "Cohere2MoeLayerNorm" and model.logit_scale == 0.0625
    model.logit_scale = 1.0
    wrong = step_errors(compiled, model, ids, ids.clone())
    assert wrong["logits"] > 0.9 and wrong["loss"] > 1e-3 and wrong["grads"] > 0.1, wrong
    model.logit_scale = 0.0625
    right = step_errors(compiled, model, ids, ids.clone())
    assert right["logits"] < TOL and right["loss"] < TOL and right["grads"] < TOL, right


def test_cohere2_moe_train_step_accumulates_as_eager_on_one_rank():
    """train_step of M=2 (micro-batch 0 right-padded, 1 packed): the merged step's plan-run edge
    kernels (the LayerNorm, the head, its logit scale and their backward) give both losses and every
    gradient as eager accumulation, under both reductions."""
    if "cohere2_moe" not in LMS:
        pytest.skip(_missing("cohere2_moe"))
    from family_workers import accumulation_case
    res = accumulation_case(0, 1, _case(2, "cohere2_moe"), int.from_bytes(os.urandom(3), "little"))
    assert "refused" not in res, res
    for reduction in ("mean", "items"):
        assert res[reduction]["loss"] < TOL and res[reduction]["grads"] < TOL, (reduction, res)


def test_a_logit_scale_read_otherwise_or_not_finite_is_refused_by_name():
    """Only ``logits = logits * self.logit_scale`` after ``logits = self.lm_head(...)`` is modelled:
    a forward dividing by it, or a scale that is not a finite number, is refused naming it."""
    from moegraph.lowering.hf_common import logit_scale

    class Divides(torch.nn.Module):
        logit_scale = 0.5

        def forward(self, hidden):
            logits = self.lm_head(hidden)
            logits = logits / self.logit_scale
            return logits

    class Scales(Divides):
        def forward(self, hidden):
            logits = self.lm_head(hidden)
            logits = logits * self.logit_scale
            return logits

    with pytest.raises(LoweringError) as info:
        logit_scale(Divides())
    assert str(info.value).startswith("Divides.forward reads self.logit_scale=0.5 other than as the LM head's "
                                      "logits times it"), info.value
    assert logit_scale(Scales()) == 0.5
    broken = Scales()
    broken.logit_scale = float("nan")
    with pytest.raises(LoweringError, match=r"^Scales.forward reads self.logit_scale=nan: the compiled model's LM "
                                            r"head multiplies its logits by a finite number only$"):
        logit_scale(broken)


@pytest.mark.parametrize("strategy", [Strategy("sp", "ep", "a2a", 1, dtype="fp32"),
                                      Strategy("tp", "tp", "ag-rs", 2, dtype="fp32")])
def test_cohere2_moe_layer_with_its_bias_free_layernorm_matches_eager(strategy):
    """Cohere2-MoE's own default norm (rms_norm_eps=None): mean-centred, a weight and no bias, lowered
    as a NORM 'layer' node; one decoder layer (a NoPE full-attention layer: the eager call's cos/sin
    are not read) through the reference interpreter, also under tp at n=2."""
    if "cohere2_moe" not in LMS:
        pytest.skip(_missing("cohere2_moe"))
    layer = tiny_model("cohere2_moe", LMS["cohere2_moe"], seed=5).model.layers[0]
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(3), "little"))
    x, dy = torch.randn(2, 16, 64, generator=gen), torch.randn(2, 16, 64, generator=gen)
    unused = torch.full((1, 16, 8), float("nan"))       # NaN: any use of RoPE would show
    y_ref, dx_ref, grads_ref = eager_step(layer, x, dy, call=lambda m, t: m(t, position_embeddings=(unused, unused)))
    graph = trace_module(layer, strategy, batch=2, seq=16)
    assert any(n.op.name == "NORM" and n.attr("kind") == "layer" for n in graph.nodes)
    res = interpret(graph, {k: t.detach() for k, t in [*layer.named_parameters(), *layer.named_buffers()]}, x, dy)
    assert rel_err(res.output, y_ref) < TOL and rel_err(res.input_grad, dx_ref) < TOL
    name, err = max_grad_err(res.param_grads, grads_ref)
    assert err < TOL, f"gradient of {name}: {err:.2e}"


@pytest.mark.parametrize("family,attn", [("laguna", "tp"), ("laguna", "sp"), ("qwen3_moe", "sp")])
def test_token_chunks_share_the_per_head_norm_and_gate_weights(family, attn):
    """chunks=2 at n=2 (emulated in the compile's own check against the eager layer): each chunk's
    per-head q/k norm (and Laguna's gate) reads one weight, so the chunks' gradients add up (with a
    weight per chunk, 0.7 off at q_norm.weight)."""
    if family not in LMS:
        pytest.skip(_missing(family))
    layer = tiny_model(family, LMS[family]).model.layers[0]
    graph = trace_module(layer, Strategy(attn, "ep", "a2a", 2, dtype="fp32", chunks=2), batch=2, seq=16)
    norms = [n for n in graph.nodes if n.op.name == "NORM" and n.attr("kind") == "head_rms"]
    assert len(norms) >= 4 and len({n.inputs[1] for n in norms}) == 2
    assert sum(n.op.name == "GLU" for n in graph.nodes) == (4 if family == "laguna" else 0)


@pytest.mark.parametrize("attn", ["tp", "sp"])
def test_afmoe_dense_layer_with_its_sigmoid_output_gate_matches_eager(attn):
    """AFMoE's attention gates its output per feature by sigmoid(gate_proj(x)) (Laguna's: softplus,
    per head): its dense first layer compiles at n=2, checked against eager by the compile (the whole
    model, MoE layers included, is in COMPILED)."""
    if "afmoe" not in LMS:
        pytest.skip(_missing("afmoe"))
    layer = tiny_model("afmoe", LMS["afmoe"]).model.layers[0]
    graph = trace_module(layer, Strategy(attn, "ep", "a2a", 2, dtype="fp32"), batch=2, seq=16)
    assert [n.attr("act") for n in graph.nodes if n.op.name == "GLU"] == ["sigmoid", "sigmoid"]


def test_afmoe_with_mup_scaled_embeddings_refuses_naming_the_switch():
    """mup_enabled=True scales AFMoE's embeddings by sqrt(h) in its base model's forward, which the
    model edges do not compute: a switch that is on is not a neutral multiplier of 1."""
    if "afmoe" not in LMS:
        pytest.skip(_missing("afmoe"))
    model = tiny_model("afmoe", LMS["afmoe"], mup_enabled=True)
    with pytest.raises(LoweringError, match=r"config\.mup_enabled=True"):
        trace_causal_lm(model, Strategy("sp", "ep", "ag-rs", 1, dtype="fp32"), batch=2, seq=16)


def test_the_compiled_families_cover_every_strategy_at_two_ranks():
    assert {(c["attn"], c["ffn"], c["dispatch"]) for c in N2_CASES} == set(COMBOS)
    assert torch.get_num_threads() >= 1


def test_beam_layers_refuse_naming_the_position_dependent_query_scale():
    """Beam's edges (its final logit soft cap, its NoPE layer type's absent frequencies) are modelled;
    its layers refuse the query scale its model passes its attention (the NoPE layers' scalable
    softmax), by name."""
    if "beam" not in LMS:
        pytest.skip(_missing("beam"))
    model = tiny_model("beam", LMS["beam"])
    with pytest.raises(LoweringError) as info:
        trace_causal_lm(model, Strategy("sp", "ep", "ag-rs", 1, dtype="fp32"), batch=2, seq=16)
    assert str(info.value).startswith("layer 0: self_attn (BeamAttention): its forward multiplies the queries by a "
                                      "position-dependent attention_scaling"), info.value
