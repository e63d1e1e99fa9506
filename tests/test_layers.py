"""Multi-layer graphs (moegraph.layers): L identical layers lowered once, chained, verified;
activation memory accumulates; no false edges across layers; passes and the interpreter work
on them (numerics against two chained eager layers)."""

import dataclasses
import json

import pytest
import torch
from torch import nn

from helpers import max_grad_err, rel_err, small_layer
from moegraph.cost import CostModel
from moegraph.interpreter import interpret
from moegraph.ir import GraphError, OpKind, Phase, Role, Strategy, verify
from moegraph.passes.stack import stack_layers
from moegraph.layers import layer_count, layer_graph
from moegraph.passes import PassError, run_pipeline
from moegraph.registry import load_hardware, load_model
from moegraph.tracer import relower, trace_layers, trace_model

SMALL = load_model("small")        # 4 layers in the registry
SP = Strategy("sp", "ep", "ag-rs", 2)


def _ancestors(graph, names):
    seen, todo = set(), list(names)
    while todo:
        node = graph.node[todo.pop()]
        for p in graph.predecessors(node):
            if p.name not in seen:
                seen.add(p.name)
                todo.append(p.name)
    return seen


def test_stacked_graph_names_layers_params_and_order():
    one = trace_model(SMALL, SP, seq=64)
    three = stack_layers(trace_model(SMALL, SP, seq=64), 3)
    assert layer_count(three) == 3 and layer_count(one) == 1 and layer_graph(three) == one
    verify(three)
    assert len(three.nodes) == 3 * len(one.nodes)
    assert [n.name for n in three.nodes if n.layer == 2] == [f"l2.{n.name}" for n in one.nodes
                                                              if n.phase is Phase.FORWARD] + \
        [f"l2.{n.name}" for n in one.nodes if n.phase is not Phase.FORWARD]
    for n in three.nodes:
        assert n.name.startswith(f"l{n.layer}.") and n.module.startswith(f"layers.{n.layer}")
    assert all(n.layer is None for n in one.nodes)
    # all forwards first (layer 0 first), then backward and recompute, last layer first
    phases = [(n.phase is not Phase.FORWARD, n.layer) for n in three.nodes]
    fwd_layers = [lay for back, lay in phases if not back]
    bwd_layers = [lay for back, lay in phases if back]
    assert fwd_layers == sorted(fwd_layers) and bwd_layers == sorted(bwd_layers, reverse=True)
    assert phases.index((True, 2)) == len(fwd_layers)
    # distinct parameters and gradients per layer, read from layers.{i}.<name>
    assert len(three.params) == 3 * len(one.params) and len(set(three.grad_of.values())) == 3 * len(one.grads)
    sources = {src.qualname for _, spec in three.params for src in spec.sources}
    one_sources = {src.qualname for _, spec in one.params for src in spec.sources}
    assert sources == {f"layers.{i}.{q}" for i in range(3) for q in one_sources}
    # chaining: layer 1 reads layer 0's output; one input, one seed gradient for the whole stack
    assert "l0.hidden_next" in {i for n in three.nodes if n.layer == 1 for i in n.inputs}
    acts = [v for v in three.inputs if three.value[v].kind.value == "activation"]
    grads = [v for v in three.inputs if three.value[v].kind.value == "grad"]
    assert acts == ["l0.hidden"] and grads == ["l2.d_hidden_next"]
    assert three.outputs[:2] == ("l2.hidden_next", f"l0.{one.outputs[1]}")


def test_activation_bytes_accumulate_across_layers():
    """L layers hold L times one layer's activations, except that layer i's output is layer
    i+1's input: one value, held once. Exact numbers from the one-layer graph and from the
    README's closed form for sp+ep+ag-rs: (2n + 2k + 3kf + 12 + 5/m) * bsh/n elements, bf16."""
    cfg = load_model("mixtral-8x7b")
    one = trace_model(cfg, Strategy("sp", "ep", "ag-rs", 8), seq=8192)
    b, s, h, n, k = 1, 8192, cfg.hidden, 8, cfg.top_k
    f, m = cfg.ffn_hidden / h, cfg.heads / cfg.kv_heads
    per_layer = round((2 * n + 2 * k + 3 * k * f + 12 + 5 / m) * b * s * h / n) * 2
    assert one.activation_bytes() == per_layer
    boundary = b * s // n * h * 2                         # the layer output == next layer's input
    assert {"hidden", "hidden_next"} <= one.saved
    for L in (2, 4):
        many = stack_layers(trace_model(cfg, Strategy("sp", "ep", "ag-rs", 8), seq=8192), L)
        assert many.activation_bytes() == L * per_layer - (L - 1) * boundary
    # with sar=paper the layer output is not held by its own layer (the next one holds it as input)
    cost = CostModel(load_hardware("h800"))
    one_paper, _ = run_pipeline(one, "gate-reorder,sar=paper", cost=cost)
    assert "hidden_next" not in one_paper.saved and "hidden" in one_paper.saved
    four_paper, report = run_pipeline(stack_layers(trace_model(cfg, Strategy("sp", "ep", "ag-rs", 8), seq=8192), 4),
                                      "gate-reorder,sar=paper", cost=cost)
    assert layer_count(four_paper) == 4 and report["sar"]["layers"] == 4
    assert four_paper.activation_bytes() == 4 * one_paper.activation_bytes()
    # Fig 9's kept set for sp+ep+ag-rs: (2kf + 4 + 2/m) * bsh/n elements per layer
    assert four_paper.activation_bytes() == 4 * round((2 * k * f + 4 + 2 / m) * b * s * h / n) * 2


