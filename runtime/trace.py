"""Measured per-node timing: recording during a step, schedule-like JSON, Chrome trace, and
predicted-vs-measured comparison.

Clocks. CPU: the host clock (``time.perf_counter_ns``): a compute node spans its kernel call;
a collective spans issue to completion as the host observes it: at the first node boundary
where its work reports ``is_completed()``, or when a host wait on it returns (so a collective
finishing in the middle of a kernel is stamped at that kernel's end; no Python callbacks run on
gloo's threads, which would need the GIL and delay gloo's next collective). GPU: CUDA events
recorded on the node's stream around the kernel (compute) or around issue + stream-wait
(collective), read after the step with
``Event.elapsed_time`` against an event recorded when the forward started.

Times are microseconds from the start of the step's forward. A measured step is exported as a
``schedules`` Schedule (the schedule-file format: per node name, stream, start_us, end_us,
sm_budget, phase, ...) with ``summary.measured = true`` and a top-level ``"measured": true``, so
the Gantt renderer draws measured and predicted steps the same way.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from moegraph.ir import Graph
from moegraph.atomic import write_atomic

if TYPE_CHECKING:
    from moegraph.registry import Hardware
    from moegraph.runtime.plan import ExecutionPlan


@dataclass(frozen=True)
class NodeTiming:
    name: str
    stream: str
    sm_budget: int
    phase: str
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


@dataclass(frozen=True)
class WaitTiming:
    """The host blocked on a collective's result (CPU): exposed, not overlapped, communication."""

    node: str                     # the collective waited on
    consumer: str                 # the node that needed its output
    start_us: float
    end_us: float


@dataclass(frozen=True)
class StepTrace:
    rank: int
    device: str
    nodes: tuple[NodeTiming, ...]
    waits: tuple[WaitTiming, ...] = ()
    backward_start_us: float | None = None

    @property
    def step_us(self) -> float:
        return max((t.end_us for t in self.nodes), default=0.0)

    def by_name(self) -> dict[str, NodeTiming]:
        return {t.name: t for t in self.nodes}


@dataclass
class StepRecorder:
    """Collects raw clock readings of one step; ``finalize`` turns them into a StepTrace.

    Rows hold host nanoseconds (CPU), a Pending whose ``done_ns`` / ``waited_ns`` the executor
    fills (CPU collectives), or CUDA events (GPU). GPU rows are read only in ``finalize``, so recording
    never synchronises the device during the step.
    """

    rank: int
    cuda: bool
    t0_ns: int = 0
    t0_event: Any = None
    rows: list[tuple] = field(default_factory=list)
    waits: list[tuple] = field(default_factory=list)
    backward_start: Any = None

    def start(self, stream: Any = None) -> None:
        self.t0_ns = time.perf_counter_ns()
        if self.cuda:
            self.t0_event = new_event(stream)

    def mark_backward(self, stream: Any = None) -> None:
        self.backward_start = new_event(stream) if self.cuda else time.perf_counter_ns()

    def add(self, name: str, stream: str, sm_budget: int, phase: str, start: Any, end: Any) -> None:
        self.rows.append((name, stream, sm_budget, phase, start, end))

    def add_wait(self, node: str, consumer: str, start_ns: int, end_ns: int) -> None:
        self.waits.append((node, consumer, start_ns, end_ns))

    def _us(self, t: Any) -> float:
        if self.cuda:
            return float(self.t0_event.elapsed_time(t)) * 1e3          # ms -> us
        return (t - self.t0_ns) / 1e3

    def complete(self) -> bool:
        """GPU: every event recorded has completed (non-blocking query); CPU: always."""
        return not self.cuda or all(ev.query() for ev in self._events())

    def _events(self) -> list:
        return [t for row in self.rows for t in row[4:6] if hasattr(t, "query")] + \
            [t for t in (self.t0_event, self.backward_start) if hasattr(t, "query")]

    def finalize(self, sync: bool = True) -> StepTrace:
        """sync=False: the caller checked ``complete()``, so reading the events cannot block."""
        from moegraph.runtime.collectives import Pending
        if self.cuda and sync:
            import torch
            torch.cuda.synchronize()
        nodes = []
        for name, stream, budget, phase, start, end in self.rows:
            if isinstance(end, Pending):                             # a CPU collective
                end = end.done_ns if end.done_ns is not None else end.waited_ns
            nodes.append(NodeTiming(name, stream, budget, phase, round(self._us(start), 3),
                                    round(max(self._us(end), self._us(start)), 3)))
        waits = tuple(WaitTiming(n, c, round(self._us(a), 3), round(self._us(b), 3)) for n, c, a, b in self.waits)
        bwd = None if self.backward_start is None else round(self._us(self.backward_start), 3)
        return StepTrace(self.rank, "cuda" if self.cuda else "cpu", tuple(nodes), waits, bwd)


