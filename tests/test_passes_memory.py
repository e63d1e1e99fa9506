"""Model-level memory: what a schedule of L stacked layers holds, with and without selective
activation rematerialization (passes/sar.py; the remat anchors of schedules/problem.py).

Expected values come from the graph's values (or a hand sum), never from the memory model
under test."""

import pytest

from moegraph.ir import Phase, Role, Strategy
from moegraph.passes.stack import stack_layers
from moegraph.passes import run_pipeline
from moegraph.registry import load_model
from moegraph.schedules.api import compile_graph
from moegraph.schedules.baselines import BASELINES
from moegraph.schedules.problem import build_problem, remat_anchors
from moegraph.schedules.solution import memory_profile, peak_memory_bytes, solution_ends
from moegraph.tracer import trace_model
from helpers import held_for_backward
from schedules_fakes import GRAD, PARAM, PGRAD, MiniBuilder, cost_model

COST = cost_model()
SMALL = load_model("small")          # 4 layers
SP = Strategy("sp", "ep", "ag-rs", 2)
T, H = 1024, 2048
ACT_BYTES = T * H * 2                # one bf16 [T, H] activation


def _two_gemm_layer():
    """x -> f -> a -> g -> y; backward g.dgrad, g.wgrad, f.dgrad, f.wgrad (graph order). Backward
    reads x (f.wgrad) and a (g.wgrad): the layer holds 2 activations for backward."""
    g = MiniBuilder("two_gemm", n=8)
    x = g.inp("x", (T, H))
    w1, w2 = g.inp("w1", (H, H), PARAM), g.inp("w2", (H, H), PARAM)
    a = g.gemm("f", x, w1, g.val("a", (T, H)), T, H, H)
    y = g.gemm("g", a, w2, g.val("y", (T, H)), T, H, H)
    dy = g.inp("dy", (T, H), GRAD)
    da = g.gemm("g.dgrad", dy, w2, g.val("da", (T, H), GRAD), T, H, H, Phase.BACKWARD, Role.DGRAD)
    dw2 = g.gemm("g.wgrad", a, dy, g.val("dw2", (H, H), PGRAD), H, T, H, Phase.BACKWARD, Role.WGRAD)
    dx = g.gemm("f.dgrad", da, w1, g.val("dx", (T, H), GRAD), T, H, H, Phase.BACKWARD, Role.DGRAD)
    dw1 = g.gemm("f.wgrad", x, da, g.val("dw1", (H, H), PGRAD), H, T, H, Phase.BACKWARD, Role.WGRAD)
    g.outputs += [y, dx, dw1, dw2]
    g.saved |= {x, a}
    return g.build()


def test_stacked_peak_equals_a_hand_sum():
    """3 stacked two-gemm layers, sequential schedule. After the forward, x0, a0, y0 (= x1), a1,
    y1 (= x2), a2 and the output y2 are live (7); the seed gradient arrives at the barrier (8);
    the last layer's g.dgrad writes da2 while dy2 and a2 still wait for g.wgrad (9). From then
    on every step frees at least what it allocates. Peak: 9 activations."""
    three = stack_layers(_two_gemm_layer(), 3)
    p = build_problem(three, COST)
    sol = BASELINES["sequential"](p)
    assert peak_memory_bytes(p, sol) == 9 * ACT_BYTES
    assert held_for_backward(three) == 6 * ACT_BYTES        # x0, a0, y0, a1, y1, a2
    # as the forward ends, every value saved for backward is live, plus the output y2
    barrier = max(solution_ends(p, sol)[t.index] for t in p.tasks if t.side == 0)
    assert [b for tick, b in memory_profile(p, sol) if tick < barrier][-1] == 7 * ACT_BYTES


