"""Check a finished schedule file against the semantics, independently of the solver.

Nothing here reuses the CP-SAT model or moegraph.schedules.problem: every rule is re-derived from the
file by sweeping events over time. Checks, in the order violations are reported:

    hash        the content hashes to the recorded hash
    structure   each node once, on a known stream of its kind, finite times, end >= start
    coverage    every node of the graph scheduled exactly once: every node graph.nodes names
                is scheduled and no other (a deleted node is named), each declared value is a
                graph input or the output of exactly one scheduled node, and every value read
                or listed as a graph output exists (a deleted node leaves its outputs
                unproduced; the file's values are the graph's, see build_schedule)
    dependency  a node starts at or after the end of every producer of its inputs
    barrier     backward/recompute nodes start at or after the end of every forward node;
                in a merged micro-batch step (nodes carry attr ``mb``) a node of micro-batch
                j after every forward node of micro-batch j (step-level nodes: of all)
    stream      one node at a time per stream (nodes taking no time occupy no stream)
    sm          the SMs of running nodes sum to <= sm_count at every instant
    duration    each duration matches the cost model (rebuilt from the embedded hardware)
                at the recorded SM budget, rounded up to the tick: 0 <= d - cost <= 10 ns; a
                collective that some compute node overlaps is priced x comm_overlap_stretch
    memory      peak live bytes (recomputed) equals summary.peak_memory_bytes and fits
                memory_budget_bytes
    summary     summary.makespan_us equals the last end

Times are compared on an integer picosecond grid (file times are rounded to 1e-6 us).

Files written by ``run --trace`` (``Schedule.origin`` predicted / measured) hold the runtime's
times, not the cost model's: on them verify checks hash, structure, coverage, dependency,
barrier, stream and summary (makespan), the memory budget if one is recorded, and skips
(``skipped_checks`` says why, and the CLI prints it):

    duration    measured times / the runtime plan's own unrounded prediction
    sm          the plan records compute nodes at 0 SMs and holds no SMs on the CPU
    memory      the peak comparison, when the file records no summary.peak_memory_bytes
    stream      on the comm streams of a step measured on the CPU: a collective spans issue to
                host-observed completion, and gloo runs collectives on its own worker threads,
                so those spans may overlap (the compute stream is still checked)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moegraph.cost import CostModel
from moegraph.options import format_bytes
from moegraph.registry import Hardware
from moegraph.schedules.schedule_file import Schedule, exposed_comm, round_us

__all__ = ["Violation", "Verdict", "verify_schedule", "verdict", "skipped_checks", "DURATION_TOLERANCE_US", "check",
           "memory_events", "memory_curve", "unknown_stream"]

DURATION_TOLERANCE_US = 0.01 + 1e-6
"""Durations are rounded up to a 10 ns tick; the extra 1 ps absorbs float rounding."""
_EXCLUDED_KINDS = ("param", "param_grad")
_FORWARD = "forward"


@dataclass(frozen=True)
class Violation:
    check: str
    message: str
    nodes: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.message


def _ps(t: float) -> int:
    return round(t * 1e6)


@dataclass(frozen=True)
class Verdict:
    """What ``verify`` found in one file: its origin, the violations, and the checks skipped
    for that origin with the reason."""

    origin: str
    violations: tuple[Violation, ...]
    skipped: tuple[tuple[str, str], ...]

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "origin": self.origin, "violation_count": len(self.violations),
                "violations": [{"check": v.check, "message": v.message, "nodes": list(v.nodes)}
                               for v in self.violations],
                "skipped": {k: why for k, why in self.skipped}}


def skipped_checks(sched: Schedule) -> tuple[tuple[str, str], ...]:
    """(check, why) for every check that does not apply to a file of this origin."""
    if sched.origin == "compiled":
        return ()
    what = "measured times" if sched.origin == "measured" else "the runtime plan's own prediction"
    out = [("duration", f"{what}, not cost-model times"),
           ("sm", "the runtime plan records compute nodes at 0 SMs and holds no SMs on the CPU")]
    if sched.summary.get("peak_memory_bytes") is None:
        out.append(("memory", "the file records no peak memory (the budget, if any, is still checked)"))
    if sched.origin == "measured" and sched.summary.get("device") == "cpu":
        out.append(("stream", "comm streams of a CPU measurement: a collective spans issue to host-observed "
                              "completion and gloo runs collectives on worker threads (compute stream checked)"))
    return tuple(out)


def verdict(sched: Schedule, cost: CostModel | None = None) -> Verdict:
    """Every violation found in ``sched``, with the checks skipped for its origin."""
    skipped = skipped_checks(sched)
    return Verdict(sched.origin, tuple(_violations(sched, cost, {k for k, _ in skipped})), skipped)


def verify_schedule(sched: Schedule, cost: CostModel | None = None) -> list[Violation]:
    """All violations found (empty: the schedule is valid). The first is the one to print.
    Checks that do not apply to the file's origin are skipped (``skipped_checks``)."""
    return list(verdict(sched, cost).violations)


