"""Qwen3-Next: Gated DeltaNet linear-attention layers (moegraph.delta_kernels, GATED_DELTA) and gated
full-attention layers (q_proj's per-head query and gate: a SPLIT of mode 'heads'), compiled whole and
checked against eager: logits, loss and every parameter's gradient, under attn sp and tp, at n=1 here
and on 2 gloo ranks, on sequences of one and of two chunks of the delta rule (16 and 80 tokens;
chunks of 64); padded and packed batches. The zoo's tiny model (tests/family_zoo.py) has one layer of
each kind. Qwen3.5-MoE (the same blocks, its DeltaNet projections separate) in a few of the cases.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_next")

from family_workers import batch_cases, family_cases  # noqa: E402
from delta_checks import TOL, check_batches, check_two_ranks, l2, perturbed_weight_matches_eager, refusal  # noqa: E402
from family_zoo import tiny_model  # noqa: E402
from helpers import RANK_BATCH  # noqa: E402
from moegraph.delta_kernels import chunked_delta_rule, gated_delta_flops  # noqa: E402
from moegraph.ir import OpKind, Phase, Strategy  # noqa: E402
from moegraph.tracer import trace_causal_lm  # noqa: E402

FAMILY, CLS = "qwen3_next", "Qwen3NextForCausalLM"
LINEAR = "model.layers.0.linear_attn"

pytestmark = pytest.mark.usefixtures("one_thread")


QWEN35 = ("qwen3_5_moe", "Qwen3_5MoeForCausalLM")   # the same blocks, its four projections separate ('flat')
HAS_QWEN35 = importlib.util.find_spec("transformers.models.qwen3_5_moe") is not None   # not in 5.17
needs_qwen35 = pytest.mark.skipif(not HAS_QWEN35, reason=f"transformers {transformers.__version__} has no qwen3_5_moe")


def _case(attn: str, ffn: str, dispatch: str, seq: int, family: tuple[str, str] = (FAMILY, CLS)) -> dict:
    return dict(family=family[0], cls=family[1], attn=attn, ffn=ffn, dispatch=dispatch, seq=seq)


@pytest.mark.parametrize("chunk", [64, 16, 7])
def test_chunked_delta_rule_matches_transformers_chunked_and_token_by_token(chunk):
    """moegraph's chunked gated delta rule against transformers' two reference implementations (the
    independent reference: its chunked one and its recurrence token by token), over 150 positions
    (several chunks, the last one partial), 2 key heads serving 4 value heads, in float64."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf
    gen = torch.Generator().manual_seed(3)
    b, S, Hk, Hv, dk, dv = 2, 150, 2, 4, 8, 6
    q, k = (torch.randn(b, S, Hk, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, S, Hv, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(b, S, Hv, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(b, S, Hv, generator=gen, dtype=torch.float64)
    chunked, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    stepwise, _ = hf.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    heads = lambda x: l2(x.transpose(1, 2)).repeat_interleave(Hv // Hk, 1)   # noqa: E731
    ours = chunked_delta_rule(heads(q) * dk ** -0.5, heads(k), v.transpose(1, 2), g.transpose(1, 2),
                              beta.transpose(1, 2), chunk).transpose(1, 2)
    for ref in (chunked, stepwise):        # transformers computes in fp32: its own error bounds ours
        assert float((ours - ref).norm() / ref.norm()) < 1e-6


def test_gated_delta_flops_count_the_chunked_algorithm():
    """Per value head and chunk of L: 4L^2dk + L^2(dk+dv) + 2L^2dv + 6L dk dv, plus the conv and the
    elementwise terms per position; a partial chunk is a whole one."""
    f = gated_delta_flops(b=1, s=64, k_heads=1, v_heads=1, k_dim=8, v_dim=8, conv=4, chunk=64)
    assert f == 4 * 64 * 64 * 8 + 64 * 64 * 16 + 2 * 64 * 64 * 8 + 6 * 64 * 64 + 64 * (2 * 4 * 24 + 80)
    per_position = 2 * 4 * 24 + 80
    assert gated_delta_flops(b=1, s=65, k_heads=1, v_heads=1, k_dim=8, v_dim=8, conv=4) == \
        2 * (f - 64 * per_position) + 65 * per_position


@pytest.mark.parametrize("attn,ffn,dispatch,seq,family", [
    ("sp", "ep", "a2a", 80, (FAMILY, CLS)), ("tp", "tp", "ag-rs", 80, (FAMILY, CLS)), ("tp", "ep", "a2a", 16, (FAMILY, CLS)),
    ("sp", "tp", "ag-rs", 16, (FAMILY, CLS)), pytest.param("sp", "ep", "ag-rs", 80, QWEN35, marks=needs_qwen35),
    pytest.param("tp", "ep", "a2a", 80, QWEN35, marks=needs_qwen35)])
def test_compiles_and_matches_eager_on_one_rank(attn, ffn, dispatch, seq, family):
    (res,) = family_cases(0, 1, [_case(attn, ffn, dispatch, seq, family)], seed=31)
    assert "refused" not in res, res
    assert res["logits"] < TOL and res["loss"] < TOL and res["grads"] < TOL, res


def test_the_layers_lower_to_a_gated_delta_core_and_a_gated_attention():
    """Layer 0 (linear attention): one GATED_DELTA forward and its one backward kernel giving the
    gradients of qkvz, ba, the conv, A_log, dt_bias and the norm weight; layer 1 (full attention):
    q_proj's rows cut per head into the query and the gate's logits (SPLIT 'heads'), no g_proj GEMM."""
    from moegraph.layers import KINDS_META
    model = tiny_model(FAMILY, CLS)
    graph, _ = trace_causal_lm(model, Strategy("sp", "ep", "a2a", 1, dtype="fp32"), batch=2, seq=16)
    kinds = graph.meta_get(KINDS_META)
    assert kinds.pattern == (0, 1)
    linear, full = kinds.graphs
    delta = [n for n in linear.nodes if n.op is OpKind.GATED_DELTA]
    assert [n.phase for n in delta] == [Phase.FORWARD, Phase.BACKWARD] and len(delta[1].outputs) == 6
    assert delta[0].typed.k_heads == 2 and delta[0].typed.v_heads == 4 and delta[0].flops > 0
    heads = [n for n in full.nodes if n.op is OpKind.SPLIT and n.attr("mode") == "heads"]
    assert len(heads) == 2 and heads[0].attr("sizes") == (8, 8)          # forward and its gradient
    assert not any("attn_gate_proj" in n.name for n in full.nodes)
    assert not any(n.op is OpKind.GATED_DELTA for n in full.nodes)
    # the bytes: the forward moves its chunk states [dk, dv] per value head once each way (fp32); the
    # backward recomputes them and writes their gradients, twice that (it was priced with its inputs
    # and outputs only: cheaper than the forward on h800 at twice the FLOPs)
    from moegraph.delta_kernels import gated_delta_state_bytes
    from moegraph.registry import load_hardware
    from moegraph.cost import CostModel
    value = {v.name: v for v in linear.values}

    def io(node):
        return sum(value[x].nbytes for x in dict.fromkeys(node.inputs)) + sum(value[y].nbytes for y in node.outputs)
    states = 2 * 4 * 2 * 4 * 1 * 8 * 8                     # 2 ways x fp32 x b=2 x 4 value heads x 1 chunk x dk x dv
    assert states == gated_delta_state_bytes(b=2, s=16, v_heads=4, k_dim=8, v_dim=8)
    fwd, bwd = delta
    assert fwd.mem_bytes == sum(value[x].nbytes for x in fwd.inputs) + value[fwd.outputs[0]].nbytes + states
    assert bwd.mem_bytes == io(bwd) + 2 * states
    cost = CostModel(load_hardware("h800"))
    assert cost.node_time_us(bwd) > cost.node_time_us(fwd)


@needs_qwen35
@pytest.mark.parametrize("attn", ["sp", "tp"])
def test_qwen3_5_moe_projections_lower_to_one_gemm_cut_by_heads(attn):
    """Qwen3.5-MoE: in_proj_qkv, in_proj_z, in_proj_b and in_proj_a read as one weight whose rows hold
    each rank's heads of the four (tp: this rank's; sp: every rank's, rank-major, for the all-to-all)."""
    from moegraph.layers import KINDS_META
    graph, _ = trace_causal_lm(tiny_model(*QWEN35), Strategy(attn, "ep", "a2a", 2, dtype="fp32"), batch=2, seq=16)
    linear = graph.meta_get(KINDS_META).graphs[0]
    (core,) = [n for n in linear.nodes if n.op is OpKind.GATED_DELTA and n.phase is Phase.FORWARD]
    assert core.attr("layout") == "flat" and len(core.inputs) == 5
    spec = dict(linear.params)["in_proj.weight"]
    names = [src.qualname.rsplit(".", 2)[-2] for src in spec.sources]
    assert names == ["in_proj_qkv"] * 3 + ["in_proj_z", "in_proj_b", "in_proj_a"] if attn == "tp" else \
        names == (["in_proj_qkv"] * 3 + ["in_proj_z", "in_proj_b", "in_proj_a"]) * 2


@pytest.mark.parametrize("name,change", [("A_log", lambda t: t + 0.7), ("dt_bias", lambda t: t - 1.5),
                                         ("conv1d.weight", lambda t: t.flip(-1))])
def test_decay_and_conv_weights_are_read(name, change):
    """Perturbing A_log, dt_bias or the conv weights changes eager's logits, and the compiled model of
    the perturbed weights matches eager again (logits and every gradient, theirs included, nonzero)."""
    perturbed_weight_matches_eager(_case("tp", "ep", "a2a", 80), 41, f"{LINEAR}.{name}", change)


# n = 2 on gloo ranks (the suite's shared spawn): both strategies, one and two chunks of the delta rule; two
# token chunks (the delta rule's block left whole); a folded attention (attn_nodes=2: each rank runs one
# row's whole sequence of every head)
N2_CASES = [_case("sp", "ep", "a2a", 80), _case("tp", "tp", "ag-rs", 80), _case("tp", "ep", "ag-rs", 16),
            _case("sp", "tp", "ag-rs", 16), dict(_case("sp", "ep", "a2a", 80), passes="chunk=2"),
            dict(_case("sp", "ep", "a2a", 80), attn_nodes=2)] + \
    ([_case("sp", "ep", "a2a", 80, QWEN35), _case("tp", "tp", "ag-rs", 80, QWEN35)] if HAS_QWEN35 else [])
N2 = RANK_BATCH.add(2, "qwen3_next.family_cases", family_cases, N2_CASES, int.from_bytes(os.urandom(3), "little"))


def test_compiled_on_two_gloo_ranks_matches_eager(rank_results):
    check_two_ranks(rank_results, N2, N2_CASES)


BATCH_CASES = [_case("sp", "ep", "a2a", 16), _case("tp", "tp", "ag-rs", 16)] + \
    ([_case("sp", "tp", "ag-rs", 16, QWEN35)] if HAS_QWEN35 else [])


def test_right_padded_and_packed_batches_match_eager_on_one_rank():
    """A padded token's input to the Gated DeltaNet is zero in eager (its projections then give zeros;
    the padded positions' logits show it: 0.37 off without); packed documents share one recurrence in
    eager as in the compiled model (the delta rule reads no positions)."""
    check_batches(batch_cases(0, 1, BATCH_CASES, 53))


BATCHES_N2 = RANK_BATCH.add(2, "qwen3_next.batch_cases", batch_cases, BATCH_CASES, int.from_bytes(os.urandom(3), "little"))


def test_right_padded_and_packed_batches_on_two_gloo_ranks_match_eager(rank_results):
    for results in rank_results(2, BATCHES_N2):
        check_batches(results)


# -- what is not modelled, refused by name --------------------------------------------------------

def test_a_conv_with_a_bias_is_refused_by_name():
    model = tiny_model(FAMILY, CLS)
    old = model.get_submodule(f"{LINEAR}.conv1d")
    conv = nn.Conv1d(old.in_channels, old.out_channels, old.kernel_size[0], groups=old.groups,
                     padding=old.padding[0], bias=True)
    model.get_submodule(LINEAR).conv1d = conv
    assert "conv1d" in refusal(model) and "bias-free causal depthwise convolution" in refusal(model)


def test_another_activation_is_refused_by_name():
    model = tiny_model(FAMILY, CLS)
    model.get_submodule(LINEAR).activation = "gelu"
    assert "Qwen3NextGatedDeltaNet's activation 'gelu' is not modelled" in refusal(model)


def test_token_chunks_leave_the_delta_rule_whole_and_match_eager():
    """chunk=2: the full-attention and MoE blocks run two token chunks, the Gated DeltaNet block one
    (its recurrence reads the whole sequence): logits and gradients as eager's."""
    (res,) = family_cases(0, 1, [dict(_case("tp", "ep", "a2a", 80), passes="chunk=2")], seed=61)
    assert "refused" not in res, res
    assert res["logits"] < TOL and res["loss"] < TOL and res["grads"] < TOL, res


def test_the_numerical_check_refuses_a_delta_rule_it_does_not_describe(monkeypatch):
    """A near miss the structural reading cannot see (the forward's delta rule called with half its
    beta) is refused by the numerical check against eager, naming the layer and the block."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    from moegraph.lowering import check
    rule = hf.torch_chunk_gated_delta_rule
    monkeypatch.setattr(hf, "torch_chunk_gated_delta_rule", lambda *a, beta, **kw: rule(*a, beta=beta / 2, **kw))
    monkeypatch.setattr(check, "_CHECKED", {})
    text = refusal(tiny_model(FAMILY, CLS))
    assert text.startswith("layer 0 (Qwen3NextDecoderLayer): the lowered graph differs from the eager module at "
                           "'linear_attn' (Qwen3NextGatedDeltaNet)"), text


@pytest.mark.parametrize("attn,n,family,kept", [
    ("sp", 2, (FAMILY, CLS), {"qkvz_a2a", "ba_a2a", "delta_out"}), ("tp", 2, (FAMILY, CLS), {"qkvz", "ba", "delta_out"}),
    ("sp", 1, (FAMILY, CLS), {"qkvz", "ba", "delta_out"}),
    pytest.param("sp", 2, QWEN35, {"qkvzba_a2a", "delta_out"}, marks=needs_qwen35),
    pytest.param("tp", 2, QWEN35, {"qkvzba", "delta_out"}, marks=needs_qwen35),
    ("sp", 2, ("kimi_linear", "KimiLinearForCausalLM"), {"qkvb_a2a", "f_a2a", "z_a2a", "delta_out"}),
    ("tp", 2, ("kimi_linear", "KimiLinearForCausalLM"), {"qkvb", "f", "z", "delta_out"})])
def test_sar_paper_keeps_the_delta_cores_inputs_and_output(attn, n, family, kept):
    """Fig 9's rule for the linear-attention block: its core's inputs (after the all-to-all under sp)
    and its output are kept, so backward re-runs neither the projections, their all-to-alls nor the
    delta rule (the policy named softmax attention's units only and kept nothing of this block)."""
    from moegraph.cost import CostModel
    from moegraph.layers import KINDS_META
    from moegraph.passes import run_pipeline
    from moegraph.registry import load_hardware
    graph, _ = trace_causal_lm(tiny_model(*family), Strategy(attn, "ep", "a2a", n, dtype="fp32"), batch=2, seq=16)
    linear = next(k for k in graph.meta_get(KINDS_META).graphs if any(nd.op is OpKind.GATED_DELTA for nd in k.nodes))
    _, report = run_pipeline(linear, "sar=paper", cost=CostModel(load_hardware("h800")))
    sar = report["sar"]
    assert kept <= set(sar["kept"])
    assert not kept & set(sar["recompute"] + sar["recommunicate"])
    assert not any(v.startswith("gated_delta") for v in sar.get("recompute_nodes", []))
