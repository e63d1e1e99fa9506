"""`moegraph run`: launches ranks, measures, checks against eager, writes traces; one-line errors."""

from __future__ import annotations

import json

import pytest

from moegraph.cli import main
from moegraph.options import format_bytes

@pytest.mark.slow
def test_run_checks_measures_and_writes_traces(capfd, tmp_path):
    out = tmp_path / "measured.json"
    rc = main(["run", "--n", "2", "--steps", "2", "--schedule", "greedy", "--check", "--compare-prediction",
               "--trace", str(out), "--json", "--memory-budget", "100MiB"])
    assert rc == 0
    captured = capfd.readouterr()           # fd level: rank 0's progress lines come from its own process
    report = json.loads(captured.out)
    progress = [line for line in captured.err.splitlines() if line.startswith("run [")]
    for fragment in ("planned: schedule greedy", "starting 2 gloo ranks", "1 warm-up step", "step 1/2: ",
                     "step 2/2: ", "checking output and gradients"):
        assert any(fragment in line for line in progress), (fragment, captured.err)
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
    # memory: the plan's predicted peak is the predicted file's own (recomputed from its times by
    # the schedules' accounting), made under the run's budget, which that file records; no CPU measurement
    from moegraph.schedules.gantt import _figure, peak_bytes
    from moegraph.schedules.schedule_file import Schedule
    from moegraph.schedules.verify import verify_schedule
    predicted_file = Schedule.load(out.with_suffix(".predicted.json"))
    assert report["predicted_peak_bytes"] == peak_bytes(predicted_file) > 0
    assert report["memory_budget_bytes"] == predicted["memory_budget_bytes"] == 100 * 2**20
    assert report["measured_peak_bytes"] is None and "checked_memory_budget_bytes" not in report
    assert not verify_schedule(predicted_file)
    # the measured file's Gantt title: the peak it shows is the model's accounting, not a measurement
    fig = _figure(Schedule.load(out), None)
    assert any("predicted peak " in ax.get_title(loc="left") for ax in fig.axes)
    chrome = json.loads(out.with_suffix(".chrome.json").read_text())
    assert {e["pid"] for e in chrome["traceEvents"]} == {0, 1}
    # 2 steps: no step took the median time; the trace is the faster middle step, and says so
    assert report["trace"]["step_us"] == min(report["step_us_all"]) and report["trace"]["of_steps"] == 2


def test_the_traced_step_is_a_median_step_and_the_report_names_it():
    from moegraph.runtime.report import format_report
    from moegraph.runtime.trace import traced_step
    assert traced_step([315.7e3, 203.2e3]) == 1               # even: the faster middle step
    assert traced_step([9.0, 1.0, 5.0]) == 2                  # odd: the median itself
    assert traced_step([4.0, 3.0, 2.0, 1.0]) == 2
    report = {"model": "tiny", "hardware": "cpu", "backend": "gloo", "n": 2, "batch": 1, "seq": 8,
              "strategy": {"attn": "sp", "ffn": "ep", "dispatch": "a2a", "dtype": "fp32", "passes": []},
              "schedule": "greedy", "plan_hash": "0" * 64, "steps": 2, "warmup": 1, "step_us": 259467.0,
              "step_us_min": 203200.0, "step_us_max": 315700.0,
              "trace": {"schedule": "t.json", "chrome": "t.chrome.json", "step": 1, "step_us": 203200.0,
                        "of_steps": 2}}
    assert "trace of step 1 (203.200 ms, the faster of the two middle steps of 2)" in format_report(report)
    report["trace"].update(step=2, step_us=259467.0, of_steps=3)
    assert "trace of step 2 (259.467 ms, the median step)" in format_report(report)


