"""Where a measured pipeline step's time goes (``benchmarks/pipeline_link.py --breakdown``).

On each rank, ``ActionClock`` records when torch's ``_PipelineScheduleRuntime`` starts each
action (it names every action for the profiler: ``_get_profiler_function_name`` is called once
per action, at its start) and every wait on point-to-point work (``_wait_batch_p2p``: a
receive's wait inside F or B, the sends' wait at the step's end). An action's compute is its
span (to the next action's start, the last one to the step's end) less the waits inside it.
``time.perf_counter`` is CLOCK_MONOTONIC, one clock for every process of the machine, so a
send's start on one rank and its receive's end on the other give the transfer's time where the
receiver was already waiting when the send started (the whole transfer is then seen).

``report`` sets, per order and rank, the measured medians beside the units the stage-level
problem priced (``pipeline_problem``: F and B per stage, edge units included, and the boundary
send), and the transfers measured against the predicted send.
"""

from __future__ import annotations

import statistics
import time

__all__ = ["ActionClock", "report", "node_classes", "class_report"]

WAITED_MS = 0.5
"""A receive that waited longer than this saw its transfer still in flight."""


class ActionClock:
    """Per-action start times and p2p waits of torch's pipeline runtime in this process (module
    docstring): patches the runtime module's two hooks on construction."""

    def __init__(self):
        from torch.distributed.pipelining import schedules
        self.events: list[tuple] = []
        self._current = None
        name, wait = schedules._get_profiler_function_name, schedules._wait_batch_p2p

        def named(action):
            self._current = str(action)
            self.events.append(("act", self._current, time.perf_counter()))
            return name(action)

        def waited(work):
            t0 = time.perf_counter()
            wait(work)
            self.events.append(("wait", self._current, t0, time.perf_counter()))
        schedules._get_profiler_function_name, schedules._wait_batch_p2p = named, waited

    def timed(self, label: str, fn):
        """``fn`` wrapped: each call's span recorded as a part of the current action (``label``)."""
        def call(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            self.events.append(("part", self._current, label, t0, time.perf_counter()))
            return out
        return call

    def start(self, t: float) -> None:
        self.events, self._current = [("start", t)], None

    def stop(self, t: float) -> list[tuple]:
        """This step's events, the step's end appended."""
        return self.events + [("end", t)]


def node_classes(layer, hardware: str) -> dict[str, tuple[float, float, float, int]]:
    """Per op class of a recording CompiledLayer's graph (``layer.record = True`` before the
    steps): (predicted us, measured median us, its 10th percentile, nodes), summed over the
    nodes, each node's median (percentile) over the recorded runs of it."""
    from moegraph.cost import CostModel, op_class
    from moegraph.registry import load_hardware
    cost = CostModel(load_hardware(hardware).for_group(1))         # its stages: groups of one rank
    spans: dict[str, list[float]] = {}
    for trace in layer.traces:
        for t in trace.nodes:
            spans.setdefault(t.name, []).append(t.duration_us)
    out: dict[str, list] = {}
    for node in layer.graph.nodes:
        xs = sorted(spans.get(node.name, []))
        if not xs:
            continue
        row = out.setdefault(f"{node.phase.value} {op_class(node)}", [0.0, 0.0, 0.0, 0])
        row[0] += cost.node_time_us(node)
        row[1] += statistics.median(xs)
        row[2] += xs[len(xs) // 10]
        row[3] += 1
    return {k: tuple(v) for k, v in out.items()}


def _actions(events: list[tuple]) -> list[dict]:
    """Per action: name, start, span, waits (s) inside it."""
    acts = [e for e in events if e[0] == "act"]
    end = events[-1][1]
    out = []
    for k, (_, name, t) in enumerate(acts):
        stop = acts[k + 1][2] if k + 1 < len(acts) else end
        waits = [(a, b) for kind, *rest in events if kind == "wait" for (lab, a, b) in [rest]
                 if lab == name and t <= a <= stop]
        parts: dict[str, float] = {}
        for e in events:
            if e[0] == "part" and e[1] == name and t <= e[3] <= stop:
                parts[e[2]] = parts.get(e[2], 0.0) + e[4] - e[3]
        out.append({"name": name, "start": t, "span": stop - t, "wait": sum(b - a for a, b in waits), "parts": parts,
                    "wait_end": max((b for _, b in waits), default=None),
                    "wait_start": min((a for a, _ in waits), default=None)})
    return out


def _kind(name: str) -> tuple[str, int, int | None]:
    """'1SEND_F3' -> ('SEND_F', 1, 3); '0F2' -> ('F', 0, 2)."""
    i = 0
    while name[i].isdigit():
        i += 1
    j = len(name)
    while j > i and name[j - 1].isdigit():
        j -= 1
    return name[i:j], int(name[:i]), int(name[j:]) if j < len(name) else None


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f}" if xs else "-"


def _low(xs: list[float]) -> str:
    """The 10th percentile: other jobs on the cores only add time, so it is the figure least moved by load."""
    return f"{sorted(xs)[len(xs) // 10] * 1e3:.1f}" if xs else "-"


def class_report(ranks: list[dict]) -> str:
    """Markdown: per rank's stage and op class, the predicted node times beside the recorded ones."""
    lines = ["Stage layers' nodes by op class (the plan's own per-node recording; both orders' steps): summed "
             "node times, ms", "", "| rank | phase, op class | nodes | predicted | measured median | 10th percentile "
             "| error of the prediction (vs 10th pct.) |", "|---:|---|---:|---:|---:|---:|---:|"]
    for rank, r in enumerate(ranks):
        tot = [0.0, 0.0, 0.0]
        for cls, (pred, med, low, n) in sorted(r["classes"].items()):
            tot = [tot[0] + pred, tot[1] + med, tot[2] + low]
            lines.append(f"| {rank} | {cls} | {n} | {pred / 1e3:.2f} | {med / 1e3:.2f} | {low / 1e3:.2f} | "
                         f"{pred / med - 1:+.0%} ({pred / low - 1:+.0%}) |")
        lines.append(f"| {rank} | all | - | {tot[0] / 1e3:.2f} | {tot[1] / 1e3:.2f} | {tot[2] / 1e3:.2f} | "
                     f"{tot[0] / tot[1] - 1:+.0%} ({tot[0] / tot[2] - 1:+.0%}) |")
    return "\n".join(lines)


def report(built, problem, predicted: dict, ranks: list[dict]) -> str:
    """Markdown tables: per order, per rank and unit, predicted against measured (module docstring)."""
    tick = problem.tick_us / 1e3
    lines = ["Breakdown (--breakdown): per action, the median over the timed steps and micro-batches; compute = the "
             "action's span less its p2p waits; ms",
             "",
             "| order | rank | unit | predicted | measured compute | its 10th percentile | measured p2p wait in it | n |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    edges = built.edges
    parts = {("F", 0): f" (layer {built.layer_prices[0].f_us / 1e3:.1f} + embedding {edges.embedding.f_us / 1e3:.1f})",
             ("B", 0): f" (layer {built.layer_prices[0].b_us / 1e3:.1f} + embedding {edges.embedding.b_us / 1e3:.1f})",
             ("F", 1): f" (layer {built.layer_prices[-1].f_us / 1e3:.1f} + head {edges.head.f_us / 1e3:.1f})",
             ("B", 1): f" (layer {built.layer_prices[-1].b_us / 1e3:.1f} + head {edges.head.b_us / 1e3:.1f})"}
    transfers = []
    for order in predicted:
        per_rank = [[_actions(ev) for ev in r[order]] for r in ranks]
        for rank, steps in enumerate(per_rank):
            rows: dict[str, tuple[list, list]] = {}
            part_times: dict[tuple[str, str], list] = {}
            for acts in steps:
                for a in acts:
                    kind, stage, _ = _kind(a["name"])
                    c, w = rows.setdefault(f"{kind} stage {stage}", ([], []))
                    c.append(a["span"] - a["wait"])
                    w.append(a["wait"])
                    for label, took in a["parts"].items():
                        part_times.setdefault((f"{kind} stage {stage}", label), []).append(took)
            for unit, (c, w) in sorted(rows.items()):
                kind, stage = unit.split(" stage ")[0], int(unit.split(" stage ")[1])
                work = problem.work[stage]
                pred = {"F": work.f, "B": work.b}.get(kind)
                label = f"{unit}{parts.get((kind, stage), '')}"
                lines.append(f"| {order} | {rank} | {label} | {'-' if pred is None else f'{pred * tick:.1f}'} | "
                             f"{_med(c)} | {_low(c)} | {_med(w)} | {len(c)} |")
                for (u, part), xs in sorted(part_times.items()):
                    if u == unit:
                        lines.append(f"| {order} | {rank} | - of it: {part} | - | {_med(xs)} | {_low(xs)} | - | {len(xs)} |")
            evs = ranks[rank][order]
            before = [next(e[2] for e in ev if e[0] == "act") - ev[0][1] for ev in evs]
            lines.append(f"| {order} | {rank} | runtime before the first action (step() to it) | - | {_med(before)} | "
                         f"{_low(before)} | - | {len(before)} |")
            whole = [ev[-1][1] - ev[0][1] for ev in evs]
            step_wait = [sum(a["wait"] for a in acts) for acts in steps]
            step_comp = [sum(a["span"] - a["wait"] for a in acts) for acts in steps]
            tl = predicted[order]
            lines.append(f"| {order} | {rank} | step: compute / p2p wait | busy {tl.busy(rank) * tick:.1f}, "
                         f"waits {tl.wait_ticks[rank] * tick:.1f}, idle {tl.bubble_ticks[rank] * tick:.1f} | "
                         f"{_med(step_comp)} | {_low(step_comp)} | {_med(step_wait)} | {len(steps)} |")
            lines.append(f"| {order} | {rank} | this rank's step | {tl.makespan * tick:.1f} | {_med(whole)} | "
                         f"{_low(whole)} | - | {len(whole)} |")
        # transfers: a send's start on one rank to its receive's wait end on the other
        for direction, send, recv_kind, src, dst in (("forward", "SEND_F", "F", 0, 1), ("backward", "SEND_B", "B", 1, 0)):
            seen, bounds = [], []
            for s_acts, r_acts in zip(per_rank[src], per_rank[dst]):
                sends = {(_kind(a["name"])[2]): a["start"] for a in s_acts if _kind(a["name"])[0] == send}
                for a in r_acts:
                    kind, _, mb = _kind(a["name"])
                    if kind != recv_kind or mb not in sends or a["wait_end"] is None:
                        continue
                    took = a["wait_end"] - sends[mb]
                    (seen if a["wait"] * 1e3 > WAITED_MS and a["wait_start"] <= sends[mb] else bounds).append(took)
            pred = (problem.send if direction == "forward" else problem.send_back)[0] * tick
            transfers.append(f"| {order} | {direction} | {pred:.1f} | {_med(seen)} ({len(seen)}) | "
                             f"{_med(bounds)} ({len(bounds)}) |")
    lines += ["", "Transfers: a send's start to its receive's end on the other rank; 'whole' where the receiver "
              f"was already waiting when the send started (and waited > {WAITED_MS} ms), else an upper bound; ms",
              "", "| order | direction | predicted | measured whole (n) | upper bound (n) |", "|---|---|---:|---:|---:|",
              *transfers]
    return "\n".join(lines)
