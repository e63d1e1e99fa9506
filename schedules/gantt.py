"""Draw a Schedule: Gantt chart (.png/.svg), a self-contained report (.html), or a Chrome
trace (.json, opens in Perfetto and chrome://tracing).

Renders the Schedule object and nothing else. Chart: one row per stream; bars coloured by
compute / communication / recompute; comm bars carry their SM budget ("CE" = copy engines);
communication that no compute overlaps is hatched red; a dashed line marks the
forward/backward barrier; the live-memory curve (in the largest binary unit it reaches) runs beneath. ``compare`` stacks a
second schedule of the same layer on the same time axis.

A file is drawn as it is, valid or not (a user inspects a damaged file too); ``not_valid``
marks a panel whose file the verifier rejects ("NOT VALID" in its title and label), so a chart
of a broken file is never read as a schedule. A node on a stream the file does not declare
cannot be placed on any row: ``check_drawable`` refuses it (ScheduleError) in verify's words.

Multi-layer schedules (every node carries the int attribute ``layer``, see moegraph.layers)
add a per-layer summary lane under the streams: one row per layer with its forward span, its
backward span (recompute included) and its exposed communication hatched red. In the Chrome
trace each layer is its own process (a collapsible track group in Perfetto) holding that
layer's nodes on the stream threads, after one "layers" process with each layer's forward and
backward spans. A model step's edge nodes (``moegraph.edges``: the embedding, final norm and
LM head gradient sync, attr ``edge``) form one more group, "edges", after the layers: a row
in the lane, a thread in the "layers" process and a process of their own. A one-layer schedule
has no layer attribute, so no lane and one process.

Merged micro-batch schedules (nodes carry the int attribute ``mb``, see moegraph.microbatch):
each bar takes its category's colour shaded by its micro-batch (``mb_colour``: neighbouring
micro-batches alternate dark and light, later ones lighter still), so a reader sees which
micro-batch's forward collective runs under which micro-batch's backward compute; the legend
lists the shades (step-level gradient sums and syncs darker), the bar labels keep the
``mb{j}.`` prefix, and the Chrome trace carries
``mb`` in each slice's args. No barrier line is drawn: each micro-batch has its own.
"""

from __future__ import annotations

import html
import io
import json
from pathlib import Path

from moegraph.atomic import atomic_output, write_atomic
from moegraph.cost import FUSED_ATTR, variant_of
from moegraph.edges import EDGES
from moegraph.ir import LAYER_ATTR
from moegraph.microbatch import MB_ATTR
from moegraph.options import format_bytes
from moegraph.schedules.schedule_file import (Schedule, ScheduledNode, exposed_comm, group_label, layer_exposed_comm,
                                               layer_group, per_layer_summary)
from moegraph.schedules.problem import ScheduleError
from moegraph.schedules.verify import memory_curve, unknown_stream

__all__ = ["render", "chrome_trace", "labels", "peak_bytes", "layer_nodes", "FORMATS", "mb_colour", "micro_batches",
           "check_drawable", "NOT_VALID"]

FORMATS = (".png", ".svg", ".html", ".json")
COLOURS = {"compute": "#4C72B0", "comm": "#DD8452", "recompute": "#8172B3"}
EXPOSED = "#C44E52"
LABEL_PT = 6  # bar labels' font size
CUT_MIN = 8  # a label cut short keeps at least this many characters of the node name
LAYER_COLOURS = {"forward": "#64B5CD", "backward": "#8C8C8C"}   # grey: the step's darkened comm is brown


NOT_VALID = "NOT VALID"
"""The mark a panel of a file the verifier rejects carries in its title and label."""


def check_drawable(s: Schedule, source: str = "schedule") -> None:
    """Raise ScheduleError when a node of ``s`` is on a stream ``s`` does not declare: it has no
    row to be drawn on (verify reports the same node as a structure violation)."""
    bad = [n for n in s.nodes if n.stream not in s.streams]
    if bad:
        more = f" ({len(bad) - 1} more nodes on undeclared streams)" if len(bad) > 1 else ""
        raise ScheduleError(f"{source}: cannot draw: {unknown_stream(s, bad[0])}{more}")


