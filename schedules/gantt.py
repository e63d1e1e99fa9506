"""Draw a Schedule: Gantt chart (.png/.svg), a self-contained report (.html), or a Chrome
trace (.json, opens in Perfetto and chrome://tracing).

Renders the Schedule object and nothing else. Chart: one row per stream; bars coloured by
compute / communication / recompute; comm bars carry their SM budget ("CE" = copy engines);
communication that no compute overlaps is hatched red; a dashed line marks the
forward/backward barrier; the live-memory curve (GiB) runs beneath. ``compare`` stacks a
second schedule of the same layer on the same time axis.
"""

from __future__ import annotations

import html
import io
import json
from pathlib import Path

from moegraph.schedules.schedule_file import Schedule, ScheduledNode, exposed_comm
from moegraph.schedules.verify import memory_curve

__all__ = ["render", "chrome_trace", "labels", "peak_bytes", "FORMATS"]

FORMATS = (".png", ".svg", ".html", ".json")
COLOURS = {"compute": "#4C72B0", "comm": "#DD8452", "recompute": "#8172B3"}
EXPOSED = "#C44E52"


def render(sched: Schedule, path: str | Path, compare: Schedule | None = None,
           sources: tuple[str, ...] = ()) -> Path:
    """Write ``sched`` (and ``compare`` beside it) to ``path``; the suffix picks the format.
    ``sources`` (e.g. the file names) tell the panels apart where their labels would not."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot render to {path.name!r}: the suffix must be one of {', '.join(FORMATS)}")
    if suffix == ".json":
        path.write_text(json.dumps(chrome_trace(sched, compare, sources), sort_keys=True, indent=1) + "\n")
    elif suffix == ".html":
        path.write_text(_html(sched, compare, sources))
    else:
        fig = _figure(sched, compare, sources)
        fig.savefig(path, dpi=110, bbox_inches="tight", metadata=_metadata(suffix))
        import matplotlib.pyplot as plt
        plt.close(fig)
    return path


def _metadata(suffix: str) -> dict:
    # No creation dates or tool versions: the same schedule gives the same bytes.
    if suffix == ".svg":
        return {"Date": None, "Creator": None}
    return {"Software": None}


def _category(n: ScheduledNode) -> str:
    if n.phase == "recompute":
        return "recompute"
    return "comm" if n.kind == "comm" else "compute"


def labels(scheds: list[Schedule], sources: tuple[str, ...] = ()) -> list[str]:
    """One label per schedule: graph name, method and origin ("measured, rank 0" /
    "predicted"); where two would read the same, the source (file name) or the position is
    added, so compared panels and Perfetto processes never share a name."""
    out = []
    for s in scheds:
        sm = s.summary
        what = str(sm.get("method", "?"))
        if s.origin == "measured":
            what += ", measured" + (f" rank {sm['rank']}" if "rank" in sm else "")
        elif s.origin == "predicted":
            what += ", predicted"
        out.append(f"{s.graph.get('name', 'schedule')} [{what}]")
    if len(set(out)) < len(out):
        out = [f"{label} {sources[i] if i < len(sources) else f'#{i + 1}'}" for i, label in enumerate(out)]
    if len(set(out)) < len(out):
        out = [f"{label} #{i + 1}" for i, label in enumerate(out)]
    return out


def peak_bytes(s: Schedule) -> int:
    """The recorded peak memory, or (files from ``run --trace`` record none) the peak of the
    live-memory curve recomputed from the nodes."""
    peak = s.summary.get("peak_memory_bytes")
    return peak if peak is not None else max((b for _, b in memory_curve(s)), default=0)


def _title(s: Schedule, label: str) -> str:
    sm = s.summary
    bound = f"  (bound {sm['lower_bound_us']:.1f})" if "lower_bound_us" in sm else ""
    return (f"{label}  makespan {s.makespan_us:.1f} us{bound}  peak {peak_bytes(s) / 2**30:.2f} GiB  "
            f"exposed comm {sm.get('exposed_comm_us', 0):.1f} us")


def _figure(sched: Schedule, compare: Schedule | None, sources: tuple[str, ...] = ()):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scheds = [sched] + ([compare] if compare is not None else [])
    ratios = []
    for s in scheds:
        ratios += [max(1.0, 0.55 * len(s.streams)), 0.9]
    fig, axes = plt.subplots(len(ratios), 1, sharex=True, figsize=(14, 1.2 + 1.3 * sum(ratios)),
                             gridspec_kw={"height_ratios": ratios, "hspace": 0.35})
    span = max(s.makespan_us for s in scheds) or 1.0
    for k, (s, label) in enumerate(zip(scheds, labels(scheds, sources))):
        _gantt(axes[2 * k], s, span, label)
        _memory(axes[2 * k + 1], s)
    axes[-1].set_xlabel("time (us)")
    handles = [Patch(color=c, label=k) for k, c in COLOURS.items()]
    handles.append(Patch(facecolor="none", edgecolor=EXPOSED, hatch="///", label="exposed comm"))
    axes[0].legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.12), fontsize=7, ncol=4,
                   framealpha=0.8)
    return fig


def _gantt(ax, s: Schedule, span: float, label: str) -> None:
    rows = {name: i for i, name in enumerate(s.streams)}
    for n in s.nodes:
        d = n.end_us - n.start_us
        if d <= 0:
            continue
        y = rows[n.stream]
        ax.barh(y, d, left=n.start_us, height=0.7, color=COLOURS[_category(n)], edgecolor="white", linewidth=0.4)
        bar = n.name if n.kind == "compute" else f"{n.name} ({'CE' if n.sm_budget == 0 else f'{n.sm_budget} SM'})"
        room = d / span * 160  # characters that fit, roughly, at this figure width
        if room >= 4:
            text = bar if len(bar) <= room else bar[:max(int(room) - 1, 3)] + "."
            ax.text(n.start_us + d / 2, y, text, ha="center", va="center", fontsize=6, color="white", clip_on=True)
    comm_rows = [rows[x] for x in s.streams if x.startswith("comm")]
    for a, b in exposed_comm(s.nodes):
        for y in comm_rows:
            busy = [n for n in s.nodes if rows[n.stream] == y and n.start_us < b and n.end_us > a]
            for n in busy:
                lo, hi = max(a, n.start_us), min(b, n.end_us)
                ax.barh(y, hi - lo, left=lo, height=0.7, facecolor="none", edgecolor=EXPOSED, hatch="///",
                        linewidth=0.8)
    barrier = s.summary.get("barrier_us")
    if barrier:
        ax.axvline(barrier, color="black", linestyle="--", linewidth=1)
        ax.text(barrier, len(rows) - 0.45, " backward", fontsize=7, va="bottom")
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set_ylim(len(rows) - 0.4, -0.6)
    ax.set_title(_title(s, label), fontsize=9, loc="left")


def _memory(ax, s: Schedule) -> None:
    curve = memory_curve(s)
    span = s.makespan_us
    xs = [0.0] + [t for t, _ in curve] + [span]
    ys = [0.0] + [b / 2**30 for _, b in curve] + [curve[-1][1] / 2**30 if curve else 0.0]
    ax.step(xs, ys, where="post", color="#55A868", linewidth=1.2)
    ax.fill_between(xs, ys, step="post", color="#55A868", alpha=0.25)
    if s.memory_budget_bytes is not None:
        ax.axhline(s.memory_budget_bytes / 2**30, color=EXPOSED, linestyle=":", linewidth=1)
    ax.set_ylabel("GiB", fontsize=8)
    ax.set_ylim(bottom=0)


def chrome_trace(sched: Schedule, compare: Schedule | None = None, sources: tuple[str, ...] = ()) -> dict:
    """Trace Event Format: one complete ("X") event per node, streams as named threads, one
    process per schedule (named apart, see ``labels``)."""
    events = []
    scheds = [sched] + ([compare] if compare is not None else [])
    for pid, (s, label) in enumerate(zip(scheds, labels(scheds, sources))):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
        tids = {name: i for i, name in enumerate(s.streams)}
        for name, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for n in s.nodes:
            events.append({"name": n.name, "cat": _category(n), "ph": "X", "ts": n.start_us,
                           "dur": round(n.end_us - n.start_us, 6), "pid": pid, "tid": tids[n.stream],
                           "args": {"op": n.op, "phase": n.phase, "role": n.role, "sm_budget": n.sm_budget,
                                    "stream": n.stream}})
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def _summary_rows(s: Schedule) -> list[tuple[str, str]]:
    sm = s.summary
    rows = [("graph", str(s.graph.get("name"))), ("strategy", str(sm.get("strategy", ""))),
            ("method", str(sm.get("method"))), ("origin", s.origin), ("makespan (us)", f"{s.makespan_us:.2f}"),
            ("lower bound (us)", f"{sm['lower_bound_us']:.2f}" if "lower_bound_us" in sm else "-")]
    for k in ("sequential", "greedy", "megascale"):
        v = sm.get("baselines", {}).get(k)
        rows.append((f"{k} (us)", "-" if v is None else f"{v:.2f}"))
    rows += [("exposed comm (us)", f"{sm.get('exposed_comm_us', 0):.2f}"),
             ("peak memory (GiB)", f"{peak_bytes(s) / 2**30:.3f}"),
             ("memory budget (GiB)", "-" if s.memory_budget_bytes is None else f"{s.memory_budget_bytes / 2**30:.3f}"),
             ("solver status", str(sm.get("solver", {}).get("status"))),
             ("hash", s.hash[:19] + "...")]
    return rows


def _html(sched: Schedule, compare: Schedule | None, sources: tuple[str, ...] = ()) -> str:
    import matplotlib.pyplot as plt
    fig = _figure(sched, compare, sources)
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata=_metadata(".svg"))
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]  # drop the XML prolog and DOCTYPE: inline in HTML
    scheds = [sched] + ([compare] if compare is not None else [])
    tables = [_summary_rows(s) for s in scheds]
    head = "".join(f"<th>{html.escape(label)}</th>" for label in labels(scheds, sources))
    body = ""
    for i, (key, _) in enumerate(tables[0]):
        cells = "".join(f"<td>{html.escape(t[i][1])}</td>" for t in tables)
        body += f"<tr><th>{html.escape(key)}</th>{cells}</tr>\n"
    title = html.escape(str(sched.graph.get("name")))
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>schedule {title}</title>\n"
            "<style>body{font-family:sans-serif;margin:1em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:13px}</style></head>\n"
            f"<body><h2>schedule {title}</h2>\n<table><tr><th></th>{head}</tr>\n{body}</table>\n{svg}\n"
            "</body></html>\n")