def _violations(sched: Schedule, cost: CostModel | None, skip: set[str]) -> list[Violation]:
    out: list[Violation] = []
    recorded, actual = sched.hash, sched.compute_hash()
    if recorded != actual:
        out.append(Violation("hash", f"hash mismatch: the file records {recorded[:19]}... but its content "
                                     f"hashes to {actual[:19]}... (edited after it was written?)"))
    if not _structure(sched, out) or not _coverage(sched, out):
        return out
    _dependencies(sched, out)
    _barrier(sched, out)
    _streams(sched, out, compute_only="stream" in skip)
    if "sm" not in skip:
        _sms(sched, out)
    if "duration" not in skip:
        _durations(sched, cost, out)
    _memory(sched, out, check_peak="memory" not in skip)
    _summary(sched, out)
    return out


def check(sched: Schedule, cost: CostModel | None = None) -> None:
    """Raise ValueError with the first violation, if any."""
    v = verify_schedule(sched, cost)
    if v:
        raise ValueError(v[0].message)


def unknown_stream(s: Schedule, n) -> Violation:
    """The violation of node ``n`` on a stream ``s`` does not declare (gantt refuses to draw it)."""
    return Violation("structure", f"node {n.name!r} is on unknown stream {n.stream!r}; streams: {list(s.streams)}",
                     (n.name,))


def _structure(s: Schedule, out: list[Violation]) -> bool:
    ok = True
    seen: set[str] = set()
    for n in s.nodes:
        if n.name in seen:
            out.append(Violation("structure", f"node {n.name!r} is scheduled more than once", (n.name,)))
            ok = False
        seen.add(n.name)
        where = f"node {n.name!r}"
        if n.stream not in s.streams:
            out.append(unknown_stream(s, n))
            ok = False
        elif (n.kind == "comm") != n.stream.startswith("comm") or n.kind not in ("comm", "compute"):
            out.append(Violation("structure", f"{where} ({n.kind}) is on stream {n.stream!r}", (n.name,)))
            ok = False
        times_ok = all(isinstance(t, (int, float)) and math.isfinite(t) for t in (n.start_us, n.end_us))
        if not times_ok or n.start_us < 0 or n.end_us < n.start_us:
            out.append(Violation("structure", f"{where} has bad times start={n.start_us!r} end={n.end_us!r} us",
                                 (n.name,)))
            ok = False
    known = {v.name for v in s.values}
    for n in s.nodes:
        for v in (*n.inputs, *n.outputs):
            if v not in known:
                out.append(Violation("structure", f"node {n.name!r} refers to undeclared value {v!r}", (n.name,)))
                ok = False
    return ok


