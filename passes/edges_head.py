"""The edges' eager compute, priced: a micro-batch's final norm and LM head, forward and backward.

``moegraph.passes.edges`` appends these nodes (attr ``eager``: autograd runs them, or in a merged
step the plan through the runtime's kernels) so that the scheduler prices them and orders the
layers around them. Per micro-batch, T = b*s/n tokens on this rank, item bytes per element:

  forward   edges.norm         RMSNORM   y [b, s/n, h] -> normed        4*T*h FLOPs
                               or NORM (kind 'layer', a bias-free LayerNorm: ``EdgeHead.norm``)
                                                                       7*T*h FLOPs (as the layers')
            edges.lm_head      GEMM      normed -> logits [b, s/n, V]  2*T*h*V FLOPs
            edges.logit_scale  SCALE     logits -> logits x c          T*V FLOPs, reads and writes
                                         (only with ``EdgeHead.logit_scale`` c != 1)   T*V elements
  backward  edges.logit_scale.dgrad  SCALE  -> d_logits (x c)          as its forward
            edges.lm_head.dgrad      GEMM   d_logits -> d_normed       2*T*h*V FLOPs
            edges.lm_head.wgrad      GEMM   -> the head's partial      2*T*h*V FLOPs
            edges.norm.dgrad         RMSNORM / NORM -> the layers' seed   twice the forward's FLOPs
            edges.norm.wgrad         RMSNORM / NORM -> the norm's partial  once the forward's

The norms' rules are autodiff's (``_rmsnorm``, ``_norm``: the data gradient twice the forward's
FLOPs, the weight's once); the scale is the layers' SCALE (Granite's residual multiplier) on the
logits, the eager ``logits * c`` the runtime runs, memory-bound. The GEMMs' bytes read the
weight [V, h] besides their tensors (no graph value: the compiled model holds it); an incoming
gradient is priced as the value it is the gradient of (same shape).

Notation: b batch (one replica's rows), s sequence, h hidden, n ranks per replica, V vocabulary.
"""

from __future__ import annotations

from typing import Callable

from moegraph.builder import GraphBuilder
from moegraph.edges import EAGER_ATTR, EDGES, EdgeHead
from moegraph.efficiency import gemm_attrs
from moegraph.ir import OpKind, Phase, Role, ValueKind


