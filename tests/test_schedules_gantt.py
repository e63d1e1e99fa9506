"""Gantt output in every format; the Chrome trace holds one complete event per node."""

import dataclasses
import json

import pytest

from moegraph.schedules import compile_graph, render
from moegraph.schedules.gantt import labels, peak_bytes
from schedules_fakes import cost_model, moe_layer

COST = cost_model()


@pytest.fixture(scope="module")
def pair():
    g = moe_layer(recompute=True)
    return (compile_graph(g, COST, time_limit_s=1.0).schedule,
            compile_graph(g, COST, method="megascale").schedule)


@pytest.mark.parametrize("ext", ["png", "svg", "html", "json"])
@pytest.mark.slow
def test_every_format(pair, tmp_path, ext):
    a, b = pair
    one = render(a, tmp_path / f"one.{ext}")
    two = render(a, tmp_path / f"two.{ext}", compare=b)
    assert one.stat().st_size > 0 and two.stat().st_size > 0
    if ext == "png":
        assert one.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if ext in ("svg", "html"):
        assert "<svg" in two.read_text()
    if ext == "html":
        text = two.read_text()
        assert "makespan (us)" in text and f"{a.summary['makespan_us']:.2f}" in text
        assert "<?xml" not in text and "http" not in text.split("<svg")[0]  # self-contained


@pytest.mark.parametrize("ext", ["svg", "html"])
def test_the_same_schedule_gives_the_same_bytes(pair, tmp_path, ext):
    """matplotlib salts an SVG's clip-path ids with a random uuid unless told otherwise: two renders
    of one schedule (compared, so several clipped axes) must be byte-identical."""
    a, b = pair
    one, two = (render(a, tmp_path / f"{i}.{ext}", compare=b).read_bytes() for i in (1, 2))
    assert b"clip-path" in one and one == two


def test_chrome_trace(pair, tmp_path):
    a, b = pair
    trace = json.loads(render(a, tmp_path / "t.json").read_text())
    assert trace["displayTimeUnit"] == "ns"
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in xs) == sorted(n.name for n in a.nodes)
    threads = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert set(threads) == set(a.streams)
    node = a.node
    for e in xs:
        n = node[e["name"]]
        assert e["ts"] == n.start_us and e["dur"] == pytest.approx(n.end_us - n.start_us)
        assert e["tid"] == threads[n.stream] and e["pid"] == 0
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
    both = json.loads(render(a, tmp_path / "c.json", compare=b).read_text())
    assert sum(e["ph"] == "X" for e in both["traceEvents"]) == 2 * len(a.nodes)


def test_unknown_format(pair, tmp_path):
    with pytest.raises(ValueError, match=r"cannot render to 'x.pdf': the suffix must be one of \.png, \.svg, "
                                         r"\.html, \.json"):
        render(pair[0], tmp_path / "x.pdf")


def _as_runtime_file(s, measured: bool):
    """`run --trace` writes no peak memory, no bound, no solver; it marks the file measured or not."""
    summary = {"method": s.summary["method"], "plan_hash": "0" * 64, "strategy": s.summary["strategy"],
               "makespan_us": s.summary["makespan_us"], "exposed_comm_us": 0.0, "measured": measured}
    if measured:
        summary.update(rank=1, device="cpu")
    return dataclasses.replace(s, summary=summary).with_hash()


@pytest.mark.parametrize("ext", ["png", "html", "json"])
@pytest.mark.slow
def test_runtime_files_render_and_compared_panels_are_named_apart(pair, tmp_path, ext):
    a, _ = pair
    measured, predicted = _as_runtime_file(a, True), _as_runtime_file(a, False)
    out = render(measured, tmp_path / f"m.{ext}", compare=predicted)
    assert out.stat().st_size > 0
    if ext == "json":
        names = [e["args"]["name"] for e in json.loads(out.read_text())["traceEvents"] if e["name"] == "process_name"]
        assert names == [f"{a.graph['name']} [cpsat, measured rank 1]", f"{a.graph['name']} [cpsat, predicted]"]
    if ext == "html":
        assert "[cpsat, measured rank 1]" in out.read_text()


def test_two_files_with_the_same_label_get_their_sources():
    a = _as_runtime_file(compile_graph(moe_layer(), COST, method="sequential").schedule, True)
    assert labels([a, a], ("run1.json", "run2.json")) == [f"moe_c1 [sequential, measured rank 1] run{i}.json"
                                                         for i in (1, 2)]
    assert len(set(labels([a, a]))) == 2


def test_peak_of_a_file_without_one_is_recomputed(pair):
    a, _ = pair
    assert peak_bytes(_as_runtime_file(a, True)) == a.summary["peak_memory_bytes"]


# Multi-layer schedules: 4 stacked synthetic layers (nodes "l{i}.<name>", attr "layer").