def test_run_reports_memory_predicted_and_measured_only_where_measured():
    """The text report's memory line: the plan's predicted peak and budget; on the CPU no measured
    number at all, on CUDA the largest rank's allocator peak (``memory_report``)."""
    from moegraph.runtime.report import format_report
    from moegraph.runtime.device_memory import memory_report
    from moegraph.runtime.plan import ExecutionPlan
    plan = ExecutionPlan("greedy", (), "0" * 64, peak_memory_bytes=3 * 2**20, memory_budget_bytes=4 * 2**20)
    report = {"model": "tiny", "hardware": "cpu", "backend": "gloo", "n": 2, "batch": 1, "seq": 8,
              "strategy": {"attn": "sp", "ffn": "ep", "dispatch": "a2a", "dtype": "fp32", "passes": []},
              "schedule": "greedy", "plan_hash": "0" * 64, "steps": 2, "warmup": 1, "step_us": 2.0,
              "step_us_min": 1.0, "step_us_max": 3.0}
    ranks = [{"plans": [{"device_peak_bytes": 7 * 2**20, "device_resident_bytes": 2 * 2**20}]},
             {"plans": [{"device_peak_bytes": 9 * 2**20, "device_resident_bytes": 1 * 2**20}]}]
    cpu = format_report({**report, **memory_report(plan, ranks, "cpu")})
    assert ("memory: predicted peak 3.00MiB of live values, parameters and their gradients not counted (made under "
            "a budget of 4.00MiB); measured peak: not available on CPU") in cpu
    gpu = memory_report(plan, ranks, "cuda", checked_budget=5 * 2**20)
    assert (gpu["measured_peak_bytes"], gpu["measured_resident_bytes"]) == (9 * 2**20, 2 * 2**20)
    text = format_report({**report, **gpu})
    assert "within --memory-budget 5.00MiB); measured peak 9.00MiB (torch.cuda.max_memory_allocated" in text
    assert "2.00MiB of it allocated before the steps" in text


def test_device_memory_takes_each_blocks_peak_from_a_reset_statistic(monkeypatch):
    """``DeviceMemory.measure``: the allocator's peak statistic is reset as each block begins (an
    earlier block's or the warm-up's peak does not count), and the largest block peak is kept."""
    import torch

    from moegraph.runtime.device_memory import DeviceMemory
    alloc = {"now": 100, "peak": 10_000}           # a warm-up peak the measured steps never reach

    def reset():
        alloc["peak"] = alloc["now"]

    def step(extra):
        alloc["peak"] = max(alloc["peak"], alloc["now"] + extra)
        return [1.0]
    for name, fn in (("synchronize", lambda: None), ("reset_peak_memory_stats", reset),
                     ("memory_allocated", lambda: alloc["now"]), ("max_memory_allocated", lambda: alloc["peak"])):
        monkeypatch.setattr(torch.cuda, name, fn)
    mem = DeviceMemory()
    assert mem.measure(lambda: step(500)) == [1.0]
    alloc["now"] = 50
    mem.measure(lambda: step(200))
    assert (mem.peak_bytes, mem.resident_bytes) == (600, 100)


