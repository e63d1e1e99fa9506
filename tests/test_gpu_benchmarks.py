"""The GPU benchmarks' CPU smoke modes (``--device cpu --tiny``): the same code the GPU session
runs, at tiny sizes in fp32, so a broken benchmark is found here and not on lent device time."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod             # dataclasses look their module up while being built
    spec.loader.exec_module(mod)
    return mod


def _table(out: str) -> tuple[list[str], list[dict[str, str]]]:
    """The markdown table printed on stdout: (header, rows as dicts)."""
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]
    return header, rows


pytestmark = pytest.mark.usefixtures("one_thread")       # tests/conftest.py


def test_gpu_layer_tiny_cpu_smoke(capsys, tmp_path):
    gpu_layer = _load("gpu_layer")
    assert gpu_layer.main(["--device", "cpu", "--tiny", "--json", str(tmp_path / "r.json")]) == 0
    header, rows = _table(capsys.readouterr().out)
    assert header == ["variant", "median_ms", "ratio_vs_eager", "host_us_per_node", "max_rel_err"]
    assert [r["variant"] for r in rows] == ["eager", "sequential", "greedy", "cpsat"]
    for r in rows:
        assert float(r["median_ms"]) > 0
    for r in rows[1:]:
        assert float(r["max_rel_err"]) < 1e-5          # fp32 against the eager module
        assert float(r["host_us_per_node"]) > 0
    assert (tmp_path / "r.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("name", ["gpu_layer", "gpu_overlap"])
def test_gpu_benchmark_without_cuda_exits_2_with_one_line(name, capsys):
    mod = _load(name)
    with pytest.raises(SystemExit) as exc:
        mod.main([])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "--device cpu" in err


def test_gpu_layer_refuses_a_scale_that_does_not_divide_the_heads(capsys):
    with pytest.raises(SystemExit) as exc:
        _load("gpu_layer").main(["--device", "cpu", "--scale", "3"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.strip() == "gpu_layer.py: error: --scale 3 is not one of 1, 2, 4, 8"


def test_gpu_layer_refuses_cuda_graphs_off_cuda(capsys):
    with pytest.raises(SystemExit) as exc:
        _load("gpu_layer").main(["--device", "cpu", "--tiny", "--cuda-graphs", "layer"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.strip() == ("gpu_layer.py: error: --cuda-graphs layer needs --device cuda "
                                                  "(CUDA graphs capture device work)")


@pytest.mark.slow
def test_gpu_overlap_tiny_cpu_smoke(capsys):
    """The emulated n=2 rank graph under every plan: the table's columns, and every plan's
    numbers equal the sequential plan's (on CPU collectives complete when issued: nothing hides)."""
    assert _load("gpu_overlap").main(["--device", "cpu", "--tiny", "--time-limit", "1"]) == 0
    header, rows = _table(capsys.readouterr().out)
    assert header == ["plan", "median_step_ms", "predicted_ms", "host_us_per_node", "hidden_comm_fraction",
                      "predicted_hidden", "equal_to_sequential"]
    assert [r["plan"] for r in rows] == ["sequential", "greedy", "cpsat"]
    assert all(float(r["median_step_ms"]) > 0 and r["equal_to_sequential"] == "yes" for r in rows)
    assert all(float(r["host_us_per_node"]) > 0 and float(r["predicted_ms"]) > 0 for r in rows)
    assert all(0 <= float(r["hidden_comm_fraction"]) <= 1 and 0 <= float(r["predicted_hidden"]) <= 1 for r in rows)
    assert float(rows[0]["hidden_comm_fraction"]) < 0.05 and float(rows[0]["predicted_hidden"]) == 0
    # the overlapped plans are predicted below every node run alone in turn (sequential)
    assert all(float(r["predicted_ms"]) < float(rows[0]["predicted_ms"]) for r in rows[1:])


def test_gpu_overlap_one_queue_plans_follow_the_program_order(capsys):
    """--launch-order program: the overlapped plans are scheduled for one hardware queue fed in
    program order (what CUDA_DEVICE_MAX_CONNECTIONS=1 makes of the issue order): no faster than the
    same plans with a queue per stream, issued in that order, and the header says so."""
    from moegraph.runtime.emulated import TINY_SIZES, EmulatedRankGraph
    from moegraph.schedules.launch import launch_sequence
    from moegraph.schedules.problem import build_problem
    mod = _load("gpu_overlap")
    predicted = {}
    for order in ("free", "program"):
        assert mod.main(["--device", "cpu", "--tiny", "--time-limit", "1", "--launch-order", order]) == 0
        out = capsys.readouterr().out
        assert f"launch order {order}, CUDA_DEVICE_MAX_CONNECTIONS=" in out
        _, rows = _table(out)
        predicted[order] = {r["plan"]: float(r["predicted_ms"]) for r in rows}
    assert predicted["program"]["sequential"] == predicted["free"]["sequential"]
    assert all(predicted["program"][m] >= predicted["free"][m] - 1e-9 for m in ("greedy", "cpsat"))
    rg = EmulatedRankGraph(TINY_SIZES, "cpu")
    plan = rg.plan("greedy", time_limit_s=1, launch_order="program")
    problem = build_problem(rg.graph, rg.cost)
    launched = [problem.tasks[i].name for i in launch_sequence(problem, "program") if problem.tasks[i].max_ticks > 0]
    issued = [e.name for e in plan.entries if e.name in set(launched)]
    fwd = {t.name for t in problem.tasks if t.side == 0}
    # the plan issues its forward, then its backward (the barrier), each in the launch order
    assert issued == [x for x in launched if x in fwd] + [x for x in launched if x not in fwd]
