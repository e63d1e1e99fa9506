"""Fitting measurements to a hardware profile (docs/calibration.md).

Every number is chosen so that ``moegraph.cost.CostModel``,
evaluating its own formulas, reproduces the measurements:

    kernel_latency_us  kappa = median fixed cost of tiny nodes through run_compute
    peak_flops_bf16    P = best GEMM-class FLOP/s, flops / (t - kappa); holds the measured peak
                       of the profile's dtype (fp32 on CPU: see measured.notes, dtype=...)
    *_eff curves       per half-decade size bin: sum(flops) / (P * sum(t - kappa)), time-weighted,
                       each GEMM's time times its shape factor (moegraph.efficiency, from the
                       base profile's tiles and the device's SMs), which the cost model applies
                       on top of the curve: so the predicted total of the bin's kernels equals the measured total; a
                       bin holding nodes of real layer graphs uses only those; then the compute
                       curves and mem_eff are refined together (the cost model takes the max of
                       the FLOP and memory terms). The router is left out (see COMPUTE_CURVES).
    hbm_bw_bytes_s     W = best copy or memory-bound kernel bandwidth (reads + writes); mem_eff
                       by mem_bytes as above, from the streaming kernel ADD alone when measured
    mem_op_traffic     per other memory-bound op: its summed time in the bandwidth regime
                       (t >= 2 kappa) over the summed time mem_eff's curve gives its IR bytes
                       (fit_mem_traffic); then the curves are refined with the factors applied and
                       the factors fitted once more against the refined curve
    latencies, link    alpha = min over collectives of (t_smallest - kappa) / (steps (n-1));
                       B = the best size bin of any collective (link_peak) of comm_bytes /
                       (t - kappa - steps (n-1) alpha) over messages taking at least twice that
                       fixed part, so no such message's curve point exceeds 1 (smaller ones'
                       bins may, and are clamped to 1); curves by comm_bytes:
                       ring_eff (all-gather + reduce-scatter), a2a_eff (even + uneven; each also
                       sets its scalars *_intra = *_inter, one link measured: eff_max and
                       *_half_bytes of the size curve through the binned points, by
                       moegraph.efficiency.fit_size_eff, the registry's fit),
                       all_reduce_eff
    slowdown           compute runs x s slower beside a collective: sm_count = 100 and one
                       comm budget b = round(100 (1 - 1/s)) with saturation b, so
                       CostModel.compute_slowdown(b) = 100 / (100 - b) ~ s and collectives keep
                       full bandwidth ("effective held fraction" b/100 of the CPU); the
                       collective runs x c slower beside that compute: comm_overlap_stretch = c
"""


from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from moegraph.cost import interpolate, shaped_node
from moegraph.efficiency import fit_size_eff, gemm_shape, gemm_shape_factor
from moegraph.registry import Hardware
from moegraph.registry.fields import SOURCED_FIELDS, traffic_factor
from moegraph.runtime.calibrate.results import MEMORY_BOUND_OPS, BenchResult, MachineInfo, Sample
from moegraph.runtime.calibrate.options import CalibrationOptions
from moegraph.runtime.calibrate.profile_io import CalibrationFacts, Profile
from moegraph.runtime.netns import bucket_bytes

__all__ = ["fit_profile", "link_peak", "COMM_BIN_WIDTH", "binned_curve", "graph_first", "refine_compute_curves", "fit_mem_traffic", "self_check", "summarize_checks",
           "GraphCheck", "BenchCheck", "fit_bin", "gemm_factor", "COMPUTE_CURVES", "COMM_CURVES", "COMM_KINDS", "BIN_WIDTH"]

