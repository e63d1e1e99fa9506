"""ExecutionPlan: what each rank runs, on which stream, with which SM budget, in which order.

A plan is the runtime's view of a schedule: one entry per graph node, in *issue order* (the
order the host thread issues kernels and collectives). Every rank issues the same plan, so
collectives are called in the same order everywhere and cannot deadlock; ``hash`` covers the
graph and the entries so ranks can check they agree before the first step.

Sources:
    ``sequential(graph)``        graph order, one node at a time, no predicted times (a plan
                                 that needs no cost model; ``make_plan(..., "sequential")``
                                 gives the schedules stage's sequential baseline, with times);
    ``from_schedule(graph, s)``  a ``moegraph.schedules`` Schedule (``compile``, ``tune``, a
                                 schedule file): entries sorted by predicted start.
Every scheduling method (cpsat and the baselines sequential, greedy, megascale) lives in
``moegraph.schedules``; the runtime only adapts its result.

Issue order and streams: on GPU each stream is a CUDA stream, so issuing in start order lets a
kernel and a collective run together. On CPU the host thread runs compute itself and gloo runs
collectives on its own threads, so overlap happens between an issued collective and the compute
issued after it.

Forward entries come first, then backward and recompute entries (the barrier: backward runs
when autograd calls it). A merged step graph of M micro-batches (``moegraph.microbatch``) has
the barrier per micro-batch: micro-batch j's forward entries precede its backward entries, and
micro-batch j+1's forward may come between them (run whole by ``Executor.step``).

Alone collectives: an entry with ``alone`` set is a collective the schedule runs with no compute
beside it (``moegraph.schedules.solution.overlaps_compute`` is false for it: on hardware where
overlap stretches collectives, the scheduler may decide that overlapping does not pay). The
executor fences it: it starts after the compute issued before it, and the compute issued after
it waits for it, so the run keeps the schedule's timeline. Sequential plans mark every
collective alone (one node at a time).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from moegraph.cost import FusedGroup, variant
from moegraph.ir import Graph, Phase, graph_digest
from moegraph.microbatch import micro_batch_count, micro_batch_of
from moegraph.runtime import PlanError

if TYPE_CHECKING:
    from moegraph.schedules.schedule_file import Schedule

COMPUTE = "compute"
COMM = "comm"


@dataclass(frozen=True)
class PlanEntry:
    """One node: its stream, the SMs its collective may use, its predicted times (if known), and
    whether it is a collective that runs with no compute beside it (``alone``)."""

    name: str
    stream: str
    sm_budget: int = 0
    start_us: float | None = None
    end_us: float | None = None
    alone: bool = False


@dataclass(frozen=True)
class ExecutionPlan:
    method: str
    entries: tuple[PlanEntry, ...]
    graph_digest: str
    source_hash: str | None = None      # the Schedule's own content hash, when built from one
    # the schedule's predicted peak of live activation bytes (the cost model's accounting,
    # schedules.verify.memory_events: parameters and their gradients not counted) and the memory
    # budget it was made under; None: not built from a schedule (no times), or no budget
    peak_memory_bytes: int | None = None
    memory_budget_bytes: int | None = None

    @functools.cached_property
    def hash(self) -> str:
        """sha256 of the graph digest and (name, stream, sm_budget, alone) of every entry, in order."""
        body = json.dumps({"graph": self.graph_digest,
                           "entries": [[e.name, e.stream, e.sm_budget, e.alone] for e in self.entries]})
        return hashlib.sha256(body.encode()).hexdigest()

    @property
    def streams(self) -> tuple[str, ...]:
        """Compute first, then the communication streams in order of first use."""
        seen = dict.fromkeys([COMPUTE] + [e.stream for e in self.entries])
        return tuple(seen)

    def queue(self, stream: str) -> tuple[PlanEntry, ...]:
        """The entries one stream runs, in order."""
        return tuple(e for e in self.entries if e.stream == stream)

    @property
    def entry(self) -> dict[str, PlanEntry]:
        return {e.name: e for e in self.entries}

    def split(self, graph: Graph) -> tuple[tuple[PlanEntry, ...], tuple[PlanEntry, ...]]:
        """(forward entries, backward + recompute entries), each in issue order. A merged step
        graph has no such split (its phases interleave): PlanError."""
        if micro_batch_count(graph) > 1:
            raise PlanError(f"graph {graph.name!r} holds {micro_batch_count(graph)} micro-batches whose forward and "
                            "backward interleave: its plan runs whole (Executor.step), not as two phases")
        fwd = tuple(e for e in self.entries if graph.node[e.name].phase is Phase.FORWARD)
        bwd = tuple(e for e in self.entries if graph.node[e.name].phase is not Phase.FORWARD)
        return fwd, bwd

    @property
    def predicted_makespan_us(self) -> float | None:
        ends = [e.end_us for e in self.entries]
        if not ends or any(t is None for t in ends):
            return None
        return max(ends) - min(e.start_us for e in self.entries)

    def comm_keys(self, graph: Graph) -> tuple[tuple[str, int], ...]:
        """Distinct (stream, sm_budget) of the collectives, sorted: one process group each."""
        return tuple(sorted({(e.stream, e.sm_budget) for e in self.entries if graph.node[e.name].is_comm}))

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def sequential(cls, graph: Graph) -> "ExecutionPlan":
        """Graph order (forward first; in a merged step graph micro-batch by micro-batch, then the
        step's gradient synchronisation), one node at a time, every collective alone; no times."""
        index = {n.name: i for i, n in enumerate(graph.nodes)}
        last = micro_batch_count(graph)         # step-level nodes (mb None) after every micro-batch
        order = sorted(graph.nodes, key=lambda n: (_mb_key(n, last), n.phase is not Phase.FORWARD, index[n.name]))
        entries = tuple(PlanEntry(n.name, COMM if n.is_comm else COMPUTE, alone=n.is_comm) for n in order)
        return check_plan(graph, cls("sequential", entries, graph_digest(graph)))

    @classmethod
    def from_schedule(cls, graph: Graph, schedule: "Schedule", method: str | None = None) -> "ExecutionPlan":
        """Adapt a ``moegraph.schedules`` Schedule of ``graph``.

        Issue order is predicted start, ties broken by graph order (a topological order, so a
        zero-length producer still comes before its consumer). Collectives that no compute
        overlaps are marked ``alone`` (``overlaps_compute`` on the schedule's own timeline).
        """
        from moegraph.schedules.gantt import peak_bytes     # recorded, or recomputed (run --trace files)
        from moegraph.schedules.schedule_file import Schedule
        if not isinstance(schedule, Schedule):
            raise PlanError(f"cannot build a plan from a {type(schedule).__name__}: expected a "
                            "moegraph.schedules Schedule (compile_graph(...).schedule, or Schedule.load(path))")
        index = {n.name: i for i, n in enumerate(graph.nodes)}
        names = [n.name for n in schedule.nodes]
        unknown = [x for x in names if x not in index]
        if unknown:
            raise PlanError(f"schedule names nodes the graph does not have: {unknown[:5]}")
        for r in schedule.nodes:
            for what in ("start_us", "end_us"):
                t = getattr(r, what)
                if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
                    raise PlanError(f"schedule node {r.name!r} has {what}={t!r}: not a finite number")
            if r.end_us < r.start_us:
                raise PlanError(f"schedule node {r.name!r} ends at {r.end_us} us before it starts at {r.start_us} us")
        if micro_batch_count(graph) > 1:
            # the schedule keeps each micro-batch's barrier itself (moegraph.schedules.problem); a
            # global forward-first order would undo the interleaving it chose. check_plan verifies
            rows = sorted(schedule.nodes, key=lambda r: (r.start_us, index[r.name]))
        else:
            rows = sorted(schedule.nodes, key=lambda r: (graph.node[r.name].phase is not Phase.FORWARD, r.start_us,
                                                          index[r.name]))
        beside = _beside_compute(graph, schedule)
        entries = tuple(PlanEntry(r.name, r.stream, int(r.sm_budget), float(r.start_us),
                                  float(r.end_us), r.kind == "comm" and r.name not in beside) for r in rows)
        plan = cls(method or str(schedule.summary.get("method", "schedule")), entries, graph_digest(graph),
                   source_hash=schedule.hash or None, peak_memory_bytes=peak_bytes(schedule),
                   memory_budget_bytes=schedule.memory_budget_bytes)
        return check_plan(graph, plan)

    def with_entries(self, entries: Iterable[PlanEntry], method: str | None = None) -> "ExecutionPlan":
        """Other entries: the schedule's peak and budget no longer describe them (None)."""
        return dataclasses.replace(self, entries=tuple(entries), method=method or self.method,
                                   peak_memory_bytes=None, memory_budget_bytes=None)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "hash": self.hash, "graph_digest": self.graph_digest,
                "source_hash": self.source_hash, "peak_memory_bytes": self.peak_memory_bytes,
                "memory_budget_bytes": self.memory_budget_bytes,
                "entries": [dataclasses.asdict(e) for e in self.entries]}


