"""Memory-traffic factors (Hardware.mem_op_traffic): validated, applied by the cost model to the
memory term of memory-bound nodes only, fitted by the calibration, and checked against H200
measurements the fit did not use (benchmarks/data/h200-calibrate-samples-2026-11-27-run*.json:
three `calibrate --device cuda --samples` runs, NVIDIA H200, torch 2.11, 2026-11-27 18:52-18:53 UTC);
and `calibrate --refit`, which fits them from such files."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import pytest

from moegraph.cli import main
from moegraph.cost import CostModel, shaped_node
from moegraph.ir import OpKind
from moegraph.registry import RegistryError, load_hardware
from moegraph.runtime.calibrate.fit import fit_profile
from moegraph.runtime.calibrate.options import CalibrationOptions
from moegraph.runtime.calibrate.profile_io import read_samples
from moegraph.runtime.calibrate.results import MachineInfo

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data"
RUNS = [DATA / f"h200-calibrate-samples-2026-11-27-run{i}.json" for i in (1, 2, 3)]
OPTS = CalibrationOptions(device="cuda", backend="nccl", n=1, base="h100", dtype="bf16", output=Path("h200.yaml"))
INFO = MachineInfo(host="device", cpu="?", cores=16, torch="2.11.0+cu130", gpu="NVIDIA H200", sm_count=132)


def _fit(results):
    return fit_profile(results, load_hardware("h100"), OPTS, INFO, 1.0).hardware()


def _errors(hw, results, keep=lambda s: True) -> dict[str, float]:
    """label -> predicted / measured - 1 of every memory-bound case (copies price no IR op)."""
    out = {}
    for r in results:
        for s in r.samples:
            if r.name == "memory" and s.op != "copy" and keep(s):
                node = shaped_node("case", OpKind(s.op), s.shape, flops=s.flops, mem_bytes=s.mem_bytes)
                out[s.label] = CostModel(hw).node_time_us(node) / 1e6 / s.seconds - 1
    return out


def test_a_bad_entry_is_refused_naming_it():
    hw = load_hardware("h100")
    with pytest.raises(RegistryError, match="mem_op_traffic: unknown op kind 'gemm'"):
        dataclasses.replace(hw, mem_op_traffic={"gemm": 2.0})         # a GEMM's floor is one pass
    with pytest.raises(RegistryError, match="mem_op_traffic: rmsnorm: traffic factor 1000.0 is outside"):
        dataclasses.replace(hw, mem_op_traffic={"rmsnorm": 1000})
    with pytest.raises(RegistryError, match="mem_op_traffic: unknown op kind 'rmsnorm.recompute'"):
        dataclasses.replace(hw, mem_op_traffic={"rmsnorm.recompute": 2.0})   # roles: forward, dgrad, wgrad


def test_the_factor_scales_the_memory_term_of_memory_bound_nodes_only():
    hw = load_hardware("h100")
    with_factors = dataclasses.replace(hw, mem_op_traffic={"rmsnorm": 4.0, "rmsnorm.dgrad": 6.0, "add": 1.0,
                                                           "other": 2.5})
    kappa = hw.kernel_latency_us

    def net(h, op, **kw):
        return CostModel(h).node_time_us(shaped_node("n", op, (), **kw)) - kappa
    big = 1 << 30                                       # bytes: the memory term binds, the latency does not
    assert net(with_factors, OpKind.RMSNORM, mem_bytes=big) == pytest.approx(4.0 * net(hw, OpKind.RMSNORM, mem_bytes=big))
    dgrad = (("role", "dgrad"),)                        # the role's entry before the op's
    assert CostModel(with_factors).node_time_us(shaped_node("n", OpKind.RMSNORM, dgrad, mem_bytes=big)) - kappa == \
        pytest.approx(6.0 * (CostModel(hw).node_time_us(shaped_node("n", OpKind.RMSNORM, dgrad, mem_bytes=big)) - kappa))
    assert net(with_factors, OpKind.ADD, mem_bytes=big) == pytest.approx(net(hw, OpKind.ADD, mem_bytes=big))
    assert net(with_factors, OpKind.ROPE, mem_bytes=big) == pytest.approx(2.5 * net(hw, OpKind.ROPE, mem_bytes=big))
    # a GEMM whose memory floor binds (a few FLOPs, many bytes) keeps one pass: "other" is for
    # memory-bound ops the calibration did not measure, not for fused compute kernels
    gemm = dict(flops=1, mem_bytes=big)
    assert net(with_factors, OpKind.GEMM, **gemm) == pytest.approx(net(hw, OpKind.GEMM, **gemm))


def test_fitted_factors_price_every_op_on_runs_the_fit_did_not_see():
    """Fit on run 1; the memory cases of runs 2 and 3 (add, eager RMSNorm, SwiGLU; 256-65536
    tokens of h 4096 / f 14336, bf16) priced within 15% median. One mem_eff curve cannot: an
    eager RMSNorm moves its rows ~14x per IR byte, the single-kernel ADD once."""
    runs = [read_samples(p) for p in RUNS]
    hw = _fit(runs[0])
    traffic = dict(hw.mem_op_traffic)
    assert traffic["add"] == 1.0 and 10 < traffic["rmsnorm"] < 20 and 1.3 < traffic["swiglu"] < 2.5
    for held_out in runs[1:]:
        errors = _errors(hw, held_out)
        assert len(errors) == 15
        assert statistics.median(abs(e) for e in errors.values()) < 0.15, errors
    # the same curve without the factors misprices the largest RMSNorm by most of its time
    one_curve = dataclasses.replace(hw, mem_op_traffic=())
    assert _errors(one_curve, runs[1])["rmsnorm 65536 tokens"] < -0.8


def test_fitted_factors_extrapolate_to_sizes_the_fit_did_not_see():
    """Fit on run 1 without its largest cases (65536 tokens: 1-5.6 GB moved); those cases of runs
    2 and 3 within 15% each."""
    runs = [read_samples(p) for p in RUNS]
    small = [dataclasses.replace(r, samples=tuple(s for s in r.samples if "65536 tokens" not in s.label))
             for r in runs[0]]
    hw = _fit(small)
    for held_out in runs[1:]:
        errors = _errors(hw, held_out, keep=lambda s: "65536 tokens" in s.label)
        assert sorted(errors) == ["add 65536 tokens", "rmsnorm 65536 tokens", "swiglu 65536 tokens"]
        assert all(abs(e) < 0.15 for e in errors.values()), errors


def test_refit_of_recorded_runs_writes_their_profile(tmp_path, capsys):
    out = tmp_path / "h200.yaml"
    assert main(["calibrate", "--refit", *map(str, RUNS), "-o", str(out), "--quiet"]) == 0
    hw = load_hardware(out)
    assert hw.sm_count == 132 and 10 < hw.mem_traffic("rmsnorm") < 20
    assert "refit from 3 recorded run(s), each case's median" in dict(hw.measured)["notes"]
    # provenance: what the runs measured names them; the collectives (one GPU) keep the base's line
    sources, base = dict(hw.sources), dict(load_hardware("h100").sources)
    for measured in ("mem_eff", "gemm_eff", "grouped_gemm_eff", "attention_eff"):
        assert sources[measured].startswith("measured by moegraph calibrate on NVIDIA H200"), measured
    assert sources["ring_eff_intra"] == base["ring_eff_intra"]


def _refit_error(capsys, *args) -> str:
    assert main(["calibrate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_refit_refuses_in_one_line(capsys, tmp_path):
    out = str(tmp_path / "p.yaml")
    not_samples = tmp_path / "x.json"
    not_samples.write_text("[1, 2]")
    assert "not a samples file written by --samples" in _refit_error(capsys, "--refit", str(not_samples), "-o", out)
    assert _refit_error(capsys, "--refit", str(RUNS[0]), "--n", "4", "-o", out) == (
        f"moegraph calibrate: error: --refit {RUNS[0]}: --n 4 differs from the recorded run's 1; a refit fits "
        "what was measured (leave --n out)")
    assert "--samples measures or records a run" in _refit_error(
        capsys, "--refit", str(RUNS[0]), "--samples", str(tmp_path / "s.json"), "-o", out)
    assert not Path(out).exists()


GRAPH_RUNS = [DATA / f"h200-calibrate-samples-2026-11-27-graph{i}.json" for i in (1, 2, 3)]
"""Three `calibrate --device cuda --n 1 --time-budget 60 --samples` runs with the layer-graph
benchmark on the GPU (the Mixtral-8x7B layer at s 4096, bf16, forward and backward; 2026-11-27,
H200, torch 2.11)."""


def test_layer_graph_runs_price_every_memory_op_and_the_layer_held_out():
    """Fit on graph run 1: the layer's rope, permutes and norms get their own factors, INDEX_MAP
    (a sort over 131 KB of routing ids: latency-bound) none; runs 2 and 3's layer compute (the
    summed time of its 41 nodes) priced within 12%, as in-sample."""
    from moegraph.runtime.calibrate.fit import GraphCheck, self_check
    runs = [read_samples(p) for p in GRAPH_RUNS]
    hw = _fit(runs[0])
    traffic = dict(hw.mem_op_traffic)
    assert {"rope", "permute", "unpermute", "rmsnorm", "swiglu"} <= set(traffic) and "index_map" not in traffic
    # per role: a forward index_select streams (under 2x ADD's traffic), its backward index_add
    # does not (over 8x); the weighted combine is the other way round
    assert traffic["permute.forward"] < 2 < 8 < traffic["permute.dgrad"]
    assert traffic["unpermute.forward"] > 2 * traffic["unpermute.dgrad"]
    for held_out in runs[1:]:
        (layer,) = [c for c in self_check(hw, held_out, 1) if isinstance(c, GraphCheck)]
        assert abs(layer.error) < 0.12, layer.line()
