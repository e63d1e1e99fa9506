"""Compute benchmarks: the kernels (``moegraph.kernels.run_compute`` on IR nodes) by size: fixed
per-node cost, GEMM, grouped GEMM, attention and memory-bound kernels (``benchmarks``' regime).

Notation: M rows (tokens), K/N GEMM in/out features, R expert rows, El local experts,
S sequence on this rank, H/G query/kv heads on this rank, d head dim, n ranks.
"""

from __future__ import annotations

import statistics
import time

import torch

from moegraph.efficiency import attention_attrs, gemm_attrs
from moegraph.index_map import RecvMap
from moegraph.cost import shape_attrs
from moegraph.ir import OpKind, Role
from moegraph.kernels import run_compute
from moegraph.runtime.calibrate.harness import RankEnv, bench_node, compute_case, measure, sweep
from moegraph.runtime.calibrate.results import BenchResult, Sample


def bench_kernel(env: RankEnv, deadline: float) -> BenchResult:
    """Per-node fixed cost: tiny kernels through run_compute, host time per call back to back."""
    t, cases = env.rand, []
    cases.append(("gemm", bench_node(OpKind.GEMM, flops=2 * 8 * 8, **gemm_attrs((1, 1, 8), (8, 8))),
                  [t(1, 1, 8), t(8, 8)], [(1, 1, 8)]))
    cases.append(("add", bench_node(OpKind.ADD, flops=8), [t(1, 1, 8), t(1, 1, 8)], [(1, 1, 8)]))
    cases.append(("rmsnorm", bench_node(OpKind.RMSNORM, flops=32, eps=1e-5), [t(1, 1, 8), t(8)], [(1, 1, 8)]))
    cases.append(("swiglu", bench_node(OpKind.SWIGLU, flops=40), [t(1, 8), t(1, 8)], [(1, 8)]))
    cases.append(("gate", bench_node(OpKind.GATE, flops=8), [t(1, 8), t(1)], [(1, 8)]))
    samples = []
    for name, node, ins, shapes in cases:
        fn = lambda: run_compute(env.ctx, node, ins, shapes)  # noqa: E731
        for _ in range(20):
            fn()
        calls = 50
        per = [env.clock.host_loop(fn, calls) for _ in range(7)]
        sec = env.group.reduce([statistics.median(per)], "mean")[0]
        samples.append(Sample("kernel", node.op.value, sec, flops=node.flops, label=name,
                              shape=shape_attrs(dict(node.attrs), node.role)))
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
        node = bench_node(OpKind.GEMM, Role(role), flops=2 * m * k * n, **gemm_attrs(x.shape, w.shape))
        return compute_case(env, "gemm", node, ins, [out], f"{role} {m}x{k}x{n}", dl, left)

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
        node = bench_node(OpKind.GROUPED_GEMM, Role(role), flops=2 * r * k * n, **gemm_attrs(x.shape, w.shape))
        return compute_case(env, "grouped_gemm", node, ins, [out], f"{role} R={r} El={e} {k}x{n}", dl, left)

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
        attrs = attention_attrs(seq=s, head_dim=d) | {"causal": True}
        if role == "forward":
            node, ins = bench_node(OpKind.ATTENTION, flops=fwd_flops, **attrs), [q, k, v]
            outs = [(1, s, hl * d)]
        else:
            node = bench_node(OpKind.ATTENTION, Role.DGRAD, flops=fwd_flops * 5 // 2, **attrs)
            ins, outs = [q, k, v, env.rand(1, s, hl * d), env.rand(1, s, hl * d)], [q.shape, k.shape, v.shape]
        return compute_case(env, "attention", node, ins, [tuple(o) for o in outs],
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
            node, ins, outs = bench_node(OpKind.ADD, flops=m * h), [env.rand(1, m, h), env.rand(1, m, h)], [(1, m, h)]
        elif op == "rmsnorm":
            node = bench_node(OpKind.RMSNORM, flops=4 * m * h, eps=1e-5)
            ins, outs = [env.rand(1, m, h), env.rand(h)], [(1, m, h)]
        else:
            node, ins, outs = bench_node(OpKind.SWIGLU, flops=5 * m * f), [env.rand(m, f), env.rand(m, f)], [(m, f)]
        return compute_case(env, "memory", node, ins, outs, f"{op} {m} tokens", dl, left, max_reps=200)

    work = lambda c: 2 * c[1] if c[0] == "copy" else 3 * c[1] * max(h, f) * esize  # noqa: E731
    copy_deadline = time.time() + max(0.0, deadline - time.time()) / 3        # a third for copies
    samples, left = sweep(env, copies, run, copy_deadline, work, min_cases=2)
    more, left_ops = sweep(env, ops, run, deadline, work, min_cases=2)
    samples, left = samples + more, left + left_ops
    rates = [s.mem_bytes / s.seconds for s in samples if s.op == "copy"]
    best = max(rates) if rates else max(s.mem_bytes / s.seconds for s in samples)
    return BenchResult("memory", tuple(samples), f"{len(samples)} cases, best copy {best / 1e9:.1f} GB/s", 0.0,
                       f"{left} cases not run (budget)" if left else "")
