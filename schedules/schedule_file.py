"""The schedule file: versioned, self-describing, byte-stable JSON.

A file holds everything ``moegraph.schedules.verify`` needs and nothing that varies between runs:

    {"format": "moegraph.schedule", "version": 1,
     "graph":    {name, strategy (Strategy.as_dict), dims, inputs, outputs, nodes, digest},
     "hardware": Hardware.to_dict(),
     "streams":  ["compute", "comm", ...],
     "memory_budget_bytes": int | null,
     "tick_us":  0.01,
     "values":   [{name, bytes (storage), kind, alias_of}],
     "nodes":    [{name, op, role, phase, kind: "compute"|"comm", inputs, outputs, flops,
                   mem_bytes, comm_bytes, group, attrs, module, block, forward_of,
                   stream, start_us, end_us, sm_budget}],
     "summary":  {method, strategy, makespan_us, lower_bound_us, barrier_us, exposed_comm_us,
                  baselines: {sequential, greedy, megascale}, peak_memory_bytes,
                  solver: {status, objective_bound_us}},
     "hash":     "sha256:<hex of the canonical JSON of everything else>"}

Files written by ``moegraph run --trace`` use the same format with a runtime summary
({method, plan_hash, strategy, makespan_us, exposed_comm_us, measured: bool, ...}, no
peak_memory_bytes or solver): ``Schedule.origin`` tells the three kinds apart.

graph.nodes names every node of the graph in its order, so ``verify`` names a node missing from
"nodes" (files written before it was recorded lack it; verify then names the value the missing
node would have produced). graph.digest is ``moegraph.ir.graph_digest`` of the scheduled graph (every node's op, costs and
attributes, every value): ``moegraph run --schedule`` lowers the graph again from the file's
settings and runs the file only if the digests agree. Files written before it was recorded
lack it; run refuses them (recompile).

The reader checks every field's JSON type (times finite, counts non-negative integers) and
names the first bad one; it does not check the hash or the semantics (``verify`` does).

sm_budget: SMs a collective holds (0 = copy engines); SMs a compute node runs on (0 for a
node that takes no time, such as a view). Canonical form: sorted keys, fixed separators,
ASCII, computed times rounded to ``DECIMALS`` places (they are multiples of the 10 ns tick,
so rounding only removes float noise). Solver wall time is NOT in the file (it differs
between runs); compile results and the CLI report it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from moegraph.atomic import write_atomic
from moegraph.canonical import canonical_json
from moegraph.edges import EDGES, is_edge
from moegraph.ir import LAYER_ATTR, Graph, graph_digest

__all__ = ["FORMAT", "VERSION", "DECIMALS", "ScheduleFormatError", "ScheduledValue", "ScheduledNode", "Schedule",
           "graph_header", "canonical_json", "round_us", "plain", "exposed_comm", "layer_exposed_comm", "dp_sync_exposure",
           "per_layer_summary", "layer_group", "group_label", "Origin"]

FORMAT = "moegraph.schedule"
VERSION = 1
DECIMALS = 6
Origin = Literal["compiled", "predicted", "measured"]


class ScheduleFormatError(ValueError):
    """A file that is not a moegraph schedule of a supported version, or misses fields."""


def round_us(x: float) -> float:
    """A time in microseconds as written to the file (-0.0 folded into 0.0)."""
    if not math.isfinite(x):
        raise ScheduleFormatError(f"time {x!r} is not finite")
    return round(float(x), DECIMALS) + 0.0


def plain(v: Any, where: str = "value") -> Any:
    """JSON types only: tuples become lists; anything else JSON cannot hold is an error."""
    if isinstance(v, (tuple, list)):
        return [plain(x, where) for x in v]
    if isinstance(v, dict):
        return {str(k): plain(x, where) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ScheduleFormatError(f"{where}: {v!r} cannot be written to JSON")
        return v
    raise ScheduleFormatError(f"{where}: {type(v).__name__} {v!r} cannot be written to JSON")


@dataclass(frozen=True)
class ScheduledValue:
    name: str
    bytes: int
    kind: str
    alias_of: str | None


@dataclass(frozen=True)
class ScheduledNode:
    name: str
    op: str
    role: str
    phase: str
    kind: str                   # "compute" | "comm"
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    flops: int
    mem_bytes: int
    comm_bytes: int
    group: int
    attrs: dict
    module: str
    block: str
    forward_of: str | None
    stream: str
    start_us: float
    end_us: float
    sm_budget: int

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


_NODE_FIELDS = tuple(f for f in ScheduledNode.__dataclass_fields__)
_VALUE_FIELDS = tuple(f for f in ScheduledValue.__dataclass_fields__)


@dataclass(frozen=True)
class Schedule:
    graph: dict
    hardware: dict
    streams: tuple[str, ...]
    memory_budget_bytes: int | None
    tick_us: float
    values: tuple[ScheduledValue, ...]
    nodes: tuple[ScheduledNode, ...]
    summary: dict
    hash: str = field(default="")

    # -- content and hash ---------------------------------------------------------------
    def content(self) -> dict:
        """The file's JSON object without the hash."""
        return {
            "format": FORMAT, "version": VERSION,
            "graph": plain(self.graph, "graph"),
            "hardware": plain(self.hardware, "hardware"),
            "streams": list(self.streams),
            "memory_budget_bytes": self.memory_budget_bytes,
            "tick_us": self.tick_us,
            "values": [plain(asdict(v), f"value {v.name!r}") for v in self.values],
            "nodes": [{**plain({k: getattr(n, k) for k in _NODE_FIELDS if k != "attrs"}, f"node {n.name!r}"),
                       "attrs": plain(n.attrs, f"node {n.name!r} attrs")} for n in self.nodes],
            "summary": plain(self.summary, "summary"),
        }

    def compute_hash(self) -> str:
        return "sha256:" + hashlib.sha256(canonical_json(self.content()).encode("ascii")).hexdigest()

    def with_hash(self) -> "Schedule":
        return replace(self, hash=self.compute_hash())

    # -- I/O ------------------------------------------------------------------------------
    def to_json(self) -> str:
        """Canonical text (one line per top-level list entry would not be canonical: the whole
        file is one canonical JSON document plus a trailing newline)."""
        return canonical_json({**self.content(), "hash": self.hash or self.compute_hash()}) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        """Parse a schedule file. The hash is read, not checked (moegraph.schedules.verify checks it)."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as err:
            raise ScheduleFormatError(f"not JSON: {err}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else None
            raise ScheduleFormatError(f"not a {FORMAT} file (format={got!r})")
        if d.get("version") != VERSION:
            raise ScheduleFormatError(f"schedule version {d.get('version')!r} is not supported "
                                      f"(this reader: {VERSION})")
        missing = [k for k in ("graph", "hardware", "streams", "memory_budget_bytes", "tick_us", "values", "nodes",
                               "summary", "hash") if k not in d]
        if missing:
            raise ScheduleFormatError(f"schedule file misses {', '.join(map(repr, missing))}")
        _check_fields(d)
        values = tuple(ScheduledValue(**{k: v[k] for k in _VALUE_FIELDS}) for v in d["values"])
        nodes = tuple(ScheduledNode(**{k: (tuple(n[k]) if k in ("inputs", "outputs") else n[k])
                                       for k in _NODE_FIELDS}) for n in d["nodes"])
        return cls(graph=d["graph"], hardware=d["hardware"], streams=tuple(d["streams"]),
                   memory_budget_bytes=d["memory_budget_bytes"], tick_us=d["tick_us"], values=values,
                   nodes=nodes, summary=d["summary"], hash=d["hash"])

    def save(self, path: str | Path) -> Path:
        """Write the file atomically (moegraph.atomic): a kill leaves the old file or this one."""
        return write_atomic(path, self.to_json(), encoding="ascii")

    @classmethod
    def load(cls, path: str | Path) -> "Schedule":
        return cls.from_json(Path(path).read_text(encoding="ascii"))

    # -- conveniences ---------------------------------------------------------------------
    @property
    def origin(self) -> Origin:
        """Who wrote the file: ``compiled`` (compile / tune: cost-model times), ``predicted``
        (``run --trace``: the plan's predicted times) or ``measured`` (``run --trace``: one
        measured step). The runtime marks its files with ``summary.measured``."""
        measured = self.summary.get("measured")
        if measured is None:
            return "compiled"
        return "measured" if measured else "predicted"

    @property
    def node(self) -> dict[str, ScheduledNode]:
        return {n.name: n for n in self.nodes}

    @property
    def makespan_us(self) -> float:
        return max((n.end_us for n in self.nodes), default=0.0)

def load_schedule(path: str | Path) -> Schedule:
    """The schedule file at ``path`` (written by compile, tune or run --trace): FileNotFoundError
    when there is none, ScheduleError (one line naming the file) when it is not a schedule file."""
    from moegraph.schedules.problem import ScheduleError
    if not Path(path).is_file():
        raise FileNotFoundError(f"no schedule file {str(path)!r}")
    try:
        return Schedule.load(path)
    except (ValueError, KeyError, TypeError) as err:
        raise ScheduleError(f"{path}: not a moegraph schedule file: {err}") from err


def graph_header(graph: Graph) -> dict:
    """The file's "graph" object for ``graph`` (module docstring), its node names and digest included."""
    return {"name": graph.name, "strategy": graph.strategy.as_dict(), "dims": asdict(graph.dims),
            "inputs": list(graph.inputs), "outputs": list(graph.outputs), "nodes": [n.name for n in graph.nodes],
            "digest": graph_digest(graph)}


