"""DeepSeek-V3 (671B) in the registry (issue 12, item 4): multi-head latent attention, the grouped
sigmoid router with its score-correction bias and routed scaling, and dense first layers as
ModelConfig fields, computed by the reference layer (moegraph.models) and lowered through
moegraph/lowering/reference.py.

Volumes and activation bytes are checked against closed forms derived from the architecture
(docs/cost_model.md, "Today's families"), with the sizes typed here from the public config.json,
not read from the registry or the graph. Numerics: the reference layer with every DeepSeek-V3
feature (tiny sizes) matches its own eager forward through the interpreter (fp32, 1e-5), and the
eager forward itself matches transformers' DeepseekV3 modules with the same weights.

Notation: b batch, s sequence, h hidden, n group size, k top-k, H heads, r_q, r_kv the latent
ranks, dn, dr, dv the no-RoPE q/k, RoPE q/k and value head dims (dq = dn + dr), f_s the shared
expert's width, B bytes per element.
"""

from __future__ import annotations

import json
from fractions import Fraction as Fr

import pytest
import torch

from helpers import assert_interpreted_matches_eager, rel_err, routing_gather_bytes
from moegraph.passes.stack import stack_layers
from moegraph.cli import main
from moegraph.commands import forward_comm_bytes
from moegraph.ir import OpKind, Phase, Strategy
from moegraph.models import MoETransformerLayer
from moegraph.registry import RegistryError, load_model
from moegraph.tracer import trace_model, trace_module

B, S, BYTES, N = 1, 8192, 2, 8

# deepseek-ai/DeepSeek-V3 config.json
LAYERS, H_, HEADS, RQ, RKV, DN, DR, DV = 61, 7168, 128, 1536, 512, 128, 64, 128
E, K, GROUPS, TOPK_GROUPS, F_EXPERT, F_SHARED, F_DENSE, DENSE_LAYERS = 256, 8, 8, 4, 2048, 2048, 18432, 3
DQ = DN + DR


def exact(x: Fr) -> int:
    assert x.denominator == 1, f"{x} is not a whole number of bytes"
    return int(x)


def test_entry_matches_the_public_config():
    cfg = load_model("deepseek-v3")
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, cfg.experts, cfg.top_k) == \
        (LAYERS, H_, HEADS, HEADS, F_EXPERT, E, K)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (RQ, RKV, DN, DR, DV)
    assert cfg.head_dim == DQ
    assert (cfg.router_scoring, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.score_correction_bias,
            cfg.normalize_topk) == ("sigmoid", GROUPS, TOPK_GROUPS, 2.5, True, True)
    assert (cfg.shared_experts, cfg.shared_ffn_total) == (1, F_SHARED)
    assert (cfg.first_k_dense_replace, cfg.dense_ffn_hidden) == (DENSE_LAYERS, F_DENSE)


def test_layer_param_bytes_follow_the_architecture():
    h = H_
    mla = RQ * h + RQ + HEADS * DQ * RQ + (RKV + DR) * h + RKV + HEADS * (DN + DV) * RKV + h * HEADS * DV
    moe = E * h + E + 3 * E * F_EXPERT * h + 3 * F_SHARED * h
    assert load_model("deepseek-v3").layer_param_bytes == 4 * (mla + moe + 2 * h)


def test_tp_volumes_are_eq1_and_eq4():
    # MLA under tp: the tokens are all-gathered once (the latents are computed replicated from
    # them, so their norms need no reduction) and the output projection reduce-scattered: eq (1).
    # The shared expert sends nothing: eq (4), plus the sigmoid router's top-k weights and ids gathered.
    comm = forward_comm_bytes(trace_model(load_model("deepseek-v3"), Strategy("tp", "tp", "ag-rs", N), batch=B, seq=S))
    eq1 = 2 * B * S * H_ * Fr(N - 1, N) * BYTES
    assert comm == {"attention": exact(eq1), "ffn": exact(eq1 + routing_gather_bytes(B, S, K, N))}


def sp_attention_formula() -> Fr:
    return (Fr(B * S, N) * HEADS * (2 * DQ + DV) + B * S * Fr(HEADS, N) * DV) * Fr(N - 1, N) * BYTES


