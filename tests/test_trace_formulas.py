"""Communication volumes and activation memory equal MegaScale-MoE's closed forms, exactly.

The expected values are computed here from Table 2's sizes and the paper's equations, not
from the graph. Convention (README): bytes each rank sends in the forward pass; a ring
all-gather/reduce-scatter sends (n-1)/n of the full tensor, an all-to-all (n-1)/n of the
rank's input.
"""

from fractions import Fraction as Fr

import pytest

from helpers import routing_gather_bytes
from moegraph.commands import forward_comm_bytes
from moegraph.ir import Strategy
from moegraph.registry import load_model
from moegraph.tracer import trace_model, trace_module

MODELS = ["internal-352b", "mixtral-8x7b", "mixtral-8x22b", "hunyuan-large", "phi-3.5-moe", "deepseek-moe"]
# Table 2, typed from the paper: h, heads, m, h_ffn, experts, top-k
TABLE2 = {"internal-352b": (4096, 32, 4, 14336, 32, 3), "mixtral-8x7b": (4096, 32, 4, 14336, 8, 2),
          "mixtral-8x22b": (6144, 48, 6, 16384, 8, 2), "hunyuan-large": (6400, 80, 10, 18304, 16, 1),
          "phi-3.5-moe": (4096, 32, 4, 6400, 16, 2), "deepseek-moe": (2048, 16, 1, 1408, 64, 6)}
B, S, N, BYTES = 1, 8192, 8, 2
# Shared experts (S, f_s) from the public configs; Table 2 counts routed experts only
SHARED = {"hunyuan-large": (1, 18304), "deepseek-moe": (2, 1408)}


def paper(name):
    h, heads, m, h_ffn, experts, k = TABLE2[name]
    return h, Fr(m), Fr(h_ffn, h), k


def exact(x: Fr) -> int:
    assert x.denominator == 1, f"{x} is not a whole number of bytes"
    return int(x)


@pytest.mark.parametrize("name", MODELS)
def test_tp_attention_and_ffn_volumes_match_eq1_and_eq4(name):
    h, _, _, k = paper(name)
    comm = forward_comm_bytes(trace_model(load_model(name), Strategy("tp", "tp", "ag-rs", N), batch=B, seq=S))
    eq1 = 2 * B * S * h * Fr(N - 1, N)
    eq4 = 2 * B * S * h * Fr(N - 1, N)
    assert comm["attention"] == exact(eq1 * BYTES)
    assert comm["ffn"] == exact(eq4 * BYTES + routing_gather_bytes(B, S, k, N))     # + the routing's gather


@pytest.mark.parametrize("name", MODELS)
def test_ep_all_to_all_volume_matches_eq3(name):
    h, _, _, k = paper(name)
    comm = forward_comm_bytes(trace_model(load_model(name), Strategy("sp", "ep", "a2a", N), batch=B, seq=S))
    eq3 = Fr(2 * k, N) * B * S * h * Fr(N - 1, N)
    assert comm["ffn"] == exact(eq3 * BYTES)


@pytest.mark.parametrize("name", MODELS)
def test_sp_attention_volume_is_half_of_eq2(name):
    """Ulysses sends (n-1)/n of q,k,v ([b, s/n, h(1+2/m)]) and of attn ([b, s, h/n]): eq (2) / 2."""
    h, m, _, _ = paper(name)
    comm = forward_comm_bytes(trace_model(load_model(name), Strategy("sp", "ep", "ag-rs", N), batch=B, seq=S))
    eq2 = 2 * B * S * h * Fr(N - 1, N) * (2 + Fr(2) / m) / N
    assert comm["attention"] == exact(eq2 / 2 * BYTES)


@pytest.mark.parametrize("name", MODELS)
def test_activation_bytes_match_fig9_total(name):
    h, m, f, k = paper(name)
    g = trace_model(load_model(name), Strategy("sp", "ep", "ag-rs", N), batch=B, seq=S)
    total = (2 * N + 2 * k + 3 * k * f + 12 + 5 / m) * B * S * h / N
    if name in SHARED:      # docs/cost_model.md: FC1, FC3, SwiGLU [b, s/n, S*f_s], output, sum [b, s/n, h]
        count, f_s = SHARED[name]
        total += (3 * count * Fr(f_s, h) + 2) * B * S * h / N
    assert g.activation_bytes() == exact(total * BYTES)


