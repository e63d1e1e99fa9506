"""Unfused vs chunk=4 vs fused (tile-level, MegaScale-MoE §4.2) predicted layer times. Cost model only.

For each model x hardware (sp+ep+ag-rs, the paper's strategy; n=8, b=1, s=8192) three graphs:
    unfused        chunks=1
    chunk=4        chunks=4 (every chunk re-reads the expert weights)
    chunk=4+fused  chunks=4 + fuse=auto (each chunk's pairs fused)
    fused          chunks=1 + fuse=auto (every group whose kernel beats its members in series)
and, per graph: the serial sum of node times, the two-stream list-schedule estimate the passes
use, the compute stream's busy time, and the step (fwd+bwd) makespan of the scheduler's greedy
list-schedule baseline and of CP-SAT (--time-limit, deterministic seconds; `source` says where
the schedule came from). Then each forward fused group's Fig 16 factor: (comm + compute one
after another) / fused kernel time, beside the paper's 1.2-4.7x.

    .venv/bin/python benchmarks/fuse_variants.py                 # mixtral-8x7b, internal-352b on h800, h20
    .venv/bin/python benchmarks/fuse_variants.py --time-limit 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moegraph.cost import CostModel  # noqa: E402
from moegraph.ir import Phase, Strategy  # noqa: E402
from moegraph.passes import run_pipeline  # noqa: E402
from moegraph.passes.estimate import overlap_time_us, serial_time_us  # noqa: E402
from moegraph.registry import load_hardware, load_model  # noqa: E402
from moegraph.schedules.api import compile_graph  # noqa: E402
from moegraph.tracer import trace_model  # noqa: E402

VARIANTS = (("unfused", 1, None), ("chunk=4", 4, None), ("chunk=4+fused", 4, "fuse=auto"), ("fused", 1, "fuse=auto"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mixtral-8x7b,internal-352b")
    p.add_argument("--hardware", default="h800,h20")
    p.add_argument("--time-limit", type=float, default=10.0)
    a = p.parse_args(argv)
    print("| model | hw | variant | nodes | compute busy us | serial us | 2-stream est. us | greedy us | cpsat us (source) |")
    print("|---|---|---|---|---|---|---|---|---|")
    factors = []
    for model_name in a.models.split(","):
        model = load_model(model_name)
        for hw_name in a.hardware.split(","):
            cost = CostModel(load_hardware(hw_name))
            for label, chunks, spec in VARIANTS:
                g = trace_model(model, Strategy("sp", "ep", "ag-rs", 8, chunks=chunks), batch=1, seq=8192)
                if spec:
                    g, report = run_pipeline(g, spec, cost=cost)
                    if chunks == 1:
                        factors += [(model_name, hw_name, grp) for grp in report["fuse"]["groups"]
                                    if g.node[grp["anchor"]].phase is Phase.FORWARD]
                busy = sum(cost.node_time_us(n) for n in g.nodes if not n.is_comm)
                greedy = compile_graph(g, cost, method="greedy").schedule.summary["makespan_us"]
                res = compile_graph(g, cost, time_limit_s=a.time_limit)
                print(f"| {model_name} | {hw_name} | {label} | {len(g.nodes)} | {busy:,.1f} | {serial_time_us(g, cost):,.1f} | "
                      f"{overlap_time_us(g, cost):,.1f} | {greedy:,.1f} | "
                      f"{res.schedule.summary['makespan_us']:,.1f} ({res.source}) |", flush=True)
    print("\nForward fused groups (Fig 16: the paper's overlapped vs non-overlapped time, 1.2-4.7x):\n")
    print("| model | hw | kernel | comm us | compute us | comm+compute us | fused us | factor | SMs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model_name, hw_name, grp in factors:
        print(f"| {model_name} | {hw_name} | {grp['kind']} ({grp['anchor']}) | {grp['comm_us']:,.1f} | "
              f"{grp['compute_us']:,.1f} | {grp['unfused_us']:,.1f} | {grp['fused_us']:,.1f} | "
              f"{grp['unfused_us'] / grp['fused_us']:.2f}x | {grp['sm']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
