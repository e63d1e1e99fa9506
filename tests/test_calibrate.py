"""`moegraph calibrate`: a short real calibration loads and reproduces its own measurements, the
budget holds (on a clock the test drives), the fit reproduces known hardware, bad arguments fail
in one line, and the shipped profile is valid."""

from __future__ import annotations

import dataclasses
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moegraph.cli import main
from moegraph.cost import CostModel, shaped_node
from moegraph.ir import Node, OpKind, Phase
from moegraph.registry import CURVE_NAMES, load_hardware
from moegraph.runtime.calibrate.harness import coarse_to_fine, sweep
from moegraph.runtime.calibrate.results import BenchResult, MachineInfo, OverlapMeasure, Sample
from moegraph.runtime.calibrate.fit import binned_curve, fit_profile, self_check
from moegraph.runtime.calibrate.options import CalibrationOptions
from moegraph.runtime.calibrate.profile_io import read_facts, read_samples, write_profile, write_samples

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "moegraph" / "registry" / "profiles" / "cpu-2core-gloo.yaml"
BUDGET_S = 10        # the least budget calibrate takes (options.MIN_BUDGET_S)


# --- one short real calibration, shared --------------------------------------------------------

@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """(process, profile path, samples path) of one 10 s calibration on 2 ranks."""
    folder = tmp_path_factory.mktemp("calibrate")
    out, samples = folder / "short.yaml", folder / "short.json"
    proc = subprocess.run([sys.executable, "-m", "moegraph", "calibrate", "--time-budget", str(BUDGET_S),
                           "--n", "2", "-o", str(out), "--samples", str(samples)],
                          capture_output=True, text=True, timeout=BUDGET_S + 120)
    return proc, out, samples


@pytest.mark.slow
def test_short_calibration_writes_a_loadable_profile_with_curves(short_run):
    proc, out, _ = short_run
    assert proc.returncode == 0, proc.stderr
    hw = load_hardware(out)
    assert hw.name == "short"
    names = {name for name, _ in hw.curves}
    assert {"gemm_eff", "mem_eff", "ring_eff"} <= names <= set(CURVE_NAMES)
    for name, points in hw.curves:
        sizes = [s for s, _ in points]
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes), name
        assert all(0 < e <= 1 for _, e in points), name
    measured = dict(hw.measured)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", measured["date"])
    assert measured["machine"]
    facts = read_facts(hw)
    assert (facts.n, facts.backend, facts.dtype, facts.torch) == (2, "gloo", "fp32", torch.__version__)
    # one progress line per benchmark, each with the elapsed time
    assert re.search(r"calibrate \[\s*\d+\.\d+s\] gemm ", proc.stderr)
    assert re.search(r"calibrate \[\s*\d+\.\d+s\] all_gather ", proc.stderr)


def _gemm_node(sample: Sample) -> Node:
    """The node the sample measured: its shape attributes (role, m/n/k) price it, as in a graph."""
    return shaped_node("fc", OpKind.GEMM, sample.shape, flops=sample.flops, mem_bytes=sample.mem_bytes)


@pytest.mark.slow
def test_calibrated_cost_model_reproduces_its_gemm_measurements(short_run):
    """The written profile, read back, prices every GEMM it measured within 2x and all of them
    together without bias (in-sample, from the --samples file: the curves, peak and latency survive
    the fit and the YAML). Held-out
    predictions against fresh timings are benchmarks/prediction.py's and heldout.py's, not a test's."""
    proc, out, samples = short_run
    assert proc.returncode == 0, proc.stderr
    hw = load_hardware(out)
    gemms = [s for r in read_samples(samples) if r.name == "gemm" for s in r.samples]
    assert len(gemms) >= 2                                   # gemm runs at least two cases, budget or not
    ratio = lambda model, s: model.node_time_us(_gemm_node(s)) / 1e6 / s.seconds  # noqa: E731
    ratios = {s.label: ratio(CostModel(hw), s) for s in gemms}
    # Each case within 3x: the efficiency curve is one-dimensional in FLOPs, and on a CPU a 16-row
    # GEMM runs near half the rate of a square one of equal FLOPs (seen: 0.65 and 1.25 in one bin),
    # which the GPU tile shape factor does not describe: 'forward 16x512x1024' sits at 0.61-0.62
    # (3 runs beside one busy core, 2026-11-28, the others 0.69-1.45). CI runs this beside a second
    # shard spawning its own ranks; there a 2x bound failed once (2026-11-28), the slow 16-row
    # case's timing slowed further. Across cases the fit is unbiased.
    assert all(1 / 3 < r < 3 for r in ratios.values()), ratios
    assert 1 / 1.15 < statistics.geometric_mean(ratios.values()) < 1.15, ratios
    # the check can fail: a profile claiming a tenth of the peak misprices the largest case
    wrong = CostModel(dataclasses.replace(hw, peak_flops_bf16=hw.peak_flops_bf16 / 10))
    assert ratio(wrong, max(gemms, key=lambda s: s.flops)) > 1.5


