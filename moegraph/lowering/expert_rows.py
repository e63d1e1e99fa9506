"""Expert rows: each row's routing weight gathered to the experts, and the grouped GEMM over the
rows of each local expert (``blocks._emit_moe_chunk``'s two helpers).

Notation (as ``blocks``): T tokens, k top-k, R expert rows on this rank, h hidden, El local experts,
K/N a GEMM's input/output width.
"""

from __future__ import annotations

import math

from moegraph.builder import GraphBuilder
from moegraph.efficiency import gemm_attrs
from moegraph.ir import OpKind, ValueKind
from moegraph.lowering.blocks_ext import WEIGHT_DTYPE


def row_weights(g: GraphBuilder, topk_w: str, imap: str, R: int, c: str, kw: dict) -> str:
    """Routing weight per expert row, gathered from [T, k] by the index map: [T, k] -> [R]; under a2a
    the weights travel with their rows to the experts: [R] -> [R] (R fp32 values)."""
    a2a, n = g.strategy.dispatch == "a2a", g.strategy.n
    row_w = g.value(f"row_weights_send{c}" if a2a and n > 1 else f"row_weights{c}", (R,),
                    kind=ValueKind.ROUTING, dtype=WEIGHT_DTYPE, routed=True)
    g.node(f"gate_weights{c}", OpKind.PERMUTE, (topk_w, imap), (row_w,), attrs={"index": "slot"}, **kw)
    if a2a and n > 1:
        sent = row_w
        row_w = g.value(f"row_weights{c}", (R,), kind=ValueKind.ROUTING, dtype=WEIGHT_DTYPE, routed=True)
        g.collective(f"gate_weights_a2a{c}", OpKind.ALL_TO_ALL, (sent, imap), (row_w,),
                     full_bytes=g.nbytes(sent),
                     attrs={"mode": "tokens", "direction": "to_experts", "emit_map": False}, **kw)
    return row_w


def grouped_gemm(g: GraphBuilder, name: str, rows: str, w: str, seg: str, out: str, **kw) -> str:
    """Per-expert y = x @ w[e].T over row segments. [R, K] -> [R, N], w: [El, N, K].

    Attr ``stream_bytes``: expert-weight bytes the kernel streams, one expert's weights per row
    segment: an index map (shape [R]) has one segment per local expert, a recv map ([n, El]) one
    per source rank and expert (the runtime runs one GEMM per segment). The cost model prices
    them at the profile's in-step weight-streaming rate (moegraph.cost, ``stream_bytes``)."""
    experts, n_out, k_in = g.shape(w)
    r = g.shape(rows)[0]
    y = g.value(out, (r, n_out), routed=True)
    segments = math.prod(g.shape(seg)) if len(g.shape(seg)) == 2 else experts
    g.node(name, OpKind.GROUPED_GEMM, (rows, w, seg), (y,), flops=2 * r * n_out * k_in,
           attrs={"stream_bytes": segments * (g.nbytes(w) // experts)} | gemm_attrs(g.shape(rows), g.shape(w)),
           **kw)
    return y
