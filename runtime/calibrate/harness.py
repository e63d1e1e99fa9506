"""The calibration ranks' harness: lockstep decisions across ranks, the clock, each rank's
environment, and the coarse-to-fine sweep that fits cases into a time budget (``benchmarks``'
module docstring: timing and budget), plus the IR nodes and byte counts every benchmark builds on.

Notation: M rows (tokens), K/N GEMM in/out features, n ranks.
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from moegraph.cost import shape_attrs
from moegraph.ir import Node, OpKind, Phase, Role, freeze_attrs
from moegraph.kernels import RankContext, run_compute
from moegraph.runtime.calibrate.results import Sample
from moegraph.runtime.collectives import Comm

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Lockstep:
    """Rank-0 decisions and cross-rank reductions; trivial for one rank (or no process group)."""

    def __init__(self, rank: int, n: int):
        import torch.distributed as dist
        self.rank, self.n = rank, n
        self.dist = dist if n > 1 and dist.is_available() and dist.is_initialized() else None

    def agree(self, *values: int) -> list[int]:
        """Rank 0's values, on every rank."""
        if self.dist is None:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        self.dist.broadcast(t, src=0)
        return [int(v) for v in t.tolist()]

    def reduce(self, values: Sequence[float], how: str) -> list[float]:
        """Mean ("mean") or max ("max") over ranks, element-wise."""
        if self.dist is None:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64)
        if how == "mean":
            self.dist.all_reduce(t)
            t /= self.n
        elif how == "max":
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        else:
            raise ValueError(f"reduction {how!r} is not one of 'mean', 'max'")
        return t.tolist()

    def barrier(self) -> None:
        if self.dist is not None:
            self.dist.barrier()