def test_sp_ep_a2a_volumes():
    # Ulysses moves the assembled heads: q and k [b, s/n, H*dq] and v [b, s/n, H*dv] out,
    # the attention output [b, s, H/n*dv] back; each all-to-all sends (n-1)/n of its input.
    # Expert dispatch and combine: eq (3), 2k/n * bsh * (n-1)/n.
    comm = forward_comm_bytes(trace_model(load_model("deepseek-v3"), Strategy("sp", "ep", "a2a", N), batch=B, seq=S))
    attention = sp_attention_formula()
    eq3 = Fr(2 * K, N) * B * S * H_ * Fr(N - 1, N) * BYTES
    assert comm == {"attention": exact(attention), "ffn": exact(eq3)}


def activation_formula(n: int) -> Fr:
    """sp + ep + ag-rs, every forward activation held (the Fig 9 accounting), per rank, bytes.

    Attention, per local token (t = bs/n rows): the layer input, its norm, the output projection
    and the residual (4h); q's latent and its norm (2 r_q); kv's latent with k_pe (r_kv + dr) and
    the latent's norm (r_kv); q [H dq] and kv [H (dn+dv)] from the up projections; the assembled
    heads q, k [H dq] and v [H dv]; the same after Ulysses; the attention output and its
    all-to-all back (2 H dv). FFN (Fig 9's MoE part): norm 1, gathered tokens n, dispatched rows
    k, FC1/FC3/SwiGLU 3kf, FC2 k, combined n, reduce-scattered 1, residual 1, all in units of
    bsh/n; the shared expert: 3 f_s/h + 2 (its FC1, FC3, SwiGLU; its output and the sum)."""
    t = Fr(B * S, n)
    attention = (4 * H_ + 2 * RQ + (RKV + DR) + RKV + HEADS * DQ + HEADS * (DN + DV)
                 + 2 * HEADS * (2 * DQ + DV) + 2 * HEADS * DV) * t
    f = Fr(F_EXPERT, H_)
    ffn = (1 + n + K + 3 * K * f + K + n + 1 + 1 + 3 * Fr(F_SHARED, H_) + 2) * t * H_
    return (attention + ffn) * BYTES


def test_activation_bytes_match_the_formula():
    g = trace_model(load_model("deepseek-v3"), Strategy("sp", "ep", "ag-rs", N), batch=B, seq=S)
    assert g.activation_bytes() == exact(activation_formula(N))


def test_activation_example_in_the_docs():
    # the number docs/cost_model.md quotes, recomputed from the formula (not the graph)
    assert exact(activation_formula(N)) == 1_176_633_344
    assert exact(sp_attention_formula()) == 146_800_640


def test_the_dense_layers_are_an_mlp_and_the_moe_layers_route():
    cfg = load_model("deepseek-v3")
    with torch.device("meta"):
        dense, moe = MoETransformerLayer.from_config(cfg, layer=2), MoETransformerLayer.from_config(cfg, layer=3)
    assert dense.moe is None and dense.mlp.w1.weight.shape == (F_DENSE, H_)
    assert moe.mlp is None and moe.moe.w1.shape == (E, F_EXPERT, H_)
    g = trace_module(dense, Strategy("tp", "tp", "ag-rs", N), batch=1, seq=1024)
    ops = {nd.op for nd in g.nodes if nd.phase is Phase.FORWARD}
    assert OpKind.MLA_HEADS in ops and OpKind.ROUTER not in ops and OpKind.GROUPED_GEMM not in ops


def test_the_router_attributes_reach_the_graph():
    g = trace_model(load_model("deepseek-v3"), Strategy("sp", "ep", "a2a", N), batch=1, seq=1024)
    (router,) = [nd for nd in g.nodes if nd.op is OpKind.ROUTER and nd.phase is Phase.FORWARD]
    attrs = dict(router.attrs)
    assert (attrs["scoring"], attrs["groups"], attrs["topk_groups"], attrs["scale"], attrs["score_bias"]) == \
        ("sigmoid", GROUPS, TOPK_GROUPS, 2.5, True)
    assert g.param_spec["router.score_bias"].buffer and "router.score_bias" not in g.grad_of


# --- numerics ----------------------------------------------------------------------------------

TINY = dict(hidden=64, heads=4, kv_heads=4, ffn_hidden=48, experts=8, top_k=3,
            mla=dict(q_rank=24, kv_rank=16, nope_dim=8, rope_dim=4, v_dim=6), scoring="sigmoid", groups=4,
            topk_groups=2, scale=2.5, score_bias=True, shared_ffn_hidden=48, rope_theta=1e4)


