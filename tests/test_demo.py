"""The README's main job (`moegraph demo`) and the runtime's measurement order."""

import json

import pytest

from moegraph.cli import main
from moegraph.runtime.timing import measurement_blocks


@pytest.mark.slow
def test_demo_compiles_the_paper_layer_and_draws_it(tmp_path, capsys):
    assert main(["demo", "-o", str(tmp_path), "--skip-run"]) == 0
    out = capsys.readouterr().out
    for step in ("1/4 trace", "2/4 compile", "3/4 gantt"):
        assert step in out
    # no ranks run: no link is made or reported (--link auto would pick one where it can)
    assert not [line for line in out.splitlines() if line.startswith("link:")], out
    sched = tmp_path / "mixtral-8x7b-h800.json"
    assert (tmp_path / "mixtral-8x7b-h800.png").stat().st_size > 0
    assert main(["verify", str(sched)]) == 0                 # the schedule it wrote is valid
    summary = json.loads(sched.read_text())["summary"]
    assert summary["makespan_us"] <= min(summary["baselines"].values())


def test_measurement_blocks_are_abba_and_cover_every_step():
    assert measurement_blocks(1, 7) == [(0, 7)]
    blocks = measurement_blocks(2, 7)
    assert [i for i, _ in blocks] == [0, 1, 1, 0]
    for plan in (0, 1):
        assert sum(c for i, c in blocks if i == plan) == 7
    assert [i for i, _ in measurement_blocks(3, 1)] == [0, 1, 2]     # empty halves dropped