@pytest.mark.slow
def test_run_with_the_cpsat_schedule(capsys):
    assert main(["run", "--n", "2", "--steps", "1", "--schedule", "cpsat", "--time-limit", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"] == "cpsat"


@pytest.mark.slow
def test_run_trains_the_model_step_a_multi_layer_compile_wrote(capsys, tmp_path):
    """compile --layers 2 schedules the model step (layers + embedding and LM head): run --schedule
    runs it, as the model trained under the file's plan, in the file's dtype, against eager."""
    sched = tmp_path / "two.json"
    assert main(["compile", "--model", "small", "--layers", "2", "--hardware", "cpu-2core-gloo", "--n", "2",
                 "--seq", "32", "--dtype", "fp32", "--schedule", "sequential", "-o", str(sched)]) == 0
    capsys.readouterr()
    assert main(["run", "--schedule", str(sched), "--steps", "1", "--check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["model"], report["layers"], report["vocab"], report["train_steps"]) == ("small", 2, 32000, 1)
    assert report["schedule"] == "sequential" and report["seq"] == 32 and report["strategy"]["dtype"] == "fp32"
    assert report["max_rel_err_loss"] < 1e-5 and report["max_rel_err_grads"] < 1e-4
    assert report["predicted_peak_bytes"] == json.loads(sched.read_text())["summary"]["peak_memory_bytes"]
    assert main(["run", "--schedule", str(sched), "--layers", "3"]) == 2
    assert "--layers 3 does not match the schedule file" in capsys.readouterr().err


@pytest.mark.slow
def test_run_takes_model_strategy_and_passes_from_a_schedule_file(capsys, tmp_path):
    sched = tmp_path / "tp.json"
    assert main(["compile", "--model", "tiny", "--hardware", "cpu-2core-gloo", "--attn", "tp", "--ffn", "tp",
                 "--n", "2", "--seq", "64", "--dtype", "fp32", "--passes", "sar=paper", "--schedule", "greedy",
                 "-o", str(sched)]) == 0
    capsys.readouterr()
    peak = json.loads(sched.read_text())["summary"]["peak_memory_bytes"]
    # a --memory-budget the file's predicted peak fits (exactly) runs the file; one byte less is refused
    assert main(["run", "--schedule", str(sched), "--memory-budget", str(peak - 1)]) == 2
    assert f"is below the predicted peak {format_bytes(peak)} of --schedule" in capsys.readouterr().err
    assert main(["run", "--schedule", str(sched), "--steps", "1", "--warmup", "0", "--check", "--json",
                 "--memory-budget", str(peak)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["predicted_peak_bytes"] == report["checked_memory_budget_bytes"] == peak
    assert report["memory_budget_bytes"] is None and report["measured_peak_bytes"] is None
    assert (report["model"], report["hardware"], report["seq"], report["n"]) == ("tiny", "cpu-2core-gloo", 64, 2)
    assert "prediction_note" not in report                  # priced for this kind of machine: no note
    assert report["strategy"]["attn"] == "tp" and report["strategy"]["ffn"] == "tp"
    assert report["strategy"]["passes"] == ["sar=paper"] and report["schedule"] == "greedy"
    assert report["max_rel_err_output"] < 1e-5 and report["max_rel_err_grads"] < 1e-5
    file = json.loads(sched.read_text())
    starts = {n["name"]: n["start_us"] for n in file["nodes"]}
    assert report["predicted_step_us"] == pytest.approx(max(n["end_us"] for n in file["nodes"]) - min(starts.values()),
                                                        abs=0.1)


def test_gpu_sized_layers_on_cpu_ranks_are_refused_by_memory():
    """The audit's case: the demo's mixtral-8x7b file on 8 gloo ranks of a 22 GiB machine (a rank
    was SIGKILLed after 116 s); the tiny default layer fits."""
    from moegraph.options import UsageError
    from moegraph.registry import load_model
    from moegraph.runtime.device_memory import check_rank_memory
    mixtral, gib = load_model("mixtral-8x7b"), 2**30
    with pytest.raises(UsageError, match=r"--n 8 gloo ranks on this machine's CPU would hold at least 4\d\.\d\dGiB: "
                                         r"each rank builds a mixtral-8x7b layer in fp32 \(5\.\d\dGiB\)"):
        check_rank_memory(mixtral, 1, 8, what="--n 8 gloo ranks", available=22 * gib)
    check_rank_memory(mixtral, 1, 8, what="--n 8 gloo ranks", available=64 * gib)
    check_rank_memory(load_model("tiny"), 1, 2, what="--n 2 gloo ranks", available=1 * gib)


def test_docs_state_run_timeout_default():
    """docs/runtime.md ("Safety") names `moegraph run --timeout`'s real default."""
    import re
    from pathlib import Path

    from moegraph.cli import build_parser
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    default = run.get_default("timeout")
    text = " ".join((Path(__file__).parents[1] / "docs" / "runtime.md").read_text().split())
    said = re.search(r"`moegraph run --timeout`, default (\d+) s", text)
    assert said and float(said.group(1)) == default, (said, default)


@pytest.mark.slow
def test_run_rebuilds_a_schedule_files_graph_from_its_typed_strategy(capsys, tmp_path, monkeypatch):
    """run --schedule FILE rebuilds the file's graph from its typed strategy (gate, chunks,
    compress, remat, fuse: the driver with passes=RECORDED), never by joining the recorded pass
    labels into a pipeline string and parsing it back; the graph digest check passes and the
    report keeps the file's record of the passes."""
    import moegraph.passes.manager as manager
    sched = tmp_path / "typed.json"
    assert main(["compile", "--model", "tiny", "--hardware", "cpu-2core-gloo", "--n", "2", "--seq", "64",
                 "--dtype", "fp32", "--passes", "fuse=all,sar=paper,compress=tp-fp8,chunk=2,gate-reorder",
                 "--schedule", "greedy", "-o", str(sched)]) == 0
    capsys.readouterr()
    st = json.loads(sched.read_text())["graph"]["strategy"]
    assert (st["gate"], st["chunks"], st["compress"], st["remat"], st["fuse"]) == ("before-fc2", 2, "tp-fp8", "paper",
                                                                                   "all")

    def no_strings(spec):
        raise AssertionError(f"run parsed a pipeline string {spec!r}")
    monkeypatch.setattr(manager, "parse_passes", no_strings)
    assert main(["run", "--schedule", str(sched), "--steps", "1", "--warmup", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["strategy"]["passes"] == ["gate-reorder", "chunk=2", "compress=tp-fp8", "sar=paper", "fuse=all"]
    assert report["fused_groups"] > 0


@pytest.mark.parametrize("field", ["ep_nodes", "attn_nodes"])
def test_a_schedule_file_from_before_the_node_fields_still_describes_its_graph(tmp_path, field):
    """Files written before Strategy.ep_nodes (or attn_nodes) existed hold no such key, and their graph
    digest was taken without it: the graph lowered from them today is still the one they schedule (a flat
    dispatch, the attention on all n ranks), while a file claiming another value is a different graph."""
    from moegraph.config import RECORDED, CompileConfig
    from moegraph.ir import Strategy
    from moegraph.runtime import PlanError
    from moegraph.runtime.schedule_check import check_same_graph
    from moegraph.schedules.driver import lower
    from moegraph.schedules.schedule_file import Schedule
    path = tmp_path / "old.json"
    assert main(["compile", "--model", "tiny", "--hardware", "cpu-gloo", "--n", "2", "--seq", "64", "--dtype", "fp32",
                 "--dispatch", "a2a", "--schedule", "greedy", "-o", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["graph"]["strategy"].pop(field) == 1                       # as written before the field
    old = Schedule.from_json(json.dumps(doc))
    strategy = Strategy.from_dict(doc["graph"]["strategy"])
    graph = lower(CompileConfig(model="tiny", strategy=strategy, passes=RECORDED, seq=64, hardware="cpu-gloo")).graph
    check_same_graph(graph, old, path)                                    # no PlanError
    doc["graph"]["strategy"][field] = 2
    with pytest.raises(PlanError, match="different graph"):
        check_same_graph(graph, Schedule.from_json(json.dumps(doc)), path)


@pytest.mark.slow
def test_run_of_a_gpu_priced_schedule_on_the_cpu_says_whose_prediction_it_shows(capsys, tmp_path):
    """An h800 file run on gloo sets h800's predicted step beside this CPU's measured one: said on
    stderr before the ranks start, and in the report (it was silent)."""
    sched = tmp_path / "h800.json"
    assert main(["compile", "--model", "tiny", "--hardware", "h800", "--n", "2", "--seq", "64", "--dtype", "fp32",
                 "--schedule", "greedy", "-o", str(sched)]) == 0
    capsys.readouterr()
    assert main(["run", "--schedule", str(sched), "--steps", "1", "--warmup", "0"]) == 0
    out, err = capsys.readouterr()
    assert "run: the plan is priced for h800, a GPU profile, and runs here on the CPU" in err
    assert "note: the plan is priced for h800" in out and "predicted" in out