CPU_SHARES = 100            # sm_count of a CPU profile: compute "SMs" are percent of the cores
# The router is priced with gemm_eff, but runs softmax/top-k (forward) and a vjp (backward)
# around a skinny GEMM: 5-10x slower than a GEMM of its FLOPs. It is ~1% of a small-model step,
# so it is left out of the fit rather than dragging down every GEMM of its size.
COMPUTE_CURVES = {"gemm_eff": ("gemm",), "grouped_gemm_eff": ("grouped_gemm",), "attention_eff": ("attention",)}
BIN_WIDTH = 0.5             # log10 width of a compute / memory curve bin (half a decade)
# the streaming kernel that mem_eff's curve is fitted on: one kernel reading its two inputs and
# writing its output once, the bytes the IR counts; every other memory-bound op gets a traffic
# factor against it (Hardware.mem_op_traffic)
TRAFFIC_REFERENCE = "add"
COMM_CURVES = {"ring_eff": ("all_gather", "reduce_scatter"), "a2a_eff": ("all_to_all", "all_to_all_uneven"),
               "all_reduce_eff": ("all_reduce",)}
COMM_BIN_WIDTH = math.log10(4)   # log10 width of a collective curve bin: one bin per benchmarked size
COMM_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_to_all_uneven", "all_reduce")


def _by_bench(results: Iterable[BenchResult]) -> dict[str, list[Sample]]:
    return {r.name: list(r.samples) for r in results}


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def binned_curve(points: Sequence[tuple[float, float, bool]], rate: float, *, width: float = BIN_WIDTH,
                 eff_floor: float = 1e-4, caps: dict[int, float] | None = None) -> list[list[float]]:
    """points: (size, net seconds, from a real layer graph). One point per log10 bin of
    ``width``: eff = sum(size) / (rate * sum(net seconds)); a bin with graph points uses only
    those. Sizes strictly increase; eff is clamped to [eff_floor, caps.get(bin, 1)]."""
    bins: dict[int, list[tuple[float, float, bool]]] = defaultdict(list)
    for size, net, real in points:
        if size > 0:
            bins[round(math.log10(size) / width)].append((size, net, real))
    curve: list[list[float]] = []
    for key in sorted(bins):
        pts = bins[key]
        if any(real for _, _, real in pts):
            pts = [p for p in pts if p[2]]
        size = _sig(math.exp(statistics.fmean(math.log(s) for s, _, _ in pts)))
        net = sum(t for _, t, _ in pts)
        eff = 1.0 if net <= 0 else sum(s for s, _, _ in pts) / (rate * net)
        eff = _sig(min((caps or {}).get(key, 1.0), max(eff_floor, eff)))
        if curve and size <= curve[-1][0]:
            continue
        curve.append([size, eff])
    return curve


def graph_first(samples: Sequence[Any], size: Any, width: float = BIN_WIDTH) -> list[Any]:
    """Per log10 bin of ``width``: the samples from real layer graphs if the bin has any, else all."""
    bins: dict[int, list[Any]] = defaultdict(list)
    for s in samples:
        bins[round(math.log10(size(s)) / width)].append(s)
    out = []
    for pts in bins.values():
        real = [s for s in pts if s.bench == "model_graphs"]
        out += real or pts
    return out


def link_peak(points: Sequence[tuple[float, float]], width: float = COMM_BIN_WIDTH) -> float:
    """points: (bytes, net transfer seconds) of one collective's messages. The best bin's bandwidth,
    sum(bytes) / sum(seconds) per log10 bin of ``width`` as ``binned_curve`` bins them; 0 if none.

    The profile's link bandwidth B: every curve point is then <= 1 of it and none is clamped. A
    peak taken from the largest messages only (>= 1 MiB, as before 2026-11-23) lay below what
    256-768 KiB messages reach on the emulated 1 Gbit/s link (the token bucket's burst), so their
    points were clamped at 1 and the cost model priced the layers' collectives 3-9% long."""
    bins: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for size, net in points:
        if size > 0 and net > 0:
            bins[round(math.log10(size) / width)].append((size, net))
    return max((sum(b for b, _ in pts) / sum(t for _, t in pts) for pts in bins.values()), default=0.0)


