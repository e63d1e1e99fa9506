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
                          (row segments per (source, local expert)). from_experts: rows split by
                          the RecvMap.splits. Dropless: counts are data-dependent, so each rank
                          first exchanges its counts (a small all_to_all on the metadata group),
                          then calls all_to_all_single with those split sizes.
    flat=True             gathers / reduce-scatters / shards work on the flattened tensor
    reduce="mean"         reduce-scatter averages over ranks instead of summing

Every collective is issued with ``async_op=True`` and returns a ``Pending``; its outputs exist
after ``Pending.wait`` (CPU: blocks the host; GPU: orders the current stream after it).

Backend gaps, emulated exactly:
    * reduce_scatter on gloo: older gloo has none, and torch 2.13's ``reduce_scatter_single``
      on gloo is a composite: it copies its input on the calling thread (31 ms for 8 MiB here,
      against 3 ms to issue an all_to_all of the same buffer) and returns a plain Work without a
      future, not one of gloo's asynchronous works. On gloo it is therefore always emulated:
      all_to_all_single of the n chunks, then a local sum in rank order (the reference's
      order). Same bytes on the wire as a ring reduce-scatter: (n-1)/n of the tensor per rank. Elsewhere the native op
      is used; ``emulate={"reduce_scatter"}`` forces the emulation, and a backend raising "not
      supported" falls back to it.
    * the count exchange of token all-to-alls always runs on a gloo (CPU) group, also when the
      data goes over NCCL: split sizes are host integers anyway (IndexMap.splits), so no device
      sync is added for them.

