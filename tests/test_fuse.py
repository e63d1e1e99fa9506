"""Fused tile-level variants (issue 14 item 5): the cost model's tile pipeline, the fuse pass,
and the runtime refusing what it cannot run.

h800 numbers typed from hardware.yaml / Hardware defaults: P = 989e12, gemm_eff 0.75,
B_nvlink = 200e9, a2a_eff_intra 0.55, ring_eff_intra 0.726, copy_engine_eff 0.6, alpha 2 us,
kernel 4 us, copy engine +10 us, a2a saturation 24 SMs, 132 SMs, fused tile overhead 0.5 us
(helpers.flat_h800: the constant efficiencies before the shape and size curves, issue 29).
"""

from __future__ import annotations

import json
import re

import dataclasses

import pytest

from moegraph.passes.stack import stack_layers
from moegraph.cost import FUSED_ATTR, CostModel, FusedGroup, tile_pipeline_us, variant
from moegraph.ir import Strategy, verify
from moegraph.passes import PassError, run_pipeline
from moegraph.passes.fuse import candidates, mark
from moegraph.registry import load_hardware, load_model
from moegraph.tracer import trace_model

from helpers import flat_h800

A2A_BYTES = 14_680_064
GEMM_BODY_US = 150.0                          # compute time above the kernel latency
GEMM_FLOPS = int(GEMM_BODY_US * 1e-6 * 989e12 * 0.75)


@pytest.fixture(scope="module")
def h800() -> CostModel:
    return CostModel(flat_h800())


def a2a_gemm(kind="a2a+gemm", nbytes=A2A_BYTES, flops=GEMM_FLOPS) -> FusedGroup:
    return FusedGroup(kind=kind, comm=("all_to_all", nbytes, 8, "intra"),
                      compute=(("gemm", flops, 0, "forward"),))


def hand_fused_us(b: int) -> float:
    """The a2a+gemm tile pipeline at b SMs, by hand: n = 8 tiles, the local one needs no
    transfer; equal tiles give T = kappa + max(n g, (n-1) c + g)."""
    s = 1.0 if b == 0 else min(1.0, b / 24)
    eff = 0.55 * (0.6 / 0.726 if b == 0 else s)
    comm_body = 7 * 2 + (10 if b == 0 else 0) + A2A_BYTES / (200e9 * eff) * 1e6
    c = comm_body / 7
    g = (GEMM_FLOPS / (989e12 * 0.75) * 1e6) * 132 / (132 - b) / 8 + 0.5
    return 4 + max(8 * g, 7 * c + g)


def test_tile_pipeline_two_stage_flow():
    assert tile_pipeline_us([0, 3, 3], [2, 2, 2]) == 8        # transfer-bound: 3 + 3 + the last tile's 2
    assert tile_pipeline_us([0, 1, 1], [2, 2, 2]) == 6        # compute-bound: 3 tiles of 2 back to back
    with pytest.raises(ValueError, match="2 first-stage tiles vs 3 second-stage tiles"):
        tile_pipeline_us([1, 1], [1, 1, 1])


def test_fused_a2a_gemm_on_h800_is_the_hand_computed_tile_pipeline(h800):
    # b = 24 (a2a saturation): c = (14 + 133.4551)/7 = 21.065, g = 150 * 132/108 / 8 + 0.5 = 23.417
    # T = 4 + max(187.33, 147.455 + 23.417) = 191.333; the other budgets are slower (b = 0: 208.7)
    assert hand_fused_us(24) == pytest.approx(191.3333333, rel=1e-6)
    assert min(hand_fused_us(b) for b in (0, 8, 16, 24, 32)) == hand_fused_us(24)
    price = h800.fused_price(a2a_gemm())
    assert price.time_us == pytest.approx(191.3333333, rel=1e-6)
    assert price.sm == 24 and price.tiles == 8
    # both stages: 4 + 14 + 14680064/(200e9*0.55) and 4 + 150 alone
    assert price.unfused_us == pytest.approx(4 + 14 + A2A_BYTES / 110e9 * 1e6 + 154, rel=1e-6)


def test_compute_first_mirrors_comm_first_for_equal_tiles(h800):
    """GEMM+A2A runs compute tiles first and sends all but the local one; with equal tiles its
    flow time equals A2A+GEMM's (max(n g, g + (n-1) c) either way)."""
    assert h800.fused_price(a2a_gemm("gemm+a2a")).time_us == pytest.approx(h800.fused_price(a2a_gemm()).time_us)