def tiny_layer(seed: int, dense: bool = False, q_rank: bool = True) -> MoETransformerLayer:
    torch.manual_seed(seed)
    kw = dict(TINY, mla=TINY["mla"] | ({} if q_rank else {"q_rank": None}))
    layer = MoETransformerLayer(**kw, dense_ffn_hidden=80 if dense else None)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if not dense:   # a bias large enough to change which experts are chosen
        layer.moe.e_score_correction_bias.normal_(std=0.3)
    return layer


@pytest.mark.parametrize("attn,ffn,dispatch", [("tp", "tp", "ag-rs"), ("sp", "ep", "a2a"), ("tp", "ep", "ag-rs")])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("variant", ["moe", "dense", "moe-no-q-rank"])
@pytest.mark.slow
def test_reference_layer_matches_eager(variant, n, attn, ffn, dispatch, rng, one_thread):
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    layer = tiny_layer(seed, dense=variant == "dense", q_rank=variant != "moe-no-q-rank")
    x, dy = torch.randn(2, 16, 64, generator=rng), torch.randn(2, 16, 64, generator=rng)
    assert_interpreted_matches_eager(layer, Strategy(attn, ffn, dispatch, n, dtype="fp32"), x, dy)


def test_the_score_bias_changes_the_choice():
    # the test above would not see the bias if it never changed an expert choice
    from moegraph.models import route
    layer = tiny_layer(0)
    x = torch.randn(64, 64)
    moe = layer.moe
    args = dict(scoring="sigmoid", groups=4, topk_groups=2, scale=2.5)
    _, with_bias = route(x, moe.router.weight, 3, bias=moe.e_score_correction_bias, **args)
    _, without = route(x, moe.router.weight, 3, bias=None, **args)
    assert not torch.equal(with_bias.sort(-1).values, without.sort(-1).values)


# --- the eager reference against transformers' DeepSeek-V3 -------------------------------------

def hf_config(**extra):
    hf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config
    m = TINY["mla"]
    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=m["q_rank"],
                           kv_lora_rank=m["kv_rank"], qk_nope_head_dim=m["nope_dim"], qk_rope_head_dim=m["rope_dim"],
                           v_head_dim=m["v_dim"], n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, n_shared_experts=1, moe_intermediate_size=48,
                           intermediate_size=80, rope_interleave=False, rms_norm_eps=1e-5, attention_dropout=0.0,
                           norm_topk_prob=True, rope_theta=1e4, **extra)
    cfg._attn_implementation = "eager"
    return hf, cfg


def test_mla_matches_transformers():
    hf, cfg = hf_config()
    ours = tiny_layer(1).attn
    theirs = hf.DeepseekV3Attention(cfg, layer_idx=0).eval()
    names = {"q_a_proj": "q_a_proj", "q_a_layernorm": "q_a_norm", "q_b_proj": "q_b_proj",
             "kv_a_proj_with_mqa": "kv_a_proj", "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "kv_b_proj",
             "o_proj": "o_proj"}
    with torch.no_grad():
        for hf_name, our_name in names.items():
            getattr(theirs, hf_name).weight.copy_(getattr(ours, our_name).weight)
    x = torch.randn(2, 16, 64)
    rotary = hf.DeepseekV3RotaryEmbedding(cfg)
    pos = torch.arange(16)[None].expand(2, -1)
    mask = torch.full((16, 16), float("-inf")).triu(1)[None, None]
    expected, _ = theirs(x, position_embeddings=rotary(x, pos), attention_mask=mask)
    assert rel_err(ours(x), expected) < 1e-5


def test_moe_matches_transformers():
    hf, cfg = hf_config()
    ours = tiny_layer(2).moe
    theirs = hf.DeepseekV3MoE(cfg).eval()
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        theirs.gate.e_score_correction_bias.copy_(ours.e_score_correction_bias)
        theirs.experts.gate_up_proj.copy_(torch.cat((ours.w1, ours.w3), dim=1))
        theirs.experts.down_proj.copy_(ours.w2)
        for hf_name, our_name in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            getattr(theirs.shared_experts, hf_name).weight.copy_(getattr(ours.shared, our_name).weight)
    x = torch.randn(2, 16, 64)
    assert rel_err(ours(x), theirs(x)) < 1e-5


