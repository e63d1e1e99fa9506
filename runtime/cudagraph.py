"""CUDA graphs for a compiled layer's static-shape segments (opt-in: ``cuda_graphs``).

Why. On a GPU the executor issues every node from Python: its host cost per node
(``HostTime``, ``run --json``'s ``host_us_per_node``) times the nodes of a phase is a floor
under the step time. When that floor approaches the device time (small layers, many nodes,
short kernels) replaying a captured CUDA graph, one launch for a whole segment, removes it.

Modes (``CudaGraphs``, a Literal; ``"off"`` is the default and runs the plain executor):

    attention   per phase, the maximal static prefix and suffix of the plan's issue order
                (forward: the attention block with its collectives, up to the router; backward:
                from the last routing-dependent node on, i.e. the attention block's backward).
                Everything between them runs eagerly. Never refused for data dependence.
    layer       each whole phase (forward, backward + recompute) as one graph. Refused, naming
                the first node, where a node of the phase needs a host value (``host_read``).

What cannot be captured (``host_reads``, a pure function of the graph and ``expert_rows``): a
CUDA graph replays fixed kernels on fixed buffers, so a node whose work depends on a value read
on the host breaks it: the local index map of ffn=ep under dispatch=ag-rs with
``expert_rows='exact'`` (its row count R is read back, dropless routing sizes every expert buffer
by it), a token all-to-all (its split sizes go to the host), a grouped GEMM over by-destination
rows (it loops over host row segments), and any node that reads a value whose row count depends
on the routing. With ``expert_rows='padded'`` (capacity-padded, still dropless:
``moegraph.index_map.build_index_map``) the local map has the static C = T * min(k, E/n) rows and
its real row count stays on the device, so ffn=ep under ag-rs captures whole; the refusal for
'exact' points there. Padding costs memory: C instead of about R rows in every expert buffer
(``padded_rows_extra_bytes``; ``run --json`` reports it).
Index maps are Python objects, not tensors: the 'attention' segments stop before a node that
reads or makes one, so no index map crosses a graph boundary. The grouped GEMM over an index map
reads no host value on any GPU or dtype (``moegraph.grouped_gemm``: ``torch._grouped_mm`` where its
kernel runs from device-side group ends, bf16 on sm90/sm100; elsewhere its masked formulation),
so an fp32 layer captures whole too.

Replay (``CapturedSegment``). The first call warms the segment up eagerly on a side stream
(torch requires it: lazy cuBLAS/NCCL initialisation must not be captured), with
``torch.cuda.set_sync_debug_mode("error")`` so a kernel that would read the host fails here,
naming the segment, instead of inside capture; then captures it with ``torch.cuda.graph`` into
one memory pool per layer. Every call: inputs are copied into the static placeholders (fresh
activations, the incoming gradient, the forward's saved values for backward; a parameter is its
own placeholder, the captured kernels read its storage, so in-place optimizer updates need no
copy and only a parameter whose storage was replaced is copied), the graph is replayed, and
every output is cloned out: the graph's own output buffers are overwritten by the next replay,
while autograd and the caller hold the returned tensors (y, saved values, gradients).

Comm streams. Collectives of a captured segment run on the executor's comm streams; each comm
stream is forked from the capturing stream (``wait_stream``) before the segment and joined back
by the executor's end-of-phase ``wait_stream``, the same event fences the eager path uses, so
the collectives are part of the graph. Segments end at their phase's end-of-phase join: a
collective never spans two segments.

Traces. Per-node timing events cannot be recorded inside a graph: a layer with cuda_graphs on
records no per-node traces (``run`` reports ``cuda_graphs`` and ``per_node_traces: false``);
step times are still measured, and ``host_us_per_node`` then measures replay launch overhead
(copy-in, replay, clone-out, and the eager segments' issue cost).

Not yet run on a GPU (no device was lent): tests/test_cudagraph.py checks the semantics on CPU
with an emulated capture backend (``GraphBackend``) and holds GPU tests that skip without CUDA.
"""

from __future__ import annotations

import time
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol, Sequence

import torch

from moegraph.ir import ExpertRows, Graph, Node, OpKind, ValueKind, check_expert_rows
from moegraph.index_map import IndexMap
from moegraph.runtime import CUDA_GRAPH_MODES, CudaGraphs, RuntimeFailure
from moegraph.runtime.executor import Executor, _releases
from moegraph.runtime.plan import ExecutionPlan, PlanEntry

WARMUP_RUNS = 2            # eager runs before capture (torch's examples use a few; lazy init happens in the first)