def hidden_comm_fraction(trace: StepTrace) -> float:
    """Share of the step's collective time during which a compute node ran (0 with no
    collectives), summed per collective: two collectives that overlap each other each count
    their own time (unlike ``schedules.schedule_file.exposed_comm``'s union), since the issue's
    bar asks how much of every collective's time compute hid. Compute nodes run one at a time on
    the compute stream, so their intervals do not overlap one another."""
    from moegraph.runtime.plan import COMPUTE
    compute = [(t.start_us, t.end_us) for t in trace.nodes if t.stream == COMPUTE]
    total = hidden = 0.0
    for t in trace.nodes:
        if t.stream == COMPUTE:
            continue
        total += t.duration_us
        hidden += sum(max(0.0, min(t.end_us, e) - max(t.start_us, s)) for s, e in compute)
    return hidden / total if total else 0.0


def new_event(stream: Any = None) -> Any:
    """A CUDA event recorded on ``stream``. Inside a CUDA graph capture (runtime.cudagraph) an
    event is a fork/join marker, not a clock: it is made without timing there."""
    import torch
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    ev = torch.cuda.Event(enable_timing=not capturing)
    ev.record(stream)
    return ev


# -- exports ------------------------------------------------------------------------------------

def as_schedule(graph: Graph, plan: "ExecutionPlan", times: dict[str, tuple[float, float]], *,
                hardware: "Hardware | None" = None, memory_budget_bytes: int | None = None,
                **summary: Any) -> Any:
    """A ``schedules`` Schedule (the schedule-file object the Gantt renderer draws) with the given
    per-node (start_us, end_us); streams and SM budgets from ``plan``; ``memory_budget_bytes``:
    the budget the file records (``verify`` checks its peak against it)."""
    from moegraph.schedules.schedule_file import (Schedule, ScheduledNode, ScheduledValue, exposed_comm, graph_header,
                                                  round_us)
    nodes = []
    for e in plan.entries:
        n = graph.node[e.name]
        start, end = times[e.name]
        nodes.append(ScheduledNode(
            name=n.name, op=n.op.value, role=n.role.value, phase=n.phase.value,
            kind="comm" if n.is_comm else "compute", inputs=tuple(n.inputs), outputs=tuple(n.outputs),
            flops=n.flops, mem_bytes=n.mem_bytes, comm_bytes=n.comm_bytes, group=n.group,
            attrs={k: _thaw(v) for k, v in n.attrs}, module=n.module, block=n.block, forward_of=n.forward_of,
            stream=e.stream, start_us=round_us(start), end_us=round_us(max(end, start)), sm_budget=e.sm_budget))
    values = tuple(ScheduledValue(v.name, v.storage_bytes, v.kind.value, v.alias_of) for v in graph.values)
    st = graph.strategy
    summary = {"method": plan.method, "plan_hash": plan.hash,
               "strategy": f"attn={st.attn} ffn={st.ffn} dispatch={st.dispatch} n={st.n} chunks={st.chunks} "
                           f"remat={st.remat} dtype={st.dtype}",
               "makespan_us": round_us(max((nd.end_us for nd in nodes), default=0.0)),
               "exposed_comm_us": round_us(sum(b - a for a, b in exposed_comm(nodes))), **summary}
    hw = hardware.to_dict() if hardware is not None else {}
    return Schedule(graph=graph_header(graph),
                    hardware=hw, streams=tuple(plan.streams), memory_budget_bytes=memory_budget_bytes, tick_us=0.01,
                    values=values, nodes=tuple(nodes), summary=summary).with_hash()


