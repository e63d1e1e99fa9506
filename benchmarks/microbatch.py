"""Merged micro-batch step schedules (issue 16's predicted acceptance): exposed communication,
speed-up over M x the single-micro-batch CP-SAT schedule, and CP-SAT against the hand-written
megatron-1f1b and dualpipe orders.

    .venv/bin/python benchmarks/microbatch.py [--model mixtral-8x7b] [--hardware h800] [--layers 4]
                                              [--micro-batches 4] [--dispatch ag-rs|a2a|auto] [--time-limit 10]
                                              [--memory-budget BYTES | --budget-factor F] [--compare-window-search]

Both schedules are CP-SAT's at the same deterministic time limit, on the default pass
pipeline (gate-reorder, sar=paper; with --dispatch auto also the dispatch pass, which picks the
dispatch of the smaller predicted layer time, as `compile` does), n=8, s=8192. Prints one Markdown block for RESULTS.md.
``--budget-factor F`` bounds the merged step's memory at F x the single-micro-batch schedule's
peak; ``--compare-window-search`` also compiles the merged step without the window search
(moegraph.schedules.lns) and prints both (makespan, peak, wall time).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform

from moegraph.passes.stack import stack_layers
from moegraph.cost import CostModel
from moegraph.ir import Strategy
from moegraph.passes.microbatch import merge_microbatches
from moegraph.options import byte_size, format_bytes, positive_float, positive_int
from moegraph.passes import run_pipeline
from moegraph.registry import load_hardware, load_model
from moegraph.schedules import api
from moegraph.schedules.api import compile_graph
from moegraph.schedules.verify import verify_schedule
from moegraph.tracer import trace_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mixtral-8x7b")
    ap.add_argument("--hardware", default="h800")
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--micro-batches", type=positive_int, default=4)
    ap.add_argument("--dispatch", default="ag-rs", choices=("ag-rs", "a2a", "auto"),
                    help="token dispatch; auto: the dispatch pass's choice (the smaller predicted layer time)")
    ap.add_argument("--time-limit", type=positive_float, default=10.0)
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--memory-budget", type=byte_size, default=None, help="for the merged step only")
    budget.add_argument("--budget-factor", type=positive_float, default=None,
                        help="merged step's budget = F x the single-micro-batch schedule's peak")
    ap.add_argument("--compare-window-search", action="store_true",
                    help="also compile the merged step without the window search")
    args = ap.parse_args()
    M = args.micro_batches
    cost = CostModel(load_hardware(args.hardware))
    traced = "a2a" if args.dispatch == "auto" else args.dispatch
    graph = stack_layers(trace_model(load_model(args.model), Strategy("sp", "ep", traced, 8), seq=8192), args.layers)
    passes = "gate-reorder,dispatch=auto,sar=paper" if args.dispatch == "auto" else "gate-reorder,sar=paper"
    graph, _ = run_pipeline(graph, passes, cost=cost)
    args.dispatch = graph.strategy.dispatch if args.dispatch != "auto" else f"auto -> {graph.strategy.dispatch}"
    one = compile_graph(graph, cost, time_limit_s=args.time_limit)
    if args.budget_factor is not None:
        args.memory_budget = int(args.budget_factor * one.schedule.summary["peak_memory_bytes"])
    step = merge_microbatches(graph, M)
    merged = compile_graph(step, cost, time_limit_s=args.time_limit, memory_budget_bytes=args.memory_budget)
    assert verify_schedule(one.schedule) == [] and verify_schedule(merged.schedule) == []
    if args.compare_window_search:
        min_tasks, api.LNS_MIN_TASKS = api.LNS_MIN_TASKS, float("inf")
        try:
            plain = compile_graph(step, cost, time_limit_s=args.time_limit, memory_budget_bytes=args.memory_budget)
        finally:
            api.LNS_MIN_TASKS = min_tasks
        assert verify_schedule(plain.schedule) == []
    s1, s = one.schedule.summary, merged.schedule.summary
    span = s["makespan_us"]
    print(f"{args.model}, {args.layers} layers, {args.hardware}, sp+ep {args.dispatch}, n=8, s=8192, "
          f"passes {passes}, M={M}, --time-limit {args.time_limit:g}"
          + (f", merged step's memory budget {format_bytes(args.memory_budget)}" if args.memory_budget else "") + "; "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.node()} "
          f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})\n")
    gib = 2 ** 30
    print("| schedule | makespan us | exposed comm us | exposed / step | peak memory GiB |")
    print("|---|---:|---:|---:|---:|")
    print(f"| 1 micro-batch, cpsat ({one.source}, {one.status}) | {s1['makespan_us']:.1f} | "
          f"{s1['exposed_comm_us']:.1f} | {s1['exposed_comm_us'] / s1['makespan_us']:.3f} | "
          f"{s1['peak_memory_bytes'] / gib:.2f} |")
    print(f"| {M} x 1 micro-batch | {M * s1['makespan_us']:.1f} | {M * s1['exposed_comm_us']:.1f} | | |")
    print(f"| merged M={M}, returned ({merged.source}, {merged.status}) | {span:.1f} | {s['exposed_comm_us']:.1f} | "
          f"{s['exposed_comm_us'] / span:.3f} | {s['peak_memory_bytes'] / gib:.2f} |")
    for name, v in sorted(s["baselines"].items()):
        print(f"| merged M={M}, {name} | {v:.1f} | | | |")
    print(f"\nlower bound {s['lower_bound_us']:.1f} us; warm start {s['solver']['warm_start']} "
          f"({s['solver']['warm_start_makespan_us']:.1f} us); speed-up over {M} x single: "
          f"{M * s1['makespan_us'] / span:.3f}x; wall {one.wall_s:.0f} s + {merged.wall_s:.0f} s")
    window = s["solver"].get("lns")
    if window:
        print(f"window search (moegraph.schedules.lns): {window['improved']} of {window['windows']} windows kept, "
              f"{window['makespan_before_us']:.1f} -> {span:.1f} us")
    if args.compare_window_search:
        print("\n| merged step | makespan us | exposed comm us | peak memory GiB | budget GiB | wall s |")
        print("|---|---:|---:|---:|---:|---:|")
        for label, r in (("without the window search", plain), ("with the window search", merged)):
            t = r.schedule.summary
            print(f"| {label} ({r.source}, {r.status}) | {t['makespan_us']:.1f} | {t['exposed_comm_us']:.1f} | "
                  f"{t['peak_memory_bytes'] / gib:.3f} | "
                  f"{'-' if args.memory_budget is None else f'{args.memory_budget / gib:.3f}'} | {r.wall_s:.0f} |")


if __name__ == "__main__":
    main()
