"""The edges of a compiled causal LM (moegraph.edges): the embedding, final norm and LM head
gradients are synchronised by graph collectives that the scheduler places and the runtime
executes from the plan. Small graphs and 2 gloo ranks."""

from __future__ import annotations

import importlib.util

import pytest

import edges_workers as workers
from helpers import RANK_BATCH, fresh_seed
from moegraph.passes.stack import stack_layers
from moegraph.cost import CostModel
from moegraph.edges import edge_values
from moegraph.passes.edges import add_edges
from moegraph.ir import ConfigError, GraphError, Strategy
from moegraph.registry import load_hardware, load_model
from moegraph.schedules.api import compile_graph
from moegraph.tracer import trace_model

TOL = 1e-5
HAS_HF = importlib.util.find_spec("transformers") is not None
SYNC = ("edges.norm.grad_allreduce", "edges.lm_head.grad_allreduce")
# mixtral-8x7b's head gradient [32000, 4096] bf16, 262.1 MB: ceil(262.1 / 26.2) = 10 buckets of 3200 rows
BUCKETS = 10
HEAD_SYNC = tuple(f"edges.lm_head.bucket{i}.grad_allreduce" for i in range(BUCKETS))
MIXTRAL_SYNC = ("edges.norm.grad_allreduce", *HEAD_SYNC)



# The rank functions run in the suite's shared 2- and 4-rank spawns (helpers.RankBatch): starting
# ranks costs more than these checks.
EDGE_GRADS = RANK_BATCH.add(2, "edges.edge_grad_checks", workers.edge_grad_checks, fresh_seed())
BASE_MODEL = (RANK_BATCH.add(2, "edges.base_model_grad_checks", workers.base_model_grad_checks, fresh_seed())
              if HAS_HF else None)
BUCKETED = RANK_BATCH.add(2, "edges.bucketed_edge_grads", workers.bucketed_edge_grads, fresh_seed(), 1, 2800)
BUCKETED_DP = RANK_BATCH.add(4, "edges.bucketed_edge_grads_dp", workers.bucketed_edge_grads, fresh_seed(), 2, 2048)
DP_BF16 = RANK_BATCH.add(4, "edges.dp_bf16_edge_grads", workers.dp_bf16_edge_grads, fresh_seed(), 2)
PARTIAL = RANK_BATCH.add(4, "edges.partial_embed_grads", workers.partial_embed_grads, fresh_seed(), 2)
PADDING = (RANK_BATCH.add(4, "edges.partial_embed_padding", workers.partial_embed_padding, fresh_seed(), 2)
           if HAS_HF else None)


def _graph(dp: int = 1, vocab: int | None = 32000, layers: int = 2):
    cfg = load_model("mixtral-8x7b")
    g = stack_layers(trace_model(cfg, Strategy("sp", "ep", "ag-rs", 8, dtype="bf16", dp=dp), batch=1, seq=2048), layers)
    return add_edges(g, vocab=vocab)


@pytest.mark.parametrize("method", ["greedy", "cpsat"])
@pytest.mark.slow
def test_edge_sync_is_scheduled_under_the_layers_backward(method):
    """The head's gradient buckets and the norm's all-reduce start before the layers' backward
    compute ends (their partials exist at the barrier, nothing else reads them; greedy: the head's);
    the embedding gather starts
    after layer 0's input gradient is made."""
    g = _graph()
    s = compile_graph(g, CostModel(load_hardware("h800")), method=method, time_limit_s=2.0).schedule
    by = {n.name: n for n in s.nodes}
    assert set(MIXTRAL_SYNC) | {"edges.embed.grad_gather"} <= set(by)
    backward = [n for n in s.nodes if n.kind == "compute" and n.phase != "forward"]
    last_end = max(n.end_us for n in backward)
    forward_end = max(n.end_us for n in s.nodes if n.phase == "forward")
    for name in MIXTRAL_SYNC:
        # greedy's list order by bottom level puts the norm's 32 us all-reduce after the head's ten
        # buckets, after the backward: the buckets (and CP-SAT's norm) run under it
        end = last_end if name in HEAD_SYNC or method == "cpsat" else float("inf")
        assert forward_end <= by[name].start_us < end, (name, by[name].start_us, forward_end, last_end)
    dx = g.producer[g.outputs[1]].name                     # layer 0's input gradient
    assert by["edges.embed.grad_gather"].start_us >= by[dx].end_us
    # the eager head and norm backward make the seed: every layer's backward starts after it
    seed_made = by["edges.norm.dgrad"].end_us
    assert all(n.start_us >= seed_made for n in s.nodes if "layer" in n.attrs and n.phase == "backward")
    assert by["edges.lm_head"].start_us >= max(n.end_us for n in s.nodes if n.attrs.get("layer") == 1
                                              and n.phase == "forward")
    assert all(by[k].attrs.get("edge") is True and "layer" not in by[k].attrs for k in MIXTRAL_SYNC)


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