def _kind(v: Any) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if isinstance(v, float) and math.isinf(v):
        return "infinite"
    return f"{type(v).__name__} {v!r}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


_NODE_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{k: (lambda v: isinstance(v, str), "a string")
       for k in ("name", "op", "role", "phase", "kind", "module", "block", "stream")},
    "inputs": (_is_str_list, "a list of value names"), "outputs": (_is_str_list, "a list of value names"),
    **{k: (lambda v: _is_int(v) and v >= 0, "a non-negative integer")
       for k in ("flops", "mem_bytes", "comm_bytes", "group", "sm_budget")},
    "attrs": (lambda v: isinstance(v, dict), "an object"),
    "forward_of": (lambda v: v is None or isinstance(v, str), "a node name or null"),
    "start_us": (lambda v: _is_time(v) and v >= 0, "a finite number >= 0"),
    "end_us": (lambda v: _is_time(v) and v >= 0, "a finite number >= 0"),
}
_VALUE_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "name": (lambda v: isinstance(v, str), "a string"),
    "bytes": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "kind": (lambda v: isinstance(v, str), "a string"),
    "alias_of": (lambda v: v is None or isinstance(v, str), "a value name or null"),
}
_SUMMARY_TIMES = ("makespan_us", "lower_bound_us", "barrier_us", "exposed_comm_us")


