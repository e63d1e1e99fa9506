"""The router's auxiliary loss across pipeline stages, at run time (moegraph.passes.stage_aux).

Notation: b (one micro-batch's rows), s, h, n (ranks of a stage's group) as in moegraph.ir; E
experts.

Each compiled stage's layers return, beside their output shard, their routers' [3, E] fp32
stats (``StageLayersAux``); the stage adds them to the stats it received and sends the sum on
with its activation (a second boundary tensor, [3, E] on every rank of the pipeline group: the
stats are the replica's, identical on the group's n ranks). The last stage's loss
(``aux_term``) adds coef * aux of the total, as transformers' loss does. The gradient that comes
back along the stats is the loss's derivative by each expert's prob sum (the counts and N are
constants, as in transformers' loss, whose counts come from a top-k); each stage's layers hand it
to their routers' backward as the graph's (stats, seed) pair (stage_aux's docstring).

The n ranks of the last stage each hold the whole aux loss: its term is added once to the sum of
their loss terms (the value 1/n of it on each rank) while every rank's backward takes its full
gradient (each rank's routers see their own rows: the full coefficient applies to them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from moegraph.edges import AuxLoss, aux_loss_value
from moegraph.passes.stage_aux import StageAux
from moegraph.runtime.autograd import once_only

__all__ = ["StageLayersAux", "aux_term"]


class StageLayersAux(torch.autograd.Function):
    """A stage's layers (a ``runtime.autograd.Runner``) returning (output shard [b, s/n, h], the
    routers' stats [3, E]); backward feeds the stats' prob-sum gradient to the routers (module
    docstring) and returns the input and parameter gradients."""

    @staticmethod
    def forward(ctx, runner: Any, aux: StageAux, x: torch.Tensor, *params: torch.Tensor):
        y, state = runner.run_forward(x, params)
        ctx.runner, ctx.state, ctx.aux = runner, state, aux
        ctx.save_for_backward(*params)
        return y, state[0][aux.stats].clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor, d_stats: torch.Tensor | None):
        params = ctx.saved_tensors
        once_only(ctx.state)
        (saved, rec), ctx.state = ctx.state, None
        E = ctx.aux.experts
        d_psum = torch.zeros(E) if d_stats is None else d_stats[1].float()
        # stage_aux's docstring: (stats, seed) = ([d psum, 0, 1], 1/E) makes the routers' c = d psum
        saved = dict(saved) | {ctx.aux.stats: torch.stack([d_psum, torch.zeros_like(d_psum), torch.ones_like(d_psum)]),
                               ctx.aux.seed: torch.full((1,), 1.0 / E, device=d_psum.device)}
        dx, grads = ctx.runner.run_backward((saved, rec), dy, params)
        return (None, None, dx, *grads)


def aux_term(stats: torch.Tensor, aux: AuxLoss, n: int) -> torch.Tensor:
    """coef * aux of the whole model's stats [3, E] (the counts and N constants), for one of the
    last stage's n ranks: its value coef * aux / n (the n terms sum to the loss), its gradient
    coef * d aux (module docstring)."""
    value = aux_loss_value(torch.stack([stats[0].detach(), stats[1], stats[2].detach()]), aux.experts)
    return aux.coef * (value - value.detach() * (1 - 1 / n))
