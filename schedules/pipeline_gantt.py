"""Gantt chart of a pipeline step's timeline (moegraph.schedules.pipeline.Timeline).

One lane group per pipeline rank, top to bottom, each of three rows:

    r<k>        its compute: F, I, W, B bars (stage colour shade by kind; label "<stage>F<mb>" where
                it fits), F&B pairs in one bar, the optimizer step; idle time (the bubble) shaded grey
    r<k> send   the transfers it sends, on the link to their receiver (forward blue, backward orange)
    r<k> dp     its stages' gradient syncs

Labels appear only where the bar holds them, so the chart stays readable at P=16 (48 rows); the
title carries the step, the bubble and the exposed communication (``Timeline.summary``).
"""

from __future__ import annotations

from pathlib import Path

from moegraph.atomic import atomic_output
from moegraph.schedules.gantt import LABEL_PT, _chars_per_us, time_axis
from moegraph.schedules.pipeline import Pair, Timeline

__all__ = ["render_pipeline", "pipeline_figure", "KIND_COLOURS", "BUBBLE"]

KIND_COLOURS = {"F": "#4C72B0", "I": "#DD8452", "W": "#55A868", "B": "#C44E52", "pair": "#8172B3",
                "optimizer": "#333333", "fwd": "#4C72B0", "bwd": "#DD8452", "sync": "#937860"}
BUBBLE = "#DDDDDD"


def pipeline_figure(t: Timeline, title: str = ""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    P = len(t.orders)
    tick = t.problem.tick_us
    span = t.makespan * tick or 1.0
    fig, ax = plt.subplots(figsize=(16, 1.5 + 0.55 * P))
    cpu = _chars_per_us(ax, span)
    rows = []
    for r in range(P):
        y = 3 * r
        rows += [(y, f"r{r}"), (y + 1, f"r{r} send"), (y + 2, f"r{r} dp")]
        busy = sorted((t.start[i], t.end[i]) for i in t.orders[r]) + [t.optimizer[r]]
        last = 0
        for a, b in sorted(busy):
            if a > last:                                   # idle compute: the bubble
                ax.barh(y, (a - last) * tick, left=last * tick, height=0.9, color=BUBBLE, linewidth=0)
            last = max(last, b)
        if last < t.makespan:
            ax.barh(y, (t.makespan - last) * tick, left=last * tick, height=0.9, color=BUBBLE, linewidth=0)
        for item in t.orders[r]:
            kind = "pair" if isinstance(item, Pair) else item.kind
            _bar(ax, y, t.start[item] * tick, t.end[item] * tick, KIND_COLOURS[kind], str(item), cpu)
        a, b = t.optimizer[r]
        _bar(ax, y, a * tick, b * tick, KIND_COLOURS["optimizer"], "opt", cpu)
        for s in t.problem.layout.stages_of(r):
            a, b = t.sync[s]
            _bar(ax, y + 2, a * tick, b * tick, KIND_COLOURS["sync"], f"sync s{s}", cpu)
    for x in t.transfers:
        _bar(ax, 3 * x.link[0] + 1, x.start * tick, x.end * tick, KIND_COLOURS[x.direction],
             f"{x.stage}->{x.link[1]} mb{x.mb}", cpu)
    ax.set_yticks([y for y, _ in rows], [name for _, name in rows], fontsize=6)
    ax.set_ylim(3 * P - 0.4, -0.6)
    ax.set_xlim(0, span)
    time_axis(ax, span)
    s = t.summary()
    # one entry per colour: a transfer wears its action's colour (F's sends, I's and B's returns)
    by_colour: dict[str, list[str]] = {}
    for kind, colour in KIND_COLOURS.items():
        by_colour.setdefault(colour, []).append(f"{kind} send" if kind in ("fwd", "bwd") else kind)
    handles = [Patch(color=c, label=", ".join(names)) for c, names in by_colour.items()]
    handles.append(Patch(color=BUBBLE, label="bubble"))
    legend = ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=len(handles))
    # The title goes on its own line above the legend's row, whatever its length: its pad is how far
    # the drawn legend reaches above the axes (points), so the two never share a line.
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend_pt = (legend.get_window_extent(renderer).y1 - ax.get_window_extent(renderer).y1) * 72 / fig.dpi
    ax.set_title(f"{title}  step {s['step_us'] / 1e3:,.2f} ms, bubble {s['bubble_fraction']:.1%}, exposed p2p "
                 f"(max rank) {max(s['exposed_p2p_us']) / 1e3:,.2f} ms, exposed sync {s['exposed_sync_us'] / 1e3:,.2f} ms",
                 fontsize=9, loc="left", pad=legend_pt + 4)
    return fig


def _bar(ax, y: int, a: float, b: float, colour: str, text: str, chars_per_us: float) -> None:
    if b <= a:
        return
    ax.barh(y, b - a, left=a, height=0.8, color=colour, edgecolor="white", linewidth=0.3)
    if (b - a) * chars_per_us >= len(text) + 1:
        ax.text((a + b) / 2, y, text, ha="center", va="center", fontsize=LABEL_PT, color="white", clip_on=True)


def render_pipeline(t: Timeline, path: str | Path, title: str = "") -> Path:
    """Write the chart (.png or .svg)."""
    import matplotlib.pyplot as plt
    path = Path(path)
    if path.suffix not in (".png", ".svg"):
        raise ValueError(f"{path}: a pipeline chart is .png or .svg, not {path.suffix or 'no suffix'}")
    fig = pipeline_figure(t, title)
    with atomic_output(path) as buf:                 # a kill leaves the old chart or this one
        fig.savefig(buf, format=path.suffix[1:], dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