def _coverage(s: Schedule, out: list[Violation]) -> bool:
    """Every graph node scheduled exactly once: by name where the file lists the graph's nodes
    (graph.nodes), and read off the values: each is a graph input or the output of exactly one
    node; a value nothing produces is reported with its first reader (a file without
    graph.nodes cannot name the node that would have produced it)."""
    listed = s.graph.get("nodes")
    if listed is not None:
        scheduled, known = {n.name for n in s.nodes}, set(listed)
        missing = [name for name in listed if name not in scheduled]
        extra = [n.name for n in s.nodes if n.name not in known]
        for name in missing:
            out.append(Violation("coverage", f"node {name!r} of the graph is missing from the schedule", (name,)))
        for name in extra:
            out.append(Violation("coverage", f"node {name!r} is scheduled but is no node of the graph (graph.nodes)",
                                 (name,)))
        if missing or extra:
            return False      # the values the missing nodes produce dangle: the same fault, named above
    ok = True
    inputs = set(s.graph.get("inputs", ()))
    declared = {v.name for v in s.values}
    made_by: dict[str, str] = {}
    for n in s.nodes:
        for v in n.outputs:
            if v in inputs:
                out.append(Violation("coverage", f"node {n.name!r} writes graph input {v!r}", (n.name,)))
                ok = False
            elif v in made_by:
                out.append(Violation("coverage", f"value {v!r} is written by both {made_by[v]!r} and {n.name!r}",
                                     (made_by[v], n.name)))
                ok = False
            else:
                made_by[v] = n.name
    readers: dict[str, list[str]] = {}
    for n in s.nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(n.name)
    for name in (*s.graph.get("inputs", ()), *s.graph.get("outputs", ())):
        if name not in declared:
            out.append(Violation("coverage", f"graph input/output {name!r} is not a declared value"))
            ok = False
    outputs = set(s.graph.get("outputs", ()))
    for v in s.values:
        if v.name in inputs or v.name in made_by:
            continue
        used = readers.get(v.name, [])
        why = (f"read by {used[0]!r}" + (f" and {len(used) - 1} more" if len(used) > 1 else "") if used
               else "a graph output" if v.name in outputs else "declared")
        out.append(Violation("coverage", f"value {v.name!r} ({why}) is neither a graph input nor written by any "
                                         f"scheduled node: the node producing it is missing from the schedule",
                             tuple(used[:1])))
        ok = False
    if not ok:
        return False       # a missing node leaves its inputs' producers unread: the same fault, named above
    for n in s.nodes:      # a node whose every output nothing reads: an edge to it was cut from the file
        if n.outputs and not any(v in readers or v in outputs for v in n.outputs):
            out.append(Violation("coverage", f"node {n.name!r}'s outputs ({', '.join(n.outputs)}) are read by no "
                                             "node and are no graph output", (n.name,)))
            ok = False
    return ok


def _producers(s: Schedule) -> dict[str, Any]:
    return {v: n for n in s.nodes for v in n.outputs}


def _dependencies(s: Schedule, out: list[Violation]) -> None:
    prod = _producers(s)
    for n in s.nodes:
        for v in n.inputs:
            p = prod.get(v)
            if p is not None and _ps(n.start_us) < _ps(p.end_us):
                out.append(Violation("dependency", f"node {n.name!r} starts at {n.start_us:.2f} us before its input "
                                                   f"{v!r} is produced at {p.end_us:.2f} us by {p.name!r}",
                                     (n.name, p.name)))


def _forward_end(s: Schedule) -> tuple[float, str | None]:
    fwd = [n for n in s.nodes if n.phase == _FORWARD]
    if not fwd:
        return 0.0, None
    last = max(fwd, key=lambda n: (_ps(n.end_us), n.name))
    return last.end_us, last.name


def _micro_batched(s: Schedule) -> bool:
    return any(n.attrs.get("mb") is not None for n in s.nodes)


