"""Fitting the cost model's shape and size curves to measurements (docs/cost_model.md, "Shapes").

One code path for published measurements (the registry's hardware.yaml values: ``PUBLISHED``
below, and the H200 shape sweep in benchmarks/data) and for ``moegraph calibrate``'s own:

    fit_gemm_shape(hw, samples)     gemm_eff / grouped_gemm_eff, gemm_tiles, gemm_wave_exponent,
                                    gemm_k_half: a small deterministic grid over the shape
                                    parameters; at each point the base efficiencies are the
                                    time-weighted ratio of the compute-bound samples (as calibrate
                                    fits its curves), and the point with the least mean
                                    |log(predicted / measured)| wins. Prices go through CostModel.
    fit_attention(points)           attention_eff, attention_seq_half from (s, TFLOP/s) points
    efficiency.fit_size_eff(points) a collective's eff_max and half_bytes

Notation: a GEMM sample (E, m, n, k, seconds): E groups of m/E rows, y[m, n] = x[m, k] @ w[n, k]^T.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from moegraph.cost import CostModel
from moegraph.efficiency import gemm_attrs
from moegraph.ir import Node, OpKind, Phase, freeze_attrs
from moegraph.registry import Hardware

__all__ = ["GemmSample", "read_shape_file", "gemm_node", "fit_gemm_shape", "fit_attention", "gemm_errors",
           "TILE_GRID", "GAMMA_GRID", "K_HALF_GRID", "PUBLISHED"]

# The tile set: cuBLAS's Hopper/Ampere tensor-core tiles (NVIDIA, "Matrix Multiplication
# Background User's Guide", §2.3: 256x128, 128x128, 64x128 ...); relative efficiencies fitted.
TILE_GRID = tuple(((128, 256, 1.0), (128, 128, r2), (64, 128, r3)) for r2 in (0.7, 0.85, 1.0) for r3 in (0.45, 0.6, 0.75))
GAMMA_GRID = (0.0, 0.1, 0.2, 0.3, 0.5, 1.0)
K_HALF_GRID = (0.0, 32.0, 64.0, 128.0, 256.0)
MIN_US = 35.0
"""Samples shorter than this are host-launch bound on the measuring machine (a 256^3 GEMM took
29 us through torch on the H200 host): left out of the fit and of its error."""

PUBLISHED: dict[str, tuple[tuple[float, float], ...]] = {
    # FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608) Fig 5, H100 SXM5 bf16 forward, causal,
    # head dim 128: (sequence length, TFLOP/s) as labelled on the bars.
    "fa3_causal_d128_h100": ((512, 292), (1024, 423), (2048, 521), (4096, 579), (8192, 602), (16384, 616)),
    # the same figure, head dims 64 and 256 (the panels whose 512-token bars are lowest)
    "fa3_causal_d64_h100": ((512, 164), (1024, 244)),
    "fa3_causal_d256_h100": ((512, 286), (1024, 427), (2048, 537), (4096, 612), (8192, 628), (16384, 642)),
    # MoNTA (Guo et al. 2024) Table 8 / Fig 13b: A800, 2 nodes x 8 over IB 200 Gb/s; all-to-all
    # efficiency by bytes sent per rank (1 M = 1e6 B; Table 8's latencies fix the unit)
    "monta_a2a_inter_a800": ((8e6 / 2, 0.427), (32e6 / 2, 0.633), (256e6 / 2, 0.741)),
    # MoNTA Table 8 / Fig 13a: 8-GPU intra-node all-gather (A800 NVLink), bytes sent = 7/8 of the volume
    "monta_ag_intra_a800": ((64e6 * 7 / 8, 0.726), (256e6 * 7 / 8, 0.776)),
}


@dataclass(frozen=True)
class GemmSample:
    groups: int
    m: int          # rows of all groups together
    n: int
    k: int
    seconds: float

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def read_shape_file(path: str | Path) -> tuple[list[GemmSample], list[tuple[int, int, float, float]]]:
    """(GEMM and grouped-GEMM samples, attention (d, s, fwd TFLOP/s, fwd+bwd TFLOP/s)) of a
    benchmarks/gpu_shapes.py output file."""
    gemms, attn = [], []
    for line in Path(path).read_text().splitlines():
        f = line.split()
        if not f or f[0].startswith("#"):
            continue
        if f[0] == "gemm":
            m, n, k, us = int(f[1]), int(f[2]), int(f[3]), float(f[4])
            gemms.append(GemmSample(1, m, n, k, us * 1e-6))
        elif f[0] == "ggemm" and f[1] != "err":
            e, rows, k, n, us = int(f[1]), int(f[2]), int(f[3]), int(f[4]), float(f[5])
            gemms.append(GemmSample(e, e * rows, n, k, us * 1e-6))
        elif f[0] == "attn":
            attn.append((int(f[1]), int(f[2]), float(f[5]), float(f[7])))
    return gemms, attn


def gemm_node(s: GemmSample) -> Node:
    """The IR node the cost model prices for a sample: operands read once, output written once."""
    op = OpKind.GROUPED_GEMM if s.groups > 1 else OpKind.GEMM
    mem = 2 * (s.m * s.k + s.groups * s.n * s.k + s.m * s.n)
    w = (s.groups, s.n, s.k) if s.groups > 1 else (s.n, s.k)
    return Node("sample", op, Phase.FORWARD, (), ("y",), flops=s.flops, mem_bytes=mem,
                attrs=freeze_attrs(gemm_attrs((s.m, s.k), w)))


def gemm_errors(hw: Hardware, samples: Iterable[GemmSample]) -> list[float]:
    """predicted / measured - 1 for every sample of at least MIN_US, priced by CostModel(hw)."""
    cost = CostModel(hw)
    return [cost.node_time_us(gemm_node(s)) / (s.seconds * 1e6) - 1 for s in samples if s.seconds * 1e6 >= MIN_US]


def _base_eff(cost: CostModel, samples: Sequence[GemmSample], field: str) -> float | None:
    """The scalar that makes the compute-bound samples' predicted total equal their measured one."""
    hw = cost.hw
    num = den = 0.0
    for s in samples:
        node = gemm_node(s)
        f = cost._shape(node, "grouped_gemm" if s.groups > 1 else "gemm")
        net = s.seconds - hw.kernel_latency_us * 1e-6
        if net <= 0 or s.seconds * 1e6 < MIN_US:
            continue
        if node.mem_bytes / (hw.hbm_bw_bytes_s * hw.mem_eff) >= s.flops / (hw.peak_flops_bf16 * f):
            continue                                                   # memory-bound at any efficiency <= 1
        num += s.flops / (hw.peak_flops_bf16 * f)
        den += net
    return None if den <= 0 else min(1.0, num / den)