@pytest.mark.parametrize("hw", ["h800", "h20", "a100"])
@pytest.mark.parametrize("nbytes, flops", [(10**4, 10**8), (A2A_BYTES, GEMM_FLOPS), (10**9, 10**10), (10**6, 10**13)])
def test_fused_never_below_either_stage(hw, nbytes, flops):
    cm = CostModel(load_hardware(hw))
    for kind in ("a2a+gemm", "gemm+a2a"):
        group = a2a_gemm(kind, nbytes, flops)
        price = cm.fused_price(group)
        assert price.time_us >= cm.best_time_us(group.comm_node()) - 1e-9
        assert price.time_us >= price.compute_us - 1e-9


@pytest.mark.parametrize("model", ["mixtral-8x7b", "internal-352b"])
@pytest.mark.parametrize("hw", ["h800", "h20"])
def test_model_groups_fused_at_most_unfused(model, hw):
    cm = CostModel(load_hardware(hw))
    g = trace_model(load_model(model), Strategy("sp", "ep", "ag-rs", 8), batch=1, seq=8192)
    cands = candidates(g, cm)
    assert {c.group.kind for c in cands} == {"gemm+a2a", "a2a+gemm", "ag+scatter+grouped_gemm", "grouped_gemm+gather+rs"}
    for c in cands:
        p = cm.fused_price(c.group)
        assert max(p.comm_us, p.compute_us) <= p.time_us <= p.unfused_us


def test_fuse_marks_the_papers_kernels_and_keeps_the_graph(h800):
    g = trace_model(load_model("mixtral-8x7b"), Strategy("sp", "ep", "ag-rs", 8), batch=1, seq=8192)
    out, report = run_pipeline(g, "fuse=all", cost=h800)
    verify(out)
    groups = {grp["anchor"]: (grp["kind"], grp["members"]) for grp in report["fuse"]["groups"]}
    assert groups == {
        "qkv_proj": ("gemm+a2a", ["qkv_proj", "qkv_split", "rope", "qkv_a2a"]),
        "out_proj": ("a2a+gemm", ["attn_a2a", "out_proj"]),
        "fc3": ("ag+scatter+grouped_gemm", ["ln2_ag", "dispatch_scatter", "fc1", "fc3"]),
        "fc2": ("grouped_gemm+gather+rs", ["fc2", "combine_gather", "ffn_rs"]),
        "fc3.dgrad": ("grouped_gemm+gather+rs",
                      ["fc3.dgrad", "fc1.dgrad", "d_ffn_in.accumulate1", "dispatch_scatter.dgrad", "ln2_ag.bwd"]),
        "out_proj.dgrad": ("gemm+a2a", ["out_proj.dgrad", "attn_a2a.bwd"]),
    }
    # the routing all-gather is no member: the kernel's tiles need the routing before they start
    # (it comes first, small); the backward's all-gather of the combine is not fused (fusing it
    # would let fc2.dgrad's readers start before fc2.wgrad, its anchor, ends)
    assert FUSED_ATTR not in dict(out.node["routing_ag"].attrs)
    assert FUSED_ATTR not in dict(out.node["ffn_rs.bwd"].attrs)
    # only attributes change: same nodes otherwise, same values, same saved set
    strip = [dataclasses.replace(n, attrs=tuple(kv for kv in n.attrs if kv[0] != FUSED_ATTR)) for n in out.nodes]
    assert tuple(strip) == g.nodes and out.values == g.values and out.saved == g.saved
    assert {n.name for n in out.nodes if variant(n) == "fused"} == {m for _, ms in groups.values() for m in ms}
    # the anchor carries the whole kernel, the other members nothing
    assert h800.node_time_us(out.node["out_proj"]) == pytest.approx(h800.fused_price(
        FusedGroup.of(out.node["out_proj"])).time_us)
    assert h800.node_time_us(out.node["attn_a2a"]) == 0.0 and h800.comm_sm_budgets(out.node["attn_a2a"]) == (0,)
    # a view in the chain (qkv_split) adds nothing, and the rope is applied to each tile in the
    # GEMM's epilogue (no HBM pass of its own): the chain's compute is the GEMM's; the unfused
    # baseline pays the collective at its default budget and the GEMM and the rope as kernels
    qkv = h800.fused_price(FusedGroup.of(out.node["qkv_proj"]))
    assert qkv.compute_us == pytest.approx(h800.node_time_us(g.node["qkv_proj"]))
    assert qkv.unfused_us == pytest.approx(h800.node_time_us(g.node["qkv_a2a"]) + h800.node_time_us(g.node["qkv_proj"])
                                           + h800.node_time_us(g.node["rope"]))
    assert run_pipeline(g, "fuse=none", cost=h800)[0] == g


