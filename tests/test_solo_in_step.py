"""In-step factors of a group of one rank (Hardware.solo_in_step_factors): the calibration's
in-step stage fits them on its n = 1 layers apart from the n-rank ones, ``Hardware.for_group``
swaps them in for n = 1 only, and the driver prices a one-rank layer with them."""

from __future__ import annotations

import dataclasses
import time

import pytest

from moegraph.config import CompileConfig
from moegraph.cost import CostModel
from moegraph.ir import OpKind, Strategy
from moegraph.registry import load_hardware, load_model
from moegraph.runtime.calibrate.options import CalibrationOptions
from moegraph.tracer import trace_model
from test_calibrate_steps import _with_terms as _sample   # a measured step from known factors and rates

BASE = load_hardware("cpu-gloo")
GROUP = {"gemm": 1.8, "grouped_gemm": 1.1, "attention": 1.4, "memory": 2.9, "comm": 1.2}   # n-rank steps
SOLO = {"gemm": 1.3, "grouped_gemm": 1.25, "attention": 1.7, "memory": 2.0, "comm": 1.2}   # one-rank steps
STREAM_BW, SOLO_STREAM_BW = 9e9, 20e9


def _graph(seq: int, attn: str, dispatch: str, n: int, dp: int = 1):
    return trace_model(load_model("tiny"), Strategy(attn=attn, ffn="ep", dispatch=dispatch, n=n, dtype="fp32", dp=dp),
                       batch=1, seq=seq)


def test_for_group_swaps_in_the_solo_compute_factors_for_one_rank_only():
    hw = dataclasses.replace(BASE, in_step_factors=(("comm", 3.0), ("gemm", 2.0), ("memory", 2.5)),
                             in_step_stream_bw_bytes_s=STREAM_BW, solo_in_step_factors=(("gemm", 1.25),),
                             solo_in_step_stream_bw_bytes_s=SOLO_STREAM_BW)
    assert hw.for_group(2) is hw and hw.for_group(8) is hw
    one = hw.for_group(1)
    assert (one.in_step_factor("gemm"), one.in_step_factor("comm"), one.in_step_factor("memory")) == (1.25, 3.0, 1.0)
    assert one.in_step_stream_bw_bytes_s == SOLO_STREAM_BW
    assert one.solo_in_step_factors == () and one.for_group(1) is one
    assert BASE.for_group(1) is BASE                  # not measured: the n-rank prices
    again = dataclasses.replace(BASE, **{k: hw.to_dict()[k] for k in ("solo_in_step_factors", "in_step_factors")})
    assert again.solo_in_step_factors == (("gemm", 1.25),)


def test_in_step_stage_fits_the_solo_factors_on_its_one_rank_layers(monkeypatch):
    import moegraph.runtime.calibrate.steps as steps
    from moegraph.runtime.calibrate.command import _in_step_stage
    from moegraph.runtime.calibrate.profile_io import CalibrationFacts, Profile
    from moegraph.runtime.calibrate.results import MachineInfo
    group = [_sample(_graph(64, "sp", "ag-rs", 2), "a", GROUP, STREAM_BW),
             _sample(_graph(32, "tp", "a2a", 2), "b", GROUP, STREAM_BW)]
    solo = [_sample(_graph(64, "sp", "ag-rs", 1, dp=2), "s64", SOLO, SOLO_STREAM_BW),
            _sample(_graph(32, "sp", "ag-rs", 1, dp=2), "s32", SOLO, SOLO_STREAM_BW)]
    assert any(nd.is_comm for nd in solo[0].graph.nodes)           # the replicas' gradient sync
    monkeypatch.setattr(steps, "measure_steps", lambda *a, **k: group)
    monkeypatch.setattr(steps, "measure_solo", lambda *a, **k: solo)
    opts = CalibrationOptions(time_budget_s=180.0, verbose=False)
    facts = CalibrationFacts.of_run(opts, MachineInfo("h", "c", 2, "t"), 1.0, (), (), ())
    profile, checks = _in_step_stage(Profile(BASE.to_dict(), facts, "d"), opts, time.time())
    hw = profile.hardware()
    for c in ("gemm", "grouped_gemm", "attention", "memory"):
        assert hw.in_step_factor(c) == pytest.approx(GROUP[c], rel=1e-3), c
        assert dict(hw.solo_in_step_factors)[c] == pytest.approx(SOLO[c], rel=1e-3), c
    assert "comm" not in dict(hw.solo_in_step_factors)           # a lone rank's collectives keep the n-rank price
    assert hw.solo_in_step_stream_bw_bytes_s == pytest.approx(SOLO_STREAM_BW, rel=1e-3)
    assert len(checks) == 4
    for check in checks[2:]:                          # the solo steps, priced by for_group(1): their own fit
        assert check.label in ("s64", "s32")
        assert abs(check.error) < 1e-3, check.line()


def test_the_driver_prices_a_one_rank_layer_with_the_solo_factors():
    from moegraph.schedules.driver import lower
    hw = dataclasses.replace(BASE, name="solo-test", in_step_factors=(("gemm", 2.0),),
                             solo_in_step_factors=(("gemm", 1.25),))
    gemm_factor = {}
    for n in (1, 2):
        config = CompileConfig(model="tiny", strategy=Strategy("sp", "ep", "ag-rs", n, dtype="fp32"), passes=(),
                               schedule="greedy", batch=1, seq=32, hardware=hw)
        lowered = lower(config)
        gemm = next(nd for nd in lowered.graph.nodes if nd.op is OpKind.GEMM)
        kappa = hw.kernel_latency_us
        alone = CostModel(BASE).node_time_us(gemm) - kappa
        gemm_factor[n] = (lowered.cost.node_time_us(gemm) - kappa) / alone
    assert gemm_factor[1] == pytest.approx(1.25) and gemm_factor[2] == pytest.approx(2.0)