def test_registry_models_match_table2():
    for name, (h, heads, m, h_ffn, experts, k) in TABLE2.items():
        cfg = load_model(name)
        assert (cfg.hidden, cfg.heads, cfg.heads // cfg.kv_heads, cfg.ffn_hidden, cfg.experts, cfg.top_k) == \
            (h, heads, m, h_ffn, experts, k)


# --- families read from Hugging Face configs (issue 27, item 6) --------------------------------------
# Sizes typed from the published config.json files (tests/assets/README.md): H, G, d, h, k, f. Their
# head width H*d differs from h, so the forms below keep H*d and G*d apart from h.

HF = {"qwen3-30b-a3b": dict(H=32, G=4, d=128, h=2048, k=8, f=768, n=4),
      "gpt-oss-120b": dict(H=64, G=8, d=64, h=2880, k=4, f=2880, n=8)}


def _hf(name):
    pytest.importorskip("transformers")
    return load_model(f"tests/assets/{name}.json"), HF[name]


@pytest.mark.parametrize("name", sorted(HF))
def test_hf_family_tp_volumes_are_eq1_and_eq4(name):
    """Whole heads per rank (per-head q/k norms, sinks, biases need no cross-rank sums): the
    sequence all-gather and reduce-scatter of [b, s, h] in each block, as eq (1) and (4)."""
    cfg, a = _hf(name)
    n = a["n"]
    comm = forward_comm_bytes(trace_model(cfg, Strategy("tp", "tp", "ag-rs", n), batch=B, seq=S))
    assert comm == {"attention": exact(2 * B * S * a["h"] * Fr(n - 1, n) * BYTES),
                    "ffn": exact(2 * B * S * a["h"] * Fr(n - 1, n) * BYTES + routing_gather_bytes(B, S, a["k"], n))}


@pytest.mark.parametrize("name", sorted(HF))
def test_hf_family_ulysses_and_a2a_volumes(name):
    """Ulysses in: this rank's q, k, v [b, s/n, (H+2G)d]; back: [b, s, Hd/n]; each (n-1)/n on the wire.
    Expert all-to-alls: eq (3) with h (the rows carry h, not H*d)."""
    cfg, a = _hf(name)
    n, H, G, d, h, k = a["n"], a["H"], a["G"], a["d"], a["h"], a["k"]
    comm = forward_comm_bytes(trace_model(cfg, Strategy("sp", "ep", "a2a", n), batch=B, seq=S))
    ulysses = Fr(n - 1, n) * (B * Fr(S, n) * (H + 2 * G) * d + Fr(B * S * H * d, n))
    assert comm == {"attention": exact(ulysses * BYTES), "ffn": exact(Fr(2 * k, n) * B * S * h * Fr(n - 1, n) * BYTES)}


def test_hf_family_activation_bytes():
    """sp + ep + ag-rs, per rank, u = b s/n tokens (bf16), from each block's saved values:
    Qwen3-30B-A3B  u [4h + 6d(H+G) + (2n + 2k + 3)h + 3kf]: per-head q/k norm outputs beside the
                   Fig 9 attention values, H*d apart from h;
    GPT-OSS-120B   u [5h + d(6H+7G) + (2n + 3k + 3)h + 5kf]: the q/k/v and o biases' outputs, the expert
                   biases' outputs (gate, up: k f each; down: k h), the clamped SwiGLU's."""
    for name, form in (("qwen3-30b-a3b", lambda n, H, G, d, h, k, f: 4 * h + 6 * d * (H + G) + (2 * n + 2 * k + 3) * h
                        + 3 * k * f),
                       ("gpt-oss-120b", lambda n, H, G, d, h, k, f: 5 * h + d * (6 * H + 7 * G) + (2 * n + 3 * k + 3) * h
                        + 5 * k * f)):
        cfg, a = _hf(name)
        g = trace_model(cfg, Strategy("sp", "ep", "ag-rs", a["n"]), batch=B, seq=S)
        u = Fr(B * S, a["n"])
        assert g.activation_bytes() == exact(u * form(a["n"], a["H"], a["G"], a["d"], a["h"], a["k"], a["f"]) * BYTES)


@pytest.mark.parametrize("gating", ["per-head", "per-element"])
def test_gated_attention_activation_bytes_add_the_gate(gating):
    """Laguna's gated attention output (the zoo's tiny layer: h=64, H=8, G=4, d=8; sp, n=2, fp32), the
    attention block's saved values per rank, u = b s/n tokens: u [3h + 6d(H+G)] as Qwen3-30B-A3B's
    above (its layer input aside), plus the gate's logits (u H per head, u Hd per feature), read by
    the gate's backward beside the attention output, and the gated output u Hd, o_proj's input."""
    pytest.importorskip("transformers")
    from family_zoo import moe_causal_lms, tiny_model
    lms = dict(moe_causal_lms())
    if "laguna" not in lms:
        pytest.skip("the installed transformers has no model type 'laguna'")
    h, H, G, d, n, b, s = 64, 8, 4, 8, 2, 2, 16
    layer = tiny_model("laguna", lms["laguna"], gating=gating).model.layers[0]
    assert (layer.self_attn.num_heads, layer.self_attn.head_dim, layer.self_attn.k_proj.out_features) == (H, d, G * d)
    g = trace_module(layer, Strategy("sp", "ep", "ag-rs", n, dtype="fp32"), batch=b, seq=s)
    block = {o: node.block for node in g.nodes for o in node.outputs}
    saved = sum(g.value[v].storage_bytes for v in g.saved if block.get(v) == "attention")
    u = Fr(b * s, n)
    gate = (H if gating == "per-head" else H * d) + H * d
    assert saved == exact(u * (3 * h + 6 * d * (H + G) + gate) * 4)