LAYERS = 4


@pytest.fixture(scope="module")
def layered():
    from moegraph.passes.stack import stack_layers
    return compile_graph(stack_layers(moe_layer(recompute=True), LAYERS), COST, method="greedy").schedule


def _spans(s, i):
    """(forward, backward) span of layer i, straight from the nodes (backward includes recompute)."""
    mine = [n for n in s.nodes if n.name.startswith(f"l{i}.")]
    fwd = [n for n in mine if n.phase == "forward"]
    bwd = [n for n in mine if n.phase in ("backward", "recompute")]
    assert fwd and bwd and len(fwd) + len(bwd) == len(mine)
    return ((min(n.start_us for n in fwd), max(n.end_us for n in fwd)),
            (min(n.start_us for n in bwd), max(n.end_us for n in bwd)))


def test_chrome_trace_has_one_process_per_layer_holding_its_nodes(layered, tmp_path):
    trace = json.loads(render(layered, tmp_path / "t.json").read_text())["traceEvents"]
    label = labels([layered])[0]
    procs = {e["args"]["name"]: e["pid"] for e in trace if e["name"] == "process_name"}
    assert list(procs) == [f"{label} layers"] + [f"{label} l{i}" for i in range(LAYERS)]
    assert len(set(procs.values())) == LAYERS + 1
    xs = [e for e in trace if e["ph"] == "X"]
    node = layered.node
    for i in range(LAYERS):
        pid = procs[f"{label} l{i}"]
        got = sorted(e["name"] for e in xs if e["pid"] == pid)
        assert got == sorted(n.name for n in layered.nodes if n.name.startswith(f"l{i}."))
        threads = {e["tid"]: e["args"]["name"] for e in trace if e["name"] == "thread_name" and e["pid"] == pid}
        for e in xs:
            if e["pid"] == pid:
                n = node[e["name"]]
                assert threads[e["tid"]] == n.stream and e["ts"] == n.start_us and e["args"]["layer"] == i
    # every node exactly once; the summary process holds only the layers' spans
    assert sorted(e["name"] for e in xs if e["cat"] != "layer") == sorted(n.name for n in layered.nodes)
    summary = {e["name"]: e for e in xs if e["pid"] == procs[f"{label} layers"]}
    assert all(e["cat"] == "layer" for e in summary.values()) and len(summary) == 2 * LAYERS
    for i in range(LAYERS):
        for phase, (lo, hi) in zip(("forward", "backward"), _spans(layered, i)):
            e = summary[f"l{i} {phase}"]
            assert e["ts"] == pytest.approx(lo) and e["ts"] + e["dur"] == pytest.approx(hi)


def _axes(fig, gid):
    return [ax for ax in fig.axes if ax.get_gid() == gid]


def test_summary_lane_spans_and_exposed_comm(layered):
    from moegraph.schedules.gantt import _figure
    fig = _figure(layered, None)
    (lane,) = _axes(fig, "layers")
    bars = {p.get_gid(): p for p in lane.patches if p.get_gid()}
    comm = [n for n in layered.nodes if n.kind == "comm"]
    compute = [n for n in layered.nodes if n.kind == "compute"]
    for i in range(LAYERS):
        for phase, (lo, hi) in zip(("forward", "backward"), _spans(layered, i)):
            bar = bars[f"layer{i}.{phase}"]
            assert bar.get_x() == pytest.approx(lo) and bar.get_x() + bar.get_width() == pytest.approx(hi)
            assert bar.get_y() + bar.get_height() / 2 == pytest.approx(i)  # row i is layer i
        exposed = [p for g, p in bars.items() if g.startswith(f"layer{i}.exposed")]
        assert exposed  # the synthetic layer's forward all-to-alls have nothing to hide under
        for p in exposed:
            a, b = p.get_x(), p.get_x() + p.get_width()
            mid = (a + b) / 2
            # inside one of this layer's collectives, and no compute of any layer runs then
            assert any(n.name.startswith(f"l{i}.") and n.start_us <= a + 1e-6 and b <= n.end_us + 1e-6 for n in comm)
            assert not any(n.start_us < b - 1e-6 and n.end_us > a + 1e-6 for n in compute), (i, a, b)
            assert any(n.start_us <= mid <= n.end_us for n in comm)
    assert len(bars) == sum(1 for g in bars if ".exposed" in g) + 2 * LAYERS
    import matplotlib.pyplot as plt
    plt.close(fig)


