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
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from moegraph.cost import collective_bytes
from moegraph.index_map import IndexMap, RecvMap
from moegraph.ir import ConfigError, Node, OpKind, Phase, Role, freeze_attrs
from moegraph.kernels import RankContext, run_compute
from moegraph.runtime.collectives import Comm, Pending

__all__ = ["Sample", "OverlapMeasure", "BenchResult", "MachineInfo", "BENCHES", "TORCH_DTYPES", "rank_benchmarks",
           "run_benches", "machine_info", "make_collective"]

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MEMORY_BOUND_OPS = ("rmsnorm", "rope", "swiglu", "permute", "unpermute", "gate", "add", "cast", "index_map")


@dataclass(frozen=True)
class OverlapMeasure:
    """Compute beside a collective (bench_overlap): seconds of one GEMM alone, its slowdown while
    the collective is in flight, seconds of the collective alone and its stretch beside compute."""

    compute_alone: float
    compute_slowdown: float
    comm_alone: float
    comm_stretch: float
    runs: int


@dataclass(frozen=True)
class Sample:
    """One measured case: the median seconds of one call, and the sizes the cost model sees.

    op: an OpKind value (what the cost model prices it as), or "copy" (plain memcpy, for the
    bandwidth peak) or "overlap". flops / mem_bytes / comm_bytes follow the IR's conventions.
    """

    bench: str
    op: str
    seconds: float
    flops: float = 0.0
    mem_bytes: float = 0.0
    comm_bytes: float = 0.0
    label: str = ""
    graph: str = ""                             # model_graphs: the layer graph the node belongs to
    overlap: OverlapMeasure | None = None       # the overlap benchmark's measurements


@dataclass(frozen=True)
class MachineInfo:
    """The machine a calibration ran on (``benchmarks.machine_info``), plus the load around it."""

    host: str
    cpu: str
    cores: int
    torch: str
    gpu: str | None = None
    sm_count: int | None = None
    memory_bytes: int | None = None
    load_avg_1m: float | None = None          # before the run
    foreign_load_cores: float | None = None   # cores other processes used during it

    def line(self) -> str:
        return f"{self.host}: {self.gpu or self.cpu}, {self.cores} cores"


@dataclass(frozen=True)
class BenchResult:
    name: str
    samples: tuple[Sample, ...]
    summary: str
    seconds: float
    skipped: str = ""             # why it did not run, or ran only partly ("" = complete)


@dataclass(frozen=True)
class BenchSpec:
    name: str
    weight: float                 # share of the remaining budget
    mandatory: bool               # runs (one case) even past the deadline: the profile needs it
    needs_comm: bool = False      # needs n >= 2 ranks
    cpu_only: bool = False
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
    BenchSpec("model_graphs", 6.0, False, cpu_only=True, min_s=4.0),   # one graph: trace, interpret, time
)


# --- lockstep, clock, budget ---------------------------------------------------------------

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


# --- IR nodes and sizes ----------------------------------------------------------------------

def _node(op: OpKind, role: Role = Role.FORWARD, *, flops: float = 0, mem_bytes: float = 0,
          **attrs: Any) -> Node:
    phase = Phase.FORWARD if role is Role.FORWARD else Phase.BACKWARD
    return Node(name=f"calibrate.{op.value}.{role.value}", op=op, phase=phase, inputs=(), outputs=("y",),
                role=role, flops=int(flops), mem_bytes=int(mem_bytes), attrs=freeze_attrs(attrs))


def _nbytes(*tensors: torch.Tensor) -> int:
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _shape_bytes(shape: Sequence[int], t: torch.Tensor) -> int:
    return math.prod(shape) * t.element_size()


def _compute_case(env: RankEnv, bench: str, node: Node, ins: list[Any], out_shapes: list[tuple[int, ...]],
                  label: str, deadline: float, left: int, **kw: Any) -> Sample:
    """Time ``run_compute(node)``; mem_bytes as the IR builder counts them (inputs once + outputs)."""
    fn = lambda: run_compute(env.ctx, node, ins, out_shapes)  # noqa: E731
    tensors = [t for t in ins if isinstance(t, torch.Tensor)]
    mem = node.mem_bytes or _nbytes(*tensors) + sum(_shape_bytes(s, tensors[0]) for s in out_shapes)
    seconds = measure(env, fn, deadline, left, "mean", **kw)
    return Sample(bench, node.op.value, seconds, flops=node.flops, mem_bytes=mem, label=label)