def fit_mem_traffic(samples: Sequence[Any], curve: Sequence[Sequence[float]], bw: float,
                    kappa: float) -> dict[str, float]:
    """op[.role] -> traffic factor (Hardware.mem_op_traffic), per measured memory-bound op ("op",
    its roles pooled) and per role of it ("op.role": eager torch runs a backward as other kernels
    than its forward): the summed net time (t - kappa) of its samples over the summed time the
    mem_eff ``curve`` gives their IR bytes, within [0.1, 100]. Only samples whose bytes the
    reference kernel would take at least kappa / 4 to move count (the rest are latency-bound);
    the reference op is 1; "other", for the ops not measured, is the same quotient over every
    non-reference sample together (what one pooled curve charged them: no measurement says they
    stream like the reference). Empty when no non-reference op was measured."""
    points = tuple((float(x), float(e)) for x, e in curve)
    by_op: dict[str, list[Any]] = defaultdict(list)
    for s in samples:
        # bytes enough that the reference kernel would take a quarter of the fixed cost to move
        # them: a sort over a few routing ids (INDEX_MAP, 131 KB in 284 us on the H200) is not
        # bandwidth-bound, and no traffic factor describes it
        streams = s.mem_bytes / (bw * interpolate(points, s.mem_bytes)) >= kappa / 4
        if s.op != TRAFFIC_REFERENCE and s.mem_bytes > 0 and s.seconds > kappa and streams:
            by_op[s.op].append(s)

    def factor(ss: list[Any]) -> float:
        priced = sum(s.mem_bytes / (bw * interpolate(points, s.mem_bytes)) for s in ss)
        return _sig(min(100.0, max(0.1, sum(s.seconds - kappa for s in ss) / priced)))
    if not by_op:
        return {}
    out = {}
    for op, ss in sorted(by_op.items()):
        out[op] = factor(ss)
        roles: dict[str, list[Any]] = defaultdict(list)
        for smp in ss:
            roles[sample_role(smp)].append(smp)
        out |= {f"{op}.{role}": factor(rs) for role, rs in sorted(roles.items())}
    return out | {TRAFFIC_REFERENCE: 1.0, "other": factor([s for ss in by_op.values() for s in ss])}


def sample_role(s: Any) -> str:
    """A compute sample's role (a Role value; its stored shape attrs, forward when absent)."""
    return dict(s.shape).get("role", "forward")


def gemm_factor(s: Any, hw: Hardware) -> float:
    """The cost model's shape factor of a GEMM or grouped-GEMM sample on ``hw`` (its stored
    shape attrs); 1 for other ops and for a sample without ``mnk``."""
    if s.op not in ("gemm", "grouped_gemm"):
        return 1.0
    shape = gemm_shape(shaped_node("sample", s.op, s.shape, flops=s.flops, mem_bytes=s.mem_bytes))
    return 1.0 if shape is None else gemm_shape_factor(hw, shape)


def shape_caps(samples: Sequence[Any], hw: Hardware, width: float = BIN_WIDTH) -> dict[int, float]:
    """Per FLOP bin, the most a shape-divided curve point may be: 1 / the bin's smallest shape
    factor (>= 1), so no sample of the bin is priced above the peak; where the factor
    over-penalises a shape the point exceeds 1 and the product stays <= 1."""
    caps: dict[int, float] = {}
    for s in samples:
        key, q = round(math.log10(s.flops) / width), gemm_factor(s, hw)
        caps[key] = max(caps.get(key, 1.0), 1.0 / max(q, 1e-4))
    return caps