# --- registry checks ---------------------------------------------------------------------------

BASE = dict(layers=2, hidden=64, heads=4, kv_heads=4, ffn_hidden=128, experts=8, top_k=2)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


@pytest.mark.parametrize("extra,field", [
    ({"qk_nope_head_dim": 8}, "qk_nope_head_dim"),                 # an MLA size without kv_lora_rank
    ({"kv_lora_rank": 16}, "qk_nope_head_dim"),                    # MLA without its head dims
    (MLA | {"qk_rope_head_dim": 5}, "qk_rope_head_dim"),
    (MLA | {"kv_heads": 2}, "kv_heads"),
    (MLA | {"qk_norm": True}, "qk_norm"),
    (MLA | {"head_dim": 16}, "head_dim"),
    ({"router_scoring": "relu"}, "router_scoring"),
    ({"n_group": 2}, "n_group"),                                   # groups need sigmoid scoring
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
    ({"score_correction_bias": True}, "score_correction_bias"),
    ({"router_scoring": "sigmoid", "n_group": 3}, "n_group"),
    ({"router_scoring": "sigmoid", "n_group": 2, "topk_group": 3}, "topk_group"),
    ({"router_scoring": "sigmoid", "n_group": 4, "topk_group": 1, "top_k": 3}, "top_k"),
    ({"first_k_dense_replace": 1}, "first_k_dense_replace"),       # no dense width
    ({"dense_ffn_hidden": 256}, "dense_ffn_hidden"),
    ({"first_k_dense_replace": 2, "dense_ffn_hidden": 256}, "first_k_dense_replace"),   # no MoE layer left
])
def test_bad_deepseek_fields_name_the_field(extra, field, tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(json.dumps(BASE | extra))
    with pytest.raises(RegistryError) as err:
        load_model(str(path))
    assert err.value.field == field and field in str(err.value) and "\n" not in str(err.value)


def test_trace_and_compile_run_on_deepseek_v3(capsys):
    args = ["--model", "deepseek-v3", "--hardware", "h800", "--n", "8", "--seq", "4096"]
    assert main(["trace", *args, "--attn", "tp", "--ffn", "ep", "--dispatch", "a2a", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["model"] == "deepseek-v3" and summary["forward_comm_bytes"]["ffn"] > 0
    assert main(["compile", *args, "--schedule", "sequential", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan_us"] > 0


@pytest.mark.slow
def test_a_stack_holds_only_the_moe_layers():
    from moegraph.config import CompileConfig
    from moegraph.schedules.driver import lower
    # 61 layers, the first 3 dense: a stack of identical MoE layers has at most 58
    cfg = load_model("deepseek-v3")
    g = stack_layers(trace_model(cfg, Strategy("tp", "ep", "a2a", N), batch=1, seq=1024), 58)
    assert {nd.layer for nd in g.nodes} == set(range(58))
    with pytest.raises(Exception, match=r"^layers=59 must be between 1 and deepseek-v3's 58 MoE layers \(its "
                                        r"first_k_dense_replace=3 dense layers lower to another graph\)$"):
        lower(CompileConfig(model=cfg, strategy=Strategy("tp", "ep", "a2a", N), passes=(), seq=1024, layers=59))


@pytest.mark.slow
def test_a_deepseek_v3_like_yaml_runs_on_two_gloo_ranks_and_matches_eager(tmp_path, capsys):
    # every new field at once in a user YAML, run end to end (the router's score bias is a
    # buffer: the runtime must hand it to the ranks) and checked against the eager layer
    path = tmp_path / "tiny-dsv3.yaml"
    path.write_text(json.dumps(BASE | MLA | dict(
        layers=4, ffn_hidden=48, top_k=3, q_lora_rank=24, router_scoring="sigmoid", n_group=4, topk_group=2,
        routed_scaling_factor=2.5, score_correction_bias=True, shared_experts=1, first_k_dense_replace=1,
        dense_ffn_hidden=96)))
    assert main(["run", "--model", str(path), "--n", "2", "--seq", "16", "--attn", "tp", "--ffn", "ep",
                 "--dispatch", "a2a", "--steps", "1", "--warmup", "0", "--schedule", "greedy", "--check",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_rel_err_output"] < 1e-5 and out["max_rel_err_grads"] < 1e-5, out