# --- compute benchmarks ------------------------------------------------------------------------

def bench_kernel(env: RankEnv, deadline: float) -> BenchResult:
    """Per-node fixed cost: tiny kernels through run_compute, host time per call back to back."""
    t, cases = env.rand, []
    cases.append(("gemm", _node(OpKind.GEMM, flops=2 * 8 * 8), [t(1, 1, 8), t(8, 8)], [(1, 1, 8)]))
    cases.append(("add", _node(OpKind.ADD, flops=8), [t(1, 1, 8), t(1, 1, 8)], [(1, 1, 8)]))
    cases.append(("rmsnorm", _node(OpKind.RMSNORM, flops=32, eps=1e-5), [t(1, 1, 8), t(8)], [(1, 1, 8)]))
    cases.append(("swiglu", _node(OpKind.SWIGLU, flops=40), [t(1, 8), t(1, 8)], [(1, 8)]))
    cases.append(("gate", _node(OpKind.GATE, flops=8), [t(1, 8), t(1)], [(1, 8)]))
    samples = []
    for name, node, ins, shapes in cases:
        fn = lambda: run_compute(env.ctx, node, ins, shapes)  # noqa: E731
        for _ in range(20):
            fn()
        calls = 50
        per = [env.clock.host_loop(fn, calls) for _ in range(7)]
        sec = env.group.reduce([statistics.median(per)], "mean")[0]
        samples.append(Sample("kernel", node.op.value, sec, flops=node.flops, label=name))
    med = statistics.median(s.seconds for s in samples)
    detail = ", ".join(f"{s.label} {s.seconds * 1e6:.1f}" for s in samples)
    return BenchResult("kernel", tuple(samples), f"fixed cost {med * 1e6:.1f} us/node (median of {detail} us)", 0.0)


def _gemm_cases(env: RankEnv) -> list[tuple[int, int, int, str]]:
    """(M, K, N, role) spanning the tiny/small registry models (h 64/512, h_ffn 128/1024) at
    b=1, seq 16..4096 tokens on a rank, and one large case for the peak."""
    if env.cuda:
        ms, kns = (256, 1024, 4096, 16384), ((1024, 4096), (4096, 1024), (4096, 4096), (8192, 8192))
        peak = (8192, 8192, 8192, "forward")
    else:
        ms, kns = (16, 64, 256, 1024, 4096), ((64, 128), (128, 64), (512, 512), (512, 1024), (1024, 512))
        peak = (2048, 1024, 1024, "forward")
    roles = ("forward", "dgrad", "wgrad")
    cases = [(m, k, n, roles[(i + j) % 3]) for i, m in enumerate(ms) for j, (k, n) in enumerate(kns)]
    return sorted(cases + [peak], key=lambda c: (c[0] * c[1] * c[2], c))


def bench_gemm(env: RankEnv, deadline: float) -> BenchResult:
    def run(case, dl, left):
        m, k, n, role = case
        x, w, dy = env.rand(1, m, k), env.rand(n, k), env.rand(1, m, n)
        ins, out = {"forward": ([x, w], (1, m, n)), "dgrad": ([dy, w], (1, m, k)),
                    "wgrad": ([x, dy], (n, k))}[role]
        node = _node(OpKind.GEMM, Role(role), flops=2 * m * k * n)
        return _compute_case(env, "gemm", node, ins, [out], f"{role} {m}x{k}x{n}", dl, left)

    samples, left = sweep(env, _gemm_cases(env), run, deadline, lambda c: 2 * c[0] * c[1] * c[2], min_cases=2)
    best = max(s.flops / s.seconds for s in samples)
    return BenchResult("gemm", tuple(samples), f"{len(samples)} shapes, best {best / 1e9:.1f} GFLOP/s", 0.0,
                       f"{left} shapes not run (budget)" if left else "")