def _forward_ends(s: Schedule) -> dict[Any, tuple[float, str | None]]:
    """Micro-batch (None for the whole step) -> (end of its forward, its last forward node)."""
    out = {None: _forward_end(s)}
    for n in s.nodes:
        j = n.attrs.get("mb")
        if n.phase == _FORWARD and j is not None and (j not in out or _ps(n.end_us) > _ps(out[j][0])
                                                      or (_ps(n.end_us) == _ps(out[j][0]) and n.name > out[j][1])):
            out[j] = (n.end_us, n.name)
    return out


def _barrier(s: Schedule, out: list[Violation]) -> None:
    ends = _forward_ends(s)
    for n in s.nodes:
        end, last = ends.get(n.attrs.get("mb"), (0.0, None))
        if n.phase != _FORWARD and _ps(n.start_us) < _ps(end):
            whose = "" if n.attrs.get("mb") is None else f" of micro-batch {n.attrs['mb']}"
            out.append(Violation("barrier", f"node {n.name!r} ({n.phase}) starts at {n.start_us:.2f} us before the "
                                            f"forward pass{whose} ends at {end:.2f} us (last forward node {last!r})",
                                 (n.name, last)))


def _streams(s: Schedule, out: list[Violation], compute_only: bool = False) -> None:
    for stream in s.streams:
        if compute_only and stream != "compute":
            continue
        busy = sorted((_ps(n.start_us), _ps(n.end_us), n.name, n) for n in s.nodes
                      if n.stream == stream and _ps(n.end_us) > _ps(n.start_us))
        last = None
        for s0, e0, _, n in busy:
            if last is not None and s0 < _ps(last.end_us):
                out.append(Violation("stream", f"nodes {last.name!r} [{last.start_us:.2f}, {last.end_us:.2f}) us and "
                                               f"{n.name!r} [{n.start_us:.2f}, {n.end_us:.2f}) us overlap on stream "
                                               f"{stream!r}", (last.name, n.name)))
            if last is None or e0 > _ps(last.end_us):
                last = n


def _sm_count(s: Schedule) -> int:
    return int(s.hardware["sm_count"])


def _sms(s: Schedule, out: list[Violation]) -> None:
    cap = _sm_count(s)
    events = []
    for n in s.nodes:
        if _ps(n.end_us) > _ps(n.start_us) and n.sm_budget:
            events.append((_ps(n.start_us), 1, n.sm_budget, n))
            events.append((_ps(n.end_us), 0, -n.sm_budget, n))
    events.sort(key=lambda e: (e[0], e[1], e[3].name))
    used, running = 0, {}
    for t, is_start, d, n in events:
        used += d
        if is_start:
            running[n.name] = n.sm_budget
        else:
            running.pop(n.name, None)
        if used > cap:
            holders = ", ".join(f"{k!r} ({v})" for k, v in sorted(running.items()))
            out.append(Violation("sm", f"SMs exceed sm_count={cap} at {t / 1e6:.2f} us: {holders} hold {used}",
                                 tuple(sorted(running))))
            return


def _cost_model(s: Schedule, cost: CostModel | None) -> CostModel:
    if cost is not None:
        return cost
    return CostModel(Hardware(**s.hardware))


def _ir_node(n) -> Any:
    from moegraph.ir import Node, OpKind, Phase, Role, freeze_attrs
    return Node(name=n.name, op=OpKind(n.op), phase=Phase(n.phase), inputs=tuple(n.inputs),
                outputs=tuple(n.outputs), role=Role(n.role), flops=n.flops, mem_bytes=n.mem_bytes,
                comm_bytes=n.comm_bytes, group=n.group, module=n.module, block=n.block,
                forward_of=n.forward_of, attrs=freeze_attrs(n.attrs))


