"""Pass manager behaviour and the passes' decisions on paper-sized models (no numerics here).

Closed forms are computed from Table 2 / the paper's formulas, not read from the graph.
h800, n=8, b=1, s=8192, bf16 throughout, as the paper's figures.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
from contextlib import redirect_stdout
from fractions import Fraction as Fr

import pytest

from helpers import flat_h800
from moegraph.cli import main
from moegraph.cost import CostModel
from moegraph.ir import GraphError, OpKind, Phase, Strategy, verify
from moegraph.passes.stack import stack_layers
from moegraph.registry import load_hardware, load_model
from moegraph.tracer import trace_model
from moegraph.passes import (PASSES, KeepSearchTimeout, PassError, PassResult, dispatch, remat_pass, run_pipeline,
                             sar)

MODELS = ["internal-352b", "mixtral-8x7b", "mixtral-8x22b", "hunyuan-large", "phi-3.5-moe", "deepseek-moe"]
N, S, BYTES = 8, 8192, 2


@pytest.fixture(scope="module")
def h800() -> CostModel:
    return CostModel(load_hardware("h800"))


def trace(name: str, strategy: Strategy, **overrides):
    cfg = dataclasses.replace(load_model(name), **overrides)
    return trace_model(cfg, strategy, batch=1, seq=S)


def tiny(**kw):
    return trace_model(load_model("tiny"), Strategy(**({"attn": "sp", "ffn": "ep", "dispatch": "ag-rs", "n": 2} | kw)),
                       batch=1, seq=64)


# -- pass manager: parsing, errors, order ------------------------------------------------------

def test_unknown_pass_lists_valid_names(h800):
    with pytest.raises(PassError) as err:
        run_pipeline(tiny(), "sar=paper,sarr", cost=h800)
    assert str(err.value) == "unknown pass 'sarr'; valid: chunk, compress, dispatch, fuse, gate-reorder, sar"


@pytest.mark.parametrize("spec,message", [
    ("sar=papr", "pass 'sar': invalid argument 'papr' (not a policy); "
                 "valid: paper (the default), none, budget:<bytes>[:<seconds>s] (e.g. budget:2GiB, budget:2GiB:120s)"),
    ("sar=budget:lots", "pass 'sar': invalid argument 'budget:lots' ('lots' is not a positive size such as 1.5GiB, "
                        "800MiB, 64KiB or a plain number of bytes); valid: paper (the default), none, budget:<bytes>"
                        "[:<seconds>s] (e.g. budget:2GiB, budget:2GiB:120s)"),
    ("sar=budget:500MB", "pass 'sar': invalid argument 'budget:500MB' ('500MB' is not a positive size such as 1.5GiB, "
                         "800MiB, 64KiB or a plain number of bytes); valid: paper (the default), none, budget:<bytes>"
                         "[:<seconds>s] (e.g. budget:2GiB, budget:2GiB:120s)"),
    ("chunk=0", "pass 'chunk': invalid argument '0' (not a positive integer); "
                "valid: auto (the default), or a chunk count N >= 1 dividing s/n"),
    ("compress", "pass 'compress': invalid argument None (a mode is required); valid: dp-bf16, tp-fp8, ep-fp8"),
    ("dispatch=ring", "pass 'dispatch': invalid argument 'ring' (not a dispatch mode); valid: auto (the default), a2a, ag-rs"),
    ("gate-reorder=never", "pass 'gate-reorder': invalid argument 'never' (not a gate order); "
                           "valid: before-fc2 (the default), after-fc2"),
    ("sar,chunk=2,sar=none", "pass 'sar' is given twice in pipeline 'sar,chunk=2,sar=none'"),
    ("sar,,chunk", "empty pass name in pipeline 'sar,,chunk'; valid: chunk, compress, dispatch, fuse, gate-reorder, sar"),
])
def test_bad_arguments_name_the_valid_choices(h800, spec, message):
    with pytest.raises(PassError) as err:
        run_pipeline(tiny(), spec, cost=h800)
    assert str(err.value) == message


def test_failure_names_the_pass_and_its_predecessors(h800):
    g = tiny(ffn="tp")
    with pytest.raises(PassError) as err:
        run_pipeline(g, "dispatch=a2a,gate-reorder", cost=h800)
    assert str(err.value) == ("pass 'dispatch=a2a' failed (passes before it: gate-reorder): "
                              "dispatch='a2a' needs ffn='ep' (ffn='tp': only 'ag-rs')")
    assert isinstance(err.value.__cause__, ValueError)


def test_verifier_failure_is_reported_as_the_pass_that_broke_the_graph(h800):
    from moegraph.pass_steps import Chunk, Sar
    from moegraph.passes import BuiltPass, build_pass, run_passes

    def breaks(graph):
        bad = dataclasses.replace(graph.nodes[0], inputs=("nowhere",))
        return PassResult(dataclasses.replace(graph, nodes=(bad,) + graph.nodes[1:]), True)
    with pytest.raises(PassError) as err:
        run_passes(tiny(), [build_pass(Chunk(2), h800), build_pass(Sar(), h800), BuiltPass("breaks", breaks)])
    assert str(err.value) == ("pass 'breaks' failed (passes before it: chunk=2, sar): "
                              "node 'input_norm' (rmsnorm, forward) reads unknown value 'nowhere'")
    assert isinstance(err.value.__cause__, GraphError)


def test_pipeline_runs_in_stage_order_and_reports_it(h800):
    g = tiny(dp=2)
    out, report = run_pipeline(g, "sar=paper,gate-reorder,dispatch=auto,chunk=auto,compress=dp-bf16", cost=h800)
    assert report["pipeline"] == ["gate-reorder", "dispatch=auto", "chunk=auto", "compress=dp-bf16", "sar=paper"]
    assert list(out.strategy.passes) == report["pipeline"]
    assert set(report) == {"pipeline", "gate-reorder", "dispatch", "chunk", "compress", "sar"}
    json.dumps(report)                                        # the report is JSON-serialisable
    verify(out)


def test_stage_table_puts_relowering_before_rewrites():
    relower = [p.stage for p in PASSES.values() if p.relowers]
    rewrite = [p.stage for p in PASSES.values() if not p.relowers]
    assert max(relower) < min(rewrite)


def test_relowering_pass_refuses_a_rewritten_graph(h800):
    rewritten = sar("paper", h800)(tiny()).graph
    with pytest.raises(ValueError, match="would discard the rewrites of sar=paper"):
        dispatch("a2a", h800)(rewritten)


def test_empty_pipeline_is_identity(h800):
    g = tiny()
    out, report = run_pipeline(g, "", cost=h800)
    assert out is g and report == {"pipeline": []}


def test_unchanged_pass_says_so(h800):
    g = tiny(dispatch="ag-rs", chunks=1)
    assert run_pipeline(g, "sar=none", cost=h800)[0].nodes == g.nodes
    assert not sar("none", h800)(g).changed
    assert sar("paper", h800)(g).changed


def test_cli_maps_pass_errors_to_one_line_exit_2(capsys):
    rc = main(["trace", "--model", "tiny", "--n", "2", "--seq", "64", "--passes", "sarr"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err == "moegraph trace: error: unknown pass 'sarr'; valid: chunk, compress, dispatch, fuse, gate-reorder, sar\n"


# -- sar ---------------------------------------------------------------------------------------

def fig9_paper_bytes(name: str) -> int:
    cfg = load_model(name)
    k, f, m = cfg.top_k, Fr(cfg.ffn_hidden, cfg.hidden), Fr(cfg.heads, cfg.kv_heads)
    total = (2 * k * f + 4 + Fr(2) / m) * 1 * S * cfg.hidden / N * BYTES
    assert total.denominator == 1
    return int(total)


@pytest.mark.parametrize("gate", ["after-fc2", "before-fc2"])
@pytest.mark.parametrize("name", MODELS)
def test_sar_paper_keeps_exactly_fig9_bytes(h800, name, gate):
    g = trace(name, Strategy("sp", "ep", "ag-rs", N, gate=gate))
    out, report = run_pipeline(g, "sar=paper", cost=h800)
    assert out.activation_bytes() == fig9_paper_bytes(name)
    r = report["sar"]
    assert r["kept"] == ["hidden", "q_a2a", "k_a2a", "v_a2a", "attn", "ln2_in", "fc1_out", "fc3_out"]
    assert r["activation_bytes_before"] == g.activation_bytes() and r["activation_bytes_after"] == out.activation_bytes()
    assert {"ln1_out", "ln2_out", "ffn_in", "fc2_in"} <= set(r["recompute"])
    assert set(r["recommunicate"]) == {"attn_a2a", "ln2_out_ag"}
    # predicted times of the inserted nodes, as the cost model prices them
    re = out.nodes_in(Phase.RECOMPUTE)
    assert r["recompute_time_us"] == pytest.approx(sum(h800.node_time_us(n) for n in re if not n.is_comm), abs=1e-3)
    assert r["recommunicate_time_us"] == pytest.approx(sum(h800.node_time_us(n) for n in re if n.is_comm), abs=1e-3)
    assert r["recompute_time_us"] > 0 and r["recommunicate_time_us"] > 0


def test_sar_paper_under_tp_attention_keeps_the_qkv_analogue(h800):
    g = trace("mixtral-8x7b", Strategy("tp", "ep", "ag-rs", N))
    out, report = run_pipeline(g, "sar=paper", cost=h800)
    assert report["sar"]["kept"] == ["hidden", "qkv", "attn", "ln2_in", "fc1_out", "fc3_out"]
    assert out.activation_bytes() == fig9_paper_bytes("mixtral-8x7b")     # (1+2/m) bsh/n either way


def test_sar_rebuilds_the_paper_chains(h800):
    """Fig 8b: ffn_in by RMSNorm + all-gather + scatter, fc2_in by SwiGLU, attn_a2a by re-communication."""
    out = run_pipeline(trace("mixtral-8x7b", Strategy("sp", "ep", "ag-rs", N)), "gate-reorder,sar", cost=h800)[0]
    re = {n.name: n for n in out.nodes_in(Phase.RECOMPUTE)}
    assert re["post_attn_norm.re"].op is OpKind.RMSNORM and re["post_attn_norm.re"].inputs[0] == "ln2_in"
    assert re["ln2_ag.re"].inputs == ("ln2_out.re",) and re["ln2_ag.re"].op is OpKind.ALL_GATHER
    assert re["dispatch_scatter.re"].inputs[0] == "ln2_out_ag.re"
    # the gated SwiGLU (routing weights in its own kernel) rebuilds FC2's input in one node
    assert re["swiglu.re"].inputs == ("fc1_out", "fc3_out", "row_weights") and "gate.re" not in re
    assert re["attn_a2a.re"].inputs == ("attn",)
    assert all(n.forward_of == name[:-3] and n.role.value == "forward" for name, n in re.items())
    wgrad = out.node["fc1.wgrad"]
    assert wgrad.inputs[0] == "ffn_in.re"
    assert dict(out.meta_get("remat"))["fc2_out"] == "drop"     # gate-reorder: nothing reads FC2's output


def test_sar_decisions_are_data_in_graph_meta(h800):
    g = trace("mixtral-8x7b", Strategy("sp", "ep", "ag-rs", N))
    out = sar("paper", h800)(g).graph
    decisions = dict(out.meta_get("remat"))
    assert set(decisions) == set(g.saved)
    assert decisions["fc1_out"] == "keep" and decisions["attn_a2a"] == "recommunicate"
    assert decisions["ln1_out"] == "recompute" and decisions["hidden_next"] == "drop"
    assert out.strategy.remat == "paper"


@pytest.mark.parametrize("budget", ["3GiB", "143MiB", "58MiB"])
def test_sar_budget_fits_and_trades_time_for_bytes(h800, budget):
    g = trace("mixtral-8x7b", Strategy("sp", "ep", "ag-rs", N, gate="before-fc2"))
    out, report = run_pipeline(g, f"sar=budget:{budget}", cost=h800)
    r = report["sar"]
    assert out.activation_bytes() <= r["budget_bytes"] and out.activation_bytes() <= g.activation_bytes()
    assert (out.strategy.remat, out.strategy.remat_budget) == ("budget", r["budget_bytes"])       # typed record
    assert out.strategy.passes == (f"sar=budget:{budget}",)
    if budget == "3GiB":
        assert r["budget_bytes"] == 3 * 2**30 and r["recompute_time_us"] == r["recommunicate_time_us"] == 0
    else:
        assert r["budget_bytes"] == int(budget[:-3]) * 2**20 and r["recompute_time_us"] > 0


def test_sar_budget_beats_paper_time_at_paper_bytes(h800):
    """At Fig 9's footprint, the budget search finds a set no slower to rebuild than Fig 9's."""
    g = trace("mixtral-8x7b", Strategy("sp", "ep", "ag-rs", N, gate="before-fc2"))
    paper = run_pipeline(g, "sar=paper", cost=h800)[1]["sar"]
    budget = run_pipeline(g, f"sar=budget:{paper['activation_bytes_after']}", cost=h800)[1]["sar"]
    assert budget["activation_bytes_after"] <= paper["activation_bytes_after"]
    paper_us = paper["recompute_time_us"] + paper["recommunicate_time_us"]
    assert budget["recompute_time_us"] + budget["recommunicate_time_us"] <= paper_us + 1e-6


def test_sar_budget_below_the_minimum_names_it(h800):
    with pytest.raises(PassError, match=r"budget 1000 bytes is below the smallest activation footprint \d+ bytes"):
        run_pipeline(tiny(), "sar=budget:1000", cost=h800)


def test_sar_budget_reports_the_keep_search_status_and_limit(h800):
    r = run_pipeline(tiny(), "sar=budget:40000", cost=h800)[1]["sar"]
    assert (r["keep_search"], r["keep_search_limit_s"]) == ("optimal", 30.0)      # tiny: proven in far less


@pytest.mark.parametrize("layers", [1, 2])
def test_sar_budget_search_out_of_time_names_its_limit_not_the_budget(h800, layers):
    """A search stopped by its time limit before any keep-set is not a budget below the minimum
    (40000 bytes fits tiny's layer, as above): the error names the limit to raise, on a stack too."""
    g = stack_layers(tiny(), layers)
    with pytest.raises(KeepSearchTimeout, match=r"budget \d+ bytes found no keep-set within its time limit "
                                                r"keep_search_s=1e-09 s .*raise the sar pass option keep_search_s"):
        remat_pass("budget", 40000 * layers, h800, keep_search_s=1e-9)(g)
    with pytest.raises(KeepSearchTimeout):
        sar("budget:40000", h800, keep_search_s=1e-9)(tiny())


def test_sar_keep_search_limit_from_the_pipeline_string(h800):
    r = run_pipeline(tiny(), "sar=budget:40000:7.5s", cost=h800)[1]["sar"]
    assert (r["keep_search"], r["keep_search_limit_s"]) == ("optimal", 7.5)
    with pytest.raises(PassError, match=r"keep-set search limit '7' must be seconds, e.g. 120s"):
        run_pipeline(tiny(), "sar=budget:40000:7", cost=h800)
    with pytest.raises(PassError, match=r"keep_search_s=0.0 must be a positive number of seconds"):
        run_pipeline(tiny(), "sar=budget:40000:0s", cost=h800)


@pytest.mark.parametrize("limit", [0, -1.0, float("nan"), float("inf"), True, "30"])
def test_sar_keep_search_limit_must_be_positive_seconds(h800, limit):
    with pytest.raises(ValueError, match=rf"keep_search_s={re.escape(repr(limit))} must be a positive number"):
        remat_pass("budget", 40000, h800, keep_search_s=limit)


# -- dispatch ------------------------------------------------------------------------------------

@pytest.mark.parametrize("start", ["a2a", "ag-rs"])
@pytest.mark.parametrize("top_k,expected", [(1, "a2a"), (8, "ag-rs")])
def test_dispatch_auto_on_mixtral_h800(start, top_k, expected):
    # the pass's decision on the constant-efficiency h800 (helpers.flat_h800): with the sourced
    # curves (DeepEP's all-to-all at 0.765 of NVLink against rings at 0.794) the whole-layer serial
    # estimate keeps a2a up to top-k 8 on Mixtral; benchmarks/fidelity.py reports that against Fig 7
    h800 = CostModel(flat_h800())
    g = trace("mixtral-8x7b", Strategy("sp", "ep", start, N), top_k=top_k)
    out, report = run_pipeline(g, "dispatch=auto", cost=h800)
    r = report["dispatch"]
    assert r["chosen"] == expected == out.strategy.dispatch
    assert set(r["predicted_us"]) == {"a2a", "ag-rs"}
    assert r["predicted_us"][expected] < r["predicted_us"]["ag-rs" if expected == "a2a" else "a2a"]


def test_dispatch_auto_follows_the_cost_model_not_a_threshold():
    """Make all-to-all as efficient as a ring and make latency free: at top-k 8 = n the bytes tie and
    all-to-all (which skips the n-fold router work) wins, so the choice really comes from the cost model."""
    h800 = CostModel(flat_h800())  # sized on constant efficiencies (issue 29)
    hw = dataclasses.replace(flat_h800(), a2a_eff_intra=flat_h800().ring_eff_intra)
    g = trace("mixtral-8x7b", Strategy("sp", "ep", "ag-rs", N), top_k=8)
    assert run_pipeline(g, "dispatch=auto", cost=h800)[1]["dispatch"]["chosen"] == "ag-rs"
    assert run_pipeline(g, "dispatch=auto", cost=CostModel(hw))[1]["dispatch"]["chosen"] == "a2a"


def test_dispatch_with_tp_experts_is_ag_rs(h800):
    out, report = run_pipeline(tiny(ffn="tp"), "dispatch=auto", cost=h800)
    assert report["dispatch"]["chosen"] == "ag-rs" and list(report["dispatch"]["predicted_us"]) == ["ag-rs"]


# -- chunk -----------------------------------------------------------------------------------------

def test_chunk_auto_searches_until_latency_stops_paying(h800):
    g = trace("mixtral-8x7b", Strategy("sp", "ep", "ag-rs", N))
    out, report = run_pipeline(g, "chunk=auto", cost=h800)
    r = report["chunk"]
    pred = r["predicted_us"]
    assert r["chosen"] == out.strategy.chunks == min(pred, key=pred.get)
    assert r["chosen"] > 1                                   # overlap pays on h800 ...
    assert pred[max(pred)] > pred[r["chosen"]]               # ... until per-op latency takes over
    assert all(c in pred for c in (1, 2, 4))
    assert out.node["fc1.c0"].attr("chunk") == 0 and "fc1" not in out.node


def test_chunk_auto_with_free_latency_chunks_finer():
    hw = flat_h800()  # sized on constant efficiencies (issue 29)
    h800 = CostModel(hw)
    free = CostModel(dataclasses.replace(hw, kernel_latency_us=0.0, intra_node_latency_us=0.0))
    g = trace("mixtral-8x7b", Strategy("sp", "ep", "ag-rs", N))
    chosen = run_pipeline(g, "chunk=auto", cost=h800)[1]["chunk"]["chosen"]
    assert run_pipeline(g, "chunk=auto", cost=free)[1]["chunk"]["chosen"] > chosen


def test_chunk_auto_searches_a_bounded_range(h800, monkeypatch):
    """Unbounded, the search once ran to 1024 chunks of mixtral-8x7b and picked 256 (10,007 nodes,
    79 s). With the patience stop disabled it now tries the divisors of s/n up to 16 and no more."""
    import moegraph.passes.strategy as strategy_mod
    monkeypatch.setattr(strategy_mod, "PATIENCE", 10**6)
    g = trace("mixtral-8x7b", Strategy("sp", "ep", "ag-rs", N))
    assert g.dims.s // N >= 64 * strategy_mod.MAX_AUTO_CHUNKS       # many more divisors than the bound
    out, report = run_pipeline(g, "chunk=16", cost=h800)
    assert strategy_mod.MAX_AUTO_CHUNKS == 16 and len(out.nodes) <= strategy_mod.MAX_AUTO_NODES
    out, report = run_pipeline(g, "chunk=auto", cost=h800)
    assert list(report["chunk"]["predicted_us"]) == [1, 2, 4, 8, 16]
    assert out.strategy.chunks == report["chunk"]["chosen"] <= 16


def test_chunk_auto_never_builds_a_graph_above_the_node_bound(h800, monkeypatch):
    import moegraph.passes.strategy as strategy_mod
    monkeypatch.setattr(strategy_mod, "PATIENCE", 10**6)
    g = trace("mixtral-8x7b", Strategy("sp", "ep", "ag-rs", N))
    four = len(run_pipeline(g, "chunk=4", cost=h800)[0].nodes)
    monkeypatch.setattr(strategy_mod, "MAX_AUTO_NODES", four)
    out, report = run_pipeline(g, "chunk=auto", cost=h800)
    assert list(report["chunk"]["predicted_us"]) == [1, 2, 4] and len(out.nodes) <= four


def test_chunk_keeps_activation_bytes(h800):
    g = trace("mixtral-8x7b", Strategy("sp", "ep", "ag-rs", N))
    for c in (2, 4):
        assert run_pipeline(g, f"chunk={c}", cost=h800)[0].activation_bytes() == g.activation_bytes()


def test_chunk_that_does_not_divide_fails_naming_the_factors(h800):
    with pytest.raises(PassError, match=r"chunks=3 does not divide the local sequence s/n=32 \(s=64, n=2\)"):
        run_pipeline(tiny(), "chunk=3", cost=h800)


# -- gate-reorder and compress -----------------------------------------------------------------------

def test_gate_reorder_under_a2a_sends_the_weights(h800):
    out = run_pipeline(trace("mixtral-8x7b", Strategy("sp", "ep", "a2a", N)), "gate-reorder", cost=h800)[0]
    a2a = out.node["gate_weights_a2a"]
    k = load_model("mixtral-8x7b").top_k
    assert a2a.comm_bytes == S // N * k * 4 * (N - 1) // N          # R fp32 weights, (n-1)/n of them sent
    swiglu = out.node["swiglu"]      # the received weights scale SwiGLU's rows in its kernel: no GATE node
    assert out.node["combine_gather"].attr("weighted") is False and swiglu.inputs[2] == "row_weights"
    assert swiglu.attr("row_weights") is True and not any(n.op is OpKind.GATE for n in out.nodes)
    assert out.strategy.gate == "before-fc2"


def test_compress_dp_bf16_halves_gradient_reduce_scatter_bytes(h800):
    g = trace("mixtral-8x7b", Strategy("sp", "ep", "ag-rs", N, dp=4))
    out, report = run_pipeline(g, "compress=dp-bf16", cost=h800)
    r = report["compress"]
    assert r["comm_bytes_after"] * 2 == r["comm_bytes_before"] > 0
    assert any(n.attr("scope", None) == "inter" for n in out.nodes if n.op is OpKind.ALL_TO_ALL)
    assert not [n for n in out.nodes if n.op is OpKind.REDUCE_SCATTER and n.attr("dp", False)]


def test_dp_sync_is_hierarchical_for_replicated_params(h800):
    g = trace("mixtral-8x7b", Strategy("sp", "ep", "ag-rs", N, dp=4))
    names = [n.name for n in g.nodes if n.name.startswith("qkv.weight.grad")]
    assert names == ["qkv.weight.grad_main", "qkv.weight.grad_rs_intra", "qkv.weight.grad_rs_inter",
                     "qkv.weight.grad_ag_inter", "qkv.weight.grad_ag_intra"]
    assert g.node["qkv.weight.grad_rs_inter"].group == 4 and g.node["qkv.weight.grad_rs_intra"].group == N
    assert [n.name for n in g.nodes if n.name.startswith("w1.grad")] == \
        ["w1.grad_main", "w1.grad_rs_inter", "w1.grad_ag_inter"]      # expert shards: inter-node only
    # the replicated sum's group-n steps are on NVLink while the n ranks fit a node, on the NICs once they span
    # nodes (DeepSeek-V2 at EP16 over h800's 8-GPU nodes): they were labelled intra whatever n was
    wide = trace("deepseek-v2", Strategy("sp", "ep", "a2a", 16, dp=2))
    for graph, scope in ((g, "intra"), (wide, "inter")):
        steps = [n for n in graph.nodes if n.name.endswith((".grad_rs_intra", ".grad_ag_intra"))]
        assert steps and {h800.scope(n) for n in steps} == {scope}


def test_compress_ep_fp8_sends_fp8_rows_and_their_scales_to_the_experts(h800):
    g = trace("mixtral-8x7b", Strategy("sp", "ep", "a2a", N))
    out, report = run_pipeline(g, "compress=ep-fp8,sar=paper", cost=h800)
    h, k = load_model("mixtral-8x7b").hidden, load_model("mixtral-8x7b").top_k
    rows = S // N * k                                                    # R = b*s*k/n rows on this rank
    a2a = out.node["dispatch_a2a"]
    assert g.node["dispatch_a2a"].comm_bytes == rows * h * 2 * (N - 1) // N       # bf16 rows
    assert a2a.comm_bytes == rows * (h + 4) * (N - 1) // N                       # fp8 rows + an fp32 scale each
    assert a2a.inputs[:2] == ("ffn_in_send.fp8", "ffn_in_send.scale") and a2a.attr("payloads") == 2
    assert out.node["dispatch_a2a.quant"].outputs == a2a.inputs[:2]
    assert out.node["dispatch_a2a.dequant"].outputs == ("ffn_in",)
    assert out.node["dispatch_a2a.re"].attr("compressed") == "fp8"         # sar's re-sent dispatch too
    # in backward, the combine's gradient goes to the experts in FP8 too (DeepSeek-V3 §3.3)
    assert out.node["combine_a2a.bwd"].comm_bytes == rows * (h + 4) * (N - 1) // N
    assert report["compress"]["compressed"] == ["combine_a2a.bwd", "dispatch_a2a"]
    for name in ("combine_a2a", "dispatch_a2a.bwd"):                       # the combine and its way back: bf16
        assert out.node[name].comm_bytes == g.node[name].comm_bytes and out.node[name].attr("compressed", None) is None
    assert out.strategy.compress == "ep-fp8"
    none, report = run_pipeline(trace("mixtral-8x7b", Strategy("sp", "ep", "ag-rs", N)), "compress=ep-fp8", cost=h800)
    assert report["compress"]["compressed"] == [] and "no token dispatch" in report["compress"]["note"]


def test_a_token_exchange_whose_payloads_do_not_match_its_outputs_is_refused(h800):
    out, _ = run_pipeline(trace("mixtral-8x7b", Strategy("sp", "ep", "a2a", N)), "compress=ep-fp8", cost=h800)
    bad = out.node["dispatch_a2a"].with_attrs(payloads=1)
    with pytest.raises(GraphError, match=r"node 'dispatch_a2a' .*writes 3 values; expected its 1 payload\(s\) and "
                                         r"the recv map"):
        verify(dataclasses.replace(out, nodes=tuple(bad if n.name == bad.name else n for n in out.nodes)))


def test_compress_without_targets_changes_nothing(h800):
    g = tiny()
    from moegraph.pass_steps import Compress
    result_dp = PASSES["compress"].build(Compress("dp-bf16"), h800).run(g)
    assert not result_dp.changed and result_dp.report["compressed"] == []


# -- the trace shows what the passes chose -----------------------------------------------------------

def test_trace_strategy_fields_reflect_the_choices():
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["trace", "--model", "tiny", "--hardware", "h800", "--n", "2", "--seq", "64", "--dispatch", "a2a",
                   "--passes", "sar=paper,compress=tp-fp8,gate-reorder,dispatch=ag-rs,chunk=4", "--json"])
    assert rc == 0
    s = json.loads(buf.getvalue())
    assert s["strategy"] | {"passes": None} == {"attn": "sp", "ffn": "ep", "dispatch": "ag-rs", "n": 2, "dtype": "bf16",
                                                "dp": 1, "chunks": 4, "remat": "paper", "gate": "before-fc2",
                                                "remat_budget": None, "compress": "tp-fp8", "fuse": "none", "ep_nodes": 1,
                                                "attn_nodes": 1, "passes": None}
    assert s["strategy"]["passes"] == ["gate-reorder", "dispatch=ag-rs", "chunk=4", "compress=tp-fp8", "sar=paper"]
    assert s["passes"]["sar"]["activation_bytes_after"] == s["activation_bytes"]
    assert any(n["phase"] == "recompute" for n in s["nodes"])