def _segments(rows: int, experts: int, seed: int) -> tuple[tuple[int, int], ...]:
    """Uneven rows per expert, as top-1 routing of ``rows`` rows with random router preferences."""
    g = torch.Generator().manual_seed(seed)
    prefs = torch.rand(experts, generator=g) + 0.5                   # experts differ by up to 3x
    counts = torch.bincount(torch.multinomial(prefs, rows, replacement=True, generator=g), minlength=experts)
    return tuple(enumerate(counts.tolist()))


def bench_grouped_gemm(env: RankEnv, deadline: float) -> BenchResult:
    """Per-expert GEMMs over uneven row segments (the grouped_gemm kernels, forward and grads)."""
    if env.cuda:
        rs, shapes = (1024, 4096, 16384), ((4, 4096, 14336), (4, 14336, 4096), (8, 2048, 1408))
    else:
        rs, shapes = (64, 256, 1024, 4096), ((2, 64, 128), (4, 128, 64), (4, 512, 1024), (4, 1024, 512),
                                               (8, 512, 1024))
    roles = ("forward", "dgrad", "wgrad")
    cases = sorted(((r, e, k, n, roles[(i + j) % 3]) for i, r in enumerate(rs) for j, (e, k, n) in enumerate(shapes)),
                   key=lambda c: (c[0] * c[2] * c[3], c))

    def run(case, dl, left):
        r, e, k, n, role = case
        seg = RecvMap(_segments(r, e, seed=r * 31 + e), (r,))
        x, w, dy = env.rand(r, k), env.rand(e, n, k), env.rand(r, n)
        ins, out = {"forward": ([x, w, seg], (r, n)), "dgrad": ([dy, w, seg], (r, k)),
                    "wgrad": ([x, dy, seg], (e, n, k))}[role]
        node = _node(OpKind.GROUPED_GEMM, Role(role), flops=2 * r * k * n)
        return _compute_case(env, "grouped_gemm", node, ins, [out], f"{role} R={r} El={e} {k}x{n}", dl, left)

    samples, left = sweep(env, cases, run, deadline, lambda c: 2 * c[0] * c[2] * c[3], min_cases=2)
    best = max(s.flops / s.seconds for s in samples)
    return BenchResult("grouped_gemm", tuple(samples), f"{len(samples)} shapes, best {best / 1e9:.1f} GFLOP/s", 0.0,
                       f"{left} shapes not run (budget)" if left else "")


