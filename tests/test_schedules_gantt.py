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