def refine_compute_curves(curves: dict[str, list[list[float]]], fitted: dict[str, list[Any]], peak: float,
                          bw: float, kappa: float, *, width: float = BIN_WIDTH, rounds: int = 60,
                          traffic: dict[str, float] | None = None, shape_hw: Hardware | None = None) -> None:
    """Adjust the compute and mem_eff curve points (in place) until, for every point, the cost
    model's predicted total over the samples of that point's bin equals their measured total.

    The cost model prices a compute node as kappa + max(flops / (P eff(flops)), mem_bytes /
    (W mem_eff(mem_bytes))) with efficiencies interpolated in log(size), so a node's price can
    come from the other curve, and its neighbours' points matter: a damped fixed-point
    iteration over every point handles both. A point is scaled by (predicted / measured) of
    the nodes whose binding term it prices; points stay within [1e-4, 1]. ``traffic``: op ->
    factor on the memory term (Hardware.mem_op_traffic), as the cost model applies it;
    ``shape_hw``: the profile whose GEMM shape factors multiply the curves (``gemm_factor``)."""
    import numpy as np
    rows = [(name, s) for name, ss in fitted.items() for s in ss]
    if not rows:
        return
    cls = np.array([name for name, _ in rows])
    flops = np.array([float(s.flops) for _, s in rows])
    shape = np.array([gemm_factor(s, shape_hw) if shape_hw is not None else 1.0 for _, s in rows])
    caps = {name: shape_caps(fitted[name], shape_hw, width) if shape_hw is not None and name in COMPUTE_CURVES
            else {} for name in curves}
    mem = np.array([float(s.mem_bytes) for _, s in rows])
    moved = mem * np.array([traffic_factor(traffic or {}, s.op, sample_role(s)) if name == "mem_eff" else 1.0
                            for name, s in rows])                                  # bytes the kernels move
    target = np.maximum(np.array([s.seconds for _, s in rows]) - kappa, 1e-9)
    key_f = np.round(np.log10(np.maximum(flops, 1.0)) / width)
    key_m = np.round(np.log10(np.maximum(mem, 1.0)) / width)

    def eff(curve: list[list[float]], size: np.ndarray) -> np.ndarray:
        xs = np.log([p[0] for p in curve])
        return np.interp(np.log(np.maximum(size, 1.0)), xs, [p[1] for p in curve])

    for _ in range(rounds):
        t_flop = np.zeros(len(rows))
        for name in COMPUTE_CURVES:
            m = cls == name
            if m.any() and name in curves:
                t_flop[m] = flops[m] / (peak * eff(curves[name], flops[m]) * shape[m])
        m = cls == "mem_eff"
        t_flop[m] = flops[m] / peak                                      # memory-bound ops: eff 1
        t_mem = moved / (bw * eff(curves["mem_eff"], mem)) if "mem_eff" in curves else np.zeros(len(rows))
        pred = np.maximum(t_flop, t_mem)
        for name, curve in curves.items():
            if name == "mem_eff":
                binds, keys = (t_mem >= t_flop) & (mem > 0), key_m
            elif name in COMPUTE_CURVES:
                binds, keys = (cls == name) & (t_flop > t_mem), key_f
            else:
                continue
            for point in curve:
                sel = binds & (keys == round(math.log10(point[0]) / width))
                if sel.any():
                    ratio = pred[sel].sum() / target[sel].sum()
                    cap = caps[name].get(round(math.log10(point[0]) / width), 1.0)
                    point[1] = min(cap, max(1e-4, point[1] * ratio ** 0.7))
    for curve in curves.values():
        for point in curve:
            point[1] = _sig(point[1])


def _overall(points: Sequence[tuple[float, float, bool]], rate: float) -> float:
    net = sum(t for _, t, _ in points)
    eff = 1.0 if net <= 0 else sum(s for s, _, _ in points) / (rate * net)
    return _sig(min(1.0, max(1e-4, eff)))


