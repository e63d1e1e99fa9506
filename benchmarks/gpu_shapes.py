"""GEMM, grouped-GEMM and attention throughput by shape on one GPU (the data behind the cost
model's shape curves, docs/cost_model.md "Shapes"). Needs only torch and a CUDA device.

    python3 benchmarks/gpu_shapes.py            > benchmarks/data/<gpu>-shapes-<date>.txt
    python3 benchmarks/gpu_shapes.py --heldout  > benchmarks/data/<gpu>-shapes-heldout-<date>.txt

Lines: ``gemm M N K us TFLOP/s`` (y[M, N] = x[M, K] @ w[K, N]), ``ggemm E m K N us TFLOP/s``
(torch._grouped_mm over E experts of m rows), ``attn d s H fwd_us fwd_TF fwdbwd_us fwdbwd_TF``
(causal SDPA, b = 1; FLOPs: the IR's causal count 2 s^2 H d forward, 3.5x that forward +
backward). Times: CUDA events over 10 calls after 3 warm-up calls. --heldout: 40 random shapes
(seed 7) and a GEMM beside a copy loop on a second stream. moegraph.cost_fit reads these files.
"""

from __future__ import annotations

import random
import sys

import torch
import torch.nn.functional as F

BF16 = torch.bfloat16


def timed_us(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def gemm(m: int, n: int, k: int) -> None:
    x, w = torch.randn(m, k, device="cuda", dtype=BF16), torch.randn(k, n, device="cuda", dtype=BF16)
    us = timed_us(lambda: x @ w)
    print("gemm", m, n, k, round(us, 2), round(2 * m * n * k / us / 1e6, 1))


def grid() -> None:
    shapes = [(m, 4096, 4096) for m in range(1024, 4353, 128)]                 # wave quantization sweep
    shapes += [(16384, n, 4096) for n in (64, 128, 256, 512, 1024, 1792, 2048, 3584)]
    shapes += [(16384, 4096, k) for k in (64, 128, 256, 512, 1024, 1792)]
    shapes += [(m, m, m) for m in (256, 512, 1024, 2048, 4096, 8192, 16384)]
    shapes += [(8192, 1792, 4096), (8192, 4096, 1792), (2048, 14336, 4096), (2048, 4096, 14336),
               (8192, 14336, 4096), (512, 14336, 4096), (16384, 6144, 4096), (16384, 4096, 512)]
    for s in shapes:
        gemm(*s)
    groups = [(e, m, 4096, 14336) for e in (2, 4, 8) for m in (64, 128, 256, 512, 1024, 2048, 4096)]
    groups += [(8, m, 2048, 1408) for m in (128, 512, 2048)] + [(4, m, 14336, 4096) for m in (256, 1024, 4096)]
    for e, m, k, n in groups:
        x = torch.randn(e * m, k, device="cuda", dtype=BF16)
        w = torch.randn(e, n, k, device="cuda", dtype=BF16).transpose(1, 2)
        offs = torch.arange(m, e * m + 1, m, device="cuda", dtype=torch.int32)
        us = timed_us(lambda: torch._grouped_mm(x, w, offs=offs))
        print("ggemm", e, m, k, n, round(us, 2), round(2 * e * m * n * k / us / 1e6, 1))
    for d in (64, 128, 256):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            h = 32 if d < 256 else 16
            q, k, v = (torch.randn(1, h, s, d, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
            g = torch.randn(1, h, s, d, device="cuda", dtype=BF16)
            flops = 2 * s * s * h * d
            fwd = timed_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            both = timed_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g))
            print("attn", d, s, h, round(fwd, 1), round(flops / fwd / 1e6, 1), round(both, 1),
                  round(3.5 * flops / both / 1e6, 1))


def heldout() -> None:
    random.seed(7)
    dims = [128, 384, 640, 1024, 1408, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 6400, 7168, 8192, 12288,
            14336, 16384, 18304]
    for _ in range(40):
        gemm(random.choice(dims), random.choice(dims), random.choice(dims))
    x, w = torch.randn(8192, 8192, device="cuda", dtype=BF16), torch.randn(8192, 8192, device="cuda", dtype=BF16)
    a = torch.empty(2**28, device="cuda", dtype=BF16)
    b = torch.empty_like(a)
    alone_g, alone_c = timed_us(lambda: x @ w), timed_us(lambda: b.copy_(a))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    for _ in range(2):
        with torch.cuda.stream(s1):
            ev[0].record()
            for _ in range(20):
                x @ w
            ev[1].record()
        with torch.cuda.stream(s2):
            ev[2].record()
            for _ in range(30):
                b.copy_(a)
            ev[3].record()
        torch.cuda.synchronize()
    print("interf gemm_alone", round(alone_g, 1), "copy_alone", round(alone_c, 1), "gemm_beside",
          round(ev[0].elapsed_time(ev[1]) * 1e3 / 20, 1), "copy_beside", round(ev[2].elapsed_time(ev[3]) * 1e3 / 30, 1))


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    heldout() if "--heldout" in sys.argv[1:] else grid()
