"""The project's reference MoE layer: Mixtral-style, in plain eager PyTorch.

It is the independent ground truth every numerical test compares against: nothing here
knows about graphs, ranks or schedules.

Notation: b batch, s sequence, h hidden, E experts, k top-k, H heads, G kv heads, d head dim;
MLA (DeepSeek-V2/V3): r_q, r_kv the q and kv latent ranks, dn, dr, dv the per-head no-RoPE q/k,
RoPE q/k and value dims.
"""

from __future__ import annotations

from typing import Literal

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
    """cos, sin of shape [s, d] ([b, s, d] for positions [b, s]) in the rotate-half convention (as
    Hugging Face Mixtral)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, s, heads, d]; cos/sin: [s, d], or [b, s, d] (each row's own positions)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = (cos[None], sin[None]) if cos.dim() == 2 else (cos, sin)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


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


class MLA(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), written from the DeepSeek-V3 paper (eqs 1-11)
    with plain rotate-half RoPE (YaRN scaling and the interleaved pair order change only rotation
    values). Per token x [h]:
        q = q_b(norm(q_a(x))) [H*(dn+dr)] (q_proj(x) when q_rank is None), per head (q_nope, q_rot)
        (c, k_pe) = kv_a(x) [r_kv + dr];  (k_nope, v) per head = kv_b(norm(c)) [H*(dn+dv)]
        attention over query (q_nope, rope(q_rot)), key (k_nope, rope(k_pe)) -- k_pe shared by
        every head -- with scale (dn+dr)^-0.5, then o [h, H*dv]."""

    def __init__(self, hidden: int, heads: int, q_rank: int | None, kv_rank: int, nope_dim: int, rope_dim: int,
                 v_dim: int, rope_theta: float, eps: float = 1e-5):
        super().__init__()
        self.heads, self.q_rank, self.kv_rank = heads, q_rank, kv_rank
        self.nope_dim, self.rope_dim, self.v_dim, self.rope_theta = nope_dim, rope_dim, v_dim, rope_theta
        qk = nope_dim + rope_dim
        if q_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_rank, bias=False)
            self.q_a_norm = RMSNorm(q_rank, eps)
            self.q_b_proj = nn.Linear(q_rank, heads * qk, bias=False)
        self.kv_a_proj = nn.Linear(hidden, kv_rank + rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(kv_rank, eps)
        self.kv_b_proj = nn.Linear(kv_rank, heads * (nope_dim + v_dim), bias=False)
        self.o_proj = nn.Linear(heads * v_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        H, dn, dr, dv = self.heads, self.nope_dim, self.rope_dim, self.v_dim
        q = self.q_proj(x) if self.q_rank is None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(b, s, H, dn + dr).split([dn, dr], dim=-1)
        c, k_pe = self.kv_a_proj(x).split([self.kv_rank, dr], dim=-1)          # [b, s, r_kv], [b, s, dr]
        k_nope, v = self.kv_b_proj(self.kv_a_norm(c)).view(b, s, H, dn + dv).split([dn, dv], dim=-1)
        cos, sin = rope_cos_sin(torch.arange(s, device=x.device), dr, self.rope_theta, x.dtype)
        q_rot = apply_rope(q_rot, cos, sin)
        k_rot = apply_rope(k_pe.view(b, s, 1, dr), cos, sin).expand(b, s, H, dr)
        query, key = torch.cat((q_nope, q_rot), dim=-1), torch.cat((k_nope, k_rot), dim=-1)   # [b, s, H, dn+dr]
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)                    # scale (dn+dr)^-0.5
        return self.o_proj(out.transpose(1, 2).reshape(b, s, H * dv))


Scoring = Literal["softmax", "sigmoid"]


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize: bool = True, *,
          scoring: Scoring = "softmax", bias: torch.Tensor | None = None, groups: int = 1, topk_groups: int = 1,
          scale: float = 1.0):
    """Top-k router. x: [tokens, h] -> (weights [tokens, k], experts [tokens, k]).

    softmax (Mixtral, Qwen2-MoE, OLMoE): top-k of the softmax probabilities, renormalised over the
    k unless normalize=False. sigmoid (DeepSeek-V3, as its reference inference code): scores are
    sigmoid(logits); the choice ranks score + bias (the score-correction bias steers load only),
    restricted to the topk_groups best of ``groups`` equal expert groups, a group ranked by the
    sum of its two best biased scores; the chosen experts' unbiased scores, renormalised if
    normalize, times ``scale`` weigh them."""
    logits = F.linear(x, router_weight).float()
    if scoring == "softmax":
        weights, experts = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        return (weights / weights.sum(dim=-1, keepdim=True) if normalize else weights), experts
    if scoring != "sigmoid":
        raise ValueError(f"scoring={scoring!r}: expected 'softmax' or 'sigmoid'")
    scores = torch.sigmoid(logits)                                              # [T, E]
    biased = scores if bias is None else scores + bias.float()
    T, E = scores.shape
    if groups > 1:
        per_group = biased.view(T, groups, E // groups)
        best_groups = per_group.topk(2, dim=-1).values.sum(dim=-1).topk(topk_groups, dim=-1).indices   # [T, tg]
        keep = torch.zeros(T, groups, dtype=torch.bool, device=x.device)
        keep[torch.arange(T, device=x.device)[:, None], best_groups] = True
        biased = per_group.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
    experts = torch.topk(biased, top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scale, experts


def swiglu(x: torch.Tensor, w1: nn.Linear, w3: nn.Linear, w2: nn.Linear) -> torch.Tensor:
    """w2(silu(w1 x) * w3 x): the dense SwiGLU FFN of the shared experts and the dense layers."""
    return w2(F.silu(w1(x)) * w3(x))


class DenseMLP(nn.Module):
    """A dense SwiGLU FFN: the MLP of DeepSeek-V3's first_k_dense_replace layers, which have no
    router and no experts. (Not SharedExpert's base: a rule for it would make every SharedExpert
    subclass a rule-backed one.)"""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn_hidden, bias=False)     # gate projection
        self.w3 = nn.Linear(hidden, ffn_hidden, bias=False)     # up projection
        self.w2 = nn.Linear(ffn_hidden, hidden, bias=False)     # down projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.w1, self.w3, self.w2)


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
        y = swiglu(x, self.w1, self.w3, self.w2)
        return y if self.gate is None else torch.sigmoid(self.gate(x)) * y


class MoE(nn.Module):
    """Top-k routed SwiGLU experts; expert weights stacked as [E, out, in] like nn.Linear.
    ``normalize``: renormalise the top-k weights to sum to 1 (Mixtral) or not (Qwen2-MoE, OLMoE,
    DeepSeekMoE). ``shared_ffn_hidden`` > 0 adds a SharedExpert of that (total) width.
    DeepSeek-V3's router (see ``route``): scoring="sigmoid", expert ``groups`` of which the
    ``topk_groups`` best are eligible, the routed ``scale``, and with ``score_bias`` the buffer
    ``e_score_correction_bias`` [E] (zeros; trained outside backprop, so not a parameter)."""

    def __init__(self, hidden: int, ffn_hidden: int, experts: int, top_k: int, *, normalize: bool = True,
                 shared_ffn_hidden: int = 0, shared_gate: bool = False, scoring: Scoring = "softmax",
                 groups: int = 1, topk_groups: int = 1, scale: float = 1.0, score_bias: bool = False):
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.scoring, self.groups, self.topk_groups, self.scale = scoring, groups, topk_groups, scale
        self.router = nn.Linear(hidden, experts, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(experts) if score_bias else None)
        self.w1 = nn.Parameter(torch.empty(experts, ffn_hidden, hidden))   # gate projection
        self.w3 = nn.Parameter(torch.empty(experts, ffn_hidden, hidden))   # up projection
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn_hidden))   # down projection
        for w in (self.w1, self.w3, self.w2):
            if w.device.type != "meta":      # meta has no values; its normal_ would import torch._dynamo (~1.8 s)
                nn.init.normal_(w, std=hidden ** -0.5)
        self.shared = SharedExpert(hidden, shared_ffn_hidden, shared_gate) if shared_ffn_hidden else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        weights, experts = route(tokens, self.router.weight, self.top_k, self.normalize, scoring=self.scoring,
                                 bias=self.e_score_correction_bias, groups=self.groups,
                                 topk_groups=self.topk_groups, scale=self.scale)
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
    """Pre-norm decoder layer: x + Attn(RMSNorm(x)), then + FFN(RMSNorm(.)).

    Attn is GQA ``attn`` (Attention), or MLA when ``kv_rank`` is given (DeepSeek-V3: ``mla``
    holds q_rank, kv_rank, nope_dim, rope_dim, v_dim). FFN is the MoE block ``moe``, or a dense
    SwiGLU ``mlp`` of width ``dense_ffn_hidden`` when given (DeepSeek-V3's first layers)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, experts: int, top_k: int,
                 head_dim: int | None = None, rope_theta: float = 1e6, rms_eps: float = 1e-5, *,
                 qkv_bias: bool = False, qk_norm: bool = False, normalize_topk: bool = True,
                 shared_ffn_hidden: int = 0, shared_gate: bool = False, mla: dict | None = None,
                 scoring: Scoring = "softmax", groups: int = 1, topk_groups: int = 1, scale: float = 1.0,
                 score_bias: bool = False, dense_ffn_hidden: int | None = None):
        super().__init__()
        head_dim = head_dim or hidden // heads
        self.input_norm = RMSNorm(hidden, rms_eps)
        if mla is None:
            self.attn = Attention(hidden, heads, kv_heads, head_dim, rope_theta, qkv_bias=qkv_bias, qk_norm=qk_norm,
                                  eps=rms_eps)
        else:
            self.attn = MLA(hidden, heads, rope_theta=rope_theta, eps=rms_eps, **mla)
        self.post_attn_norm = RMSNorm(hidden, rms_eps)
        self.moe = self.mlp = None
        if dense_ffn_hidden is not None:
            self.mlp = DenseMLP(hidden, dense_ffn_hidden)
        else:
            self.moe = MoE(hidden, ffn_hidden, experts, top_k, normalize=normalize_topk,
                           shared_ffn_hidden=shared_ffn_hidden, shared_gate=shared_gate, scoring=scoring,
                           groups=groups, topk_groups=topk_groups, scale=scale, score_bias=score_bias)

    @classmethod
    def from_config(cls, cfg, layer: int | None = None) -> "MoETransformerLayer":
        """Build from a registry ModelConfig (moegraph.registry): layer ``layer`` of the model
        (dense when below cfg.first_k_dense_replace), or by default an MoE layer."""
        mla = None
        if cfg.kv_lora_rank is not None:
            mla = dict(q_rank=cfg.q_lora_rank, kv_rank=cfg.kv_lora_rank, nope_dim=cfg.qk_nope_head_dim,
                       rope_dim=cfg.qk_rope_head_dim, v_dim=cfg.v_head_dim)
        dense = layer is not None and layer < cfg.first_k_dense_replace
        return cls(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, cfg.experts, cfg.top_k,
                   head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_eps=cfg.rms_eps, qkv_bias=cfg.qkv_bias,
                   qk_norm=cfg.qk_norm, normalize_topk=cfg.normalize_topk,
                   shared_ffn_hidden=cfg.shared_ffn_total, shared_gate=cfg.shared_gate, mla=mla,
                   scoring=cfg.router_scoring, groups=cfg.n_group, topk_groups=cfg.topk_group,
                   scale=cfg.routed_scaling_factor, score_bias=cfg.score_correction_bias,
                   dense_ffn_hidden=cfg.dense_ffn_hidden if dense else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.input_norm(x))
        ffn = self.moe if self.mlp is None else self.mlp
        return h + ffn(self.post_attn_norm(h))


class CausalLMOutput:
    """What ``MoETransformer.forward`` returns: ``loss`` (None without labels) and ``logits``
    [b, s, vocab] (attributes, as transformers' outputs)."""

    def __init__(self, loss: torch.Tensor | None, logits: torch.Tensor | None):
        self.loss, self.logits = loss, logits


VOCAB = 32000
"""The vocabulary size when the registry gives none (it has no such field): Mixtral's."""

IGNORE_INDEX = -100
"""A label that contributes no loss (transformers' convention: padding, prompt tokens)."""


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [b, s]: the label position t is scored against, labels[t + 1]; IGNORE_INDEX at the end."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, as transformers' ForCausalLMLoss: position t predicts
    labels[t + 1]; the last position and IGNORE_INDEX labels contribute nothing; fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), shift_labels(labels).flatten(), ignore_index=IGNORE_INDEX)


