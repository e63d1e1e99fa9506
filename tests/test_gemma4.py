"""Gemma 4's MoE decoder layer (moegraph.lowering.parallel_ffn): its router and experts beside the dense
MLP, read as one MoE block whose shared expert is the dense MLP, each branch with its own norms; the
router's own norm, learned scale, constant and per-expert scale; the attention's value norm and values
from k_proj; the layer's scalar; the scaled embedding. Whole-model numerics against eager (every
strategy, n=1 and 2) are tests/test_family_zoo.py's (COMPILED, VARIANTS, MIXED); here: what is read,
that each part is load-bearing (the numerical check refuses the layer without it), and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers.models.gemma4", reason="this transformers has no Gemma 4")

from family_zoo import tiny_model  # noqa: E402
from moegraph.ir import Strategy  # noqa: E402
from moegraph.lowering import LoweringError  # noqa: E402
from moegraph.lowering.specs import MoESpec  # noqa: E402
from moegraph.lowering.structural import structural_guard  # noqa: E402
from moegraph.tracer import extract_program, trace_causal_lm, trace_layers  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CLS = "Gemma4ForCausalLM"
STRATEGY = Strategy("sp", "ep", "a2a", 1, dtype="fp32")
K_EQ_V = dict(attention_k_eq_v=True, layer_types=["sliding_attention", "full_attention"], sliding_window=6,
              per_layer_config={1: {"head_dim": 16, "num_key_value_heads": 2}})


def _layer(seed: int = 3, **overrides):
    return tiny_model("gemma4", CLS, seed=seed, **overrides).model.layers[0]


def test_the_layer_is_one_moe_block_with_the_dense_mlp_as_its_shared_expert():
    layer = _layer()
    program = extract_program(layer)
    assert [st.kind for st in program.steps] == ["norm", "attention", "norm", "add", "moe", "norm", "add", "scale"]
    (moe,) = program.specs(MoESpec)
    h = layer.hidden_size
    assert moe.router.qualname == "router.proj.weight" and moe.top_k == 2 and moe.normalize
    assert moe.router_norm.weight.qualname == "router.scale" and moe.router_input_scale == h ** -0.5
    assert moe.expert_scale.qualname == "router.per_expert_scale"
    assert moe.routed_norm.weight.qualname == "pre_feedforward_layernorm_2.weight"
    assert moe.routed_post_norm.weight.qualname == "post_feedforward_layernorm_2.weight"
    assert moe.shared.w1.qualname == "mlp.gate_proj.weight" and moe.shared.activation == "gelu_tanh"
    assert moe.shared.input_norm.weight.qualname == "pre_feedforward_layernorm.weight"
    assert moe.shared.output_norm.weight.qualname == "post_feedforward_layernorm_1.weight"
    assert program.steps[5].module == "post_feedforward_layernorm" and program.steps[7].by == "layer_scalar"
    attn = program.steps[1].spec
    assert attn.scale == 1.0 and attn.v_norm_eps == layer.self_attn.v_norm.eps and not attn.v_from_k


def test_a_full_layer_with_k_eq_v_reads_its_values_from_k_proj():
    full = tiny_model("gemma4", CLS, seed=3, **K_EQ_V).model.layers[1]
    assert full.self_attn.v_proj is None
    attn = extract_program(full).steps[1].spec
    assert attn.v_from_k and attn.v == attn.k and attn.head_dim == 16 and attn.kv_heads == 2


# each part of the reading, dropped: the compile's numerical check against the eager layer refuses it (the
# structural guard off, so that the numbers alone refuse, not the check that every parameter is read).
# The zoo's weights are N(0, 0.2): the router's scale and per-expert scale are far from ones
DROPS = {
    "per-expert scale": dict(expert_scale=None),
    "router norm scale": dict(router_norm=None),
    "router constant": dict(router_input_scale=1.0),
    "experts' input norm": dict(routed_norm=None),
    "experts' output norm": dict(routed_post_norm=None),
}


@pytest.mark.parametrize("part", sorted(DROPS) + ["dense MLP's output norm", "layer scalar"])
def test_each_part_is_load_bearing(part, monkeypatch):
    import moegraph.tracer as tracer
    layer = _layer(seed=4)
    assert layer.router.per_expert_scale.std() > 0.1 and layer.router.scale.std() > 0.1
    assert abs(float(layer.layer_scalar)) != 1.0
    fold = tracer.fold_routed_experts

    def dropped(steps, output):
        steps, output = fold(steps, output)
        out = []
        for st in steps:
            if st.kind == "moe" and part in DROPS:
                st = dataclasses.replace(st, spec=dataclasses.replace(st.spec, **DROPS[part]))
            elif st.kind == "moe" and part == "dense MLP's output norm":
                st = dataclasses.replace(st, spec=dataclasses.replace(
                    st.spec, shared=dataclasses.replace(st.spec.shared, output_norm=None)))
            elif st.kind == "scale" and part == "layer scalar":
                st = dataclasses.replace(st, by=None)
            out.append(st)
        return out, output
    monkeypatch.setattr(tracer, "fold_routed_experts", dropped)
    with structural_guard(False), pytest.raises(LoweringError, match="the lowered graph differs from the eager module"):
        trace_layers([layer], STRATEGY, batch=2, seq=16)


def test_the_embedding_scale_is_read_from_its_buffer():
    model = tiny_model("gemma4", CLS, seed=5)
    _, spec = trace_causal_lm(model, STRATEGY, batch=2, seq=16)
    assert spec.edge_head.embed_scale == float(model.model.embed_tokens.embed_scale) != 1.0
    assert "model.embed_tokens.embed_scale" in spec.unused


def test_the_soft_cap_is_read():
    model = tiny_model("gemma4", CLS, seed=5, final_logit_softcapping=3.0)
    _, spec = trace_causal_lm(model, STRATEGY, batch=2, seq=16)
    assert spec.edge_head.softcap == 3.0


REFUSED = {
    "per-layer inputs": (dict(hidden_size_per_layer_input=8),
                         "Gemma4ForCausalLM: layer 0: the layer (Gemma4TextDecoderLayer): per-layer inputs "
                         "(hidden_size_per_layer_input=8: "),
    "kv sharing": (dict(num_kv_shared_layers=1),
                   "layer 1: self_attn (Gemma4TextAttention): is_kv_shared_layer=True (config.num_kv_shared_layers): "
                   "keys and values shared from an earlier layer are not modelled"),
    "bidirectional attention": (dict(use_bidirectional_attention="all"),
                                "layer 0: self_attn.is_causal=False: only causal attention is supported"),
}


@pytest.mark.parametrize("construct", sorted(REFUSED))
def test_what_is_not_modelled_is_refused_naming_it(construct):
    overrides, text = REFUSED[construct]
    model = tiny_model("gemma4", CLS, **overrides)
    with pytest.raises(LoweringError) as info:
        trace_causal_lm(model, STRATEGY, batch=2, seq=16)
    assert str(info.value).startswith(text), info.value
    assert "\n" not in str(info.value)


def test_a_router_read_otherwise_is_refused_naming_what_it_reads():
    from moegraph.lowering.parallel_ffn import router_spec
    router = _layer().router
    router.norm = torch.nn.LayerNorm(router.hidden_size)     # a norm with a weight: not the weightless RMSNorm
    with pytest.raises(LoweringError, match=r"^router \(Gemma4TextRouter\): its norm is not a weightless RMSNorm"):
        router_spec(router, "router")
