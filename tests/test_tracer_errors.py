"""Anything the tracer cannot lower is an error naming the module's qualified name and type."""

import pytest
from torch import nn

from moegraph.ir import Strategy
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
        h = x + self.attn(self.norm(x)) * 0.5
        return h + self.moe(self.norm2(h))


def test_unknown_module_names_qualname_and_type():
    with pytest.raises(LoweringError, match=r"no lowering rule for module 'mlp\.0' \(torch\.nn\.modules\.linear\.Linear\)"):
        trace_module(WithDense(), Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=16)


def test_unsupported_operation_between_blocks_is_named():
    with pytest.raises(LoweringError, match=r"cannot lower call_function .*mul.* in WithScale"):
        trace_module(WithScale(), Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=16)


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