@pytest.mark.parametrize("method", ["sequential", "greedy", "megascale", "cpsat"])
@pytest.mark.slow
def test_stacked_peak_without_remat_holds_every_saved_activation(method):
    """Four layers of the small model with sar=none: every value the forward leaves for
    backward (counted here from the graph's values) is live at the barrier, so no schedule can
    peak below their sum; and the memory model holds no more than that plus what backward
    allocates (less than one layer's activations of this graph)."""
    g, _ = run_pipeline(stack_layers(trace_model(SMALL, SP, seq=64), 4), "gate-reorder,sar=none", cost=COST)
    held = held_for_backward(g)
    one_layer = held_for_backward(run_pipeline(trace_model(SMALL, SP, seq=64), "gate-reorder,sar=none",
                                                cost=COST)[0])
    assert held > 3 * one_layer          # the stack holds (nearly) four layers' worth
    peak = compile_graph(g, COST, method=method, time_limit_s=0.5).schedule.summary["peak_memory_bytes"]
    assert held <= peak < held + one_layer


def test_one_layer_has_no_remat_anchors():
    g, _ = run_pipeline(trace_model(SMALL, SP, seq=64), "gate-reorder,sar=paper", cost=COST)
    assert any(n.phase is Phase.RECOMPUTE for n in g.nodes) and remat_anchors(g) == {}


def _rebuilt_bytes_per_layer(graph) -> dict[int, int]:
    out: dict[int, int] = {}
    for n in graph.nodes:
        if n.phase is Phase.RECOMPUTE:
            out[n.layer] = out.get(n.layer, 0) + sum(graph.value[o].storage_bytes for o in n.outputs)
    return out


@pytest.mark.parametrize("method", ["greedy", "megascale", "cpsat"])
@pytest.mark.slow
def test_stacked_rebuilds_run_just_ahead_of_their_layer(method):
    """sar=paper on 4 layers: a layer's rebuilds (recompute / re-communicate nodes) start no
    earlier than the next layer's backward, so at no instant are more than two layers' rebuilt
    values live. Without that rule the list schedules rebuild every layer at the barrier and
    hold all of them (the model-level peak then fell only 12% on 32 mixtral layers)."""
    g, _ = run_pipeline(stack_layers(trace_model(SMALL, SP, seq=64), 4), "gate-reorder,sar=paper", cost=COST)
    per_layer = _rebuilt_bytes_per_layer(g)
    assert set(per_layer) == {0, 1, 2, 3} and len(set(per_layer.values())) == 1
    sched = compile_graph(g, COST, method=method, time_limit_s=0.5).schedule
    start = {n.name: n.start_us for n in sched.nodes}
    ends = {n.name: n.end_us for n in sched.nodes}
    # when layer i's backward may begin: its gradient from the layer above exists (the top
    # layer's is the seed, there at the barrier)
    barrier = max(ends[n.name] for n in g.nodes if n.phase is Phase.FORWARD)
    may_begin = {i: max([barrier] + [ends[g.producer[v].name] for n in g.nodes if n.layer == i and
                                     n.phase is Phase.BACKWARD for v in n.inputs
                                     if v in g.producer and g.producer[v].layer == i + 1]) for i in range(4)}
    assert may_begin[0] > may_begin[1] > may_begin[2] > may_begin[3] == barrier
    for n in g.nodes:
        if n.phase is Phase.RECOMPUTE:
            assert start[n.name] >= may_begin[min(n.layer + 1, 3)], (n.name, method)
    # live rebuilt bytes over time, from the schedule file (producer start to last reader end)
    events = []
    for v in (o for n in g.nodes if n.phase is Phase.RECOMPUTE for o in n.outputs):
        if g.value[v].storage_bytes:
            readers = [ends[n.name] for n in g.nodes if v in n.inputs or any(
                g.value[i].alias_of == v for i in n.inputs)]
            events += [(start[g.producer[v].name], g.value[v].storage_bytes), (max(readers), -g.value[v].storage_bytes)]
    live, most = 0, 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        live += d
        most = max(most, live)
    assert most <= 3 * per_layer[0]