class _FakeClock:
    """time.time() for the calibration's budget, advanced by the cases the test runs."""

    def __init__(self):
        self.now = 1_000.0

    def time(self) -> float:
        return self.now


def _sweep_on(clock: _FakeClock, monkeypatch, costs: list[float], budget_s: float, work, min_cases: int = 2):
    """``sweep`` over cases costing ``costs`` seconds of ``clock``; (indices run, cases not run)."""
    module = sys.modules[sweep.__module__]
    monkeypatch.setattr(module, "time", SimpleNamespace(time=clock.time))
    env = SimpleNamespace(group=SimpleNamespace(agree=lambda *values: list(values)))   # one rank
    ran = []

    def run(i, deadline, left):
        ran.append(i)
        clock.now += costs[i]
        return Sample("b", "gemm", costs[i], flops=work(i))

    _, not_run = sweep(env, range(len(costs)), run, clock.now + budget_s, work, min_cases=min_cases)
    return ran, not_run


def test_a_sweep_starts_cases_only_while_its_budget_lasts(monkeypatch):
    """The time budget, on a clock the test drives (the real command's wall time depends on the
    machine's load): cases start while time is left, in coarse-to-fine order, so the sweep ends
    within one case of its deadline; past the deadline only the mandatory cases run."""
    clock = _FakeClock()
    ran, not_run = _sweep_on(clock, monkeypatch, [1.0] * 10, 4.5, work=lambda i: 0.0)
    assert ran == coarse_to_fine(10)[:5] and not_run == 5          # started at 0, 1, 2, 3 and 4 s
    assert clock.now - 1_000.0 == 5.0

    clock = _FakeClock()
    ran, not_run = _sweep_on(clock, monkeypatch, [1.0] * 10, -1.0, work=lambda i: 0.0)
    assert ran == coarse_to_fine(10)[:2] and not_run == 8          # min_cases, though no time is left


def test_a_sweep_passes_over_a_case_too_big_for_the_time_left(monkeypatch):
    """At the rate measured so far, case 9 (50x the work) would take 3 x 50 s of the 18 s left: it
    is passed over, and the small cases after it still run."""
    costs = [1.0] * 9 + [50.0]
    clock = _FakeClock()
    ran, not_run = _sweep_on(clock, monkeypatch, costs, 20.0, work=lambda i: costs[i])
    assert 9 not in ran and sorted(ran) == list(range(9)) and not_run == 1
    assert clock.now - 1_000.0 == 9.0


# --- the fit, on synthetic measurements of known hardware -------------------------------------

TRUE_PEAK, TRUE_BW, KAPPA = 100e9, 50e9, 5e-6
LINK, ALPHA, N = 2e9, 100e-6, 2


TRUE_GEMM_EFF = {1e6: 0.2, 1e7: 0.4, 1e8: 0.6, 1e9: 0.8, 1e10: 1.0}


def _synthetic_results() -> list[BenchResult]:
    """Samples generated by the cost model's own formulas from known numbers."""
    gemm = [Sample("gemm", "gemm", KAPPA + f / (TRUE_PEAK * e), flops=f, mem_bytes=1.0)
            for f, e in TRUE_GEMM_EFF.items()]
    memory = [Sample("memory", "copy", b / TRUE_BW, mem_bytes=b) for b in (1e6, 1e7)]
    memory += [Sample("memory", "add", KAPPA + b / (TRUE_BW * 0.5), mem_bytes=b) for b in (1e5, 1e6, 1e7)]
    kernel = [Sample("kernel", "add", KAPPA), Sample("kernel", "gemm", KAPPA)]
    comm = []
    for kind, steps, eff in (("all_gather", 1, 0.8), ("reduce_scatter", 1, 0.8), ("all_to_all", 1, 0.5),
                             ("all_reduce", 2, 0.6)):
        samples = []
        for b in (1024.0, 1e5, 1e7):
            e = 1.0 if (b == 1e7 and kind == "all_gather") else eff      # the link peak
            samples.append(Sample(kind, kind, KAPPA + steps * (N - 1) * ALPHA + b / (LINK * e), comm_bytes=b))
        comm.append(BenchResult(kind, tuple(samples), "", 0.0))
    overlap = Sample("overlap", "all_gather", 0.01, comm_bytes=1e6,
                     overlap=OverlapMeasure(compute_alone=1e-3, compute_slowdown=1.25, comm_alone=0.01,
                                            comm_stretch=1.5, runs=3))
    return [BenchResult("kernel", tuple(kernel), "", 0.0), BenchResult("gemm", tuple(gemm), "", 0.0),
            BenchResult("memory", tuple(memory), "", 0.0), *comm,
            BenchResult("overlap", (overlap,), "", 0.0)]


