"""In-step factors: the registry validates them, the cost model applies them to the part of a
node's time above the kernel latency, and the calibration's fit recovers known factors."""

from __future__ import annotations

import dataclasses
import re

import pytest

from moegraph.cost import CostModel, op_class
from moegraph.ir import Node, OpKind, Phase, Strategy
from moegraph.registry import IN_STEP_CLASSES, RegistryError, load_hardware, load_model
from moegraph.tracer import trace_model
from moegraph.runtime.calibrate.options import CalibrationOptions, in_step_enabled
from moegraph.runtime.calibrate.steps import StepSample, fit_in_step, in_step_checks

BASE = load_hardware("cpu-gloo")


def _with(**factors) -> object:
    return dataclasses.replace(BASE, in_step_factors=tuple(factors.items()))


def test_unknown_class_and_bad_factor_are_rejected_by_name():
    with pytest.raises(RegistryError, match="unknown op class 'gemms'; valid: gemm, grouped_gemm"):
        _with(gemms=2.0)
    with pytest.raises(RegistryError, match=r"comm: factor 0\.01 is outside \[0\.1, 100\]"):
        _with(comm=0.01)


def test_factor_scales_only_the_time_above_the_kernel_latency():
    gemm = Node("g", OpKind.GEMM, Phase.FORWARD, (), ("y",), flops=int(4e9), mem_bytes=1000)
    comm = Node("c", OpKind.ALL_GATHER, Phase.FORWARD, (), ("y",), comm_bytes=1 << 20, group=2)
    kappa = BASE.kernel_latency_us
    hw = _with(gemm=1.5, comm=3.0)
    # independent of the cost model's internals: flops / (peak * gemm_eff) for an uncurved profile
    assert not BASE.curves
    alone = 4e9 / (BASE.peak_flops_bf16 * BASE.gemm_eff) * 1e6
    assert CostModel(hw).node_time_us(gemm) == pytest.approx(kappa + 1.5 * alone)
    base_comm = CostModel(BASE).node_time_us(comm)
    assert CostModel(hw).node_time_us(comm) == pytest.approx(kappa + 3.0 * (base_comm - kappa))
    # a class without a factor is unchanged
    rms = Node("r", OpKind.RMSNORM, Phase.FORWARD, (), ("y",), flops=10, mem_bytes=1 << 20)
    assert CostModel(hw).node_time_us(rms) == CostModel(BASE).node_time_us(rms)


def test_every_op_kind_has_a_class():
    assert {op_class(Node("x", op, Phase.FORWARD, (), ("y",))) for op in OpKind} <= set(IN_STEP_CLASSES)


def test_factors_round_trip_through_to_dict():
    hw = _with(memory=2.25, attention=1.4)
    again = dataclasses.replace(BASE, **{"in_step_factors": hw.to_dict()["in_step_factors"]})
    assert again.in_step_factor("memory") == 2.25 and again.in_step_factor("gemm") == 1.0


def _graph(seq: int, attn: str, ffn: str, dispatch: str):
    return trace_model(load_model("tiny"), Strategy(attn=attn, ffn=ffn, dispatch=dispatch, n=2, dtype="fp32"),
                       batch=1, seq=seq)


TRUE = {"gemm": 1.3, "grouped_gemm": 1.1, "attention": 1.6, "memory": 2.5, "comm": 3.2}
GAP_US = 7.0


def _synthetic(graph, label: str, gap_us: float, split_us: float) -> StepSample:
    """Measurements made from known factors and a known per-node host gap."""
    cost, kappa = CostModel(BASE), BASE.kernel_latency_us
    spans = {}
    for node in graph.nodes:
        p = cost.node_time_us(node)
        spans[node.name] = split_us if node.op is OpKind.SPLIT else kappa + TRUE[op_class(node)] * (p - kappa)
    priced = sum(1 for node in graph.nodes if node.op is not OpKind.SPLIT)
    return StepSample(label, graph, tuple(spans.items()), sum(spans.values()) + gap_us * priced)


def _layers(gap_us: float, split_us: float = 0.0) -> list[StepSample]:
    return [_synthetic(_graph(64, "sp", "ep", "ag-rs"), "a", gap_us, split_us),
            _synthetic(_graph(32, "tp", "ep", "a2a"), "b", gap_us, split_us)]


def test_fit_recovers_known_factors():
    factors = fit_in_step(BASE, _layers(0.0))
    assert set(factors) == set(IN_STEP_CLASSES)
    for c, f in TRUE.items():
        assert factors[c] == pytest.approx(f, rel=1e-3), c


def test_time_between_nodes_is_spread_over_the_classes():
    samples = _layers(GAP_US, split_us=3.0)
    factors = fit_in_step(BASE, samples)
    ratio = factors["gemm"] / TRUE["gemm"]
    assert ratio > 1.01
    for c, f in TRUE.items():                       # one common scale ...
        assert factors[c] / f == pytest.approx(ratio, rel=1e-3), c
    fitted = _with(**factors)                        # ... that makes the pooled makespan the pooled steps
    assert fitted.kernel_latency_us == BASE.kernel_latency_us
    total_pred = sum(CostModel(fitted).node_time_us(node) for s in samples for node in s.graph.nodes)
    assert total_pred == pytest.approx(sum(s.step_us for s in samples), rel=1e-3)
    splits = sum(1 for node in samples[0].graph.nodes if node.op is OpKind.SPLIT)
    assert splits > 0                                 # their measured 3 us each are in the steps too
    for check in in_step_checks(fitted, samples):
        assert abs(check.error) < 0.05, check.line()      # each layer near the pooled fit
        assert re.fullmatch(r"in-step \w+: sequential step [\d.]+ ms predicted vs [\d.]+ ms measured \([-+][\d.]+%\)",
                            check.line())


def test_fit_names_an_unmeasured_node():
    g = _graph(32, "tp", "ep", "a2a")
    s = _synthetic(g, "x", 0.0, 0.0)
    s = dataclasses.replace(s, node_us=s.node_us[1:])
    with pytest.raises(ValueError, match=f"x: no measured span for node '{g.nodes[0].name}'"):
        fit_in_step(BASE, [s])


@pytest.mark.parametrize("kw, enabled", [({}, True), ({"n": 1}, False), ({"time_budget_s": 60.0}, False),
                                         ({"device": "cuda"}, False)])
def test_in_step_stage_runs_only_where_it_can(kw, enabled):
    assert in_step_enabled(CalibrationOptions(**kw)) is enabled


def test_relative_mad_ignores_a_stalled_step():
    from moegraph.runtime.calibrate.steps import relative_mad
    assert relative_mad([1.0, 2.0, 3.0, 4.0, 100.0]) == pytest.approx(1 / 3)   # median 3, deviations' median 1
    assert relative_mad([5.0, 5.0, 5.0]) == 0.0