FUSED_AS_MEMBERS = ("fused groups run as their member kernels (the runtime has no tile-level fused kernels): "
                    "values and gradients are the same, but the predicted times assume fused kernels")
"""How the runtime executes a fused variant (passes/fuse.py), said wherever such a run is reported."""


def fused_group_count(graph: Graph) -> int:
    """Fused kernels the schedule predicts (their anchors); the runtime runs each as its members,
    one kernel per node in the plan's order: the same decomposition the pass marked (nodes, values
    and edges are unchanged by fusing), on a timeline the fused prediction does not describe."""
    return sum(1 for n in graph.nodes if variant(n) == "fused" and FusedGroup.is_anchor(n))


def check_plan(graph: Graph, plan: ExecutionPlan) -> ExecutionPlan:
    """Raise PlanError naming the first problem: a node missing or repeated, a forward node after
    a backward one (of the same micro-batch, in a merged step graph), a node issued before a
    producer of its inputs, a stream of the wrong kind."""
    names = [e.name for e in plan.entries]
    listed = set(names)                          # once: a model step graph has 10^4 nodes
    missing = [n.name for n in graph.nodes if n.name not in listed]
    if missing:
        raise PlanError(f"plan {plan.method!r} misses graph nodes {missing[:5]}")
    if len(listed) != len(names):
        seen: set[str] = set()
        dup = next(x for x in names if x in seen or seen.add(x))
        raise PlanError(f"plan {plan.method!r} lists node {dup!r} twice")
    produced = set(graph.inputs)
    seen_backward: dict[int | None, str] = {}     # micro-batch (None: unmerged) -> its first backward node
    for e in plan.entries:
        node = graph.node.get(e.name)
        if node is None:
            raise PlanError(f"plan {plan.method!r} names unknown node {e.name!r}")
        mb = micro_batch_of(node)
        if node.phase is Phase.FORWARD and mb in seen_backward:
            raise PlanError(f"plan {plan.method!r}: forward node {e.name!r} comes after {seen_backward[mb]!r} "
                            f"({graph.node[seen_backward[mb]].phase.value})")
        if node.phase is not Phase.FORWARD:
            seen_backward.setdefault(mb, e.name)
        late = [i for i in node.inputs if i not in produced]
        if late:
            raise PlanError(f"plan {plan.method!r}: node {e.name!r} is issued before {late[0]!r} is produced "
                            f"(by {graph.producer[late[0]].name!r})")
        if node.is_comm == (e.stream == COMPUTE):
            kind = "collective" if node.is_comm else "compute node"
            raise PlanError(f"plan {plan.method!r}: {kind} {e.name!r} is on stream {e.stream!r}")
        if e.alone and not node.is_comm:
            raise PlanError(f"plan {plan.method!r}: compute node {e.name!r} is marked alone (collectives only)")
        if node.is_comm and e.sm_budget < 0:
            raise PlanError(f"plan {plan.method!r}: collective {e.name!r} has SM budget {e.sm_budget} < 0")
        produced.update(node.outputs)
    return plan


