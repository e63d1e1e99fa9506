"""Scheduling merged micro-batch step graphs: the per-micro-batch barrier (problem and the
independent verifier), the megatron-1f1b / dualpipe baselines, CP-SAT against them, and the
compile CLI's --micro-batches."""

import dataclasses
import json

import pytest

from moegraph.passes.stack import stack_layers
from moegraph.cli import main
from moegraph.cost import CostModel
from moegraph.ir import Phase, Strategy
from moegraph.passes.microbatch import merge_microbatches
from moegraph.microbatch import micro_batch_of
from moegraph.registry import load_hardware, load_model
from moegraph.schedules.api import compile_graph
from moegraph.schedules.baselines import MICROBATCH_BASELINES, _pair_parts, pair_slots
from moegraph.schedules.problem import ScheduleError, build_problem
from moegraph.schedules.solution import check_solution, makespan_ticks
from moegraph.schedules.verify import verify_schedule
from moegraph.tracer import trace_model

TINY = load_model("tiny")
SMALL = load_model("small")     # 4 layers
COST = CostModel(load_hardware("h800"))


def _merged(M=2, layers=1):
    model = TINY if layers == 1 else SMALL
    return merge_microbatches(stack_layers(trace_model(model, Strategy("sp", "ep", "ag-rs", 2), seq=64), layers), M)


def _ancestors(problem, i):
    seen, todo = set(), [i]
    while todo:
        for p in problem.tasks[todo.pop()].preds:
            if p not in seen:
                seen.add(p)
                todo.append(p)
    return seen


def test_barrier_is_per_micro_batch():
    p = build_problem(_merged(3), COST)
    assert {t.side for t in p.tasks} == {0}
    fwd = {j: {t.index for t in p.tasks if micro_batch_of(t.node) == j and t.node.phase is Phase.FORWARD}
           for j in range(3)}
    for t in p.tasks:
        j = micro_batch_of(t.node)
        if t.node.phase is Phase.FORWARD:
            continue
        anc = _ancestors(p, t.index)
        if j is None:                        # step-level sync: after every forward
            assert all(fwd[k] <= anc for k in fwd)
            continue
        assert fwd[j] <= anc, t.name         # every forward node of its own micro-batch
        # and no later micro-batch's forward: micro-batch j+1's forward may run under j's backward
        assert not any(fwd[k] & anc for k in fwd if k > j), t.name


def test_verify_checks_the_barrier_per_micro_batch():
    r = compile_graph(_merged(2), COST, method="greedy")
    sched = r.schedule
    assert verify_schedule(sched) == []
    # the merged schedule overlaps micro-batch 1's forward with micro-batch 0's backward, which
    # one global barrier would forbid
    f1_end = max(n.end_us for n in sched.nodes if n.attrs.get("mb") == 1 and n.phase == "forward")
    b0_start = min(n.start_us for n in sched.nodes if n.attrs.get("mb") == 0 and n.phase != "forward")
    assert b0_start < f1_end
    # relabel one of micro-batch 0's early backward nodes as micro-batch 1's: now it starts
    # before its (new) micro-batch's forward ends, and the verifier says so
    early = next(n for n in sorted(sched.nodes, key=lambda n: n.start_us)
                 if n.attrs.get("mb") == 0 and n.phase != "forward" and n.start_us < f1_end)
    nodes = tuple(dataclasses.replace(n, attrs={**n.attrs, "mb": 1}) if n is early else n for n in sched.nodes)
    bad = dataclasses.replace(sched, nodes=nodes).with_hash()
    assert any(v.check == "barrier" and early.name in v.message for v in verify_schedule(bad))


def _steady_pair():
    from moegraph.schedules.pipeline_price import steady_pair
    return steady_pair(trace_model(TINY, Strategy("sp", "ep", "ag-rs", 2), seq=64))


