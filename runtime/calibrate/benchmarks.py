"""Microbenchmarks behind ``moegraph calibrate``: what runs inside each calibration rank.

Regime. The cost model must predict what the runtime measures, so every number is taken the
way the runtime runs: the same kernels (``moegraph.kernels.run_compute`` on IR nodes), the
same dtype, the same collective call sequences (mirrored from ``runtime/collectives.py``:
reduce-scatter on gloo is all_to_all_single + a local sum, token all-to-alls first exchange
their counts), N ranks started together with ``max(1, cores // N)`` threads each, as
``moegraph.runtime.launch.spawn`` does. All ranks run the same benchmark at the same time (lockstep),
so a compute number is "one rank's kernel while the other ranks run theirs on the other
cores": shared caches, memory bandwidth and clocks included.

Timing. One warm-up call, then ``reps`` timed calls (host clock on CPU, CUDA events on GPU),
median per rank; compute medians are averaged over ranks, collective medians take the slowest
rank (a collective ends when its last rank does). ``reps`` is scaled to the time left: rank 0
decides and broadcasts it, so every rank makes the same number of collective calls.

Budget. Benchmarks run in priority order (``BENCHES``); each gets a share of the remaining
time proportional to its weight, unused time flows to later ones. Within a benchmark, cases
run coarse to fine (smallest, middle, largest, then midpoints), so a short budget still spans
the sizes, and a case too big for the time left is passed over. A benchmark whose turn comes
after the deadline is skipped (mandatory ones still take two cases) and listed as skipped in
the profile.

Notation: M rows (tokens), K/N GEMM in/out features, R expert rows, El local experts,
S sequence on this rank, H/G query/kv heads on this rank, d head dim, n ranks.

Modules: ``results`` (samples, results, the machine), ``harness`` (lockstep, clock, budgeted
sweeps), ``compute_benches``, ``comm_benches``, ``graph_benches``; this one holds the priority
order (``BENCHES``) and runs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from moegraph.runtime.calibrate.comm_benches import COMM_STREAM, bench_collective, bench_overlap
from moegraph.runtime.calibrate.compute_benches import (bench_attention, bench_gemm, bench_grouped_gemm, bench_kernel,
                                                        bench_memory)
from moegraph.runtime.calibrate.graph_benches import bench_model_graphs
from moegraph.runtime.calibrate.harness import Clock, Lockstep, RankEnv
from moegraph.runtime.calibrate.results import BenchResult, cpu_seconds
from moegraph.runtime.collectives import Comm


@dataclass(frozen=True)
class BenchSpec:
    name: str
    weight: float                 # share of the remaining budget
    mandatory: bool               # runs (one case) even past the deadline: the profile needs it
    needs_comm: bool = False      # needs n >= 2 ranks
    min_s: float = 0.2            # the least time it can do anything useful in (else skipped)


# Priority order: the profile's required fields first, then curves, then refinements.
BENCHES: tuple[BenchSpec, ...] = (
    BenchSpec("kernel", 0.3, True),
    BenchSpec("gemm", 2.0, True),
    BenchSpec("memory", 1.5, True),
    BenchSpec("all_gather", 1.5, True, needs_comm=True),
    BenchSpec("reduce_scatter", 1.2, False, needs_comm=True),
    BenchSpec("all_to_all", 1.2, False, needs_comm=True),
    BenchSpec("all_reduce", 1.0, False, needs_comm=True),
    BenchSpec("grouped_gemm", 1.5, False),
    BenchSpec("attention", 1.5, False),
    BenchSpec("overlap", 1.5, False, needs_comm=True, min_s=0.5),
    BenchSpec("all_to_all_uneven", 1.0, False, needs_comm=True),
    BenchSpec("model_graphs", 6.0, False, min_s=4.0),   # one graph: trace, interpret, time
)


def run_benches(env: RankEnv, only: Sequence[str] | None = None) -> list[BenchResult]:
    """Run BENCHES in order within the budget. Results are identical in shape on every rank."""
    specs = [b for b in BENCHES if (only is None or b.name in only)
             and not (b.needs_comm and env.n < 2)]
    results: list[BenchResult] = []
    for i, spec in enumerate(specs):
        now = time.time()
        (run,) = env.group.agree(int(spec.mandatory or now + spec.min_s < env.deadline))
        if not run:
            results.append(BenchResult(spec.name, (), "skipped", 0.0, "no time left (budget)"))
            env.log(f"{spec.name:<18} skipped: no time left")
            continue
        weights = sum(s.weight for s in specs[i:])
        bench_deadline = now + max(0.0, env.deadline - now) * spec.weight / weights
        start = time.time()
        if spec.name == "kernel":
            res = bench_kernel(env, bench_deadline)
        elif spec.name == "gemm":
            res = bench_gemm(env, bench_deadline)
        elif spec.name == "grouped_gemm":
            res = bench_grouped_gemm(env, bench_deadline)
        elif spec.name == "attention":
            res = bench_attention(env, bench_deadline)
        elif spec.name == "memory":
            res = bench_memory(env, bench_deadline)
        elif spec.name in ("all_gather", "reduce_scatter", "all_to_all", "all_to_all_uneven", "all_reduce"):
            res = bench_collective(env, spec.name, bench_deadline)
        elif spec.name == "overlap":
            res = bench_overlap(env, bench_deadline)
        elif spec.name == "model_graphs":
            res = bench_model_graphs(env, bench_deadline)
        else:
            raise NotImplementedError(f"no benchmark {spec.name!r}")
        res = BenchResult(res.name, res.samples, res.summary, time.time() - start, res.skipped)
        results.append(res)
        env.log(f"{spec.name:<18} {res.summary} ({res.seconds:.1f}s)" + (f" [{res.skipped}]" if res.skipped else ""))
    return results


def rank_benchmarks(rank: int, n: int, spec: dict[str, Any]) -> tuple[list[BenchResult] | None, float]:
    """One calibration rank, started by ``moegraph.runtime.launch.spawn`` (process group, threads
    and memory settings as for runtime ranks): run the benchmarks; (results on rank 0 else None,
    CPU seconds this rank used)."""
    comm = Comm(((COMM_STREAM, 0),), rank=rank, n=n, timeout_s=spec["pg_timeout_s"]) if n > 1 else None
    env = RankEnv(rank, n, torch.device("cpu"), spec["dtype"], spec["backend"], spec["t0"], spec["deadline"],
                  Lockstep(rank, n), Clock(torch.device("cpu")), verbose=spec.get("verbose", True), comm=comm,
                  timeout_s=spec["pg_timeout_s"])
    results = run_benches(env, spec.get("only"))
    return (results if rank == 0 else None), cpu_seconds()