def measured_schedule(trace: StepTrace, graph: Graph, plan: "ExecutionPlan", *, hardware: "Hardware | None" = None,
                      **summary: Any) -> Any:
    """One measured step as a Schedule: same node fields as the predicted one, summary.measured = True."""
    times = {t.name: (t.start_us, t.end_us) for t in trace.nodes}
    barrier = trace.backward_start_us
    if barrier is None:     # a merged micro-batch step runs in one pass: no single barrier; as the
        # compiler writes it (schedules.solution.barrier_ticks: every task on side 0), the step's end
        barrier = max((end for _, end in times.values()), default=0.0)
    return as_schedule(graph, plan, times, hardware=hardware, measured=True, rank=trace.rank, device=trace.device,
                       barrier_us=barrier, **summary)


def predicted_schedule(graph: Graph, plan: "ExecutionPlan", *, hardware: "Hardware | None" = None) -> Any:
    """The plan's predicted times as a Schedule (None if the plan carries none), under the memory
    budget the plan was made under. (A measured file records none: its peak is the model's byte
    accounting on measured times, which no schedule promised to keep under the budget.)"""
    if any(e.start_us is None for e in plan.entries):
        return None
    return as_schedule(graph, plan, {e.name: (e.start_us, e.end_us) for e in plan.entries}, hardware=hardware,
                       memory_budget_bytes=plan.memory_budget_bytes, measured=False)


def schedule_json(schedule: Any) -> dict[str, Any]:
    """The file's JSON object, plus a top-level ``measured`` flag (ignored by Schedule.from_json)."""
    return {**schedule.content(), "measured": bool(schedule.summary.get("measured")), "hash": schedule.hash}


def _thaw(v: Any) -> Any:
    return [_thaw(x) for x in v] if isinstance(v, tuple) else v