def render(sched: Schedule, path: str | Path, compare: Schedule | None = None,
           sources: tuple[str, ...] = (), not_valid: tuple[bool, ...] = ()) -> Path:
    """Write ``sched`` (and ``compare`` beside it) to ``path``; the suffix picks the format.
    ``sources`` (e.g. the file names) tell the panels apart where their labels would not;
    ``not_valid[i]`` marks panel i NOT VALID (module doc)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot render to {path.name!r}: the suffix must be one of {', '.join(FORMATS)}")
    for i, s in enumerate((sched, compare)):
        if s is not None:
            check_drawable(s, sources[i] if i < len(sources) else "schedule")
    # every format is written atomically (moegraph.atomic): a kill leaves the old chart or the new one
    if suffix == ".json":
        write_atomic(path, json.dumps(chrome_trace(sched, compare, sources, not_valid), sort_keys=True, indent=1)
                     + "\n")
    elif suffix == ".html":
        write_atomic(path, _html(sched, compare, sources, not_valid))
    else:
        fig = _figure(sched, compare, sources, not_valid)
        with atomic_output(path) as buf, _fixed_svg_ids():
            fig.savefig(buf, format=suffix[1:], dpi=110, bbox_inches="tight", metadata=_metadata(suffix))
        import matplotlib.pyplot as plt
        plt.close(fig)
    return path


def _fixed_svg_ids():
    """matplotlib names an SVG's clip paths by a hash salted with a random uuid unless svg.hashsalt
    is set: fixed here, so the same schedule gives the same SVG and HTML bytes."""
    import matplotlib
    return matplotlib.rc_context({"svg.hashsalt": "moegraph"})


def _metadata(suffix: str) -> dict:
    # No creation dates or tool versions: the same schedule gives the same bytes.
    if suffix == ".svg":
        return {"Date": None, "Creator": None}
    return {"Software": None}


def micro_batches(s: Schedule) -> int:
    """How many micro-batches the schedule's nodes carry (0 when none is tagged)."""
    return 1 + max((n.attrs[MB_ATTR] for n in s.nodes if n.attrs.get(MB_ATTR) is not None), default=-1)


STEP = "step"
"""``mb_colour``'s micro-batch for a merged schedule's step-level nodes (gradient sums and syncs)."""


def mb_colour(base: str, mb: int | str | None) -> str:
    """``base`` (#rrggbb) shaded for micro-batch ``mb``: odd micro-batches mixed 45% with white,
    and each pair further 10% (at most 75%), so micro-batches j and j+1 always differ
    clearly; a merged schedule's step-level nodes (``STEP``) mixed 35% with black; None (an
    unmerged schedule) keeps ``base``."""
    if mb is None:
        return base
    rgb = [int(base[i:i + 2], 16) for i in (1, 3, 5)]
    if mb == STEP:
        return "#" + "".join(f"{round(c * 0.65):02x}" for c in rgb)
    mix = min(0.75, (0.45 if mb % 2 else 0.0) + 0.10 * (mb // 2))
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in rgb)


def _bar_colour(n: ScheduledNode, merged: bool) -> str:
    mb = n.attrs.get(MB_ATTR)
    return mb_colour(COLOURS[_category(n)], STEP if merged and mb is None else mb)


def _category(n: ScheduledNode) -> str:
    if n.phase == "recompute":
        return "recompute"
    return "comm" if n.kind == "comm" else "compute"


def layer_nodes(s: Schedule) -> dict[int | str, list[ScheduledNode]] | None:
    """A multi-layer schedule's nodes by layer index (ascending), a model step's edge nodes
    (``moegraph.edges``) last as the group "edges"; None for a one-layer schedule, whose nodes
    carry no ``layer`` attribute. Raises ValueError when only some nodes carry one, or one is not
    a non-negative integer: the grouping would be wrong."""
    if not any(LAYER_ATTR in n.attrs for n in s.nodes):
        return None
    out: dict[int | str, list[ScheduledNode]] = {}
    edges: list[ScheduledNode] = []
    for n in s.nodes:
        if layer_group(n.attrs) == EDGES:
            edges.append(n)
            continue
        i = n.attrs.get(LAYER_ATTR)
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"node {n.name!r} has attribute {LAYER_ATTR!r} = {i!r}; in a multi-layer schedule "
                             "every node needs a non-negative integer layer index (or is an edge node)")
        out.setdefault(i, []).append(n)
    out = dict(sorted(out.items()))
    if edges:
        out[EDGES] = edges
    return out