def _mb_key(node, last: int) -> int:
    """Sort key of a node's micro-batch: its index, ``last`` for step-level nodes."""
    j = micro_batch_of(node)
    return last if j is None else j


# -- schedule adapter --------------------------------------------------------------------------

def _beside_compute(graph: Graph, schedule: "Schedule") -> set[str]:
    """Names of the collectives some compute node overlaps, by the schedules stage's own rule
    (``overlaps_compute``) on the schedule's timeline rebuilt as a Problem and Solution."""
    from moegraph.cost import CostModel
    from moegraph.registry import Hardware
    from moegraph.schedules.problem import ScheduleError, build_problem
    from moegraph.schedules.solution import Solution, overlaps_compute
    try:
        problem = build_problem(graph, CostModel(Hardware(**schedule.hardware)), comm_streams=schedule.streams[1:])
    except (ScheduleError, TypeError, ValueError) as err:
        raise PlanError(f"cannot rebuild the schedule's problem: {err}") from err
    tick = problem.tick_us
    by_name = {n.name: n for n in schedule.nodes}
    missing = [t.name for t in problem.tasks if t.name not in by_name]
    if missing:
        raise PlanError(f"schedule misses graph nodes {missing[:5]}")
    start, mode = [], []
    for t in problem.tasks:
        row = by_name[t.name]
        ticks = round((row.end_us - row.start_us) / tick)
        # the mode this row ran in: its SMs (a compute node's SMs are its row's sm_budget), the
        # duration nearest the row's (alone and beside modes of one budget differ only there)
        sm = row.sm_budget
        fits = [k for k, m in enumerate(t.modes) if m.sm == sm] or list(range(len(t.modes)))
        start.append(round(row.start_us / tick))
        mode.append(min(fits, key=lambda k: abs(t.modes[k].ticks - ticks)))
    beside = overlaps_compute(problem, Solution("schedule", tuple(start), tuple(mode)))
    return {t.name for t in problem.tasks if t.kind == "comm" and beside[t.index]}