def test_a_layernorm_and_logit_scale_head_is_priced():
    """EdgeHead('layer', eps, c) (Cohere's bias-free final LayerNorm and logit_scale): the norm is
    the NORM op's kind 'layer', priced as the layers' (7*T*h FLOPs; its data gradient twice, its
    weight's once); the scale a SCALE on the logits [b, s/n, V] both ways (T*V FLOPs, reading and
    writing T*V bf16 elements), between the head and the loss, its backward feeding the head's;
    the cost model prices each; the default head has neither. M=2: each micro-batch its own."""
    from moegraph.edges import EdgeHead
    cfg = load_model("mixtral-8x7b")
    layer = trace_model(cfg, Strategy("sp", "ep", "ag-rs", 8, dtype="bf16"), batch=1, seq=2048)
    head = EdgeHead("layer", 1e-5, logit_scale=0.0625)
    g = add_edges(layer, vocab=32000, head=head)
    T, h, V = 2048 // 8, 4096, 32000
    node = {n.name: n for n in g.nodes}
    for name, flops in (("edges.norm", 7 * T * h), ("edges.norm.dgrad", 14 * T * h), ("edges.norm.wgrad", 7 * T * h)):
        assert node[name].op.name == "NORM" and node[name].attr("kind") == "layer" and node[name].flops == flops
        assert node[name].attr("eps") == 1e-5 and node[name].attr("eager") is True
    scale, back = node["edges.logit_scale"], node["edges.logit_scale.dgrad"]
    for nd in (scale, back):
        assert nd.op.name == "SCALE" and nd.attr("factor") == 0.0625 and nd.attr("eager") is True
        assert nd.flops == T * V and nd.mem_bytes == 2 * T * V * 2
        assert g.value[nd.outputs[0]].shape == (1, 2048 // 8, V)
    assert scale.inputs == node["edges.lm_head"].outputs
    assert node["edges.lm_head.dgrad"].inputs == back.outputs == node["edges.lm_head.wgrad"].inputs[1:]
    assert back.inputs == scale.outputs
    cost = CostModel(load_hardware("h800"))
    assert all(cost.node_time_us(node[k]) > 0 for k in ("edges.norm", "edges.logit_scale", "edges.logit_scale.dgrad"))
    assert edge_values(g).head == head
    plain = add_edges(layer, vocab=32000)
    assert {n.name: n for n in plain.nodes}["edges.norm"].op.name == "RMSNORM"
    assert not any("logit_scale" in n.name for n in plain.nodes)
    assert edge_values(plain).head == EdgeHead()
    from moegraph.passes.microbatch import merge_microbatches
    merged = {n.name: n for n in add_edges(merge_microbatches(layer, 2), vocab=32000, head=head).nodes}
    assert all(merged[f"mb{j}.edges.logit_scale.dgrad"].attr("mb") == j for j in range(2))
    with pytest.raises(ValueError, match="logit_scale 1 and no soft cap for a base model"):
        add_edges(layer, vocab=None, head=head)


def test_a_biased_layernorm_and_a_logit_soft_cap_are_priced():
    """EdgeHead('layer', eps, bias=True, softcap=c) (PhiMoE's final LayerNorm, Beam's soft cap): the
    norm's bias adds T*h FLOPs to the LayerNorm's 7*T*h and its partial gradient is [2h] (weight,
    then bias: one sync); the soft cap is a LIMIT on the logits (3*T*V FLOPs, reading and writing
    T*V bf16 elements), after the scale, its backward (reading its input too) first in the head's
    backward chain; with both, the chain is scale -> cap forward and cap -> scale backward."""
    from moegraph.edges import EdgeHead
    cfg = load_model("mixtral-8x7b")
    layer = trace_model(cfg, Strategy("sp", "ep", "ag-rs", 8, dtype="bf16"), batch=1, seq=2048)
    head = EdgeHead("layer", 1e-5, bias=True, logit_scale=0.5, softcap=30.0)
    g = add_edges(layer, vocab=32000, head=head)
    T, h, V = 2048 // 8, 4096, 32000
    node = {n.name: n for n in g.nodes}
    assert node["edges.norm"].flops == 8 * T * h and node["edges.norm.wgrad"].flops == 8 * T * h
    assert g.value[edge_values(g).norm_partial].shape == (2 * h,)
    cap, back = node["edges.logit_softcap"], node["edges.logit_softcap.dgrad"]
    assert cap.op.name == back.op.name == "LIMIT"
    assert (cap.attr("how"), cap.attr("limit")) == ("softcap", 30.0) and cap.flops == 3 * T * V
    assert cap.mem_bytes == 2 * T * V * 2 and back.mem_bytes == 3 * T * V * 2
    assert cap.inputs == node["edges.logit_scale"].outputs and back.inputs == (cap.inputs[0], cap.outputs[0])
    assert node["edges.logit_scale.dgrad"].inputs == back.outputs
    assert node["edges.lm_head.dgrad"].inputs == node["edges.logit_scale.dgrad"].outputs
    assert CostModel(load_hardware("h800")).node_time_us(cap) > 0
    assert edge_values(g).head == head
    with pytest.raises(ValueError, match="a bias"):
        EdgeHead("rms", 1e-5, bias=True)
    with pytest.raises(ValueError, match="softcap"):
        EdgeHead(softcap=0.0)


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
def n2(rank_results):
    return rank_results(2, EDGE_GRADS)[0]


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
        {*MIXTRAL_SYNC, "edges.embed.grad_gather"}
    assert main(["gantt", str(out), "-o", str(tmp_path / "t.json")]) == 0
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = [e["args"]["name"] for e in trace if e["name"] in ("process_name", "thread_name")]
    assert "edges" in names and any(n.endswith(" edges") for n in names)


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_base_model_gradients_match_eager_on_2_ranks(rank_results):
    """No head: the norm's all-reduce and the embedding gather still run from the plan, and
    every gradient (embedding, final norm, layers) equals eager's."""
    res = rank_results(2, BASE_MODEL)[0]
    assert {"edges.norm.grad_allreduce", "edges.embed.grad_gather"} <= set(res["edge_nodes"])
    assert not any("lm_head" in e for e in res["edge_nodes"])
    assert max(res["errors"].values()) < TOL, res["errors"]


def test_periodic_warm_start_tiles_the_layers_around_the_edges():
    """The periodic warm start (moegraph.schedules.periodic) on a stack with edges: feasible,
    the layers tiled as without edges, the eager compute in a window between the forward and
    the backward, the edge collectives in the gaps the tiled backward leaves on their stream, else
    alone after it: makespan at most L x the unit's + the edges' (greedy's unit, seq 2048: the
    norm's all-reduce fits a gap, the head's buckets do not)."""
    from moegraph.layers import layer_graph
    from moegraph.schedules.baselines import greedy
    from moegraph.schedules.periodic import is_stack, tile_layers
    from moegraph.schedules.problem import build_problem
    from moegraph.schedules.solution import alone_twin, check_solution, makespan_ticks, solution_ends

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
    assert len(edges) == 9 + BUCKETS - 1 + 2            # the head's ten buckets, split and concat
    assert makespan_ticks(problem, tiled) < 2 * makespan_ticks(unit, sol) + extra
    ends = solution_ends(problem, tiled)
    last_backward = max(ends[t.index] for t in problem.tasks
                        if not t.node.attr("edge", False) and t.side == 1 and t.kind == "compute")
    assert tiled.start[problem.by_name["edges.norm.grad_allreduce"].index] < last_backward


def test_carrying_periods_hide_the_heads_buckets_the_plain_tiling_leaves_at_the_end():
    """The head's gradient buckets (alike edge collectives) find no room in the plain tiling's
    backward and run after it; a carrying schedule (the unit's backward with one bucket, solved
    by CP-SAT) lets the first backward periods each take one, inside their windows: feasible, and
    shorter than the plain tiling (moegraph.schedules.periodic, "Carried buckets")."""
    from moegraph.layers import layer_graph
    from moegraph.schedules.api import _carrying
    from moegraph.schedules.baselines import greedy
    from moegraph.schedules.cpsat import SolverOptions
    from moegraph.schedules.periodic import alike_edge_collectives, tile_layers
    from moegraph.schedules.problem import build_problem
    from moegraph.schedules.solution import alone_twin, barrier_ticks, check_solution, makespan_ticks, solution_ends

    cost = CostModel(load_hardware("h800"))
    g = _graph(layers=4)
    problem, unit = build_problem(g, cost), build_problem(layer_graph(g), cost)
    buckets = alike_edge_collectives(problem)
    assert [problem.tasks[i].name for i in buckets] == [f"edges.lm_head.bucket{j}.grad_allreduce"
                                                       for j in range(BUCKETS)]
    sol = greedy(unit)
    plain = tile_layers(problem, unit, sol)
    carry = _carrying(problem, unit, sol, SolverOptions(time_limit_s=2.0))
    bucket = problem.tasks[buckets[0]]
    alone = bucket.modes[alone_twin(bucket, bucket.default_mode)].ticks      # run after the backward
    assert carry is not None
    assert makespan_ticks(carry.unit, carry.solution) < makespan_ticks(unit, sol) - barrier_ticks(unit, sol) + alone

    def layers_backward_end(sol_):
        ends = solution_ends(problem, sol_)
        return ends, max(ends[t.index] for t in problem.tasks
                         if not t.node.attr("edge", False) and t.side == 1 and t.kind == "compute")
    _, plain_end = layers_backward_end(plain)
    assert all(plain.start[i] >= plain_end for i in buckets)          # the plain tiling: all after
    carried = tile_layers(problem, unit, sol, carry=carry)
    check_solution(problem, carried)
    assert carried.method.endswith("+carry")
    ends, end = layers_backward_end(carried)
    assert sum(ends[i] <= end for i in buckets) == 4    # one per backward period (4 layers, 1-layer unit)
    assert makespan_ticks(problem, carried) < makespan_ticks(problem, plain)


# -- merged micro-batch steps (moegraph.microbatch): per micro-batch head and gather, one sync --------

def _merged(M: int, dp: int = 1, passes: str = ""):
    from moegraph.passes.microbatch import merge_microbatches
    from moegraph.passes import run_pipeline
    cfg = load_model("mixtral-8x7b")
    g = stack_layers(trace_model(cfg, Strategy("sp", "ep", "ag-rs", 8, dtype="bf16", dp=dp), batch=1, seq=2048), 2)
    if passes:
        g, _ = run_pipeline(g, passes, cost=CostModel(load_hardware("h800")))
    return add_edges(merge_microbatches(g, M), vocab=32000)


def test_merged_step_edges_closed_form():
    """M=3: per micro-batch its own eager norm/head forward and backward (2*T*h*V FLOPs per GEMM,
    T = b*s/n tokens of ONE micro-batch) and its own embedding gather ((n-1)/n * b*s*h bf16 bytes,
    reading its layer 0's input gradient); the head and norm partials accumulate micro-batch by
    micro-batch and are all-reduced ONCE per step, 2(n-1)/n * V*h*2 bytes (the same as a
    one-micro-batch step's all-reduce)."""
    from moegraph.microbatch import microbatch_boundaries
    M, n, T, h, V = 3, 8, 2048 // 8, 4096, 32000
    g = _merged(M)
    node = {nd.name: nd for nd in g.nodes}
    per_mb = ("edges.norm", "edges.lm_head", "edges.lm_head.dgrad", "edges.lm_head.wgrad", "edges.norm.dgrad",
              "edges.norm.wgrad", "edges.embed.grad_gather")
    edge_nodes = [nd for nd in g.nodes if nd.attr("edge", False)]
    assert len(edge_nodes) == M * len(per_mb) + len(MIXTRAL_SYNC) + 2      # + the buckets' split and concat
    ev = edge_values(g)
    for j, (_, seed, _, dx) in enumerate(microbatch_boundaries(g)):
        for name in per_mb:
            assert node[f"mb{j}.{name}"].attr("mb") == j
        for name in ("edges.lm_head", "edges.lm_head.dgrad", "edges.lm_head.wgrad"):
            assert node[f"mb{j}.{name}"].flops == 2 * T * h * V
        assert g.producer[seed].name == f"mb{j}.edges.norm.dgrad" and seed not in g.inputs
        gather = node[f"mb{j}.edges.embed.grad_gather"]
        assert gather.inputs == (dx,) and gather.comm_bytes == (n - 1) * 2048 * h * 2 // n
        assert ev.seeds[j] == seed and ev.embed_gathered[j] == gather.outputs[0]
        wgrad = node[f"mb{j}.edges.lm_head.wgrad"]
        if j == 0:
            assert not wgrad.attr("accumulate", False)
        else:                                  # adds into the previous micro-batches' sum
            assert wgrad.inputs[-1] == f"mb{j - 1}.edges.d_lm_head.partial" and wgrad.attr("accumulate")
            assert wgrad.mem_bytes == node["mb0.edges.lm_head.wgrad"].mem_bytes + V * h * 2
    sync = [nd for nd in edge_nodes if nd.is_comm and nd.attr("mb", None) is None]
    assert sorted(nd.name for nd in sync) == sorted(MIXTRAL_SYNC)
    assert node["edges.lm_head.grad_buckets"].inputs == (f"mb{M - 1}.edges.d_lm_head.partial",) == (ev.head_partial,)
    assert sum(node[k].comm_bytes for k in HEAD_SYNC) == 2 * (n - 1) * V * h * 2 // n
    one = {nd.name: nd for nd in _graph(layers=2).nodes}
    assert all(node[k].comm_bytes == one[k].comm_bytes for k in MIXTRAL_SYNC)
    with pytest.raises(GraphError, match="one value per micro-batch"):
        ev.seed


def test_merged_edges_in_the_paired_slots():
    """The paired baselines' slots (baselines.pair_slots): micro-batch j's eager head backward
    opens its backward (the slot of its last layer's backward), its embedding gather sits with its
    layer 0's backward, the step's sync opens the cool-down; megatron-1f1b and dualpipe are
    feasible."""
    from moegraph.schedules.baselines import dualpipe, megatron_1f1b, pair_slots
    from moegraph.schedules.problem import build_problem
    from moegraph.schedules.solution import check_solution
    M, L = 2, 2
    p = build_problem(_merged(M), CostModel(load_hardware("h800")))
    slot = dict(zip((t.name for t in p.tasks), pair_slots(p)))
    for j in range(M):
        layer_bwd = lambda layer: [s for name, s in slot.items()  # noqa: E731
                                   if name.startswith(f"mb{j}.l{layer}.")
                                   and p.graph.node[name].phase.value != "forward"]
        assert slot[f"mb{j}.edges.norm.dgrad"] == min(layer_bwd(L - 1)) == L + j * L
        assert slot[f"mb{j}.edges.embed.grad_gather"] == max(layer_bwd(0)) == L + j * L + L - 1
        assert slot[f"mb{j}.edges.lm_head"] == max(s for name, s in slot.items()
                                                   if name.startswith(f"mb{j}.l{L - 1}.")
                                                   and p.graph.node[name].phase.value == "forward")
    assert {slot[k] for k in HEAD_SYNC} == {L + (M - 1) * L}
    for fn in (megatron_1f1b, dualpipe):
        check_solution(p, fn(p))


def test_dp_bf16_compresses_the_edges_sync_too():
    """compress=dp-bf16 records its wire format in graph.meta; the edges (added after the passes)
    then send their DP reduce-scatters as bf16 all-to-alls: half the fp32 bytes, closed form
    (n-1)/n * V*h * 2 intra-node and (dp-1)/dp * V*h/n * 2 inter-node; in a merged step too."""
    from moegraph.passes.compress import DpGradWire, dp_grad_wire
    n, dp, V, h = 8, 2, 32000, 4096
    plain = {nd.name: nd for nd in _graph(dp=dp, layers=2).nodes}
    for g in (_graph_passes(dp, "compress=dp-bf16"), _merged(2, dp=dp, passes="compress=dp-bf16")):
        assert dp_grad_wire(g) is DpGradWire.BF16
        node = {nd.name: nd for nd in g.nodes}
        for name, fp32, bf16 in (("edges.lm_head.grad_rs_intra", (n - 1) * V * h * 4 // n, (n - 1) * V * h * 2 // n),
                                 ("edges.lm_head.grad_rs_inter", (dp - 1) * V * h // n * 4 // dp,
                                  (dp - 1) * V * h // n * 2 // dp)):
            assert plain[name].op.value == "reduce_scatter" and plain[name].comm_bytes == fp32
            assert node[name].op.value == "all_to_all" and node[name].attr("compressed") == "bf16"
            assert node[name].comm_bytes == bf16 == fp32 // 2
            assert node[f"{name}.sum"].attr("edge") is True
        assert not [nd.name for nd in g.nodes if nd.op.value == "reduce_scatter" and nd.attr("dp", False)]
    assert dp_grad_wire(_graph(dp=dp, layers=2)) is DpGradWire.FP32


def _graph_passes(dp: int, passes: str, embed_grad=None):
    from moegraph.passes import run_pipeline
    cfg = load_model("mixtral-8x7b")
    g = stack_layers(trace_model(cfg, Strategy("sp", "ep", "ag-rs", 8, dtype="bf16", dp=dp), batch=1, seq=2048), 2)
    g, _ = run_pipeline(g, passes, cost=CostModel(load_hardware("h800")))
    return add_edges(g, vocab=32000, embed_grad=embed_grad)


def test_merged_step_executor_runs_the_edges_by_step_edges():
    """The merged-step executor runs every eager edge node of a merged graph with edges at its plan
    position (tests/test_microbatch_model.py checks the numerics): it accepts the graph, refuses
    ``step`` (the seeds are the edges' to make) and a step whose kernels are missing, by name."""
    from moegraph.passes.microbatch import merge_microbatches
    import torch

    from moegraph.runtime import RuntimeFailure
    from moegraph.runtime.executor import Executor
    from moegraph.runtime.module import make_plan
    cfg = load_model("small")
    g = stack_layers(trace_model(cfg, Strategy("sp", "ep", "ag-rs", 2, dtype="fp32"), batch=1, seq=64), 2)
    merged = add_edges(merge_microbatches(g, 2), vocab=64)
    cost = CostModel(load_hardware("h800"))
    ex = Executor(merged, make_plan(merged, cost, "greedy"), None, rank=0, n=2, device=torch.device("cpu"))
    assert ex.plan_eager == {nd.name for nd in merged.nodes if nd.attr("eager", False)}
    with pytest.raises(RuntimeFailure, match="step_edges"):
        ex.step([], [], [])
    with pytest.raises(RuntimeFailure, match="mb0.edges.norm, "):
        ex.step_edges([torch.zeros(1, 32, cfg.hidden)] * 2, [], eager_kernels={})


def test_dp_bf16_edge_sync_runs_compressed_on_n2_dp2(rank_results):
    """n=2 x dp=2 on 4 gloo ranks with compress=dp-bf16: the plan runs the edges' head and norm
    sync as bf16 all-to-alls (intra- and inter-node), and their gradients equal eager's within the
    bf16 wire format's rounding (tests/test_dp.py BF16_TOL) but visibly not to fp32 precision (the
    compressed path ran). The embedding gradient: with the bf16 wire PARTIAL sends fewer inter-node
    bytes ((dp-1)/dp * V*h/n * (2+4) = 3072 < ROWS' (dp-1)*b*s*h*4 = 4096), so its sync is
    compressed too, to the same tolerance."""
    res = rank_results(4, DP_BF16)[0]
    from test_dp import BF16_TOL          # after the batch ran: importing test_dp registers its case too
    assert res["pattern"] == "partial"
    assert {"edges.lm_head.grad_rs_intra", "edges.lm_head.grad_rs_inter", "edges.norm.grad_rs_intra",
            "edges.norm.grad_rs_inter", "edges.embed.grad_rs_inter"} <= set(res["compressed"]), res["compressed"]
    err = res["errors"]
    for part in ("embed", "norm", "head", "layers"):
        assert err[part] < BF16_TOL, err
    assert err["head"] > 1e-6, err


def test_builder_extend_continues_a_graph():
    """GraphBuilder.extend: new names unique against the continued graph's values and nodes; only
    what was added is listed (add_edges splices it in)."""
    from moegraph.builder import GraphBuilder
    from moegraph.ir import OpKind
    g = _graph(layers=1)
    b = GraphBuilder.extend(g)
    v = b.value("edges.normed", (4,))
    b.node("edges.norm", OpKind.ADD, (v,), (v,))
    assert v == "edges.normed_2" and [n.name for n in b.nodes] == ["edges.norm_2"]
    assert [x.name for x in b.added_values()] == [v] and b.inputs == [] and b.shape("edges.normed") == \
        g.value["edges.normed"].shape


def test_dp_warm_starts_issue_the_edges_sync_first():
    """dp=2: the DP-aware warm starts (schedules.dp_order) put the head and norm DP collectives
    first on the DP stream (their partials exist before any layer's backward), not after layer 0's
    as a layer-less node's key did."""
    from moegraph.schedules.dp_order import dp_warm_starts
    from moegraph.schedules.problem import DP_STREAM, build_problem
    p = build_problem(_graph(dp=2, layers=2), CostModel(load_hardware("h800")))
    sols = dp_warm_starts(p)
    assert len(sols) == 2
    for sol in sols:
        dp = sorted((t for t in p.tasks if t.stream == DP_STREAM), key=lambda t: sol.start[t.index])
        order = [t.name for t in dp]
        head_norm = {x for x in order if x.startswith(("edges.lm_head.", "edges.norm."))}
        assert len(head_norm) == 4 and set(order[:4]) == head_norm, order[:6]


# -- the embedding gradient across replicas: ROWS (gather over replicas) or PARTIAL (scatter + sync) --

@pytest.mark.parametrize("point, rows, partial, chosen, mb2_chosen", [
    # mixtral-8x7b at dp=4, b=8, s=8192, bf16: 3*8*8192*4096*2 vs 3 * 32000*4096/32 * (4+4)
    (dict(n=8, dp=4, b=8, s=8192, h=4096, vocab=32000, elem=2), 1_610_612_736, 98_304_000, "partial", "partial"),
    # the same with compress=dp-bf16: the inter reduce-scatter sends bf16 (w=2), the all-gather fp32
    (dict(n=8, dp=4, b=8, s=8192, h=4096, vocab=32000, elem=2, wire=2), 1_610_612_736, 73_728_000, "partial",
     "partial"),
    # small b*s*dp vs a large vocabulary (Qwen's 152064): the rows are cheaper, even twice
    (dict(n=8, dp=2, b=1, s=2048, h=4096, vocab=152064, elem=2), 16_777_216, 311_427_072, "rows", "rows"),
    (dict(n=8, dp=2, b=1, s=2048, h=4096, vocab=32000, elem=2), 16_777_216, 65_536_000, "rows", "rows"),
    # b=4: one micro-batch's rows 33.6 MB < 65.5 MB, two micro-batches' 67.1 MB > 65.5 MB
    (dict(n=8, dp=2, b=4, s=2048, h=4096, vocab=32000, elem=2), 67_108_864, 65_536_000, "partial", "partial"),
    (dict(n=8, dp=2, b=2, s=2048, h=4096, vocab=32000, elem=2), 33_554_432, 65_536_000, "rows", "partial"),
    # a tie (tiny fp32 model, n=2 x dp=2, b=2, s=16, h=32, V=64): ROWS; at M=2 8192 > 4096
    (dict(n=2, dp=2, b=2, s=16, h=32, vocab=64, elem=4), 4096, 4096, "rows", "partial"),
    (dict(n=2, dp=2, b=1, s=16, h=32, vocab=64, elem=4), 2048, 4096, "rows", "rows"),   # M=2: a tie
    (dict(n=2, dp=2, b=4, s=16, h=32, vocab=64, elem=4), 8192, 4096, "partial", "partial"),
])
def test_embed_grad_closed_form_bytes_and_choice(point, rows, partial, chosen, mb2_chosen):
    from moegraph.edges import EmbedGrad
    from moegraph.passes.edges import embed_grad_choice, embed_grad_inter_bytes
    assert embed_grad_inter_bytes(EmbedGrad.ROWS, **point) == rows
    assert embed_grad_inter_bytes(EmbedGrad.PARTIAL, **point) == partial
    assert embed_grad_choice(**point) is EmbedGrad(chosen)
    one = point | {"dp": 1}
    assert embed_grad_choice(**one) is EmbedGrad.ROWS and embed_grad_inter_bytes(EmbedGrad.PARTIAL, **one) == 0
    assert embed_grad_choice(**point | {"vocab": None}) is EmbedGrad.ROWS
    # M=2 micro-batches: ROWS gathers per micro-batch (2x its bytes), PARTIAL syncs once per step
    assert embed_grad_inter_bytes(EmbedGrad.ROWS, **point, micro_batches=2) == 2 * rows
    assert embed_grad_inter_bytes(EmbedGrad.PARTIAL, **point, micro_batches=2) == partial
    assert embed_grad_choice(**point, micro_batches=2) is EmbedGrad(mb2_chosen)


@pytest.mark.parametrize("M, chosen", [(1, "rows"), (2, "partial"), (3, "partial")])
def test_embed_grad_choice_over_micro_batches(M, chosen):
    """n=2 x dp=2, b=2, s=16, h=32, V=64, fp32: one micro-batch ties (ROWS 4096 = PARTIAL 4096:
    ROWS), M micro-batches send M x 4096 bytes of rows against PARTIAL's 4096 once."""
    from moegraph.edges import EmbedGrad
    from moegraph.passes.edges import embed_grad_choice, embed_grad_inter_bytes
    point = dict(n=2, dp=2, b=2, s=16, h=32, vocab=64, elem=4, micro_batches=M)
    assert embed_grad_inter_bytes(EmbedGrad.ROWS, **point) == M * 4096
    assert embed_grad_inter_bytes(EmbedGrad.PARTIAL, **point) == 4096
    assert embed_grad_choice(**point) is EmbedGrad(chosen)
    with pytest.raises(ValueError, match="micro_batches=0"):
        embed_grad_inter_bytes(EmbedGrad.ROWS, **point | {"micro_batches": 0})


def _inter_embed_bytes(g) -> int:
    """The embedding gradient's inter-node bytes per rank as the graph's collectives send them."""
    return sum(nd.comm_bytes for nd in g.nodes if nd.is_comm and nd.attr("embed", False)
               and nd.attr("scope", None) == "inter")


def test_add_edges_builds_the_chosen_pattern_with_the_closed_form_bytes():
    """mixtral-8x7b at dp=4, b=8, s=8192: add_edges picks PARTIAL; its graph scatters this rank's
    layer-0 input gradient (eager, run by the plan, priced memory-bound) into a [V, h] partial
    synced by the hierarchical DP rule, marked dp; the inter bytes its collectives send are the
    closed form's. At b=1, s=2048, dp=2 it keeps ROWS (the gather over replicas, now dp-marked)."""
    from moegraph.edges import EmbedGrad
    n, dp, b, s, h, V = 8, 4, 8, 8192, 4096, 32000
    cfg = load_model("mixtral-8x7b")
    g = add_edges(stack_layers(trace_model(cfg, Strategy("sp", "ep", "ag-rs", n, dtype="bf16", dp=dp), batch=b, seq=s), 1),
                  vocab=V)
    ev = edge_values(g)
    assert ev.embed_grad is EmbedGrad.PARTIAL and ev.embed_gathered == ()
    node = {nd.name: nd for nd in g.nodes}
    scatter = node["edges.embed.scatter"]
    T = b * s // n
    assert scatter.attr("eager") is True and not scatter.is_comm
    assert scatter.inputs == (g.outputs[1],) and g.value[g.outputs[1]].shape == (b, s // n, h)   # layer 0's dx
    assert scatter.flops == T * h and scatter.mem_bytes == (T * h + V * h) * 2
    assert g.value[ev.embed_partial].shape == (V, h) and g.value[ev.embed_synced].shape == (V, h)
    assert ev.embed_synced in g.outputs and "edges.embed.grad_gather" not in node
    sync = [nd for nd in g.nodes if nd.is_comm and nd.attr("embed", False)]
    assert {nd.name for nd in sync} == {"edges.embed.grad_rs_intra", "edges.embed.grad_rs_inter",
                                       "edges.embed.grad_ag_inter", "edges.embed.grad_ag_intra"}
    assert all(nd.attr("dp", False) and nd.attr("edge", False) for nd in sync)
    assert _inter_embed_bytes(g) == 98_304_000
    with pytest.raises(GraphError, match="already has its edges"):
        add_edges(g, vocab=V)
    # forced ROWS at the same point: the 1.6 GB gather
    rows = add_edges(stack_layers(trace_model(cfg, Strategy("sp", "ep", "ag-rs", n, dtype="bf16", dp=dp), batch=b, seq=s), 1), vocab=V, embed_grad=EmbedGrad.ROWS)
    assert _inter_embed_bytes(rows) == 1_610_612_736
    small = _graph(dp=2, layers=1)
    assert edge_values(small).embed_grad is EmbedGrad.ROWS
    assert {nd.name: nd for nd in small.nodes}["edges.embed.grad_gather_dp"].attr("dp") is True


def test_partial_embed_grad_is_refused_where_it_does_not_apply_and_follows_dp_bf16():
    from moegraph.edges import EmbedGrad
    with pytest.raises(ConfigError, match="dp == 1"):
        _graph_forced(dp=1)
    with pytest.raises(ConfigError, match="base model"):
        _graph_forced(dp=2, vocab=None)
    # compress=dp-bf16: the embedding's inter reduce-scatter is a bf16 all-to-all as the head's
    c = _graph_passes(2, "compress=dp-bf16", embed_grad=EmbedGrad.PARTIAL)
    rs = {nd.name: nd for nd in c.nodes}["edges.embed.grad_rs_inter"]
    assert rs.op.value == "all_to_all" and rs.attr("compressed") == "bf16"
    assert rs.comm_bytes == 16_384_000          # (dp-1)/dp * V*h/n * 2 at n=8, dp=2: half the fp32 bytes


def test_merged_step_partial_embed_grad_scatters_per_micro_batch_and_syncs_once():
    """M=2, n=8 x dp=2, b=2, s=2048 (mixtral-8x7b, bf16): two micro-batches' rows would send
    2 * 2*2048*4096*2 = 67.1 MB inter-node per rank, PARTIAL's one sync 32000*4096/16 * 8 = 65.5 MB:
    add_edges picks PARTIAL. Micro-batch j's scatter reads its own layer-0 input gradient and
    (j >= 1) adds into micro-batch j-1's partial (attr accumulate, V*h*2 bytes read more); ONE
    hierarchical sync (no mb) reads the last partial; no gather. Greedy and megatron-1f1b plans
    verify, with each scatter after its layer 0's backward and the sync after the last scatter."""
    from moegraph.edges import EmbedGrad
    from moegraph.passes.microbatch import merge_microbatches
    from moegraph.microbatch import microbatch_boundaries
    from moegraph.schedules.baselines import megatron_1f1b
    from moegraph.schedules.problem import build_problem
    from moegraph.schedules.solution import check_solution
    from moegraph.schedules.verify import verify_schedule
    n, dp, b, s, h, V = 8, 2, 2, 2048, 4096, 32000
    cfg = load_model("mixtral-8x7b")
    g = stack_layers(trace_model(cfg, Strategy("sp", "ep", "ag-rs", n, dtype="bf16", dp=dp), batch=b, seq=s), 2)
    assert edge_values(add_edges(g, vocab=V)).embed_grad is EmbedGrad.ROWS      # one micro-batch: 33.6 MB rows
    m = add_edges(merge_microbatches(g, 2), vocab=V)
    ev = edge_values(m)
    assert ev.embed_grad is EmbedGrad.PARTIAL and ev.embed_gathered == ()
    node = {nd.name: nd for nd in m.nodes}
    T = b * s // n
    bounds = microbatch_boundaries(m)
    s0, s1 = node["mb0.edges.embed.scatter"], node["mb1.edges.embed.scatter"]
    assert s0.inputs == (bounds[0][3],) and s0.attr("mb") == 0 and not s0.attr("accumulate", False)
    assert s0.mem_bytes == (T * h + V * h) * 2 and s0.flops == T * h
    assert s1.inputs == (bounds[1][3], "mb0.edges.d_embed.partial") and s1.attr("mb") == 1
    assert s1.attr("accumulate") is True and s1.mem_bytes == (T * h + 2 * V * h) * 2
    assert s1.outputs == (ev.embed_partial,) and all(x.attr("eager") and x.attr("embed") for x in (s0, s1))
    sync = [nd for nd in m.nodes if nd.attr("embed", False) and nd.name not in (s0.name, s1.name)]
    assert {nd.name for nd in sync if nd.is_comm} == {"edges.embed.grad_rs_intra", "edges.embed.grad_rs_inter",
                                                     "edges.embed.grad_ag_inter", "edges.embed.grad_ag_intra"}
    assert all(nd.attr("mb", None) is None for nd in sync)
    assert [nd.name for nd in m.nodes if ev.embed_partial in nd.inputs] == ["edges.embed.grad_main"]
    assert not [nd for nd in m.nodes if "grad_gather" in nd.name and nd.attr("embed", False)]
    assert _inter_embed_bytes(m) == 65_536_000
    rows = add_edges(merge_microbatches(g, 2), vocab=V, embed_grad=EmbedGrad.ROWS)
    assert _inter_embed_bytes(rows) == 67_108_864
    cost = CostModel(load_hardware("h800"))
    sched = compile_graph(m, cost, method="greedy").schedule
    assert verify_schedule(sched, cost) == []
    at = {nd.name: nd for nd in sched.nodes}
    for j, sc in enumerate((s0, s1)):
        assert at[sc.name].start_us >= at[m.producer[bounds[j][3]].name].end_us
    assert min(at[nd.name].start_us for nd in sync) >= at[s1.name].end_us
    p = build_problem(m, cost)
    check_solution(p, megatron_1f1b(p))


def _graph_forced(dp: int, vocab: int | None = 32000):
    from moegraph.edges import EmbedGrad
    cfg = load_model("mixtral-8x7b")
    g = stack_layers(trace_model(cfg, Strategy("sp", "ep", "ag-rs", 8, dtype="bf16", dp=dp), batch=1, seq=2048), 1)
    return add_edges(g, vocab=vocab, embed_grad=EmbedGrad.PARTIAL)


def test_embed_gather_over_replicas_counts_as_dp_sync():
    """ROWS: the gather over the replicas follows layer 0's input gradient, the last compute of the
    step, so nothing can hide it: exposed_dp_sync_us holds at least its time (it did not before:
    it was no dp-marked node)."""
    from moegraph.schedules.schedule_file import dp_sync_exposure
    g = _graph(dp=2, layers=2)
    s = compile_graph(g, CostModel(load_hardware("h800")), method="greedy").schedule
    gather = next(nd for nd in s.nodes if nd.name == "edges.embed.grad_gather_dp")
    # compute that takes time (the head buckets' zero-copy concat is none, wherever it sits)
    assert gather.start_us >= max(nd.end_us for nd in s.nodes if nd.kind == "compute" and nd.end_us > nd.start_us)
    assert dp_sync_exposure(s.nodes)["exposed_dp_sync_us"] >= gather.end_us - gather.start_us - 0.01


def test_executor_refuses_a_plan_eager_node_without_its_kernel():
    """PARTIAL's edges.embed.scatter is eager but the plan reads its output: the executor runs it
    by a registered callable; without one, the backward is refused by name before it runs anything.
    The head/norm eager nodes (their outputs are given) cannot be registered."""
    import torch

    from moegraph.edges import EmbedGrad
    from moegraph.runtime import RuntimeFailure
    from moegraph.runtime.executor import Executor
    from moegraph.runtime.module import make_plan
    cfg = load_model("small")
    g = stack_layers(trace_model(cfg, Strategy("sp", "ep", "ag-rs", 2, dtype="fp32", dp=2), batch=1, seq=64), 2)
    g = add_edges(g, vocab=64, embed_grad=EmbedGrad.PARTIAL)
    plan = make_plan(g, CostModel(load_hardware("h800")), "greedy")
    ex = Executor(g, plan, None, rank=0, n=2, device=torch.device("cpu"))
    assert ex.plan_eager == {"edges.embed.scatter"}
    assert "edges.embed.scatter" in {e.name for e in ex.bwd} and "edges.norm.dgrad" not in {e.name for e in ex.bwd}
    ev = edge_values(g)
    partials = {p: torch.zeros(g.value[p].shape) for p in ev.partials}
    with pytest.raises(RuntimeFailure, match="edges.embed.scatter.*no callable is registered"):
        ex.backward_edges({}, torch.zeros(g.value[ev.seed].shape), [], partials)
    with pytest.raises(RuntimeFailure, match="not an eager node the plan"):
        ex.set_eager_kernel("edges.norm.dgrad", lambda ins: ins)
    with pytest.raises(RuntimeFailure, match="not an eager node the plan"):
        Executor(_graph_small_rows(), make_plan(_graph_small_rows(), CostModel(load_hardware("h800")), "greedy"),
                 None, rank=0, n=2, device=torch.device("cpu"),
                 eager_kernels={"edges.embed.scatter": lambda ins: ins})


def _graph_small_rows():
    from moegraph.edges import EmbedGrad
    cfg = load_model("small")
    return add_edges(stack_layers(trace_model(cfg, Strategy("sp", "ep", "ag-rs", 2, dtype="fp32", dp=2), batch=1, seq=64), 2), vocab=64, embed_grad=EmbedGrad.ROWS)


def test_partial_embedding_gradient_matches_eager_on_n2_dp2(rank_results):
    """n=2 x dp=2 on 4 gloo ranks, replicas of 4 rows: add_edges picks PARTIAL, the plan runs the
    scatter and the embedding's hierarchical sync, and every gradient equals eager's on the global
    batch (TOL, as the other edge tests); with the scatter's kernel made to return zeros the
    embedding gradient is wrong and nothing else is (the plan's result is the gradient)."""
    res = rank_results(4, PARTIAL)[0]
    assert res["pattern"] == "partial"
    assert {"edges.embed.scatter", "edges.embed.grad_rs_inter", "edges.embed.grad_ag_inter"} <= set(res["planned"])
    assert "edges.embed.grad_gather_dp" not in res["planned"]
    assert max(res["errors"].values()) < TOL, res["errors"]
    assert res["zeroed"]["embed"] > 0.5, res["zeroed"]
    assert max(v for k, v in res["zeroed"].items() if k != "embed") < TOL, res["zeroed"]


def test_periodic_tiling_places_the_partial_scatter_after_the_backward():
    """PARTIAL's scatter and its sync's cast follow layer 0's backward: the tiled warm starts (plain
    and DP-aware) put them after the layers' backward windows, feasibly."""
    from moegraph.edges import EmbedGrad
    from moegraph.layers import layer_graph
    from moegraph.schedules.baselines import greedy
    from moegraph.schedules.periodic import can_slide, tile_layers
    from moegraph.schedules.problem import build_problem
    from moegraph.schedules.solution import check_solution, solution_ends

    cost = CostModel(load_hardware("h800"))
    cfg = load_model("mixtral-8x7b")
    g = add_edges(stack_layers(trace_model(cfg, Strategy("sp", "ep", "ag-rs", 8, dtype="bf16", dp=2), batch=1, seq=2048), 2), vocab=32000, embed_grad=EmbedGrad.PARTIAL)
    problem, unit = build_problem(g, cost), build_problem(layer_graph(g), cost)
    sol = greedy(unit)
    assert can_slide(unit)
    dx = g.producer[g.outputs[1]].name
    for slide in (False, True):
        tiled = tile_layers(problem, unit, sol, dp_slide=slide)
        check_solution(problem, tiled)
        ends = solution_ends(problem, tiled)
        scatter = problem.by_name["edges.embed.scatter"]
        assert tiled.start[scatter.index] >= ends[problem.by_name[dx].index]


@pytest.mark.parametrize("batch, pattern", [(8, "partial"), (1, "rows")])
def test_compile_json_edges_row_names_the_embedding_pattern(capsys, batch, pattern):
    """compile --dp 2 (n=8, s=1024, V=32000, bf16): at b=8 ROWS would send 8*1024*4096*2 = 67.1 MB
    inter-node per rank, PARTIAL 32000*4096/16 * 8 = 65.5 MB: "partial"; at b=1 the rows (8.4 MB)."""
    import json

    from moegraph.cli import main
    args = ["compile", "--model", "mixtral-8x7b", "--layers", "2", "--seq", "1024", "--dp", "2", "--batch",
            str(batch), "--schedule", "greedy"]
    assert main([*args, "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["layers"][-1]["layer"] == "edges" and c["layers"][-1]["embed_grad"] == pattern
    assert main(args) == 0
    assert f"embedding gradient across replicas: {pattern}" in capsys.readouterr().out


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_partial_embedding_gradient_keeps_the_padding_row_zero_on_n2_dp2(rank_results):
    """PARTIAL on a transformers Mixtral with a padding row (pad_token_id=0 in every row): the
    scatter zeroes the padding row as nn.Embedding does; every gradient equals eager's."""
    res = rank_results(4, PADDING)[0]
    assert res["pattern"] == "partial"
    assert res["pad_row"] == 0.0 == res["eager_pad_row"]
    assert max(res["errors"].values()) < TOL, res["errors"]


# -- gradient buckets: the [V, h] syncs in row blocks the scheduler can place in the backward's gaps --

def test_head_gradient_sync_in_buckets_closed_form():
    """mixtral-8x7b's head partial [32000, 4096] bf16 (262.1 MB) at the 25 MiB default: 10 blocks of
    3200 rows, views of the partial (a zero-copy split), each all-reduced (2(n-1)/n * 3200*h*2 bytes,
    the ten summing to the whole all-reduce's), each writing its rows of the synced gradient, which
    keeps its name; the concat is zero-copy and priced 0. A bucket as large as the partial: the one
    all-reduce, no split."""
    from moegraph.passes.edges import GRAD_BUCKET_BYTES
    n, V, h = 8, 32000, 4096
    assert GRAD_BUCKET_BYTES == 25 * 2**20
    g = _graph(layers=1)
    ev, node = edge_values(g), {nd.name: nd for nd in g.nodes}
    split, concat = node["edges.lm_head.grad_buckets"], node["edges.lm_head.grad_concat"]
    assert split.op.value == concat.op.value == "split"
    assert split.inputs == (ev.head_partial,) and concat.outputs == (ev.head_synced,) == ("d_edges.lm_head.synced",)
    for nd, mode in ((split, "split"), (concat, "concat")):
        assert (nd.attr("mode"), nd.attr("dim"), nd.attr("sizes")) == (mode, 0, (V // BUCKETS,) * BUCKETS)
        assert nd.mem_bytes == 0 and CostModel(load_hardware("h800")).node_time_us(nd) == 0.0
    for i, (part, name) in enumerate(zip(split.outputs, HEAD_SYNC)):
        ar = node[name]
        assert ar.inputs == (part,) and g.value[part].alias_of == ev.head_partial
        assert g.value[part].shape == (V // BUCKETS, h) and ar.group == n
        assert ar.comm_bytes == 2 * (n - 1) * (V // BUCKETS) * h * 2 // n
        assert concat.inputs[i] == ar.outputs[0] and g.value[ar.outputs[0]].alias_of == ev.head_synced
    assert "edges.lm_head.grad_allreduce" not in node and "edges.norm.grad_allreduce" in node   # the norm: whole
    whole = add_edges(stack_layers(trace_model(load_model("mixtral-8x7b"), Strategy("sp", "ep", "ag-rs", 8, dtype="bf16"),
                                  batch=1, seq=2048), 1), vocab=V, grad_bucket_bytes=V * h * 2)
    names = {nd.name for nd in whole.nodes}
    assert "edges.lm_head.grad_allreduce" in names and not any("bucket" in x or "grad_concat" in x for x in names)
    assert whole.producer[edge_values(whole).head_synced].name == "edges.lm_head.grad_allreduce"
    with pytest.raises(ValueError, match="grad_bucket_bytes=0 must be a positive integer"):
        add_edges(stack_layers(trace_model(load_model("small"), Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=64), 1),
                  vocab=64, grad_bucket_bytes=0)


def test_bucket_rows_are_near_equal_and_follow_the_dp_sync():
    """n=2 x dp=2 (tiny, h=64 fp32), V=50 (12,800 bytes) in 5,000-byte buckets: 3 blocks of 17, 17, 16
    rows, the head's and PARTIAL's embedding sync alike, each through _dp_sync's chain (its intra
    reduce-scatter sending (n-1)/n * rows*h*4 bytes). 1-byte buckets: one row per block (50), not
    12,800 blocks."""
    from moegraph.edges import EmbedGrad
    n, h = 2, 64

    def graph(bucket):
        g = stack_layers(trace_model(load_model("tiny"), Strategy("sp", "ep", "ag-rs", n, dtype="fp32", dp=2), batch=1, seq=64), 1)
        return add_edges(g, vocab=50, embed_grad=EmbedGrad.PARTIAL, grad_bucket_bytes=bucket)

    node = {nd.name: nd for nd in graph(5000).nodes}
    for part in ("lm_head", "embed"):
        sizes = node[f"edges.{part}.grad_concat"].attr("sizes")
        assert sizes == (17, 17, 16)
        for i, rows in enumerate(sizes):
            assert node[f"edges.{part}.bucket{i}.grad_rs_intra"].comm_bytes == (n - 1) * rows * h * 4 // n
    assert node["edges.embed.grad_concat"].attr("embed") is True
    assert {nd.name: nd for nd in graph(1).nodes}["edges.lm_head.grad_concat"].attr("sizes") == (1,) * 50


@pytest.mark.slow
def test_buckets_run_under_the_layers_backward():
    """The point of the buckets (mixtral-8x7b, 2 layers, s=2048, CP-SAT from the warm starts): the
    head's first bucket is all-reduced before the layers' backward compute ends, and the
    periodic warm starts (the concat after its blocks' collectives, plain and DP-aware) are valid."""
    from moegraph.layers import layer_graph
    from moegraph.schedules.baselines import greedy
    from moegraph.schedules.periodic import tile_layers
    from moegraph.schedules.problem import build_problem
    from moegraph.schedules.solution import check_solution
    cost = CostModel(load_hardware("h800"))
    for dp in (1, 2):
        g = _graph(dp=dp, layers=2)
        problem, unit = build_problem(g, cost), build_problem(layer_graph(g), cost)
        for slide in ((False, True) if dp > 1 else (False,)):
            check_solution(problem, tile_layers(problem, unit, greedy(unit), dp_slide=slide))
    s = compile_graph(_graph(), cost, method="cpsat", time_limit_s=2.0).schedule
    by = {nd.name: nd for nd in s.nodes}
    last_end = max(nd.end_us for nd in s.nodes if nd.kind == "compute" and nd.phase != "forward")
    assert by[HEAD_SYNC[0]].end_us < last_end
    assert by["edges.lm_head.grad_concat"].start_us >= max(by[k].end_us for k in HEAD_SYNC)


def test_bucketed_edge_gradients_match_eager_on_2_ranks(rank_results):
    """The public compile path with 2,800-byte buckets (V=64, h=32 fp32: 8,192 bytes): the head's
    sync in 3 uneven blocks (22, 21, 21 rows), run from the plan; every gradient equals eager's. With
    bucket 1's all-reduce a local no-op only rows 22..42 of the head gradient go wrong: each block
    is its own rows."""
    res = rank_results(2, BUCKETED)[0]
    assert res["sizes"] == {"lm_head": (22, 21, 21)}
    assert {"edges.lm_head.grad_buckets", "edges.lm_head.grad_concat",
            *(f"edges.lm_head.bucket{i}.grad_allreduce" for i in range(3))} <= set(res["planned"])
    assert max(res["errors"].values()) < TOL, res["errors"]
    rows = res["row_errors"]
    assert max(rows[:22] + rows[43:]) < TOL and min(rows[22:43]) > 1e-2, rows


def test_bucketed_partial_embedding_and_head_match_eager_on_n2_dp2(rank_results):
    """n=2 x dp=2, 2,048-byte buckets: PARTIAL's embedding sync and the head's, each in 4 blocks of
    16 rows through _dp_sync's chain, run from the plan; every gradient equals eager's."""
    res = rank_results(4, BUCKETED_DP)[0]
    assert res["pattern"] == "partial" and res["sizes"] == {"lm_head": (16,) * 4, "embed": (16,) * 4}
    assert {f"edges.{p}.bucket{i}.grad_rs_inter" for p in ("lm_head", "embed") for i in range(4)} <= set(res["planned"])
    assert max(res["errors"].values()) < TOL, res["errors"]
