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
from moegraph.runtime.calibrate.steps import (StepSample, fit_in_step, fit_overlap_stretch, fit_stream, in_step_checks,
                                          retimed_makespan_us, service_spans)
from moegraph.runtime.trace import NodeTiming

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
    fit = fit_in_step(BASE, _layers(0.0))
    factors = fit.factors
    assert (fit.stream_bw_bytes_s, fit.accumulate_bw_bytes_s) == (0.0, 0.0)   # no such terms in the data
    assert set(factors) == set(IN_STEP_CLASSES)
    for c, f in TRUE.items():
        assert factors[c] == pytest.approx(f, rel=1e-3), c


def test_time_between_nodes_is_spread_over_the_classes():
    samples = _layers(GAP_US, split_us=3.0)
    factors = fit_in_step(BASE, samples).factors
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


# --- service times, weight streaming and accumulation (issue 13 item 4) ---------------------

def _t(name: str, stream: str, start: float, end: float) -> NodeTiming:
    return NodeTiming(name, stream, 0, "backward", start, end)


def test_service_spans_remove_the_wait_behind_queued_collectives():
    # three all-reduces issued together at 100 us on one stream finish one after another;
    # a compute node on the host stream and a later collective are their own spans
    nodes = [_t("mm", "compute", 0.0, 100.0), _t("ar1", "comm", 100.0, 140.0), _t("ar2", "comm", 100.5, 300.0),
             _t("ar3", "comm", 101.0, 310.0), _t("late", "comm", 400.0, 450.0), _t("mm2", "compute", 310.0, 330.0)]
    assert service_spans(nodes) == pytest.approx({"mm": 100.0, "ar1": 40.0, "ar2": 160.0, "ar3": 10.0,
                                                  "late": 50.0, "mm2": 20.0})


def test_fit_stream_recovers_a_known_line_and_refuses_an_unseparable_one():
    xs, zs = [100.0, 200.0, 300.0, 150.0], [8.0, 8.0, 16.0, 32.0]
    ys = [0.9 * x + 2.5 * z for x, z in zip(xs, zs)]
    assert fit_stream(xs, ys, zs) == pytest.approx((0.9, 2.5))
    # z proportional to x: the two terms cannot be told apart, so no streaming term
    assert fit_stream(xs, [1.2 * x for x in xs], [x / 10 for x in xs]) == pytest.approx((1.2, 0.0))
    # the data say less time for more bytes: no negative streaming
    f, c = fit_stream(xs, [x - 0.5 * z for x, z in zip(xs, zs)], zs)
    assert c == 0.0 and f == pytest.approx(sum(x - 0.5 * z for x, z in zip(xs, zs)) / sum(xs))


STREAM_BW, SUM_BW = 4e9, 2e9          # bytes/s the synthetic steps are made with


def _with_terms(graph, label: str, factors: dict = TRUE, stream_bw: float = STREAM_BW) -> StepSample:
    """Measurements from known factors plus the two in-step terms at known rates."""
    cost, kappa = CostModel(BASE), BASE.kernel_latency_us
    spans = {}
    for node in graph.nodes:
        p = cost.node_time_us(node)
        t = 0.0 if node.op is OpKind.SPLIT else kappa + factors[op_class(node)] * (p - kappa)
        if node.op is OpKind.GROUPED_GEMM:
            t += node.attr("stream_bytes") / stream_bw * 1e6
        if node.attr("accumulate", False):
            t += node.attr("accumulate_bytes") / SUM_BW * 1e6
        spans[node.name] = t
    return StepSample(label, graph, tuple(spans.items()), sum(spans.values()))


def test_fit_recovers_the_streaming_and_accumulation_rates():
    chunked = trace_model(load_model("tiny"), Strategy(attn="sp", ffn="ep", dispatch="ag-rs", n=2, dtype="fp32",
                                                       chunks=2), batch=1, seq=64)
    summing = [nd for nd in chunked.nodes if nd.attr("accumulate", False)]
    assert summing and all(nd.attr("accumulate_bytes") > 0 for nd in summing)
    samples = [_with_terms(_graph(64, "sp", "ep", "ag-rs"), "a"), _with_terms(_graph(32, "tp", "ep", "a2a"), "b"),
               _with_terms(chunked, "c")]
    fit = fit_in_step(BASE, samples)
    assert fit.stream_bw_bytes_s == pytest.approx(STREAM_BW, rel=1e-3)
    assert fit.accumulate_bw_bytes_s == pytest.approx(SUM_BW, rel=1e-3)
    for c, f in TRUE.items():
        assert fit.factors[c] == pytest.approx(f, rel=1e-3), c
    fitted = dataclasses.replace(BASE, in_step_factors=tuple(fit.factors.items()),
                                 in_step_stream_bw_bytes_s=fit.stream_bw_bytes_s,
                                 accumulate_bw_bytes_s=fit.accumulate_bw_bytes_s)
    for check in in_step_checks(fitted, samples):
        assert abs(check.error) < 1e-3, check.line()


def _without(graph, key: str):
    """``graph`` with attr ``key`` taken off its first node that has it, and that node."""
    node = next(nd for nd in graph.nodes if nd.attr(key, None) is not None)
    bare = dataclasses.replace(node, attrs=tuple((k, v) for k, v in node.attrs if k != key))
    return dataclasses.replace(graph, nodes=tuple(bare if nd is node else nd for nd in graph.nodes)), node


