"""Anything the tracer cannot lower is an error naming the module's qualified name and type."""

import pytest
import torch
from torch import nn

import moegraph
from helpers import small_layer

from moegraph.ir import OpKind, Phase, Strategy
from moegraph.models import Attention, MoE, RMSNorm
from moegraph.tracer import LoweringError, trace_module


class WithDense(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(64)
        self.attn = Attention(64, 8, 4, 8, 1e6)
        self.norm2 = RMSNorm(64)
        self.mlp = nn.Sequential(nn.Linear(64, 64))

    def forward(self, x):
        h = x + self.attn(self.norm(x))
        return h + self.mlp(self.norm2(h))


class WithScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn = RMSNorm(64), Attention(64, 8, 4, 8, 1e6)
        self.norm2, self.moe = RMSNorm(64), MoE(64, 96, 8, 2)

    def forward(self, x):
        h = x + self.attn(self.norm(x)) * x          # an elementwise product of two activations
        return h + self.moe(self.norm2(h))


class WithConstantScale(WithScale):
    def forward(self, x):
        h = x + self.attn(self.norm(x)) * 0.5        # a residual multiplier (Granite's)
        return h + self.moe(self.norm2(h))


def test_unknown_module_names_qualname_and_type():
    with pytest.raises(LoweringError, match=r"no lowering rule for module 'mlp\.0' \(torch\.nn\.modules\.linear\.Linear\)"):
        trace_module(WithDense(), Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=16)


def test_unsupported_operation_between_blocks_is_named():
    with pytest.raises(LoweringError, match=r"cannot lower call_function .*mul.* in WithScale"):
        trace_module(WithScale(), Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=16)


def test_a_constant_residual_multiplier_lowers_to_a_scale_node():
    """x * 0.5 between blocks is a SCALE node; the compile's numerical check ran it against eager."""
    g = trace_module(WithConstantScale(), Strategy("sp", "ep", "ag-rs", 2, dtype="fp32"), batch=1, seq=16)
    (scale,) = [nd for nd in g.nodes if nd.op is OpKind.SCALE and nd.phase is Phase.FORWARD]
    assert scale.attr("factor") == 0.5


def test_meta_device_tracing_allocates_nothing(monkeypatch):
    """trace_model builds the registry layer on the meta device: internal-352b's layer would be
    ~24 GB of fp32 weights, and not one parameter or buffer may have storage."""
    from moegraph.models import MoETransformerLayer
    from moegraph.registry import load_model
    from moegraph.tracer import trace_model
    built = []
    real = MoETransformerLayer.from_config.__func__

    def spy(cls, cfg):
        built.append(real(cls, cfg))
        return built[-1]
    monkeypatch.setattr(MoETransformerLayer, "from_config", classmethod(spy))
    cfg = load_model("internal-352b")
    g = trace_model(cfg, Strategy("sp", "ep", "ag-rs", 8))
    (layer,) = built
    tensors = [*layer.parameters(), *layer.buffers()]
    assert sum(t.numel() for t in tensors) * 4 > 20e9                          # what it would have cost
    assert tensors and all(t.is_meta for t in tensors)
    assert g.dims.experts == 32


def test_a_bare_block_says_to_compile_its_decoder_layer_or_the_model():
    # a block's own rule describes it inside a layer; tracing into it blamed a missing rule deeper
    # down (HF: "register a rule for MixtralExperts")
    with pytest.raises(LoweringError, match=r"^moegraph\.models\.MoE is one block of a decoder layer, not a layer .*"
                                            r"compile the decoder layer that holds it .* or the whole model instead"):
        trace_module(MoE(64, 96, 8, 2), Strategy("sp", "ep", "ag-rs", 1), batch=1, seq=16)
    hf = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    cfg = hf.MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                           num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(LoweringError, match=r"MixtralSparseMoeBlock is one block of a decoder layer"):
        moegraph.compile(hf.MixtralSparseMoeBlock(cfg), torch.randn(2, 16, 32), hardware="cpu-gloo")


@pytest.mark.slow
def test_a_torch_compiled_module_says_to_pass_the_original():
    layer = small_layer(1)
    with pytest.raises(ValueError, match=r"^OptimizedModule wraps MoETransformerLayer \(torch\.compile\): .*"
                                         r"compiled\._orig_mod"):
        moegraph.compile(torch.compile(layer), torch.randn(2, 16, 64), hardware="cpu-gloo")