def test_registered_passes():
    assert sorted(PASSES) == ["chunk", "compress", "dispatch", "fuse", "gate-reorder", "sar"]


# -- the typed path: a Strategy value rebuilds the graph its pipeline built ---------------------------

@pytest.mark.parametrize("name, layers", [("tiny", 1), ("small", 2)])
def test_lower_strategy_rebuilds_what_the_pipeline_built_from_the_typed_fields_alone(h800, name, layers):
    """Every rewrite a pipeline applies is a typed Strategy field (gate, chunks, compress, remat,
    fuse), so the driver's RECORDED path on the pipeline's resulting strategy gives the same
    graph, digest for digest (what run --schedule FILE checks), without parsing its recorded labels."""
    from moegraph.config import RECORDED, CompileConfig
    from moegraph.ir import graph_digest
    from moegraph.passes import passes_for
    from moegraph.schedules.driver import lower
    import moegraph.passes.manager as manager

    def lower_strategy(strategy):
        return lower(CompileConfig(model=model, strategy=strategy, passes=RECORDED, seq=64, layers=layers,
                                   edges="none", hardware=h800.hw)).graph
    model = load_model(name)
    base = stack_layers(trace_model(model, Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=64), layers)
    piped, _ = run_pipeline(base, "gate-reorder,chunk=2,compress=tp-fp8,sar=paper,fuse=all", cost=h800)
    st = piped.strategy
    assert (st.gate, st.chunks, st.compress, st.remat, st.fuse) == ("before-fc2", 2, "tp-fp8", "paper", "all")
    assert [p.label for p in passes_for(st, h800)] == ["compress=tp-fp8", "sar=paper", "fuse=all"]
    real = manager.parse_passes
    try:
        manager.parse_passes = lambda spec: pytest.fail(f"parsed {spec!r}")
        typed = lower_strategy(st)
        # without a record, the labels are the typed passes' own, in stage order
        fresh = lower_strategy(dataclasses.replace(st, passes=()))
    finally:
        manager.parse_passes = real
    assert graph_digest(typed) == graph_digest(piped)
    assert fresh.strategy.passes == ("gate-reorder", "chunk=2", "compress=tp-fp8", "sar=paper", "fuse=all")
    assert graph_digest(dataclasses.replace(fresh, strategy=st)) == graph_digest(piped)


def test_rewrite_as_refuses_a_graph_lowered_for_another_strategy(h800):
    from moegraph.passes import rewrite_as
    graph = trace("tiny", Strategy("sp", "ep", "ag-rs", 2))
    with pytest.raises(PassError, match=r"differs from the one asked for in attn \('sp', not 'tp'\)"):
        rewrite_as(graph, Strategy("tp", "ep", "ag-rs", 2, remat="paper"), h800)


def test_compress_and_fuse_record_their_typed_fields(h800):
    graph = trace("tiny", Strategy("sp", "ep", "ag-rs", 2))
    out, _ = run_pipeline(graph, "compress=dp-bf16", cost=h800)         # dp=1: nothing to compress, still recorded
    assert out.strategy.compress == "dp-bf16" and out.strategy.fuse == "none"
    out, _ = run_pipeline(graph, "fuse=none", cost=h800)                 # marks nothing: records nothing
    assert out.strategy.fuse == "none" and out.strategy.passes == ()
    with pytest.raises(Exception, match=r"compress='zip' is not one of 'none', 'dp-bf16', 'tp-fp8', 'ep-fp8'"):
        Strategy("sp", "ep", "ag-rs", 2, compress="zip")