def test_no_false_edges_across_layers():
    """The last layer's weight-gradient all-reduces (sp attention's replicated weights) feed
    only its parameter gradients: no earlier layer's backward waits for them."""
    g = stack_layers(trace_model(SMALL, SP, seq=64), 3)
    wgrad_ar = [n.name for n in g.nodes if n.layer == 2 and n.op is OpKind.ALL_REDUCE and n.role is Role.WGRAD]
    assert wgrad_ar, "sp attention has replicated weights whose gradients are all-reduced"
    l0_backward = [n.name for n in g.nodes if n.layer == 0 and n.phase is not Phase.FORWARD]
    before_l0 = _ancestors(g, l0_backward)
    assert not set(wgrad_ar) & before_l0
    # the check can fail: layer 2's data-gradient nodes are ancestors of layer 0's backward
    assert any(g.node[a].layer == 2 and g.node[a].role is Role.DGRAD for a in before_l0)


def _assert_matches_eager_chain(graph, model: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
    """The interpreted stack ``graph`` computes ``model.layers`` chained in order: output, input
    gradient and every parameter's gradient within 1e-5 of eager autograd."""
    xr = x.clone().requires_grad_(True)
    y_ref = xr
    for layer in model.layers:
        y_ref = layer(y_ref)
    y_ref.backward(dy)
    grads_ref = {k: p.grad for k, p in model.named_parameters()}
    res = interpret(graph, {k: p.detach() for k, p in model.named_parameters()}, x, dy)
    assert rel_err(res.output, y_ref.detach()) < 1e-5
    assert rel_err(res.input_grad, xr.grad) < 1e-5
    assert set(res.param_grads) == set(grads_ref)
    name, err = max_grad_err(res.param_grads, grads_ref)
    assert err < 1e-5, f"gradient of {name}: relative error {err:.2e}"


def _two_layers(seed: int) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList([small_layer(1, seed=seed), small_layer(1, seed=seed + 1)])
    return model


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("passes", ["", "gate-reorder,sar=paper", "dispatch=a2a,chunk=2"])
def test_interpreter_two_layers_match_eager(n, passes, rng):
    model = _two_layers(int(torch.randint(0, 2**31 - 2, (1,), generator=rng)))
    b, s = 2, 16
    x, dy = torch.randn(b, s, 64, generator=rng), torch.randn(b, s, 64, generator=rng)
    graph = stack_layers(trace_layers(model.layers, Strategy("sp", "ep", "ag-rs", n, dtype="fp32"), batch=b, seq=s),
                         len(model.layers))
    if passes:
        graph, _ = run_pipeline(graph, passes, cost=CostModel(load_hardware("h800")))
        assert layer_count(graph) == 2
    _assert_matches_eager_chain(graph, model, x, dy)


@pytest.mark.slow
def test_interpreter_two_layers_detects_swapped_layers(rng):
    """The chained comparison can fail: the layers' weights swapped give another function."""
    model = _two_layers(3)
    x, dy = torch.randn(2, 16, 64, generator=rng), torch.randn(2, 16, 64, generator=rng)
    y_ref = model.layers[1](model.layers[0](x)).detach()
    graph = stack_layers(trace_layers(model.layers, Strategy("sp", "ep", "ag-rs", 2, dtype="fp32"), batch=2, seq=16),
                         len(model.layers))
    swapped = {k.replace("layers.0.", "layers.X.").replace("layers.1.", "layers.0.").replace("layers.X.", "layers.1."):
               p.detach() for k, p in model.named_parameters()}
    assert rel_err(interpret(graph, swapped, x, dy).output, y_ref) > 1e-2


def _mixed_stack(seed: int) -> nn.Module:
    """Layers of two kinds, A B A B: qkv biases on the second kind."""
    model = nn.Module()
    model.layers = nn.ModuleList([small_layer(1, seed=seed + i, **({"qkv_bias": True} if i % 2 else {}))
                                  for i in range(4)])
    return model


@pytest.mark.parametrize("passes", ["", "gate-reorder,sar=paper"])
def test_mixed_layers_lower_each_kind_once_and_match_eager(passes, rng):
    """Layers that differ are a stack of kinds (moegraph.layers.LayerKinds): each distinct layer
    lowered once, layer i its kind's copy; chained they compute the eager layers in order."""
    from moegraph.layers import KINDS_META, layer_kinds
    model = _mixed_stack(int(torch.randint(0, 2**31 - 8, (1,), generator=rng)))
    b, s = 2, 16
    strategy = Strategy("sp", "ep", "ag-rs", 2, dtype="fp32")
    traced = trace_layers(model.layers, strategy, batch=b, seq=s)
    kinds = traced.meta_get(KINDS_META)
    assert kinds.pattern == (0, 1, 0, 1) and kinds.period() == 2 and len(kinds.graphs) == 2
    graph = stack_layers(traced, 4)
    if passes:
        graph, _ = run_pipeline(graph, passes, cost=CostModel(load_hardware("h800")))
    assert layer_count(graph) == 4 and layer_kinds(graph).pattern == (0, 1, 0, 1)
    with pytest.raises(GraphError, match="stacks 2 kinds of layers .*ABAB"):
        layer_graph(graph)
    assert sum(n.op is OpKind.BIAS and n.phase is Phase.FORWARD for n in graph.nodes) == 2      # layers 1, 3
    x, dy = torch.randn(b, s, 64, generator=rng), torch.randn(b, s, 64, generator=rng)
    _assert_matches_eager_chain(graph, model, x, dy)


def test_layer_kinds_period_and_stage_slices():
    from moegraph.layers import LayerKinds
    one = trace_model(SMALL, SP, seq=64)
    other = dataclasses.replace(one, name="other")
    assert LayerKinds((one, other), (0, 1, 0, 1)).period() == 2
    assert LayerKinds((one, other), (0, 0, 1, 1)).period() == 4           # dense first layers: no repeat
    sub = LayerKinds((one, other), (0, 0, 1, 1, 1)).sub([2, 3, 4])
    assert sub.graphs == (other,) and sub.pattern == (0, 0, 0)
    with pytest.raises(GraphError, match="must start with kind 0"):
        LayerKinds((one, other), (1, 0))


@pytest.mark.parametrize("spec", ["sar=paper", "gate-reorder", "dispatch=auto", "chunk=2", "chunk=auto",
                                  "compress=tp-fp8"])
def test_every_pass_runs_on_a_multi_layer_graph(spec):
    """Each pass keeps the layer count and does to every layer what it does to one."""
    cost = CostModel(load_hardware("h800"))
    strategy = Strategy("tp", "ep", "ag-rs", 2)     # tp attention: compress=tp-fp8 has targets
    one, _ = run_pipeline(trace_model(SMALL, strategy, seq=64), spec, cost=cost)
    two, report = run_pipeline(stack_layers(trace_model(SMALL, strategy, seq=64), 2), spec, cost=cost)
    assert layer_count(two) == 2 and len(two.nodes) == 2 * len(one.nodes)
    assert two.strategy == one.strategy and report[spec.partition("=")[0]]["layers"] == 2
    assert {n.name for n in two.nodes if n.layer == 1} == {f"l1.{n.name}" for n in one.nodes}


def test_sar_budget_caps_the_whole_stack():
    """sar=budget:B on 3 layers: the stack holds at most B activation bytes, each layer the
    keep-set a single layer gets under B // 3 (a stack holds 3x one layer's activations); a
    budget below 3x the least footprint is an error naming the stack."""
    cost = CostModel(load_hardware("h800"))
    g = stack_layers(trace_model(SMALL, SP, seq=64), 3)
    one = trace_model(SMALL, SP, seq=64)
    paper = run_pipeline(one, "sar=paper", cost=cost)[0].activation_bytes()
    full = one.activation_bytes()
    budget = 3 * (paper + full) // 2                  # between paper's and no remat's, per layer
    three, report = run_pipeline(g, f"sar=budget:{budget}", cost=cost)
    single, single_report = run_pipeline(one, f"sar=budget:{budget // 3}", cost=cost)
    assert three.activation_bytes() == 3 * single.activation_bytes() <= budget
    assert paper < single.activation_bytes() < full
    assert report["sar"]["kept"] == single_report["sar"]["kept"] and report["sar"]["budget_bytes"] == budget
    assert three.strategy.remat_budget == budget
    with pytest.raises(PassError, match="budget 3000 bytes for 3 layers is below their smallest activation"):
        run_pipeline(g, "sar=budget:3000", cost=cost)


def test_a_stack_is_relowered_through_its_layer_graph():
    """relower takes one layer; the pass manager re-lowers a stack's layer graph and restacks."""
    from moegraph.tracer import LoweringError
    g = stack_layers(trace_model(SMALL, SP, seq=64), 2)
    with pytest.raises(LoweringError, match="holds 2 layers: re-lower its one-layer graph"):
        relower(g, chunks=2)
    again, _ = run_pipeline(g, "chunk=2", cost=None)
    assert layer_count(again) == 2 and again.strategy.chunks == 2
    assert len(again.nodes) == 2 * len(layer_graph(again).nodes)


def test_layer_count_bounds():
    from moegraph.builder import ConfigError
    from moegraph.config import CompileConfig
    from moegraph.schedules.driver import lower
    with pytest.raises(ConfigError, match="between 1 and small's 4 layers"):
        lower(CompileConfig(model=SMALL, strategy=SP, passes=(), seq=64, layers=5))
    with pytest.raises(ValueError, match="positive integer"):
        stack_layers(trace_model(SMALL, SP, seq=64), 0)
    big = dataclasses.replace(SMALL, layers=6)
    assert layer_count(stack_layers(trace_model(big, SP, seq=64), 6)) == 6


@pytest.mark.slow
def test_compile_layers_reports_each_layer(capsys):
    """--layers 2: one schedule of both layers, per-layer times and exposed communication."""
    from moegraph.cli import main
    small = ["--model", "small", "--n", "2", "--seq", "64", "--time-limit", "1"]
    assert main(["compile", *small, "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert "layers" not in one
    assert main(["compile", *small, "--layers", "2", "--json"]) == 0
    two = json.loads(capsys.readouterr().out)
    # plus the model's edges (moegraph.edges): 6 eager norm/head nodes, the norm's all-reduce, 1 gather,
    # the head's [32000, 512] bf16 gradient (32.8 MB) in two 25 MiB buckets: split, 2 all-reduces, concat
    assert two["nodes"] == 2 * one["nodes"] + 12 and [r["layer"] for r in two["layers"]] == [0, 1, "edges"]
    for r in two["layers"]:
        assert r["forward_us"][0] < r["forward_us"][1] <= r["backward_us"][1] <= two["makespan_us"]
        assert 0 <= r["exposed_comm_us"] <= r["comm_us"]
    assert two["layers"][0]["forward_us"][1] <= two["layers"][1]["forward_us"][1]
    assert sum(r["exposed_comm_us"] for r in two["layers"]) >= two["exposed_comm_us"] - 0.01


@pytest.mark.slow
def test_compile_merged_layers_schedules_the_edges(capsys, tmp_path):
    """--layers 2 --micro-batches 2: the merged step graph has the model's edges (an "edges" row,
    no stderr note); CP-SAT schedules every micro-batch's embedding gather and the step's one
    norm all-reduce and head sync (two buckets) each, and the verifier accepts the schedule file."""
    from moegraph.cli import main
    from moegraph.schedules.schedule_file import Schedule
    from moegraph.schedules.verify import verify_schedule
    out = tmp_path / "s.json"
    small = ["--model", "small", "--n", "2", "--seq", "64", "--time-limit", "1", "--layers", "2"]
    assert main(["compile", *small, "--micro-batches", "2", "--json", "-o", str(out)]) == 0
    res = capsys.readouterr()
    c = json.loads(res.out)
    solver = c["solver"]     # "cpsat" only for a schedule the solver improved, else its warm start by name
    improved = solver["makespan_us"] < solver["warm_start_makespan_us"]
    assert c["source"] == ("cpsat" if improved else solver["warm_start"])
    assert c["micro_batches"] == 2
    assert [r["layer"] for r in c["layers"]] == [0, 1, "edges"] and c["layers"][-1]["comm_us"] > 0
    sched = Schedule.load(str(out))
    comm = sorted(n.name for n in sched.nodes if n.attrs.get("edge") and n.kind == "comm")
    assert comm == ["edges.lm_head.bucket0.grad_allreduce", "edges.lm_head.bucket1.grad_allreduce",
                    "edges.norm.grad_allreduce", "mb0.edges.embed.grad_gather",
                    "mb1.edges.embed.grad_gather"]
    assert verify_schedule(sched) == []
