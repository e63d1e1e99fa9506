"""Hugging Face MixtralDecoderLayer lowers like the reference layer and runs exactly."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import MixtralConfig  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralRotaryEmbedding  # noqa: E402

from helpers import eager_step, max_grad_err, rel_err, small_layer  # noqa: E402
from moegraph.interpreter import interpret  # noqa: E402
from moegraph.ir import Strategy  # noqa: E402
from moegraph.tracer import trace_module  # noqa: E402


def hf_layer(seed=0, **overrides):
    cfg = MixtralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4,
                        num_local_experts=8, num_experts_per_tok=3, rope_theta=1e6, rms_norm_eps=1e-5,
                        attn_implementation="sdpa", **overrides)
    torch.manual_seed(seed)
    layer = MixtralDecoderLayer(cfg, 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return cfg, layer


def hf_call(cfg):
    rotary = MixtralRotaryEmbedding(cfg)

    def call(layer, x):
        cos_sin = rotary(x, torch.arange(x.shape[1])[None])
        return layer(x, position_embeddings=cos_sin, attention_mask=None)
    return call


@pytest.mark.slow
@pytest.mark.parametrize("attn,ffn,dispatch", [("sp", "ep", "a2a"), ("sp", "ep", "ag-rs"), ("tp", "tp", "ag-rs")])
@pytest.mark.parametrize("n", [2, 4])
def test_hf_mixtral_matches_eager(attn, ffn, dispatch, n, rng):
    cfg, layer = hf_layer(seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
    x, dy = torch.randn(2, 16, 64, generator=rng), torch.randn(2, 16, 64, generator=rng)
    y_ref, dx_ref, grads_ref = eager_step(layer, x, dy, call=hf_call(cfg))
    graph = trace_module(layer, Strategy(attn, ffn, dispatch, n, dtype="fp32"), batch=2, seq=16)
    res = interpret(graph, {k: p.detach() for k, p in layer.named_parameters()}, x, dy)
    assert rel_err(res.output, y_ref) < 1e-5
    assert rel_err(res.input_grad, dx_ref) < 1e-5
    name, err = max_grad_err(res.param_grads, grads_ref)
    assert err < 1e-5, f"gradient of {name}: {err:.2e}"


@pytest.mark.parametrize("attn,ffn,dispatch", [("sp", "ep", "ag-rs"), ("tp", "tp", "ag-rs"), ("sp", "ep", "a2a")])
def test_reference_and_hf_lower_to_same_ops_and_shapes(attn, ffn, dispatch):
    _, hf = hf_layer()
    ours = small_layer(4)
    strategy = Strategy(attn, ffn, dispatch, 4)
    g_hf, g_ours = trace_module(hf, strategy, batch=1, seq=64), trace_module(ours, strategy, batch=1, seq=64)

    def signature(g):
        return [(n.op, n.phase, n.role, tuple(g.value[v].shape for v in n.inputs),
                 tuple(g.value[v].shape for v in n.outputs), n.flops, n.comm_bytes) for n in g.nodes]
    assert signature(g_hf) == signature(g_ours)
    assert g_hf.activation_bytes() == g_ours.activation_bytes()


def test_hf_jitter_noise_is_rejected_with_the_module_name():
    _, layer = hf_layer(router_jitter_noise=0.1)
    with pytest.raises(NotImplementedError, match=r"^mlp \(MixtralSparseMoeBlock\): router_jitter_noise=0.1"):
        trace_module(layer, Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=16)