def labels(scheds: list[Schedule], sources: tuple[str, ...] = (), not_valid: tuple[bool, ...] = ()) -> list[str]:
    """One label per schedule: graph name, method and origin ("measured, rank 0" /
    "predicted"); where two would read the same, the source (file name) or the position is
    added, so compared panels and Perfetto processes never share a name. A schedule flagged in
    ``not_valid`` is prefixed NOT_VALID."""
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
    return [f"{NOT_VALID}: {label}" if i < len(not_valid) and not_valid[i] else label for i, label in enumerate(out)]


def peak_bytes(s: Schedule) -> int:
    """The recorded peak memory, or (files from ``run --trace`` record none) the peak of the
    live-memory curve recomputed from the nodes."""
    peak = s.summary.get("peak_memory_bytes")
    return peak if peak is not None else max((b for _, b in memory_curve(s)), default=0)


def _title(s: Schedule, label: str) -> str:
    sm = s.summary
    bound = f"  (bound {sm['lower_bound_us']:.1f})" if "lower_bound_us" in sm else ""
    return (f"{label}  makespan {s.makespan_us:.1f} us{bound}  predicted peak {format_bytes(peak_bytes(s))}  "
            f"exposed comm {sm.get('exposed_comm_us', 0):.1f} us")


def _figure(sched: Schedule, compare: Schedule | None, sources: tuple[str, ...] = (),
            not_valid: tuple[bool, ...] = ()):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scheds = [sched] + ([compare] if compare is not None else [])
    layered = [layer_nodes(s) for s in scheds]
    ratios = []  # per schedule: streams, layer lane (multi-layer only), memory
    for s, by_layer in zip(scheds, layered):
        ratios.append(max(1.0, 0.55 * len(s.streams)))
        if by_layer is not None:
            # ~0.2 inch a layer: 32 rows of tick labels at 6 pt stay apart
            ratios.append(max(0.9, 0.15 * len(by_layer)))
        ratios.append(0.9)
    # hspace is a fraction of the mean axis height: keep the gaps ~0.45 inch however tall the lane
    fig, axes = plt.subplots(len(ratios), 1, sharex=True, figsize=(14, 1.2 + 1.3 * sum(ratios)),
                             gridspec_kw={"height_ratios": ratios, "hspace": 0.45 * len(ratios) / (1.3 * sum(ratios))})
    span = max(s.makespan_us for s in scheds) or 1.0
    axes_of = iter(axes)
    for s, label, by_layer in zip(scheds, labels(scheds, sources, not_valid), layered):
        _gantt(next(axes_of), s, span, label)
        if by_layer is not None:
            _layer_lane(next(axes_of), s, by_layer, span)
        _memory(next(axes_of), s)
    time_axis(axes[-1], span)
    most = max(micro_batches(s) for s in scheds)
    # micro-batch 0 keeps the base shade: one entry says so, where two (compute, mb0) were one colour
    handles = [Patch(color=c, label=f"{k}, mb0" if most and k == "compute" else k) for k, c in COLOURS.items()]
    handles.append(Patch(facecolor="none", edgecolor=EXPOSED, hatch="///", label="exposed comm"))
    if any(by_layer is not None for by_layer in layered):
        handles += [Patch(color=c, label=f"layer {k}") for k, c in LAYER_COLOURS.items()]
    handles += [Patch(color=mb_colour(COLOURS["compute"], j), label=f"mb{j}") for j in range(1, most)]
    if most:
        handles.append(Patch(color=mb_colour(COLOURS["comm"], STEP), label="step (grad sync)"))
    axes[0].legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.12), fontsize=7, ncol=len(handles),
                   framealpha=0.8)
    return fig