SM budgets (GPU, NCCL): one process group per distinct (stream, budget) of the plan, its
communicator created with ``ProcessGroupNCCL.Options().config.min_ctas = max_ctas = budget``
(one CTA per channel, one SM per CTA). Budget 0 asks for NCCL's zero-CTA policy (copy engines)
where this torch/NCCL exposes it (``config.cta_policy = NCCL_CTA_POLICY_ZERO``, NCCL >= 2.28),
else it is an unconstrained communicator. On CPU (gloo) budgets are recorded, not enforced;
each stream still gets its own gloo group, so its collectives progress on their own threads.
docs/runtime.md lists the limits.
"""

from __future__ import annotations

import math
import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from moegraph.ir import Node, OpKind
from moegraph.kernels import IndexMap, RecvMap
from moegraph.runtime import CollectiveTimeout, RuntimeFailure, ScheduleMismatch

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
EMULABLE = frozenset({"reduce_scatter"})
GLOO_EMULATED = frozenset({"reduce_scatter"})   # see "Backend gaps" above


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
        the current CUDA stream after the collective; hangs surface in ``drain``.
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


def drain(pending: Sequence[Pending], timeout_s: float, rank: int) -> None:
    """Host-wait until every pending work has completed, naming the first that does not (GPU)."""
    deadline = time.monotonic() + timeout_s
    for p in pending:
        for work in p.works:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(f"rank {rank}: {_describe(p.node, p.stream)} did not complete "
                                            f"within {timeout_s:g} s")
                time.sleep(1e-4)


class Comm:
    """The process groups one plan needs, and the IR collectives issued on them.

    ``keys`` are the plan's distinct (stream, sm_budget) pairs. Must be created on every rank
    with the same keys in the same order (``new_group`` is collective): callers check the plan
    hash first (``check_same_plan``).
    """

    def __init__(self, keys: Sequence[tuple[str, int]], *, rank: int, n: int, timeout_s: float,
                 emulate: frozenset[str] = frozenset(), meta_group: Any = None):
        unknown = set(emulate) - EMULABLE
        if unknown:
            raise ValueError(f"cannot emulate {sorted(unknown)}; emulable collectives: {sorted(EMULABLE)}")
        self.rank, self.n, self.timeout_s = rank, n, timeout_s
        self.backend = dist.get_backend() if n > 1 else "none"
        self.emulate = set(emulate) | (GLOO_EMULATED if self.backend == "gloo" else set())
        self.meta = meta_group if meta_group is not None else metadata_group()
        self.native_budgets = self.backend == "nccl"
        self.groups = {key: _group(self.backend, *key, timeout_s) for key in keys}

    def issue(self, node: Node, ins: list[Any], stream: str, budget: int,
              shapes: Sequence[tuple[int, ...]] = ()) -> Pending:
        """Issue ``node`` on this rank's inputs ``ins``; ``shapes`` are its outputs' IR shapes
        (needed by flat=True gathers, which reshape the gathered bucket)."""
        if node.group != self.n:
            raise NotImplementedError(f"collective {node.name!r} has group size {node.group} (axis "
                                      f"{node.attr('axis', 'mp')!r}) but the runtime runs one group of all "
                                      f"{self.n} ranks (data parallelism across groups is not supported)")
        pg = self.groups[(stream, budget)]
        issued = time.perf_counter_ns()
        if node.op is OpKind.ALL_GATHER:
            works, finish, keep = self._all_gather(node, ins[0], pg, shapes)
        elif node.op is OpKind.REDUCE_SCATTER:
            works, finish, keep = self._reduce_scatter(node, ins[0], pg)
        elif node.op is OpKind.ALL_REDUCE:
            works, finish, keep = self._all_reduce(ins[0], pg)
        elif node.op is OpKind.ALL_TO_ALL:
            mode = node.attr("mode")
            if mode in ("heads", "shards"):
                works, finish, keep = self._a2a_parts(node, ins, pg, stack=mode == "shards")
            elif mode == "tokens":
                works, finish, keep = self._a2a_tokens(node, ins, pg)
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

    def _all_gather(self, node: Node, x: torch.Tensor, pg, shapes):
        n, dim, flat = self.n, node.attr("dim"), node.attr("flat", False)
        x = (x.reshape(-1) if flat else x).contiguous()
        send = _bytes(x)                                            # [numel * itemsize] uint8
        out = send.new_empty((n * send.numel(),))                   # shards concatenated
        work = _all_gather_single(out, send, group=pg, async_op=True)

        def finish():
            parts = [_unbytes(p, x.dtype, x.shape) for p in out.view(n, -1).unbind(0)]
            full = torch.cat(parts, dim=dim)                        # [.., S, ..] x n -> [.., n*S, ..]
            return [full.view(shapes[0]) if flat and shapes else full]
        return [work], finish, (send, out)

    def _reduce_scatter(self, node: Node, x: torch.Tensor, pg):
        n, dim, flat = self.n, node.attr("dim"), node.attr("flat", False)
        mean = node.attr("reduce", "sum") == "mean"
        chunks = torch.stack((x.reshape(-1) if flat else x).chunk(n, dim=dim))   # [n, ..S..]: chunk j to rank j
        if "reduce_scatter" not in self.emulate:
            out = chunks.new_empty(chunks.shape[1:])
            cat = chunks.view(-1, *chunks.shape[2:])                # chunks concatenated on dim 0
            op = dist.ReduceOp.AVG if mean else dist.ReduceOp.SUM
            try:
                work = _reduce_scatter_single(out, cat, op=op, group=pg, async_op=True)
                return [work], lambda: [out], (chunks, out)
            except (RuntimeError, NotImplementedError, ValueError) as err:
                if "support" not in str(err).lower():
                    raise
                self.emulate.add("reduce_scatter")                  # same torch on every rank: all switch
        recv = torch.empty_like(chunks)                             # [n, ..S..]: rank r's partial of my chunk
        work = dist.all_to_all_single(recv, chunks, group=pg, async_op=True)
        # summed (or averaged) over ranks in rank order, as the reference interpreter does
        return [work], lambda: [recv.mean(0) if mean else recv.sum(0)], (chunks, recv)

    def _all_reduce(self, x: torch.Tensor, pg):
        out = x.contiguous().clone()
        work = dist.all_reduce(out, group=pg, async_op=True)
        return [work], lambda: [out], (out,)

    def _a2a_parts(self, node: Node, ins: list[torch.Tensor], pg, *, stack: bool):
        """heads: part j of each tensor (split along split_dim) to rank j, received parts concatenated
        along cat_dim in rank order. shards (flat=True flattens first): received parts stacked,
        [.., X, ..] -> [n, .., X/n, ..]. All tensors packed into one [n, bytes] exchange."""
        n, split_dim = self.n, node.attr("split_dim")
        cat_dim = None if stack else node.attr("cat_dim")
        flat = stack and node.attr("flat", False)
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

    def _a2a_tokens(self, node: Node, ins: list[Any], pg):
        rows, send_map = ins[0], ins[1]
        if not isinstance(send_map, (IndexMap, RecvMap)):
            raise TypeError(f"all_to_all {node.name!r}: input {node.inputs[1]!r} is a {type(send_map).__name__}, "
                            "expected an IndexMap or RecvMap")
        send_splits = [int(c) for c in send_map.splits]
        if len(send_splits) != self.n or sum(send_splits) != rows.shape[0]:
            raise RuntimeFailure(f"all_to_all {node.name!r}: split sizes {send_splits} do not cover the "
                                 f"{rows.shape[0]} rows of {node.inputs[0]!r} over {self.n} ranks")
        recv_map = None
        if node.attr("emit_map", False):
            per = len(send_map.segments) // self.n                  # experts per destination rank (El)
            counts = torch.tensor([c for _, c in send_map.segments], dtype=torch.int64).view(self.n, per)
            got = self.exchange(node, counts)                       # [n, El]: row r = rank r's rows per my expert
            recv_map = RecvMap(tuple((e, int(c)) for r in range(self.n) for e, c in enumerate(got[r].tolist())),
                               tuple(int(c) for c in got.sum(1).tolist()))
            recv_splits = list(recv_map.splits)
        else:
            got = self.exchange(node, torch.tensor(send_splits, dtype=torch.int64).view(self.n, 1))
            recv_splits = [int(c) for c in got.view(-1).tolist()]
        rows = rows.contiguous()
        # [R, h * itemsize] uint8: rows stay rows (the width is explicit: a rank may send no rows)
        send = _bytes(rows).view(rows.shape[0], math.prod(rows.shape[1:]) * rows.element_size())
        out = send.new_empty((sum(recv_splits), send.shape[1]))    # [R_recv, h * itemsize]
        work = dist.all_to_all_single(out, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                                      group=pg, async_op=True)

        def finish():
            got_rows = _unbytes(out, rows.dtype, (out.shape[0], *rows.shape[1:]))   # [R_recv, h]
            return [got_rows] if recv_map is None else [got_rows, recv_map]
        return [work], finish, (send, out)

    def exchange(self, node: Node | None, counts: torch.Tensor) -> torch.Tensor:
        """Synchronous all_to_all of a small [n, m] int64 tensor on the metadata group: row r of
        the result is what rank r put in row ``self.rank``."""
        recv = torch.empty_like(counts)
        work = dist.all_to_all_single(recv, counts.contiguous(), group=self.meta, async_op=True)
        what = f"split-size exchange of {node.name!r}" if node is not None else "split-size exchange"
        _wait_host(work, self.timeout_s, what, self.rank)
        return recv


_GROUPS: dict[tuple, Any] = {}


def _group(backend: str, stream: str, budget: int, timeout_s: float) -> Any:
    """The process group of one (stream, budget): NCCL, one per pair (its communicator carries the
    CTA limit); gloo, one per stream (budgets are not enforced). Cached per default group, so
    compiling several layers reuses them; ``new_group`` is collective, and every rank compiles
    the same plans in the same order, so every rank hits or misses the cache alike."""
    key = (id(dist.group.WORLD), backend, stream, budget if backend == "nccl" else None, timeout_s)
    if key not in _GROUPS:
        kw = {"pg_options": nccl_options(budget)} if backend == "nccl" else {}
        _GROUPS[key] = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return _GROUPS[key]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 tensor (no copy)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _unbytes(b: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Inverse of ``_bytes``: reinterpret bytes as ``dtype`` with ``shape`` (a view when aligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    if not b.is_contiguous() or b.storage_offset() % size:
        b = b.clone()                                           # reinterpretation needs aligned storage
    return b.view(dtype).view(tuple(shape))


def metadata_group() -> Any:
    """A CPU (gloo) group for split sizes and plan hashes: WORLD under gloo, a new (cached) group
    under NCCL. Collective: every rank must call it at the same point."""
    if not dist.is_initialized():
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    key = (id(dist.group.WORLD), "meta")
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo")
    return _GROUPS[key]


def nccl_options(budget: int) -> Any:
    """ProcessGroupNCCL options whose communicator uses ``budget`` CTAs (= SMs); see module doc."""
    pg_cls = getattr(dist, "ProcessGroupNCCL", None)
    if pg_cls is None:
        raise RuntimeFailure("this torch build has no NCCL backend (ProcessGroupNCCL); use backend gloo")
    opts = pg_cls.Options()
    cfg = getattr(opts, "config", None)
    if cfg is None:
        return opts                                                 # NCCL < 2.17: no per-communicator config
    if budget > 0:
        cfg.min_ctas = budget
        cfg.max_ctas = budget
    elif hasattr(cfg, "cta_policy") and hasattr(pg_cls, "NCCL_CTA_POLICY_ZERO"):
        cfg.cta_policy = pg_cls.NCCL_CTA_POLICY_ZERO
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

    def issue(self, node: Node, *_args) -> Pending:
        raise RuntimeFailure(f"collective {node.name!r} needs torch.distributed initialised with "
                             f"{node.group} ranks")
