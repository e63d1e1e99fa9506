"""ExecutionPlan: what each rank runs, on which stream, with which SM budget, in which order.

A plan is the runtime's view of a schedule: one entry per graph node, in *issue order* (the
order the host thread issues kernels and collectives). Every rank issues the same plan, so
collectives are called in the same order everywhere and cannot deadlock; ``hash`` covers the
graph and the entries so ranks can check they agree before the first step.

Sources:
    ``sequential(graph)``        graph order, one node at a time (Megatron-LM without overlap);
    ``asap(graph, cost)``        a list schedule on the cost model that issues every collective
                                 as soon as its inputs exist and fills the wait with independent
                                 compute (earliest predicted start first; the runtime's own
                                 overlapped order, independent of ``schedules``);
    ``from_schedule(graph, s)``  a ``schedules`` Schedule: entries sorted by predicted start.

Issue order and streams: on GPU each stream is a CUDA stream, so issuing in start order lets a
kernel and a collective run together. On CPU the host thread runs compute itself and gloo runs
collectives on its own threads, so overlap happens between an issued collective and the compute
issued after it.

Forward entries come first, then backward and recompute entries (the barrier: backward runs
when autograd calls it).

Alone collectives: an entry with ``alone`` set is a collective the schedule runs with no compute
beside it (on hardware where overlap stretches collectives, hw.comm_overlap_stretch > 1, the
scheduler may decide that overlapping does not pay). The executor fences it: it starts after the
compute issued before it, and the compute issued after it waits for it. Sequential plans mark
every collective alone (one node at a time).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable

from moegraph.ir import Graph, Node, OpKind, Phase, graph_digest
from moegraph.runtime import PlanError

COMPUTE = "compute"
COMM = "comm"
LOCAL_METHODS = ("sequential", "asap")


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
        """(forward entries, backward + recompute entries), each in issue order."""
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
    def sequential(cls, graph: Graph, cost: Any = None) -> "ExecutionPlan":
        """Graph order, one node at a time; predicted times from ``cost`` when given."""
        return _list_plan(graph, cost, overlap=False, method="sequential")

    @classmethod
    def asap(cls, graph: Graph, cost: Any) -> "ExecutionPlan":
        """Collectives issued as early as possible, compute filling their wait (see module doc)."""
        if cost is None:
            raise PlanError("the 'asap' plan needs a cost model to predict when collectives finish")
        return _list_plan(graph, cost, overlap=True, method="asap")

    @classmethod
    def from_schedule(cls, graph: Graph, schedule: Any, method: str | None = None) -> "ExecutionPlan":
        """Adapt a ``schedules`` Schedule (per-node name, stream, start_us, end_us, sm_budget).

        Issue order is predicted start, ties broken by graph order (a topological order, so a
        zero-length producer still comes before its consumer). Where the schedule's hardware
        stretches overlapped collectives, those no compute overlaps are marked ``alone``.
        """
        rows = [_row(r) for r in _schedule_rows(schedule)]
        index = {n.name: i for i, n in enumerate(graph.nodes)}
        unknown = [r["name"] for r in rows if r["name"] not in index]
        if unknown:
            raise PlanError(f"schedule names nodes the graph does not have: {unknown[:5]}")
        rows.sort(key=lambda r: (graph.node[r["name"]].phase is not Phase.FORWARD, r["start_us"], index[r["name"]]))
        alone = _alone_rows(graph, rows) if _stretch_of(schedule) > 1 else set()
        entries = tuple(PlanEntry(r["name"], r["stream"], int(r["sm_budget"] or 0), float(r["start_us"]),
                                  float(r["end_us"]), r["name"] in alone) for r in rows)
        plan = cls(method or str(getattr(schedule, "method", "schedule")), entries, graph_digest(graph),
                   source_hash=getattr(schedule, "hash", None))
        return check_plan(graph, plan)

    def with_entries(self, entries: Iterable[PlanEntry], method: str | None = None) -> "ExecutionPlan":
        return dataclasses.replace(self, entries=tuple(entries), method=method or self.method)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "hash": self.hash, "graph_digest": self.graph_digest,
                "source_hash": self.source_hash, "entries": [dataclasses.asdict(e) for e in self.entries]}


def check_plan(graph: Graph, plan: ExecutionPlan) -> ExecutionPlan:
    """Raise PlanError naming the first problem: a node missing or repeated, a forward node after
    a backward one, a node issued before a producer of its inputs, a stream of the wrong kind."""
    names = [e.name for e in plan.entries]
    missing = [n.name for n in graph.nodes if n.name not in set(names)]
    if missing:
        raise PlanError(f"plan {plan.method!r} misses graph nodes {missing[:5]}")
    if len(set(names)) != len(names):
        dup = next(x for x in names if names.count(x) > 1)
        raise PlanError(f"plan {plan.method!r} lists node {dup!r} twice")
    produced = set(graph.inputs)
    seen_backward = None
    for e in plan.entries:
        node = graph.node.get(e.name)
        if node is None:
            raise PlanError(f"plan {plan.method!r} names unknown node {e.name!r}")
        if node.phase is Phase.FORWARD and seen_backward:
            raise PlanError(f"plan {plan.method!r}: forward node {e.name!r} comes after {seen_backward!r} "
                            f"({graph.node[seen_backward].phase.value})")
        if node.phase is not Phase.FORWARD:
            seen_backward = seen_backward or e.name
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


# -- local list schedules --------------------------------------------------------------------

def _stream(node: Node) -> str:
    return COMM if node.is_comm else COMPUTE


def _duration_us(node: Node, cost: Any, budget: int) -> float:
    if node.op is OpKind.SPLIT:
        return 0.0
    return float(cost.node_time_us(node, budget) if node.is_comm else cost.node_time_us(node))


def _list_plan(graph: Graph, cost: Any, *, overlap: bool, method: str) -> ExecutionPlan:
    """Simulate two streams (compute, comm) on the cost model, side by side of the barrier.

    overlap=False: one node at a time in graph order. overlap=True: repeatedly place the node
    that can start earliest (ties: collectives first, then graph order), so a collective is
    issued as soon as its inputs exist and independent compute runs while it is in flight.
    """
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    budget = {n.name: (cost.default_sm_budget(n) if (cost is not None and n.is_comm) else 0) for n in graph.nodes}
    end: dict[str, float] = {}
    entries: list[PlanEntry] = []
    side_start = 0.0
    for forward in (True, False):
        todo = [n for n in graph.nodes if (n.phase is Phase.FORWARD) == forward]
        free = {COMPUTE: side_start, COMM: side_start}
        preds = {n.name: [p.name for p in graph.predecessors(n)] for n in todo}
        last = side_start
        while todo:
            if overlap:
                ready = [n for n in todo if all(p in end for p in preds[n.name])]
                est = {n.name: max([free[_stream(n)], *(end[p] for p in preds[n.name])]) for n in ready}
                node = min(ready, key=lambda n: (est[n.name], not n.is_comm, index[n.name]))
                start = est[node.name]
            else:
                node = todo[0]
                start = max([last, *(end[p] for p in preds[node.name])])
            todo.remove(node)
            dur = _duration_us(node, cost, budget[node.name]) if cost is not None else 0.0
            if overlap and node.is_comm and cost is not None:   # asap issues collectives to run beside compute
                dur *= getattr(cost, "comm_overlap_stretch", lambda: 1.0)()
            end[node.name] = start + dur
            free[_stream(node)] = end[node.name]
            last = end[node.name]
            entries.append(PlanEntry(node.name, _stream(node), budget[node.name],
                                     start if cost is not None else None, end[node.name] if cost is not None else None,
                                     alone=node.is_comm and not overlap))
        side_start = max([side_start, *(end[e.name] for e in entries)])
    if overlap:
        entries.sort(key=lambda e: (graph.node[e.name].phase is not Phase.FORWARD, e.start_us, index[e.name]))
    return check_plan(graph, ExecutionPlan(method, tuple(entries), graph_digest(graph)))


# -- schedule adapter --------------------------------------------------------------------------

def _schedule_rows(schedule: Any) -> list[Any]:
    for attr in ("entries", "nodes"):
        rows = getattr(schedule, attr, None)
        if rows is not None:
            return list(rows.values()) if isinstance(rows, dict) else list(rows)
    if isinstance(schedule, dict):
        return list(schedule.get("nodes") or schedule.get("entries") or [])
    raise PlanError(f"cannot read per-node entries from a {type(schedule).__name__}: "
                    "expected .entries or .nodes (name, stream, start_us, end_us, sm_budget)")


def _stretch_of(schedule: Any) -> float:
    """The schedule's hardware comm_overlap_stretch (1 when it records none)."""
    hw = schedule.get("hardware") if isinstance(schedule, dict) else getattr(schedule, "hardware", None)
    value = hw.get("comm_overlap_stretch", 1.0) if isinstance(hw, dict) else 1.0
    return float(value or 1.0)


def _alone_rows(graph: Graph, rows: list[dict[str, Any]]) -> set[str]:
    """Collectives during which no compute node that takes time runs (open intervals). The same
    rule as moegraph.schedules.problem.overlaps_compute, restated on plain rows: plans come from any
    object with per-node times, and the runtime must work without the schedules package."""
    busy = [(r["start_us"], r["end_us"]) for r in rows
            if not graph.node[r["name"]].is_comm and r["end_us"] > r["start_us"]]
    return {r["name"] for r in rows if graph.node[r["name"]].is_comm
            and not any(cs < r["end_us"] and r["start_us"] < ce for cs, ce in busy)}


def _row(r: Any) -> dict[str, Any]:
    get = r.get if isinstance(r, dict) else (lambda k, d=None: getattr(r, k, d))
    row = {k: get(k) for k in ("name", "stream", "start_us", "end_us", "sm_budget")}
    if row["name"] is None or row["stream"] is None or row["start_us"] is None:
        raise PlanError(f"schedule entry {r!r} lacks a name, stream or start_us")
    if row["end_us"] is None:
        row["end_us"] = row["start_us"]
    return row