def bench_attention(env: RankEnv, deadline: float) -> BenchResult:
    """Causal GQA attention (SDPA) forward and backward on this rank's heads, b=1."""
    n = env.n if not env.cuda else 1
    if env.cuda:
        models, seqs = ((32, 8, 128),), (1024, 2048, 4096, 8192)
    else:
        models, seqs = ((4, 2, 16), (8, 4, 64)), (128, 256, 512, 1024)
    cases = []
    for heads, kv, d in models:
        hl, gl = (heads // n, kv // n) if heads % n == 0 and kv % n == 0 else (heads, kv)
        for i, s in enumerate(seqs):
            for role in ("forward", "dgrad"):
                cases.append((s, hl, gl, d, role))
    cases.sort(key=lambda c: (c[0] * c[0] * c[1] * c[3], c))

    def run(case, dl, left):
        s, hl, gl, d, role = case
        q, k, v = env.rand(1, s, hl * d), env.rand(1, s, gl * d), env.rand(1, s, gl * d)
        fwd_flops = 2 * s * s * hl * d                                   # the IR's causal count
        if role == "forward":
            node, ins = _node(OpKind.ATTENTION, flops=fwd_flops, head_dim=d, causal=True), [q, k, v]
            outs = [(1, s, hl * d)]
        else:
            node = _node(OpKind.ATTENTION, Role.DGRAD, flops=fwd_flops * 5 // 2, head_dim=d, causal=True)
            ins, outs = [q, k, v, env.rand(1, s, hl * d), env.rand(1, s, hl * d)], [q.shape, k.shape, v.shape]
        return _compute_case(env, "attention", node, ins, [tuple(o) for o in outs],
                             f"{role} s={s} H={hl} G={gl} d={d}", dl, left)

    flops = lambda c: c[0] * c[0] * c[1] * c[3] * (5 if c[4] == "dgrad" else 2)  # noqa: E731
    samples, left = sweep(env, cases, run, deadline, flops, min_cases=2)
    best = max(s.flops / s.seconds for s in samples)
    return BenchResult("attention", tuple(samples), f"{len(samples)} shapes, best {best / 1e9:.1f} GFLOP/s", 0.0,
                       f"{left} shapes not run (budget)" if left else "")


def bench_memory(env: RankEnv, deadline: float) -> BenchResult:
    """Plain copies (the bandwidth peak) and memory-bound kernels (add, rmsnorm, swiglu) by bytes."""
    esize = torch.empty((), dtype=env.dtype).element_size()
    top = 30 if env.cuda else 26                                    # largest buffer 1 GiB / 64 MiB
    copies: list[tuple[str, int]] = [("copy", 1 << b) for b in range(14, top + 1, 2)]   # bytes per buffer
    h, f = (4096, 14336) if env.cuda else (512, 1024)
    tokens = (256, 1024, 4096, 16384, 65536) if env.cuda else (16, 64, 256, 1024, 4096, 16384)
    ops = sorted(((op, m) for m in tokens for op in ("add", "rmsnorm", "swiglu")),
                 key=lambda c: (c[1] * (f if c[0] == "swiglu" else h), c))

    def run(case, dl, left):
        op, size = case
        if op == "copy":
            src = torch.empty(size // esize, device=env.device, dtype=env.dtype).normal_()
            dst = torch.empty_like(src)
            sec = measure(env, lambda: dst.copy_(src), dl, left, "mean", max_reps=200)
            return Sample("memory", "copy", sec, mem_bytes=2 * size, label=f"copy {size} B")
        m = size
        if op == "add":
            node, ins, outs = _node(OpKind.ADD, flops=m * h), [env.rand(1, m, h), env.rand(1, m, h)], [(1, m, h)]
        elif op == "rmsnorm":
            node = _node(OpKind.RMSNORM, flops=4 * m * h, eps=1e-5)
            ins, outs = [env.rand(1, m, h), env.rand(h)], [(1, m, h)]
        else:
            node, ins, outs = _node(OpKind.SWIGLU, flops=5 * m * f), [env.rand(m, f), env.rand(m, f)], [(m, f)]
        return _compute_case(env, "memory", node, ins, outs, f"{op} {m} tokens", dl, left, max_reps=200)

    work = lambda c: 2 * c[1] if c[0] == "copy" else 3 * c[1] * max(h, f) * esize  # noqa: E731
    copy_deadline = time.time() + max(0.0, deadline - time.time()) / 3        # a third for copies
    samples, left = sweep(env, copies, run, copy_deadline, work, min_cases=2)
    more, left_ops = sweep(env, ops, run, deadline, work, min_cases=2)
    samples, left = samples + more, left + left_ops
    rates = [s.mem_bytes / s.seconds for s in samples if s.op == "copy"]
    best = max(rates) if rates else max(s.mem_bytes / s.seconds for s in samples)
    return BenchResult("memory", tuple(samples), f"{len(samples)} cases, best copy {best / 1e9:.1f} GB/s", 0.0,
                       f"{left} cases not run (budget)" if left else "")


# --- collectives: the runtime's own (moegraph.runtime.collectives.Comm) ------------------------

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
        op, ins, attrs, full = OpKind.ALL_GATHER, lambda: [x], {"dim": 1}, n * _nbytes(x)
    elif kind == "reduce_scatter":
        x = env.rand(1, n * shard_rows, _H)                             # [b, n*S, h] -> [b, S, h]
        op, ins, attrs, full = OpKind.REDUCE_SCATTER, lambda: [x], {"dim": 1}, _nbytes(x)
    elif kind == "all_to_all":                                          # Ulysses "heads" mode
        x = env.rand(1, shard_rows, n * _H)                              # [b, S, n*h'] -> [b, n*S, h']
        op, ins, attrs, full = (OpKind.ALL_TO_ALL, lambda: [x], {"mode": "heads", "split_dim": 2, "cat_dim": 1},
                                _nbytes(x))
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
        op, ins, attrs, full = OpKind.ALL_REDUCE, lambda: [x], {}, _nbytes(x)
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
    node = _node(OpKind.GEMM, flops=2 * m * k * n_out)
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


# --- whole layer graphs of the registry's CPU models -------------------------------------------

MODEL_GRAPHS = (                      # (model, seq, attn, ffn, dispatch), most representative first
    ("small", 512, "tp", "ep", "ag-rs"),
    ("small", 512, "sp", "ep", "a2a"),
    ("small", 1024, "tp", "tp", "ag-rs"),
    ("small", 256, "sp", "ep", "ag-rs"),
    ("small", 128, "tp", "ep", "a2a"),
    ("small", 1024, "sp", "ep", "a2a"),
    ("small", 256, "tp", "ep", "a2a"),
    ("small", 512, "sp", "tp", "ag-rs"),
    ("small", 128, "sp", "ep", "ag-rs"),
)
"""Only the ``small`` registry model: at equal FLOPs its kernels (head dim 64, h 512) run at other
efficiencies than ``tiny``'s (head dim 16, h 64), and the cost model sees FLOPs only, so mixing
both would blur the curves for the model the CPU runs are about. ``tiny``-sized shapes are in
the synthetic sweeps, which fill the sizes no graph node covers."""


def _model_graph(env: RankEnv, model: str, seq: int, attn: str, ffn: str, dispatch: str) -> Any:
    """The traced layer graph of one MODEL_GRAPHS entry at this run's n; ConfigError (raised by
    ``builder.check_strategy`` before anything is built) when n cannot split that layer."""
    from moegraph.ir import Strategy
    from moegraph.registry import load_model
    from moegraph.tracer import trace_model
    return trace_model(load_model(model), Strategy(attn, ffn, dispatch, env.n, dtype=env.dtype_name), batch=1, seq=seq)


def _graph_inputs(env: RankEnv, graph: Any, model: str, seq: int):
    """This rank's value environment of ``graph`` (``_model_graph``) from one interpreter run."""
    from moegraph.interpreter import interpret
    from moegraph.models import MoETransformerLayer
    from moegraph.registry import load_model
    cfg = load_model(model)
    torch.manual_seed(seq)
    layer = MoETransformerLayer.from_config(cfg).to(env.dtype)
    params = {k: p.detach() for k, p in layer.named_parameters()}
    x, dy = env.rand(1, seq, cfg.hidden), env.rand(1, seq, cfg.hidden)
    with torch.no_grad():
        envs = interpret(graph, params, x, dy).envs
    return envs[env.rank]


def _time_nodes(env: RankEnv, graph: Any, nodes: Sequence[Node], values: dict[str, Any], deadline: float,
                min_reps: int) -> list[float]:
    """Median seconds of each node on this rank (reps fitted to the time left), mean over ranks."""
    ctx = RankContext(env.rank, env.n, graph.dims.s)
    env.group.barrier()
    medians = []
    for j, nd in enumerate(nodes):
        ins = [values[v] for v in nd.inputs]
        shapes = [graph.value[o].shape for o in nd.outputs]
        fn = lambda: run_compute(ctx, nd, ins, shapes)  # noqa: E731
        fn()
        probe = env.clock.times(fn, 1)[0]
        share = max(0.0, deadline - time.time()) / (len(nodes) - j)
        reps = max(min_reps, min(20, int(share / max(probe, 1e-7)) - 1))   # local: no collective inside
        medians.append(statistics.median(env.clock.times(fn, reps) + [probe]))
    return env.group.reduce(medians, "mean")


def bench_model_graphs(env: RankEnv, deadline: float) -> BenchResult:
    """Every compute node of real layer graphs (forward and backward), on this rank's real inputs.

    Pass 1 traces each graph of MODEL_GRAPHS, runs the interpreter once for this rank's inputs
    and times every compute node; while time is left, later passes time the graphs again and
    each node keeps its fastest pass: a burst of load from other processes inflates one pass,
    not the result (the ranks' own contention is in every pass)."""
    prepared: list[tuple[int, str, Any, list[Node], dict[str, Any]]] = []
    best: list[list[float]] = []
    notes: list[str] = []
    first_pass_end = time.time() + 0.6 * max(0.0, deadline - time.time())
    for i, (model, seq, attn, ffn, dispatch) in enumerate(MODEL_GRAPHS):
        (stop,) = env.group.agree(int(time.time() >= first_pass_end and i >= 1))
        if stop:
            break
        label = f"{model} s={seq} {attn}/{ffn}/{dispatch} n={env.n}"
        try:
            graph = _model_graph(env, model, seq, attn, ffn, dispatch)
        except ConfigError as err:              # this n cannot split that layer: skip it; anything else is a bug
            notes.append(f"{label}: {str(err).splitlines()[0]}")
            continue
        values = _graph_inputs(env, graph, model, seq)
        nodes = [nd for nd in graph.nodes if not nd.is_comm and nd.op is not OpKind.SPLIT]
        graph_deadline = time.time() + max(0.0, first_pass_end - time.time()) / (len(MODEL_GRAPHS) - i)
        medians = _time_nodes(env, graph, nodes, values, graph_deadline, 2)
        prepared.append((i, label, graph, nodes, values))
        best.append(medians)
        env.log(f"  model graph {label}: {len(nodes)} compute nodes, {sum(medians) * 1e3:.1f} ms")
    passes = 1
    while prepared and passes < 5:
        timed = 0
        for g, (i, label, graph, nodes, values) in enumerate(prepared):
            cost = 4 * sum(best[g])                     # warm-up, probe, two reps per node
            (go,) = env.group.agree(int(time.time() + cost < deadline))
            if not go:
                continue
            again = _time_nodes(env, graph, nodes, values, time.time() + cost, 2)
            best[g] = [min(a, b) for a, b in zip(best[g], again)]
            timed += 1
        if not timed:
            break
        passes += 1
    samples = [Sample("model_graphs", nd.op.value, sec, flops=nd.flops, mem_bytes=nd.mem_bytes,
                      label=f"{label}: {nd.name}", graph=label)
               for (i, label, _, nodes, _), medians in zip(prepared, best) for nd, sec in zip(nodes, medians)]
    left = len(MODEL_GRAPHS) - len(prepared) - len(notes)
    skipped = "; ".join(notes + ([f"{left} graphs not run (budget)"] if left else []))
    return BenchResult("model_graphs", tuple(samples),
                       f"{len(prepared)} layer graphs, {len(samples)} nodes, up to {passes} passes", 0.0, skipped)


# --- driver ------------------------------------------------------------------------------------

def run_benches(env: RankEnv, only: Sequence[str] | None = None) -> list[BenchResult]:
    """Run BENCHES in order within the budget. Results are identical in shape on every rank."""
    specs = [b for b in BENCHES if (only is None or b.name in only)
             and not (b.needs_comm and env.n < 2) and not (b.cpu_only and env.cuda)]
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


def machine_info(device: torch.device) -> MachineInfo:
    """Host name, CPU or GPU model, core count, torch version (GPU: SM count and memory)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info = MachineInfo(socket.gethostname(), cpu, os.cpu_count() or 1, torch.__version__)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info = dataclasses.replace(info, gpu=torch.cuda.get_device_name(device), sm_count=props.multi_processor_count,
                                   memory_bytes=int(props.total_memory))
    return info


def cpu_seconds() -> float:
    """User + system CPU seconds this process has used."""
    import resource
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def machine_busy_seconds() -> float | None:
    """CPU seconds all processes of the machine have used since boot (/proc/stat), or None.

    user + nice + system + steal (the hypervisor giving our cores to other guests slows us as
    much as a local job); interrupt time is left out: loopback TCP of our own collectives is
    accounted there, not to our processes."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        user, nice, system, _idle, _iowait, _irq, _softirq, steal = (int(x) for x in fields[:8])
        return (user + nice + system + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


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