def eager_compute(g: GraphBuilder, j: int, at: Callable[[int, str], str], seed: str, y: str, vocab: int | None,
                  head: EdgeHead, T: int, h: int, item: int, grad_dtype: str, norm_acc: str | None,
                  head_acc: str | None) -> tuple[str, str | None]:
    """Micro-batch j's eager norm and head (``at(j, name)``: its copy of a name), forward and
    backward, priced (module docstring): the backward makes ``seed``; the weight-gradient nodes
    add into ``norm_acc`` / ``head_acc`` (the previous micro-batches' sums) when given. Returns
    the (norm, head) partial sums."""
    d = g.dims
    eager = dict(block=EDGES, attrs={EAGER_ATTR: True})
    if head.norm == "rms":
        norm_op, norm_flops, norm = OpKind.RMSNORM, 4 * T * h, eager
    elif head.norm == "layer":                              # the NORM op's LayerNorm, as the layers'
        norm_op, norm_flops = OpKind.NORM, 7 * T * h
        norm = dict(eager, attrs=eager["attrs"] | {"kind": "layer", "eps": float(head.eps)})
    else:
        raise ValueError(f"final norm {head.norm!r} is not one of 'rms', 'layer'")
    normed = g.like(at(j, f"{EDGES}.normed"), y)
    g.node(at(j, f"{EDGES}.norm"), norm_op, (y,), (normed,), flops=norm_flops, mem_bytes=(2 * T * h + h) * item,
           **norm)
    norm_partial = g.value(at(j, f"{EDGES}.d_norm.partial"), (h,), kind=ValueKind.PARAM_GRAD, dtype=grad_dtype)
    head_partial = None
    if vocab is not None:
        logits = g.value(at(j, f"{EDGES}.logits"), (d.b, d.s // g.strategy.n, vocab))
        gemm = 2 * T * h * vocab
        # the head's product normed [T, h] @ W[V, h]^T, priced by its shape as the layers' GEMMs are
        gemm_kw = dict(eager, attrs=eager["attrs"] | gemm_attrs(g.shape(normed), (vocab, h)))
        g.node(at(j, f"{EDGES}.lm_head"), OpKind.GEMM, (normed,), (logits,), flops=gemm,
               mem_bytes=(T * h + vocab * h + T * vocab) * item, **gemm_kw)
        d_logits = logits                                   # priced as the logits (module docstring)
        if head.logit_scale != 1:
            scale = dict(eager, attrs=eager["attrs"] | {"factor": float(head.logit_scale)}, flops=T * vocab,
                         mem_bytes=2 * T * vocab * item)
            scaled = g.like(at(j, f"{EDGES}.logits_scaled"), logits)
            g.node(at(j, f"{EDGES}.logit_scale"), OpKind.SCALE, (logits,), (scaled,), **scale)
            d_logits = g.like(at(j, f"{EDGES}.d_logits"), logits, kind=ValueKind.GRAD)
            g.node(at(j, f"{EDGES}.logit_scale.dgrad"), OpKind.SCALE, (scaled,), (d_logits,), phase=Phase.BACKWARD,
                   role=Role.DGRAD, **scale)
        d_normed = g.like(at(j, f"{EDGES}.d_normed"), normed, kind=ValueKind.GRAD)
        head_partial = g.value(at(j, f"{EDGES}.d_lm_head.partial"), (vocab, h), kind=ValueKind.PARAM_GRAD,
                               dtype=grad_dtype)
        bwd = dict(phase=Phase.BACKWARD, flops=gemm, mem_bytes=(T * h + vocab * h + T * vocab) * item, **gemm_kw)
        g.node(at(j, f"{EDGES}.lm_head.dgrad"), OpKind.GEMM, (d_logits,), (d_normed,), role=Role.DGRAD, **bwd)
        wgrad_node(g, at(j, f"{EDGES}.lm_head.wgrad"), OpKind.GEMM, (normed, d_logits), head_partial, head_acc,
                   **bwd)
    else:
        d_normed = g.input(at(j, f"{EDGES}.d_normed"), g.shape(normed), kind=ValueKind.GRAD)
    # as autodiff's norm rules: the data gradient twice the forward's FLOPs, the weight's once
    g.node(at(j, f"{EDGES}.norm.dgrad"), norm_op, (y, d_normed), (seed,), phase=Phase.BACKWARD,
           role=Role.DGRAD, flops=2 * norm_flops, mem_bytes=3 * T * h * item, **norm)
    wgrad_node(g, at(j, f"{EDGES}.norm.wgrad"), norm_op, (y, d_normed), norm_partial, norm_acc,
               phase=Phase.BACKWARD, flops=norm_flops, mem_bytes=(2 * T * h + h) * item, **norm)
    return norm_partial, head_partial


def wgrad_node(g: GraphBuilder, name: str, op: OpKind, inputs: tuple[str, ...], out: str, acc: str | None, *,
               mem_bytes: int, attrs: dict, **kw) -> None:
    """A weight-gradient node; with ``acc`` (the previous micro-batches' sum) it adds into it, as
    ``moegraph.microbatch`` makes a layer's weight-gradient kernel accumulate: ``acc`` read last,
    its bytes read once more (``Node.accumulating``)."""
    g.node(name, op, inputs, (out,), role=Role.WGRAD, mem_bytes=mem_bytes, attrs=attrs, **kw)
    if acc is not None:
        g.nodes[-1] = g.nodes[-1].accumulating(acc, g.nbytes(acc))


__all__ = ["eager_compute", "wgrad_node"]