# compute kernels whose shapes follow their inputs' and that read nothing on the host
_STATIC_KERNELS = frozenset({OpKind.GEMM, OpKind.ATTENTION, OpKind.RMSNORM, OpKind.ROPE, OpKind.SWIGLU,
                             OpKind.ROUTER, OpKind.PERMUTE, OpKind.UNPERMUTE, OpKind.GATE, OpKind.SPLIT,
                             OpKind.ADD, OpKind.BIAS, OpKind.SIGMOID_GATE, OpKind.SQUARE_SUM,
                             OpKind.RMSNORM_SHARDED, OpKind.MLA_HEADS, OpKind.CAST, OpKind.ALL_GATHER,
                             OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE,
                             OpKind.NORM, OpKind.GLU, OpKind.SCALE, OpKind.LIMIT,
                             OpKind.GATED_DELTA})      # the structural lowering's elementwise ops


def check_mode(mode: Any) -> CudaGraphs:
    """``mode`` if it is one of CUDA_GRAPH_MODES, else ValueError naming the valid ones."""
    if not isinstance(mode, str) or mode not in CUDA_GRAPH_MODES:
        raise ValueError(f"cuda_graphs={mode!r} is not one of {', '.join(map(repr, CUDA_GRAPH_MODES))}")
    return typing.cast(CudaGraphs, mode)


@dataclass(frozen=True)
class HostRead:
    """A node a CUDA graph cannot hold: ``reason`` says which host value it needs."""

    node: str
    phase: Literal["forward", "backward"]      # the executor's phase (backward includes recompute)
    reason: str
    remedy: str = ("capture needs static shapes (ffn=tp with dispatch=ag-rs, or ffn=ep with dispatch=ag-rs and "
                   "expert_rows='padded', captures whole, or use cuda_graphs='attention')")

    def refusal(self, graph: Graph) -> str:
        st = graph.strategy
        return (f"cuda_graphs: {self.phase} node {self.node!r} (ffn={st.ffn}, dispatch={st.dispatch}) {self.reason}; "
                f"{self.remedy}")


def host_reads(graph: Graph, expert_rows: ExpertRows = "exact") -> dict[str, str]:
    """Node name -> why it needs a host value, for every node that does (graph order). Pure.
    ``expert_rows``: how local index maps are built ('padded' ones read nothing on the host).

    A value's rows are data-dependent when a local index map or a token all-to-all makes it, or
    when a node that reads such a value makes it as a routed (``Value.routed``) or routing value;
    other outputs of such a node (a combine's [b, S, h], a weight gradient) have static shapes."""
    dynamic: set[str] = set()
    out: dict[str, str] = {}
    maps = {o: nd.typed.layout for nd in graph.nodes if nd.op is OpKind.INDEX_MAP for o in nd.outputs}
    for node in graph.nodes:
        reason = _own_host_read(node, maps, expert_rows)
        if reason is None:
            read = next((v for v in node.inputs if v in dynamic), None)
            if read is not None:
                reason = f"reads {read!r}, whose row count depends on the routing"
        if reason is None:
            continue
        out[node.name] = reason
        own = node.op is OpKind.INDEX_MAP or node.op is OpKind.ALL_TO_ALL
        for o in node.outputs:
            v = graph.value[o]
            if own or v.routed or v.kind is ValueKind.ROUTING:
                dynamic.add(o)
    return out


def _own_host_read(node: Node, maps: dict[str, str], expert_rows: ExpertRows) -> str | None:
    """Why the node's kernel itself reads the host (regardless of its inputs' shapes), or None."""
    match node.op:
        case OpKind.INDEX_MAP:
            layout = node.typed.layout
            if layout == "local" and check_expert_rows(expert_rows) == "exact":
                return ("builds a local index map whose row count R is read on the host (expert_rows='exact': "
                        "dropless routing sizes the expert buffers by it; expert_rows='padded' fixes them at "
                        "C = T * min(k, E/n) rows, still dropless, and captures)")
            if layout == "local":
                return None
            if layout in ("all", "by_dest"):
                return None
            if layout in ("by_node", "in_node"):
                return (f"builds a {layout} index map (the hierarchical dispatch, ep_nodes > 1) whose row count "
                        "is read on the host")
            raise ValueError(f"node {node.name!r}: index map layout {layout!r} is not one of 'local', 'all', "
                             "'by_dest', 'by_node', 'in_node'")
        case OpKind.ALL_TO_ALL:
            mode = node.typed.mode
            if mode == "tokens":
                return "sends data-dependent split sizes (copied to the host for the all-to-all)"
            if mode in ("heads", "shards"):
                return None
            raise NotImplementedError(f"node {node.name!r}: all-to-all mode {mode!r} has no cuda_graphs rule")
        case OpKind.GROUPED_GEMM:
            seg = node.inputs[-1]
            if maps.get(seg) in ("by_dest", "in_node"):
                return (f"loops over host row segments of index map {seg!r} (layout by_dest has no device-side "
                        "group offsets)")
            return None
        case OpKind.GROUPED_BIAS:       # the structural lowering's expert biases: rows' experts from host segments
            return f"reads the host row segments of index map {node.inputs[2]!r} (each row's expert)"
        case op if op in _STATIC_KERNELS:
            return None
    raise NotImplementedError(f"no cuda_graphs rule for {node.op.value} (node {node.name!r})")


