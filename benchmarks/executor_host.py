"""Host time per node of the executor's step (the first GPU session: ~360 us per node, so the GPU
idled between nodes and no kernel ever ran beside a collective).

The emulated n=2 rank graph of ``moegraph.runtime.emulated`` (TINY_SIZES: tiny kernels, so the
host's own cost dominates) on CPU, one torch thread; per plan (sequential, greedy) and recording
on or off: ``runtime.executor.HostTime`` (wall time of forward + backward minus host waits,
divided by the nodes run, mean over the steps; on CPU it includes the kernels, which the host
runs itself), and how it splits into the kernels (``run_compute``), the emulated collectives'
issue and the executor's own bookkeeping (the rest).

    python benchmarks/executor_host.py                 # 30 steps per row
    python benchmarks/executor_host.py --steps 100
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))       # gpu_common, beside this file
from gpu_common import markdown_table  # noqa: E402

COLUMNS = ("plan", "recorded", "host_us_per_node", "kernels_us", "comm_issue_us", "executor_us")


class _Timed:
    """Wraps a callable, summing the host nanoseconds spent in it."""

    def __init__(self, fn: Any):
        self.fn, self.ns = fn, 0

    def __call__(self, *args: Any, **kw: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return self.fn(*args, **kw)
        finally:
            self.ns += time.perf_counter_ns() - t


def run(steps: int) -> list[dict[str, Any]]:
    import moegraph.runtime.executor as executor_module
    from moegraph.runtime.emulated import TINY_SIZES, EmulatedRankGraph
    torch.set_num_threads(1)
    rg = EmulatedRankGraph(TINY_SIZES, "cpu")
    rows = []
    for plan_name in ("sequential", "greedy"):
        for record in (False, True):
            ex = rg.executor(rg.plan(plan_name))
            for _ in range(3):                                           # warm-up: tables, probes, allocator
                rg.step(ex, record=record)
            kernels, issue = _Timed(executor_module.run_compute), _Timed(ex.comm.issue)
            executor_module.run_compute, ex.comm.issue = kernels, issue
            ex.host.reset()
            try:
                for _ in range(steps):
                    rg.step(ex, record=record)
            finally:
                executor_module.run_compute = kernels.fn
            nodes = steps * len(rg.graph.nodes)
            host = ex.host.us_per_node()
            k_us, c_us = kernels.ns / nodes / 1e3, issue.ns / nodes / 1e3
            rows.append({"plan": plan_name, "recorded": "yes" if record else "no", "host_us_per_node": host,
                         "kernels_us": k_us, "comm_issue_us": c_us, "executor_us": host - k_us - c_us})
    return rows


def main(argv: list[str] | None = None) -> int:
    from moegraph.cli import OneLineParser
    from moegraph.options import positive_int
    p = OneLineParser(prog="executor_host.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive_int, default=30)
    args = p.parse_args(argv)
    from moegraph.runtime.emulated import TINY_SIZES
    rows = run(args.steps)
    print(f"# executor_host: emulated n=2 rank graph, TINY_SIZES {TINY_SIZES}, CPU, 1 thread; mean of "
          f"{args.steps} steps; per node (us)")
    print(markdown_table(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