@pytest.mark.parametrize("key", ["stream_bytes", "accumulate_bytes"])
def test_fit_refuses_a_node_without_its_byte_count(key):
    """A node without the byte count its rate is fitted by is an error naming it (as the cost
    model's), not a 0 that would fit the rate on fewer bytes than were moved."""
    chunked = trace_model(load_model("tiny"), Strategy(attn="sp", ffn="ep", dispatch="ag-rs", n=2, dtype="fp32",
                                                       chunks=2), batch=1, seq=64)
    samples = [_with_terms(_graph(64, "sp", "ep", "ag-rs"), "a"), _with_terms(_graph(32, "tp", "ep", "a2a"), "b"),
               _with_terms(chunked, "c")]
    i = 0 if key == "stream_bytes" else 2              # an expert GEMM's, a summing kernel's
    bare, node = _without(samples[i].graph, key)
    samples[i] = dataclasses.replace(samples[i], graph=bare)
    with pytest.raises(ValueError, match=f"node '{node.name}' .* has {key}=None, but the in-step fit prices"):
        fit_in_step(BASE, samples)


def test_a_chunked_layer_alone_gives_no_factors():
    chunked = trace_model(load_model("tiny"), Strategy(attn="sp", ffn="ep", dispatch="ag-rs", n=2, dtype="fp32",
                                                       chunks=2), batch=1, seq=64)
    with pytest.raises(ValueError, match="needs at least one measured layer without gradient accumulation"):
        fit_in_step(BASE, [_with_terms(chunked, "c")])


def test_in_step_stage_stores_both_rates_in_the_profile(monkeypatch):
    import time

    import moegraph.runtime.calibrate.steps as steps
    from moegraph.runtime.calibrate.results import MachineInfo
    from moegraph.runtime.calibrate.command import _in_step_stage
    from moegraph.runtime.calibrate.profile_io import CalibrationFacts, Profile
    chunked = trace_model(load_model("tiny"), Strategy(attn="sp", ffn="ep", dispatch="ag-rs", n=2, dtype="fp32",
                                                       chunks=2), batch=1, seq=64)
    samples = [_with_terms(_graph(64, "sp", "ep", "ag-rs"), "a"), _with_terms(_graph(32, "tp", "ep", "a2a"), "b"),
               _with_terms(chunked, "c")]
    monkeypatch.setattr(steps, "measure_steps", lambda *a, **k: samples)
    monkeypatch.setattr(steps, "measure_solo", lambda *a, **k: [])      # tests/test_solo_in_step.py
    opts = CalibrationOptions(time_budget_s=180.0, verbose=False)
    facts = CalibrationFacts.of_run(opts, MachineInfo("h", "c", 2, "t"), 1.0, (), (), ())
    profile, checks = _in_step_stage(Profile(BASE.to_dict(), facts, "d"), opts, time.time())
    hw = profile.hardware()
    assert hw.in_step_stream_bw_bytes_s == pytest.approx(STREAM_BW, rel=1e-3)
    assert hw.accumulate_bw_bytes_s == pytest.approx(SUM_BW, rel=1e-3)
    assert len(checks) == 3 and all(abs(c.error) < 1e-3 for c in checks)


# --- comm_overlap_stretch fitted in-step on a greedy plan (fit_overlap_stretch) ---------------------

def _probed(seq: int, measured_us: float | None = None, stretch: float | None = None) -> StepSample:
    from moegraph.runtime.module import make_plan
    graph = _graph(seq, "sp", "ep", "ag-rs")
    hw = dataclasses.replace(BASE, comm_overlap_stretch=1.0)
    plan = make_plan(graph, CostModel(hw), "greedy")
    if measured_us is None:
        measured_us = retimed_makespan_us(graph, CostModel(hw), plan, stretch)
    return StepSample(f"s{seq}", graph, (), 1.0, overlap_plan=plan, overlap_step_us=measured_us)


def test_retimed_order_reproduces_the_schedulers_makespan_at_stretch_one():
    # the list scheduler (moegraph.schedules) timed this plan; the retiming re-derives it from
    # the plan's order alone
    from moegraph.runtime.module import make_plan
    graph = _graph(64, "sp", "ep", "ag-rs")
    cost = CostModel(dataclasses.replace(BASE, comm_overlap_stretch=1.0))
    plan = make_plan(graph, cost, "greedy")
    assert any(not e.alone for e in plan.entries if graph.node[e.name].is_comm)     # it overlaps
    assert retimed_makespan_us(graph, cost, plan, 1.0) == pytest.approx(plan.predicted_makespan_us, rel=2e-3)
    # collectives beside compute that take longer push the makespan out
    assert retimed_makespan_us(graph, cost, plan, 3.0) > retimed_makespan_us(graph, cost, plan, 1.0) * 1.01


def test_fit_overlap_stretch_recovers_a_known_stretch_and_clamps():
    hw = dataclasses.replace(BASE, comm_overlap_stretch=1.0)
    assert fit_overlap_stretch(hw, [_probed(64, stretch=1.7), _probed(32, stretch=1.7)]) == pytest.approx(1.7, abs=2e-3)
    # measured no longer than the order at x = 1: no stretch
    assert fit_overlap_stretch(hw, [_probed(64, measured_us=1.0)]) == 1.0
    # unreachable: clamped at the maximum
    assert fit_overlap_stretch(hw, [_probed(64, measured_us=1e12)]) == 4.0
    # no probed layer: nothing fitted
    assert fit_overlap_stretch(hw, _layers(0.0)) is None
