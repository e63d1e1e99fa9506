"""The edges of a compiled causal LM (moegraph.edges): the embedding, final norm and LM head
gradients are synchronised by graph collectives that the scheduler places and the runtime
executes from the plan. Small graphs and 2 gloo ranks."""

from __future__ import annotations

import importlib.util
import os

import pytest

import edges_workers as workers
from moegraph.cost import CostModel
from moegraph.edges import add_edges, edge_values
from moegraph.ir import GraphError, Strategy
from moegraph.registry import load_hardware, load_model
from moegraph.runtime.launch import spawn
from moegraph.schedules.api import compile_graph
from moegraph.tracer import trace_model

TOL = 1e-5
HAS_HF = importlib.util.find_spec("transformers") is not None
SYNC = ("edges.norm.grad_allreduce", "edges.lm_head.grad_allreduce")


def _graph(dp: int = 1, vocab: int | None = 32000, layers: int = 2):
    cfg = load_model("mixtral-8x7b")
    g = trace_model(cfg, Strategy("sp", "ep", "ag-rs", 8, dtype="bf16", dp=dp), batch=1, seq=2048, layers=layers)
    return add_edges(g, vocab=vocab)


@pytest.mark.parametrize("method", ["greedy", "cpsat"])
def test_edge_sync_is_scheduled_under_the_layers_backward(method):
    """The head and norm gradient all-reduces start before the layers' backward compute ends
    (their partials exist at the barrier, nothing else reads them); the embedding gather starts
    after layer 0's input gradient is made."""
    g = _graph()
    s = compile_graph(g, CostModel(load_hardware("h800")), method=method, time_limit_s=2.0).schedule
    by = {n.name: n for n in s.nodes}
    assert set(SYNC) | {"edges.embed.grad_gather"} <= set(by)
    backward = [n for n in s.nodes if n.kind == "compute" and n.phase != "forward"]
    last_end = max(n.end_us for n in backward)
    forward_end = max(n.end_us for n in s.nodes if n.phase == "forward")
    for name in SYNC:
        assert forward_end <= by[name].start_us < last_end, (name, by[name].start_us, forward_end, last_end)
    dx = g.producer[g.outputs[1]].name                     # layer 0's input gradient
    assert by["edges.embed.grad_gather"].start_us >= by[dx].end_us
    # the eager head and norm backward make the seed: every layer's backward starts after it
    seed_made = by["edges.norm.dgrad"].end_us
    assert all(n.start_us >= seed_made for n in s.nodes if "layer" in n.attrs and n.phase == "backward")
    assert by["edges.lm_head"].start_us >= max(n.end_us for n in s.nodes if n.attrs.get("layer") == 1
                                              and n.phase == "forward")
    assert all(by[k].attrs.get("edge") is True and "layer" not in by[k].attrs for k in SYNC)


def test_eager_edge_compute_is_priced():
    """The head GEMMs: 2*T*h*V FLOPs each (T = b*s/n = 2048/8 tokens, h 4096, V 32000), reading
    the [V, h] weight; the norm's forward 4*T*h. All marked eager (the runtime's autograd runs them)."""
    g = _graph(layers=1)
    T, h, V = 2048 // 8, 4096, 32000
    node = {n.name: n for n in g.nodes}
    for name in ("edges.lm_head", "edges.lm_head.dgrad", "edges.lm_head.wgrad"):
        assert node[name].flops == 2 * T * h * V
        assert node[name].mem_bytes == 2 * (T * h + V * h + T * V)          # bf16
    assert node["edges.norm"].flops == 4 * T * h
    eager = {n.name for n in g.nodes if n.attr("eager", False)}
    assert eager == {"edges.norm", "edges.lm_head", "edges.lm_head.dgrad", "edges.lm_head.wgrad",
                     "edges.norm.dgrad", "edges.norm.wgrad"}
    assert not any(node[n].is_comm for n in eager)
    assert g.producer[edge_values(g).seed].name == "edges.norm.dgrad"


def test_edge_sync_follows_the_dp_rule_and_base_models_have_no_head():
    g = _graph(dp=2, layers=1)
    names = {n.name for n in g.nodes if n.attr("edge", False)}
    # the hierarchical sync of a replicated parameter (autodiff._dp_sync), the rows gathered over replicas
    assert {"edges.lm_head.grad_rs_intra", "edges.lm_head.grad_rs_inter", "edges.lm_head.grad_ag_inter",
            "edges.lm_head.grad_ag_intra", "edges.norm.grad_rs_inter", "edges.embed.grad_gather_dp"} <= names
    assert g.value[edge_values(g).embed_rows].shape == (2, 2048, 4096)
    base = _graph(vocab=None, layers=1)
    assert edge_values(base).head_partial is None and not any("lm_head" in n.name for n in base.nodes)
    with pytest.raises(GraphError, match="already has its edges"):
        add_edges(base, vocab=None)