def fit_gemm_shape(hw: Hardware, samples: Sequence[GemmSample]) -> dict[str, object]:
    """The shape fields (and base efficiencies) of ``hw`` that price ``samples`` best (module docstring)."""
    dense = [s for s in samples if s.groups == 1]
    grouped = [s for s in samples if s.groups > 1]
    best: tuple[float, dict[str, object]] | None = None
    for tiles, gamma, k_half in itertools.product(TILE_GRID, GAMMA_GRID, K_HALF_GRID):
        trial = dataclasses.replace(hw, gemm_tiles=tiles, gemm_wave_exponent=gamma, gemm_k_half=k_half, curves=())
        cost = CostModel(trial)
        fields: dict[str, object] = {"gemm_tiles": tiles, "gemm_wave_exponent": gamma, "gemm_k_half": k_half}
        for name, part in (("gemm_eff", dense), ("grouped_gemm_eff", grouped)):
            eff = _base_eff(cost, part, name) if part else None
            if eff is not None:
                fields[name] = round(eff, 4)
        trial = dataclasses.replace(trial, **{k: v for k, v in fields.items() if k.endswith("_eff")})
        errs = gemm_errors(trial, samples)
        loss = sum(abs(math.log1p(e)) for e in errs) / max(1, len(errs))
        if best is None or loss < best[0] - 1e-12:
            best = (loss, fields)
    assert best is not None
    return best[1]


def fit_attention(points: Sequence[tuple[float, float]], peak_flops: float) -> tuple[float, float]:
    """(attention_eff, attention_seq_half) of eff(s) = e s/(s + s_half) through (s, TFLOP/s) points:
    the size curve of ``efficiency.fit_size_eff`` with s for bytes."""
    from moegraph.efficiency import fit_size_eff
    return fit_size_eff((s, tf * 1e12 / peak_flops) for s, tf in points)