def fit_profile(results: Sequence[BenchResult], base: Hardware, opts: CalibrationOptions, info: MachineInfo,
                wall_s: float) -> Profile:
    """Measured samples -> a Profile: Hardware fields (plain types) that load_hardware accepts."""
    samples = _by_bench(results)
    prof = base.to_dict()
    prof["name"] = opts.output.stem
    curves: dict[str, list[list[float]]] = {}
    unmeasured: list[str] = []
    notes: list[str] = []
    cpu = opts.device == "cpu"

    # per-node fixed cost
    kernel = samples.get("kernel", [])
    if kernel:
        prof["kernel_latency_us"] = _sig(statistics.median(s.seconds for s in kernel) * 1e6)
    else:
        unmeasured.append("kernel_latency_us")
    kappa = prof["kernel_latency_us"] / 1e6

    # compute: peak and one curve per class; memory: bandwidth peak from copies, curve from
    # memory-bound kernels; then the curves are refined together (the cost model takes the max
    # of the FLOP and memory terms, so a compute node can be priced by mem_eff)
    graph = samples.get("model_graphs", [])
    compute = [s for name in ("gemm", "grouped_gemm", "attention") for s in samples.get(name, [])] + graph
    rates = [s.flops / (s.seconds - kappa) for s in compute
             if s.op in sum(COMPUTE_CURVES.values(), ()) and s.flops > 0 and s.seconds >= 10 * kappa]
    fitted: dict[str, list[Any]] = {}
    # the SMs a GPU profile gets (the device's, where it has more than the largest comm budget),
    # for the GEMM shape factors now and the profile's sm_count below
    sms = info.sm_count if not cpu and info.sm_count is not None and info.sm_count > max(base.comm_sm_budgets) \
        else base.sm_count
    shape_hw = dataclasses.replace(base, sm_count=sms)
    if rates:
        peak = max(rates)
        prof["peak_flops_bf16"] = _sig(peak)
        for curve, ops in COMPUTE_CURVES.items():
            chosen = graph_first([s for s in compute if s.op in ops and s.flops > 0], lambda s: s.flops)
            if chosen:
                pts = [(s.flops, (s.seconds - kappa) * gemm_factor(s, shape_hw), False) for s in chosen]
                curves[curve] = binned_curve(pts, peak, caps=shape_caps(chosen, shape_hw))
                prof[curve] = _overall(pts, peak)
                fitted[curve] = chosen
            else:
                unmeasured.append(curve)
    else:
        unmeasured += ["peak_flops_bf16", *COMPUTE_CURVES]

    memory = samples.get("memory", [])
    mem_ops = [s for s in memory + graph if s.op in MEMORY_BOUND_OPS and s.mem_bytes > 0]
    copies = [s.mem_bytes / s.seconds for s in memory if s.op == "copy" and s.mem_bytes >= 1 << 18]
    op_bw = [s.mem_bytes / (s.seconds - kappa) for s in mem_ops if s.seconds >= 5 * kappa]
    if copies or op_bw:
        bw = max(copies + op_bw)
        prof["hbm_bw_bytes_s"] = _sig(bw)
        dram = [s.mem_bytes / s.seconds for s in memory if s.op == "copy" and s.mem_bytes >= 1 << 26]
        notes.append(f"hbm_bw = best copy or memory-bound kernel bandwidth {bw / 1e9:.1f} GB/s (reads+writes, "
                     f"cache-resident)" + (f"; copies of >= 32 MiB buffers reach {max(dram) / 1e9:.1f} GB/s"
                                           if dram else ""))
    else:
        unmeasured.append("hbm_bw_bytes_s")
    reference: list[Any] = []
    if mem_ops:
        chosen = graph_first(mem_ops, lambda s: s.mem_bytes)
        # the curve from the streaming kernel alone where measured: one curve over ops whose
        # kernels move the IR's bytes once (ADD) and several times (eager RMSNorm) fits neither
        reference = [s for s in chosen if s.op == TRAFFIC_REFERENCE]
        pts = [(s.mem_bytes, s.seconds - kappa, False) for s in reference or chosen]
        curves["mem_eff"] = binned_curve(pts, prof["hbm_bw_bytes_s"])
        prof["mem_eff"] = _overall(pts, prof["hbm_bw_bytes_s"])
        fitted["mem_eff"] = chosen
    else:
        unmeasured.append("mem_eff")
    traffic: dict[str, float] = {}
    if reference:
        traffic = fit_mem_traffic(fitted["mem_eff"], curves["mem_eff"], prof["hbm_bw_bytes_s"], kappa)
    if fitted:
        refine_compute_curves(curves, fitted, prof["peak_flops_bf16"], prof["hbm_bw_bytes_s"], kappa, traffic=traffic,
                              shape_hw=shape_hw)
    if reference:
        traffic = fit_mem_traffic(fitted["mem_eff"], curves["mem_eff"], prof["hbm_bw_bytes_s"], kappa)
    prof["mem_op_traffic"] = traffic

    # collectives
    n = opts.n
    comm = {k: samples.get(k, []) for k in COMM_KINDS}
    if cpu and n > 1 and any(comm.values()):
        def steps(kind: str) -> int:
            return 2 if kind == "all_reduce" else 1
        alphas = [(min(ss, key=lambda s: s.comm_bytes).seconds - kappa) / (steps(k) * (n - 1))
                  for k, ss in comm.items() if ss]
        alpha = max(0.0, min(alphas))
        fixed = {k: kappa + steps(k) * (n - 1) * alpha for k in COMM_KINDS}
        # the link peak: the best size bin of any collective, over messages whose time is mostly
        # transfer (at least twice the fixed part: near it, noise in alpha would make the quotient
        # explode); a curve pools kinds per bin, so none of its points exceeds 1 of it
        bw = max((link_peak([(s.comm_bytes, s.seconds - fixed[k]) for s in ss if s.seconds >= 2 * fixed[k]])
                  for k, ss in comm.items()), default=0.0)
        if bw <= 0:
            # no message was mostly transfer: the best raw rate, latency included (an underestimate)
            bw = max(s.comm_bytes / s.seconds for ss in comm.values() for s in ss)
            notes.append(f"link bandwidth {bw / 1e9:.3g} GB/s is the best raw bytes/s of any collective, latency "
                         "included (no message spent at least twice the fixed part in transfer): an underestimate")
        prof.update(nvlink_bw_bytes_s=_sig(bw), nic_bw_bytes_s=_sig(bw), intra_node_latency_us=_sig(alpha * 1e6),
                    inter_node_latency_us=_sig(alpha * 1e6), copy_engine_latency_us=0.0,
                    gpus_per_node=max(base.gpus_per_node, n))
        notes.append("link = loopback TCP between ranks (nvlink_bw_bytes_s; nic_bw_bytes_s and the inter-node "
                     "latency copy it: one host)")
        for curve, kinds in COMM_CURVES.items():
            pts = [(s.comm_bytes, s.seconds - fixed[k], False) for k in kinds for s in comm[k]]
            if pts:
                curves[curve] = binned_curve(pts, bw, width=COMM_BIN_WIDTH)
                if curve != "all_reduce_eff":        # one link measured: it prices both scopes
                    # the size curve the GPU profiles use (moegraph.efficiency.size_eff), fitted by
                    # the same code as their published points; the binned curve still prices first
                    eff_max, half = fit_size_eff((b, e) for b, e in curves[curve])
                    prof[f"{curve}_intra"] = prof[f"{curve}_inter"] = _sig(eff_max)
                    half_key = curve.replace("_eff", "_half_bytes")
                    prof[f"{half_key}_intra"] = prof[f"{half_key}_inter"] = _sig(half)
            else:
                unmeasured.append(curve)
        missing = [k for k, ss in comm.items() if not ss]
        unmeasured += missing
        if opts.backend == "gloo":
            notes.append("reduce_scatter measured as the runtime runs it on gloo: all_to_all_single of the n "
                         "chunks + a local sum; all_to_all_uneven includes the split-size exchange")
    else:
        unmeasured += [*COMM_KINDS, "link_bandwidth", "collective_latency", *COMM_CURVES]

    # compute beside a running collective
    overlap = samples.get("overlap", [])
    if overlap:
        slow = statistics.fmean(s.overlap.compute_slowdown for s in overlap)
        stretch = statistics.fmean(s.overlap.comm_stretch for s in overlap)
        held = min(CPU_SHARES - 1, max(0, round(CPU_SHARES * (1 - 1 / slow))))
        prof["comm_overlap_stretch"] = round(min(10.0, max(1.0, stretch)), 3)
        if held >= 1:
            prof.update(sm_count=CPU_SHARES, comm_sm_budgets=[held], comm_sm_saturation=held,
                        a2a_sm_saturation=held)
        else:
            prof.update(sm_count=1, comm_sm_budgets=[0], comm_sm_saturation=1, a2a_sm_saturation=1)
        notes.append(f"overlap: compute runs x{slow:.2f} slower while a collective is in flight -> sm_count "
                     f"{prof['sm_count']}, comm budget {prof['comm_sm_budgets']} (effective held fraction "
                     f"{held / CPU_SHARES:.2f}: compute_slowdown = {prof['sm_count']}/({prof['sm_count']}-{held})); "
                     f"the collective itself runs x{stretch:.2f} slower beside compute -> comm_overlap_stretch "
                     f"{prof['comm_overlap_stretch']}")
    elif cpu:
        unmeasured.append("comm_compute_slowdown")
        prof.update(sm_count=1, comm_sm_budgets=[0], comm_sm_saturation=1, a2a_sm_saturation=1)
    else:
        unmeasured.append("comm_compute_slowdown")
        prof["sm_count"] = shape_hw.sm_count           # the device's (above), the base's if it has none
    if 0 in prof["comm_sm_budgets"] and cpu:
        prof["copy_engine_eff"] = prof["ring_eff_intra"]    # s(0) = copy_engine_eff / ring_eff = 1

    if cpu:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        prof["hbm_capacity_bytes"] = int(pages * page // max(1, n))
    elif info.memory_bytes is not None:
        prof["hbm_capacity_bytes"] = info.memory_bytes

    skipped = [f"{r.name} ({r.skipped})" for r in results if r.skipped]
    prof["curves"] = curves
    prof["link_bit_s"] = float(opts.link.rate_bit_s) if opts.link else 0.0     # never the base's
    prof["link_latency_us"] = opts.link.latency_us if opts.link else 0.0
    prof["link_burst_bytes"] = float(bucket_bytes(opts.link.rate_bit_s)) if opts.link else 0.0
    # the in-step stage fits these together (steps.py), never the base's: a base's factors were
    # fitted beside its own rates, and would misprice expert GEMMs without them
    prof["in_step_factors"] = {}
    prof["in_step_stream_bw_bytes_s"] = 0.0
    prof["accumulate_bw_bytes_s"] = 0.0
    prof.pop("measured", None)
    prof.pop("description", None)
    # the base's source lines stay for what this run did not measure; a measured field names this run
    measured_here = [*fitted, *(f"{c}_{scope}" for c in COMM_CURVES if c in curves and c != "all_reduce_eff"
                                for scope in ("intra", "inter"))] + (["comm_overlap_stretch"] if overlap else [])
    prof["sources"] = dict(prof.get("sources") or {}) | {
        f: f"measured by moegraph calibrate on {info.gpu or info.cpu} (this profile's measured block; "
           "docs/calibration.md)" for f in measured_here if f in SOURCED_FIELDS}
    facts = CalibrationFacts.of_run(opts, info, wall_s, unmeasured, skipped, notes)
    return Profile(prof, facts, _description(opts, info))


def _description(opts: CalibrationOptions, info: MachineInfo) -> str:
    if opts.device == "cpu":
        return (f"Calibrated by moegraph calibrate: {info.cpu} ({info.cores} cores), "
                f"{opts.n} ranks x {opts.threads} thread(s), {opts.dtype}, gloo over "
                f"{f'an emulated {opts.link} link' if opts.link else 'loopback'}; peak_flops_bf16 "
                f"holds the measured {opts.dtype} GEMM peak, hbm = DRAM/cache, nvlink = loopback TCP")
    return (f"Calibrated by moegraph calibrate: {info.gpu or 'GPU'}, {opts.dtype}; compute measured, "
            f"collectives from {opts.base} (unmeasured)")


def fit_bin(s: Sample) -> tuple[str, int] | None:
    """(curve, bin) a compute or memory-bound sample is fitted in; None for others (router, copy)."""
    curve = "mem_eff" if s.op in MEMORY_BOUND_OPS else next((c for c, ops in COMPUTE_CURVES.items() if s.op in ops),
                                                              None)
    size = s.mem_bytes if curve == "mem_eff" else s.flops
    return None if curve is None or size <= 0 else (curve, round(math.log10(size) / BIN_WIDTH))


@dataclass(frozen=True)
class GraphCheck:
    """One real layer graph: the summed compute time the fitted model predicts against the measured."""

    label: str
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1

    def line(self) -> str:
        return (f"{self.label}: compute {self.predicted_s * 1e3:.1f} ms predicted vs {self.measured_s * 1e3:.1f} ms "
                f"measured ({self.error:+.1%})")


@dataclass(frozen=True)
class BenchCheck:
    """One benchmark: the median |relative error| of single samples (None when none was checked);
    ``unfitted``: samples in bins that layer-graph nodes priced; ``not_ops``: samples of no IR op
    (plain copies), which no node prices (both counted, not checked)."""

    bench: str
    median_error: float | None
    cases: int
    unfitted: int = 0
    not_ops: int = 0

    def line(self) -> str:
        head = (f"median |error| {self.median_error:.0%} over {self.cases} cases" if self.median_error is not None
                else "no case checked")
        return (f"{self.bench}: {head}" + (f" (+{self.unfitted} priced from layer-graph nodes)" if self.unfitted else "")
                + (f" (+{self.not_ops} of no IR op, not checked)" if self.not_ops else ""))


def self_check(hw: Hardware, results: Sequence[BenchResult], n: int) -> list[GraphCheck | BenchCheck]:
    """The fitted cost model against the samples it was fitted on: per benchmark the median
    |error| of single nodes, per model graph the error of the summed compute time. Synthetic
    compute samples in a bin that layer-graph nodes priced (graph_first) were not fitted and
    are only counted."""
    from moegraph.cost import CostModel, shaped_node
    from moegraph.ir import Node, OpKind, Phase
    cost = CostModel(hw)
    benches: list[GraphCheck | BenchCheck] = []
    graphs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    graph_bins = {fit_bin(s) for r in results if r.name == "model_graphs" for s in r.samples} - {None}
    for res in results:
        errs, unfitted, not_ops = [], 0, 0
        for s in res.samples:
            if res.name != "model_graphs" and fit_bin(s) in graph_bins:
                unfitted += 1
                continue
            try:
                op = OpKind(s.op)
            except ValueError:
                not_ops += 1                                         # copy: no IR node prices it
                continue
            if op.is_comm:
                if res.name == "overlap":
                    continue
                node = Node("check", op, Phase.FORWARD, (), ("y",), comm_bytes=int(s.comm_bytes), group=n)
            else:
                # priced with the measured node's shape attributes (Sample.shape), as in a graph
                node = shaped_node("check", op, s.shape, flops=s.flops, mem_bytes=s.mem_bytes)
            pred = cost.node_time_us(node) / 1e6
            errs.append(abs(pred / s.seconds - 1))
            if res.name == "model_graphs":
                g = graphs[s.graph]
                g[0] += pred
                g[1] += s.seconds
        if (errs or not_ops) and res.name != "model_graphs":
            benches.append(BenchCheck(res.name, statistics.median(errs) if errs else None, len(errs), unfitted,
                                      not_ops))
    return [GraphCheck(label, p, m) for label, (p, m) in graphs.items()] + benches


def summarize_checks(checks: Sequence[GraphCheck | BenchCheck]) -> str:
    """One line: the range of the layer-graph total errors and each benchmark's median error."""
    totals = [c.error for c in checks if isinstance(c, GraphCheck)]
    parts = []
    if totals:
        parts.append(f"layer-graph compute totals {min(totals):+.0%}..{max(totals):+.0%} over {len(totals)} graphs")
    medians = [f"{c.bench} {c.median_error:.0%}" for c in checks
               if isinstance(c, BenchCheck) and c.median_error is not None]
    if medians:
        parts.append("median |error| per node: " + ", ".join(medians))
    unchecked = [f"{c.bench} {c.not_ops}" for c in checks if isinstance(c, BenchCheck) and c.not_ops]
    if unchecked:
        parts.append("samples of no IR op, not checked: " + ", ".join(unchecked))
    return "; ".join(parts)