def first_host_read(graph: Graph, plan: ExecutionPlan, expert_rows: ExpertRows = "exact") -> HostRead | None:
    """The first node in issue order (forward, then backward) that needs a host value, or None
    when both phases can be captured whole. Pure function of (graph, plan, expert_rows)."""
    reads = host_reads(graph, expert_rows)
    for phase, entries in zip(("forward", "backward"), plan.split(graph)):
        for e in entries:
            if e.name in reads:
                return HostRead(e.name, phase, reads[e.name])
    return None


def capture_refusal(graph: Graph, plan: ExecutionPlan, mode: CudaGraphs,
                    expert_rows: ExpertRows = "exact") -> str | None:
    """Why ``mode`` cannot run this (graph, plan) with ``expert_rows``, or None. Device independent
    (see ``check_device``)."""
    check_mode(mode)
    if mode == "off":
        return None
    from moegraph.edges import edge_values
    from moegraph.microbatch import micro_batch_count
    if micro_batch_count(graph) > 1:
        return (f"cuda_graphs: graph {graph.name!r} is a merged step of {micro_batch_count(graph)} micro-batches; "
                "only one-micro-batch layers are captured")
    if edge_values(graph) is not None:
        return f"cuda_graphs: graph {graph.name!r} carries a model's edges (moegraph.edges); only layers are captured"
    if mode == "layer":
        hit = first_host_read(graph, plan, expert_rows)
        return None if hit is None else hit.refusal(graph)
    if mode == "attention":
        if not any(s.captured for entries in plan.split(graph) for s in segments(graph, entries, mode)):
            return f"cuda_graphs: graph {graph.name!r} has no static prefix or suffix to capture"
        return None
    raise ValueError(f"cuda_graphs={mode!r} is not one of {', '.join(CUDA_GRAPH_MODES)}")


def check_device(mode: CudaGraphs, device: torch.device) -> None:
    """ValueError unless ``mode`` is off or the layer lives on a CUDA device."""
    if mode != "off" and torch.device(device).type != "cuda":
        raise ValueError(f"cuda_graphs={mode!r} needs the layer on a CUDA device (NCCL across ranks), it is on "
                         f"{torch.device(device)}; use cuda_graphs='off'")


# -- segments -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Segment:
    """Consecutive plan entries of one phase, captured or run eagerly."""

    entries: tuple[PlanEntry, ...]
    captured: bool


def segments(graph: Graph, entries: Sequence[PlanEntry], mode: CudaGraphs) -> list[Segment]:
    """A phase's entries cut into segments: 'layer': one captured segment (the caller checked
    ``first_host_read``); 'attention': the static prefix before the first node that needs a host
    value or touches an index map, the eager middle, the static suffix after the last one."""
    entries = tuple(entries)
    if not entries:
        return []
    if mode == "layer":
        return [Segment(entries, True)]
    if mode != "attention":
        raise ValueError(f"segments for cuda_graphs={mode!r}: only 'attention' and 'layer' capture")
    reads = host_reads(graph)
    maps = {o for nd in graph.nodes if nd.op is OpKind.INDEX_MAP for o in nd.outputs}
    breaks = [i for i, e in enumerate(entries) if e.name in reads
              or any(v in maps for v in (*graph.node[e.name].inputs, *graph.node[e.name].outputs))]
    if not breaks:
        return [Segment(entries, True)]
    parts = [Segment(entries[:breaks[0]], True), Segment(entries[breaks[0]:breaks[-1] + 1], False),
             Segment(entries[breaks[-1] + 1:], True)]
    return [p for p in parts if p.entries]


# -- capture backends ---------------------------------------------------------------------------

class GraphBackend(Protocol):
    """How a segment is captured and replayed. ``capture(fn, fork)`` runs ``fork()`` on the
    capturing stream, then captures ``fn`` (it reads the placeholders, returns the output dict)
    and returns (handle, the output buffers it wrote); ``replay(handle)`` re-runs the capture,
    rewriting those same buffers."""

    def capture(self, fn: Callable[[], dict[str, Any]], fork: Callable[[], None]) -> tuple[Any, dict[str, Any]]: ...

    def replay(self, handle: Any) -> None: ...


