"""The edges' eager compute, priced: a micro-batch's final norm and LM head, forward and backward.

``moegraph.passes.edges`` appends these nodes (attr ``eager``: autograd runs them, or in a merged
step the plan through the runtime's kernels) so that the scheduler prices them and orders the
layers around them. Per micro-batch, T = b*s/n tokens on this rank, item bytes per element:

  forward   edges.norm         RMSNORM   y [b, s/n, h] -> normed        4*T*h FLOPs
                               or NORM (kind 'layer', a LayerNorm: ``EdgeHead.norm``)
                                                                       7*T*h FLOPs (as the layers'),
                                                                       + T*h with a bias (the layers'
                                                                       BIAS node's), its [h] read
            edges.lm_head      GEMM      normed -> logits [b, s/n, V]  2*T*h*V FLOPs
            edges.logit_scale  SCALE     logits -> logits x c          T*V FLOPs, reads and writes
                                         (only with ``EdgeHead.logit_scale`` c != 1)   T*V elements
            edges.logit_softcap LIMIT    -> c tanh(logits / c)         3*T*V FLOPs, reads and writes
                                         (only with ``EdgeHead.softcap`` c)            T*V elements
  backward  edges.logit_softcap.dgrad LIMIT (logits, d) -> d (1 - tanh^2)  as its forward, reads
                                                                       T*V more
            edges.logit_scale.dgrad  SCALE  -> d_logits (x c)          as its forward
            edges.lm_head.dgrad      GEMM   d_logits -> d_normed       2*T*h*V FLOPs
            edges.lm_head.wgrad      GEMM   -> the head's partial      2*T*h*V FLOPs
            edges.norm.dgrad         RMSNORM / NORM -> the layers' seed   twice the forward's FLOPs
            edges.norm.wgrad         RMSNORM / NORM -> the norm's partial [h] ([2h] with a bias:
                                                       weight, then bias)  once the forward's

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
from moegraph.token_layout import local_tokens


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
        norm_op, norm_flops = OpKind.NORM, (7 + head.bias) * T * h
        norm = dict(eager, attrs=eager["attrs"] | {"kind": "layer", "eps": float(head.eps)})
    else:
        raise ValueError(f"final norm {head.norm!r} is not one of 'rms', 'layer'")
    H = head.norm_params * h                                # the norm's parameters: weight (and bias)
    normed = g.like(at(j, f"{EDGES}.normed"), y)
    g.node(at(j, f"{EDGES}.norm"), norm_op, (y,), (normed,), flops=norm_flops, mem_bytes=(2 * T * h + H) * item,
           **norm)
    norm_partial = g.value(at(j, f"{EDGES}.d_norm.partial"), (H,), kind=ValueKind.PARAM_GRAD, dtype=grad_dtype)
    head_partial = None
    if vocab is not None:
        logits = g.value(at(j, f"{EDGES}.logits"), (*local_tokens(d.b, d.s, g.strategy), vocab))   # [b/N, s/G, V]
        gemm = 2 * T * h * vocab
        # the head's product normed [T, h] @ W[V, h]^T, priced by its shape as the layers' GEMMs are
        gemm_kw = dict(eager, attrs=eager["attrs"] | gemm_attrs(g.shape(normed), (vocab, h)))
        g.node(at(j, f"{EDGES}.lm_head"), OpKind.GEMM, (normed,), (logits,), flops=gemm,
               mem_bytes=(T * h + vocab * h + T * vocab) * item, **gemm_kw)
        d_logits = _logit_tail(g, j, at, logits, head, eager, T * vocab, item)
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
               phase=Phase.BACKWARD, flops=norm_flops, mem_bytes=(2 * T * h + H) * item, **norm)
    return norm_partial, head_partial


def _logit_tail(g: GraphBuilder, j: int, at: Callable[[int, str], str], logits: str, head: EdgeHead, eager: dict,
                elements: int, item: int) -> str:
    """The logits' scale, then their soft cap, forward and backward (module docstring; each only
    where ``head`` has it). An incoming gradient is priced as the value it is the gradient of (the
    last forward output's: the loss's gradient). Returns the gradient of the head's logits."""
    steps = []                                            # (name, op, attrs, FLOPs per element)
    if head.logit_scale != 1:
        steps.append(("logit_scale", OpKind.SCALE, {"factor": float(head.logit_scale)}, 1))
    if head.softcap is not None:
        steps.append(("logit_softcap", OpKind.LIMIT, {"how": "softcap", "limit": float(head.softcap)}, 3))
    ins = [logits]
    for name, op, attrs, per in steps:
        out = g.like(at(j, f"{EDGES}.{name}.out"), logits)
        g.node(at(j, f"{EDGES}.{name}"), op, (ins[-1],), (out,), flops=per * elements,
               mem_bytes=2 * elements * item, **dict(eager, attrs=eager["attrs"] | attrs))
        ins.append(out)
    d = ins[-1]
    for (name, op, attrs, per), x in reversed(list(zip(steps, ins))):
        dx = g.like(at(j, f"{EDGES}.d_{name}.in"), logits, kind=ValueKind.GRAD)
        reads = (x, d) if op is OpKind.LIMIT else (d,)      # the soft cap's backward reads its input
        g.node(at(j, f"{EDGES}.{name}.dgrad"), op, reads, (dx,), phase=Phase.BACKWARD, role=Role.DGRAD,
               flops=per * elements, mem_bytes=(len(reads) + 1) * elements * item,
               **dict(eager, attrs=eager["attrs"] | attrs))
        d = dx
    return d


def wgrad_node(g: GraphBuilder, name: str, op: OpKind, inputs: tuple[str, ...], out: str, acc: str | None, *,
               mem_bytes: int, attrs: dict, **kw) -> None:
    """A weight-gradient node; with ``acc`` (the previous micro-batches' sum) it adds into it, as
    ``moegraph.microbatch`` makes a layer's weight-gradient kernel accumulate: ``acc`` read last,
    its bytes read once more (``Node.accumulating``)."""
    g.node(name, op, inputs, (out,), role=Role.WGRAD, mem_bytes=mem_bytes, attrs=attrs, **kw)
    if acc is not None:
        g.nodes[-1] = g.nodes[-1].accumulating(acc, g.nbytes(acc))


__all__ = ["eager_compute", "wgrad_node"]
