"""A lower bound on the exposed data-parallel gradient sync of one step, beside the scheduled one
(``moegraph.schedules.bound.dp_sync_exposure_bound``; ``compile --json``: ``exposed_dp_sync_bound_us``).

Why: issue 15 asks that the DP sync (mixtral-8x7b, h800, dp=4) be exposed at most 5% as much as
a sequential end-of-step sync. This shows which sizes allow it at all. With one communication
stream (the default ``comm_streams``) the sync's collectives (node attr ``dp``) run one at a
time, each at least its fastest mode; the only compute they can hide under is the backward's
(they read its weight gradients), which is busy at most the sum of its slowest modes. So

    exposed DP sync >= sum(fastest dp-sync durations) - sum(slowest backward compute durations)

for every schedule of the problem (sound; the scheduler is not consulted for it). The scheduled
figure is ``compile --json``'s ``exposed_dp_sync_us`` (CP-SAT at the default limit).

    .venv/bin/python benchmarks/dp_exposure_bound.py [--batches 1 8] [--layers 1]
"""

from __future__ import annotations

import argparse

from moegraph.cost import CostModel
from moegraph.ir import Strategy
from moegraph.passes import run_pipeline
from moegraph.registry import load_hardware, load_model
from moegraph.schedules.api import compile_graph
from moegraph.schedules.bound import dp_sync_exposure_bound
from moegraph.schedules.problem import build_problem
from moegraph.schedules.schedule_file import dp_sync_exposure
from moegraph.tracer import trace_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mixtral-8x7b")
    ap.add_argument("--hw", default="h800")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=10.0)
    args = ap.parse_args()
    cost = CostModel(load_hardware(args.hw))
    print(f"{args.model}, {args.hw}, sp+ep+ag-rs n=8 s=8192 dp={args.dp}, {args.layers} layer(s), one comm stream\n")
    print("| b | passes | sync (sequential) ms | bound: exposed >= ms | bound / sync | CP-SAT exposed ms | CP-SAT / sync |")
    print("|---|---|---|---|---|---|---|")
    for b in args.batches:
        for passes in ("gate-reorder,sar=paper", "gate-reorder,sar=paper,compress=dp-bf16"):
            g = trace_model(load_model(args.model), Strategy("sp", "ep", "ag-rs", 8, dp=args.dp), batch=b, seq=8192,
                            layers=args.layers)
            g, _ = run_pipeline(g, passes, cost=cost)
            bound = dp_sync_exposure_bound(build_problem(g, cost))
            sched = compile_graph(g, cost, time_limit_s=args.time_limit).schedule
            got = dp_sync_exposure(sched.nodes)
            seq_us, exp_us = got["dp_sync_us"], got["exposed_dp_sync_us"]
            print(f"| {b} | {passes} | {seq_us / 1e3:.1f} | {bound / 1e3:.1f} | {bound / seq_us:.0%} "
                  f"| {exp_us / 1e3:.1f} | {exp_us / seq_us:.0%} |", flush=True)


if __name__ == "__main__":
    main()
