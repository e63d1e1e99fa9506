"""Kernels of GATED_DELTA, the Gated DeltaNet token mixer's core (Qwen3-Next's linear attention) and
Kimi Delta Attention's (Kimi Linear's: the same rule, its decay per key feature), and its FLOP and byte
counts for the cost model.

Registered into ``moegraph.kernels.KERNELS`` through ``moegraph.family_kernels``. The forward is
written here in torch (causal depthwise convolution, decay, the chunked gated delta rule, the
gated RMSNorm); the backward differentiates it with autograd (exact).

Notation: b batch, S the whole sequence (the op runs head-sharded: every rank holds all of it for
its heads), Hk key heads and Hv value heads on this rank (r = Hv/Hk value heads per key head),
dk, dv key and value head dims, P = 2dk + 2r dv the per-key-head width of in_proj_qkvz's output,
C = 2 Hk dk + Hv dv convolved channels, K the convolution's width, L the chunk size (64), c the
number of chunks ceil(S/L).

One node computes, per position t and value head (attrs k_heads, v_heads, k_dim, v_dim, conv,
chunk_size, eps, l2_eps, layout):
    q, k, v, z   from qkvz [b, S, Hk*P] (layout 'grouped', Qwen3-Next: per key head q [dk], k [dk],
                 v [r dv], z [r dv]), or from one [b, S, 2 Hk dk + 2 Hv dv + 2 Hv] (layout 'flat',
                 Qwen3.5-MoE: q, k, v, z, b, a one after another)
    b_, a        from ba [b, S, Hk*2r] (grouped: per key head b [r], a [r]), or the flat input's
                 (layout 'kda', Kimi Delta Attention, Hk = Hv: qkvb [b, S, 2 Hk dk + Hv dv + Hv] of q, k,
                 v, b; a [b, S, Hv*dk] its forget gate's f_b_proj output; z [b, S, Hv*dv] its g_b_proj's)
    (q, k, v) = silu(causal depthwise conv over S of (q, k, v) with weight [C, 1, K])
    q, k      = l2-normalised per head (eps l2_eps); q *= dk^-0.5; a key head serves r value heads
    beta = sigmoid(b_),  g = -exp(A_log) * softplus(a + dt_bias)          [b, S, Hv]
                 ('kda': [b, S, Hv, dk], one decay per key feature; A_log [1, 1, Hv, 1], dt_bias [Hv*dk])
    state S_t = diag(exp(g_t)) S_{t-1} + k_t (beta_t (v_t - (diag(exp(g_t)) S_{t-1})^T k_t))^T,  o_t = S_t^T q_t
    y = rmsnorm(o, eps) * w * silu(z)   per value head                    [b, S, Hv*dv]
                 ('kda': * sigmoid(z), the norm in fp32 throughout)
computed chunk by chunk (``chunked_delta_rule``), as the training kernels do. A right-padded
batch's padded tokens enter with zero q, k, v, z, b and a, as eager zeroes their input (``_padding``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moegraph.ir import Node, OpKind, Role, bad_choice

CHUNK = 64
"""The delta rule's chunk size: transformers' and the FLA kernels' default."""


