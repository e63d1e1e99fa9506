"""Communication volumes and activation memory equal MegaScale-MoE's closed forms, exactly.

The expected values are computed here from Table 2's sizes and the paper's equations, not
from the graph. Convention (README): bytes each rank sends in the forward pass; a ring
all-gather/reduce-scatter sends (n-1)/n of the full tensor, an all-to-all (n-1)/n of the
rank's input.
"""

from fractions import Fraction as Fr

import pytest

from moegraph.commands import forward_comm_bytes
from moegraph.ir import Strategy
from moegraph.registry import load_model
from moegraph.tracer import trace_model

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
    h, _, _, _ = paper(name)
    comm = forward_comm_bytes(trace_model(load_model(name), Strategy("tp", "tp", "ag-rs", N), batch=B, seq=S))
    eq1 = 2 * B * S * h * Fr(N - 1, N)
    eq4 = 2 * B * S * h * Fr(N - 1, N)
    assert comm["attention"] == exact(eq1 * BYTES)
    assert comm["ffn"] == exact(eq4 * BYTES)


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