@pytest.mark.parametrize("make", [lambda: _merged(2), _steady_pair], ids=["merged", "steady-pair"])
def test_pair_stages_follow_megatron_order(make):
    """The three phases of Megatron-Core's pair, checked on named nodes of the tiny layer
    (sp+ep, ag-rs: the router runs on the rank's tokens before the dispatch, as Megatron's, then
    routing_ag and ln2_ag dispatch, ffn_rs combines). Also on the pipeline's steady-state pair
    (micro-batch 0's backward without its forward), where the backward's collectives are told
    apart by the backward alone: until 2026-11-28 they were all put in the last phase there."""
    p = build_problem(make(), COST)
    _, stage, part = _pair_parts(p)
    st = {t.name: stage[t.index] for t in p.tasks}
    expect = {  # forward of micro-batch 1
        "mb1.qkv_proj": 0, "mb1.attention": 0, "mb1.post_attn_norm": 0, "mb1.router": 0, "mb1.ln2_ag": 1, "mb1.fc1": 1, "mb1.fc2": 1,
        "mb1.ffn_rs": 2, "mb1.ffn_residual": 2,
        # backward of micro-batch 0
        "mb0.ffn_rs.bwd": 0, "mb0.fc2.dgrad": 1, "mb0.fc1.wgrad": 1, "mb0.ln2_ag.bwd": 1,
        "mb0.post_attn_norm.dgrad": 2, "mb0.attention.dgrad": 2, "mb0.qkv_proj.wgrad": 2}
    assert {k: st[k] for k in expect} == expect
    assert part[p.by_name["mb0.fc1.wgrad"].index] == "Bw" and part[p.by_name["mb0.fc1.dgrad"].index] == "Bd"
    slots = pair_slots(p)
    slot = {t.name: slots[t.index] for t in p.tasks}
    assert slot["mb1.qkv_proj"] == slot["mb0.fc1.dgrad"]
    if "mb0.qkv_proj" in slot:              # the merged step: warm-up and cool-down slots too
        assert slot["mb0.qkv_proj"] < slot["mb1.qkv_proj"] < slot["mb1.fc1.dgrad"]


def test_steady_pair_stages_with_the_node_dispatch():
    """DeepSeek-V3's layer as Megatron-Core runs it (DeepEP-like node dispatch in FP8, TP attention
    folded in the node, SAR): on the pipeline's steady-state pair both hops of the combine's
    gradient open the pair, both hops of the dispatch's gradient (and the routing weights') and
    SAR's re-sent dispatch sit in the MLP phase, the attention's backward in the last."""
    from moegraph.passes import run_pipeline
    from moegraph.schedules.pipeline_price import steady_pair
    g = trace_model(load_model("deepseek-v3"), Strategy("tp", "ep", "a2a", 16, ep_nodes=2, attn_nodes=8), batch=8, seq=256)
    g, _ = run_pipeline(g, "gate-reorder,compress=ep-fp8,sar=paper", cost=COST)
    p = build_problem(steady_pair(g), COST)
    _, stage, _ = _pair_parts(p)
    st = {t.name: stage[t.index] for t in p.tasks}
    expect = {"mb0.node_combine_a2a.bwd": 0, "mb0.combine_a2a.bwd": 0,
              "mb0.node_a2a.re": 1, "mb0.dispatch_a2a.re": 1, "mb0.fc1.dgrad": 1, "mb0.dispatch_a2a.bwd": 1,
              "mb0.node_a2a.bwd": 1, "mb0.gate_weights_a2a.bwd": 1, "mb0.node_weights_a2a.bwd": 1,
              "mb0.attn_rs.bwd": 2, "mb0.attention.dgrad": 2,
              "mb1.attn_rs": 0, "mb1.node_a2a": 1, "mb1.fc1": 1, "mb1.node_combine_a2a": 2}
    assert {k: st[k] for k in expect} == expect


@pytest.mark.parametrize("name", sorted(MICROBATCH_BASELINES))
def test_paired_baselines_run_one_pair_at_a_time(name):
    p = build_problem(_merged(3, layers=2), COST)
    sol = MICROBATCH_BASELINES[name](p)
    check_solution(p, sol)
    slots = pair_slots(p)
    for t in p.tasks:                       # nothing starts before every earlier slot has started
        earlier = [u for u in p.tasks if slots[u.index] < slots[t.index]]
        assert all(sol.start[u.index] <= sol.start[t.index] for u in earlier), t.name
    with pytest.raises(ScheduleError, match="needs a merged step graph"):
        MICROBATCH_BASELINES[name](build_problem(trace_model(TINY, Strategy("sp", "ep", "ag-rs", 2), seq=64), COST))