@pytest.mark.parametrize("strategy", [Strategy("sp", "ep", "ag-rs", 2), Strategy("sp", "ep", "a2a", 2, chunks=2),
                                      Strategy("tp", "tp", "ag-rs", 2, chunks=2)])
def test_eligible_groups_never_share_a_node(h800, strategy):
    """Overlapping groups are not legitimate (a node runs in one kernel) and never occur: fuse=all
    marks every eligible group, each member once."""
    g = trace_model(load_model("tiny"), strategy, batch=1, seq=64)
    members = [m for c in candidates(g, h800) for m in c.members]
    assert members and len(members) == len(set(members))


def test_mark_refuses_a_node_in_two_chosen_groups(h800):
    """Were ``candidates`` ever to return overlapping groups, one group's attribute would silently
    overwrite the other's on the shared node: mark names it instead."""
    g = trace_model(load_model("tiny"), Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=64)
    first, second = candidates(g, h800)[:2]
    overlapping = dataclasses.replace(second, members=second.members + (first.members[0],))
    with pytest.raises(ValueError, match=re.escape(
            f"fuse: node {first.members[0]!r} is a member of two chosen groups, {first.group.kind} anchored at "
            f"{first.anchor!r} and {second.group.kind} anchored at {second.anchor!r}")):
        mark(g, [first, overlapping])
    assert FusedGroup.of(mark(g, [first, second]).node[first.members[0]]) == first.group


def test_fused_beats_chunk4_on_internal_352b(h800):
    """Chunking re-reads the expert weights per chunk; the fused kernel reads them once: the
    compute stream's busy time of the fused layer (fused kernels included) stays below chunk=4's."""
    model = load_model("internal-352b")
    fused, _ = run_pipeline(trace_model(model, Strategy("sp", "ep", "ag-rs", 8), batch=1, seq=8192), "fuse=all",
                            cost=h800)
    chunked = trace_model(model, Strategy("sp", "ep", "ag-rs", 8, chunks=4), batch=1, seq=8192)
    busy = {name: sum(h800.node_time_us(n) for n in g.nodes if not n.is_comm)
            for name, g in (("fused", fused), ("chunk4", chunked))}
    assert busy["fused"] < busy["chunk4"]
    fc2 = FusedGroup.of(fused.node["fc2"])
    chunk_fc2 = sum(h800.node_time_us(n) for n in chunked.nodes
                    if n.name.startswith("fc2") and n.phase.value == "forward" and n.op.value == "grouped_gemm")
    assert h800.fused_price(fc2).time_us < chunk_fc2 + sum(
        h800.node_time_us(n) for n in chunked.nodes if n.name.startswith("ffn_rs") and n.phase.value == "forward")


def test_bad_argument_and_bad_attr(h800):
    with pytest.raises(PassError, match="pass 'fuse': invalid argument 'some'"):
        run_pipeline(trace_model(load_model("tiny"), Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=64), "fuse=some",
                     cost=h800)
    g = trace_model(load_model("tiny"), Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=64)
    attr = {"kind": "gemm+ag", "anchor": True, "comm": ["all_gather", 8, 2, "intra"], "compute": [["gemm", 1, 1, "forward"]]}
    bad = g.nodes[1].with_attrs(**{FUSED_ATTR: attr})
    with pytest.raises(ValueError, match="node 'qkv_proj': bad 'fused' attribute: "
                                         "fused kind 'gemm\\+ag' is not one of a2a\\+gemm, "):
        h800.node_time_us(bad)
    with pytest.raises(ValueError, match="node 'qkv_proj': bad 'fused' attribute: anchor 'qkv_proj' is not true or false"):
        h800.node_time_us(g.nodes[1].with_attrs(**{FUSED_ATTR: attr | {"kind": "gemm+a2a", "anchor": "qkv_proj"}}))