@pytest.mark.slow
def test_svg_names_the_layer_bars_and_compared_schedules_get_a_lane_each(layered, tmp_path):
    text = render(layered, tmp_path / "x.svg").read_text()
    for i in range(LAYERS):
        assert f'id="layer{i}.forward"' in text and f'id="layer{i}.backward"' in text
    from moegraph.schedules.gantt import _figure
    other = dataclasses.replace(layered, summary=layered.summary | {"method": "other"})
    fig = _figure(layered, other)
    assert [ax.get_gid() for ax in fig.axes].count("layers") == 2 and len(fig.axes) == 6
    import matplotlib.pyplot as plt
    plt.close(fig)
    trace = json.loads(render(layered, tmp_path / "c.json", compare=other).read_text())["traceEvents"]
    procs = [e["args"]["name"] for e in trace if e["name"] == "process_name"]
    assert len(procs) == len(set(procs)) == 2 * (LAYERS + 1)


def test_one_layer_chart_has_no_summary_lane(pair, tmp_path):
    from moegraph.schedules.gantt import _figure
    fig = _figure(pair[0], pair[1])
    assert not _axes(fig, "layers") and len(fig.axes) == 4  # gantt + memory per panel, as before
    trace = json.loads(render(pair[0], tmp_path / "t.json").read_text())["traceEvents"]
    assert [e["args"]["name"] for e in trace if e["name"] == "process_name"] == labels([pair[0]])
    import matplotlib.pyplot as plt
    plt.close(fig)


@pytest.mark.parametrize("which", ["one", "layered"])
@pytest.mark.slow
def test_bar_labels_are_whole_names_and_never_overlap(pair, layered, which):
    from moegraph.schedules.gantt import _figure
    s = pair[0] if which == "one" else layered
    fig = _figure(s, None)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    names = {n.name for n in s.nodes}
    texts = [t.get_text() for t in fig.axes[0].texts if t.get_text() != " backward"]
    for t in texts:
        # a whole name, or at least 8 of its characters and "." ("l1.." would read alike)
        whole = t.split(" (")[0] in names
        assert whole or (t.endswith(".") and len(t) >= 9 and any(m.startswith(t[:-1]) for m in names)), t
    if which == "one":
        assert texts  # some bars are wide enough to carry a label
    else:
        # at 4 layers no node bar has room for 8 characters of its name (~7 for "l0.fc13.wgrad"),
        # so none is labelled; the lane's layer bars are wide enough for theirs
        assert not texts
        (lane,) = _axes(fig, "layers")
        bar_texts = {t.get_text() for t in lane.texts if t.get_color() == "white"}
        assert bar_texts == {f"l{i} {p}" for i in range(LAYERS) for p in ("fwd", "bwd")}
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.texts if t.get_text().strip()]
        for k, a in enumerate(boxes):
            for b in boxes[k + 1:]:
                assert not a.overlaps(b), (ax.get_gid(), a, b)
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_partly_layered_schedule_is_refused(layered):
    from moegraph.schedules.gantt import layer_nodes
    first = layered.nodes[0]
    bad = dataclasses.replace(layered, nodes=(dataclasses.replace(first, attrs={}),) + layered.nodes[1:])
    with pytest.raises(ValueError, match=rf"node '{first.name}' has attribute 'layer' = None"):
        layer_nodes(bad)
    assert list(layer_nodes(layered)) == list(range(LAYERS))


# The gantt command on damaged files: an unknown stream is refused in verify's words; any other
# violation is drawn, with one warning line and the panel marked NOT VALID.

def _damaged(a, tmp_path, name, edit):
    """``a`` saved, then ``edit``ed as a user (or a bug) would change the JSON."""
    a.save(tmp_path / "ok.json")
    doc = json.loads((tmp_path / "ok.json").read_text())
    edit(doc)
    (tmp_path / name).write_text(json.dumps(doc))
    return tmp_path / name


def _gantt(argv, capsys):
    from moegraph.cli import main
    capsys.readouterr()
    rc = main(["gantt", *map(str, argv)])
    return rc, capsys.readouterr()


def test_gantt_refuses_a_node_on_an_unknown_stream_in_one_line(pair, tmp_path, capsys):
    a, _ = pair
    comm = next(n.name for n in a.nodes if n.kind == "comm")
    bad = _damaged(a, tmp_path, "stream.json",
                   lambda d: next(n for n in d["nodes"] if n["name"] == comm).update(stream="comm2"))
    rc, out = _gantt([bad, "-o", tmp_path / "c.png"], capsys)
    assert rc == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err
    assert f"node {comm!r} is on unknown stream 'comm2'; streams: {list(a.streams)}" in lines[0]
    assert str(bad) in lines[0] and not (tmp_path / "c.png").exists()
    # the same words as verify's
    from moegraph.schedules.schedule_file import load_schedule
    from moegraph.schedules.verify import verify_schedule
    assert next(v.message for v in verify_schedule(load_schedule(str(bad))) if v.check == "structure") in lines[0]


