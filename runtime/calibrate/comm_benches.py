"""Collective benchmarks: the runtime's own collectives (``moegraph.runtime.collectives.Comm``),
issued exactly as the executor issues them, by bytes sent; and compute beside a collective in flight.

Notation: b batch, S rows of one rank's shard, h row width, n ranks.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from moegraph.cost import collective_bytes
from moegraph.efficiency import gemm_attrs
from moegraph.index_map import IndexMap
from moegraph.ir import Node, OpKind, Phase, freeze_attrs
from moegraph.kernels import run_compute
from moegraph.runtime.calibrate.harness import RankEnv, bench_node, measure, nbytes, sweep
from moegraph.runtime.calibrate.results import BenchResult, OverlapMeasure, Sample
from moegraph.runtime.collectives import Pending

_H = 64                                                      # row width of collective test tensors
COMM_STREAM = "comm"


def make_collective(env: RankEnv, kind: str, comm_bytes: int, seed: int = 0
                    ) -> tuple[Callable[[], Pending], int, OpKind]:
    """(issue, full_bytes, op): issue() starts the collective on the runtime's ``Comm`` exactly as
    the executor does (an IR node and its inputs) and returns its Pending. Sizes give about
    ``comm_bytes`` sent per rank; full_bytes is the tensor the cost model prices."""
    if env.comm is None:
        raise ValueError(f"collective {kind!r} needs n >= 2 ranks with a process group")
    n, esize = env.n, torch.empty((), dtype=env.dtype).element_size()
    shard_rows = max(1, round(comm_bytes / (n - 1) / (_H * esize)))     # rows of one rank's shard
    if kind == "all_gather":
        x = env.rand(1, shard_rows, _H)                                 # [b, S, h] -> [b, n*S, h]
        op, ins, attrs, full = OpKind.ALL_GATHER, lambda: [x], {"dim": 1}, n * nbytes(x)
    elif kind == "reduce_scatter":
        x = env.rand(1, n * shard_rows, _H)                             # [b, n*S, h] -> [b, S, h]
        op, ins, attrs, full = OpKind.REDUCE_SCATTER, lambda: [x], {"dim": 1}, nbytes(x)
    elif kind == "all_to_all":                                          # Ulysses "heads" mode
        x = env.rand(1, shard_rows, n * _H)                              # [b, S, n*h'] -> [b, n*S, h']
        op, ins, attrs, full = (OpKind.ALL_TO_ALL, lambda: [x], {"mode": "heads", "split_dim": 2, "cat_dim": 1},
                                nbytes(x))
    elif kind == "all_to_all_uneven":                                   # "tokens" mode: counts first
        rows = n * shard_rows
        g = torch.Generator().manual_seed(seed * 1000 + env.rank)
        dest = torch.randint(0, n, (rows,), generator=g)                 # balanced in expectation
        splits = tuple(int(c) for c in torch.bincount(dest, minlength=n).tolist())
        x, flat = env.rand(rows, _H), torch.arange(rows)
        # a fresh IndexMap per issue: the runtime caches exchanged counts on the map, and the
        # benchmark must time the count exchange the runtime pays once per routing
        op, ins, attrs, full = (OpKind.ALL_TO_ALL, lambda: [x, IndexMap.from_splits(flat, splits)],
                                {"mode": "tokens"}, n * shard_rows * _H * esize)
    elif kind == "all_reduce":
        rows = max(n, round(comm_bytes * n / (2 * (n - 1)) / (_H * esize) / n) * n)
        x = env.rand(rows, _H)
        op, ins, attrs, full = OpKind.ALL_REDUCE, lambda: [x], {}, nbytes(x)
    else:
        raise ValueError(f"collective {kind!r} is not one of all_gather, reduce_scatter, all_to_all, "
                         f"all_to_all_uneven, all_reduce")
    node = Node(name=f"calibrate.{kind}", op=op, phase=Phase.FORWARD,
                inputs=tuple(f"in{i}" for i in range(len(ins()))),
                outputs=("y",), comm_bytes=collective_bytes(op, full, n), group=n,
                attrs=freeze_attrs(attrs))
    comm = env.comm
    return (lambda: comm.issue(node, ins(), COMM_STREAM, 0)), full, op


def _blocking(env: RankEnv, issue: Callable[[], Pending]) -> Callable[[], list[Any]]:
    return lambda: issue().wait(env.timeout_s, env.rank)


COMM_SIZES_CPU = tuple(1 << b for b in range(10, 25, 2))              # 1 KiB .. 16 MiB sent per rank


def bench_collective(env: RankEnv, kind: str, deadline: float) -> BenchResult:
    def run(target, dl, left):
        issue, full, op = make_collective(env, kind, target, seed=target)
        comm = collective_bytes(op, full - full % env.n, env.n)
        sec = measure(env, _blocking(env, issue), dl, left, "max", max_reps=100)
        return Sample(kind, op.value, sec, comm_bytes=comm, label=f"{kind} {comm} B")

    samples, left = sweep(env, COMM_SIZES_CPU, run, deadline, float, min_cases=2)
    small = min(samples, key=lambda s: s.comm_bytes)
    big = max(samples, key=lambda s: s.comm_bytes / s.seconds)
    summary = (f"{len(samples)} sizes, {small.seconds * 1e6:.0f} us at {small.comm_bytes:.0f} B, "
               f"best {big.comm_bytes / big.seconds / 1e9:.2f} GB/s at {big.comm_bytes / 1e6:.1f} MB")
    return BenchResult(kind, tuple(samples), summary, 0.0, f"{left} sizes not run (budget)" if left else "")


def bench_overlap(env: RankEnv, deadline: float) -> BenchResult:
    """Compute beside a collective: a GEMM loop alone, then while a large collective is in flight
    (on the host thread, as the CPU runtime overlaps), and the collective alone vs overlapped."""
    # the small model's QKV projection at s=512 (~3 ms on one core), beside ~4 MiB messages
    m, k, n_out = (4096, 4096, 4096) if env.cuda else (512, 512, 512)
    x, w = env.rand(1, m, k), env.rand(n_out, k)
    node = bench_node(OpKind.GEMM, flops=2 * m * k * n_out, **gemm_attrs(x.shape, w.shape))
    gemm = lambda: run_compute(env.ctx, node, [x, w], [(1, m, n_out)])  # noqa: E731
    kinds, comm_target = ("all_gather", "all_to_all"), 4 << 20
    share = max(0.0, deadline - time.time())
    compute_alone = measure(env, gemm, time.time() + share / 5, 1, "mean", max_reps=100)
    samples = []
    for i, kind in enumerate(kinds):
        issue, full, op = make_collective(env, kind, comm_target, seed=i)
        comm = collective_bytes(op, full - full % env.n, env.n)
        sub_deadline = time.time() + max(0.0, deadline - time.time()) / (len(kinds) - i)
        comm_alone = measure(env, _blocking(env, issue), time.time() + (sub_deadline - time.time()) / 3, 1, "max",
                             max_reps=10)
        ratios, stretches, runs = [], [], 0
        while True:
            (go,) = env.group.agree(int(runs < 2 or (runs < 10 and time.time() < sub_deadline)))
            if not go:
                break
            runs += 1
            env.group.barrier()
            done: list[float] = []
            start = time.perf_counter()
            pending = issue()
            works = pending.works
            try:
                works[-1].get_future().add_done_callback(lambda _f: done.append(time.perf_counter()))
            except (AttributeError, RuntimeError):  # a work without a future: polled below
                pass
            loop = []
            while not all(w.is_completed() for w in works):
                t = time.perf_counter()
                gemm()
                loop.append((t, time.perf_counter()))
            end = done[0] if done else time.perf_counter()
            pending.wait(env.timeout_s, env.rank)
            inside = [b - a for a, b in loop if b <= end] or [b - a for a, b in loop]
            if inside:
                ratios.append(statistics.median(inside) / compute_alone)
            stretches.append((end - start) / comm_alone)
        ratio, stretch = env.group.reduce([statistics.median(ratios) if ratios else 1.0,
                                           statistics.median(stretches)], "mean")
        samples.append(Sample("overlap", op.value, comm_alone * stretch, comm_bytes=comm, label=kind,
                              overlap=OverlapMeasure(compute_alone, ratio, comm_alone, stretch, runs)))
    slow = statistics.mean(s.overlap.compute_slowdown for s in samples)
    stretch = statistics.mean(s.overlap.comm_stretch for s in samples)
    return BenchResult("overlap", tuple(samples),
                       f"compute x{slow:.2f} while a collective runs, collective x{stretch:.2f} while compute "
                       f"runs", 0.0)