def _durations(s: Schedule, cost: CostModel | None, out: list[Violation]) -> None:
    try:
        cost = _cost_model(s, cost)
    except (TypeError, ValueError) as err:
        out.append(Violation("duration", f"cannot rebuild the cost model from the embedded hardware: {err}"))
        return
    S = int(cost.sm_count())
    reserves = sorted({0, *cost.hw.comm_sm_budgets})
    stretch = float(cost.comm_overlap_stretch())
    beside = _beside_compute(s)
    for n in s.nodes:
        try:
            node = _ir_node(n)
        except (ValueError, TypeError) as err:
            out.append(Violation("duration", f"node {n.name!r} cannot be priced: {err}", (n.name,)))
            continue
        if node.is_comm:
            allowed = tuple(cost.comm_sm_budgets(node))
            if n.sm_budget not in allowed:
                out.append(Violation("duration", f"node {n.name!r} holds {n.sm_budget} SMs; allowed budgets: "
                                                 f"{list(allowed)}", (n.name,)))
                continue
            want, at = float(cost.node_time_us(node, n.sm_budget)), f"with {n.sm_budget} SMs"
            if n.name in beside and stretch != 1.0:
                want, at = want * stretch, at + f" beside compute (x{stretch:g})"
        else:
            base = 0.0 if node.op.value == "split" else float(cost.node_time_us(node))
            if base == 0.0:
                want, at = 0.0, "(no kernel)"
                if n.sm_budget != 0:
                    out.append(Violation("duration", f"node {n.name!r} takes no time but records {n.sm_budget} SMs",
                                         (n.name,)))
                    continue
            else:
                if n.sm_budget not in [S - b for b in reserves]:
                    out.append(Violation("duration", f"node {n.name!r} runs on {n.sm_budget} SMs; allowed: "
                                                     f"{[S - b for b in reserves]}", (n.name,)))
                    continue
                want, at = float(cost.beside_comm_us(node, S - n.sm_budget)), f"on {n.sm_budget} of {S} SMs"
        got = n.end_us - n.start_us
        if not (-1e-6 <= got - want <= DURATION_TOLERANCE_US):
            out.append(Violation("duration", f"node {n.name!r} lasts {got:.4f} us but the cost model gives "
                                             f"{want:.4f} us {at}", (n.name,)))


def _beside_compute(s: Schedule) -> set[str]:
    """Collectives during which some compute node that takes time runs (open intervals)."""
    busy = [(_ps(n.start_us), _ps(n.end_us)) for n in s.nodes if n.kind == "compute" and n.end_us > n.start_us]
    out = set()
    for n in s.nodes:
        if n.kind == "comm":
            a, b = _ps(n.start_us), _ps(n.end_us)
            if any(cs < b and a < ce for cs, ce in busy):
                out.add(n.name)
    return out


def _bases(s: Schedule) -> dict[str, str]:
    alias = {v.name: v.alias_of for v in s.values}
    base = {}
    for name in alias:
        b, hops = name, 0
        while alias.get(b) is not None and hops <= len(alias):
            b, hops = alias[b], hops + 1
        base[name] = b
    return base


def memory_events(s: Schedule) -> list[tuple[int, int, str]]:
    """(time ps, +/- bytes, value) for every counted value's live interval [start, end)."""
    base = _bases(s)
    prod = _producers(s)
    graph_inputs = set(s.graph.get("inputs", ()))
    outputs = {base.get(o, o) for o in s.graph.get("outputs", ())}
    makespan = max((_ps(n.end_us) for n in s.nodes), default=0)
    # a merged micro-batch step counts each seed gradient from 0 (schedules.problem)
    barrier = 0 if _micro_batched(s) else _ps(_forward_end(s)[0])
    last_use: dict[str, int] = {}
    for n in s.nodes:
        for v in n.inputs:
            b = base.get(v, v)
            last_use[b] = max(last_use.get(b, 0), _ps(n.end_us))
    events = []
    for v in s.values:
        if v.bytes <= 0 or v.alias_of is not None or v.kind in _EXCLUDED_KINDS:
            continue
        p = prod.get(v.name)
        if p is not None:
            start = _ps(p.start_us)
        elif v.name in graph_inputs:
            start = barrier if v.kind == "grad" else 0
        else:
            continue
        if v.name in outputs:
            end = makespan
        elif v.name in last_use:
            end = last_use[v.name]
        else:
            end = _ps(p.end_us) if p is not None else start
        if end > start:
            events += [(start, v.bytes, v.name), (end, -v.bytes, v.name)]
    return sorted(events, key=lambda e: (e[0], e[1], e[2]))


