"""Constructs of single families the zoo's default tiny configs do not exercise, or exercise without
showing that they are modelled (tests/test_family_zoo.py holds every family at its defaults):
DBRX's fused Wqkv with clip_qkv, its p-norm routing and residual dropout.

Each compiled construct is shown load-bearing: the compiled model matches eager with it, and the
same compiled model differs from an eager model without it.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from family_workers import compile_case, step_errors  # noqa: E402
from family_zoo import ROWS, moe_causal_lms, tiny_model  # noqa: E402
from moegraph.ir import ConfigError, OpKind, Strategy  # noqa: E402
from moegraph.lowering import LoweringError  # noqa: E402
from moegraph.tracer import trace_causal_lm  # noqa: E402

TOL = 1e-5
LMS = dict(moe_causal_lms())

pytestmark = pytest.mark.usefixtures("one_thread")


def _need(family: str) -> None:
    if family not in LMS:
        pytest.skip(f"transformers {transformers.__version__} has no model type {family!r}")


def _dbrx_attn(**changes) -> dict:
    return {"attn_config": ROWS["dbrx"]["attn_config"] | changes}


def test_dbrx_clip_qkv_is_a_clamp_of_the_fused_projection():
    """clip_qkv=0.5 clamps most of q, k and v (their std is ~1.6): the graph clamps the fused qkv
    projection (a LIMIT node per token chunk), the compiled model matches eager, and the same
    compiled model differs from eager once eager's clamp is lifted to 8."""
    _need("dbrx")
    case = dict(family="dbrx", cls=LMS["dbrx"], attn="tp", ffn="ep", dispatch="a2a", overrides=_dbrx_attn(clip_qkv=0.5))
    model, ids, compiled = compile_case(case, 3)
    assert not isinstance(compiled, str), compiled
    limits = [n for n in compiled.layers.graph.nodes if n.op is OpKind.LIMIT and n.role.value == "forward"]
    assert limits and {(n.attr("how"), n.attr("limit")) for n in limits} == {("clamp", 0.5)}
    right = step_errors(compiled, model, ids, ids.clone())
    assert right["logits"] < TOL and right["loss"] < TOL and right["grads"] < TOL, right
    for block in model.transformer.blocks:
        block.norm_attn_norm.attn.clip_qkv = 8.0
    wrong = step_errors(compiled, model, ids, ids.clone())
    assert wrong["logits"] > 1e-2 and wrong["grads"] > 1e-2, wrong


@pytest.mark.parametrize("overrides,message", [
    (dict(ffn_config=ROWS["dbrx"]["ffn_config"] | {"moe_normalize_expert_weights": 2.0}),
     r"^layer 0: ffn \(DbrxFFN\): moe_normalize_expert_weights=2\.0 divides the top-k weights by their p-norm "
     r"with p != 1: not modelled \(p=1, their sum, is\)$"),
    (dict(resid_pdrop=0.1),
     r"dropout with p=0\.1 in training mode between its blocks is random per step and not modelled"),
    (_dbrx_attn(clip_qkv=-1.0), r"clip_qkv=-1\.0: only a clamp to \[-c, c\], c > 0, is modelled$"),
])
def test_dbrx_settings_not_modelled_refuse_by_name(overrides, message):
    _need("dbrx")
    model = tiny_model("dbrx", LMS["dbrx"], **overrides)
    with pytest.raises(LoweringError, match=message):
        trace_causal_lm(model, Strategy("sp", "ep", "a2a", 1, dtype="fp32"), batch=2, seq=16)


def test_mistral4_query_scale_by_position_refuses_beyond_where_it_is_one():
    """Mistral 4 scales its queries by 1 + beta log(1 + floor(p / P)) (P: rope_parameters'
    original_max_position_embeddings): exactly 1 below P, where it compiles (the zoo's tests); a
    longer sequence is refused naming it (lowered at that length, checked at the check's own)."""
    _need("mistral4")
    model = tiny_model("mistral4", LMS["mistral4"])
    P = model.config.rope_parameters["original_max_position_embeddings"]
    with pytest.raises(ConfigError, match=rf"llama_4_scaling_beta\) departs from 1 at position {P}, which is not "
                                            rf"modelled: lowered for s <= {P} only \(s={P + 8}\)"):
        trace_causal_lm(model, Strategy("sp", "ep", "a2a", 1, dtype="fp32"), batch=1, seq=P + 8)


def test_longcat_flash_dual_sublayers_refuse_by_name():
    _need("longcat_flash")
    model = tiny_model("longcat_flash", LMS["longcat_flash"])
    with pytest.raises(LoweringError, match=r"^layer 0: 'self_attn' \(ModuleList of 2 LongcatFlashMLA\): a decoder "
                                            r"layer of 2 attention sublayers .* is not modelled: one attention block "
                                            r"per layer is$"):
        trace_causal_lm(model, Strategy("sp", "ep", "a2a", 1, dtype="fp32"), batch=2, seq=16)


@pytest.mark.parametrize("training,how", [
    (True, "samples the experts at random in training mode"),
    (False, "picks and weighs the experts in eval mode by a masked softmax around the best score"),
])
def test_phimoe_sparsemixer_router_refuses_by_name(training, how):
    """PhiMoE's router calls sparsemixer: in training it draws its experts by Gumbel sampling (random
    per step); in eval it weighs them by a masked softmax, not a top-k of scores: refused naming it in
    both modes (before router_jitter_noise, which is sparsemixer's threshold there, not a noise)."""
    _need("phimoe")
    from moegraph.tracer import extract_program
    model = tiny_model("phimoe", LMS["phimoe"]).train(training)
    with pytest.raises(LoweringError, match=rf"^mlp\.router \(PhimoeTopKRouter\): its routing function sparsemixer "
                                            rf"{how}"):
        extract_program(model.model.layers[0])


def test_minimax_m3_fused_shared_expert_refuses_by_name():
    _need("minimax_m3_vl")
    model = tiny_model("minimax_m3_vl", LMS["minimax_m3_vl"])
    with pytest.raises(LoweringError, match=r"^layer 0: 'mlp\.shared_experts' \(MiniMaxM3VLDenseMLP\): a gated MLP "
                                            r"without gate_proj, up_proj \(it holds gate_up_proj, down_proj; its "
                                            r"forward clamps by swiglu_limit\) is not modelled"):
        trace_causal_lm(model, Strategy("sp", "ep", "a2a", 1, dtype="fp32"), batch=2, seq=16)
