"""Rank-local kernels for every compute op, plus the routing index maps.

The reference interpreter (simulated ranks) and the runtime (real ranks) both execute
compute nodes through ``run_compute``; they differ only in how collectives move data.
Backward kernels are written out in closed form where that is short (GEMM, RMSNorm, RoPE,
SwiGLU); attention and the router differentiate their forward kernel with autograd, which is
exact and, unlike ``torch.func.vjp``, adds no functional-transform overhead per call.

Notation: b batch, S sequence on this rank after the op's layout, h hidden, T tokens,
k top-k, R expert rows, El experts on this rank, C = T * min(k, El) padded expert rows.

Padded expert rows (``RankContext.expert_rows == "padded"``, layout 'local' only): the index map
has C >= R rows, the first R real, rows R..C-1 padding (other ranks' rows, left in place by the
sort). Padding must contribute exactly nothing: a grouped GEMM's output rows past the last offset
are uncomputed memory (``torch._grouped_mm``) and are zeroed; every kernel that sums rows back into
tokens or routing slots (UNPERMUTE, PERMUTE's backward, UNPERMUTE's weight gradient) masks them
first; grouped weight gradients never read rows past the last offset. Masks are ``masked_fill``
(NaN-safe: garbage times a zero mask would still be NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from moegraph.ir import ExpertRows, Graph, Node, OpKind, Role, bad_choice, check_expert_rows
from moegraph.models import apply_rope, causal_gqa_attention, rms_norm, rope_cos_sin, route


@dataclass(frozen=True)
class RankContext:
    rank: int
    n: int
    seq: int                      # full sequence length s
    expert_rows: ExpertRows = "exact"   # the local index map's rows (build_index_map)

    def __post_init__(self):
        check_expert_rows(self.expert_rows)


@dataclass(frozen=True)
class IndexMap:
    """Where each expert row comes from, computed once per step from the routing (paper §3.2).

    Built on the routing's device without reading any value back to the host, so that a step
    needs no host synchronisation for it (except ``layout='local'`` with exact rows, below):

    flat:     for each row, token * k + slot into the [T, k] routing tensors.
    counts:   [groups] rows per group, on the device. Group g uses expert weight g for layouts
              'local' and 'all'; for 'by_dest' group g is expert g of the whole model, on rank
              g // per_dest.
    offsets:  [groups] int32 cumulative row ends (layouts 'local', 'all'): the grouped GEMM's
              device-side group boundaries (None for 'by_dest', whose rows leave the rank).
    per_dest: experts per destination rank for 'by_dest', else 0.
    rows:     padded maps only (layout 'local', ``expert_rows='padded'``): 0-dim device tensor R, the
              real rows; ``flat`` then has C >= R rows and rows R..C-1 are padding (``real_rows``).
              None: every row is real.

    ``segments`` and ``splits`` are host tuples read from ``counts`` with one device-to-host copy
    (cached): the all-to-all needs its split sizes on the host, once per exchange.
    """

    flat: torch.Tensor
    top_k: int
    counts: torch.Tensor
    offsets: torch.Tensor | None = None
    per_dest: int = 0
    rows: torch.Tensor | None = None
    _host: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def tokens(self) -> torch.Tensor:
        return torch.div(self.flat, self.top_k, rounding_mode="floor")

    def real_rows(self, t: torch.Tensor) -> torch.Tensor:
        """t [C, ...] in this map's row order with the padding rows (R..C-1) set to zero, on the
        device; t itself when the map is not padded."""
        return _mask_padding(t, self.rows)

    def host_counts(self) -> tuple[int, ...]:
        """Rows per group on the host: one device-to-host copy, the first time only."""
        if "counts" not in self._host:
            self._host["counts"] = tuple(int(c) for c in self.counts.tolist())
        return self._host["counts"]

    @classmethod
    def from_splits(cls, flat: torch.Tensor, splits: Sequence[int]) -> "IndexMap":
        """Rows already grouped by destination rank, ``splits[d]`` rows for rank d (one expert per
        rank): e.g. a benchmark's uneven all-to-all. Each call is a new routing, so the runtime
        exchanges its counts again (the cache in ``host_fact`` is per map)."""
        counts = torch.tensor([int(c) for c in splits], dtype=torch.int64)
        return cls(flat, 1, counts, None, per_dest=1)

    def host_fact(self, key: str, compute: Callable[[], Any]) -> Any:
        """A host-side fact about this routing, computed once per map (the runtime caches the
        all-to-all's exchanged counts here: every exchange that follows this routing reuses them)."""
        if key not in self._host:
            self._host[key] = compute()
        return self._host[key]

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """(local expert, row count) in row order (by_dest: in destination-local expert ids)."""
        counts = self.host_counts()
        if self.per_dest:
            return tuple((e % self.per_dest, c) for e, c in enumerate(counts))
        return tuple(enumerate(counts))

    @property
    def splits(self) -> tuple[int, ...]:
        """Rows per destination rank (all-to-all dispatch only; () otherwise)."""
        if not self.per_dest:
            return ()
        counts, per = self.host_counts(), self.per_dest
        return tuple(sum(counts[d * per:(d + 1) * per]) for d in range(len(counts) // per))


@dataclass(frozen=True)
class RecvMap:
    """What an all-to-all dispatch delivered: row segments per (source, expert), rows per source,
    and (``sent``, when known) rows this rank sent to each rank in that dispatch, which is what the
    rows' way back delivers. Host integers: the all-to-all that delivered them needed them there."""

    segments: tuple[tuple[int, int], ...]
    splits: tuple[int, ...]
    sent: tuple[int, ...] = ()
    offsets = None                       # segments are source-major, not one per expert: no grouped GEMM offsets
    rows = None                          # never padded: every received row is real


def _mask_padding(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Rows at index >= ``rows`` (a 0-dim device tensor) of t set to zero; t itself for None.
    masked_fill, not a multiply: padding rows may hold uncomputed memory (NaN, inf)."""
    if rows is None:
        return t
    pad = torch.arange(t.shape[0], device=t.device) >= rows
    return t.masked_fill(pad.view(-1, *([1] * (t.dim() - 1))), 0)


def padded_rows(tokens: int, top_k: int, experts_per_rank: int) -> int:
    """C = T * min(k, El): the most rows T tokens can put on one rank's El experts (a token picks
    k distinct experts, at most El of them here), so R <= C for any routing: padding to C drops
    nothing."""
    return tokens * min(top_k, experts_per_rank)


def local_index_maps(graph: Graph) -> list[Node]:
    """The graph's INDEX_MAP nodes of layout 'local' (ffn=ep under dispatch=ag-rs): the ones
    ``expert_rows`` pads."""
    return [nd for nd in graph.nodes if nd.op is OpKind.INDEX_MAP and nd.attr("layout") == "local"]


def expert_rows_refusal(graph: Graph, expert_rows: ExpertRows) -> str | None:
    """Why ``expert_rows`` does not apply to this graph, or None: 'padded' pads local index maps,
    and a graph without one (ffn=tp, or dispatch=a2a) would run exactly as 'exact'."""
    if check_expert_rows(expert_rows) == "padded" and not local_index_maps(graph):
        st = graph.strategy
        return (f"expert_rows='padded' pads the local index map of ffn=ep with dispatch=ag-rs; graph {graph.name!r} "
                f"(ffn={st.ffn}, dispatch={st.dispatch}) has none: use expert_rows='exact'")
    return None


def padded_rows_extra_bytes(graph: Graph) -> int:
    """Bytes a step's routed values (expert rows, ``Value.routed``) hold beyond the graph's planning
    shapes when the local index maps are padded: each one's bytes x (C / R_expected - 1), with
    R_expected its planning rows (the balanced T*k/n) and C = T * min(k, El). Summed over every
    routed value of the step (forward, backward, recompute): an allocation volume, not a peak.
    The scheduler's memory model keeps R_expected; this is what padding adds on top. 0 without a
    local index map."""
    ratios = set()
    for nd in local_index_maps(graph):
        T, k = graph.value[nd.inputs[0]].shape
        expected = graph.value[nd.outputs[0]].shape[0]
        ratios.add(Fraction(padded_rows(T, k, nd.attr("experts_per_rank")), expected))
    if not ratios:
        return 0
    if len(ratios) > 1:
        raise ValueError(f"graph {graph.name!r}: local index maps pad by different ratios {sorted(map(str, ratios))}; "
                         "padded_rows_extra_bytes assumes one")
    (ratio,) = ratios
    routed = sum(v.storage_bytes for v in graph.values if v.routed)
    return int(routed * (ratio - 1))


def build_index_map(experts: torch.Tensor, layout: str, experts_per_rank: int, rank: int, n: int,
                    expert_rows: ExpertRows = "exact") -> IndexMap:
    """experts: [T, k] routed expert ids -> rows sorted by expert (stable in token order).

    layout 'local': only this rank's experts (ep with all-gather dispatch); 'all': every
    expert, all local (tensor-parallel experts); 'by_dest': every row, grouped by the rank
    that owns its expert (all-to-all dispatch).

    Sorting keys, not filtering rows, keeps every shape static (T*k rows) and the work on the
    device. 'local' keeps only this rank's rows, R of them, a data-dependent count. With
    ``expert_rows='exact'`` the map has R rows: reading R is the one host synchronisation of this
    layout (dropless routing sizes its buffers by it). With 'padded' it has the static
    C = T * min(k, El) >= R rows (``padded_rows``): no host read; the last offset (R) stays on the
    device and rows R..C-1 are padding the kernels zero or mask (module doc). Other layouts have
    T*k rows either way.
    """
    expert_rows = check_expert_rows(expert_rows)
    flat_experts = experts.reshape(-1)                          # [T*k]
    if layout == "local":
        key = flat_experts - rank * experts_per_rank
        key = torch.where((key >= 0) & (key < experts_per_rank), key, experts_per_rank)   # others sort last
        groups = experts_per_rank
    elif layout == "all":
        key, groups = flat_experts, experts_per_rank
    elif layout == "by_dest":
        key, groups = flat_experts, experts_per_rank * n
    else:
        raise ValueError(f"index map layout {layout!r} is not one of 'local', 'all', 'by_dest'")
    sorted_key, order = torch.sort(key, stable=True)
    bounds = torch.arange(1, groups + 1, device=key.device, dtype=sorted_key.dtype)
    ends = torch.searchsorted(sorted_key, bounds)               # [groups]: rows with key < g + 1
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    k = experts.shape[1]
    if layout == "by_dest":
        return IndexMap(order, k, counts, None, experts_per_rank)
    if layout == "local" and expert_rows == "padded":
        C = padded_rows(experts.shape[0], k, experts_per_rank)
        real = ends[-1] if groups else ends.new_zeros(())
        return IndexMap(order[:C], k, counts, ends.to(torch.int32), rows=real)
    if layout == "local":
        order = order[:int(ends[-1].item())] if groups else order[:0]   # the layout's one host sync
    return IndexMap(order, k, counts, ends.to(torch.int32))


def run_compute(ctx: RankContext, node: Node, ins: list[Any], out_shapes: list[tuple[int, ...]]) -> list[Any]:
    """Execute one compute node on one rank.

    attr accumulate=True (a weight-gradient kernel adding into a running sum): the last input
    is that sum, and the kernel's single output is added to it.
    """
    fn = KERNELS.get((node.op, node.role))
    if fn is None:
        raise NotImplementedError(f"no kernel for {node.op.value}/{node.role.value} (node {node.name!r})")
    if node.attr("accumulate", False):
        (out,) = fn(ctx, node, ins[:-1], out_shapes)
        return [ins[-1] + out]
    return fn(ctx, node, ins, out_shapes)


# -- forward kernels ---------------------------------------------------------------------

def _linear(x, w):
    return F.linear(x, w)


def chunk_positions(layout: str, rank: int, n: int, seq: int, rows: int, chunk: int = 0,
                    chunks: int = 1, device: torch.device | None = None) -> torch.Tensor:
    """Sequence position of each of ``rows`` rows of token chunk ``chunk`` (of ``chunks``) on ``rank``.

    L = seq/(n*chunks) tokens per rank and chunk; rank r's chunk j holds positions
    r*seq/n + j*L + [0, L). layout 'shard': this rank's own L rows. 'full': the chunk gathered
    from all n ranks, rank-major (n*L rows). 'chunk_major': all chunks of the gathered
    sequence one after another (seq rows), which is how chunked attention sees it.
    With chunks == 1 these are the plain positions: shard r is r*seq/n + [0, seq/n), full is [0, seq).
    ``device``: where the positions are built (the device of the rows they index).
    """
    local = seq // (n * chunks)
    i = torch.arange(rows, device=device)
    if layout == "shard":
        return rank * (seq // n) + chunk * local + i
    if layout == "full":
        return (i // local) * (seq // n) + chunk * local + i % local
    if layout == "chunk_major":
        j, within = i // (n * local), i % (n * local)
        return (within // local) * (seq // n) + j * local + within % local
    raise ValueError(f"position layout {layout!r} is not one of 'shard', 'full', 'chunk_major'")


def _rope_fwd(ctx: RankContext, node: Node, q, k):
    d, S = node.attr("head_dim"), q.shape[1]
    positions = chunk_positions(node.attr("positions"), ctx.rank, ctx.n, ctx.seq, S,
                                node.attr("chunk", 0), node.attr("chunks", 1), device=q.device)
    cos, sin = rope_cos_sin(positions, d, node.attr("theta"), q.dtype)
    b = q.shape[0]
    rot = lambda x: apply_rope(x.view(b, S, -1, d), cos, sin).reshape(b, S, -1)  # noqa: E731
    return rot(q), rot(k)


def _attention_fwd(ctx: RankContext, node: Node, *qkv):
    """Causal GQA attention over the whole sequence, given as N chunks each of q, k, v.

    Chunked inputs arrive chunk-major (see chunk_positions); rows are put in sequence order,
    attended with the plain causal mask and put back, so the result equals the unchunked one.
    Returns the N output chunks.
    """
    d, N = node.attr("head_dim"), node.attr("chunks", 1)
    q, k, v = (torch.cat(qkv[i * N:(i + 1) * N], dim=1) for i in range(3))
    b, S = q.shape[:2]
    if N > 1:
        pos = chunk_positions("chunk_major", ctx.rank, ctx.n, ctx.seq, S, chunks=N, device=q.device)
        order = torch.argsort(pos)                                      # row holding position p
        q, k, v = q[:, order], k[:, order], v[:, order]
    dv = node.attr("v_head_dim", d)                                    # MLA: values narrower than q/k heads
    out = causal_gqa_attention(q.view(b, S, -1, d), k.view(b, S, -1, d), v.view(b, S, -1, dv))
    if N > 1:
        out = out[:, pos]
    return tuple(out.chunk(N, dim=1)) if N > 1 else (out,)


def _swiglu_fwd(a, b):
    return F.silu(a) * b


def _route(node: Node, x, w, *bias):
    """x [..., h] -> (weights [T, k], experts [T, k]); softmax (Mixtral) or sigmoid scoring (DeepSeek-V3)."""
    scoring = node.attr("scoring")
    if scoring == "softmax":
        return route(_tokens(x), w, node.attr("top_k"), node.attr("normalize", True))
    if scoring == "sigmoid":
        return route_sigmoid(_tokens(x), w, bias[0] if bias else None, node.attr("top_k"), groups=node.attr("groups"),
                             topk_groups=node.attr("topk_groups"), normalize=node.attr("normalize", True),
                             scale=node.attr("scale"))
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
    return _route(node, x, w, *bias)[0]


def _router_probs(x, w):
    """The softmax router's probabilities P [T, E] in fp32, as transformers' aux loss reads them."""
    return torch.softmax(F.linear(_tokens(x), w).float(), dim=-1)


def _aux_stats(node: Node, x, w, experts):
    """A router's aux-loss stats [2, E] fp32: the top-k slots per expert, the sum of P per expert."""
    E = node.attr("experts")
    slots = experts.reshape(-1)
    # scatter_add, not bincount: bincount reads the max on the host (a sync inside the step);
    # integer counts in fp32 are exact whatever order the adds land in
    counts = torch.zeros(E, dtype=torch.float32, device=slots.device).scatter_add_(
        0, slots, torch.ones(slots.shape, dtype=torch.float32, device=slots.device))
    return torch.stack([counts, _router_probs(x, w).sum(0)])


def _router_pullback(node: Node, primal: int, ins):
    """A router's data (``primal`` 0) or weight (1) gradient. With attr aux its inputs end in
    (the global stats [2, E], the aux seed [1]) and the aux loss's probability gradient
    seed * E * count / N^2 * share (moegraph.edges) joins the routing weights' cotangent."""
    if not node.attr("aux", False):
        (x, w, *bias), dweights = ins[:-1], ins[-1]
        leaves = (x, w)
        return _pullback(lambda p: _router_fwd(node, *(p if i == primal else leaves[i] for i in range(2)), *bias),
                         (leaves[primal],), (dweights,))
    (x, w, *bias), dweights, stats, seed = ins[:-3], ins[-3], ins[-2], ins[-1]
    leaves = (x, w)
    rows, E = node.attr("aux_rows"), node.attr("experts")
    c = seed.float() * (E * node.attr("aux_share") / rows / rows) * stats[0]              # [E]

    def fn(p):
        args = tuple(p if i == primal else leaves[i] for i in range(2))
        return _router_fwd(node, *args, *bias), _router_probs(*args)
    T = _tokens(x).shape[0]
    return _pullback(fn, (leaves[primal],), (dweights, c.expand(T, E)))


_GROUPED_MM = getattr(torch, "_grouped_mm", None)
_GROUPED_MM_RUNS: dict[tuple[torch.device, torch.dtype], bool] = {}   # probed once per (device, dtype)


def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm takes this device and dtype (fp64 it does not), probed once on
    tiny aligned operands in both call shapes (2-D x 3-D, and 2-D x 2-D for weight gradients), as
    ``runtime.cudagraph.grouped_mm_host_read`` probes its host reads. Decided up front, so an
    error from a real call (a shape bug) propagates instead of switching the op off."""
    key = (device, dtype)
    if key not in _GROUPED_MM_RUNS:
        x = torch.zeros(32, 16, dtype=dtype, device=device)                    # [R, K], two groups of 16 rows
        w = torch.zeros(2, 16, 16, dtype=dtype, device=device)                 # [E, N, K]
        ends = torch.arange(16, 33, 16, dtype=torch.int32, device=device)      # [16, 32], no host copy
        try:
            _GROUPED_MM(x, w.transpose(-2, -1), offs=ends)
            _GROUPED_MM(x.T, x, offs=ends)
            _GROUPED_MM_RUNS[key] = True
        except (RuntimeError, NotImplementedError):
            _GROUPED_MM_RUNS[key] = False
    return _GROUPED_MM_RUNS[key]


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor | None:
    """torch._grouped_mm with device-side group ends, or None where it cannot run (no such op, a
    device/dtype it does not take, or an operand whose row stride is not 16-byte aligned): the
    caller then loops over host segments, which costs one device-to-host copy of the counts."""
    if _GROUPED_MM is None or not _grouped_mm_runs(a.device, a.dtype):
        return None
    for t in (a, b):
        if any(st != 1 and (st * t.element_size()) % 16 for st in t.stride()) \
                or (t.storage_offset() * t.element_size()) % 16:
            return None
    return _GROUPED_MM(a, b, offs=offsets)


def _grouped(x, w, seg, transpose_w: bool = False):
    """Per-segment x @ w[e].T (or x @ w[e] for data gradients). seg: an IndexMap (device-side
    offsets, one group per expert) or a RecvMap (host segments). A padded map's rows past its
    last offset come out zero (torch._grouped_mm leaves them uncomputed)."""
    if seg.offsets is not None:
        if seg.offsets.shape[0] != w.shape[0]:
            raise ValueError(f"index map has {seg.offsets.shape[0]} groups for {w.shape[0]} expert weights")
        out = _grouped_mm(x, w if transpose_w else w.transpose(-2, -1), seg.offsets)
        if out is not None:
            return _mask_padding(out, seg.rows)
    outs, start = [], 0
    for e, count in seg.segments:
        xe = x[start:start + count]
        outs.append(xe @ w[e] if transpose_w else F.linear(xe, w[e]))
        start += count
    width = w.shape[2] if transpose_w else w.shape[1]
    if seg.rows is not None and start < x.shape[0]:          # a padded map: zero rows R..C-1
        outs.append(x.new_zeros((x.shape[0] - start, width)))
    if not outs:
        return x.new_zeros((0, width))
    return torch.cat(outs)


def _grouped_wgrad(x, dy, seg, w_shape):
    # rows past the last offset (a padded map's padding) are read by neither path: the grouped
    # GEMM's groups end there, the host loop's segments cover the R real rows only
    if seg.offsets is not None and seg.offsets.shape[0] == w_shape[0]:
        dw = _grouped_mm(dy.T, x, seg.offsets)                  # [E, out, in]; empty groups are zero
        if dw is not None:
            return dw
    dw = x.new_zeros(w_shape)
    start = 0
    for e, count in seg.segments:                 # an expert may own several segments (a2a): accumulate
        dw[e].addmm_(dy[start:start + count].T, x[start:start + count])
        start += count
    return dw


def _tokens(x):
    return x.reshape(-1, x.shape[-1])


def _k_rmsnorm(ctx, node, ins, shapes):
    x, w = ins
    return [rms_norm(x, w, node.attr("eps"))]


def _k_gemm(ctx, node, ins, shapes):
    return [_linear(*ins)]


def _k_split(ctx, node, ins, shapes):
    mode = node.attr("mode")
    if mode == "concat":                                                # chunks -> one buffer
        return [torch.cat(ins, dim=node.attr("dim"))]
    if mode == "split":
        return list(torch.split(ins[0], list(node.attr("sizes")), dim=node.attr("dim")))
    raise bad_choice(node)


def _k_rope(ctx, node, ins, shapes):
    return list(_rope_fwd(ctx, node, *ins))


def _k_attention(ctx, node, ins, shapes):
    return list(_attention_fwd(ctx, node, *ins))


def _k_add(ctx, node, ins, shapes):
    """a + b; or, with attr reduce_dim, the sum (reduce="mean": the mean) of one input over that dim,
    accumulated in FP32 (the local sum after a compressed all-to-all)."""
    dim = node.attr("reduce_dim", None)
    if dim is None:
        if len(ins) == 2:
            return [ins[0] + ins[1]]
        total = ins[0].clone()                  # n-ary (the aux loss's sum of the routers' stats)
        for t in ins[1:]:
            total += t
        return [total]
    acc, how = ins[0].float(), node.attr("reduce", "sum")
    if how not in ("sum", "mean"):
        raise ValueError(f"node {node.name!r}: reduce={how!r} is not one of 'sum', 'mean'")
    acc = acc.mean(dim) if how == "mean" else acc.sum(dim)
    return [acc.to(ins[0].dtype if node.attr("to", None) is None else TORCH_DTYPES[node.attr("to")])]


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "fp8": torch.float8_e4m3fn, "int64": torch.int64, "int32": torch.int32}
FP8_MAX = 448.0                                                         # largest finite E4M3 value


def _k_cast(ctx, node, ins, shapes):
    """Precision change. attr to: target dtype. scale="per_token": quantize x [..., h] to
    (x / s in fp8, s [...] fp32) with s = amax over h / FP8_MAX; scale="apply": the inverse
    (inputs x, s). The interpreter keeps the rounding: CAST to bf16 and back loses bits."""
    to = TORCH_DTYPES[node.attr("to")]
    mode = node.attr("scale", None)
    if mode is None:
        return [ins[0].to(to)]
    if mode == "per_token":
        x = ins[0].float()
        s = (x.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        return [(x / s[..., None]).to(to), s]
    if mode == "apply":
        x, s = ins
        return [(x.float() * s[..., None]).to(to)]
    raise ValueError(f"cast scale {mode!r} (node {node.name!r}) is not one of 'per_token', 'apply'")


def _k_swiglu(ctx, node, ins, shapes):
    return [_swiglu_fwd(*ins)]


def _k_router(ctx, node, ins, shapes):
    weights, experts = _route(node, *ins)
    if node.attr("aux", False):                 # the aux loss's stats (moegraph.edges)
        return [weights, experts, _aux_stats(node, ins[0], ins[1], experts)]
    return [weights, experts]


def _k_index_map(ctx, node, ins, shapes):
    return [build_index_map(ins[0], node.attr("layout"), node.attr("experts_per_rank"), ctx.rank, ctx.n,
                            ctx.expert_rows)]


def _k_permute(ctx, node, ins, shapes):
    x, imap = ins
    index = node.attr("index")
    if index == "slot":                                                 # [T, k] routing weights -> [R]
        return [x.reshape(-1)[imap.flat]]
    if index == "token":
        return [_tokens(x)[imap.tokens]]                                # [T, h] -> [R, h]
    raise bad_choice(node)


def _k_unpermute(ctx, node, ins, shapes):
    if node.attr("weighted"):
        rows, weights, imap = ins
        rows = rows * weights.reshape(-1)[imap.flat, None].to(rows.dtype)
    else:
        rows, imap = ins
    out = rows.new_zeros((_tokens_count(shapes[0]), rows.shape[1]))
    return [out.index_add(0, imap.tokens, imap.real_rows(rows)).view(shapes[0])]   # [R, h] -> [b, S, h]


def _tokens_count(shape):
    t = 1
    for d in shape[:-1]:
        t *= d
    return t


def _k_gate(ctx, node, ins, shapes):
    rows, gates = ins
    return [rows * gates[:, None].to(rows.dtype)]


def _k_bias(ctx, node, ins, shapes):
    x, b = ins
    return [x + b.to(x.dtype)]


def _k_sigmoid_gate(ctx, node, ins, shapes):
    x, logit = ins                                                      # [..., h], [..., 1]
    return [x * torch.sigmoid(logit)]


def _square_sum(x):
    return x.float().pow(2).sum(-1, keepdim=True)


def _rmsnorm_sharded_fwd(node: Node, x, w, ss):
    """RMSNorm of a row split across ranks: ss is the all-reduced sum of squares of the whole row
    (width elements), so every rank normalises its slice by the full row's RMS."""
    r = torch.rsqrt(ss / node.attr("width") + node.attr("eps"))
    return w * (x.float() * r).to(x.dtype)


def _k_square_sum(ctx, node, ins, shapes):
    return [_square_sum(ins[0])]


def _k_rmsnorm_sharded(ctx, node, ins, shapes):
    return [_rmsnorm_sharded_fwd(node, *ins)]


def _mla_heads_fwd(ctx: RankContext, node: Node, q, kv, k_pe):
    """q [b, S, Hl*(dn+dr)], kv [b, S, Hl*(dn+dv)], k_pe [b, S, dr] -> query, key [b, S, Hl*(dn+dr)],
    value [b, S, Hl*dv]: query = (q_nope, rope(q_rot)), key = (k_nope, rope(k_pe)) with the one
    k_pe shared by every head. Interleaved RoPE (pairs 2i, 2i+1) equals rotate-half RoPE on the
    de-interleaved vector (evens, then odds), which is also the layout it returns (as transformers')."""
    Hl, dn, dr, dv = (node.attr(a) for a in ("heads", "nope_dim", "rope_dim", "v_dim"))
    b, S = q.shape[:2]
    q_nope, q_rot = q.view(b, S, Hl, dn + dr).split((dn, dr), dim=-1)
    k_nope, v = kv.view(b, S, Hl, dn + dv).split((dn, dv), dim=-1)
    k_rot = k_pe.view(b, S, 1, dr)
    if node.attr("interleave"):
        q_rot, k_rot = (torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1) for t in (q_rot, k_rot))
    positions = chunk_positions(node.attr("positions"), ctx.rank, ctx.n, ctx.seq, S,
                                node.attr("chunk", 0), node.attr("chunks", 1), device=q.device)
    cos, sin = rope_cos_sin(positions, dr, node.attr("theta"), q.dtype)
    q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
    query = torch.cat((q_nope, q_rot), dim=-1).reshape(b, S, -1)
    key = torch.cat((k_nope, k_rot.expand(b, S, Hl, dr)), dim=-1).reshape(b, S, -1)
    return query, key, v.reshape(b, S, -1)


def _k_mla_heads(ctx, node, ins, shapes):
    return list(_mla_heads_fwd(ctx, node, *ins))


def _k_mla_heads_dgrad(ctx, node, ins, shapes):
    # the transpose of each forward step: RoPE rotates back (-sin, as ROPE's backward), the
    # de-interleave is undone, k_pe's broadcast over the heads sums, the splits concatenate
    q, dquery, dkey, dvalue = ins[0], *ins[3:]
    Hl, dn, dr, dv = (node.attr(a) for a in ("heads", "nope_dim", "rope_dim", "v_dim"))
    b, S = q.shape[:2]
    dq_nope, dq_rot = dquery.view(b, S, Hl, dn + dr).split((dn, dr), dim=-1)
    dk_nope, dk_rot = dkey.view(b, S, Hl, dn + dr).split((dn, dr), dim=-1)
    positions = chunk_positions(node.attr("positions"), ctx.rank, ctx.n, ctx.seq, S,
                                node.attr("chunk", 0), node.attr("chunks", 1), device=q.device)
    cos, sin = rope_cos_sin(positions, dr, node.attr("theta"), q.dtype)
    dq_rot = apply_rope(dq_rot, cos, -sin)
    dk_rot = apply_rope(dk_rot.sum(2, keepdim=True), cos, -sin)                   # [b, S, 1, dr]
    if node.attr("interleave"):                                                    # evens, odds -> pairs
        dq_rot, dk_rot = (torch.stack(t.split(dr // 2, dim=-1), dim=-1).flatten(-2) for t in (dq_rot, dk_rot))
    dq = torch.cat((dq_nope, dq_rot), dim=-1).reshape(b, S, -1)
    dkv = torch.cat((dk_nope, dvalue.view(b, S, Hl, dv)), dim=-1).reshape(b, S, -1)
    return [dq, dkv, dk_rot.reshape(b, S, dr)]


def _k_grouped_gemm(ctx, node, ins, shapes):
    x, w, seg = ins
    return [_grouped(x, w, seg)]


# -- backward kernels ---------------------------------------------------------------------

def _pullback(fn: Callable, primals, cotangents) -> list:
    """Gradients of fn's outputs (paired with cotangents) with respect to primals, via autograd.
    Runs under enable_grad: the runtime calls kernels from inside an autograd Function."""
    with torch.enable_grad():
        leaves = [p.detach().requires_grad_() for p in primals]
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return list(torch.autograd.grad(outs, leaves, tuple(cotangents)))

def _k_gemm_dgrad(ctx, node, ins, shapes):
    dy, w = ins
    return [dy @ w]


def _k_gemm_wgrad(ctx, node, ins, shapes):
    x, dy = ins
    return [_tokens(dy).T @ _tokens(x)]


def _k_grouped_dgrad(ctx, node, ins, shapes):
    dy, w, seg = ins
    return [_grouped(dy, w, seg, transpose_w=True)]


def _k_grouped_wgrad(ctx, node, ins, shapes):
    x, dy, seg = ins
    return [_grouped_wgrad(x, dy, seg, shapes[0])]


def _k_rmsnorm_dgrad(ctx, node, ins, shapes):
    # y = w * x r with r = rsqrt(mean(x^2) + eps):  dx = r (g - x̂ mean(g x̂)), g = dy w, x̂ = x r
    x, w, dy = ins
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + node.attr("eps"))
    xhat, g = xf * r, dy.float() * w.float()
    return [(r * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)]


def _k_rmsnorm_wgrad(ctx, node, ins, shapes):
    x, dy = ins
    normed = rms_norm(x, x.new_ones(x.shape[-1]), node.attr("eps"))
    return [(_tokens(dy) * _tokens(normed)).sum(0)]


def _k_split_dgrad(ctx, node, ins, shapes):
    mode = node.attr("mode")
    if mode == "concat":                                                # one buffer -> chunk grads
        return list(torch.split(ins[0], list(node.attr("sizes")), dim=node.attr("dim")))
    if mode == "split":
        return [torch.cat(ins, dim=node.attr("dim"))]
    raise bad_choice(node)


def _k_rope_dgrad(ctx, node, ins, shapes):
    # RoPE rotates each (i, i + d/2) pair by a position angle; its transpose rotates back, which is
    # RoPE with -sin (sin is the same in both halves, so the rotate-half sign flip commutes).
    dq, dk = ins
    d, S, b = node.attr("head_dim"), dq.shape[1], dq.shape[0]
    positions = chunk_positions(node.attr("positions"), ctx.rank, ctx.n, ctx.seq, S,
                                node.attr("chunk", 0), node.attr("chunks", 1), device=dq.device)
    cos, sin = rope_cos_sin(positions, d, node.attr("theta"), dq.dtype)
    back = lambda x: apply_rope(x.view(b, S, -1, d), cos, -sin).reshape(b, S, -1)  # noqa: E731
    return [back(dq), back(dk)]


def _k_attention_dgrad(ctx, node, ins, shapes):
    N = node.attr("chunks", 1)                                          # ins: q, k, v, o, do; N chunks each
    qkv, do = ins[:3 * N], tuple(ins[4 * N:5 * N])
    return _pullback(lambda *t: _attention_fwd(ctx, node, *t), qkv, do)


def _k_swiglu_dgrad(ctx, node, ins, shapes):
    # y = silu(a) b:  da = silu'(a) (dy b),  db = dy silu(a); aten's fused silu_backward is one pass
    a, b, dy = ins
    return [torch.ops.aten.silu_backward(dy * b, a), dy * F.silu(a)]


def _k_router_dgrad(ctx, node, ins, shapes):
    return _router_pullback(node, 0, ins)


def _k_router_wgrad(ctx, node, ins, shapes):
    return _router_pullback(node, 1, ins)


def _k_permute_dgrad(ctx, node, ins, shapes):
    drows, imap = ins
    drows = imap.real_rows(drows)                                       # a padded map's padding adds nothing
    index = node.attr("index")
    if index == "slot":                                                 # [R] -> [T, k], zero where unrouted here
        out = drows.new_zeros(math.prod(shapes[0]))
        return [out.index_add(0, imap.flat, drows).view(shapes[0])]
    if index == "token":
        out = drows.new_zeros((_tokens_count(shapes[0]), drows.shape[1]))
        return [out.index_add(0, imap.tokens, drows).view(shapes[0])]   # k copies summed per token
    raise bad_choice(node)


def _k_unpermute_dgrad(ctx, node, ins, shapes):
    if not node.attr("weighted"):
        dy, imap = ins
        return [_tokens(dy)[imap.tokens]]
    dy, rows, weights, imap = ins
    dy_rows = _tokens(dy)[imap.tokens]                                  # [R, h]
    w_rows = weights.reshape(-1)[imap.flat]
    drows = dy_rows * w_rows[:, None].to(dy_rows.dtype)
    dweights = torch.zeros_like(weights).reshape(-1)
    # padding rows of a padded map are other ranks' slots: they must stay zero here
    dweights[imap.flat] = imap.real_rows((dy_rows * rows).sum(-1)).to(weights.dtype)
    return [drows, dweights.view_as(weights)]


def _k_bias_wgrad(ctx, node, ins, shapes):
    (dy,) = ins
    return [_tokens(dy).sum(0)]                                          # [..., X] -> [X]


def _k_sigmoid_gate_dgrad(ctx, node, ins, shapes):
    # y = x sig(g):  dx = dy sig(g),  dg = sum_h(dy x) sig(g) (1 - sig(g))
    x, logit, dy = ins
    sig = torch.sigmoid(logit)
    return [dy * sig, (dy * x).sum(-1, keepdim=True) * sig * (1 - sig)]


def _k_square_sum_dgrad(ctx, node, ins, shapes):
    x, dss = ins
    return [(2 * x.float() * dss).to(x.dtype)]


def _k_rmsnorm_sharded_dgrad(ctx, node, ins, shapes):
    # gradient of the slice and of ss; this rank's dss is partial (ss is shared across ranks): the
    # ALL_REDUCE's backward sums it before SQUARE_SUM's backward reads it
    x, w, ss, dy = ins
    return _pullback(lambda x_, ss_: _rmsnorm_sharded_fwd(node, x_, w, ss_), (x, ss), (dy,))


def _k_rmsnorm_sharded_wgrad(ctx, node, ins, shapes):
    x, w, ss, dy = ins
    return _pullback(lambda w_: _rmsnorm_sharded_fwd(node, x, w_, ss), (w,), (dy,))


def _k_gate_dgrad(ctx, node, ins, shapes):
    dy, rows, gates = ins
    return [dy * gates[:, None].to(dy.dtype), (dy * rows).sum(-1).to(gates.dtype)]


KERNELS: dict[tuple[OpKind, Role], Callable] = {
    (OpKind.RMSNORM, Role.FORWARD): _k_rmsnorm,
    (OpKind.GEMM, Role.FORWARD): _k_gemm,
    (OpKind.SPLIT, Role.FORWARD): _k_split,
    (OpKind.ROPE, Role.FORWARD): _k_rope,
    (OpKind.ATTENTION, Role.FORWARD): _k_attention,
    (OpKind.ADD, Role.FORWARD): _k_add,
    (OpKind.ADD, Role.DGRAD): _k_add,
    (OpKind.SWIGLU, Role.FORWARD): _k_swiglu,
    (OpKind.ROUTER, Role.FORWARD): _k_router,
    (OpKind.INDEX_MAP, Role.FORWARD): _k_index_map,
    (OpKind.PERMUTE, Role.FORWARD): _k_permute,
    (OpKind.UNPERMUTE, Role.FORWARD): _k_unpermute,
    (OpKind.GATE, Role.FORWARD): _k_gate,
    (OpKind.CAST, Role.FORWARD): _k_cast,
    (OpKind.CAST, Role.WGRAD): _k_cast,
    (OpKind.ADD, Role.WGRAD): _k_add,
    (OpKind.GROUPED_GEMM, Role.FORWARD): _k_grouped_gemm,
    (OpKind.GEMM, Role.DGRAD): _k_gemm_dgrad,
    (OpKind.GEMM, Role.WGRAD): _k_gemm_wgrad,
    (OpKind.GROUPED_GEMM, Role.DGRAD): _k_grouped_dgrad,
    (OpKind.GROUPED_GEMM, Role.WGRAD): _k_grouped_wgrad,
    (OpKind.RMSNORM, Role.DGRAD): _k_rmsnorm_dgrad,
    (OpKind.RMSNORM, Role.WGRAD): _k_rmsnorm_wgrad,
    (OpKind.SPLIT, Role.DGRAD): _k_split_dgrad,
    (OpKind.ROPE, Role.DGRAD): _k_rope_dgrad,
    (OpKind.ATTENTION, Role.DGRAD): _k_attention_dgrad,
    (OpKind.SWIGLU, Role.DGRAD): _k_swiglu_dgrad,
    (OpKind.ROUTER, Role.DGRAD): _k_router_dgrad,
    (OpKind.ROUTER, Role.WGRAD): _k_router_wgrad,
    (OpKind.PERMUTE, Role.DGRAD): _k_permute_dgrad,
    (OpKind.UNPERMUTE, Role.DGRAD): _k_unpermute_dgrad,
    (OpKind.GATE, Role.DGRAD): _k_gate_dgrad,
    (OpKind.BIAS, Role.FORWARD): _k_bias,
    (OpKind.BIAS, Role.WGRAD): _k_bias_wgrad,
    (OpKind.SIGMOID_GATE, Role.FORWARD): _k_sigmoid_gate,
    (OpKind.SIGMOID_GATE, Role.DGRAD): _k_sigmoid_gate_dgrad,
    (OpKind.SQUARE_SUM, Role.FORWARD): _k_square_sum,
    (OpKind.SQUARE_SUM, Role.DGRAD): _k_square_sum_dgrad,
    (OpKind.RMSNORM_SHARDED, Role.FORWARD): _k_rmsnorm_sharded,
    (OpKind.RMSNORM_SHARDED, Role.DGRAD): _k_rmsnorm_sharded_dgrad,
    (OpKind.RMSNORM_SHARDED, Role.WGRAD): _k_rmsnorm_sharded_wgrad,
    (OpKind.MLA_HEADS, Role.FORWARD): _k_mla_heads,
    (OpKind.MLA_HEADS, Role.DGRAD): _k_mla_heads_dgrad,
}