def test_dualpipe_defers_attention_weight_gradients():
    """The one difference between the two orders: in a pair, megatron-1f1b runs the attention
    backward's weight gradients before the forward's post-combine work; dualpipe after it."""
    p = build_problem(_merged(2), COST)
    _, stage, part = _pair_parts(p)
    from moegraph.schedules.baselines import _DUALPIPE, _MEGATRON
    w, f = p.by_name["mb0.qkv_proj.wgrad"], p.by_name["mb1.ffn_residual"]
    assert stage[w.index] == stage[f.index] == 2
    assert _MEGATRON[("compute", 2)]["Bw"] < _MEGATRON[("compute", 2)]["F"]
    assert _DUALPIPE[("compute", 2)]["Bw"] > _DUALPIPE[("compute", 2)]["F"]


@pytest.mark.slow
def test_cpsat_never_worse_than_the_paired_baselines():
    r = compile_graph(_merged(2, layers=2), COST, time_limit_s=2)
    s = r.schedule.summary
    assert {"megatron-1f1b", "dualpipe", "greedy", "sequential"} <= set(s["baselines"])
    assert all(s["makespan_us"] <= v for v in s["baselines"].values())
    assert verify_schedule(r.schedule) == []


@pytest.mark.slow
def test_compile_cli_micro_batches(tmp_path, capsys):
    out = tmp_path / "mb.json"
    assert main(["compile", "--model", "tiny", "--n", "2", "--seq", "64", "--micro-batches", "2", "--time-limit", "1",
                 "--json", "-o", str(out)]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["micro_batches"] == 2 and {"megatron-1f1b", "dualpipe"} <= set(c["baselines"])
    assert main(["verify", str(out)]) == 0
    capsys.readouterr()
    assert main(["compile", "--model", "tiny", "--n", "2", "--seq", "64", "--micro-batches", "2",
                 "--schedule", "megatron-1f1b", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["source"] == "megatron-1f1b" and c["makespan_us"] == c["baselines"]["megatron-1f1b"]


@pytest.mark.slow
def test_gantt_shades_micro_batches_apart(tmp_path):
    from moegraph.schedules.gantt import chrome_trace, mb_colour, render
    # hand-computed: compute blue #4C72B0 mixed 45% with white for micro-batch 1
    assert mb_colour("#4C72B0", 0) == "#4c72b0" and mb_colour("#4C72B0", 1) == "#9db1d4"
    assert mb_colour("#4C72B0", None) == "#4C72B0"
    assert mb_colour("#DD8452", "step") == "#905635"          # 65% of each channel
    merged = compile_graph(_merged(2), COST, method="greedy").schedule
    single = compile_graph(trace_model(TINY, Strategy("sp", "ep", "ag-rs", 2), seq=64), COST, method="greedy").schedule
    svg = render(merged, tmp_path / "mb.svg").read_text()
    assert "#4c72b0" in svg and "#9db1d4" in svg and "mb1" in svg
    assert "#905635" in svg                                   # the step's gradient all-reduces
    assert "#9db1d4" not in render(single, tmp_path / "one.svg").read_text()
    trace = chrome_trace(merged)
    assert {e["args"].get("mb") for e in trace["traceEvents"] if e.get("ph") == "X"} >= {0, 1}
    # every legend entry its own colour: "compute" and "mb0" were one blue under two names, and
    # "layer backward" a brown next to the step's
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt

    from moegraph.schedules.gantt import _figure
    for sched in (merged, compile_graph(_merged(2, layers=2), COST, method="greedy").schedule):
        fig = _figure(sched, None)
        entries = [(t.get_text(), mcolors.to_hex(p.get_facecolor()))
                   for leg in (a.get_legend() for a in fig.axes) if leg is not None
                   for t, p in zip(leg.get_texts(), leg.get_patches()) if p.get_fill()]
        colours = [c for _, c in entries]
        assert len(set(colours)) == len(colours), entries
        assert ("compute, mb0", "#4c72b0") in entries
        plt.close(fig)


@pytest.mark.slow
def test_memory_budget_counts_in_flight_micro_batches():
    """Running micro-batches' forwards ahead holds their activations at once: the memory model
    counts them, and a budget between one micro-batch's peak and the unconstrained merged
    peak is met (verified independently)."""
    g = _merged(3, layers=2)
    free = compile_graph(g, COST, method="greedy").schedule.summary["peak_memory_bytes"]
    seq = compile_graph(g, COST, method="sequential").schedule.summary["peak_memory_bytes"]
    assert free > seq                      # in-flight micro-batches cost memory
    budget = (free + seq) // 2
    r = compile_graph(g, COST, memory_budget_bytes=budget, time_limit_s=2)
    assert r.schedule.summary["peak_memory_bytes"] <= budget
    assert verify_schedule(r.schedule) == []


def test_interleaved_warm_starts_are_feasible_and_beat_strict_pairing():
    from moegraph.schedules.baselines import warm_starts
    p = build_problem(_merged(3, layers=2), COST)
    starts = [s for s in warm_starts(p) if s.method.startswith("interleave")]
    assert {s.method for s in starts} >= {"interleave1+ce", "interleave2+ce", "interleave4+ce", "interleave1"}
    for s in starts:
        check_solution(p, s)
    best = min(makespan_ticks(p, s) for s in starts)
    assert best <= min(makespan_ticks(p, f(p)) for f in MICROBATCH_BASELINES.values())
    assert not [s for s in warm_starts(build_problem(trace_model(TINY, Strategy("sp", "ep", "ag-rs", 2), seq=64),
                                                     COST)) if s.method.startswith("interleave")]


def test_ends_warm_starts_use_default_budgets_only_in_warm_up_and_cool_down():
    from moegraph.schedules.baselines import warm_starts
    M, L = 3, 2
    p = build_problem(_merged(M, layers=L), COST)
    slots = pair_slots(p)
    s = next(s for s in warm_starts(p) if s.method == "interleave2+ends")
    check_solution(p, s)
    ends = paired = 0
    for t in p.tasks:
        if t.kind != "comm":
            continue
        sm = t.modes[s.mode[t.index]].sm
        if L <= slots[t.index] < M * L:       # a paired slot: copy engines (the fewest SMs)
            assert sm == min(m.sm for m in t.modes), t.name
            paired += 1
        else:                                  # warm-up (micro-batch 0's forward) or cool-down
            assert sm == t.modes[t.default_mode].sm > 0, t.name
            ends += 1
    assert ends and paired


@pytest.mark.slow
def test_tune_ranks_merged_micro_batch_steps(tmp_path):
    from moegraph.schedules.schedule_file import Schedule
    from moegraph.schedules.tune import Cache, tune
    # CP-SAT limit 0.1 deterministic s: what is checked (merged step, verified, the baseline's
    # makespan) does not depend on the solver's effort
    res = tune(TINY, load_hardware("h800"), n=2, seq=256, time_limit=0.1, refine=1, cache=Cache(tmp_path),
               micro_batches=2)
    assert res["micro_batches"] == 2
    best = Schedule.from_json(res["_best_schedule"])
    assert {n.attrs.get("mb") for n in best.nodes} >= {0, 1} and verify_schedule(best) == []
    # the tp+tp sequential baseline is the merged step's: two micro-batches, one gradient sync
    one = compile_graph(trace_model(TINY, Strategy("tp", "tp", "ag-rs", 2), seq=256), COST, method="sequential")
    single = one.schedule.summary["makespan_us"]
    sync = sum(n.end_us - n.start_us for n in one.schedule.nodes if n.op == "all_reduce" and n.role == "wgrad")
    assert sync > 0
    # (plus micro-batch 1's weight-gradient kernels reading the running sum they add into)
    assert 2 * single - sync <= res["baseline"]["predicted_us"] < 2 * single - sync / 2