def _check_fields(d: dict) -> None:
    """Every field the readers (verify, gantt, the runtime) use has its JSON type and finite
    numbers, so a hand-edited or damaged file fails here with one message naming the field,
    never later inside a computation (NaN compares false with everything: a NaN time would
    pass every ordering check)."""
    for key, ok, want in (("graph", lambda v: isinstance(v, dict), "an object"),
                          ("hardware", lambda v: isinstance(v, dict), "an object"),
                          ("summary", lambda v: isinstance(v, dict), "an object"),
                          ("streams", lambda v: _is_str_list(v) and v, "a non-empty list of stream names"),
                          ("memory_budget_bytes", lambda v: v is None or (_is_int(v) and v > 0),
                           "a positive integer or null"),
                          ("tick_us", lambda v: _is_time(v) and v > 0, "a positive finite number"),
                          ("values", lambda v: isinstance(v, list), "a list"),
                          ("nodes", lambda v: isinstance(v, list), "a list"),
                          ("hash", lambda v: isinstance(v, str), "a string")):
        if not ok(d[key]):
            raise ScheduleFormatError(f"{key} is {_kind(d[key])}, not {want}")
    for key, what in (("inputs", "value"), ("outputs", "value"), ("nodes", "node")):
        if key in d["graph"] and not _is_str_list(d["graph"][key]):
            raise ScheduleFormatError(f"graph.{key} is {_kind(d['graph'][key])}, not a list of {what} names")
    if "digest" in d["graph"] and not isinstance(d["graph"]["digest"], str):
        raise ScheduleFormatError(f"graph.digest is {_kind(d['graph']['digest'])}, not a string")
    for what, entries, types in (("value", d["values"], _VALUE_TYPES), ("node", d["nodes"], _NODE_TYPES)):
        for i, e in enumerate(entries):
            if not isinstance(e, dict):
                raise ScheduleFormatError(f"{what} #{i} is {_kind(e)}, not an object")
            where = f"{what} {e['name']!r}" if isinstance(e.get("name"), str) else f"{what} #{i}"
            for k, (ok, want) in types.items():
                if k not in e:
                    raise ScheduleFormatError(f"{where} misses field {k!r}")
                if not ok(e[k]):
                    raise ScheduleFormatError(f"{where}: {k} is {_kind(e[k])}, not {want}")
    summary = d["summary"]
    for k in _SUMMARY_TIMES:
        if k in summary and not _is_time(summary[k]):
            raise ScheduleFormatError(f"summary.{k} is {_kind(summary[k])}, not a finite number")
    peak = summary.get("peak_memory_bytes")
    if peak is not None and not (_is_int(peak) and peak >= 0):
        raise ScheduleFormatError(f"summary.peak_memory_bytes is {_kind(peak)}, not a non-negative integer")
    if "measured" in summary and not isinstance(summary["measured"], bool):
        raise ScheduleFormatError(f"summary.measured is {_kind(summary['measured'])}, not true or false")