class TorchGraphs:
    """Real CUDA graphs: eager warm-up on a side stream, then ``torch.cuda.graph`` into one pool."""

    def __init__(self, device: torch.device):
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"CUDA graphs need a CUDA device, the layer is on {device}")
        self.device = torch.device(device)
        # one pool per layer, shared by its segments' graphs. torch makes sharing safe when graphs
        # replay in capture order; here it is safe in any order (a forward without backward, two
        # forwards before their backwards): placeholders live outside the pool, and a graph's outputs
        # are cloned right after its replay, so no graph's pool memory must survive another's replay
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn, fork):
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fork()
            old = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")       # a host read fails here, not in the capture
            try:
                for _ in range(WARMUP_RUNS):
                    fn()
            finally:
                torch.cuda.set_sync_debug_mode(old)
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            fork()
            out = fn()
        return g, out

    def replay(self, handle) -> None:
        handle.replay()


class CapturedSegment:
    """One captured segment: placeholders in, graph, outputs cloned out (see the module doc)."""

    def __init__(self, name: str, reads: tuple[str, ...], makes: tuple[str, ...], params: frozenset[str]):
        self.name, self.reads, self.makes, self.params = name, reads, makes, params
        self.handle: Any = None
        self.static_in: dict[str, torch.Tensor] = {}
        self.static_out: dict[str, torch.Tensor] = {}

    def run(self, inputs: dict[str, Any], run_eager: Callable[[dict[str, Any]], dict[str, Any]],
            backend: GraphBackend, fork: Callable[[], None]) -> dict[str, Any]:
        if self.handle is None:
            # a parameter is its own placeholder (in-place updates are seen); anything else a copy
            self.static_in = {k: inputs[k].detach() if k in self.params else _own(inputs[k], k, self.name)
                              for k in self.reads}
            try:
                self.handle, out = backend.capture(lambda: run_eager(dict(self.static_in)), fork)
            except RuntimeFailure:
                raise                   # the runtime's own (a collective timeout, a rank failure): as it is
            except RuntimeError as err:
                raise RuntimeFailure(f"cuda_graphs: capturing segment {self.name} failed: {err} (a kernel that reads "
                                     "the host cannot be captured)") from err
            missing = sorted(set(self.makes) - set(out))
            if missing:
                raise RuntimeFailure(f"cuda_graphs: segment {self.name} did not make {missing}: a runtime bug")
            self.static_out = {k: out[k] for k in self.makes}
        else:
            for k in self.reads:
                v, static = inputs[k], self.static_in[k]
                if k in self.params and v.data_ptr() == static.data_ptr():
                    continue                              # the parameter itself: already what the graph reads
                _copy_into(static, v, k, self.name)
        backend.replay(self.handle)
        return {k: _own(v, k, self.name) for k, v in self.static_out.items()}


def _own(v: Any, name: str, segment: str) -> Any:
    """A copy of a segment boundary value: a tensor, or an index map (its tensors copied)."""
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, IndexMap):
        return IndexMap(v.flat.clone(), v.top_k, v.counts.clone(), None if v.offsets is None else v.offsets.clone(),
                        v.per_dest, None if v.rows is None else v.rows.clone(), v.sources)
    raise RuntimeFailure(f"cuda_graphs: segment {segment} value {name!r} is a {type(v).__name__}, neither a tensor nor "
                         "an index map: it cannot be a graph's static buffer")


def _copy_into(static: Any, v: Any, name: str, segment: str) -> None:
    """Copy a new step's value into its placeholder; shapes must be the captured ones."""
    if isinstance(static, IndexMap):
        if not isinstance(v, IndexMap) or (v.top_k, v.per_dest, v.offsets is None, v.rows is None) != \
                (static.top_k, static.per_dest, static.offsets is None, static.rows is None):
            raise RuntimeFailure(f"cuda_graphs: segment {segment} input {name!r} is not an index map of the captured "
                                 "layout")
        pairs = [(static.flat, v.flat), (static.counts, v.counts)] + \
            ([] if v.offsets is None else [(static.offsets, v.offsets)]) + \
            ([] if v.rows is None else [(static.rows, v.rows)])
    else:
        pairs = [(static, v)]
    for s, t in pairs:
        if not isinstance(t, torch.Tensor) or t.shape != s.shape or t.dtype != s.dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise RuntimeFailure(f"cuda_graphs: segment {segment} input {name!r} is {got}, captured as "
                                 f"{tuple(s.shape)} {s.dtype}: a graph replays static shapes only")
        s.copy_(t)
    if isinstance(static, IndexMap):
        static._host.clear()            # host facts read from the captured step's counts are stale now