MACHINE = MachineInfo(host="h", cpu="c", cores=2, torch=torch.__version__)


def _fit(tmp_path):
    opts = CalibrationOptions(n=N, output=tmp_path / "synthetic.yaml")
    profile = fit_profile(_synthetic_results(), load_hardware("cpu-gloo"), opts, MACHINE, 1.0)
    return profile, profile.hardware()


def test_fit_recovers_known_hardware(tmp_path):
    profile, hw = _fit(tmp_path)
    assert hw.peak_flops_bf16 == pytest.approx(TRUE_PEAK, rel=1e-3)
    assert hw.hbm_bw_bytes_s == pytest.approx(TRUE_BW, rel=1e-3)
    assert hw.kernel_latency_us == pytest.approx(KAPPA * 1e6, rel=1e-3)
    assert hw.intra_node_latency_us == pytest.approx(ALPHA * 1e6, rel=1e-2)   # + the smallest message
    assert hw.nvlink_bw_bytes_s == pytest.approx(LINK, rel=1e-3)
    # compute slowdown 1.25 -> 20 of 100 "SMs" held: CostModel gives the measured factor back
    assert (hw.sm_count, hw.comm_sm_budgets) == (100, (20,))
    assert CostModel(hw).compute_slowdown(20) == pytest.approx(1.25)
    assert hw.comm_overlap_stretch == pytest.approx(1.5)
    # the fitted model reproduces every sample it was fitted on
    checks = self_check(hw, _synthetic_results(), N)
    assert {c.bench for c in checks} == {"kernel", "gemm", "memory", "all_gather", "reduce_scatter", "all_to_all",
                                         "all_reduce"}
    for c in checks:
        assert c.median_error < 0.005, c.line()


def test_self_check_counts_the_samples_no_ir_op_prices(tmp_path):
    """The memory benchmark's plain copies have no IR op: the self-check counts them (its line and
    the profile's remark say so) instead of leaving them out unnoticed."""
    from moegraph.runtime.calibrate.fit import summarize_checks
    _, hw = _fit(tmp_path)
    checks = self_check(hw, _synthetic_results(), N)
    memory = next(c for c in checks if c.bench == "memory")
    assert (memory.cases, memory.not_ops) == (3, 2)
    assert memory.line().endswith("over 3 cases (+2 of no IR op, not checked)")
    assert summarize_checks(checks).endswith("; samples of no IR op, not checked: memory 2")
    copies = [r for r in _synthetic_results() if r.name == "memory"][0]
    only = BenchResult("memory", tuple(s for s in copies.samples if s.op == "copy"), "", 0.0)
    (alone,) = self_check(hw, [only], N)
    assert alone.line() == "memory: no case checked (+2 of no IR op, not checked)"


def test_a_link_bandwidth_from_raw_rates_is_noted(tmp_path):
    """Collectives too small for any message to be mostly transfer: the link bandwidth falls back
    to the best raw bytes/s (latency included), and the profile's notes say so."""
    comm = [BenchResult(kind, tuple(Sample(kind, kind, KAPPA + (N - 1) * ALPHA + b / LINK, comm_bytes=b)
                                    for b in (1024.0, 4096.0)), "", 0.0)
            for kind in ("all_gather", "reduce_scatter")]
    base = [r for r in _synthetic_results() if r.name in ("kernel", "gemm", "memory")]
    opts = CalibrationOptions(n=N, output=tmp_path / "small.yaml")
    profile = fit_profile(base + comm, load_hardware("cpu-gloo"), opts, MACHINE, 1.0)
    raw = 4096.0 / (KAPPA + (N - 1) * ALPHA + 4096.0 / LINK)
    assert profile.hardware().nvlink_bw_bytes_s == pytest.approx(raw, rel=1e-2)
    assert any(r.startswith(f"link bandwidth {raw / 1e9:.3g} GB/s is the best raw bytes/s of any collective, "
                            "latency included") for r in profile.facts.remarks), profile.facts.remarks