def test_prediction_benchmark_runs_its_schedules_in_abba_blocks(monkeypatch, capsys):
    """benchmarks/prediction.py: repeats go in ABBA blocks (measurement_blocks), not A B A B, and
    its paired runs pair each schedule's k-th runs."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "prediction.py"
    spec = importlib.util.spec_from_file_location("bench_prediction", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    order = []

    def measured(config, **kw):
        order.append(config.schedule)
        return {"predicted_us": 1000.0, "step_us": 1000.0 + len(order)}
    monkeypatch.setattr(bench, "measure_schedule", measured)
    monkeypatch.setattr(bench, "gemm_probe_gflops", lambda: 1.0)
    assert bench.main(["--model", "tiny", "--seq", "64", "--schedules", "cpsat,sequential", "--repeats", "4"]) == 0
    assert order == ["cpsat", "cpsat", "sequential", "sequential", "sequential", "sequential", "cpsat", "cpsat"]
    out = capsys.readouterr().out
    assert "| 3 | sequential |" in out and "cpsat measured no slower than sequential in 2/4 paired runs" in out


@pytest.mark.slow
def test_measure_schedule_runs_ranks_and_matches_eager():
    from moegraph.config import CompileConfig
    from moegraph.ir import Strategy
    from moegraph.pass_steps import Sar
    from moegraph.runtime.timing import measure_schedule
    config = CompileConfig(model="tiny", strategy=Strategy("sp", "ep", "a2a", 2, dtype="fp32"), passes=(Sar("paper"),),
                           schedule="sequential", batch=1, seq=64, hardware="cpu-2core-gloo")
    row = measure_schedule(config, steps=2, warmup=1, check=True)
    assert row["schedule"] == "sequential" and row["step_us"] > 0 and row["predicted_us"] > 0
    assert len(row["step_us_all"]) == 2
    assert row["check"]["max_rel_err_output"] < 1e-5 and row["check"]["max_rel_err_grads"] < 1e-5


def test_demo_link_auto_without_privilege_says_why_and_uses_plain_loopback():
    from moegraph.runtime.demo import PLAIN_PROFILE, choose_link
    from moegraph.runtime.netns import AUTO
    choice = choose_link(AUTO, probe=lambda: "creating a network namespace needs root (CAP_NET_ADMIN)")
    assert choice.link is None and choice.hardware == PLAIN_PROFILE
    assert "needs root (CAP_NET_ADMIN)" in choice.note and "\n" not in choice.note


def test_demo_link_auto_with_privilege_picks_1gbit_and_the_link_profile_when_shipped(monkeypatch):
    from moegraph.runtime import demo, netns
    from moegraph.runtime.netns import AUTO, Link
    monkeypatch.setattr(netns, "hardware_names", lambda: ("cpu-2core-gloo",))
    choice = demo.choose_link(AUTO, probe=lambda: None)
    assert choice.link == Link(10**9) and choice.hardware == "cpu-2core-gloo"
    assert "1gbit" in choice.note and "uncalibrated for the link" in choice.note
    monkeypatch.setattr(netns, "hardware_names", lambda: ("cpu-2core-gloo", "cpu-2core-gloo-1gbit"))
    choice = demo.choose_link(AUTO, probe=lambda: None)
    assert choice.link == Link(10**9) and choice.hardware == "cpu-2core-gloo-1gbit"
    assert "uncalibrated" not in choice.note


def test_demo_link_none_and_explicit_rate_are_not_probed():
    from moegraph.runtime.demo import choose_link
    from moegraph.runtime.netns import Link

    def probe():
        raise AssertionError("probed although the link was given")
    assert choose_link(None, probe=probe).link is None
    assert choose_link(Link(5 * 10**8), probe=probe).link == Link(5 * 10**8)


def test_namespace_privilege_names_the_missing_capability(monkeypatch, tmp_path):
    from moegraph.runtime import netns
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nCapEff:\t0000000000000000\n")
    real = netns.Path
    monkeypatch.setattr(netns, "Path", lambda p: status if p == "/proc/self/status" else real(p))
    monkeypatch.setattr(netns.shutil, "which", lambda tool: f"/sbin/{tool}")
    assert "CAP_SYS_ADMIN and CAP_NET_ADMIN" in netns.namespace_privilege()
    status.write_text(f"CapEff:\t{(1 << 21) | (1 << 12):016x}\n")
    assert netns.namespace_privilege() is None
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else f"/sbin/{tool}")
    assert "`tc`" in netns.namespace_privilege()


def test_namespace_privilege_probe_sees_dropped_capabilities():
    """The real probe in a process that lacks CAP_SYS_ADMIN/CAP_NET_ADMIN (dropped by setpriv
    when root; a non-root user lacks them anyway): it gives the reason the demo prints."""
    import os
    import shutil
    import subprocess
    import sys

    import pytest
    if shutil.which("setpriv") is None and os.geteuid() == 0:
        pytest.skip("needs setpriv to drop root's capabilities")
    cmd = [sys.executable, "-c", "from moegraph.runtime.netns import namespace_privilege as p; print(p())"]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--bounding-set", "-sys_admin,-net_admin", "--inh-caps", "-all", "--", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "needs root" in out or "is not installed" in out, out


@pytest.mark.slow
def test_hf_mixtral_implementation_runs_on_ranks_and_matches_its_eager_module():
    """benchmarks/heldout.py's hf-mixtral rows: ranks build transformers' MixtralDecoderLayer (its
    parameter names are the graph's) and the compiled step matches that module's eager step."""
    import dataclasses

    import pytest
    pytest.importorskip("transformers")
    from moegraph.config import CompileConfig
    from moegraph.ir import Strategy
    from moegraph.runtime.plan import ExecutionPlan
    from moegraph.runtime.reference import seeded_layer
    from moegraph.runtime.timing import spawn_plans
    from moegraph.schedules.driver import lower
    config = CompileConfig(model="tiny", strategy=Strategy("sp", "ep", "a2a", 2, dtype="fp32"), passes=(), batch=1,
                           seq=64, hardware="cpu-2core-gloo")
    ref = lower(config)
    module = seeded_layer(ref.model, 0, "fp32", "hf-mixtral")
    assert type(module).__name__ == "MixtralDecoderLayer"
    graph = lower(config.replace(model=module)).graph
    layer = dataclasses.replace(ref, graph=graph)            # the registry model the ranks build, this graph
    results = spawn_plans(layer, (ExecutionPlan.sequential(graph),), steps=1, warmup=0, check=True,
                          implementation="hf-mixtral")
    check = results[0]["check"]
    assert check["max_rel_err_output"] < 1e-5 and check["max_rel_err_grads"] < 1e-5, check


def test_hf_mixtral_implementation_refuses_what_mixtral_lacks():
    import pytest
    pytest.importorskip("transformers")
    from moegraph.registry import load_model
    from moegraph.runtime import RuntimeFailure
    from moegraph.runtime.reference import seeded_layer
    with pytest.raises(RuntimeFailure, match="shared experts, q/k/v biases"):
        seeded_layer(load_model("qwen2-57b-a14b"), 0, "fp32", "hf-mixtral")