class MoETransformer(nn.Module):
    """A causal MoE language model: token embedding, L MoETransformerLayer, final RMSNorm, an
    untied LM head. ``forward(input_ids [b, s], labels=None)`` -> CausalLMOutput.
    ``router_aux_loss_coef`` > 0 adds, with labels, coef x the routers' load-balancing loss
    (``load_balancing_loss``) to the loss, as transformers' Mixtral with output_router_logits."""

    def __init__(self, vocab: int, layers: list[MoETransformerLayer], hidden: int, rms_eps: float = 1e-5,
                 router_aux_loss_coef: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, rms_eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.router_aux_loss_coef = router_aux_loss_coef

    @classmethod
    def from_config(cls, cfg, *, layers: int | None = None, vocab: int = VOCAB) -> "MoETransformer":
        """Build from a registry ModelConfig: ``layers`` layers (default: the model's cfg.layers;
        DeepSeek-V3's first cfg.first_k_dense_replace are dense). The registry has no vocabulary
        size; ``vocab`` defaults to Mixtral's 32000."""
        count = cfg.layers if layers is None else layers
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= cfg.layers:
            raise ValueError(f"layers={count!r} must be between 1 and {cfg.name}'s {cfg.layers} layers")
        return cls(vocab, [MoETransformerLayer.from_config(cfg, layer=i) for i in range(count)], cfg.hidden,
                   cfg.rms_eps, router_aux_loss_coef=cfg.router_aux_loss_coef)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        aux = self.router_aux_loss_coef > 0 and labels is not None
        routed: list[torch.Tensor] = []                 # each MoE layer's router input [b, s, h]
        hooks = [layer.moe.register_forward_pre_hook(lambda _, args: routed.append(args[0]))
                 for layer in self.layers if aux and layer.moe is not None]
        try:
            x = self.embed(input_ids)
            for layer in self.layers:
                x = layer(x)
        finally:
            for hook in hooks:
                hook.remove()
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return CausalLMOutput(None, logits)
        loss = causal_lm_loss(logits, labels)
        if aux:
            moes = [layer.moe for layer in self.layers if layer.moe is not None]
            router_logits = [F.linear(x.reshape(-1, x.shape[-1]), m.router.weight) for x, m in zip(routed, moes)]
            loss = loss + self.router_aux_loss_coef * load_balancing_loss(router_logits, moes[0].top_k)
        return CausalLMOutput(loss, logits)


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (no attention mask): every layer's router logits
    [T, E] together, P = softmax in fp32, the top-k of P one-hot: E * sum over the k slots and the
    experts of (fraction of rows choosing the expert in the slot) x (mean P of the expert)."""
    logits = torch.cat(router_logits)                                          # [L*T, E]
    probs = torch.softmax(logits.float(), dim=-1)
    chosen = F.one_hot(torch.topk(probs, top_k, dim=-1).indices, logits.shape[-1]).float()   # [L*T, k, E]
    return (chosen.mean(0) * probs.mean(0)[None]).sum() * logits.shape[-1]