# -- the executor -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _PhaseSegment:
    segment: Segment
    reads: tuple[str, ...]          # values it reads that earlier segments or the phase's inputs made
    makes: tuple[str, ...]          # values it makes that later segments or the phase's caller read
    release: list                   # per entry: values to drop (Executor._run's release lists)
    captured: CapturedSegment | None


class GraphedExecutor(Executor):
    """An Executor whose forward and backward phases run as segments, captured ones replayed
    (``mode``: 'attention' or 'layer'). ``backend``: the capture backend (default: real CUDA
    graphs, which need a CUDA device). Merged micro-batch steps and model edges are refused."""

    def __init__(self, graph: Graph, plan: ExecutionPlan, comm: Any, *, rank: int, n: int, device: torch.device,
                 timeout_s: float = 300.0, mode: CudaGraphs, backend: GraphBackend | None = None,
                 expert_rows: ExpertRows = "exact"):
        mode = check_mode(mode)
        if mode == "off":
            raise ValueError("GraphedExecutor with cuda_graphs='off': use Executor")
        if backend is None:
            check_device(mode, device)
        why = capture_refusal(graph, plan, mode, expert_rows)
        if why is not None:
            raise RuntimeFailure(why)
        super().__init__(graph, plan, comm, rank=rank, n=n, device=device, timeout_s=timeout_s,
                         expert_rows=expert_rows)
        self.mode = mode
        self.backend = backend if backend is not None else TorchGraphs(self.device)
        params = frozenset(self.param_names)
        full_fwd_keep = frozenset(self.saved | {self.output_name})
        self._phases = {id(self.fwd): self._cut("forward", self.fwd, full_fwd_keep, params),
                        id(self.bwd): self._cut("backward", self.bwd, frozenset(graph.outputs[1:]), params)}

    def _cut(self, phase: str, entries, keep: frozenset[str], params: frozenset[str]) -> list[_PhaseSegment]:
        segs = segments(self.graph, entries, self.mode)
        made = [{o for e in s.entries for o in self.graph.node[e.name].outputs} for s in segs]
        read = [{i for e in s.entries for i in self.graph.node[e.name].inputs} for s in segs]
        out = []
        for j, s in enumerate(segs):
            later = set(keep).union(*read[j + 1:])
            reads = tuple(sorted(read[j] - made[j]))
            makes = tuple(sorted(made[j] & later))
            name = f"{phase}[{j}] ({s.entries[0].name} .. {s.entries[-1].name}, {len(s.entries)} nodes)"
            cap = CapturedSegment(name, reads, makes, params & set(reads)) if s.captured else None
            out.append(_PhaseSegment(s, reads, makes, _releases(self.graph, s.entries, keep=set(makes)), cap))
        return out

    def _run(self, entries, inputs, release, rec, keep, kernels=None):
        if kernels:     # plan-run eager kernels belong to a model's edges, which a graphed layer refuses
            raise RuntimeFailure(f"cuda_graphs: eager kernels {sorted(kernels)} in a graphed layer")
        phase = self._phases.get(id(entries))
        if phase is None:
            raise RuntimeFailure("cuda_graphs: only a layer's forward and backward phases run segmented")
        env = dict(inputs)
        for j, ps in enumerate(phase):
            ins = {k: env[k] for k in ps.reads}
            if ps.captured is None:
                out = super()._run(ps.segment.entries, ins, ps.release, None, set(ps.makes))
            else:
                replay, started = ps.captured.handle is not None, time.perf_counter_ns()
                run_eager = lambda i, ps=ps: super(GraphedExecutor, self)._run(  # noqa: E731
                    ps.segment.entries, i, ps.release, None, set(ps.makes))
                out = ps.captured.run(ins, run_eager, self.backend, self._fork)
                if replay:      # copy-in, replay, clone-out: the host cost per node a graph leaves
                    self.host.busy_ns += time.perf_counter_ns() - started
                    self.host.nodes += len(ps.segment.entries)
            env.update(out)
            needed = set(keep).union(*(p.reads for p in phase[j + 1:]))
            env = {k: v for k, v in env.items() if k in needed}
        return {k: env[k] for k in keep if k in env}

    def _fork(self) -> None:
        """Order every comm stream after the capturing stream, so the segment's collectives are
        captured into its graph (their end is joined by the executor's end-of-phase wait_stream)."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            for s in self.comm_streams.values():
                s.wait_stream(cur)