def test_gantt_draws_a_file_that_does_not_verify_with_a_warning_and_a_mark(pair, tmp_path, capsys):
    a, _ = pair
    dropped = a.nodes[1].name
    bad = _damaged(a, tmp_path, "drop.json",
                   lambda d: d.update(nodes=[n for n in d["nodes"] if n["name"] != dropped]))
    rc, out = _gantt([bad, "-o", tmp_path / "bad.svg"], capsys)
    assert rc == 0
    warn = out.err.strip().splitlines()
    assert len(warn) == 1 and warn[0].startswith(f"warning: {bad} does not verify: ")
    assert "more)" in warn[0]      # a dropped node breaks the hash and the coverage at least
    assert "NOT VALID" in (tmp_path / "bad.svg").read_text()
    # a valid file: no warning, no mark; compared with the damaged one only that panel is marked
    rc, out = _gantt([tmp_path / "ok.json", "-o", tmp_path / "ok.svg"], capsys)
    assert rc == 0 and out.err == "" and "NOT VALID" not in (tmp_path / "ok.svg").read_text()
    rc, out = _gantt([tmp_path / "ok.json", "--compare", bad, "-o", tmp_path / "both.json", "--json"], capsys)
    panels = json.loads(out.out)["panels"]
    assert rc == 0 and [p["valid"] for p in panels] == [True, False]
    assert not panels[0]["label"].startswith("NOT VALID") and panels[1]["label"].startswith("NOT VALID: ")
    procs = [e["args"]["name"] for e in json.loads((tmp_path / "both.json").read_text())["traceEvents"]
             if e["name"] == "process_name"]
    assert procs == [p["label"] for p in panels]


def test_overlapping_measured_nodes_keep_their_labels_apart(pair):
    """A measured file's comm row holds nodes that overlap in time (as its trace saw them): two
    labels never print over each other."""
    from moegraph.schedules.gantt import _figure
    a, _ = pair
    comm = [n for n in a.nodes if n.stream.startswith("comm") and n.end_us - n.start_us > 0]
    twins = [dataclasses.replace(n, name=n.name + ".twin", start_us=n.start_us + 0.1 * (n.end_us - n.start_us),
                                 end_us=n.end_us + 0.1 * (n.end_us - n.start_us)) for n in comm]
    measured = dataclasses.replace(_as_runtime_file(a, True), nodes=tuple(a.nodes) + tuple(twins))
    fig = _figure(measured, a)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.texts if t.get_text().strip()]
        assert all(not p.overlaps(q) for k, p in enumerate(boxes) for q in boxes[k + 1:])
    rows = {a.streams.index(n.stream) for n in comm}
    assert any(t.get_position()[1] in rows for t in fig.axes[0].texts if t.get_text().strip())   # still labelled
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_a_long_step_reads_in_seconds_without_an_axis_offset(pair):
    """tune's 12 s chart showed "1.2" under a "1e7" offset; the axis now says seconds."""
    from moegraph.schedules.gantt import _figure
    a, _ = pair
    k = 12e6 / a.makespan_us
    long = dataclasses.replace(a, nodes=tuple(dataclasses.replace(n, start_us=n.start_us * k, end_us=n.end_us * k)
                                              for n in a.nodes))
    fig = _figure(long, None)
    fig.canvas.draw()
    axis = fig.axes[-1]
    assert axis.get_xlabel() == "time (s)" and axis.xaxis.get_offset_text().get_text() == ""
    ticks = [t.get_text() for t in axis.get_xticklabels() if t.get_text()]
    assert "12" in ticks and not any("e" in t for t in ticks), ticks
    import matplotlib.pyplot as plt
    plt.close(fig)


@pytest.mark.parametrize("scale,unit", [(1, "MiB"), (2**-12, "KiB"), (4, "GiB")])
def test_the_memory_axis_reads_in_the_unit_the_peak_reaches(pair, scale, unit):
    """The axis used to be GiB whatever the size (a 160 KiB schedule read 0-0.00015). The top of
    the curve, read back off the axis in its unit, is the schedule's peak."""
    import matplotlib.pyplot as plt

    from moegraph.schedules.gantt import _figure
    s = pair[1]
    s = dataclasses.replace(s, values=tuple(dataclasses.replace(v, bytes=int(v.bytes * scale)) for v in s.values),
                            memory_budget_bytes=None, summary={k: v for k, v in s.summary.items()
                                                               if k != "peak_memory_bytes"})
    fig = _figure(s, None)
    ax = next(a for a in fig.axes if a.get_ylabel())
    assert ax.get_ylabel() == unit
    top = max(max(line.get_ydata()) for line in ax.get_lines())
    size = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    assert 1 <= top < 1024 and top * size == pytest.approx(peak_bytes(s), rel=1e-9)   # recomputed
    plt.close(fig)