def _l2(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunked_delta_rule(q, k, v, g, beta, chunk: int) -> torch.Tensor:
    """The gated delta rule over the whole sequence, L = ``chunk`` positions at a time, from a zero
    state. q, k [b, H, S, dk] (normalised and scaled), v [b, H, S, dv], beta [b, H, S], g [b, H, S] (one
    decay per head, Gated DeltaNet) or [b, H, S, dk] (one per key feature, Kimi Delta Attention), fp32.
    Inside a chunk, with G the cumulative sum of g from its start (per head, or per key feature d),
    Dd[i, j] = exp(G_i,d - G_j,d) (j <= i; the same for every d with a per-head decay) and, for any
    vectors x_i, y_j of dk features, <x_i, y_j>_D = sum_d x_i,d y_j,d Dd[i, j]:
        (I + A) U = beta V - (beta exp(G) K) S0,   A[i, j] = beta_i <k_i, k_j>_D, j < i
        O = (exp(G) Q) S0 + P U,  P[i, j] = <q_i, k_j>_D (j <= i),  S1 = exp(G_L) S0 + (exp(G_L - G) K)^T U
    (U: the chunk's corrections, "new values"; a unit lower-triangular solve; exp(G) K scales each key's
    features, exp(G_L) S0 each row of the state [dk, dv]). -> [b, H, S, dv]."""
    b, H, S, dk = k.shape
    dv = v.shape[-1]
    per_feature = g.dim() == 4
    pad = (-S) % chunk
    if pad:                                   # zero keys, values and decay past the end: outputs dropped
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g = F.pad(g, (0, 0, 0, pad) if per_feature else (0, pad))
        beta = F.pad(beta, (0, pad))
    c = (S + pad) // chunk
    # [b, H, S, .] -> [b, H, c, L, .]
    q, k, v = (t.reshape(b, H, c, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(b, H, c, chunk, *g.shape[3:]), beta.reshape(b, H, c, chunk)
    G = g.cumsum(3)                                                           # [b, H, c, L] or [b, H, c, L, dk]
    Gk = G if per_feature else G[..., None]                                   # against a key's features
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    strict = lower.clone().fill_diagonal_(False)
    if per_feature:                           # [b, H, c, L, L, dk]: each key feature decays on its own
        D = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~lower[..., None], float("-inf")).exp()
        kk = (k[..., :, None, :] * k[..., None, :, :] * D).sum(-1)           # [b, H, c, L, L]
        intra = (q[..., :, None, :] * k[..., None, :, :] * D).sum(-1)
    else:
        D = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [b, H, c, L, L]
        kk = (k @ k.transpose(-1, -2)) * D
        intra = (q @ k.transpose(-1, -2)) * D
    A = (beta[..., None] * kk).masked_fill(~strict, 0.0)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    rhs = torch.cat((beta[..., None] * v, beta[..., None] * Gk.exp() * k), dim=-1)   # [b, H, c, L, dv+dk]
    solved = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    u_v, u_k = solved[..., :dv], solved[..., dv:]
    q_decayed = q * Gk.exp()
    k_to_end = k * (Gk[..., -1:, :] - Gk).exp()                               # each key decayed to the chunk's end
    end = Gk[..., -1, :].exp()[..., None]                                     # [b, H, c, 1 or dk, 1]: per state row
    state = q.new_zeros(b, H, dk, dv)
    outs = []
    for i in range(c):
        u = u_v[:, :, i] - u_k[:, :, i] @ state                               # [b, H, L, dv]
        outs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ u)
        state = state * end[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    return torch.stack(outs, dim=2).reshape(b, H, c * chunk, dv)[:, :, :S]


def projections(node: Node, *proj: torch.Tensor):
    """(q, k, v, z, b, a) [b, S, X] each from the op's projection inputs, by attr layout:
    'grouped' (Qwen3-Next): qkvz [b, S, Hk*P] and ba [b, S, Hk*2r], grouped by key head;
    'flat' (Qwen3.5-MoE): one [b, S, 2 Hk dk + 2 Hv dv + 2 Hv] of q, k, v, z, b, a one after another;
    'kda' (Kimi Linear): qkvb [b, S, 2 Hk dk + Hv dv + Hv] of q, k, v, b, then the forget gate's
    f [b, S, Hv dk] (a: one decay per key feature) and the output gate's z [b, S, Hv dv]."""
    t = node.typed
    Hk, Hv, dk, dv = t.k_heads, t.v_heads, t.k_dim, t.v_dim
    r = Hv // Hk
    if t.layout == "flat":
        return proj[0].split((Hk * dk, Hk * dk, Hv * dv, Hv * dv, Hv, Hv), dim=-1)
    if t.layout == "kda":
        q, k, v, bb = proj[0].split((Hk * dk, Hk * dk, Hv * dv, Hv), dim=-1)
        return q, k, v, proj[2], bb, proj[1]
    if t.layout != "grouped":
        raise bad_choice(node)
    qkvz, ba = proj
    b, S, _ = qkvz.shape
    # [b, S, Hk*P] -> [b, S, Hk, P] -> q, k [b, S, Hk, dk], v, z [b, S, Hk, r*dv]
    q, k, v, z = qkvz.view(b, S, Hk, -1).split((dk, dk, r * dv, r * dv), dim=-1)
    bb, a = ba.view(b, S, Hk, 2 * r).split((r, r), dim=-1)                   # [b, S, Hk, r] each
    return tuple(x.reshape(b, S, -1) for x in (q, k, v, z, bb, a))


PROJECTION_INPUTS = {"grouped": 2, "flat": 1, "kda": 3}


def projection_inputs(node: Node) -> int:
    """How many of the op's inputs are projections (``projections``); the four weights follow."""
    if node.typed.layout not in PROJECTION_INPUTS:
        raise bad_choice(node)
    return PROJECTION_INPUTS[node.typed.layout]


def _decay(node: Node, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The log-decay g = -exp(A_log) * softplus(a + dt_bias), fp32: [b, Hv, S] per value head (a, A_log,
    dt_bias [Hv]), or for layout 'kda' [b, Hv, S, dk] per key feature (a [b, S, Hv dk], dt_bias [Hv dk],
    A_log [1, 1, Hv, 1]: one rate per head)."""
    t = node.typed
    b, S = a.shape[:2]
    if t.layout == "kda":
        soft = F.softplus(a.float() + dt_bias.float()).reshape(b, S, t.v_heads, t.k_dim)
        return (-a_log.float().reshape(t.v_heads, 1).exp() * soft).transpose(1, 2)
    return (-a_log.float().exp() * F.softplus(a.reshape(b, S, t.v_heads).float() + dt_bias)).transpose(1, 2)


def gated_delta_forward(node: Node, *ins: torch.Tensor) -> torch.Tensor:
    """The module docstring's computation: the projections (``projections``), conv_w [C, 1, K],
    a_log, dt_bias, norm_w [dv] -> [b, S, Hv*dv] in the projections' dtype."""
    t = node.typed
    Hk, Hv, dk, dv = t.k_heads, t.v_heads, t.k_dim, t.v_dim
    r = Hv // Hk
    p = projection_inputs(node)
    q, k, v, z, bb, a = projections(node, *ins[:p])
    conv_w, a_log, dt_bias, norm_w = ins[p:]
    b, S, _ = q.shape
    dtype = q.dtype
    mixed = torch.cat((q, k, v), dim=-1)                                      # [b, S, C]
    w = conv_w.to(dtype)
    conv = F.conv1d(mixed.transpose(1, 2), w, padding=w.shape[-1] - 1, groups=w.shape[0])[..., :S]
    mixed = F.silu(conv).transpose(1, 2)                                      # [b, C, S] -> [b, S, C]
    q, k, v = mixed.split((Hk * dk, Hk * dk, Hv * dv), dim=-1)
    # [b, S, X*d] -> [b, X, S, d] fp32; each key head repeated for its r value heads
    heads = lambda x, n, d: x.reshape(b, S, n, d).transpose(1, 2).float()   # noqa: E731
    q = _l2(heads(q, Hk, dk), t.l2_eps).repeat_interleave(r, dim=1) * dk ** -0.5
    k = _l2(heads(k, Hk, dk), t.l2_eps).repeat_interleave(r, dim=1)
    v = heads(v, Hv, dv)
    beta = bb.reshape(b, S, Hv).sigmoid().float().transpose(1, 2)             # [b, Hv, S]
    g = _decay(node, a, a_log, dt_bias)
    o = chunked_delta_rule(q, k, v, g, beta, t.chunk_size).to(dtype)          # [b, Hv, S, dv]
    o = o.transpose(1, 2).float()                                             # [b, S, Hv, dv]
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + t.eps)
    z = z.reshape(b, S, Hv, dv).float()
    if t.layout == "kda":                     # Kimi's gated norm: fp32 throughout, a sigmoid gate
        gated = norm_w.float() * normed * z.sigmoid()
    else:
        gated = norm_w * normed.to(dtype) * F.silu(z)
    return gated.to(dtype).reshape(b, S, Hv * dv)


def _padding(ctx, qkvz):
    """The batch's padding mask [b, S, 1] in qkvz's dtype (1 keeps a token), or None: eager zeroes a
    padded token's input to the block (transformers' apply_mask_to_padding_states), so its q, k, v, z, b
    and a are zero (the projections have no bias). Packed documents change nothing here: eager's
    recurrence runs across them (its positions are not read)."""
    tokens = getattr(ctx, "tokens", None)
    if tokens is None or tokens.keys is None:
        return None
    if tuple(tokens.keys.shape) != tuple(qkvz.shape[:2]):
        raise ValueError(f"gated_delta: the batch's padding mask {list(tokens.keys.shape)} is not the [b, s] = "
                         f"{list(qkvz.shape[:2])} its recurrence runs over (a padded batch needs the whole sequence)")
    return tokens.keys.to(device=qkvz.device, dtype=qkvz.dtype)[..., None]


def _masked(node: Node, keep, ins):
    """The op's inputs with its projections' padded tokens zeroed (``keep``: ``_padding``'s)."""
    p = projection_inputs(node)
    return list(ins) if keep is None else [x * keep for x in ins[:p]] + list(ins[p:])


def _k_gated_delta(ctx, node, ins, shapes):
    return [gated_delta_forward(node, *_masked(node, _padding(ctx, ins[0]), ins))]


def _k_gated_delta_dgrad(ctx, node, ins, shapes):
    """Gradients of every input (the projections and the four weights) from dy, by autograd through the forward."""
    *fwd, dy = ins
    keep = _padding(ctx, fwd[0])
    with torch.enable_grad():
        leaves = [p.detach().requires_grad_() for p in fwd]
        out = gated_delta_forward(node, *_masked(node, keep, leaves))
        return list(torch.autograd.grad(out, leaves, dy))


KERNELS = {
    (OpKind.GATED_DELTA, Role.FORWARD): _k_gated_delta,
    (OpKind.GATED_DELTA, Role.DGRAD): _k_gated_delta_dgrad,
}


def gated_delta_flops(*, b: int, s: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, conv: int,
                      chunk: int = CHUNK, per_feature: bool = False) -> int:
    """Forward FLOPs of the chunked algorithm on one rank (module docstring's notation), per value
    head and chunk: Q K^T and K K^T 4 L^2 dk, the triangular solve on [V, K] L^2 (dv + dk), the
    intra-chunk product 2 L^2 dv, the state's read by Q and by the keys and its update 6 L dk dv;
    plus the convolution 2 K C per position and ~10 per output feature (norm, gate, decay). A decay
    per key feature (layout 'kda') weighs both products feature by feature: the decays exp(G_i - G_j)
    [L, L, dk] (2 L^2 dk) and 3 L^2 dk per product instead of 2."""
    c = math.ceil(s / chunk)
    L, dk, dv = chunk, k_dim, v_dim
    products = (8 if per_feature else 4) * L * L * dk
    per_chunk = products + L * L * (dv + dk) + 2 * L * L * dv + 6 * L * dk * dv
    channels = 2 * k_heads * k_dim + v_heads * v_dim
    return b * v_heads * c * per_chunk + b * s * (2 * conv * channels + 10 * v_heads * v_dim)


def gated_delta_state_bytes(*, b: int, s: int, v_heads: int, k_dim: int, v_dim: int, chunk: int = CHUNK) -> int:
    """Bytes of the fp32 chunk states [dk, dv] per value head a chunked kernel writes and reads back
    once each (what it moves beyond its inputs and output)."""
    return 2 * 4 * b * v_heads * math.ceil(s / chunk) * k_dim * v_dim