def time_axis(ax, span_us: float) -> None:
    """Label the shared time axis in the unit that reads at this span (us, ms, s), with plain
    tick numbers: matplotlib's default offset notation drew a 12 s step as "1.2" under "1e7"."""
    from matplotlib.ticker import FuncFormatter
    unit, scale = next((u, f) for u, f in (("s", 1e6), ("ms", 1e3), ("us", 1.0)) if span_us >= 10 * f or f == 1.0)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / scale:,.6g}"))
    ax.set_xlabel(f"time ({unit})")


def _layer_lane(ax, s: Schedule, by_layer: dict[int, list[ScheduledNode]], span: float) -> None:
    """One row per layer: forward span, backward span (recompute included), the layer's exposed
    communication hatched; its exposed total (us) at the right. Bars carry gid
    ``layer{i}.forward`` / ``layer{i}.backward`` / ``layer{i}.exposed`` (ids in the SVG)."""
    totals = {row["layer"]: row for row in per_layer_summary(s)}
    compute = [n for n in s.nodes if n.kind == "compute"]
    chars_per_us = _chars_per_us(ax, span)
    rows = list(by_layer)
    for y, i in enumerate(rows):
        row = totals[i]
        for phase, key in (("forward", "forward_us"), ("backward", "backward_us")):
            if not row[key]:
                continue
            lo, hi = row[key]
            bar = ax.barh(y, hi - lo, left=lo, height=0.72, color=LAYER_COLOURS[phase], edgecolor="white",
                          linewidth=0.3)
            bar.patches[0].set_gid(f"layer{i}.{phase}")
            text = f"{group_label(i)} {'fwd' if phase == 'forward' else 'bwd'}"
            if (hi - lo) * chars_per_us >= len(text) + 1:  # label only bars wide enough for it
                ax.text((lo + hi) / 2, y, text, ha="center", va="center", fontsize=LABEL_PT, color="white",
                        clip_on=True)
        for k, (a, b) in enumerate(layer_exposed_comm(compute, by_layer[i])):
            bar = ax.barh(y, b - a, left=a, height=0.72, facecolor="none", edgecolor=EXPOSED, hatch="////",
                          linewidth=0.6)
            bar.patches[0].set_gid(f"layer{i}.exposed{k}")
        ax.text(1.003, y, f"{row['exposed_comm_us']:.0f}", transform=ax.get_yaxis_transform(), fontsize=6,
                va="center", ha="left", color=EXPOSED)
    ax.text(1.003, -0.9, "exposed\nus", transform=ax.get_yaxis_transform(), fontsize=6, va="bottom", ha="left",
            color=EXPOSED)
    step = max(1, -(-len(rows) // 40))  # at most ~40 tick labels, however many layers
    ax.set_yticks(range(0, len(rows), step), [group_label(i) for i in rows[::step]], fontsize=6)
    ax.set_ylim(len(rows) - 0.4, -0.6)
    ax.set_ylabel("layers", fontsize=8)
    ax.set_gid("layers")


def _chars_per_us(ax, span: float) -> float:
    """How many 6 pt characters fit in one microsecond of ``ax``'s width (DejaVu Sans averages
    ~0.62 em a character; the overlap test measures the real extents)."""
    width_pt = ax.get_position().width * ax.figure.get_figwidth() * 72
    return width_pt / (0.62 * LABEL_PT) / span


def _gantt(ax, s: Schedule, span: float, label: str) -> None:
    rows = {name: i for i, name in enumerate(s.streams)}
    chars_per_us = _chars_per_us(ax, span)
    merged = micro_batches(s) > 0
    label_end: dict[int, float] = {}       # row -> where its last label's text ends (us)
    for n in sorted(s.nodes, key=lambda n: (n.start_us, n.end_us)):
        d = n.end_us - n.start_us
        if d <= 0:
            continue
        y = rows[n.stream]
        ax.barh(y, d, left=n.start_us, height=0.7, color=_bar_colour(n, merged), edgecolor="white", linewidth=0.4)
        text = _bar_text(n, room=d * chars_per_us)
        half = (len(text) + 1) / chars_per_us / 2
        # measured files overlap nodes on one row (a stream's kernels as the trace saw them):
        # a label that would run into the previous one on its row is left out
        if text and n.start_us + d / 2 - half >= label_end.get(y, -float("inf")):
            ax.text(n.start_us + d / 2, y, text, ha="center", va="center", fontsize=LABEL_PT, color="white",
                    clip_on=True)
            label_end[y] = n.start_us + d / 2 + half
    comm_rows = [rows[x] for x in s.streams if x.startswith("comm")]
    for a, b in exposed_comm(s.nodes):
        for y in comm_rows:
            busy = [n for n in s.nodes if rows[n.stream] == y and n.start_us < b and n.end_us > a]
            for n in busy:
                lo, hi = max(a, n.start_us), min(b, n.end_us)
                ax.barh(y, hi - lo, left=lo, height=0.7, facecolor="none", edgecolor=EXPOSED, hatch="///",
                        linewidth=0.8)
    barrier = s.summary.get("barrier_us")
    if barrier and not micro_batches(s):
        ax.axvline(barrier, color="black", linestyle="--", linewidth=1)
        ax.text(barrier, len(rows) - 0.45, " backward", fontsize=7, va="bottom")
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set_ylim(len(rows) - 0.4, -0.6)
    ax.set_title(_title(s, label), fontsize=9, loc="left")


def _bar_text(n: ScheduledNode, room: float) -> str:
    """The bar's label if it fits in ``room`` characters: name and SM budget, else the name,
    else its first CUT_MIN or more characters and ".", else nothing. Never shorter: at model
    scale short cuts ("l1..") read alike."""
    full = n.name if n.kind == "compute" else f"{n.name} ({'CE' if n.sm_budget == 0 else f'{n.sm_budget} SM'})"
    if FUSED_ATTR in n.attrs:  # predicted as (part of) a fused kernel, run by the runtime as its members
        full = f"{n.name} (fused {dict(n.attrs[FUSED_ATTR])['kind']})"  # a file holds it as [key, value] pairs
    keep = int(room) - 2  # characters before the "." with one to spare
    return next((t for t in (full, n.name) if len(t) + 1 <= room),
                n.name[:keep] + "." if keep >= CUT_MIN else "")


def _memory(ax, s: Schedule) -> None:
    curve = memory_curve(s)
    span = s.makespan_us
    # the axis in the largest binary unit the curve (or the budget line) reaches: a KiB-sized
    # schedule reads 0-160 KiB, not 0-0.00015 GiB
    top = max([b for _, b in curve] + [s.memory_budget_bytes or 0, 1])
    unit, size = next((u, v) for u, v in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if top >= v)
    xs = [0.0] + [t for t, _ in curve] + [span]
    ys = [0.0] + [b / size for _, b in curve] + [curve[-1][1] / size if curve else 0.0]
    ax.step(xs, ys, where="post", color="#55A868", linewidth=1.2)
    ax.fill_between(xs, ys, step="post", color="#55A868", alpha=0.25)
    if s.memory_budget_bytes is not None:
        ax.axhline(s.memory_budget_bytes / size, color=EXPOSED, linestyle=":", linewidth=1)
    ax.set_ylabel(unit, fontsize=8)
    ax.set_ylim(bottom=0)


def chrome_trace(sched: Schedule, compare: Schedule | None = None, sources: tuple[str, ...] = (),
                 not_valid: tuple[bool, ...] = ()) -> dict:
    """Trace Event Format: one complete ("X") event per node, streams as named threads, one
    process per schedule (named apart, see ``labels``). A multi-layer schedule is one process
    per layer instead ("<label> l3", a collapsible track group in Perfetto) holding that
    layer's nodes on the stream threads, after a "<label> layers" process with one thread per
    layer and its forward and backward spans (cat "layer")."""
    events = []
    scheds = [sched] + ([compare] if compare is not None else [])
    pid = 0

    def process(name: str) -> int:
        nonlocal pid
        pid += 1
        events.append({"name": "process_name", "ph": "M", "pid": pid - 1, "tid": 0, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid - 1, "tid": 0,
                       "args": {"sort_index": pid - 1}})
        return pid - 1

    def threads(p: int, names) -> dict[str, int]:
        tids = {name: i for i, name in enumerate(names)}
        for name, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": p, "tid": tid, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": p, "tid": tid, "args": {"sort_index": tid}})
        return tids

    def slices(p: int, tids: dict[str, int], nodes) -> None:
        for n in nodes:
            events.append({"name": n.name, "cat": _category(n), "ph": "X", "ts": n.start_us,
                           "dur": round(n.end_us - n.start_us, 6), "pid": p, "tid": tids[n.stream],
                           "args": {"op": n.op, "phase": n.phase, "role": n.role, "sm_budget": n.sm_budget,
                                    "stream": n.stream, "variant": variant_of(n.attrs),
                                    **{k: n.attrs[k] for k in (LAYER_ATTR, MB_ATTR)
                                       if n.attrs.get(k) is not None}}})

    for s, label in zip(scheds, labels(scheds, sources, not_valid)):
        by_layer = layer_nodes(s)
        if by_layer is None:
            p = process(label)
            slices(p, threads(p, s.streams), s.nodes)
            continue
        p = process(f"{label} layers")
        tids = threads(p, [group_label(i) for i in by_layer])
        for row in per_layer_summary(s):
            for phase, key in (("forward", "forward_us"), ("backward", "backward_us")):
                if row[key]:
                    lo, hi = row[key]
                    events.append({"name": f"{group_label(row['layer'])} {phase}", "cat": "layer", "ph": "X",
                                   "ts": lo, "dur": round(hi - lo, 6), "pid": p, "tid": tids[group_label(row['layer'])],
                                   "args": {k: v for k, v in row.items() if k not in ("forward_us", "backward_us")}})
        for i, mine in by_layer.items():
            p = process(f"{label} {group_label(i)}")
            slices(p, threads(p, s.streams), mine)
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
             ("peak memory", format_bytes(peak_bytes(s))),
             ("memory budget", "-" if s.memory_budget_bytes is None else format_bytes(s.memory_budget_bytes)),
             ("solver status", str(sm.get("solver", {}).get("status"))),
             ("hash", s.hash[:19] + "...")]
    return rows


def _html(sched: Schedule, compare: Schedule | None, sources: tuple[str, ...] = (),
          not_valid: tuple[bool, ...] = ()) -> str:
    import matplotlib.pyplot as plt
    fig = _figure(sched, compare, sources, not_valid)
    buf = io.StringIO()
    with _fixed_svg_ids():
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata=_metadata(".svg"))
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]  # drop the XML prolog and DOCTYPE: inline in HTML
    scheds = [sched] + ([compare] if compare is not None else [])
    tables = [_summary_rows(s) for s in scheds]
    head = "".join(f"<th>{html.escape(label)}</th>" for label in labels(scheds, sources, not_valid))
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
