"""The scheduling problem of one layer: tasks, modes, dependencies, memory intervals.

Everything downstream (baselines, lower bound, CP-SAT) reads a ``Problem``; nothing reads the
Graph again. Evaluating a solution of it (makespan, memory, the overlap rule, the feasibility
check) is moegraph.schedules.solution. Times are integer *ticks* of ``TICK_US`` (10 ns): every duration the cost model
gives is rounded UP to a whole tick, so a schedule on the tick grid is exactly feasible for
the cost model's durations plus less than one tick per node (the verifier's tolerance).

Semantics (docs/scheduler.md, the verifier implements them independently):
    * a node starts after the end of every producer of its inputs;
    * barrier: every BACKWARD / RECOMPUTE node starts at or after the end of every FORWARD node;
      in a merged step graph of M micro-batches (moegraph.microbatch) the barrier is per
      micro-batch: a node of micro-batch j (node attr ``mb``) waits for the end of every forward
      node of micro-batch j only, and step-level backward nodes (no ``mb``) for every forward
      node. There every task has ``side`` 0 and the barrier is carried by ``Task.preds``: edges
      from micro-batch j's last forward nodes to its first backward ones (``barrier_preds``),
      exact by transitivity, so baselines, bound and CP-SAT need no notion of it;
    * streams: one ``compute`` stream and one or more communication streams, one node at a
      time per stream. Inter-node data-parallel collectives (attr axis="dp", scope "inter":
      the NIC stages of the gradient sync, moegraph.autodiff._dp_sync) always get their own
      stream ``DP_STREAM``: they use the NIC, not NVLink, and real systems issue them on a
      separate stream (MegaScale-MoE §5), so they never queue behind intra-node collectives;
    * modes: a collective holds ``b`` SMs (b from cost.comm_sm_budgets, 0 = copy engines) for
      ``cost.node_time_us(node, b)``; a compute node runs on ``sm_count - b`` SMs
      (b in {0} | hardware budgets) for ``cost.beside_comm_us(node, b)`` (at most
      ``base * sm_count / (sm_count - b)``: SMs and HBM bandwidth left); at any instant
      the SMs of running nodes sum to at most sm_count;
    * overlap stretch: with ``cost.comm_overlap_stretch()`` = x > 1 every collective mode comes
      twice: *alone* (no compute node may run during it) at the plain time, or beside compute
      at x times it. A collective that no compute overlaps is always in its alone mode
      (``settle_alone``), so a schedule's durations follow from its timeline;
    * memory: a value with storage, not PARAM/PARAM_GRAD, is live from its producer's start
      (graph inputs: time 0, or the barrier for GRAD inputs) until the last end of a consumer
      of it or of any view of it (graph outputs: the makespan; unconsumed: producer's end).
      In a merged graph a micro-batch's seed gradient is counted from time 0 (conservative: it
      is at most one activation-sized tensor per micro-batch, and this needs no per-micro-batch
      barrier variable in the memory model).
    * remat anchors (a memory rule): in a stack of layers a RECOMPUTE node also starts after
      ``remat_anchors``' nodes, so rebuilt values are made just ahead of their layer's backward.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from moegraph.cost import CostModel, collective_scope
from moegraph.registry import Hardware

from moegraph.ir import Graph, Node, Phase, ValueKind
from moegraph.microbatch import micro_batch_count, micro_batch_of

__all__ = ["TICK_US", "COMPUTE", "DEFAULT_COMM_STREAMS", "DP_STREAM", "is_dp_inter", "ScheduleError",
           "MemoryBudgetError", "Mode", "Task", "MemValue", "Problem", "build_problem", "barrier_preds", "remat_anchors", "REMAT_LOOKAHEAD",
           "stream_of", "chunk_symmetry", "topological", "mode_duration_us"]

TICK_US = 0.01
"""One CP-SAT time unit: 10 ns. Kernels last microseconds, so rounding up costs < 0.5%."""
COMPUTE = "compute"
DEFAULT_COMM_STREAMS = ("comm",)
SCOPED_COMM_STREAMS = ("comm.intra", "comm.inter")
DP_STREAM = "comm.dp"
"""The stream of inter-node DP collectives (``is_dp_inter``), added after the chosen comm
streams whenever the graph has any: with one shared comm stream the DP sync (tens of ms on the
NIC per layer) would serialise behind NVLink all-to-alls it does not share a link with."""
_EXCLUDED_KINDS = (ValueKind.PARAM, ValueKind.PARAM_GRAD)  # persistent buffers: not scheduled memory


class ScheduleError(ValueError):
    """An expected failure: a bad option, an impossible graph, a budget nothing can meet."""


class MemoryBudgetError(ScheduleError):
    """No schedule keeps peak memory within the budget; the message gives the least peak."""

    def __init__(self, message: str, least_peak_bytes: int | None = None, proven: bool = False):
        super().__init__(message)
        self.least_peak_bytes = least_peak_bytes
        self.proven = proven


@dataclass(frozen=True)
class Mode:
    """One way to run a task: holding ``sm`` SMs for ``ticks`` ticks (``duration_us`` unrounded).
    ``alone``: a collective mode during which no compute node runs (see the module doc)."""

    sm: int
    duration_us: float
    ticks: int
    alone: bool = False


@dataclass(frozen=True)
class Task:
    """One node. ``side`` 0: before the barrier (FORWARD), 1: after it (BACKWARD, RECOMPUTE);
    0 for every node of a merged micro-batch graph, whose per-micro-batch barrier is in ``preds``
    (producers of the inputs, plus ``barrier_preds``).

    For compute, ``Mode.sm`` is the SMs the kernel runs on (sm_count - b); for a collective it
    is the SM budget b it holds. ``default_mode`` indexes the mode baselines use: a collective's
    default budget, compute at full SMs. Modes are sorted by ticks, then SMs.
    """

    index: int
    name: str
    node: Node
    kind: str                     # "compute" | "comm"
    stream: str
    side: int
    modes: tuple[Mode, ...]
    default_mode: int
    preds: tuple[int, ...]
    succs: tuple[int, ...]

    @property
    def min_ticks(self) -> int:
        return min(m.ticks for m in self.modes)

    @property
    def max_ticks(self) -> int:
        return max(m.ticks for m in self.modes)


@dataclass(frozen=True)
class MemValue:
    """A value's live interval, in terms of tasks.

    start: "producer" (task ``producer``'s start), "zero" (graph input), "barrier" (seed grad).
    ends:  tasks whose ends bound the interval from below (consumers of the value or of its
           views; the producer itself when nothing consumes it).
    until_makespan: a graph output (or the base of one), live until the makespan.
    """

    name: str
    nbytes: int
    start: str
    producer: int | None
    ends: tuple[int, ...]
    until_makespan: bool


@dataclass(frozen=True)
class Problem:
    graph: Graph
    cost: CostModel
    sm_count: int
    compute_budgets: tuple[int, ...]   # b values: compute runs on sm_count - b SMs
    streams: tuple[str, ...]           # compute first, then the comm streams
    tasks: tuple[Task, ...]
    mem_values: tuple[MemValue, ...]
    memory_budget_bytes: int | None
    tick_us: float = TICK_US
    launch: tuple[int, ...] = ()
    """Task indices in the order one hardware queue launches them (moegraph.schedules.launch):
    each starts no earlier than the one before it; () = a queue per stream, no such rule."""
    launch_order: str = "free"
    """The launch.LaunchOrder ``launch`` comes from."""

    @functools.cached_property
    def by_name(self) -> dict[str, Task]:
        return {t.name: t for t in self.tasks}

    @functools.cached_property
    def order(self) -> tuple[int, ...]:
        """Task indices in a topological order of ``preds`` (``topological``). Task order
        follows the graph's data edges, but remat anchors and micro-batch barriers are
        precedence edges that it need not follow."""
        return tuple(topological([t.index for t in self.tasks], {t.index: t.preds for t in self.tasks},
                                 {t.index: t.succs for t in self.tasks}))

    @functools.cached_property
    def dp_tail(self) -> frozenset[int]:
        """The inter-node DP collectives (stream DP_STREAM) and every task downstream of one
        (the intra-node all-gathers that finish a hierarchical sync; with compress=dp-bf16 also
        the local FP32 sums): what the DP-aware periodic tiling moves out of a period
        (moegraph.schedules.periodic)."""
        tail = {t.index for t in self.tasks if t.stream == DP_STREAM}
        for i in self.order:
            if any(p in tail for p in self.tasks[i].preds):
                tail.add(i)
        return frozenset(tail)

    @property
    def horizon(self) -> int:
        """Every task one after another at its slowest mode: no schedule needs longer."""
        return sum(t.max_ticks for t in self.tasks)


def topological(ids: list[int], preds: Mapping[int, Sequence[int]],
                succs: Mapping[int, Sequence[int]]) -> list[int]:
    """``ids`` in a topological order (Kahn's, smallest index first: deterministic). Node order
    is topological for data edges, but a Problem may add precedence edges (remat anchors,
    micro-batch barriers) that the node order need not follow."""
    waiting = {i: len(preds[i]) for i in ids}
    ready = [i for i in ids if not waiting[i]]
    heapq.heapify(ready)
    out = []
    while ready:
        i = heapq.heappop(ready)
        out.append(i)
        for s in succs[i]:
            waiting[s] -= 1
            if not waiting[s]:
                heapq.heappush(ready, s)
    if len(out) != len(ids):
        raise ScheduleError("the problem's precedence edges form a cycle")
    return out


def to_ticks(duration_us: float) -> int:
    """Round a duration up to whole ticks (ignoring float noise below a femtosecond)."""
    if not math.isfinite(duration_us) or duration_us < 0:
        raise ScheduleError(f"duration {duration_us!r} us is not a finite non-negative number")
    return max(0, math.ceil(duration_us / TICK_US - 1e-9))


def is_dp_inter(node: Node, hw: Hardware) -> bool:
    """An inter-node stage of the data-parallel gradient sync: a collective across replicas
    (attr axis="dp") on the NIC (scope "inter")."""
    return node.is_comm and node.attr("axis", None) == "dp" and collective_scope(node, hw.gpus_per_node) == "inter"


def stream_of(node: Node, comm_streams: Sequence[str], hw: Hardware) -> str:
    if not node.is_comm:
        return COMPUTE
    if is_dp_inter(node, hw):
        return DP_STREAM
    if len(comm_streams) == 1:
        return comm_streams[0]
    return f"comm.{collective_scope(node, hw.gpus_per_node)}"


def _check_streams(comm_streams: Sequence[str]) -> tuple[str, ...]:
    """The chosen comm streams; a trailing DP_STREAM (as in a Problem's or a schedule file's
    ``streams``) is accepted and dropped: build_problem adds it from the graph."""
    given = tuple(comm_streams)
    streams = given[:-1] if given[-1:] == (DP_STREAM,) else given
    if streams not in (DEFAULT_COMM_STREAMS, SCOPED_COMM_STREAMS):
        raise ScheduleError(f"comm_streams={list(given)} is not one of {list(DEFAULT_COMM_STREAMS)}, "
                            f"{list(SCOPED_COMM_STREAMS)}")
    return streams


def _dominates(o: Mode, m: Mode) -> bool:
    """``o`` is no longer, holds no more SMs and is no more constrained (alone) than ``m``."""
    return ((o.ticks, o.sm, o.alone) != (m.ticks, m.sm, m.alone) and o.ticks <= m.ticks and o.sm <= m.sm
            and o.alone <= m.alone)


def _prune(modes: list[Mode], keep: Mode) -> tuple[Mode, ...]:
    """Drop dominated modes, except ``keep`` (the default, which baselines use as is) and the
    alone twin of every kept beside-compute mode: a collective that no compute overlaps is
    priced alone at its budget (``settle_alone``, and the verifier prices it so), so that
    mode must exist even where a smaller budget is as fast alone (latency-bound collectives).
    Sorted by ticks, then SMs, beside-compute before alone."""
    kept = {m for m in modes if m == keep or not any(_dominates(o, m) for o in modes)}
    kept |= {o for m in kept if not m.alone for o in modes if o.alone and o.sm == m.sm}
    return tuple(sorted(kept, key=lambda m: (m.ticks, m.sm, m.alone)))


def mode_duration_us(node: Node, cost: CostModel, budget: int, *, alone: bool = False,
                     stretch: float | None = None) -> float:
    """How long ``node`` runs in a mode, in us: a collective holding ``budget`` SMs, alone
    (its plain time) or beside compute (``stretch`` times it; default the cost model's
    comm_overlap_stretch); a compute node while collectives hold ``budget`` SMs (its time at
    SMs and HBM left, ``cost.beside_comm_us``; ``alone`` and ``stretch`` do not apply)."""
    if node.is_comm:
        us = float(cost.node_time_us(node, budget))
        return us if alone else us * float(cost.comm_overlap_stretch() if stretch is None else stretch)
    return float(cost.beside_comm_us(node, budget))


def _comm_modes(node: Node, cost: CostModel, sm_count: int) -> tuple[tuple[Mode, ...], Mode]:
    """(pruned modes, default mode) of a collective; the default runs beside compute."""
    default_b = cost.default_sm_budget(node)
    stretch = float(cost.comm_overlap_stretch())
    if not (math.isfinite(stretch) and stretch >= 1):
        raise ScheduleError(f"comm_overlap_stretch={stretch!r} must be a finite number >= 1")
    modes = []
    for b in cost.comm_sm_budgets(node):
        if b >= sm_count:
            raise ScheduleError(f"node {node.name!r}: SM budget {b} leaves no SMs (sm_count={sm_count})")
        us = mode_duration_us(node, cost, b, stretch=stretch)
        modes.append(Mode(b, us, to_ticks(us)))
        if stretch > 1:
            us = mode_duration_us(node, cost, b, alone=True)
            modes.append(Mode(b, us, to_ticks(us), alone=True))
    default = next((m for m in modes if m.sm == default_b and not m.alone), None)
    if default is None:
        raise ScheduleError(f"node {node.name!r}: default SM budget {default_b} is not among "
                            f"the allowed budgets {[m.sm for m in modes]}")
    return _prune(modes, default), default


def _compute_modes(node: Node, cost: CostModel, sm_count: int, reserves: tuple[int, ...]) -> tuple[tuple[Mode, ...], Mode]:
    """(pruned modes, full-SM mode) of a compute node; SPLIT (a view) and free nodes take no
    time and hold no SMs."""
    if mode_duration_us(node, cost, 0) == 0.0:     # SPLIT: node_time_us prices a view at 0
        zero = Mode(0, 0.0, 0)
        return (zero,), zero
    modes = []
    for b in reserves:
        us = mode_duration_us(node, cost, b)
        modes.append(Mode(sm_count - b, us, to_ticks(us)))
    return _prune(modes, modes[0]), modes[0]


def _useful_reserves(allowed: tuple[int, ...], comm_budgets: dict[str, set[int]]) -> tuple[int, ...]:
    """SMs worth leaving to collectives: the least allowed reserve covering each combination
    of budgets the comm streams can hold at once (one collective per stream). Other reserves
    are dominated: they slow compute without letting any more collectives run beside it."""
    combos = {0}
    for budgets in comm_budgets.values():
        combos |= {c + b for c in combos for b in budgets}
    out = {0}
    for need in combos:
        fit = [b for b in allowed if b >= need]
        if fit:
            out.add(min(fit))
    return tuple(sorted(out))


def build_problem(graph: Graph, cost: CostModel, *, comm_streams: Sequence[str] = DEFAULT_COMM_STREAMS,
                  memory_budget_bytes: int | None = None) -> Problem:
    """Extract tasks (with their modes), dependencies and memory intervals from ``graph``."""
    streams = _check_streams(comm_streams)
    if memory_budget_bytes is not None and (isinstance(memory_budget_bytes, bool)
                                            or not isinstance(memory_budget_bytes, int)
                                            or memory_budget_bytes <= 0):
        raise ScheduleError(f"memory_budget_bytes={memory_budget_bytes!r} must be a positive int or None")
    hw = cost.hw
    sm_count = int(cost.sm_count())
    allowed = tuple(sorted({0, *hw.comm_sm_budgets}))
    if allowed[-1] >= sm_count:
        raise ScheduleError(f"SM budgets {list(allowed)} leave no SMs for compute (sm_count={sm_count})")

    stream = {n.name: stream_of(n, streams, hw) for n in graph.nodes}
    if DP_STREAM in stream.values():
        streams = (*streams, DP_STREAM)
    comm = {n.name: _comm_modes(n, cost, sm_count) for n in graph.nodes if n.is_comm}
    held: dict[str, set[int]] = {}
    for name, (modes, _) in comm.items():
        held.setdefault(stream[name], set()).update(m.sm for m in modes)
    reserves = _useful_reserves(allowed, held)

    index = {n.name: i for i, n in enumerate(graph.nodes)}
    producer = {v: index[n.name] for v, n in graph.producer.items()}
    merged = micro_batch_count(graph) > 1
    extra = barrier_preds(graph) if merged else {}
    anchors = {r: {index[a] for a in after} for r, after in remat_anchors(graph).items()}
    tasks = []
    for i, node in enumerate(graph.nodes):
        modes, default = comm[node.name] if node.is_comm else _compute_modes(node, cost, sm_count, reserves)
        preds = tuple(sorted({producer[v] for v in node.inputs if v in producer} | set(extra.get(i, ()))
                             | anchors.get(node.name, set())))
        side = 0 if merged or node.phase is Phase.FORWARD else 1
        if merged and node.phase is Phase.FORWARD:
            late = [p for p in preds if graph.nodes[p].phase is not Phase.FORWARD]
            if late:
                raise ScheduleError(f"forward node {node.name!r} reads an output of {graph.nodes[late[0]].phase.value} "
                                    f"node {graph.nodes[late[0]].name!r}, which the barrier runs after the forward")
        tasks.append(dict(index=i, name=node.name, node=node, kind="comm" if node.is_comm else "compute",
                          stream=stream[node.name], side=side, modes=modes,
                          default_mode=modes.index(default), preds=preds))
    succs: list[list[int]] = [[] for _ in tasks]
    for t in tasks:
        for p in t["preds"]:
            succs[p].append(t["index"])
            if tasks[p]["side"] > t["side"]:
                raise ScheduleError(f"forward node {t['name']!r} reads an output of "
                                    f"{graph.nodes[p].phase.value} node {tasks[p]['name']!r}, "
                                    f"which the barrier runs after every forward node")
    built = tuple(Task(**t, succs=tuple(succs[t["index"]])) for t in tasks)
    return Problem(graph=graph, cost=cost, sm_count=sm_count, compute_budgets=reserves,
                   streams=(COMPUTE, *streams), tasks=built, mem_values=_mem_values(graph, index),
                   memory_budget_bytes=memory_budget_bytes)


def barrier_preds(graph: Graph) -> dict[int, tuple[int, ...]]:
    """The per-micro-batch barrier of a merged graph as precedence edges (node index -> the
    forward node indices it must follow besides its producers): micro-batch j's forward sinks
    (forward nodes of j that no forward node of j reads) to its backward sources (backward or
    recompute nodes of j that read no backward or recompute node of j). By transitivity every
    backward node of j then follows every forward node of j. Step-level backward nodes (no
    ``mb``) that read no backward node follow every micro-batch's forward sinks."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    mb = [micro_batch_of(n) for n in graph.nodes]
    fwd = [n.phase is Phase.FORWARD for n in graph.nodes]
    preds = [{index[p.name] for p in graph.predecessors(n)} for n in graph.nodes]
    reads_fwd_of_own = set()
    for i, ps in enumerate(preds):
        for p in ps:
            if fwd[i] and fwd[p] and mb[p] == mb[i]:
                reads_fwd_of_own.add(p)
    sinks: dict[int | None, list[int]] = {}
    for i in range(len(graph.nodes)):
        if fwd[i] and i not in reads_fwd_of_own:
            sinks.setdefault(mb[i], []).append(i)
    everything = tuple(sorted(i for js in sinks.values() for i in js))
    out = {}
    for i in range(len(graph.nodes)):
        if fwd[i] or any(not fwd[p] and mb[p] == mb[i] for p in preds[i]):
            continue
        if mb[i] is None:
            if any(not fwd[p] for p in preds[i]):
                continue
            out[i] = everything
        else:
            out[i] = tuple(sinks.get(mb[i], ()))
    return out

REMAT_LOOKAHEAD = 1
"""Layers ahead a layer's rebuilds may run (``remat_anchors``): layer i's rebuilds start once
layer i+1's backward has begun, so at most about two layers' rebuilt values are live. 0 (not
before layer i's own backward) held mixtral-8x7b's 32-layer h800 peak at 4.98 GiB instead of
5.16, but cost 1.8% makespan: the tiled 2-layer warm start (moegraph.schedules.periodic) then
cannot fill the idle compute under a period's first collective with the lower layer's rebuilds
(docs/passes.md, benchmarks/RESULTS.md)."""


def remat_anchors(graph: Graph) -> dict[str, tuple[str, ...]]:
    """Recompute node -> the nodes it starts after besides its producers. In a stack of layers
    (moegraph.layers), layer i's recompute nodes start after the producers of the gradient
    that begins layer i+REMAT_LOOKAHEAD's backward (that layer's incoming gradient, made by
    the layer above it).

    A rebuilt value exists to be held briefly (moegraph.passes.sar), but its inputs are held
    values, available from the forward on, so with data edges alone a makespan-minded
    scheduler may rebuild every layer's values at the barrier and hold them as long as the
    originals: across L layers all rebuilt values are then live at once and remat saves
    little (the greedy list schedule of 32 mixtral-8x7b layers: 12% instead of 54%). With
    the anchors, rebuilds run a bounded distance ahead of their use, beside the collectives
    that start a layer's backward (the paper's Fig 8b rebuilds fc2_in under the all-gather of
    dffn_out). A one-layer graph, and the top layers of a stack, have no anchors: what would
    start them is the seed gradient, a graph input the barrier already orders. No cycle: an
    anchor belongs to a higher layer's backward, which reads nothing of layer i's. A memory
    rule, not a data one: the verifier does not require it, and every schedule obeying it is
    valid.
    """
    producer = graph.producer
    # (micro-batch, layer) -> producers of the gradients that start its backward: in a merged
    # graph (moegraph.microbatch) a micro-batch's rebuilds wait for its own backward only
    entry: dict[tuple[int | None, int], set[str]] = {}
    for node in graph.nodes:
        if node.phase is Phase.BACKWARD and node.layer is not None:
            entry.setdefault((micro_batch_of(node), node.layer), set()).update(
                producer[v].name for v in node.inputs
                if v in producer and graph.value[v].kind is ValueKind.GRAD and producer[v].layer != node.layer)
    out = {}
    for n in graph.nodes:
        if n.phase is Phase.RECOMPUTE and n.layer is not None:
            after = entry.get((micro_batch_of(n), n.layer + REMAT_LOOKAHEAD))
            if after:
                out[n.name] = tuple(sorted(after))
    return out


def _mem_values(graph: Graph, index: dict[str, int]) -> tuple[MemValue, ...]:
    """Live intervals of counted values. A view keeps its base alive: consumers of the view
    (and outputs that are views) extend the base's interval."""
    ends: dict[str, set[int]] = {}
    output_bases = {graph.base_of(o) for o in graph.outputs}
    for node in graph.nodes:
        for v in node.inputs:
            ends.setdefault(graph.base_of(v), set()).add(index[node.name])
    graph_inputs = set(graph.inputs)
    seed_start = "zero" if micro_batch_count(graph) > 1 else "barrier"
    out = []
    for v in graph.values:
        if v.storage_bytes <= 0 or v.kind in _EXCLUDED_KINDS:
            continue
        prod = graph.producer.get(v.name)
        if prod is not None:
            start, p = "producer", index[prod.name]
        elif v.name in graph_inputs:
            start, p = (seed_start if v.kind is ValueKind.GRAD else "zero"), None
        else:
            continue  # declared but never defined: verify() rejects graphs that use it
        e = ends.get(v.name, set())
        if not e and p is not None:
            e = {p}
        out.append(MemValue(v.name, v.storage_bytes, start, p, tuple(sorted(e)), v.name in output_bases))
    return tuple(out)


# --- symmetry of identical chunks -------------------------------------------------------------

def chunk_symmetry(problem: Problem) -> tuple[tuple[int, ...], ...] | None:
    """Tasks of interchangeable chunks, aligned: ``result[c][j]`` plays in chunk c the part
    ``result[0][j]`` plays in chunk 0. None unless every swap of chunk 0 with chunk c is an
    exact automorphism of the Problem (dependencies, modes, streams, memory values).

    Chunks are read from node attr ``chunk`` (int). Tasks are matched by colour refinement
    (structure without the chunk id); the match is then checked exactly, so a false match
    only means no symmetry is used.
    """
    tasks = problem.tasks
    chunk_of = {t.index: t.node.attr("chunk", None) for t in tasks}
    ids = sorted({c for c in chunk_of.values() if c is not None}, key=repr)
    if len(ids) < 2 or not all(isinstance(c, int) and not isinstance(c, bool) for c in ids):
        return None
    members = {c: [i for i in range(len(tasks)) if chunk_of[i] == c] for c in ids}
    colour = _refined_colours(problem)
    # Tasks of one chunk match tasks of another by colour, then by order among equal colours
    # (twins inside a chunk, such as fc1/fc3, are interchangeable too); checked exactly below.
    aligned = []
    for c in ids:
        by_colour: dict[int, list[int]] = {}
        for i in members[c]:
            by_colour.setdefault(colour[i], []).append(i)
        aligned.append(by_colour)
    shape = {k: len(v) for k, v in aligned[0].items()}
    if any({k: len(v) for k, v in a.items()} != shape for a in aligned):
        return None
    keys = sorted(aligned[0], key=lambda k: aligned[0][k][0])
    groups = tuple(tuple(i for k in keys for i in a[k]) for a in aligned)
    for c in range(1, len(groups)):
        perm = list(range(len(tasks)))
        for a, b in zip(groups[0], groups[c]):
            perm[a], perm[b] = b, a
        if not _is_automorphism(problem, perm):
            return None
    return groups


def _task_label(t: Task) -> tuple:
    n = t.node
    return (t.kind, t.stream, t.side, t.modes, t.default_mode, n.op.value, n.phase.value, n.role.value,
            n.attr("chunk", None) is None)


def _refined_colours(problem: Problem) -> list[int]:
    tasks = problem.tasks
    mem_in: list[list[tuple]] = [[] for _ in tasks]   # memory values a task produces / ends
    for v in problem.mem_values:
        if v.producer is not None:
            mem_in[v.producer].append(("prod", v.nbytes, v.start, v.until_makespan, len(v.ends)))
        for i in v.ends:
            mem_in[i].append(("end", v.nbytes, v.start, v.until_makespan))
    labels = {}
    colour = [labels.setdefault((_task_label(t), tuple(sorted(mem_in[t.index]))), len(labels)) for t in tasks]
    for _ in range(len(tasks)):
        table: dict[tuple, int] = {}
        new = [table.setdefault((colour[t.index], tuple(sorted(colour[p] for p in t.preds)),
                                 tuple(sorted(colour[s] for s in t.succs))), len(table)) for t in tasks]
        if len(table) == len(set(colour)):
            break
        colour = new
    return colour


def _is_automorphism(problem: Problem, perm: list[int]) -> bool:
    tasks = problem.tasks
    for t in tasks:
        u = tasks[perm[t.index]]
        if _task_label(t) != _task_label(u):
            return False
        if sorted(perm[p] for p in t.preds) != sorted(u.preds):
            return False
    image = {}
    for v in problem.mem_values:
        key = (v.nbytes, v.start, None if v.producer is None else perm[v.producer],
               tuple(sorted(perm[i] for i in v.ends)), v.until_makespan)
        image[key] = image.get(key, 0) + 1
    for v in problem.mem_values:
        key = (v.nbytes, v.start, v.producer, v.ends, v.until_makespan)
        image[key] = image.get(key, 0) - 1
    return all(c == 0 for c in image.values())
