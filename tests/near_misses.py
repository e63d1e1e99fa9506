"""Modules that resemble transformers' Mixtral parts but compute something else: the guard tests
(tests/test_lowering_guard.py) require the structural guard to name them, the numerical-check tests
(tests/test_numerical_check.py) require the check to refuse them with the guard off. Import after
``pytest.importorskip("transformers")``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import MixtralConfig
from transformers.models.mixtral import modeling_mixtral as mx


def mixtral(**overrides) -> mx.MixtralDecoderLayer:
    """A tiny Mixtral decoder layer (h=64, 8 experts top-2, GQA 8/4), config fields overridden."""
    cfg = MixtralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4,
                        num_local_experts=8, num_experts_per_tok=2, attn_implementation="sdpa", **overrides)
    return mx.MixtralDecoderLayer(cfg, 0)


class SharedExpertMoe(mx.MixtralSparseMoeBlock):
    """A shared SwiGLU expert beside the routed ones (DeepSeekMoE / Qwen2-MoE style)."""

    def __init__(self, config):
        super().__init__(config)
        h, f = config.hidden_size, config.intermediate_size
        self.shared_up, self.shared_gate = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.shared_down = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return super().forward(x) + self.shared_down(F.silu(self.shared_gate(x)) * self.shared_up(x))


class OnePlusRMSNorm(mx.MixtralRMSNorm):
    """Gemma-style x * (1 + w)."""

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)) * (1 + self.weight)


class HalfPlusRMSNorm(mx.MixtralRMSNorm):
    """x * (0.5 + w): an offset the norm reading does not know (it finds Gemma's 1 + w by running the
    norm, and reads anything else as a plain RMSNorm, which the numerical check then refuses)."""

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)) * (0.5 + self.weight)


class NoisyRouter(mx.MixtralTopKRouter):
    """A router that shifts its input before scoring."""

    def forward(self, hidden_states):
        return super().forward(hidden_states + 0.1)
