"""Scheduler benchmark: CP-SAT vs the baselines and the lower bound on traced layers.

    .venv/bin/python benchmarks/schedules.py                     # default sweep, h800, n=8
    .venv/bin/python benchmarks/schedules.py --models mixtral-8x7b --pipelines "" "chunk=4,sar=paper"
    .venv/bin/python benchmarks/schedules.py --synthetic         # no tracer: tests/schedules_fakes graphs

Prints one markdown table (date and machine in the heading) with, per layer graph: nodes, the
analytic lower bound, the three baselines, CP-SAT's makespan, CP-SAT / analytic bound, CP-SAT
/ proven bound (the larger of the analytic bound and CP-SAT's own), best baseline / CP-SAT,
solver status, wall and CPU seconds (CPU: this process, which runs the one-thread search; on
the shared box it is the figure that does not grow with other people's load) and peak memory; ``source`` says whether the returned schedule is
CP-SAT's (``cpsat``) or a baseline kept, and ``solver own`` is CP-SAT's own makespan. Chunked pipelines (chunk=N) are solved with --chunk-time-limit and a
memory budget of --budget-frac times the largest baseline peak (tight enough that the overlap
the baselines buy with memory is not free), as the acceptance target states ("<= 60 s with 4
chunks and a memory budget").
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moegraph.schedules import MemoryBudgetError, compile_graph, verify_schedule  # noqa: E402
from moegraph.schedules.baselines import BASELINES  # noqa: E402
from moegraph.schedules.problem import build_problem  # noqa: E402
from moegraph.schedules.solution import peak_memory_bytes  # noqa: E402

STRATEGIES = (("sp", "ep", "ag-rs"), ("sp", "ep", "a2a"), ("tp", "tp", "ag-rs"))


def traced(models, pipelines, hw_name, n, seq, strategies=STRATEGIES, layers=1):
    from moegraph.cost import CostModel
    from moegraph.ir import Strategy
    from moegraph.registry import load_hardware, load_model
    from moegraph.tracer import trace_model
    from moegraph.passes.manager import run_pipeline
    cost = CostModel(load_hardware(hw_name))
    for model in models:
        for attn, ffn, dispatch in strategies:
            base = trace_model(load_model(model), Strategy(attn=attn, ffn=ffn, dispatch=dispatch, n=n), seq=seq)
            for pipe in pipelines:
                g = run_pipeline(base, pipe, cost=cost)[0] if pipe else base
                label = f"{model} {attn}/{ffn}/{dispatch} {pipe or '-'}"
                if layers > 1:
                    from moegraph.passes.stack import stack_layers
                    g, label = stack_layers(g, layers), f"{label} x{layers} layers"
                yield label, g, cost, "chunk=" in pipe


def synthetic(hw_name):
    sys.path.insert(0, str(ROOT / "tests"))
    from schedules_fakes import moe_layer
    from moegraph.cost import CostModel
    from moegraph.registry import load_hardware
    cost = CostModel(load_hardware(hw_name))
    for chunks in (1, 4):
        for re in (False, True):
            yield f"synthetic c{chunks}{' re' if re else ''}", moe_layer(chunks=chunks, recompute=re), cost, chunks > 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mixtral-8x7b", "internal-352b"])
    ap.add_argument("--pipelines", nargs="+", default=["", "sar=paper", "chunk=4", "chunk=4,sar=paper"])
    ap.add_argument("--hw", default="h800")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT time_limit_s per unchunked layer")
    ap.add_argument("--chunk-time-limit", type=float, default=40.0,
                    help="time_limit_s per chunked layer (40: about 40 s of CPU on the 2-core box, docs/scheduler.md)")
    ap.add_argument("--budget-frac", type=float, default=0.9,
                    help="memory budget for chunked layers, as a fraction of the largest baseline peak")
    ap.add_argument("--synthetic", action="store_true", help="use tests/schedules_fakes graphs")
    ap.add_argument("--layers", type=int, default=1, help="stack each traced layer L times (moegraph.layers)")
    ap.add_argument("--strategies", nargs="+", default=["/".join(s) for s in STRATEGIES],
                    help="attn/ffn/dispatch triples (default: all three)")
    args = ap.parse_args(argv)

    strategies = [tuple(s.split("/")) for s in args.strategies]
    cases = (synthetic(args.hw) if args.synthetic
             else traced(args.models, args.pipelines, args.hw, args.n, args.seq, strategies, args.layers))
    print(f"## Scheduler benchmark, {datetime.date.today().isoformat()}, {platform.node()} "
          f"({platform.processor() or platform.machine()}), hw={args.hw}, load average at start "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| layer | nodes | budget GiB | bound us | sequential | greedy | megascale | returned | source "
          "| solver own | returned/bound | returned/proven | best baseline/returned | status | wall s | cpu s | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios, proven = [], []
    for name, graph, cost, chunked in cases:
        budget = None
        if chunked and args.budget_frac:
            p = build_problem(graph, cost)
            budget = int(args.budget_frac * max(peak_memory_bytes(p, f(p)) for f in BASELINES.values()))
        limit = args.chunk_time_limit if chunked else args.time_limit
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            r = compile_graph(graph, cost, memory_budget_bytes=budget, time_limit_s=limit)
        except MemoryBudgetError as err:
            print(f"| {name} | {len(graph.nodes)} | {budget / 2**30:.2f} | error: {err} |")
            continue
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = r.schedule
        bad = verify_schedule(s)
        sm = s.summary
        b = sm["baselines"]
        ratio = sm["makespan_us"] / sm["lower_bound_us"]
        ratios.append(ratio)
        proven.append(sm["makespan_us"] / (sm["solver"]["objective_bound_us"] or sm["lower_bound_us"]))
        print(f"| {name} | {len(graph.nodes)} | {'-' if budget is None else f'{budget / 2**30:.2f}'} "
              f"| {sm['lower_bound_us']:.1f} | {b['sequential']:.1f} | {b['greedy']:.1f} | {b['megascale']:.1f} "
              f"| {sm['makespan_us']:.1f} | {r.source} | {sm['solver']['makespan_us']} "
              f"| {ratio:.4f} | {proven[-1]:.4f} | {min(b.values()) / sm['makespan_us']:.3f} "
              f"| {r.status}{' INVALID: ' + bad[0].message if bad else ''} | {wall:.1f} | {cpu:.1f} "
              f"| {sm['peak_memory_bytes'] / 2**30:.3f} |", flush=True)
    if ratios:
        print(f"\nmedian cpsat/bound {statistics.median(ratios):.4f} (max {max(ratios):.4f}); "
              f"median cpsat/proven bound "
              f"{statistics.median(proven):.4f} (max {max(proven):.4f}); {len(ratios)} layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
