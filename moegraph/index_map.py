"""Routing index maps: where each expert row comes from, computed once per step (paper §3.2).

``build_index_map`` sorts a step's routing ([T, k] expert ids) into expert-ordered rows on the
routing's device; ``IndexMap`` holds the result (row -> routing slot, rows per group, the grouped
GEMM's device-side group ends) and ``RecvMap`` what an all-to-all dispatch delivered. The kernels
(``moegraph.kernels``), the collectives (``runtime.collectives``) and the grouped GEMM
(``moegraph.grouped_gemm``) read them.

Notation: T tokens, k top-k, R expert rows, El experts on this rank, C = T * min(k, El) padded rows.

Padded maps (``expert_rows='padded'``, layout 'local' only): C >= R rows, the first R real, rows
R..C-1 padding (other ranks' rows, left in place by the sort), which every consumer masks
(``mask_padding``; ``moegraph.kernels`` module docstring).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from moegraph.ir import ExpertRows, check_expert_rows


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

    sources:  layout 'in_node' only: the relay's received tokens, the routing's T (data-dependent, so
              not the planning shape): rows the map's gathers sum into. None: the planning shape's.

    ``segments`` and ``splits`` are host tuples read from ``counts`` with one device-to-host copy
    (cached): the all-to-all needs its split sizes on the host, once per exchange.
    """

    flat: torch.Tensor
    top_k: int
    counts: torch.Tensor
    offsets: torch.Tensor | None = None
    per_dest: int = 0
    rows: torch.Tensor | None = None
    sources: int | None = None
    _host: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def tokens(self) -> torch.Tensor:
        return torch.div(self.flat, self.top_k, rounding_mode="floor")

    def real_rows(self, t: torch.Tensor) -> torch.Tensor:
        """t [C, ...] in this map's row order with the padding rows (R..C-1) set to zero, on the
        device; t itself when the map is not padded."""
        return mask_padding(t, self.rows)

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


def mask_padding(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
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


def build_index_map(experts: torch.Tensor, layout: str, experts_per_rank: int, rank: int, n: int,
                    expert_rows: ExpertRows = "exact", node_ranks: int = 0) -> IndexMap:
    """experts: [..., k] routed expert ids (T tokens) -> rows sorted by expert (stable in token order).

    layout 'local': only this rank's experts (ep with all-gather dispatch); 'all': every
    expert, all local (tensor-parallel experts); 'by_dest': every row, grouped by the rank
    that owns its expert (all-to-all dispatch).

    Sorting keys, not filtering rows, keeps every shape static (T*k rows) and the work on the
    device. 'local' keeps only this rank's rows, R of them, a data-dependent count. With
    ``expert_rows='exact'`` the map has R rows: reading R is the one host synchronisation of this
    layout (dropless routing sizes its buffers by it). With 'padded' it has the static
    C = T * min(k, El) >= R rows (``padded_rows``): no host read; the last offset (R) stays on the
    device and rows R..C-1 are padding the kernels zero or mask (module doc). 'all' and 'by_dest'
    have T*k rows either way.

    The hierarchical dispatch's layouts (moegraph.lowering.node_dispatch; G = ``node_ranks`` ranks
    per node, rank r on node r // G, expert e on node e // (G*El)):
    'by_node'  one row per (token, destination node), grouped by node (N groups, one per rail
               peer): ``flat`` is token * k + the token's first slot on that node. Exact rows: the
               count of distinct pairs is read on the host once.
    'in_node'  ``experts`` are the tokens a relay received; the rows of the experts on this rank's
               node (rank // G), grouped by expert, so by the local rank holding it (per_dest El).
               Exact rows, read on the host once.
    """
    expert_rows = check_expert_rows(expert_rows)
    experts = experts.reshape(-1, experts.shape[-1])            # [..., k] -> [T, k]
    flat_experts = experts.reshape(-1)                          # [T*k]
    T, k = experts.shape
    if layout == "local":
        key = flat_experts - rank * experts_per_rank
        key = torch.where((key >= 0) & (key < experts_per_rank), key, experts_per_rank)   # others sort last
        groups = experts_per_rank
    elif layout == "all":
        key, groups = flat_experts, experts_per_rank
    elif layout == "by_dest":
        key, groups = flat_experts, experts_per_rank * n
    elif layout in ("by_node", "in_node"):
        if node_ranks < 1 or n % node_ranks:
            raise ValueError(f"index map layout {layout!r}: node_ranks={node_ranks} must divide n={n}")
        key, groups = _node_keys(experts, layout, experts_per_rank, rank, n, node_ranks)
    else:
        raise ValueError(f"index map layout {layout!r} is not one of 'local', 'all', 'by_dest', 'by_node', 'in_node'")
    sorted_key, order = torch.sort(key, stable=True)
    bounds = torch.arange(1, groups + 1, device=key.device, dtype=sorted_key.dtype)
    ends = torch.searchsorted(sorted_key, bounds)               # [groups]: rows with key < g + 1
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    if layout == "by_dest":
        return IndexMap(order, k, counts, None, experts_per_rank)
    if layout in ("by_node", "in_node"):
        rows = int(ends[-1].item()) if groups else 0             # the layout's one host read
        return IndexMap(order[:rows], k, counts, None, 1 if layout == "by_node" else experts_per_rank,
                        sources=T if layout == "in_node" else None)
    if layout == "local" and expert_rows == "padded":
        C = padded_rows(T, k, experts_per_rank)
        real = ends[-1] if groups else ends.new_zeros(())
        return IndexMap(order[:C], k, counts, ends.to(torch.int32), rows=real)
    if layout == "local":
        order = order[:int(ends[-1].item())] if groups else order[:0]   # the layout's one host sync
    return IndexMap(order, k, counts, ends.to(torch.int32))


def _node_keys(experts: torch.Tensor, layout: str, El: int, rank: int, n: int, G: int) -> tuple[torch.Tensor, int]:
    """(sort key [T*k], groups) of the 'by_node' and 'in_node' layouts (build_index_map's docstring);
    rows that belong to no group key ``groups`` and sort last."""
    k = experts.shape[1]
    if layout == "by_node":
        nodes = n // G
        node = torch.div(experts, El * G, rounding_mode="floor")               # [T, k] destination node
        # a slot whose node an earlier slot of the same token already goes to sends nothing
        same = node[:, :, None] == node[:, None, :]                             # [T, k, k]
        earlier = torch.ones(k, k, dtype=torch.bool, device=experts.device).tril(-1)
        repeat = (same & earlier).any(-1)                                       # [T, k]
        return torch.where(repeat, nodes, node).reshape(-1), nodes
    key = experts.reshape(-1) - rank // G * G * El                              # from this node's first expert
    return torch.where((key >= 0) & (key < G * El), key, G * El), G * El        # other nodes' experts sort last
