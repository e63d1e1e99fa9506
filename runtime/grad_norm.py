"""Gradient clipping of a compiled model by the norm of the model's gradient as the original has it
(``CompiledModel.clip_grad_norm_``).

A compiled model's ``parameters()`` are this rank's pieces: shards of the sharded parameters (each
region held by one rank of the replica, or by the first node's ranks when a parameter is split over a
node's G ranks: ``interpreter.writes_region``) and full copies of the replicated ones (the edges'
embedding, final norm and LM head; replicated layer parameters such as norms), identical on every
rank. ``torch.nn.utils.clip_grad_norm_(compiled.parameters(), c)`` takes the norm of one rank's
pieces only: each rank then clips by a different factor and the replicated copies drift apart. The
global norm counts every region of the original model once: this rank's share of sum |g|^p over the
regions it writes (``writes_region``), the replicated edge parameters on rank 0, summed over the
replica's ranks (one all-reduce; the max for p = inf). Every replica holds the same DP-synchronised
gradients, so the replica's sum is the model's. Every rank then scales all of its pieces by the same
factor, as ``torch.nn.utils.clip_grads_with_norm_`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moegraph.interpreter import writes_region

if TYPE_CHECKING:
    from moegraph.runtime.model import CompiledModel


def _counted_grads(model: CompiledModel) -> list[torch.Tensor]:
    """This rank's gradients that count towards the global norm: each region of the original
    model's parameters exactly once over the replica's ranks."""
    layers, rank, n = model.layers, model.rank, model.n
    out = [layers.shard(p).grad for p, spec in layers.graph.params
           if not spec.buffer and writes_region(spec, rank, n)]
    if rank == 0:                                   # identical on every rank: once
        edge = {id(p): p for p in (model.embed, model.norm, model.lm_head) if p is not None}
        out += [p.grad for p in edge.values()]
    return [g for g in out if g is not None]


@torch.no_grad()
def global_grad_norm(model: CompiledModel, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the original model's whole gradient (a collective over the replica: every rank
    must call it), the same on every rank; a 0-d fp32 tensor."""
    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"norm_type={norm_type!r}: only a p-norm with p > 0 (or inf) is supported")
    grads = _counted_grads(model)
    device = model.embed.device
    if p == float("inf"):
        local = torch.stack([g.detach().abs().max().float() for g in grads]).max() if grads else \
            torch.zeros((), device=device)
        if model.n > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=model.layers.executor.comm.mp_group)
        return local
    local = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        local += torch.linalg.vector_norm(g.detach().float(), p) ** p
    if model.n > 1:
        dist.all_reduce(local, group=model.layers.executor.comm.mp_group)
    return local ** (1.0 / p)


@torch.no_grad()
def clip_grad_norm(model: CompiledModel, max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale every gradient of ``model`` (this rank's pieces) by min(1, max_norm / (total + 1e-6)),
    total the global norm (``global_grad_norm``), as torch's clip_grad_norm_ does on the original
    module; returns total. A collective over the replica."""
    total = global_grad_norm(model, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"the total norm of order {float(norm_type)} of the gradients is non-finite, so it "
                           "cannot be clipped (error_if_nonfinite=False skips this check)")
    params = [p for p in model.parameters() if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(params[0].grad.dtype) if params else total)
    return total


__all__ = ["clip_grad_norm", "global_grad_norm"]