def test_fitted_profile_round_trips_through_yaml(tmp_path):
    profile, hw = _fit(tmp_path)
    path = tmp_path / "synthetic.yaml"
    write_profile(path, profile, _synthetic_results(), self_check(hw, _synthetic_results(), N))
    again = load_hardware(path)
    assert again.to_dict() == hw.to_dict()
    facts = read_facts(again)                                    # the structured facts survive the file
    assert dataclasses.replace(facts, remarks=()) == dataclasses.replace(profile.facts, remarks=())
    assert facts.notes() == profile.facts.notes() and facts.n == N and facts.foreign_load_cores is None
    text = path.read_text()
    assert text.startswith("# Hardware profile written by `moegraph calibrate`")
    assert "#   gemm: median |error| 0% over 5 cases" in text


def test_samples_round_trip_through_json(tmp_path):
    path = tmp_path / "samples.json"
    write_samples(path, _synthetic_results(), CalibrationOptions(n=N), MACHINE)
    assert read_samples(path) == _synthetic_results()


def test_binned_curve_keeps_bin_totals_and_is_valid():
    points = [(1e6, 2e-5, False), (1.2e6, 3e-5, False), (1e8, 1e-3, False), (1.1e8, 3e-3, True), (1e10, 1e-9, False)]
    curve = binned_curve(points, 100e9)
    sizes = [s for s, _ in curve]
    assert sizes == sorted(sizes) and all(0 < e <= 1 for _, e in curve)
    assert len(curve) == 3
    # first bin: predicted total = measured total
    assert (1e6 + 1.2e6) / (100e9 * curve[0][1]) == pytest.approx(5e-5, rel=1e-3)
    # a bin with a real layer-graph node uses only those nodes; an impossible time clamps to 1
    assert curve[1] == [1.1e8, pytest.approx(1.1e8 / (100e9 * 3e-3), rel=1e-3)]
    assert curve[2][1] == 1.0