@pytest.fixture(scope="module")
def n2():
    res = spawn(workers.edge_grad_checks, 2, args=(int.from_bytes(os.urandom(3), "little"),), timeout_s=300)
    return res[0]


def test_compiled_model_runs_the_edge_collectives_from_the_plan(n2):
    assert {*SYNC, "edges.embed.grad_gather"} <= set(n2["edge_nodes"])
    assert max(n2["scheduled"].values()) < TOL, n2["scheduled"]


def test_without_the_edge_collectives_the_edge_gradients_are_wrong(n2):
    """The same step with the plan's edge collectives made local no-ops: the edges' gradients
    are each rank's partials, so nothing else synchronises them (no eager all-reduce)."""
    removed = n2["removed"]
    for part in ("embed", "norm", "head"):
        assert removed[part] > 1e-2, removed
    assert removed["layers"] < TOL, removed           # the layers' own sync is untouched


def test_compile_json_and_gantt_report_the_edges(capsys, tmp_path):
    """compile --layers: the per-layer rows end with an "edges" row holding the edge collectives'
    time; the Chrome trace has an "edges" process and lane thread."""
    import json

    from moegraph.cli import main
    out = tmp_path / "s.json"
    assert main(["compile", "--model", "mixtral-8x7b", "--layers", "2", "--seq", "1024", "--schedule", "greedy",
                 "--json", "-o", str(out)]) == 0
    c = json.loads(capsys.readouterr().out)
    assert [r["layer"] for r in c["layers"]] == [0, 1, "edges"]
    edges = c["layers"][-1]
    # the eager norm and head compute is priced in the forward and the backward, the syncs in the backward
    assert edges["comm_us"] > 0 and edges["compute_us"] > 0 and edges["forward_us"] and edges["backward_us"]
    assert 0 <= edges["exposed_comm_us"] <= edges["comm_us"]
    sched = json.loads(out.read_text())
    assert {n["name"] for n in sched["nodes"] if n["attrs"].get("edge") and n["kind"] == "comm"} == \
        {*SYNC, "edges.embed.grad_gather"}
    assert main(["gantt", str(out), "-o", str(tmp_path / "t.json")]) == 0
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = [e["args"]["name"] for e in trace if e["name"] in ("process_name", "thread_name")]
    assert "edges" in names and any(n.endswith(" edges") for n in names)


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_base_model_gradients_match_eager_on_2_ranks():
    """No head: the norm's all-reduce and the embedding gather still run from the plan, and
    every gradient (embedding, final norm, layers) equals eager's."""
    res = spawn(workers.base_model_grad_checks, 2, args=(int.from_bytes(os.urandom(3), "little"),),
                timeout_s=300)[0]
    assert {"edges.norm.grad_allreduce", "edges.embed.grad_gather"} <= set(res["edge_nodes"])
    assert not any("lm_head" in e for e in res["edge_nodes"])
    assert max(res["errors"].values()) < TOL, res["errors"]


def test_periodic_warm_start_tiles_the_layers_around_the_edges():
    """The periodic warm start (moegraph.schedules.periodic) on a stack with edges: feasible,
    the layers tiled as without edges, the eager compute in a window between the forward and
    the backward, the edge collectives alone after it: makespan L x the unit's + the edges'."""
    from moegraph.layers import layer_graph
    from moegraph.schedules.baselines import greedy
    from moegraph.schedules.periodic import is_stack, tile_layers
    from moegraph.schedules.problem import build_problem
    from moegraph.schedules.solution import alone_twin, check_solution, makespan_ticks

    cost = CostModel(load_hardware("h800"))
    g = _graph(layers=2)
    assert is_stack(g)
    problem, unit = build_problem(g, cost), build_problem(layer_graph(g), cost)
    sol = greedy(unit)
    tiled = tile_layers(problem, unit, sol)
    check_solution(problem, tiled)
    edges = [t for t in problem.tasks if t.node.attr("edge", False)]
    extra = sum(t.modes[t.default_mode if t.kind == "compute" else alone_twin(t, t.default_mode)].ticks
                for t in edges)
    assert len(edges) == 9
    assert makespan_ticks(problem, tiled) == 2 * makespan_ticks(unit, sol) + extra