def merge_intervals(spans) -> list[list[float]]:
    """The union of (start, end) spans as sorted, disjoint [start, end] intervals."""
    merged: list[list[float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def exposed_comm(nodes: tuple[ScheduledNode, ...] | list[ScheduledNode]) -> list[tuple[float, float]]:
    """Intervals (us) where some collective runs and no compute node does: communication the
    schedule failed to hide."""
    union = merge_intervals
    comm = union((n.start_us, n.end_us) for n in nodes if n.kind == "comm" and n.end_us > n.start_us)
    comp = union((n.start_us, n.end_us) for n in nodes if n.kind == "compute" and n.end_us > n.start_us)
    out, j = [], 0
    for s, e in comm:
        cur = s
        while j < len(comp) and comp[j][1] <= cur:
            j += 1
        k = j
        while cur < e:
            if k < len(comp) and comp[k][0] < e:
                if comp[k][0] > cur:
                    out.append((cur, comp[k][0]))
                cur = max(cur, comp[k][1])
                k += 1
            else:
                out.append((cur, e))
                cur = e
    return out


def layer_exposed_comm(compute: list[ScheduledNode], mine: list[ScheduledNode]) -> list[tuple[float, float]]:
    """Intervals where one layer's collectives (in ``mine``) run and no compute of any layer
    (``compute``: every compute node of the schedule) does: that layer's exposed communication."""
    return exposed_comm([*compute, *(n for n in mine if n.kind == "comm")])


def dp_sync_exposure(nodes: tuple[ScheduledNode, ...] | list[ScheduledNode]) -> dict[str, float]:
    """Data-parallel gradient sync (collectives with attr dp=True, MegaScale-MoE A.1, compressed
    or not): ``dp_sync_us``, its collectives' scheduled time added up, which is what a sequential
    sync at the end of the step, after the last compute, would expose; ``exposed_dp_sync_us``,
    the time in this schedule where a DP collective runs and no compute does."""
    dp = [n for n in nodes if n.kind == "comm" and n.attrs.get("dp", False)]
    compute = [n for n in nodes if n.kind == "compute"]
    return {"dp_sync_us": round_us(sum(n.end_us - n.start_us for n in dp)),
            "exposed_dp_sync_us": round_us(sum(e - s for s, e in layer_exposed_comm(compute, dp)))}


def layer_group(attrs: Mapping[str, Any]) -> int | str | None:
    """A scheduled node's group in a multi-layer schedule: its layer index (attr 'layer'), or
    "edges" for a model's edge node (``moegraph.edges``: embedding, final norm, LM head), or
    None (a one-layer schedule's node)."""
    return EDGES if is_edge(attrs) else attrs.get(LAYER_ATTR)


def group_label(group: int | str) -> str:
    """How charts and tables name a group: "l3" for layer 3, "edges" for the edges."""
    return f"l{group}" if isinstance(group, int) else str(group)


def per_layer_summary(schedule: Schedule) -> list[dict]:
    """Per layer of a multi-layer schedule (nodes carry attr 'layer'): when its forward and its
    backward (with recompute) run, its compute and communication time, and its exposed
    communication (its collectives' time with no compute of any layer running). A model step's
    edge nodes (``moegraph.edges``) come last, as one row with "layer": "edges"."""
    compute = [n for n in schedule.nodes if n.kind == "compute"]
    by_layer: dict[int | str, list] = {}
    for n in schedule.nodes:
        group = layer_group(n.attrs)
        if group is None:
            raise ValueError(f"node {n.name!r} has no attribute {LAYER_ATTR!r} and is no edge node: in a "
                             "multi-layer schedule every node belongs to a layer or to the edges")
        by_layer.setdefault(group, []).append(n)
    order = sorted((k for k in by_layer if isinstance(k, int))) + [k for k in by_layer if not isinstance(k, int)]

    def span(nodes) -> list[float]:
        return [round_us(min(n.start_us for n in nodes)), round_us(max(n.end_us for n in nodes))] if nodes else []

    def busy(nodes, kind) -> float:
        return round_us(sum(n.end_us - n.start_us for n in nodes if n.kind == kind))

    out = []
    for i in order:
        mine = by_layer[i]
        exposed = layer_exposed_comm(compute, mine)
        out.append({"layer": i, "forward_us": span([n for n in mine if n.phase == "forward"]),
                    "backward_us": span([n for n in mine if n.phase != "forward"]),
                    "compute_us": busy(mine, "compute"), "comm_us": busy(mine, "comm"),
                    "exposed_comm_us": round_us(sum(e - s for s, e in exposed))})
    return out