def memory_curve(s: Schedule) -> list[tuple[float, int]]:
    """(time us, live bytes from then on) at every change."""
    live, curve = 0, []
    for t, d, _ in memory_events(s):
        live += d
        if curve and curve[-1][0] == t / 1e6:
            curve[-1] = (t / 1e6, live)
        else:
            curve.append((t / 1e6, live))
    return curve


def _memory(s: Schedule, out: list[Violation], check_peak: bool = True) -> None:
    events = memory_events(s)
    live, peak, peak_t, live_set, peak_set = 0, 0, 0, {}, {}
    i = 0
    while i < len(events):  # apply every change at one instant, then read the level
        t = events[i][0]
        while i < len(events) and events[i][0] == t:
            _, d, name = events[i]
            live += d
            if d > 0:
                live_set[name] = d
            else:
                live_set.pop(name, None)
            i += 1
        if live > peak:
            peak, peak_t, peak_set = live, t, dict(live_set)
    recorded = s.summary.get("peak_memory_bytes")
    if check_peak and recorded != peak:
        out.append(Violation("memory", f"summary.peak_memory_bytes is {recorded} but the schedule peaks at "
                                       f"{peak} bytes"))
    budget = s.memory_budget_bytes
    if budget is not None and peak > budget:
        top = sorted(peak_set.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        names = ", ".join(f"{k!r} {format_bytes(b)}" for k, b in top)
        out.append(Violation("memory", f"peak memory {format_bytes(peak)} at {peak_t / 1e6:.2f} us exceeds the budget "
                                       f"{format_bytes(budget)} (largest live: {names})", tuple(k for k, _ in top)))


def _summary(s: Schedule, out: list[Violation]) -> None:
    """The summary's figures are the nodes' own: the makespan and the exposed communication
    recomputed, a lower bound no longer than the schedule, and the strategy label the graph's."""
    span = max((n.end_us for n in s.nodes), default=0.0)
    recorded = s.summary.get("makespan_us")
    if not isinstance(recorded, (int, float)) or _ps(recorded) != _ps(span):
        out.append(Violation("summary", f"summary.makespan_us is {recorded} but the last node ends at {span:.2f} us"))
    exposed = round_us(sum(e - b for b, e in exposed_comm(s.nodes)))
    said = s.summary.get("exposed_comm_us")
    if said is not None and _ps(said) != _ps(exposed):
        out.append(Violation("summary", f"summary.exposed_comm_us is {said} but the nodes leave {exposed:.2f} us of "
                                        "communication exposed"))
    bound = s.summary.get("lower_bound_us")
    if bound is not None and isinstance(recorded, (int, float)) and _ps(bound) > _ps(recorded):
        out.append(Violation("summary", f"summary.lower_bound_us {bound} exceeds the makespan {recorded}: no schedule "
                                        "is shorter than a lower bound"))
    label, strategy = s.summary.get("strategy"), s.graph.get("strategy")
    if isinstance(label, str) and isinstance(strategy, dict):
        said_fields = dict(t.split("=", 1) for t in label.split() if "=" in t)
        wrong = [k for k, v in said_fields.items() if k in strategy and str(strategy[k]) != v]
        if wrong:
            k = wrong[0]
            out.append(Violation("summary", f"summary.strategy says {k}={said_fields[k]} but graph.strategy has "
                                            f"{k}={strategy[k]}"))

