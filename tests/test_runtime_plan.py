"""Execution plans, the single-rank executor, and the measured-trace exports (no spawned ranks)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import moegraph
from helpers import eager_step, max_grad_err, rel_err, small_layer
from moegraph.cost import CostModel
from moegraph.ir import Phase, Strategy
from moegraph.passes.microbatch import merge_microbatches
from moegraph.registry import load_hardware, load_model
from moegraph.tracer import trace_model, trace_module
from moegraph.runtime import PlanError, RuntimeFailure
from moegraph.runtime.module import make_plan, rank_and_size
from moegraph.runtime.plan import COMPUTE, ExecutionPlan, check_plan
from moegraph.runtime.trace import (chrome_trace, compare_prediction, measured_schedule, predicted_schedule,
                           schedule_json)
from moegraph.schedules.schedule_file import Schedule

COST = CostModel(load_hardware("cpu-gloo"))


@pytest.fixture(scope="module")
def graph():
    return trace_module(small_layer(2), Strategy("sp", "ep", "ag-rs", 2, dtype="fp32"), batch=2, seq=16)


def test_sequential_plan_is_graph_order(graph):
    plan = ExecutionPlan.sequential(graph)
    assert [e.name for e in plan.entries] == [n.name for n in graph.nodes]
    assert all((e.stream == COMPUTE) != graph.node[e.name].is_comm for e in plan.entries)
    assert plan.predicted_makespan_us is None
    timed = make_plan(graph, COST, "sequential")                  # the schedules stage's baseline
    assert [(e.name, e.stream, e.alone) for e in timed.entries] == [(e.name, e.stream, e.alone) for e in plan.entries]
    assert timed.with_entries(dataclasses.replace(e, start_us=0.0, end_us=0.0) for e in timed.entries).hash == \
        timed.hash                                                # predicted times are not hashed
    assert timed.predicted_makespan_us == pytest.approx(sum(e.end_us - e.start_us for e in timed.entries))


def test_greedy_plan_issues_collectives_earlier_and_predicts_no_longer(graph):
    seq, greedy = make_plan(graph, COST, "sequential"), make_plan(graph, COST, "greedy")
    assert greedy.hash != seq.hash
    pos = lambda plan: {e.name: i for i, e in enumerate(plan.entries)}  # noqa: E731
    p_seq, p_greedy = pos(seq), pos(greedy)
    comms = [n.name for n in graph.nodes if n.is_comm]
    assert any(p_greedy[c] < p_seq[c] for c in comms)
    assert greedy.predicted_makespan_us < seq.predicted_makespan_us
    check_plan(graph, greedy)


def test_check_plan_names_the_problem(graph):
    plan = ExecutionPlan.sequential(graph)
    entries = list(plan.entries)
    with pytest.raises(PlanError, match=r"^plan 'sequential' misses graph nodes \['input_norm'\]$"):
        check_plan(graph, plan.with_entries(entries[1:]))
    swapped = [entries[1], entries[0], *entries[2:]]
    with pytest.raises(PlanError, match=r"^plan 'sequential': node 'qkv_proj' is issued before 'ln1_out' is "
                                        r"produced \(by 'input_norm'\)$"):
        check_plan(graph, plan.with_entries(swapped))
    wrong = [dataclasses.replace(entries[0], stream="comm"), *entries[1:]]
    with pytest.raises(PlanError, match=r"^plan 'sequential': compute node 'input_norm' is on stream 'comm'$"):
        check_plan(graph, plan.with_entries(wrong))
    first_bwd = next(i for i, e in enumerate(entries) if graph.node[e.name].phase is not Phase.FORWARD)
    late = [*entries[:first_bwd - 1], entries[first_bwd], entries[first_bwd - 1], *entries[first_bwd + 1:]]
    with pytest.raises(PlanError, match=r"forward node 'ffn_residual' comes after"):
        check_plan(graph, plan.with_entries(late))
    twice = [*entries, entries[3]]
    with pytest.raises(PlanError, match=rf"^plan 'sequential' lists node '{entries[3].name}' twice$"):
        check_plan(graph, plan.with_entries(twice))


class _CountedName(str):
    """A node name that counts the equality tests it takes part in (sets and dicts test a name
    once per lookup; a scan of a list tests it against every entry)."""
    compared = 0
    __hash__ = str.__hash__

    def __eq__(self, other):
        _CountedName.compared += 1
        return str.__eq__(self, other)


def test_check_plan_is_linear_in_the_nodes(graph):
    """A 100-layer step graph (5,800 nodes) checks with O(nodes) name comparisons: the listed-node
    set is built once, not per node (the quadratic version took 6.8 s there, the linear 0.03 s)."""
    from moegraph.passes.stack import stack_layers
    big = stack_layers(trace_model(load_model("tiny"), Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=64), 100)
    plan = ExecutionPlan.sequential(big)
    counted = plan.with_entries(dataclasses.replace(e, name=_CountedName(e.name)) for e in plan.entries)
    _CountedName.compared = 0
    check_plan(big, counted)
    assert len(big.nodes) == 5800 and 0 < _CountedName.compared <= 3 * len(big.nodes), _CountedName.compared


def test_plan_from_a_schedule_follows_predicted_starts(graph):
    from moegraph.schedules import compile_graph
    s = compile_graph(graph, COST, method="greedy").schedule
    plan = ExecutionPlan.from_schedule(graph, s)
    starts = [e.start_us for e in plan.entries if graph.node[e.name].phase is Phase.FORWARD]
    assert starts == sorted(starts) and len(starts) < len(plan.entries)
    shuffled = dataclasses.replace(s, nodes=tuple(reversed(s.nodes)))   # file order does not matter
    again = ExecutionPlan.from_schedule(graph, shuffled)
    assert [e.name for e in again.entries] == [e.name for e in plan.entries] and again.hash == plan.hash
    assert plan.source_hash == s.hash and plan.method == "greedy"


def test_plans_come_only_from_schedules(graph):
    with pytest.raises(PlanError, match=r"^schedule 'asap' is not one of cpsat, sequential, greedy, megascale, "
                                       r"megatron-1f1b, dualpipe$"):
        make_plan(graph, COST, "asap")
    with pytest.raises(PlanError, match=r"^cannot build a plan from a SimpleNamespace: expected a moegraph.schedules "
                                        r"Schedule"):
        make_plan(graph, COST, SimpleNamespace(nodes=[]))


def test_without_a_process_group_only_one_rank_runs():
    with pytest.raises(RuntimeFailure, match=r"^n=2 needs torch.distributed initialised with 2 ranks"):
        rank_and_size(2)
    assert rank_and_size(None) == (0, 1)


def test_import_moegraph_stays_light():
    code = "import moegraph, sys; print('runtime' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
    from moegraph.api import compile as api_compile
    assert moegraph.compile is api_compile


# -- one rank: the executor, autograd glue and traces -------------------------------------------------

@pytest.mark.parametrize("schedule", ["sequential", "greedy"])
@pytest.mark.slow
def test_single_rank_matches_eager(schedule, rng):
    layer = small_layer(1, seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
    x, dy = torch.randn(2, 16, 64, generator=rng), torch.randn(2, 16, 64, generator=rng)
    y_ref, dx_ref, g_ref = eager_step(layer, x, dy)
    compiled = moegraph.compile(layer, x, hardware="cpu-gloo", schedule=schedule)
    xs = x.clone().requires_grad_(True)
    y = compiled(xs)
    y.backward(dy)
    assert rel_err(y.detach(), y_ref) < 1e-5 and rel_err(xs.grad, dx_ref) < 1e-5
    name, err = max_grad_err(compiled.full_grads(), g_ref)
    assert err < 1e-5, f"gradient of {name}: {err:.2e}"
    with torch.no_grad():                                      # inference path: nothing kept for backward
        assert rel_err(compiled(x), y_ref) < 1e-5


@pytest.mark.slow
def test_a_missing_input_gradient_is_an_error_naming_it_not_a_zero(rng, monkeypatch):
    """Were the plan or its release lists ever to lose the input gradient, backward would return
    None, which autograd reads as zero: the executor names the value and its node instead."""
    from moegraph.runtime.executor import Executor
    graph = trace_module(small_layer(1), Strategy("sp", "ep", "ag-rs", 1, dtype="fp32"), batch=2, seq=16)
    ex = Executor(graph, ExecutionPlan.sequential(graph), None, rank=0, n=1, device=torch.device("cpu"))
    params = [torch.randn(graph.value[p].shape, generator=rng) for p in ex.param_names]
    y, saved = ex.forward(torch.randn(2, 16, 64, generator=rng), params)
    dx, _ = ex.backward(saved, torch.randn_like(y), params)
    assert dx is not None and dx.shape == (2, 16, 64)
    run = ex._run
    monkeypatch.setattr(ex, "_run", lambda *a, **k: {v: t for v, t in run(*a, **k).items() if v != ex.input_grad_name})
    with pytest.raises(RuntimeError, match=rf"input gradient '{ex.input_grad_name}' \(made by node "
                                           rf"'{graph.producer[ex.input_grad_name].name}'\) is missing after the run"):
        ex.backward(saved, torch.randn_like(y), params)
    # a merged step of two micro-batches (Executor.step): micro-batch 1's input gradient
    merged = merge_microbatches(graph, 2)
    ex = Executor(merged, ExecutionPlan.sequential(merged), None, rank=0, n=1, device=torch.device("cpu"))
    xs, dys = [torch.randn(2, 16, 64, generator=rng) for _ in range(2)], [torch.randn(2, 16, 64) for _ in range(2)]
    assert all(dx is not None for dx in ex.step(xs, dys, params)[1])
    lost = ex.boundaries[1][3]
    run = ex._run
    monkeypatch.setattr(ex, "_run", lambda *a, **k: {v: t for v, t in run(*a, **k).items() if v != lost})
    with pytest.raises(RuntimeError, match=rf"micro-batch 1's input gradient '{lost}' \(made by node "):
        ex.step(xs, dys, params)


@pytest.mark.slow
def test_gradients_accumulate_like_autograd(rng):
    layer = small_layer(1)
    x, dy = torch.randn(2, 16, 64, generator=rng), torch.randn(2, 16, 64, generator=rng)
    compiled = moegraph.compile(layer, x, hardware="cpu-gloo", schedule="sequential")
    compiled(x).backward(dy)
    once = {k: p.grad.clone() for k, p in compiled.named_parameters()}
    compiled(x).backward(dy)
    for k, p in compiled.named_parameters():
        assert torch.allclose(p.grad, 2 * once[k], rtol=1e-5, atol=1e-6), k


def test_wrong_input_shard_shape_is_named(rng):
    compiled = moegraph.compile(small_layer(1), torch.randn(2, 16, 64), hardware="cpu-gloo", schedule="sequential")
    with pytest.raises(ValueError, match=r"^input shard has shape \(2, 8, 64\), the graph expects \(2, 16, 64\)"):
        compiled(torch.randn(2, 8, 64))


def test_measured_trace_exports(rng, tmp_path):
    layer = small_layer(1)
    x, dy = torch.randn(2, 16, 64, generator=rng), torch.randn(2, 16, 64, generator=rng)
    compiled = moegraph.compile(layer, x, hardware="cpu-gloo", schedule="greedy")
    for _ in range(3):
        compiled(x.clone().requires_grad_(True)).backward(dy)
    traces = compiled.traces
    assert len(traces) == 3
    tr = traces[-1]
    assert [t.name for t in tr.nodes] == [e.name for e in compiled.plan.entries]
    assert all(t.end_us >= t.start_us >= 0 for t in tr.nodes)
    assert 0 < tr.backward_start_us < tr.step_us
    sched = measured_schedule(tr, compiled.graph, compiled.plan, hardware=load_hardware("cpu-gloo"))
    doc = json.loads(json.dumps(schedule_json(sched)))
    assert doc["measured"] is True and doc["summary"]["plan_hash"] == compiled.plan.hash
    assert set(doc["nodes"][0]) >= {"name", "stream", "start_us", "end_us", "sm_budget", "phase"}
    back = Schedule.from_json(json.dumps(doc))                   # what the Gantt renderer reads
    assert back.node["attention"].start_us == pytest.approx(tr.by_name()["attention"].start_us, abs=1e-3)
    assert back.compute_hash() == back.hash
    pred = predicted_schedule(compiled.graph, compiled.plan)
    assert pred.summary["measured"] is False
    assert pred.makespan_us == pytest.approx(compiled.plan.predicted_makespan_us, rel=1e-6)
    chrome = chrome_trace(traces[-1:], compiled.graph)
    spans = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(compiled.graph.nodes)
    cmp = compare_prediction(compiled.plan, traces)
    assert len(cmp["nodes"]) == len(compiled.graph.nodes) and cmp["total"]["predicted_us"] > 0


def test_module_and_input_must_share_device_and_dtype():
    with pytest.raises(ValueError, match=r"^module parameters live on \['cpu/torch.float32'\] but example_inputs "
                                         r"is cpu/torch.bfloat16"):
        moegraph.compile(small_layer(1), torch.randn(2, 16, 64, dtype=torch.bfloat16), hardware="cpu-gloo",
                         schedule="sequential")


@pytest.mark.parametrize("dtype", [torch.int64, torch.float16, torch.bfloat16, torch.float64])
def test_call_with_another_dtype_than_compiled_is_named(dtype):
    # an fp32 layer took int64 / fp16 / bf16 activations silently (returned fp32) and failed on fp64
    # inside a matmul kernel
    compiled = moegraph.compile(small_layer(1), torch.randn(2, 16, 64), hardware="cpu-gloo", schedule="sequential")
    x = torch.randn(2, 16, 64).to(dtype) if dtype.is_floating_point else torch.randint(0, 5, (2, 16, 64))
    with pytest.raises(TypeError, match=rf"^compiled layer '.*' was compiled for fp32 activations and got {dtype}: "
                                        r"pass a torch.float32 tensor"):
        compiled(x)


def test_call_with_an_input_on_another_device_is_named():
    compiled = moegraph.compile(small_layer(1), torch.randn(2, 16, 64), hardware="cpu-gloo", schedule="sequential")
    with pytest.raises(ValueError, match=r"^compiled layer '.*' holds its parameters on cpu and got an input on meta: "
                                         r"move the input there"):
        compiled(torch.randn(2, 16, 64, device="meta"))


def test_call_under_autocast_is_refused():
    compiled = moegraph.compile(small_layer(1), torch.randn(2, 16, 64), hardware="cpu-gloo", schedule="sequential")
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(RuntimeFailure, match=r"called under torch.autocast\('cpu', dtype=torch.bfloat16\): .*"
                                                r"compile a bf16 module instead"):
        compiled(torch.randn(2, 16, 64))


def test_integer_layer_example_input_is_named():
    with pytest.raises(ValueError, match=r"^example_inputs is an integer tensor torch.int64 \[2, 16, 64\]: a layer "
                                         r"\(MoETransformerLayer\) takes its floating input \[b, s, h\]"):
        moegraph.compile(small_layer(1), torch.randint(0, 5, (2, 16, 64)), hardware="cpu-gloo", schedule="sequential")


@pytest.mark.parametrize("passes", ["none", " None ", ""])
def test_api_passes_none_runs_no_pass_as_the_cli(passes):
    # the README: `--passes none` runs none, the same rule everywhere incl. moegraph.compile
    compiled = moegraph.compile(small_layer(1), torch.randn(2, 16, 64), hardware="cpu-gloo", schedule="sequential",
                                passes=passes)
    assert not any(n.attr("remat", False) or n.phase is Phase.RECOMPUTE for n in compiled.graph.nodes)


def test_analytically_zero_gradients_are_reported_apart(rng):
    from moegraph.runtime.check import grad_report
    big = torch.randn(64, 64, generator=rng)
    noise = 1e-9 * torch.randn(8, 64, generator=rng)             # e.g. the router's gradient under top-1
    ok = grad_report({"w": (big * (1 + 1e-7), big), "router": (noise.flip(0), noise)})
    assert ok["worst_grad"] == "w" and ok["max_rel_err_grads"] < 1e-6
    assert ok["near_zero_grads"] == ["router"] and ok["max_err_near_zero_grads"] < 1e-6
    bad = grad_report({"w": (big, big), "router": (noise + 1e-2, noise)})   # a real gradient where none is
    assert bad["max_err_near_zero_grads"] > 1e-4


def test_sequential_plans_fence_every_collective(graph):
    seq = ExecutionPlan.sequential(graph)
    assert {e.name for e in seq.entries if e.alone} == {n.name for n in graph.nodes if n.is_comm}
    assert {e.name for e in make_plan(graph, COST, "sequential").entries if e.alone} == \
        {n.name for n in graph.nodes if n.is_comm}
    unfenced = seq.with_entries(dataclasses.replace(e, alone=False) for e in seq.entries)
    assert unfenced.hash != seq.hash                           # ranks must agree on the fences too


def test_plan_marks_alone_what_the_schedule_runs_alone(graph):
    from moegraph.schedules import compile_graph
    hw = dataclasses.replace(load_hardware("cpu-2core-gloo"), comm_overlap_stretch=1.01)
    s = compile_graph(graph, CostModel(hw), time_limit_s=2.0).schedule
    busy = [(n.start_us, n.end_us) for n in s.nodes if n.kind == "compute" and n.end_us > n.start_us]
    alone = {n.name for n in s.nodes if n.kind == "comm"
             and not any(a < n.end_us and n.start_us < b for a, b in busy)}
    assert alone and alone != {n.name for n in s.nodes if n.kind == "comm"}   # both kinds occur here
    plan = ExecutionPlan.from_schedule(graph, s)
    assert {e.name for e in plan.entries if e.alone} == alone


def test_only_collectives_can_be_alone(graph):
    plan = ExecutionPlan.sequential(graph)
    first_compute = next(e for e in plan.entries if e.stream == COMPUTE)
    bad = plan.with_entries(dataclasses.replace(e, alone=True) if e is first_compute else e for e in plan.entries)
    with pytest.raises(PlanError, match=f"compute node '{first_compute.name}' is marked alone"):
        check_plan(graph, bad)


def test_nodes_appear_under_their_names_in_torch_profiler(rng):
    compiled = moegraph.compile(small_layer(1), torch.randn(2, 16, 64), hardware="cpu-gloo", schedule="sequential")
    x, dy = torch.randn(2, 16, 64, generator=rng), torch.randn(2, 16, 64, generator=rng)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(x.clone().requires_grad_(True)).backward(dy)
    names = {evt.key for evt in prof.key_averages()}
    graph_nodes = {n.name for n in compiled.graph.nodes}
    assert graph_nodes <= names, sorted(graph_nodes - names)[:5]
