"""Shape- and size-dependent efficiencies of the GPU cost model (docs/cost_model.md, "Shapes").

Notation: a GEMM y[m, n] = x[m, k] @ w[n, k]^T (nn.Linear's layout) on one rank; a grouped GEMM
runs E such products over m/E rows each; S SMs; attention over s tokens of head dim d. Every
function here is pure and prices nothing by itself: ``moegraph.cost`` multiplies the profile's
scalar efficiency by these factors.

GEMM shape factor (a roofline with tile and wave effects; the memory-bound regime is the cost
model's mem_bytes term, which it takes the max with):

    for each tile (tm, tn, r) of hw.gemm_tiles, either orientation:
        tiles  = E * ceil(m/E / tm) * ceil(n / tn)
        pad    = (m/E * n) / (ceil(m/E / tm) tm * ceil(n / tn) tn)        tile quantization
        wave   = tiles / (ceil(tiles / S) * S)                             wave quantization
        q      = pad * wave**gamma * r
    factor = max over tiles of q  *  k / (k + k_half)                     small-K: per-tile prologue/epilogue

The library's heuristic picks the best tile, hence the max; gamma < 1 softens wave quantization
as cuBLAS's split-K / stream-K kernels do (NVIDIA, "Matrix Multiplication Background User's
Guide", §3.1-3.2, gives the raw effect); gamma = 0 and no tiles: factor k/(k + k_half).

Attention factor (causal flash attention, forward):  head(d) * s / (s + s_half); the backward
(DGRAD) multiplies by hw.attention_bwd_factor.

Collective size efficiency:  eff(bytes) = eff_max * bytes / (bytes + half_bytes): the fixed
per-call cost (protocol set-up, the first chunk's pipeline fill) in bytes of link time, the shape
nccl-tests' bus-bandwidth curves and MoNTA Fig 13 show.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from moegraph.ir import Node, OpKind, Role
from moegraph.registry import Hardware

__all__ = ["GemmShape", "gemm_shape", "gemm_shape_factor", "attention_factor", "size_eff", "fit_size_eff",
           "SHAPE_ATTR", "GROUPS_ATTR", "SEQ_ATTR", "gemm_attrs", "attention_attrs"]

SHAPE_ATTR = "mnk"
"""Node attribute of a GEMM / GROUPED_GEMM (and their backward nodes, which copy it): the forward
product's (m, n, k), m the rows of all groups together."""
GROUPS_ATTR = "groups"
"""Node attribute of a GROUPED_GEMM: the number of expert GEMMs E the m rows are split over."""
SEQ_ATTR = "seq"
"""Node attribute of an ATTENTION node: the key/query sequence length s each head attends over."""



def gemm_attrs(x_shape: Sequence[int], w_shape: Sequence[int]) -> dict[str, Any]:
    """The shape attributes of the forward product y = x @ w^T, for a GEMM or GROUPED_GEMM node
    and the backward nodes of the same product: x [..., k] (m rows: every leading dim together),
    w [n, k] (nn.Linear) or [E, n, k] (E experts: ``groups``). The one rule every builder of such
    nodes uses (the lowering, passes/edges.py's head, the calibration's benchmarks)."""
    *experts, n, k = (int(v) for v in w_shape)
    if int(x_shape[-1]) != k or len(experts) > 1:
        raise ValueError(f"gemm_attrs: x {tuple(x_shape)} @ w {tuple(w_shape)}^T is not a (grouped) linear product")
    m = math.prod(int(v) for v in x_shape) // k
    return {SHAPE_ATTR: (m, n, k)} | ({GROUPS_ATTR: experts[0]} if experts else {})


def attention_attrs(*, seq: int, head_dim: int) -> dict[str, Any]:
    """The shape attributes of an ATTENTION node (and its backward) over ``seq`` tokens per head
    (the whole sequence, whatever the rank holds of it) of head dim ``head_dim``."""
    return {SEQ_ATTR: int(seq), "head_dim": int(head_dim)}


GemmShape = tuple[int, int, int, int]
"""(E, rows per group, output columns, reduction length) of the product a node computes."""