def test_coarse_to_fine_is_a_permutation_starting_with_the_span():
    for k in range(0, 12):
        order = coarse_to_fine(k)
        assert sorted(order) == list(range(k))
        if k >= 3:
            assert order[:3] == [0, (k - 1) // 2, k - 1]


# --- bad arguments -----------------------------------------------------------------------------

def _error(capsys, *args) -> str:
    assert main(["calibrate", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_bad_rank_count(capsys, tmp_path):
    assert _error(capsys, "--n", "0", "-o", str(tmp_path / "p.yaml")) == \
        "moegraph calibrate: error: --n 0: the number of ranks must be between 1 and 64"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(capsys, tmp_path):
    assert _error(capsys, "--device", "cuda", "-o", str(tmp_path / "p.yaml")) == (
        f"moegraph calibrate: error: --device cuda: CUDA is not available (torch {torch.__version__} sees no GPU); "
        "use --device cpu")


def test_unwritable_output(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert _error(capsys, "-o", str(blocker / "p.yaml")) == \
        f"moegraph calibrate: error: -o '{blocker / 'p.yaml'}': '{blocker}' is a file, not a directory"
    assert not (tmp_path / "p.yaml").exists()
    # a missing folder is not an error: like every output, it is made when the profile is written


def test_other_bad_arguments(capsys, tmp_path):
    out = str(tmp_path / "p.yaml")
    assert _error(capsys, "--time-budget", "1", "-o", out) == (
        "moegraph calibrate: error: --time-budget 1: must be between 10 and 3600 s "
        "(starting the ranks alone takes about 5 s; below 10 s most benchmarks would be skipped and the profile "
        "would be mostly --base values)")
    assert _error(capsys, "--backend", "nccl", "-o", out) == \
        "moegraph calibrate: error: --backend nccl needs --device cuda; CPU ranks talk over gloo"
    assert _error(capsys, "-o", str(tmp_path / "p.txt")).endswith(
        "a profile is a .yaml or .yml file (load_hardware reads it by that suffix)")
    assert _error(capsys, "--base", "h999", "-o", out).startswith("moegraph calibrate: error: unknown hardware 'h999'")


# --- the shipped profile -------------------------------------------------------------------------

def test_shipped_cpu_profile_is_valid_and_dated():
    hw = load_hardware(SHIPPED)
    assert {name for name, _ in hw.curves} == set(CURVE_NAMES)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", dict(hw.measured)["date"])
    facts = read_facts(hw)
    assert (facts.n, facts.backend, facts.threads_per_rank) == (2, "gloo", 1)
    assert facts.unmeasured == ()
    for _, points in hw.curves:
        assert [s for s, _ in points] == sorted(s for s, _ in points)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_calibration_writes_single_gpu_curves(tmp_path):
    out = tmp_path / "gpu.yaml"
    assert main(["calibrate", "--device", "cuda", "--time-budget", "30", "-o", str(out)]) == 0
    hw = load_hardware(out)
    assert {"gemm_eff", "mem_eff"} <= {name for name, _ in hw.curves}
    assert "all_gather" in read_facts(hw).unmeasured


def test_link_peak_is_the_best_size_bin_so_no_curve_point_is_clamped(tmp_path):
    """Mid-size messages faster than the largest ones (the emulated link's token-bucket burst):
    the profile's link bandwidth is their rate, and the curve gives every size its own rate back."""
    from moegraph.runtime.calibrate.fit import link_peak
    assert link_peak([(1e6, 1e-3), (1e6, 3e-3), (4e6, 2e-3)]) == pytest.approx(2e9)   # bins: 1e6 -> 0.5e9
    assert link_peak([]) == 0.0
    rate = {1024.0: 1.0, 1e5: 0.7, 3e5: 1.0, 1e6: 0.9, 4e6: 0.85}   # fraction of LINK by message size
    comm = [BenchResult(kind, tuple(Sample(kind, kind, KAPPA + (N - 1) * ALPHA + b / (LINK * e), comm_bytes=b)
                                    for b, e in rate.items()), "", 0.0)
            for kind in ("all_gather", "reduce_scatter")]
    base = [r for r in _synthetic_results() if r.name in ("kernel", "gemm", "memory")]
    opts = CalibrationOptions(n=N, output=tmp_path / "burst.yaml")
    hw = fit_profile(base + comm, load_hardware("cpu-gloo"), opts, MACHINE, 1.0).hardware()
    assert hw.nvlink_bw_bytes_s == pytest.approx(LINK, rel=1e-2)          # the 3e5 B messages, not the largest
    cost = CostModel(hw)
    for b, e in rate.items():
        node = Node("c", OpKind.ALL_GATHER, Phase.FORWARD, (), ("y",), comm_bytes=int(b), group=N)
        assert cost.node_time_us(node) == pytest.approx((KAPPA + (N - 1) * ALPHA + b / (LINK * e)) * 1e6, rel=1e-2), b


def _one_rank_env():
    from moegraph.runtime.calibrate.harness import Clock, Lockstep, RankEnv
    now = time.time()
    return RankEnv(0, 2, torch.device("cpu"), "fp32", "gloo", now, now + 60, Lockstep(0, 1), Clock(torch.device("cpu")),
                   verbose=False)


def test_model_graphs_skip_only_a_layer_n_cannot_split(monkeypatch):
    """A layer the rank count cannot split is a note (its ConfigError); any other failure while
    building a model graph is a bug and propagates instead of fitting the profile on fewer graphs."""
    import moegraph.schedules.driver as driver              # the one place the tracer is called from
    from moegraph.ir import ConfigError
    from moegraph.runtime.calibrate.graph_benches import MODEL_GRAPHS, bench_model_graphs

    def split_error(cfg, strategy, **kw):
        raise ConfigError(f"n={strategy.n} does not divide heads=3")
    monkeypatch.setattr(driver, "trace_model", split_error)
    res = bench_model_graphs(_one_rank_env(), time.time() + 60)
    assert res.samples == () and res.skipped.count("does not divide heads=3") == len(MODEL_GRAPHS)

    def bug(cfg, strategy, **kw):
        raise RuntimeError("shape mismatch in a lowering rule")
    monkeypatch.setattr(driver, "trace_model", bug)
    with pytest.raises(RuntimeError, match="shape mismatch in a lowering rule"):
        bench_model_graphs(_one_rank_env(), time.time() + 60)
