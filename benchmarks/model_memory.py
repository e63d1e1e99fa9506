"""Model-level peak memory and predicted time, sar=none vs sar=paper, on stacks of L layers.

    .venv/bin/python benchmarks/model_memory.py                        # mixtral-8x7b, h800, L = 4 8 32
    .venv/bin/python benchmarks/model_memory.py --layers 4 --time-limit 5

Per L and pipeline (gate-reorder,sar=none / gate-reorder,sar=paper; sp+ep+ag-rs, n=8, b=1,
s=8192): the CP-SAT schedule's makespan and peak (what ``moegraph compile --layers L --json``
reports), the greedy and megascale list schedules' (which show whether rebuilds stay near
their use: schedules.problem.remat_anchors), and the bytes the forward leaves for backward,
counted from the graph (values made in forward and read in backward). Prints one markdown
table with the date, machine and load average; 32 layers take minutes on a loaded 2-core box.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from moegraph.passes.stack import stack_layers
from moegraph.cost import CostModel  # noqa: E402
from moegraph.ir import Strategy  # noqa: E402
from moegraph.passes import run_pipeline  # noqa: E402
from moegraph.registry import load_hardware, load_model  # noqa: E402
from moegraph.schedules import compile_graph  # noqa: E402
from moegraph.schedules.baselines import BASELINES  # noqa: E402
from moegraph.schedules.problem import build_problem  # noqa: E402
from moegraph.schedules.solution import makespan_ticks, peak_memory_bytes  # noqa: E402
from moegraph.tracer import trace_model  # noqa: E402
from helpers import held_for_backward  # noqa: E402  (tests/helpers.py)

PIPELINES = ("gate-reorder,sar=none", "gate-reorder,sar=paper")
GIB = 2**30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mixtral-8x7b")
    ap.add_argument("--hardware", default="h800")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 32])
    ap.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT deterministic seconds (compile's default)")
    args = ap.parse_args()
    cost = CostModel(load_hardware(args.hardware))
    model = load_model(args.model)
    strategy = Strategy("sp", "ep", "ag-rs", 8)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{args.model} on {args.hardware}, sp+ep+ag-rs n=8 b=1 s=8192, CP-SAT --time-limit {args.time_limit}; "
          f"{stamp}, {platform.node()} ({os.cpu_count()} cores), load average {os.getloadavg()[0]:.1f}\n")
    print("| L | pipeline | held for bwd GiB | CP-SAT us | CP-SAT peak GiB | greedy us | greedy peak GiB "
          "| megascale us | megascale peak GiB | wall s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for L in args.layers:
        for pipe in PIPELINES:
            g, _ = run_pipeline(stack_layers(trace_model(model, strategy, seq=8192), L), pipe, cost=cost)
            p = build_problem(g, cost)
            lists = {name: BASELINES[name](p) for name in ("greedy", "megascale")}
            t0 = time.perf_counter()
            s = compile_graph(g, cost, time_limit_s=args.time_limit).schedule.summary
            wall = time.perf_counter() - t0
            cells = [f"{makespan_ticks(p, sol) * p.tick_us:.1f} | {peak_memory_bytes(p, sol) / GIB:.3f}"
                     for sol in lists.values()]
            print(f"| {L} | {pipe} | {held_for_backward(g) / GIB:.3f} | {s['makespan_us']:.1f} | "
                  f"{s['peak_memory_bytes'] / GIB:.3f} | {' | '.join(cells)} | {wall:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