def chrome_trace(traces: Sequence[StepTrace], graph: Graph | None = None) -> dict[str, Any]:
    """Chrome trace (chrome://tracing, Perfetto): one process per rank, one thread per stream,
    plus a 'host wait' thread showing when the host blocked on a collective."""
    events: list[dict[str, Any]] = []
    for tr in traces:
        pid = tr.rank
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {tr.rank}"}})
        streams = list(dict.fromkeys(["compute"] + [t.stream for t in tr.nodes])) + ["host wait"]
        for tid, s in enumerate(streams):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": s}})
        tids = {s: i for i, s in enumerate(streams)}
        for t in tr.nodes:
            args = {"phase": t.phase, "sm_budget": t.sm_budget}
            if graph is not None:
                args["op"] = graph.node[t.name].op.value
            events.append({"name": t.name, "ph": "X", "pid": pid, "tid": tids[t.stream], "ts": t.start_us,
                           "dur": max(t.duration_us, 0.0), "cat": t.phase, "args": args})
        for w in tr.waits:
            events.append({"name": f"wait {w.node}", "ph": "X", "pid": pid, "tid": tids["host wait"],
                           "ts": w.start_us, "dur": max(w.end_us - w.start_us, 0.0), "cat": "wait",
                           "args": {"consumer": w.consumer}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def compare_prediction(plan: Any, traces: Sequence[StepTrace], step_us: float | None = None) -> dict[str, Any]:
    """Per node and in total: the plan's predicted duration against the median measured one.

    Per node ``rel_err`` = (predicted - measured) / measured. Total: the predicted makespan
    against the measured step (``step_us``, or the traces' median makespan).
    """
    measured: dict[str, list[float]] = {}
    for tr in traces:
        for t in tr.nodes:
            measured.setdefault(t.name, []).append(t.duration_us)
    rows = []
    for e in plan.entries:
        if e.start_us is None or e.name not in measured:
            continue
        pred, meas = e.end_us - e.start_us, statistics.median(measured[e.name])
        rows.append({"name": e.name, "stream": e.stream, "predicted_us": round(pred, 3), "measured_us": round(meas, 3),
                     "rel_err": round((pred - meas) / meas, 4) if meas > 0 else None})
    total_meas = step_us if step_us is not None else statistics.median(tr.step_us for tr in traces)
    total_pred = plan.predicted_makespan_us
    errs = [abs(r["rel_err"]) for r in rows if r["rel_err"] is not None]
    return {"total": {"predicted_us": None if total_pred is None else round(total_pred, 3),
                      "measured_us": round(total_meas, 3),
                      "rel_err": None if total_pred is None or total_meas <= 0
                      else round((total_pred - total_meas) / total_meas, 4)},
            "mean_abs_rel_err": round(statistics.mean(errs), 4) if errs else None,
            "nodes": rows}


def write_json(path: str | Path, obj: Any) -> Path:
    """``obj`` as indented JSON, written atomically (moegraph.atomic)."""
    return write_atomic(path, json.dumps(obj, indent=1) + "\n")


def trace_to_dict(trace: StepTrace) -> dict[str, Any]:
    return {"rank": trace.rank, "device": trace.device, "backward_start_us": trace.backward_start_us,
            "nodes": [asdict(t) for t in trace.nodes], "waits": [asdict(w) for w in trace.waits]}


def trace_from_dict(d: dict[str, Any]) -> StepTrace:
    return StepTrace(d["rank"], d["device"], tuple(NodeTiming(**t) for t in d["nodes"]),
                     tuple(WaitTiming(**w) for w in d["waits"]), d.get("backward_start_us"))


def write_traces(out: str, graph: Any, plan: Any, traces: list[list[Any]], steps_us: list[float],
                 hardware: Any = None) -> dict[str, Any]:
    """The median step (``traced_step``): rank 0's as a measured schedule file (OUT), the plan's
    prediction as a schedule file (OUT.predicted.json), all ranks' as a Chrome trace
    (OUT.chrome.json). Also returns which step that is and its time."""
    k = traced_step(steps_us)
    paths = trace_paths(out)
    measured = measured_schedule(traces[0][k], graph, plan, hardware=hardware, step=k, step_us=steps_us[k])
    written = {"schedule": str(write_json(paths["schedule"], schedule_json(measured)))}
    predicted = predicted_schedule(graph, plan, hardware=hardware)
    if predicted is not None:
        written["predicted"] = str(write_json(paths["predicted"], schedule_json(predicted)))
    written["chrome"] = str(write_json(paths["chrome"], chrome_trace([t[k] for t in traces], graph)))
    return {**written, "step": k, "step_us": steps_us[k], "of_steps": len(steps_us)}

def traced_step(steps_us: list[float]) -> int:
    """The step ``run --trace`` draws: the median step, a step that ran. With an even count no step
    has the median time (the mean of the middle two), so it is the faster middle step (the low
    median); the report names its index and time beside the median."""
    order = sorted(range(len(steps_us)), key=steps_us.__getitem__)
    return order[(len(order) - 1) // 2]

def trace_paths(out: str) -> dict[str, Path]:
    """The files ``run --trace OUT`` writes (``write_traces``), each checked before any work
    (``moegraph.options.check_output``: a UsageError naming the path, nothing written)."""
    from moegraph.options import check_output
    path = check_output(out, suffixes=(".json",), flag="--trace")      # a schedule file, as compile's -o
    paths = {"schedule": path, "predicted": path.with_suffix(".predicted.json"),
             "chrome": path.with_suffix(".chrome.json")}
    for p in paths.values():
        check_output(p, flag="--trace")
    return paths