class Clock:
    """Seconds per call: host clock on CPU, CUDA events on GPU (kernel time, not launch time)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def times(self, fn: Callable[[], Any], reps: int) -> list[float]:
        enabled = gc.isenabled()
        gc.disable()                                # a collection inside a timed call is noise
        try:
            if self.cuda:
                pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                         for _ in range(reps)]
                for start, end in pairs:
                    start.record()
                    fn()
                    end.record()
                torch.cuda.synchronize()
                return [start.elapsed_time(end) / 1e3 for start, end in pairs]
            out = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
            return out
        finally:
            if enabled:
                gc.enable()

    def host_loop(self, fn: Callable[[], Any], calls: int) -> float:
        """Host seconds per call of ``calls`` back-to-back calls (launch-bound on GPU)."""
        if self.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / calls


@dataclass
class RankEnv:
    """What one rank needs to run benchmarks."""

    rank: int
    n: int
    device: torch.device
    dtype_name: str
    backend: str
    t0: float                     # command start, time.time()
    deadline: float               # end of measuring, time.time()
    group: Lockstep
    clock: Clock
    verbose: bool = True
    comm: Comm | None = None      # the runtime's collectives (n >= 2)
    timeout_s: float = 300.0      # any one collective
    ctx: RankContext = field(init=False)

    def __post_init__(self):
        self.ctx = RankContext(self.rank, self.n, 1)

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype_name]

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=self.dtype)

    def log(self, text: str) -> None:
        if self.rank == 0 and self.verbose:
            print(f"calibrate [{time.time() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)


def coarse_to_fine(k: int) -> list[int]:
    """Indices 0..k-1: smallest, middle, largest, then midpoints of ever finer intervals."""
    if k <= 0:
        return []
    order, seen = [], set()

    def add(i: int) -> None:
        if i not in seen:
            seen.add(i)
            order.append(i)

    add(0)
    add((k - 1) // 2)
    add(k - 1)
    queue = [(0, (k - 1) // 2), ((k - 1) // 2, k - 1)]
    while queue:
        a, b = queue.pop(0)
        if b - a > 1:
            m = (a + b) // 2
            add(m)
            queue += [(a, m), (m, b)]
    return order


def measure(env: RankEnv, fn: Callable[[], Any], deadline: float, cases_left: int, how: str, *,
            min_reps: int = 3, max_reps: int = 50) -> float:
    """Median seconds of ``fn`` (warm-up, one probe, then reps fitting the time left), reduced
    over ranks with ``how``. Every rank makes the same number of calls (rank 0 decides)."""
    fn()
    probe = env.clock.times(fn, 1)[0]
    share = max(0.0, deadline - time.time()) / max(1, cases_left)
    want = int(share / max(probe, 1e-7)) - 1
    floor = min_reps if probe < 0.1 else 1
    (reps,) = env.group.agree(max(floor, min(max_reps, want)))
    times = env.clock.times(fn, reps)
    return env.group.reduce([statistics.median(times + [probe])], how)[0]


def sweep(env: RankEnv, cases: Sequence[Any], run: Callable[[Any, float, int], Sample | None],
          deadline: float, work: Callable[[Any], float], *, min_cases: int = 1) -> tuple[list[Sample], int]:
    """Run cases coarse to fine until the deadline (at least ``min_cases``); (samples, cases not run).

    A case whose estimated cost (its ``work`` at the best work/second seen so far, three calls)
    does not fit in the time left is passed over, so one huge case cannot eat a short budget."""
    out: list[Sample] = []
    order = coarse_to_fine(len(cases))
    rate = 0.0                                          # best work per second so far
    for i, idx in enumerate(order):
        left = max(0.0, deadline - time.time())
        must = i < min_cases
        if not must and left <= 0:
            decision = 1                                # stop
        elif not must and rate > 0 and 3 * work(cases[idx]) / rate > left:
            decision = 2                                # too big for the time left: pass over it
        else:
            decision = 0
        (decision,) = env.group.agree(decision)
        if decision == 1:
            break
        if decision == 2:
            continue
        sample = run(cases[idx], deadline, len(order) - i)
        if sample is not None:
            out.append(sample)
            rate = max(rate, work(cases[idx]) / max(sample.seconds, 1e-9))
    return out, len(order) - len(out)


def bench_node(op: OpKind, role: Role = Role.FORWARD, *, flops: float = 0, mem_bytes: float = 0,
          **attrs: Any) -> Node:
    """A benchmark's IR node; a GEMM, grouped GEMM or attention node takes the shape attributes the
    lowering gives the same op (``moegraph.efficiency.gemm_attrs`` / ``attention_attrs``)."""
    phase = Phase.FORWARD if role is Role.FORWARD else Phase.BACKWARD
    return Node(name=f"calibrate.{op.value}.{role.value}", op=op, phase=phase, inputs=(), outputs=("y",),
                role=role, flops=int(flops), mem_bytes=int(mem_bytes), attrs=freeze_attrs(attrs))


def nbytes(*tensors: torch.Tensor) -> int:
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def shape_bytes(shape: Sequence[int], t: torch.Tensor) -> int:
    return math.prod(shape) * t.element_size()


def compute_case(env: RankEnv, bench: str, node: Node, ins: list[Any], out_shapes: list[tuple[int, ...]],
                  label: str, deadline: float, left: int, **kw: Any) -> Sample:
    """Time ``run_compute(node)``; mem_bytes as the IR builder counts them (inputs once + outputs)."""
    fn = lambda: run_compute(env.ctx, node, ins, out_shapes)  # noqa: E731
    tensors = [t for t in ins if isinstance(t, torch.Tensor)]
    mem = node.mem_bytes or nbytes(*tensors) + sum(shape_bytes(s, tensors[0]) for s in out_shapes)
    seconds = measure(env, fn, deadline, left, "mean", **kw)
    return Sample(bench, node.op.value, seconds, flops=node.flops, mem_bytes=mem, label=label,
                  shape=shape_attrs(dict(node.attrs), node.role))
