"""`moegraph run`: launches ranks, measures, checks against eager, writes traces; one-line errors."""

from __future__ import annotations

import importlib.util
import json

import pytest

from moegraph.cli import main

HAS_SCHEDULER = importlib.util.find_spec("moegraph.schedules.api") is not None


def test_run_checks_measures_and_writes_traces(capsys, tmp_path):
    out = tmp_path / "measured.json"
    rc = main(["run", "--n", "2", "--steps", "2", "--schedule", "greedy", "--check", "--compare-prediction",
               "--trace", str(out), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 2 and report["schedule"] == "greedy" and report["n"] == 2
    assert report["model"] == "tiny" and report["hardware"] == "cpu-2core-gloo" and report["seq"] == 128
    assert report["step_us"] > 0 and len(report["step_us_all"]) == 2
    assert report["max_rel_err_output"] < 1e-5 and report["max_rel_err_grads"] < 1e-5
    pred = report["prediction"]
    assert pred["total"]["predicted_us"] > 0 and len(pred["nodes"]) > 10
    # the executor's host time per node (CPU: kernels included, collective waits not): within a step
    assert 0 < report["host_us_per_node"] * len(pred["nodes"]) <= max(report["step_us_all"])
    assert report["cuda_graphs"] == "off" and report["per_node_traces"] is True       # runtime.cudagraph
    assert report["expert_rows"] == "exact" and report["padded_rows_extra_bytes"] == 0   # moegraph.kernels
    sched = json.loads(out.read_text())
    assert sched["measured"] is True and sched["summary"]["plan_hash"] == report["plan_hash"] and sched["nodes"]
    predicted = json.loads(out.with_suffix(".predicted.json").read_text())
    assert predicted["measured"] is False
    assert [n["name"] for n in predicted["nodes"]] == [n["name"] for n in sched["nodes"]]
    chrome = json.loads(out.with_suffix(".chrome.json").read_text())
    assert {e["pid"] for e in chrome["traceEvents"]} == {0, 1}


@pytest.mark.skipif(not HAS_SCHEDULER, reason="moegraph.schedules.api (CP-SAT scheduler) not available yet")
def test_run_with_the_cpsat_schedule(capsys):
    assert main(["run", "--n", "2", "--steps", "1", "--schedule", "cpsat", "--time-limit", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"] == "cpsat"


def test_run_takes_model_strategy_and_passes_from_a_schedule_file(capsys, tmp_path):
    sched = tmp_path / "tp.json"
    assert main(["compile", "--model", "tiny", "--hardware", "cpu-2core-gloo", "--attn", "tp", "--ffn", "tp",
                 "--n", "2", "--seq", "64", "--dtype", "fp32", "--passes", "sar=paper", "--schedule", "greedy",
                 "-o", str(sched)]) == 0
    capsys.readouterr()
    assert main(["run", "--schedule", str(sched), "--steps", "1", "--warmup", "0", "--check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["model"], report["hardware"], report["seq"], report["n"]) == ("tiny", "cpu-2core-gloo", 64, 2)
    assert report["strategy"]["attn"] == "tp" and report["strategy"]["ffn"] == "tp"
    assert report["strategy"]["passes"] == ["sar=paper"] and report["schedule"] == "greedy"
    assert report["max_rel_err_output"] < 1e-5 and report["max_rel_err_grads"] < 1e-5
    file = json.loads(sched.read_text())
    starts = {n["name"]: n["start_us"] for n in file["nodes"]}
    assert report["predicted_step_us"] == pytest.approx(max(n["end_us"] for n in file["nodes"]) - min(starts.values()),
                                                        abs=0.1)