def test_multi_layer_graph_keeps_one_anchor_per_group(h800):
    """Restacking layers renames nodes (l0.out_proj ...): each layer's groups still price their kernel once."""
    one, _ = run_pipeline(trace_model(load_model("mixtral-8x7b"), Strategy("sp", "ep", "ag-rs", 8)), "fuse=all", cost=h800)
    two, _ = run_pipeline(stack_layers(trace_model(load_model("mixtral-8x7b"), Strategy("sp", "ep", "ag-rs", 8)), 2),
                          "fuse=all", cost=h800)
    fused_us = sum(h800.node_time_us(n) for n in one.nodes if variant(n) == "fused")
    assert fused_us > 0
    assert sum(h800.node_time_us(n) for n in two.nodes if variant(n) == "fused") == pytest.approx(2 * fused_us)
    assert sum(FusedGroup.is_anchor(n) for n in two.nodes if variant(n) == "fused") == 12


@pytest.mark.slow
def test_runtime_runs_a_fused_graph_as_its_members_and_says_so(capsys):
    """No fused kernels on the ranks: each group runs as its member kernels (the decomposition the
    pass marked), matching eager, and the report names the fused groups and what ran."""
    from moegraph.cli import main
    rc = main(["run", "--n", "2", "--steps", "1", "--passes", "fuse=all", "--schedule", "greedy", "--check", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    # tiny sp+ep+ag-rs: qkv_proj, out_proj, the dispatch (fc1, fc3) and fc2 in forward;
    # out_proj.dgrad -> attn_a2a and the dispatch's (fc3.dgrad, fc1.dgrad -> ln2_ag.bwd) in backward
    assert report["fused_groups"] == 6
    assert report["executed_as"].startswith("fused groups run as their member kernels")
    assert report["max_rel_err_output"] < 1e-5 and report["max_rel_err_grads"] < 1e-5


def test_fused_group_count_counts_kernels():
    from moegraph.runtime.plan import fused_group_count
    cm = CostModel(load_hardware("cpu-gloo"))
    g, _ = run_pipeline(trace_model(load_model("tiny"), Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=64), "fuse=none",
                        cost=cm)
    assert fused_group_count(g) == 0
    fused, _ = run_pipeline(g, "fuse=all", cost=cm)
    assert fused_group_count(fused) == 6


def test_schedule_says_which_variant_was_predicted(h800):
    """The Gantt bar label and the Chrome trace name the variant; a fused collective holds no SMs."""
    from moegraph.schedules import gantt
    from moegraph.schedules.api import compile_graph
    g, _ = run_pipeline(trace_model(load_model("tiny"), Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=64), "fuse=all",
                        cost=h800)
    sched = compile_graph(g, h800, method="greedy").schedule
    node = {n.name: n for n in sched.nodes}
    assert gantt._bar_text(node["out_proj"], 200) == "out_proj (fused a2a+gemm)"
    assert gantt._bar_text(node["router"], 200) == "router"
    assert node["attn_a2a"].sm_budget == 0 and node["attn_a2a"].end_us == node["attn_a2a"].start_us
    events = {e["name"]: e["args"]["variant"] for e in gantt.chrome_trace(sched)["traceEvents"] if e.get("ph") == "X"}
    assert events["out_proj"] == events["attn_a2a"] == "fused" and events["router"] == "unfused"


def test_auto_keeps_only_groups_faster_than_their_members():
    """With a per-tile overhead that outweighs the overlap, auto fuses nothing; all still fuses."""
    slow = CostModel(dataclasses.replace(load_hardware("h800"), fused_tile_overhead_us=500.0))
    g = trace_model(load_model("mixtral-8x7b"), Strategy("sp", "ep", "ag-rs", 8), batch=1, seq=8192)
    auto = run_pipeline(g, "fuse=auto", cost=slow)[1]["fuse"]
    assert (auto["eligible"], auto["chosen"]) == (6, 0)
    assert all(grp["fused_us"] > grp["unfused_us"] for grp in auto["groups"])
    assert run_pipeline(g, "fuse=all", cost=slow)[1]["fuse"]["chosen"] == 6


@pytest.mark.parametrize("spec", ["fuse=all", "chunk=2,fuse=all,sar=paper"])
def test_fused_graph_computes_the_eager_layer(spec, rng):
    """The invariant: fuse changes attributes only, so the interpreted fused graph (members run one
    by one) matches the eager module, outputs and every gradient."""
    import torch
    from helpers import eager_step, max_grad_err, rel_err, small_layer
    from moegraph.interpreter import interpret
    from moegraph.tracer import trace_module
    layer = small_layer(2, seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
    x, dy = torch.randn(2, 16, 64, generator=rng), torch.randn(2, 16, 64, generator=rng)
    graph = trace_module(layer, Strategy("sp", "ep", "ag-rs", 2, dtype="fp32"), batch=2, seq=16)
    out, report = run_pipeline(graph, spec, cost=CostModel(load_hardware("h800")))
    assert report["fuse"]["chosen"] >= 3
    res = interpret(out, {k: p.detach() for k, p in layer.named_parameters()}, x, dy)
    y, dx, grads = eager_step(layer, x, dy)
    assert rel_err(res.output, y) < 1e-5 and rel_err(res.input_grad, dx) < 1e-5
    assert max_grad_err(res.param_grads, grads)[1] < 1e-5


def test_tune_ranks_a_fused_twin_of_each_candidate(h800):
    """tune --fuse: a candidate with fusable groups gets a second, fused row; a layer with none
    (n = 1: no collectives) gets none."""
    from moegraph.config import CompileConfig
    from moegraph.schedules.driver import lower
    from moegraph.schedules.tune import _row, candidate_config
    model = load_model("tiny")
    cand = Strategy("sp", "ep", "ag-rs", 2)
    base = CompileConfig(model=model, passes=(), batch=1, seq=64, hardware=h800.hw)
    graph = lower(candidate_config(base, cand)).graph
    twin = lower(candidate_config(base, cand, fused=True))
    fused = twin.graph
    assert twin.report["fuse"]["chosen"] and fused.strategy.passes[-1] == "fuse=auto"
    assert any(variant(n) == "fused" for n in fused.nodes) and not any(variant(n) == "fused" for n in graph.nodes)
    lone = lower(candidate_config(base, Strategy("sp", "ep", "ag-rs", 1), fused=True))
    assert not lone.report["fuse"]["chosen"]                     # tune skips the twin of such a candidate
    entry = {"feasible": True, "predicted_us": 100.0, "peak_memory_bytes": 1, "method": "greedy"}
    assert _row({"candidate": cand, "graph": fused, "stage1": entry}, 200.0)["fused"] is True
    assert _row({"candidate": cand, "graph": graph, "stage1": entry}, 200.0)["fused"] is False


def _kinds_by_anchor(g, cost) -> dict:
    return {c.anchor: c.group.kind for c in candidates(g, cost)}


@pytest.mark.parametrize("ffn", ["ep", "tp"])
def test_agrs_dispatch_fuses_once_the_routing_is_gathered(h800, ffn):
    """Under ag-rs each rank routes its own tokens and gathers the routing first (one small
    collective), so the token all-gather feeds only the scatter: the forward AG+scatter+GroupedGEMM
    is eligible (MegaScale-MoE's kernel needs the routing before the tokens arrive), per chunk too."""
    g = trace_model(load_model("mixtral-8x7b"), Strategy("sp", ffn, "ag-rs", 8), batch=1, seq=8192)
    assert _kinds_by_anchor(g, h800)["fc3"] == "ag+scatter+grouped_gemm"
    routing = g.node["routing_ag"]
    assert (routing.inputs, g.node["index_map"].inputs) == (("topk_weights", "topk_experts"), ("topk_experts_ag",))
    assert g.value["topk_experts_ag"].shape == (1, 8192, 2) and g.node["router"].inputs[0] == "ln2_out"
    chunked = trace_model(load_model("mixtral-8x7b"), Strategy("sp", ffn, "ag-rs", 8, chunks=2), batch=1, seq=8192)
    kinds = _kinds_by_anchor(chunked, h800)
    assert (kinds["fc3.c0"], kinds["fc3.c1"]) == ("ag+scatter+grouped_gemm",) * 2


def test_a_reader_of_the_gathered_tokens_outside_the_group_blocks_it(h800):
    """The soundness rule, on the lowering before local routing: a router reading the gathered
    tokens would start before the fused kernel ends in the schedule (all its time is on fc3), so
    the group is not eligible; the combine's pair, which does not read the tokens, still is."""
    g = trace_model(load_model("mixtral-8x7b"), Strategy("sp", "ep", "ag-rs", 8), batch=1, seq=8192)
    router = g.node["router"]
    late = dataclasses.replace(router, inputs=("ln2_out_ag",) + router.inputs[1:])
    order = [n for n in g.nodes if n.name != "ln2_ag"]          # the token gather moves up, before the router
    at = next(i for i, n in enumerate(order) if n.name == "router")
    order[at:at + 1] = [g.node["ln2_ag"], late]
    gathered = dataclasses.replace(g, nodes=tuple(order))
    kinds = _kinds_by_anchor(gathered, h800)
    assert "fc3" not in kinds and kinds["fc2"] == "grouped_gemm+gather+rs"
