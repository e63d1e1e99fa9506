"""The router's kernels: routing (softmax or DeepSeek-V3's sigmoid scoring), its aux-loss
statistics, and its data and weight gradients by autograd over the forward.

Notation: T tokens, h hidden, E experts, k top-k.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moegraph.ir import Node, bad_choice
from moegraph.models import route


def tokens(x):
    """[..., X] -> [T, X]."""
    return x.reshape(-1, x.shape[-1])


def pullback(fn: Callable, primals, cotangents) -> list:
    """Gradients of fn's outputs (paired with cotangents) with respect to primals, via autograd.
    Runs under enable_grad: the runtime calls kernels from inside an autograd Function."""
    with torch.enable_grad():
        leaves = [p.detach().requires_grad_() for p in primals]
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return list(torch.autograd.grad(outs, leaves, tuple(cotangents)))


def route_tokens(node: Node, x, w, *bias):
    """x [..., h] -> (weights [..., k], experts [..., k]), x's leading dims kept (the lowering's
    [b, L, k]: gathered along L like the tokens); softmax (Mixtral) or sigmoid scoring (DeepSeek-V3)."""
    weights, experts = _route_rows(node, x, w, *bias)                  # [T, k] each
    lead = x.shape[:-1]
    return weights.view(*lead, -1), experts.view(*lead, -1)


def _route_rows(node: Node, x, w, *bias):
    """x [..., h] -> (weights [T, k], experts [T, k])."""
    scoring = node.typed.scoring
    if node.typed.general:            # group max, softmax choice bias, logit bias (structural lowering)
        from moegraph.family_kernels import route_general
        return route_general(node, x, w, *bias)
    if scoring == "softmax":
        return route(tokens(x), w, node.typed.top_k, node.typed.normalize)
    if scoring == "sigmoid":
        return route_sigmoid(tokens(x), w, bias[0] if bias else None, node.typed.top_k, groups=node.typed.groups,
                             topk_groups=node.typed.topk_groups, normalize=node.typed.normalize,
                             scale=node.typed.scale)
    raise bad_choice(node)


def route_sigmoid(x, w, bias, top_k: int, *, groups: int, topk_groups: int, normalize: bool, scale: float):
    """DeepSeek-V3's router. x [T, h], w [E, h], bias [E] or None -> (weights [T, k], experts [T, k]).

    scores = sigmoid(x w^T) in fp32; experts are chosen by scores + bias (selection only) among
    the topk_groups best of ``groups`` equal expert groups (a group ranks by the sum of its two best
    choice scores); their *unbiased* scores, renormalised to sum to 1 if normalize, times scale,
    weigh them (the +1e-20 keeps the eager module's rounding)."""
    scores = F.linear(x.float(), w.float()).sigmoid()
    choice = scores if bias is None else scores + bias.float()
    T, E = choice.shape
    if groups > 1:
        group_scores = choice.view(T, groups, E // groups).topk(2, dim=-1)[0].sum(-1)        # [T, groups]
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_groups, dim=-1)[1], 1)
        mask = keep.bool()[:, :, None].expand(T, groups, E // groups).reshape(T, E)
        choice = choice.masked_fill(~mask, float("-inf"))
    experts = torch.topk(choice, top_k, dim=-1)[1]
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, experts


def _router_fwd(node: Node, x, w, *bias):
    return route_tokens(node, x, w, *bias)[0]


def _aux_logits(node: Node, x, w, *extra):
    """The logits transformers' load_balancing_loss_func softmaxes (the router's recorded
    ``router_logits``): x W^T, plus the trained logit bias where the router adds one (attr
    logit_bias, GPT-OSS: the last of its inputs after w, or the one before a per-expert scale),
    in x's dtype as the eager router's."""
    bias = (extra[-2] if node.attr("expert_scale", False) else extra[-1]) if node.attr("logit_bias", False) else None
    return F.linear(tokens(x), w, bias)


def _router_probs(node: Node, x, w, *extra):
    """The softmax router's probabilities P [T, E] in fp32, as transformers' aux loss reads them."""
    return torch.softmax(_aux_logits(node, x, w, *extra).float(), dim=-1)


def aux_stats(node: Node, ins, keep=None):
    """A router's aux-loss stats [3, E] fp32 from its forward inputs ``ins`` (x, w, its biases): the
    top-k slots per expert, the sum of P per expert, and (every column) the rows counted. The slots
    are transformers' load_balancing_loss_func's own: the top-k of P, not the experts the router
    chose (they differ where a choice bias, e.g. Ernie 4.5's moe_statics, or expert groups pick
    them). ``keep`` [T] (fp32 0/1, a padded batch: ``router_keep``) counts only the rows it keeps,
    as transformers' loss weights them by the attention mask."""
    probs = _router_probs(node, *ins)                                               # [T, E]
    experts = torch.topk(probs, node.typed.top_k, dim=-1)[1]                        # [T, k]
    E = node.typed.experts
    slots = experts.reshape(-1)
    weight = (torch.ones(slots.shape, dtype=torch.float32, device=slots.device) if keep is None
              else keep.repeat_interleave(experts.shape[-1]))                      # [T*k], t-major as slots
    # scatter_add, not bincount: bincount reads the max on the host (a sync inside the step);
    # integer counts in fp32 are exact whatever order the adds land in
    counts = torch.zeros(E, dtype=torch.float32, device=slots.device).scatter_add_(0, slots, weight)
    if keep is None:
        return torch.stack([counts, probs.sum(0), counts.new_full((E,), float(probs.shape[0]))])
    return torch.stack([counts, (probs * keep[:, None]).sum(0), keep.sum().expand(E)])


def router_pullback(node: Node, primal: int, ins, keep=None):
    """A router's gradient with respect to its forward input ``primal`` (0: x, its data gradient;
    1: w; -1: the last, GPT-OSS's trained logit bias). The inputs are the forward's (x, w, biases),
    the routing weights' cotangent, and with attr aux (the global stats [3, E], the aux seed [1]):
    the aux loss's probability gradient seed * E * count / N^2 (moegraph.edges; N the stats' row 2,
    the rows counted) joins the routing weights' cotangent, on the rows ``keep`` [T] keeps (a
    padded batch) or all."""
    tail = 3 if node.typed.aux else 1
    fwd, dweights = tuple(ins[:-tail]), ins[-tail]
    primal %= len(fwd)

    def at(p):
        return tuple(p if i == primal else v for i, v in enumerate(fwd))
    if not node.typed.aux:
        return pullback(lambda p: _router_fwd(node, *at(p)), (fwd[primal],), (dweights,))
    stats, seed = ins[-2], ins[-1]
    rows, E = stats[2, 0], node.typed.experts
    c = seed.float() * E / rows / rows * stats[0]                                       # [E]
    T = tokens(fwd[0]).shape[0]
    dprobs = c.expand(T, E) if keep is None else c[None, :] * keep[:, None]             # [T, E]
    return pullback(lambda p: (_router_fwd(node, *at(p)), _router_probs(node, *at(p))), (fwd[primal],),
                    (dweights, dprobs))
