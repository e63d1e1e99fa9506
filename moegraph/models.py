"""The project's reference MoE layer: Mixtral-style, in plain eager PyTorch.

It is the independent ground truth every numerical test compares against: nothing here
knows about graphs, ranks or schedules.

Notation: b batch, s sequence, h hidden, E experts, k top-k, H heads, G kv heads, d head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32):
    """cos, sin of shape [s, d] in the rotate-half convention (as Hugging Face Mixtral)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, s, heads, d]; cos/sin: [s, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


def causal_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [b, s, H, d], k/v: [b, s, G, d] -> [b, s, H*d], causal, GQA by repeating kv heads."""
    heads, kv_heads = q.shape[2], k.shape[2]
    rep = heads // kv_heads
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2).flatten(2)


class Attention(nn.Module):
    """GQA attention with RoPE. Optional, as today's families have them: biases on the q, k, v
    projections (Qwen2-MoE) and RMSNorm of q and k over their whole projection width H*d and
    G*d, applied before RoPE (OLMoE)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, rope_theta: float, *,
                 qkv_bias: bool = False, qk_norm: bool = False, eps: float = 1e-5):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rope_theta = heads, kv_heads, head_dim, rope_theta
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(heads * head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(kv_heads * head_dim, eps) if qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)                     # [b, s, H*d], [b, s, G*d]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.heads, self.head_dim)
        k = k.view(b, s, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim)
        cos, sin = rope_cos_sin(torch.arange(s, device=x.device), self.head_dim, self.rope_theta, x.dtype)
        out = causal_gqa_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.o_proj(out)


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize: bool = True):
    """Softmax router with top-k, renormalised over the k (Mixtral) unless normalize=False
    (Qwen2-MoE's default). x: [tokens, h] -> ([tokens, k], [tokens, k])."""
    probs = torch.softmax(F.linear(x, router_weight).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True) if normalize else weights), experts


class SharedExpert(nn.Module):
    """A dense SwiGLU FFN every token goes through beside the routed experts, optionally scaled
    per token by sigmoid(x @ gate.T) (Qwen2-MoE). S shared experts of width f_s are one of width
    S*f_s: their outputs are summed, and a sum of SwiGLUs is the SwiGLU of the concatenated
    weights (DeepSeekMoE's reference code builds them that way)."""

    def __init__(self, hidden: int, ffn_hidden: int, gate: bool):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn_hidden, bias=False)     # gate projection
        self.w3 = nn.Linear(hidden, ffn_hidden, bias=False)     # up projection
        self.w2 = nn.Linear(ffn_hidden, hidden, bias=False)     # down projection
        self.gate = nn.Linear(hidden, 1, bias=False) if gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return y if self.gate is None else torch.sigmoid(self.gate(x)) * y


class MoE(nn.Module):
    """Top-k routed SwiGLU experts; expert weights stacked as [E, out, in] like nn.Linear.
    ``normalize``: renormalise the top-k weights to sum to 1 (Mixtral) or not (Qwen2-MoE, OLMoE,
    DeepSeekMoE). ``shared_ffn_hidden`` > 0 adds a SharedExpert of that (total) width."""

    def __init__(self, hidden: int, ffn_hidden: int, experts: int, top_k: int, *, normalize: bool = True,
                 shared_ffn_hidden: int = 0, shared_gate: bool = False):
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, ffn_hidden, hidden))   # gate projection
        self.w3 = nn.Parameter(torch.empty(experts, ffn_hidden, hidden))   # up projection
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn_hidden))   # down projection
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=hidden ** -0.5)
        self.shared = SharedExpert(hidden, shared_ffn_hidden, shared_gate) if shared_ffn_hidden else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        weights, experts = route(tokens, self.router.weight, self.top_k, self.normalize)
        out = torch.zeros_like(tokens)
        for e in range(self.w1.shape[0]):
            token_idx, slot = torch.where(experts == e)
            if token_idx.numel() == 0:
                continue
            xe = tokens[token_idx]
            ye = F.linear(F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e]), self.w2[e])
            out = out.index_add(0, token_idx, ye * weights[token_idx, slot, None].to(ye.dtype))
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(b, s, h)


class MoETransformerLayer(nn.Module):
    """Pre-norm decoder layer: x + Attn(RMSNorm(x)), then + MoE(RMSNorm(.))."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, experts: int, top_k: int,
                 head_dim: int | None = None, rope_theta: float = 1e6, rms_eps: float = 1e-5, *,
                 qkv_bias: bool = False, qk_norm: bool = False, normalize_topk: bool = True,
                 shared_ffn_hidden: int = 0, shared_gate: bool = False):
        super().__init__()
        head_dim = head_dim or hidden // heads
        self.input_norm = RMSNorm(hidden, rms_eps)
        self.attn = Attention(hidden, heads, kv_heads, head_dim, rope_theta, qkv_bias=qkv_bias, qk_norm=qk_norm,
                              eps=rms_eps)
        self.post_attn_norm = RMSNorm(hidden, rms_eps)
        self.moe = MoE(hidden, ffn_hidden, experts, top_k, normalize=normalize_topk,
                       shared_ffn_hidden=shared_ffn_hidden, shared_gate=shared_gate)

    @classmethod
    def from_config(cls, cfg) -> "MoETransformerLayer":
        """Build from a registry ModelConfig (moegraph.registry)."""
        return cls(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, cfg.experts, cfg.top_k,
                   head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_eps=cfg.rms_eps, qkv_bias=cfg.qkv_bias,
                   qk_norm=cfg.qk_norm, normalize_topk=cfg.normalize_topk,
                   shared_ffn_hidden=cfg.shared_ffn_total, shared_gate=cfg.shared_gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.input_norm(x))
        return h + self.moe(self.post_attn_norm(h))