def gemm_shape(node: Node) -> GemmShape | None:
    """The product ``node`` computes, from the forward's ``mnk`` by role; None without the attribute.

    forward  y[m, n]  = x[m, k] @ w[n, k]^T      -> (E, m/E, n, k)
    dgrad    dx[m, k] = dy[m, n] @ w[n, k]       -> (E, m/E, k, n)
    wgrad    dw[n, k] = dy[m, n]^T @ x[m, k]     -> (E, n, k, m/E)   (one [n, k] per group)"""
    raw = node.attr(SHAPE_ATTR, None)
    if raw is None:
        return None
    m, n, k = (int(v) for v in raw)
    groups = int(node.attr(GROUPS_ATTR, 1))
    if min(m, n, k, groups) <= 0:
        raise ValueError(f"node {node.name!r}: {SHAPE_ATTR}={tuple(raw)} groups={groups}: sizes must be positive")
    rows = max(1, m // groups)
    match node.role:
        case Role.FORWARD:
            return groups, rows, n, k
        case Role.DGRAD:
            return groups, rows, k, n
        case Role.WGRAD:
            return groups, n, k, rows
    raise NotImplementedError(f"no GEMM shape rule for role {node.role}")


def _tile_q(groups: int, rows: int, cols: int, tm: int, tn: int, sms: int, gamma: float) -> float:
    bm, bn = math.ceil(rows / tm), math.ceil(cols / tn)
    tiles = groups * bm * bn
    pad = (rows * cols) / (bm * tm * bn * tn)
    wave = tiles / (math.ceil(tiles / sms) * sms)
    return pad * wave ** gamma


def gemm_shape_factor(hw: Hardware, shape: GemmShape) -> float:
    """The module docstring's factor (<= 1) for ``shape`` on ``hw``."""
    groups, rows, cols, red = shape
    q = 1.0
    if hw.gemm_tiles:
        q = max(_tile_q(groups, rows, cols, a, b, hw.sm_count, hw.gemm_wave_exponent) * r
                for tm, tn, r in hw.gemm_tiles for a, b in ((tm, tn), (tn, tm)))
    return q * red / (red + hw.gemm_k_half)


def attention_factor(hw: Hardware, node: Node) -> float:
    """head(d) * s / (s + s_half), times attention_bwd_factor for the backward; 1 without a ``seq``
    attribute (a graph built by other code) only where the profile models no sequence effect."""
    seq = node.attr(SEQ_ATTR, None)
    f = 1.0
    if hw.attention_seq_half > 0:
        if seq is None:
            raise ValueError(f"node {node.name!r} (attention) has no {SEQ_ATTR!r} attribute, but profile "
                             f"{hw.name!r} prices attention by sequence length (attention_seq_half > 0)")
        f = int(seq) / (int(seq) + hw.attention_seq_half)
    if hw.attention_head_dim_eff:
        d = int(node.attr("head_dim"))
        f *= _by_head_dim(hw.attention_head_dim_eff, d)
    if node.role is Role.DGRAD:
        f *= hw.attention_bwd_factor
    return f


def _by_head_dim(points: Sequence[tuple[float, float]], d: int) -> float:
    """Linear in log2(d) between the profile's (head dim, relative efficiency) points, clamped."""
    if d <= points[0][0]:
        return points[0][1]
    for (d0, e0), (d1, e1) in zip(points, points[1:]):
        if d <= d1:
            w = math.log2(d / d0) / math.log2(d1 / d0)
            return e0 + w * (e1 - e0)
    return points[-1][1]


def size_eff(eff_max: float, half_bytes: float, nbytes: float) -> float:
    """eff_max * b / (b + half_bytes); eff_max at half_bytes = 0 (no size effect modelled)."""
    if half_bytes <= 0:
        return eff_max
    return eff_max * nbytes / (nbytes + half_bytes) if nbytes > 0 else eff_max


def fit_size_eff(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """(eff_max, half_bytes) of ``size_eff`` through measured (bytes, efficiency) points, least
    squares on the times: eff(b) = eff_max b/(b + h) means b/eff = (b + h)/eff_max, a straight
    line in b. The one fit behind the registry's collective curves (published points) and
    ``moegraph calibrate``'s (measured ones)."""
    pts = [(float(b), float(e)) for b, e in points if b > 0 and e > 0]
    if not pts:
        raise ValueError("fit_size_eff: no (bytes, efficiency) point with both > 0")
    if len(pts) == 1:
        return min(1.0, pts[0][1]), 0.0
    xs, ys = [b for b, _ in pts], [b / e for b, e in pts]
    n, sx, sy = len(pts), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    den = n * sxx - sx * sx
    slope = (n * sxy - sx * sy) / den if den else sy / sx
    icpt = (sy - slope * sx) / n
    if slope <= 0:
        return min(1.0, max(e for _, e in pts)), 0.0
    eff_max = 1.0 / slope
    if eff_max > 1.0:                                     # a link faster than its nominal rate: clamp
        eff_max = 1.0
    return eff_max, max(0.0, icpt * eff_max)


def is_shaped_gemm(node: Node) -> bool:
    return node.op in (OpKind.GEMM, OpKind.GROUPED_GEMM) and node.attr(SHAPE_ATTR, None) is not None
