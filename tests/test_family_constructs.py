"""Constructs of single families the zoo's default tiny configs do not exercise, or exercise without
showing that they are modelled (tests/test_family_zoo.py holds every family at its defaults):
DBRX's fused Wqkv with clip_qkv, its p-norm routing and residual dropout.

Each compiled construct is shown load-bearing: the compiled model matches eager with it, and the
same compiled model differs from an eager model without it. The model edges of families whose
layers do not compile (PhiMoE's final LayerNorm with a bias, Beam's logit soft cap) run on
Qwen3-MoE's tiny model (tests/family_zoo.with_edge_head), at n=1 and on 2 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import os  # noqa: E402

from family_workers import accumulation_case, compile_case, family_cases, step_errors  # noqa: E402
from helpers import RANK_BATCH  # noqa: E402
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


@pytest.mark.parametrize("family,message", [
    ("longcat_flash", r"^layer 0: 'self_attn' \(ModuleList\): 2 attention sublayers \(LongcatFlashMLA\) in one "
                      r"decoder layer .* are not modelled: one attention block per layer is$"),
    ("minimax_m3_vl", r"^layer 0: minimax m3 sparse \(config\.layer_types\[0\]='minimax_m3_sparse'\) is not "
                      r"modelled$"),
])
def test_constructs_next_to_the_modelled_set_refuse_by_name(family, message):
    """LongCat-Flash's two attention sublayers per layer; MiniMax-M3's sparse attention layers (its
    indexer picks the keys; its dense layers compile: tests/test_family_zoo.py)."""
    _need(family)
    over = {"layer_types": ["minimax_m3_sparse", "full_attention"]} if family == "minimax_m3_vl" else {}
    model = tiny_model(family, LMS[family], **over)
    with pytest.raises(LoweringError, match=message):
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
    model = tiny_model("phimoe", LMS["phimoe"]).train(training)
    with pytest.raises(LoweringError, match=rf"^layer 0: mlp\.router \(PhimoeTopKRouter\): its routing function "
                                            rf"sparsemixer {how}"):
        trace_causal_lm(model, Strategy("sp", "ep", "a2a", 1, dtype="fp32"), batch=2, seq=16)


# -- the model edges: a final LayerNorm with a bias (PhiMoE's), a logit soft cap (Beam's) --------------

EDGE_HEADS = [dict(norm_bias=True), dict(softcap=1.5), dict(softcap=2.0, norm_bias=True)]
EDGE_COMBOS = [("sp", "ep", "a2a"), ("tp", "tp", "ag-rs"), ("tp", "ep", "ag-rs")]


def _edge_case(i: int, edges: dict) -> dict:
    attn, ffn, dispatch = EDGE_COMBOS[i % len(EDGE_COMBOS)]
    return dict(family="qwen3_moe", cls=LMS.get("qwen3_moe"), attn=attn, ffn=ffn, dispatch=dispatch, edges=edges)


def test_a_biased_final_layernorm_and_a_logit_softcap_match_eager_and_are_load_bearing():
    """The edges' LayerNorm bias (its gradient in the norm's one partial [2h]) and soft cap c
    tanh(logits / c) match eager, logits, loss and every gradient; the same compiled model against
    eager with the bias zeroed, or with another cap, differs."""
    _need("qwen3_moe")
    model, ids, compiled = compile_case(_edge_case(0, dict(softcap=1.5, norm_bias=True)), 7)
    assert not isinstance(compiled, str), compiled
    assert compiled.spec.edge_head.bias and compiled.spec.edge_head.softcap == 1.5
    right = step_errors(compiled, model, ids, ids.clone())
    assert right["logits"] < TOL and right["loss"] < TOL and right["grads"] < TOL, right
    model.config.final_logit_softcapping = 3.0
    assert step_errors(compiled, model, ids, ids.clone())["logits"] > 1e-2
    model.config.final_logit_softcapping = 1.5
    with torch.no_grad():
        model.model.norm.bias.zero_()
    assert step_errors(compiled, model, ids, ids.clone())["logits"] > 1e-2


EDGES_N2 = RANK_BATCH.add(2, "family_constructs.edges", family_cases,
                          [_edge_case(i, e) for i, e in enumerate(EDGE_HEADS)] if "qwen3_moe" in LMS else [],
                          int.from_bytes(os.urandom(3), "little"))


def test_the_edge_heads_match_eager_on_two_gloo_ranks(rank_results):
    _need("qwen3_moe")
    for rank, results in enumerate(rank_results(2, EDGES_N2)):
        assert len(results) == len(EDGE_HEADS)
        for res in results:
            assert "refused" not in res, (rank, res)
            assert res["logits"] < TOL and res["loss"] < TOL and res["grads"] < TOL, (rank, res)


def test_the_edge_heads_accumulate_as_eager_in_a_merged_step():
    """train_step of M=2 (the merged step's eager edge kernels: the biased norm, the head, the cap and
    their backward), both reductions, against eager gradient accumulation."""
    _need("qwen3_moe")
    res = accumulation_case(0, 1, _edge_case(1, dict(softcap=2.0, norm_bias=True)), int.from_bytes(os.urandom(3), "little"))
    assert "refused" not in res, res
    for reduction in ("mean", "items"):
        assert res[reduction]["loss"] < TOL and res[reduction]["grads"] < TOL, (reduction, res)


def test_a_softcap_read_otherwise_is_refused_by_name():
    """Only Beam's three lines after ``logits = self.lm_head(...)`` are modelled: a forward capping
    by another formula is refused naming the field."""
    from moegraph.lowering.hf_common import logit_softcap

    class Config:
        final_logit_softcapping = 30.0

    class Clamps(torch.nn.Module):
        config = Config()

        def forward(self, hidden):
            logits = self.lm_head(hidden)
            logits = logits.clamp(-self.config.final_logit_softcapping, self.config.final_logit_softcapping)
            return logits

    with pytest.raises(LoweringError, match=r"^Clamps\.forward reads config\.final_logit_softcapping=30\.0 other "
                                            r"than as the LM head's logits' soft cap"):
        logit_softcap(Clamps())


@pytest.mark.parametrize("family,act", [("gpt_oss", "GLU"), ("qwen3_moe", "SWIGLU")])
def test_gate_reorder_scales_the_glu_rows_in_its_kernel(family, act):
    """gate-reorder multiplies each expert row by its routing weight inside the SwiGLU kernel
    (GPT-OSS: its clamped GLU with expert biases, the down bias scaled like the rows): no GATE node,
    the GLU reads the row weights, and a train step matches eager, logits and every gradient (the
    routing weights' included: they reach the router through the GLU's backward)."""
    _need(family)
    case = dict(family=family, cls=LMS[family], attn="sp", ffn="ep", dispatch="a2a", passes="gate-reorder")
    model, ids, compiled = compile_case(case, 4)
    assert not isinstance(compiled, str), compiled
    graph = compiled.layers.graph
    glus = [n for n in graph.nodes if n.op.name == act and n.role.value == "forward"]
    assert glus and all(n.attr("row_weights") is True and len(n.inputs) == 3 for n in glus)
    assert not any(n.op is OpKind.GATE for n in graph.nodes)
    errors = step_errors(compiled, model, ids, ids.clone())
    assert errors["logits"] < TOL and errors["loss"] < TOL and errors["grads"] < TOL, errors


def test_a_config_json_built_on_meta_reads_its_norms_as_they_compute(tmp_path):
    """A config.json's layers are built on the meta device (no values): the norm probe runs a CPU copy
    with random weights, so MiniMax-M3's 1 + weight norms carry offset 1 in the planned graph as in
    the compiled one (read as plain RMSNorms, offset 0, until 2026-11-28)."""
    _need("minimax_m3_vl")
    import json

    from moegraph.config import CompileConfig
    from moegraph.schedules.driver import lower
    cfg = tiny_model("minimax_m3_vl", LMS["minimax_m3_vl"]).config.to_dict()
    path = tmp_path / "minimax.json"
    path.write_text(json.dumps(cfg))
    graph = lower(CompileConfig(model=str(path), strategy=Strategy("tp", "ep", "a2a", 2), seq=32, passes=())).graph
    norms = [nd for nd in graph.nodes if nd.op is OpKind.RMSNORM or nd.attr("kind", None) == "head_rms"]
    assert norms and all(nd.attr("offset", 0.0) == 1.0 for nd in norms), [nd.name for nd in norms]
