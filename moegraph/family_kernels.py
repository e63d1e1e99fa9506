"""Kernels of the structural lowering's ops (NORM, GLU, SCALE, GROUPED_BIAS) and the extended
math of ATTENTION (windows, chunks, sinks, a softmax scale), ROPE (any frequencies, partial,
interleaved) and ROUTER (group max, softmax choice bias, a trained logit bias).

Registered into ``moegraph.kernels.KERNELS`` at import (kernels.py imports this module last); the
interpreter and the runtime run them through ``run_compute`` like every other kernel. Backward
kernels differentiate the forward with autograd (``_pullback``): exact, and these ops are small.

Notation: b batch, S sequence on this rank after the op's layout, H query heads, G kv heads, d head
dim, R expert rows, El experts on this rank, E experts, T tokens, k top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moegraph.ir import Node, OpKind, Role, bad_choice
from moegraph.models import apply_rope, causal_gqa_attention, rms_norm, rope_cos_sin
from moegraph.tokens import Tokens, attention_allowed

# -- RoPE ------------------------------------------------------------------------------------------

ROPE_EXTRA = ("inv_freq", "scaling", "rotary_dim", "interleave")


def rope_extended(node: Node) -> bool:
    """Whether a ROPE / MLA_HEADS node carries any rotation beyond the default theta one."""
    return any(node.attr(a, None) is not None for a in ROPE_EXTRA)


def cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype, inv_freq: tuple[float, ...] | None = None,
            scaling: float | None = None):
    """Rotate-half cos, sin [S, dim]: theta's default frequencies (models.rope_cos_sin), or the rotary
    module's ``inv_freq`` and cos/sin ``scaling`` (YaRN's attention factor)."""
    if inv_freq is None and scaling is None:
        return rope_cos_sin(positions, dim, theta, dtype)
    inv = torch.tensor(inv_freq, dtype=torch.float32).to(positions.device) if inv_freq is not None else \
        1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    emb = positions.float()[..., None] * inv                      # [S, dim/2], or [b, S, dim/2]
    emb, s = torch.cat((emb, emb), dim=-1), 1.0 if scaling is None else scaling
    return (emb.cos() * s).to(dtype), (emb.sin() * s).to(dtype)


def rotate(node: Node, x: torch.Tensor, positions: torch.Tensor, dim: int, inverse: bool = False) -> torch.Tensor:
    """x [b, S, heads, dim] rotated by each row's position (``positions`` [S], or [b, S]) as the node's attrs say: frequencies
    ``inv_freq`` (default: theta's), cos/sin times ``scaling``, the first ``rotary_dim`` dims only
    (the rest pass through), pairs (2i, 2i+1) when ``interleave`` else (i, i + dr/2). ``inverse``
    rotates back (the transpose, for the backward)."""
    dr = node.attr("rotary_dim", dim)
    inv = node.attr("inv_freq", None)
    if inv is None:
        cos, sin = rope_cos_sin(positions, dr, node.attr("theta"), torch.float32)
        cos, sin = cos[..., : dr // 2], sin[..., : dr // 2]
    else:
        freqs = positions.float()[..., None] * torch.tensor(inv, dtype=torch.float32).to(positions.device)
        cos, sin = freqs.cos(), freqs.sin()
    scaling = node.attr("scaling", 1.0)
    cos, sin = (cos * scaling).to(x.dtype), (sin * scaling).to(x.dtype)       # [S, dr/2] or [b, S, dr/2]
    if inverse:
        sin = -sin
    x_rot, x_pass = x[..., :dr], x[..., dr:]
    c, s = (cos[None], sin[None]) if cos.dim() == 2 else (cos, sin)
    c, s = c[:, :, None, :], s[:, :, None, :]
    if node.attr("interleave", False):
        a, b = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        out = apply_rope(x_rot, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    return torch.cat((out, x_pass), dim=-1) if dr < dim else out


# -- attention -------------------------------------------------------------------------------------

def attention_extended(node: Node) -> bool:
    return any(node.attr(a, None) is not None for a in ("window", "chunk_size", "scale")) or node.attr("sinks", False)


def attend(node: Node, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None,
           tokens: Tokens | None = None):
    """q [b, S, H, d], k [b, S, G, d], v [b, S, G, dv] in sequence order -> [b, S, H*dv]: causal
    attention restricted to a sliding ``window`` (keys in (q - window, q]) or to q's ``chunk``, with
    softmax ``scale`` (default d^-0.5) and, with ``sinks`` [H], one extra logit per head in the
    softmax's denominator only (GPT-OSS's attention sinks); ``tokens``: the batch's padding or
    packed documents (``moegraph.tokens.attention_allowed``)."""
    if not attention_extended(node) and tokens is None:
        return causal_gqa_attention(q, k, v)
    b, S, H, d = q.shape
    scale = node.attr("scale", None) or d ** -0.5
    # [S, S] or [b, 1, S, S] (query, key)
    allowed = attention_allowed(tokens, S, node.attr("window", None), node.attr("chunk_size", None), q.device)
    rep = H // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)            # [b, H, S, .]
    if sinks is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed, scale=scale)
    else:
        logits = (qt @ kt.transpose(-2, -1)) * scale
        logits = logits.masked_fill(~allowed, float("-inf"))
        sink = sinks.to(logits.dtype).view(1, H, 1, 1).expand(b, H, S, 1)
        combined = torch.cat((logits, sink), dim=-1)
        probs = torch.softmax(combined - combined.amax(-1, keepdim=True), dim=-1)[..., :-1]
        out = probs.to(vt.dtype) @ vt
    return out.transpose(1, 2).flatten(2)


def attention_pairs(s: int, window: int | None, chunk: int | None) -> int:
    """(query, key) pairs a causal mask keeps over s positions, restricted to a sliding window
    (each query sees min(i + 1, window) keys) or to chunks (c(c+1)/2 per whole chunk of c)."""
    if window is not None and chunk is not None:
        return sum(min(i + 1, window, i % chunk + 1) for i in range(s))
    if window is not None:
        w = min(window, s)
        return w * (w + 1) // 2 + (s - w) * w
    if chunk is not None:
        whole, rest = divmod(s, chunk)
        return whole * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2
    return s * (s + 1) // 2


# -- routers ---------------------------------------------------------------------------------------

def route_general(node: Node, x: torch.Tensor, w: torch.Tensor, *extra: torch.Tensor):
    """x [..., h], w [E, h] -> (weights [T, k], experts [T, k]) for routers beyond ROUTER's two plain
    ones. Inputs after w: the choice bias [E] when attr score_bias, the trained logit bias [E] when
    attr logit_bias. scores = softmax or sigmoid of the (biased) fp32 logits; experts = top-k of
    scores + choice bias (logits + choice bias when attr bias_on_logits: Kolibri) among the topk_groups best of ``groups`` groups (a group ranked by
    group_score: its two best, or its best choice score); weights = their scores, renormalised
    when normalize, times scale. Attr topk_first (GPT-OSS): the top-k of the logits, weighed by the
    softmax over those k (equal in value; the other experts get exactly zero gradient, as eager's)."""
    extra = list(extra)
    choice_bias = extra.pop(0) if node.attr("score_bias", False) else None
    logit_bias = extra.pop(0) if node.attr("logit_bias", False) else None
    expert_scale = extra.pop(0) if node.attr("expert_scale", False) else None
    tokens = x.reshape(-1, x.shape[-1])
    logits = F.linear(tokens.float(), w.float(), None if logit_bias is None else logit_bias.float())
    scoring = node.attr("scoring")
    if node.attr("topk_first", False):      # GPT-OSS: softmax over the top-k logits (unpicked: zero gradient)
        if choice_bias is not None or expert_scale is not None or scoring != "softmax":
            raise ValueError(f"node {node.name!r}: topk_first is a softmax router's with no choice bias or "
                             "per-expert scale")
        top, experts = torch.topk(logits, node.attr("top_k"), dim=-1)
        return torch.softmax(top, dim=-1) * node.attr("scale", 1.0), experts
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise bad_choice(node)
    choice = logits if node.attr("bias_on_logits", False) else scores
    choice = choice if choice_bias is None else choice + choice_bias.float().reshape(-1)
    T, E = choice.shape
    groups, topk_groups = node.attr("groups", 1), node.attr("topk_groups", 1)
    if groups > 1:
        per = choice.view(T, groups, E // groups)
        how = node.attr("group_score", "top2-sum")
        ranked = per.topk(2, dim=-1)[0].sum(-1) if how == "top2-sum" else per.amax(-1)
        keep = torch.zeros_like(ranked).scatter_(1, ranked.topk(topk_groups, dim=-1)[1], 1).bool()
        choice = choice.masked_fill(~keep[:, :, None].expand(T, groups, E // groups).reshape(T, E), float("-inf"))
    experts = torch.topk(choice, node.attr("top_k"), dim=-1)[1]
    weights = scores.gather(1, experts)
    if node.attr("normalize", True):
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    if expert_scale is not None:                # Gemma 4: each chosen weight times its expert's trained scale
        weights = weights * expert_scale.float().reshape(-1)[experts]
    return weights * node.attr("scale", 1.0), experts


# -- NORM, GLU, SCALE, GROUPED_BIAS ----------------------------------------------------------------

def _norm_fwd(node: Node, x: torch.Tensor, w: torch.Tensor | None = None):
    kind, eps = node.attr("kind"), node.attr("eps")
    if kind == "layer":
        return layer_norm(x, w, eps)
    if kind == "head_rms":
        d, offset = node.attr("group"), node.attr("offset", 0.0)
        return rms_norm(x.unflatten(-1, (-1, d)), w + offset if offset else w, eps).flatten(-2)
    if kind == "l2":
        d = node.attr("group")
        xf = x.unflatten(-1, (-1, d)).float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).flatten(-2)
    raise bad_choice(node)


def layer_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """NORM's kind 'layer': a LayerNorm of the last dim with weight ``w`` and no bias (a bias is its
    own BIAS node); also the model edges' final LayerNorm (``runtime.model_steps.final_norm``)."""
    return F.layer_norm(x, (x.shape[-1],), w, None, eps)


def _glu_fwd(node: Node, a: torch.Tensor, b: torch.Tensor):
    act = node.attr("act")
    if act in ("sigmoid", "softplus"):      # a gated attention output: b [.., X*group] * act(a [.., X])
        gate = torch.sigmoid(a) if act == "sigmoid" else F.softplus(a.float()).to(b.dtype)   # Laguna: fp32 softplus
        group = node.attr("group", None)
        return b * gate if group is None else (b.unflatten(-1, (-1, group)) * gate.unsqueeze(-1)).flatten(-2)
    if act == "gelu":
        return F.gelu(a) * b
    if act == "gelu_tanh":
        return F.gelu(a, approximate="tanh") * b
    if act == "clamped_swiglu":
        limit, alpha = node.attr("limit"), node.attr("alpha")
        gate, up = a.clamp(max=limit), b.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    raise bad_choice(node)


def scale_rows(y: torch.Tensor, row_w: torch.Tensor) -> torch.Tensor:
    """y [R, F] times each row's routing weight [R] (SWIGLU/GLU attr row_weights; the GATE node)."""
    return y * row_w[:, None].to(y.dtype)


def _row_experts(seg, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Local expert of each of the map's real rows (host segments), on ``like``'s device, and how many
    rows are real."""
    segs = seg.segments                                   # host (expert, rows) pairs: built there, copied once
    ids = torch.tensor([e for e, _ in segs], dtype=torch.int64)
    counts = torch.tensor([c for _, c in segs], dtype=torch.int64)
    real = int(sum(c for _, c in segs))
    return torch.repeat_interleave(ids, counts, output_size=real).to(like.device), min(real, like.shape[0])


def _grouped_bias_fwd(node: Node, rows, bias, seg, *row_w):
    """rows [R, N] + bias[expert of row] / share (times the row's routing weight when given)."""
    experts, real = _row_experts(seg, rows)
    add = bias[experts].to(rows.dtype) / node.attr("share", 1)
    if row_w:
        add = add * row_w[0][:real, None].to(rows.dtype)
    return torch.cat((rows[:real] + add, rows[real:])) if real < rows.shape[0] else rows + add


def _pullback(fn, primals, cotangents) -> list:
    with torch.enable_grad():
        leaves = [p.detach().requires_grad_() for p in primals]
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return list(torch.autograd.grad(outs, leaves, tuple(cotangents), allow_unused=True))


def _k_norm(ctx, node, ins, shapes):
    return [_norm_fwd(node, *ins)]


def _k_norm_dgrad(ctx, node, ins, shapes):
    *fwd, dy = ins
    return _pullback(lambda x_: _norm_fwd(node, x_, *fwd[1:]), (fwd[0],), (dy,))


def _k_norm_wgrad(ctx, node, ins, shapes):
    x, w, dy = ins
    return _pullback(lambda w_: _norm_fwd(node, x, w_), (w,), (dy,))


def _glu_rows(node: Node, a: torch.Tensor, b: torch.Tensor, *row_w: torch.Tensor):
    """GLU's output, its rows times their routing weights [R] when the node has row_weights."""
    if node.typed.row_weights != bool(row_w):
        raise ValueError(f"node {node.name!r}: row_weights={node.typed.row_weights} with {2 + len(row_w)} inputs")
    return scale_rows(_glu_fwd(node, a, b), *row_w) if row_w else _glu_fwd(node, a, b)


def _k_glu(ctx, node, ins, shapes):
    return [_glu_rows(node, *ins)]


def _k_glu_dgrad(ctx, node, ins, shapes):
    *fwd, dy = ins
    return _pullback(lambda *p: _glu_rows(node, *p), tuple(fwd), (dy,))


def _k_scale(ctx, node, ins, shapes):
    """x * factor (forward), dy * factor (dgrad); with attr by_input also times the [1] input after it."""
    y = ins[0] * node.attr("factor")
    return [y * ins[1].to(y.dtype) if node.attr("by_input", False) else y]


def limit(x: torch.Tensor, how: str, c: float) -> torch.Tensor:
    """LIMIT: clamp(x, -c, c) (DBRX's clip_qkv) or the soft cap c * tanh(x / c) (Beam's final logits);
    also the model edges' logit soft cap (``runtime.model_steps.head_logits``)."""
    if how == "clamp":
        return x.clamp(min=-c, max=c)
    if how == "softcap":
        return torch.tanh(x / c) * c
    raise ValueError(f"LIMIT how={how!r} is not one of 'clamp', 'softcap'")


def _limit_fwd(node: Node, x: torch.Tensor):
    if node.attr("how") not in ("clamp", "softcap"):
        raise bad_choice(node)
    return limit(x, node.attr("how"), node.attr("limit"))


def _k_limit(ctx, node, ins, shapes):
    return [_limit_fwd(node, ins[0])]


def _k_limit_dgrad(ctx, node, ins, shapes):
    x, dy = ins
    return _pullback(lambda x_: _limit_fwd(node, x_), (x,), (dy,))


def _k_grouped_bias(ctx, node, ins, shapes):
    return [_grouped_bias_fwd(node, *ins)]


def _k_grouped_bias_dgrad(ctx, node, ins, shapes):
    """d row weights (the rows' gradient passes through unchanged: the VJP rule returns dy itself)."""
    bias, seg, row_w, dy = ins
    return _pullback(lambda r_: _grouped_bias_fwd(node, dy.new_zeros(dy.shape), bias, seg, r_), (row_w,), (dy,))


def _k_grouped_bias_wgrad(ctx, node, ins, shapes):
    bias, seg, *row_w, dy = ins
    return _pullback(lambda b_: _grouped_bias_fwd(node, dy.new_zeros(dy.shape), b_, seg, *row_w), (bias,), (dy,))


KERNELS = {
    (OpKind.NORM, Role.FORWARD): _k_norm,
    (OpKind.NORM, Role.DGRAD): _k_norm_dgrad,
    (OpKind.NORM, Role.WGRAD): _k_norm_wgrad,
    (OpKind.GLU, Role.FORWARD): _k_glu,
    (OpKind.GLU, Role.DGRAD): _k_glu_dgrad,
    (OpKind.SCALE, Role.FORWARD): _k_scale,
    (OpKind.SCALE, Role.DGRAD): _k_scale,
    (OpKind.LIMIT, Role.FORWARD): _k_limit,
    (OpKind.LIMIT, Role.DGRAD): _k_limit_dgrad,
    (OpKind.GROUPED_BIAS, Role.FORWARD): _k_grouped_bias,
    (OpKind.GROUPED_BIAS, Role.DGRAD): _k_grouped_bias_dgrad,
    (OpKind.GROUPED_BIAS, Role.WGRAD): _k_grouped_bias_wgrad,
}

from moegraph.delta_kernels import KERNELS as _DELTA_KERNELS  # noqa: E402 - Gated DeltaNet's core
KERNELS.update(_DELTA_KERNELS)

__all__ = ["KERNELS", "attend", "attention_extended", "attention_pairs", "layer_norm", "limit", "rope_extended", "rotate",
           "route_general"]
