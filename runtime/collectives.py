"""The IR collectives on torch.distributed (gloo on CPU, NCCL on GPU), issued asynchronously.

Notation: b batch, S sequence on this rank, s full sequence, h hidden, n group size,
R expert rows on this rank (data-dependent), El experts per rank.

Semantics are exactly ``moegraph.interpreter.run_collective`` (the simulated-rank reference):

    all_gather(dim)       [.., S, ..] -> [.., n*S, ..]: shards concatenated in rank order
    reduce_scatter(dim)   [.., n*S, ..] -> [.., S, ..]: sum over ranks, keep chunk ``rank``
    all_reduce            sum over ranks
    all_to_all "heads"    each tensor split in n along split_dim, part j to rank j, received
                          parts concatenated in rank order along cat_dim (several tensors are
                          packed into one exchange)
    all_to_all "shards"   as heads, but received parts are stacked: [.., X, ..] -> [n, .., X/n, ..]
                          (compressed reduce-scatter: the sum is a local node afterwards)
    all_to_all "tokens"   uneven row exchange. to_experts: rows split by the sender's
                          IndexMap.splits; with attr emit_map the receiver also gets a RecvMap
                          (row segments per (source, local expert), and the rows it sent).
                          from_experts: rows split by the RecvMap.splits. Dropless: counts are
                          data-dependent, so the first all-to-all of a routing exchanges its
                          per-expert counts (a small all_to_all on the metadata group, cached on
                          the IndexMap), then calls all_to_all_single with those split sizes; the
                          step's other token all-to-alls reuse the cache or, on the way back, the
                          RecvMap's ``sent``: one exchange per index map and step. With attr
                          payloads=P the first P inputs (and outputs) are row tensors split alike
                          and sent side by side in one exchange (FP8 rows and their scales).
    flat=True             gathers / reduce-scatters / shards work on the flattened tensor
    reduce="mean"         reduce-scatter averages over ranks instead of summing

Groups: every collective runs on the group its attr ``axis`` names, this rank's group of that axis
in the ``Layout`` (``moegraph.runtime.layout``: replicas, nodes, attentions and pipeline blocks).

Every collective is issued with ``async_op=True`` and returns a ``Pending``; its outputs exist
after ``Pending.wait`` (CPU: blocks the host; GPU: orders the current stream after it).

Backend gaps, emulated exactly:
    * reduce_scatter on gloo: older gloo has none, and torch 2.13's ``reduce_scatter_single``
      on gloo is a composite: it copies its input on the calling thread (31 ms for 8 MiB here,
      against 3 ms to issue an all_to_all of the same buffer) and returns a plain Work without a
      future, not one of gloo's asynchronous works. On gloo it is therefore always emulated:
      all_to_all_single of the n chunks, then a local sum in rank order (the reference's
      order). Same bytes on the wire as a ring reduce-scatter: (n-1)/n of the tensor per rank. MPI
      has no reduce_scatter at all: emulated too. Elsewhere the native op is used;
      ``emulate={"reduce_scatter"}`` forces the emulation. The emulated set is decided when the
      Comm is built, from the backend (``BACKEND_EMULATED``), so it is the same on every rank; a
      native op that fails later is an error, never a switch one rank would make alone (its
      peers would then wait in a different collective).
    * the count exchange of token all-to-alls always runs on a gloo (CPU) group, also when the
      data goes over NCCL: all_to_all_single needs its split sizes on the host anyway, so the
      index map's per-expert counts are copied to the host once per dispatch (IndexMap.splits,
      the step's one device-to-host copy for that exchange), exchanged on the CPU, and the
      combine reuses the RecvMap's host integers (no copy).

SM budgets (GPU, NCCL): one process group per distinct (stream, budget) of the plan, its
communicator created with ``ProcessGroupNCCL.Options().config.min_ctas = max_ctas =
nccl_ctas(budget)`` (one CTA per channel, one SM per CTA). Budget 0 (copy engines, in the cost
model) is refused on NCCL and left out of plans compiled for NCCL ranks (``native_budgets``: this
runtime has no copy-engine path yet). Budgets above NCCL's channel limit run on that limit (``Comm.ctas`` holds what each group really got). NCCL's streams are high priority (``is_high_priority_stream``). Communicators are
connected when the Comm is built (compile), not at the first collective. On CPU (gloo) budgets
are recorded, not enforced; each stream still gets its own gloo group, so its collectives
progress on their own threads.
docs/runtime.md lists the limits.
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from moegraph.index_map import IndexMap, RecvMap
from moegraph.interpreter import Axis, axis_of
from moegraph.ir import Node, OpKind
from moegraph.runtime import CollectiveTimeout, RuntimeFailure, ScheduleMismatch
from moegraph.runtime.layout import Layout
from moegraph.runtime.native_budgets import check_native_budgets, nccl_ctas

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
EMULABLE = frozenset({"reduce_scatter"})
# what each backend cannot run natively (or, gloo, not asynchronously): see "Backend gaps" above
BACKEND_EMULATED: dict[str, frozenset[str]] = {"gloo": frozenset({"reduce_scatter"}),
                                               "mpi": frozenset({"reduce_scatter"})}


def emulated_collectives(backend: str, forced: frozenset[str] = frozenset()) -> set[str]:
    """The collectives a Comm on ``backend`` emulates: the backend's known gaps plus ``forced``.
    A function of the backend name only, so every rank decides the same before any collective."""
    unknown = set(forced) - EMULABLE
    if unknown:
        raise ValueError(f"cannot emulate {sorted(unknown)}; emulable collectives: {sorted(EMULABLE)}")
    return set(forced) | BACKEND_EMULATED.get(backend, frozenset())


@dataclass
class Pending:
    """One in-flight collective: its work handles and how to turn the buffers into outputs."""

    node: Node
    stream: str
    works: list[Any]
    finish: Callable[[], list[Any]]
    keep: tuple[Any, ...] = ()            # tensors the backend reads or writes until completion
    issued_ns: int = 0
    done_ns: int | None = None            # completion seen at a node boundary (host clock), if before a wait
    waited_ns: int | None = None          # when a host wait on it returned
    outputs: list[Any] | None = None

    @property
    def waited(self) -> bool:
        return self.outputs is not None

    def wait(self, timeout_s: float, rank: int, *, block_host: bool = True) -> list[Any]:
        """Wait for the works, then build the outputs (once).

        block_host=True (CPU): the host waits up to ``timeout_s`` per work and a timeout raises
        CollectiveTimeout naming the node. block_host=False (GPU): ``work.wait()`` only orders
        the current CUDA stream after the collective; a hang is reported by the NCCL watchdog
        after the process group's timeout.

        Lifetimes (GPU): ProcessGroupNCCL keeps the tensors its kernel reads and writes safe for
        its own stream until ``wait()`` (record_stream there, or a stash it drops at ``wait()``).
        The executor waits at issue under the comm stream, so that stream is then ordered after
        NCCL's: ``keep`` (staging buffers allocated under it) can be dropped here, and an input
        made on another stream stays safe as long as the executor record_streams it for the comm
        stream (runtime.executor's module docstring).
        """
        if self.outputs is not None:
            return self.outputs
        for work in self.works:
            if block_host:
                _wait_host(work, timeout_s, _describe(self.node, self.stream), rank)
            else:
                work.wait()
        self.waited_ns = time.perf_counter_ns()
        self.outputs = self.finish()
        self.keep = ()
        return self.outputs


def _describe(node: Node, stream: str) -> str:
    return f"collective {node.name!r} ({node.op.value}, stream {stream!r})"


def _wait_host(work: Any, timeout_s: float, what: str, rank: int) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        where = f"rank {rank}: {what}"
        if "timed out" in str(err).lower() or "timeout" in str(err).lower():
            raise CollectiveTimeout(f"{where} did not complete within {timeout_s:g} s "
                                    "(a rank is stuck, crashed, or runs a different plan)") from err
        raise RuntimeFailure(f"{where} failed: {str(err).strip().splitlines()[0]}") from err


class Comm:
    """The process groups one plan needs, and the IR collectives issued on them.

    ``keys`` are the plan's distinct (stream, sm_budget) pairs; ``axes`` the group axes its
    collectives use: one process group per (stream, budget, axis), this rank's group of that
    axis (``Layout``). Must be created on every rank with the same keys in the same order
    (``new_group`` is collective): callers check the plan hash first (``check_same_plan``).
    ``rank`` is the global rank, ``n`` the model-parallel group size, ``dp`` the replicas, ``pp``
    the pipeline blocks of n x dp ranks, ``node_ranks`` the ranks per node of axes node and rail,
    ``attn_ranks`` the ranks per attention of axes attn and attn_dp (``Layout``).
    """

    def __init__(self, keys: Sequence[tuple[str, int]], *, rank: int, n: int, timeout_s: float,
                 emulate: frozenset[str] = frozenset(), meta_group: Any = None, dp: int = 1,
                 axes: Sequence[Axis] = ("mp",), pp: int = 1, node_ranks: int = 0, attn_ranks: int = 0):
        self.layout = Layout(n, dp, rank, pp, node_ranks, attn_ranks)
        self.rank, self.n, self.dp, self.timeout_s = rank, n, dp, timeout_s
        self.backend = dist.get_backend() if self.layout.world > 1 else "none"
        self.emulate = emulated_collectives(self.backend, emulate)
        # token count exchanges run within the replica; plan-hash checks and barriers over the block
        self.world_meta = metadata_group(self.layout.blocks())
        self.meta = meta_group if meta_group is not None else metadata_group(self.layout.partition("mp"))
        axes = tuple(dict.fromkeys(axes))
        # token count exchanges on the node axes: their own groups, made in ``axes`` order on every rank
        self.metas: dict[Axis, Any] = {"mp": self.meta} | {
            axis: metadata_group(self.layout.partition(axis)) for axis in axes if axis in ("node", "rail")}
        # full_grads / unshard_output helpers within a replica (default backend); WORLD when it is one
        self.mp_group = (None if dp == 1 and pp == 1 else
                         _member_group(self.layout.partition("mp"), None, {}))
        self.native_budgets = self.backend == "nccl"
        check_native_budgets(keys, self.backend)
        self.groups = {(*key, axis): _group(self.backend, *key, timeout_s, self.layout, axis)
                       for key in keys for axis in axes}
        self.ctas = {key: nccl_ctas(key[1]) for key in self.groups} if self.native_budgets else {}
        if self.backend == "nccl":
            self._connect()

    def _connect(self) -> None:
        """Create every NCCL communicator now, at compile, not inside the first forward (NCCL
        connects a group at its first collective): one 1-element all_reduce per group, in key
        order on every rank, then one device sync (compile time, not a step)."""
        one = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
        for key, pg in self.groups.items():
            work = dist.all_reduce(one, group=pg, async_op=True)
            _wait_host(work, self.timeout_s, f"communicator set-up of stream {key[0]!r} (budget {key[1]}, "
                       f"axis {key[2]})",
                       self.rank)
        torch.cuda.synchronize()

    def issue(self, node: Node, ins: list[Any], stream: str, budget: int,
              shapes: Sequence[tuple[int, ...]] = ()) -> Pending:
        """Issue ``node`` on this rank's inputs ``ins``; ``shapes`` are its outputs' IR shapes
        (needed by flat=True gathers, which reshape the gathered bucket)."""
        axis = axis_of(node)
        g = self.layout.size(axis)
        if node.group != g:
            raise RuntimeFailure(f"collective {node.name!r} has group size {node.group} on axis {axis!r}, but "
                                 f"the runtime's {axis} groups have {g} ranks (n={self.n} x dp={self.dp})")
        key = (stream, budget, axis)
        if key not in self.groups:
            raise RuntimeFailure(f"collective {node.name!r}: no process group for stream {stream!r}, budget "
                                 f"{budget}, axis {axis!r} (the Comm was built for another plan)")
        pg = self.groups[key]
        issued = time.perf_counter_ns()
        if node.op is OpKind.ALL_GATHER:
            works, finish, keep = self._all_gather(node, ins, pg, shapes, g)
        elif node.op is OpKind.REDUCE_SCATTER:
            works, finish, keep = self._reduce_scatter(node, ins[0], pg, g)
        elif node.op is OpKind.ALL_REDUCE:
            works, finish, keep = self._all_reduce(node, ins[0], pg)
        elif node.op is OpKind.ALL_TO_ALL:
            mode = node.typed.mode
            if mode in ("heads", "shards"):
                works, finish, keep = self._a2a_parts(node, ins, pg, g, stack=mode == "shards")
            elif mode == "tokens":
                if axis not in self.metas:      # routing metadata (counts, maps) lives within a replica
                    raise RuntimeFailure(f"token all_to_all {node.name!r} on axis {axis!r}: token exchanges "
                                         "run within a replica (axes mp, node, rail) only")
                works, finish, keep = self._a2a_tokens(node, ins, pg, axis)
            else:
                raise NotImplementedError(f"no all_to_all mode {mode!r} (node {node.name!r}); "
                                          "valid: heads, shards, tokens")
        else:
            raise NotImplementedError(f"no collective {node.op.value} (node {node.name!r})")
        return Pending(node, stream, works, finish, keep, issued)

    # -- one method per IR collective: returns (works, finish, tensors to keep alive) --------
    # Pure data movement travels as raw bytes (uint8 views): exact for every dtype, including
    # ones a backend cannot reduce or even carry (fp8 on gloo), and several tensors of different
    # dtypes pack into one exchange.

    def _all_gather(self, node: Node, ins: list[torch.Tensor], pg, shapes, n: int):
        """Every input gathered along dim; several (a router's weights and expert ids) travel
        packed into one exchange of their bytes."""
        dim, flat = node.typed.dim, node.typed.flat
        if flat and len(ins) != 1:
            raise RuntimeFailure(f"all_gather {node.name!r}: a flat gather takes one tensor, got {len(ins)}")
        xs = [(x.reshape(-1) if flat else x).contiguous() for x in ins]
        parts = [_bytes(x) for x in xs]                             # [numel * itemsize] uint8 each
        send = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = send.new_empty((n * send.numel(),))                   # preallocated: shards in rank order
        work = _all_gather_single(out, send, group=pg, async_op=True)

        def finish():
            # [n, ..S..] rank-major is [.., n*S, ..] itself when nothing precedes dim (flat buckets,
            # token rows, b=1): a view. Otherwise one reorder copy, which no collective can avoid.
            if len(xs) == 1:
                full = _from_rank_major(_unbytes(out, xs[0].dtype, (n, *xs[0].shape)), dim)
                return [full.view(shapes[0]) if flat and shapes else full]
            rows, fulls, off = out.view(n, -1), [], 0
            for x, part in zip(xs, parts):                          # [n, bytes] -> each tensor's [n, ..S..]
                size = part.numel()
                fulls.append(_from_rank_major(_unbytes(rows[:, off:off + size], x.dtype, (n, *x.shape)), dim))
                off += size
            return fulls
        return [work], finish, (send, out)

    def _reduce_scatter(self, node: Node, x: torch.Tensor, pg, n: int):
        dim, flat = node.typed.dim, node.typed.flat
        how = node.typed.reduce
        if how not in ("sum", "mean"):
            raise RuntimeFailure(f"reduce_scatter {node.name!r}: reduce={how!r} is not one of sum, mean")
        mean = how == "mean"
        chunks = _to_rank_major((x.reshape(-1) if flat else x), dim, n)    # [n, ..S..]: chunk j to rank j
        if "reduce_scatter" not in self.emulate:
            out = chunks.new_empty(chunks.shape[1:])
            cat = chunks.view(-1, *chunks.shape[2:])                # chunks concatenated on dim 0
            op = dist.ReduceOp.AVG if mean else dist.ReduceOp.SUM
            work = _reduce_scatter_single(out, cat, op=op, group=pg, async_op=True)
            return [work], lambda: [out], (chunks, out)
        recv = torch.empty_like(chunks)                             # [n, ..S..]: rank r's partial of my chunk
        work = dist.all_to_all_single(recv, chunks, group=pg, async_op=True)
        # summed (or averaged) over ranks in rank order, as the reference interpreter does
        return [work], lambda: [recv.mean(0) if mean else recv.sum(0)], (chunks, recv)

    def _all_reduce(self, node: Node, x: torch.Tensor, pg):
        if node.typed.reduce != "sum":
            raise RuntimeFailure(f"all_reduce {node.name!r}: reduce={node.typed.reduce!r}: an all_reduce only sums")
        out = x.contiguous().clone()
        work = dist.all_reduce(out, group=pg, async_op=True)
        return [work], lambda: [out], (out,)

    def _a2a_parts(self, node: Node, ins: list[torch.Tensor], pg, n: int, *, stack: bool):
        """heads: part j of each tensor (split along split_dim) to rank j, received parts concatenated
        along cat_dim in rank order. shards (flat=True flattens first): received parts stacked,
        [.., X, ..] -> [n, .., X/n, ..]. All tensors packed into one [n, bytes] exchange."""
        split_dim = node.typed.split_dim
        cat_dim = None if stack else node.typed.cat_dim
        flat = stack and node.typed.flat
        parts = [(t.reshape(-1) if flat else t).chunk(n, dim=split_dim) for t in ins]   # per tensor: n equal parts
        metas = [(p[0].dtype, p[0].shape, _bytes(p[0].contiguous()).numel()) for p in parts]
        send = torch.stack([torch.cat([_bytes(p[j].contiguous()) for p in parts]) for j in range(n)])  # [n, bytes]
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=pg, async_op=True)

        def finish():
            outs, off = [], 0
            for dtype, shape, size in metas:
                pieces = [_unbytes(recv[r, off:off + size], dtype, shape) for r in range(n)]
                # heads: e.g. [b, s/n, H/n*d] x n -> [b, s, H/n*d]; shards: [X/n] x n -> [n, X/n]
                outs.append(torch.stack(pieces) if stack else torch.cat(pieces, dim=cat_dim))
                off += size
            return outs
        return [work], finish, (send, recv)

    def _a2a_tokens(self, node: Node, ins: list[Any], pg, axis: Axis):
        """Token rows over this rank's group of ``axis``: g ranks (n on mp, G on node, n/G on rail),
        its split counts exchanged on that axis's metadata group (``exchange``)."""
        g = self.layout.size(axis)
        p = node.typed.payloads
        payloads, send_map = ins[:p], ins[p]
        rows = payloads[0]
        if not isinstance(send_map, (IndexMap, RecvMap)):
            raise TypeError(f"all_to_all {node.name!r}: input {node.inputs[p]!r} is a {type(send_map).__name__}, "
                            "expected an IndexMap or RecvMap")
        send_splits = [int(c) for c in send_map.splits]
        if len(send_splits) != g or sum(send_splits) != rows.shape[0]:
            raise RuntimeFailure(f"all_to_all {node.name!r}: split sizes {send_splits} do not cover the "
                                 f"{rows.shape[0]} rows of {node.inputs[0]!r} over its group's {g} ranks")
        recv_map = None
        if isinstance(send_map, IndexMap):                          # rows leave for their experts' ranks
            # keyed by axis: one routing's counts differ per group it is exchanged on
            got = send_map.host_fact(f"a2a_received.{axis}", lambda: self._received_counts(node, send_map))
            recv_splits = [sum(row) for row in got]                 # got[r][e]: rank r's rows for my expert e
            if node.typed.emit_map:
                recv_map = RecvMap(tuple((e, c) for row in got for e, c in enumerate(row)), tuple(recv_splits),
                                   tuple(send_splits))
        elif len(send_map.sent) == g:                               # rows go back where they came from
            recv_splits = list(send_map.sent)
        else:                                                       # [g] -> [g, 1]: one count per peer
            got = self.exchange(node, torch.tensor(send_splits, dtype=torch.int64).view(g, 1))
            recv_splits = [int(c) for c in got.view(-1).tolist()]
        # each payload's rows as bytes, side by side: one exchange carries a row and its scale
        widths = [math.prod(x.shape[1:]) * x.element_size() for x in payloads]   # known also when R = 0
        cols = [_bytes(x.contiguous()).view(x.shape[0], w) for x, w in zip(payloads, widths)]
        send = cols[0] if p == 1 else torch.cat(cols, dim=1)       # [R, sum of row bytes] uint8 (R may be 0)
        out = send.new_empty((sum(recv_splits), send.shape[1]))    # [R_recv, sum of row bytes]
        work = dist.all_to_all_single(out, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                                      group=pg, async_op=True)

        def finish():
            got, off = [], 0
            for x, w in zip(payloads, widths):                      # [R_recv, w] -> [R_recv, ..] each
                part = out if p == 1 else out[:, off:off + w].contiguous()
                got.append(_unbytes(part, x.dtype, (out.shape[0], *x.shape[1:])))
                off += w
            return got if recv_map is None else [*got, recv_map]
        return [work], finish, (send, out)

    def _received_counts(self, node: Node, imap: IndexMap) -> tuple[tuple[int, ...], ...]:
        """[g][El] rows each rank of the node's g-rank group sends me per local expert under
        ``imap``'s routing: one exchange of the per-expert counts, cached on the index map per axis
        for every token all-to-all of the step that follows the same routing."""
        g, segments = self.layout.size(axis_of(node)), imap.segments
        if len(segments) % g:
            raise RuntimeFailure(f"all_to_all {node.name!r}: its index map has {len(segments)} expert segments, "
                                 f"not a multiple of the group's {g} ranks")
        per = len(segments) // g                                    # experts per destination rank (El)
        counts = torch.tensor([c for _, c in segments], dtype=torch.int64).view(g, per)   # [g, El]
        got = self.exchange(node, counts)                           # row r = rank r's rows per my expert
        return tuple(tuple(int(c) for c in row) for row in got.tolist())

    def exchange(self, node: Node | None, counts: torch.Tensor) -> torch.Tensor:
        """Synchronous all_to_all of a small [g, m] int64 tensor on the node's axis's metadata group
        (no node: the mp group, g = n): row r of the result is what group rank r put in my row."""
        recv = torch.empty_like(counts)
        group = self.meta if node is None else self.metas[axis_of(node)]
        work = dist.all_to_all_single(recv, counts.contiguous(), group=group, async_op=True)
        what = f"split-size exchange of {node.name!r}" if node is not None else "split-size exchange"
        _wait_host(work, self.timeout_s, what, self.rank)
        return recv


_GROUPS: dict[tuple, Any] = {}


def _group(backend: str, stream: str, budget: int, timeout_s: float, layout: Layout | None = None,
           axis: Axis = "mp") -> Any:
    """This rank's process group of one (stream, budget, axis): NCCL, one per budget (its
    communicator carries the CTA limit); gloo, one per stream (budgets are not enforced). Cached
    per default group, so compiling several layers reuses them; ``new_group`` is collective, and
    every rank compiles the same plans in the same order, so every rank hits or misses the cache
    alike. Without a layout: one group of all ranks."""
    kw: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if backend == "nccl":
        kw["pg_options"] = nccl_options(budget)
    parts = None if layout is None else layout.partition(axis)
    return _member_group(parts, backend, kw, (stream, budget if backend == "nccl" else None, timeout_s))


def _member_group(parts: tuple[tuple[int, ...], ...] | None, backend: str | None, kw: dict[str, Any],
                  tag: tuple = ()) -> Any:
    """Create every group of ``parts`` (``Layout.partition``; collective: all ranks create all
    groups, in the same order) and return the one holding this rank; cached. None, or a single
    part: one group of all ranks. ``backend`` None: the default group's."""
    if parts is not None and len(parts) == 1:
        parts = None                                # the partition spans every rank
    key = (id(dist.group.WORLD), backend, tag, parts)
    if key not in _GROUPS:
        backend_kw = {"backend": backend} if backend is not None else {}
        if parts is None:
            _GROUPS[key] = dist.new_group(**backend_kw, **kw)
        else:
            for ranks in parts:
                pg = dist.new_group(ranks=list(ranks), **backend_kw, **kw)
                if dist.get_rank() in ranks:
                    _GROUPS[key] = pg
    return _GROUPS[key]


def _to_rank_major(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """x [.., n*S, ..] -> contiguous [n, .., S, ..], chunk j of ``dim`` at index j. A view when
    nothing precedes ``dim`` (the layout already is rank-major), else one copy."""
    dim = dim % x.dim()
    parts = x.unflatten(dim, (n, x.shape[dim] // n))
    if math.prod(x.shape[:dim]) == 1:
        return parts.reshape(n, *parts.shape[:dim], *parts.shape[dim + 1:])
    return parts.movedim(dim, 0).contiguous()


def _from_rank_major(g: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of ``_to_rank_major``: [n, .., S, ..] -> [.., n*S, ..] (a view when nothing precedes dim)."""
    n, shape = g.shape[0], list(g.shape[1:])
    dim = dim % len(shape)
    full = shape[:dim] + [n * shape[dim]] + shape[dim + 1:]
    if math.prod(shape[:dim]) == 1:
        return g.view(full)
    return g.movedim(0, dim).reshape(full)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 tensor (no copy)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _unbytes(b: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Inverse of ``_bytes``: reinterpret bytes as ``dtype`` with ``shape`` (a view when aligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    if not b.is_contiguous() or b.storage_offset() % size:
        b = b.clone()                                           # reinterpretation needs aligned storage
    return b.view(dtype).view(tuple(shape))


def metadata_group(parts: tuple[tuple[int, ...], ...] | None = None) -> Any:
    """A CPU (gloo) group for split sizes and plan hashes: this rank's group of ``parts``
    (``Layout.partition``), or all ranks when None: WORLD under gloo, else a new (cached) group.
    Collective: every rank must call it at the same point."""
    if not dist.is_initialized():
        return None
    if (parts is None or len(parts) == 1) and dist.get_backend() == "gloo":
        return dist.group.WORLD
    return _member_group(parts, "gloo", {}, ("meta",))


def nccl_options(budget: int) -> Any:
    """ProcessGroupNCCL options: ``nccl_ctas(budget)`` CTAs (min = max), high-priority NCCL streams."""
    pg_cls = getattr(dist, "ProcessGroupNCCL", None)
    if pg_cls is None:
        raise RuntimeFailure("this torch build has no NCCL backend (ProcessGroupNCCL); use backend gloo")
    opts = pg_cls.Options()
    opts.is_high_priority_stream = True          # NCCL's own streams: its kernels are not starved by GEMMs
    cfg = getattr(opts, "config", None)
    if cfg is None:
        raise RuntimeFailure("this NCCL has no per-communicator config (NCCL < 2.17): the plan's SM budgets "
                             "cannot be enforced")
    cfg.min_ctas = cfg.max_ctas = nccl_ctas(budget)
    return opts


def check_same_plan(plan_hash: str, *, rank: int, n: int, group: Any, timeout_s: float) -> None:
    """All-gather the plan hashes; raise ScheduleMismatch naming the ranks that differ.

    Every rank reaches this call whatever plan it holds, so a mismatch is an error on all
    ranks, never a hang. The reference hash is the one most ranks hold (rank 0's on a tie).
    """
    if n == 1:
        return
    mine = torch.tensor(list(bytes.fromhex(plan_hash)), dtype=torch.int64)          # 32 digest bytes
    allh = torch.empty((n * mine.numel(),), dtype=torch.int64)
    work = _all_gather_single(allh, mine, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise CollectiveTimeout(f"rank {rank}: the plan-hash check did not complete within {timeout_s:g} s "
                                "(another rank did not reach compile)") from err
    hashes = [bytes(row.tolist()).hex() for row in allh.view(n, -1)]
    if len(set(hashes)) == 1:
        return
    counts = {h: hashes.count(h) for h in hashes}
    ref = max(hashes, key=lambda h: (counts[h], h == hashes[0]))
    odd = [r for r, h in enumerate(hashes) if h != ref]
    detail = ", ".join(f"rank {r}: {hashes[r][:12]}" for r in range(n))
    raise ScheduleMismatch(f"ranks {odd} hold a different schedule than the other ranks ({detail}); every rank "
                           "must compile the same graph with the same plan")


@dataclass
class NoComm:
    """Stand-in for a single rank without a process group: a plan with collectives cannot run."""

    rank: int = 0
    n: int = 1
    backend: str = "none"
    native_budgets: bool = False
    groups: dict = field(default_factory=dict)
    meta: Any = None                      # no metadata group (Comm.meta): barriers need none
    world_meta: Any = None
    mp_group: Any = None

    def issue(self, node: Node, *_args) -> Pending:
        raise RuntimeFailure(f"collective {node.name!r} needs torch.distributed initialised with "
                             f"{node.group} ranks")
