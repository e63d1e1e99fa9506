"""One hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1): launch order is execution order
(moegraph.schedules.launch)."""

import pytest

from moegraph.ir import OpKind, Strategy
from moegraph.passes.microbatch import merge_microbatches
from moegraph.registry import load_model
from moegraph.tracer import trace_model
from moegraph.schedules.api import compile_graph
from moegraph.schedules.baselines import greedy
from moegraph.schedules.launch import follows_launch, launch_sequence, with_launch_order
from moegraph.schedules.problem import ScheduleError, build_problem
from moegraph.schedules.solution import check_solution, makespan_ticks
from moegraph.schedules.verify import verify_schedule
from schedules_fakes import PARAM, MiniBuilder, cost_model

COST = cost_model()


def head_of_line() -> "Graph":  # noqa: F821
    """Program order p, q, r, s: q (a collective) waits for p; s (a collective) needs nothing.
    A queue per stream runs s at once beside p; one queue launches s after q, which starts
    only when p ends, and s then queues behind q on the comm stream."""
    g = MiniBuilder("head_of_line", 8)
    T, h = 4096, 4096
    x = g.inp("x", (T, h))
    x3 = g.inp("x3", (T, h))
    w = g.inp("w", (h, h), PARAM)
    a = g.gemm("p", x, w, g.val("a", (T, h)), T, h, h)
    a_ag = g.comm("q", OpKind.ALL_GATHER, a, g.val("a_ag", (T * 8, h)))
    b = g.gemm("r", x, w, g.val("b", (T, h)), T, h, h)
    c = g.comm("s", OpKind.ALL_GATHER, x3, g.val("c", (T * 8, h)))
    g.outputs += [a_ag, b, c]
    return g.build()


def test_one_queue_changes_the_schedule():
    graph = head_of_line()
    free = compile_graph(graph, COST, time_limit_s=2.0)
    one = compile_graph(graph, COST, time_limit_s=2.0, launch_order="program")
    at = {n.name: n for n in free.schedule.nodes}
    assert at["s"].start_us < at["p"].end_us          # free: s runs beside p
    at1 = {n.name: n for n in one.schedule.nodes}
    order = ["p", "q", "r", "s"]
    starts = [at1[n].start_us for n in order]
    assert starts == sorted(starts)                    # one queue: starts follow the launch order
    assert at1["s"].start_us >= at1["q"].end_us        # s queued behind q on the comm stream
    assert one.schedule.summary["makespan_us"] > free.schedule.summary["makespan_us"] + 50
    assert one.schedule.summary["launch_order"] == "program"
    assert verify_schedule(one.schedule) == []


def test_list_schedules_dispatch_in_order():
    p = with_launch_order(build_problem(head_of_line(), COST), "program")
    sol = greedy(p)
    check_solution(p, sol)                             # raises on an out-of-order start
    assert follows_launch(p, sol.start) is None
    free = build_problem(head_of_line(), COST)
    assert makespan_ticks(p, sol) > makespan_ticks(free, greedy(free))


def test_check_solution_refuses_out_of_order_starts():
    free = build_problem(head_of_line(), COST)
    sol = greedy(free)                                 # starts s beside p: out of program order
    one = with_launch_order(free, "program")
    with pytest.raises(ScheduleError, match="one hardware queue"):
        check_solution(one, sol)


def test_megatron_order_on_a_merged_step():
    layer = trace_model(load_model("tiny"), Strategy("sp", "ep", "a2a", 2), seq=64)
    merged = merge_microbatches(layer, 2)
    p = build_problem(merged, COST)
    seq = launch_sequence(p, "megatron-1f1b")
    assert sorted(seq) == list(range(len(p.tasks)))
    pos = {i: k for k, i in enumerate(seq)}
    assert all(pos[q] < pos[t.index] for t in p.tasks for q in t.preds)    # a program: inputs launched first
    free = compile_graph(merged, COST, method="megatron-1f1b")
    one = compile_graph(merged, COST, method="megatron-1f1b", launch_order="megatron-1f1b")
    assert one.schedule.summary["makespan_us"] >= free.schedule.summary["makespan_us"]
    with pytest.raises(ScheduleError, match="merged step"):
        launch_sequence(build_problem(layer, COST), "megatron-1f1b")


def test_unknown_launch_order_is_refused():
    with pytest.raises(ScheduleError, match="launch_order='fifo' is not one of free, program, megatron-1f1b"):
        compile_graph(head_of_line(), COST, launch_order="fifo")


def test_config_launch_order_reaches_the_schedule():
    """CompileConfig.launch_order is what the driver schedules under: the schedule's starts follow
    the program's launch sequence, and the file records it."""
    from moegraph.config import CompileConfig, SolverEffort
    from moegraph.schedules.driver import build
    config = CompileConfig(model="tiny", strategy=Strategy("sp", "ep", "a2a", 2), seq=64, passes=(),
                           launch_order="program", solver=SolverEffort(1.0), hardware=COST.hw)
    compiled = build(config)
    assert compiled.schedule.summary["launch_order"] == "program"
    seq = with_launch_order(build_problem(compiled.graph, compiled.cost), "program")
    start = {n.name: n.start_us for n in compiled.schedule.nodes}
    starts = [start[seq.tasks[i].name] for i in seq.launch]
    assert len(starts) > 10 and starts == sorted(starts)
    assert "launch_order" not in build(config.replace(launch_order="free")).schedule.summary


@pytest.mark.parametrize("changes, message", [
    (dict(launch_order="fifo"), "launch_order='fifo' is not one of free, program, megatron-1f1b"),
    (dict(launch_order="megatron-1f1b"), "launch_order='megatron-1f1b' launches one micro-batch's forward beside "
                                         "another's backward: it needs micro_batches >= 2 (got 1)"),
])
def test_config_refuses_a_bad_launch_order(changes, message):
    from moegraph.config import CompileConfig
    from moegraph.ir import ConfigError
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CompileConfig(model="tiny", **changes)
