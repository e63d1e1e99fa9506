"""`moegraph calibrate`: measure this machine into a hardware profile the cost model reads.

    moegraph calibrate [--device cpu|cuda] [--backend gloo|nccl] [--n N] [--time-budget S]
                       [--base NAME] [--dtype fp32|bf16] [--samples FILE.json] [--quiet] -o PROFILE.yaml

CPU (default): N ranks are spawned on loopback gloo with max(1, cores // N) threads each,
exactly as ``moegraph.runtime.launch.spawn`` starts them, and run ``moegraph.runtime.microbench`` in lockstep.
CUDA: one process, single-GPU curves only (GEMM, grouped GEMM, attention, memory, kernel
latency, timed with CUDA events); collectives and the overlap slowdown need several GPUs and
keep the ``--base`` profile's values, listed as unmeasured. UNTESTED: no GPU was available
when this path was written.

Fitting (docs/calibration.md). Every number is chosen so that ``moegraph.cost.CostModel``,
evaluating its own formulas, reproduces the measurements:

    kernel_latency_us  kappa = median fixed cost of tiny nodes through run_compute
    peak_flops_bf16    P = best GEMM-class FLOP/s, flops / (t - kappa); holds the measured peak
                       of the profile's dtype (fp32 on CPU: see measured.notes, dtype=...)
    *_eff curves       per half-decade size bin: sum(flops) / (P * sum(t - kappa)), time-weighted,
                       so the predicted total of the bin's kernels equals the measured total; a
                       bin holding nodes of real layer graphs uses only those; then the compute
                       curves and mem_eff are refined together (the cost model takes the max of
                       the FLOP and memory terms). The router is left out (see COMPUTE_CURVES).
    hbm_bw_bytes_s     W = best copy or memory-bound kernel bandwidth (reads + writes); mem_eff
                       by mem_bytes as above
    latencies, link    alpha = min over collectives of (t_smallest - kappa) / (steps (n-1));
                       B = best comm_bytes / (t - kappa - steps (n-1) alpha) over messages of
                       >= 1 MiB taking at least twice that fixed part; curves by comm_bytes:
                       ring_eff (all-gather + reduce-scatter), a2a_eff (even + uneven),
                       all_reduce_eff
    slowdown           compute runs x s slower beside a collective: sm_count = 100 and one
                       comm budget b = round(100 (1 - 1/s)) with saturation b, so
                       CostModel.compute_slowdown(b) = 100 / (100 - b) ~ s and collectives keep
                       full bandwidth ("effective held fraction" b/100 of the CPU); the
                       collective runs x c slower beside that compute: comm_overlap_stretch = c
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from moegraph.cli import UsageError
from moegraph.registry import Hardware, load_hardware
from moegraph.runtime.netns import Link, add_link_args, emulated_link, link_from_args

__all__ = ["calibrate_command", "CalibrationOptions", "CalibrationError", "run_calibration", "fit_profile",
           "self_check", "measured_info", "parse_notes", "write_profile", "write_samples", "read_samples"]

STARTUP_HINT_S = 5.0        # spawning ranks and importing torch on a 2-core machine
RESERVE_S = 1.5             # kept back from the budget for teardown, fitting and writing
HARD_LIMIT_EXTRA_S = 120.0  # ranks still running this long after the budget are killed
CPU_SHARES = 100            # sm_count of a CPU profile: compute "SMs" are percent of the cores
MIN_BUDGET_S, MAX_BUDGET_S = 5.0, 3600.0
FOREIGN_LOAD_WARN = 0.15    # cores used by other processes during the run that make it suspect
MAX_RANKS = 64
MIN_IN_STEP_BUDGET_S = 90.0  # below it the microbenchmarks get the whole budget (no in-step stage)
# The router is priced with gemm_eff, but runs softmax/top-k (forward) and a vjp (backward)
# around a skinny GEMM: 5-10x slower than a GEMM of its FLOPs. It is ~1% of a small-model step,
# so it is left out of the fit rather than dragging down every GEMM of its size.
COMPUTE_CURVES = {"gemm_eff": ("gemm",), "grouped_gemm_eff": ("grouped_gemm",), "attention_eff": ("attention",)}
BIN_WIDTH = 0.5             # log10 width of a compute / memory curve bin (half a decade)
COMM_CURVES = {"ring_eff": ("all_gather", "reduce_scatter"), "a2a_eff": ("all_to_all", "all_to_all_uneven"),
               "all_reduce_eff": ("all_reduce",)}
COMM_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_to_all_uneven", "all_reduce")


class CalibrationError(RuntimeError):
    """A rank crashed or hung (a bug, not a user error): carries the rank's traceback."""


@dataclass(frozen=True)
class CalibrationOptions:
    device: str = "cpu"
    backend: str = "gloo"
    n: int = 2
    time_budget_s: float = 180.0
    base: str = "cpu-gloo"
    dtype: str = "fp32"
    output: Path = Path("profile.yaml")
    verbose: bool = True
    samples: Path | None = None
    link: Link | None = None          # the emulated link the ranks run on (--link); None: plain loopback

    @property
    def threads(self) -> int:
        """Threads per rank: what moegraph.runtime.launch.spawn gives each of n ranks."""
        return max(1, (os.cpu_count() or 1) // self.n) if self.device == "cpu" else 1


# --- command line ----------------------------------------------------------------------------

def calibrate_command(p: argparse.ArgumentParser):
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="what to calibrate (default cpu)")
    p.add_argument("--backend", default=None, choices=("gloo", "nccl"),
                   help="collective backend (default gloo on cpu, nccl on cuda)")
    p.add_argument("--n", type=int, default=2, help="ranks for the collective benchmarks (default %(default)s)")
    p.add_argument("--time-budget", type=float, default=180.0, metavar="S",
                   help="seconds for the whole calibration, startup included (default %(default)s)")
    p.add_argument("--base", default=None,
                   help="registry name or YAML path giving unmeasured fields (default cpu-gloo on cpu, h100 on cuda)")
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16"),
                   help="dtype of the kernels (default fp32 on cpu, bf16 on cuda)")
    p.add_argument("-o", "--output", required=True, metavar="PROFILE.yaml", help="where to write the profile")
    p.add_argument("--samples", default=None, metavar="FILE.json",
                   help="also write every raw sample (median seconds, sizes) as JSON, for inspection or refitting")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_link_args(p)
    return _handle


def _handle(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    with emulated_link(opts.link):                   # the ranks spawned inside talk over the emulated link
        profile, results, wall = run_calibration(opts)
    print(format_summary(profile, results, opts, wall))
    return 0


def options_from_args(args: argparse.Namespace) -> CalibrationOptions:
    """Validate the command line; every rejection is a one-line UsageError."""
    if not 1 <= args.n <= MAX_RANKS:
        raise UsageError(f"--n {args.n}: the number of ranks must be between 1 and {MAX_RANKS}")
    budget = args.time_budget
    if not (math.isfinite(budget) and MIN_BUDGET_S <= budget <= MAX_BUDGET_S):
        raise UsageError(f"--time-budget {budget:g}: must be between {MIN_BUDGET_S:g} and {MAX_BUDGET_S:g} s "
                         f"(starting the ranks alone takes about {STARTUP_HINT_S:g} s)")
    backend = args.backend or ("gloo" if args.device == "cpu" else "nccl")
    if args.device == "cpu" and backend != "gloo":
        raise UsageError(f"--backend {backend} needs --device cuda; CPU ranks talk over gloo")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise UsageError(f"--device cuda: CUDA is not available (torch {torch.__version__} sees no GPU); "
                             f"use --device cpu")
    output = Path(args.output)
    _check_writable(output)
    base = args.base or ("cpu-gloo" if args.device == "cpu" else "h100")
    load_hardware(base)                                    # an unknown or broken base fails now
    dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    samples = None
    if args.samples:
        samples = Path(args.samples)
        if samples.suffix != ".json":
            raise UsageError(f"--samples {samples}: expected a .json file")
        _check_writable(samples, suffixes=(".json",))
    link = link_from_args(args)
    if link is not None and backend != "gloo":
        raise UsageError(f"--link {link} shapes gloo's loopback sockets; it needs --device cpu")
    return CalibrationOptions(args.device, backend, args.n, float(budget), base, dtype, output, not args.quiet, samples,
                              link)


def _check_writable(path: Path, suffixes: tuple[str, ...] = (".yaml", ".yml")) -> None:
    flag = "-o" if ".yaml" in suffixes else "--samples"
    if path.suffix not in suffixes:
        raise UsageError(f"-o {path}: a profile is a .yaml or .yml file (load_hardware reads it by that suffix)")
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as err:
        raise UsageError(f"{flag} {path}: cannot write ({err.strerror})") from None
    if not existed:
        path.unlink()


# --- running the benchmarks --------------------------------------------------------------------

def run_calibration(opts: CalibrationOptions) -> tuple[dict[str, Any], list[Any], float]:
    """Measure, fit and write ``opts.output``; (profile dict, BenchResults, wall seconds)."""
    t0 = time.time()
    base = load_hardware(opts.base)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if opts.verbose:
        what = (f"{opts.n} rank(s) on {opts.backend}, {opts.threads} thread(s) each" if opts.device == "cpu"
                else "one GPU")
        print(f"calibrate [{0.0:6.1f}s] {opts.device} {opts.dtype}, {what}, budget {opts.time_budget_s:g} s, "
              f"base {base.name}", file=sys.stderr, flush=True)
    if opts.device == "cpu":
        results, info = _run_cpu(opts, t0)
    else:
        results, info = _run_cuda(opts, t0)
    wall = time.time() - t0
    info["load_avg_1m"] = f"{load:.2f}"
    profile = fit_profile(results, base, opts, info, wall)
    hw = load_hardware_dict(profile, str(opts.output))
    checks = self_check(hw, results, opts.n)            # the isolated regime the curves describe
    profile["measured"]["notes"] += "; self-check: " + summarize_checks(checks)
    checks += _in_step_stage(profile, hw, opts, t0)
    write_profile(opts.output, profile, results, checks)
    if opts.samples is not None:
        write_samples(opts.samples, results, opts, info)
    if opts.verbose:
        for line in checks:
            print(f"calibrate [{time.time() - t0:6.1f}s] self-check {line}", file=sys.stderr, flush=True)
    return profile, results, time.time() - t0


def in_step_enabled(opts: CalibrationOptions) -> bool:
    """Whether the in-step stage (moegraph.runtime.calibrate_steps) runs: CPU ranks, n >= 2 (it times
    real collectives), and a budget that leaves the microbenchmarks enough time."""
    return opts.device == "cpu" and opts.n >= 2 and opts.time_budget_s >= MIN_IN_STEP_BUDGET_S


def _in_step_stage(profile: dict[str, Any], hw: Hardware, opts: CalibrationOptions, t0: float) -> list[str]:
    """Measure real steps, store the in-step factors in ``profile``; return the check lines."""
    from moegraph.runtime.calibrate_steps import fit_in_step, in_step_checks, measure_steps
    notes = profile["measured"]
    if not in_step_enabled(opts):
        why = "CUDA: not implemented" if opts.device != "cpu" else (
            "n=1 times no collective" if opts.n < 2 else f"--time-budget < {MIN_IN_STEP_BUDGET_S:g} s")
        notes["notes"] += f"; in_step=skipped ({why})"
        return []
    t = time.time()

    def log(msg: str) -> None:
        if opts.verbose:
            print(f"calibrate [{time.time() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)
    samples = measure_steps(hw, opts.n, deadline=t0 + opts.time_budget_s - RESERVE_S, log=log)
    if not samples:
        notes["notes"] += "; in_step=skipped (out of time)"
        return []
    factors = fit_in_step(hw, samples)
    profile["in_step_factors"] = factors
    profile["step_noise"] = round(statistics.median(s.noise for s in samples), 4)
    fitted = load_hardware_dict(profile, str(opts.output))
    lines = in_step_checks(fitted, samples)
    text = ", ".join(f"{c} x{f:.2f}" for c, f in factors.items())
    notes["notes"] += (f"; in_step=[{text}] from {len(samples)} layer(s) in {time.time() - t:.0f}s; step_noise "
                       f"{profile['step_noise']} (median over layers of the steps' relative MAD)")
    log(f"in-step factors {text}")
    return lines


def _run_cpu(opts: CalibrationOptions, t0: float) -> tuple[list[Any], dict[str, str]]:
    import queue as queue_mod

    import torch
    import torch.multiprocessing as mp

    from moegraph.runtime.launch import free_port, release_freed_memory
    from moegraph.runtime.microbench import cpu_seconds, machine_busy_seconds, machine_info, rank_main
    deadline = t0 + opts.time_budget_s - RESERVE_S
    if in_step_enabled(opts):
        from moegraph.runtime.calibrate_steps import STEP_STAGE_S
        deadline -= STEP_STAGE_S                                   # left for the in-step stage
    busy0, own0, wall0 = machine_busy_seconds(), cpu_seconds(), time.time()
    rank_cpu = 0.0
    spec = {"threads": opts.threads, "backend": opts.backend, "dtype": opts.dtype, "t0": t0, "deadline": deadline,
            "pg_timeout_s": max(60.0, opts.time_budget_s), "verbose": opts.verbose}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    release_freed_memory()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, opts.n, port, spec, q), daemon=True,
                         name=f"moegraph-calibrate{r}") for r in range(opts.n)]
    for p in procs:
        p.start()
    results, got = None, set()
    hard = t0 + opts.time_budget_s + HARD_LIMIT_EXTRA_S
    try:
        while len(got) < opts.n:
            try:
                kind, rank, payload = q.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    raise CalibrationError(f"calibration rank {dead[0]} exited with code "
                                           f"{procs[dead[0]].exitcode} before reporting") from None
                if time.time() > hard:
                    raise CalibrationError(f"calibration ranks did not finish within {opts.time_budget_s:g} s "
                                           f"+ {HARD_LIMIT_EXTRA_S:g} s") from None
                continue
            if kind == "error":
                raise CalibrationError(f"calibration rank {rank} failed:\n{payload}")
            got.add(rank)
            rank_results, used = payload
            rank_cpu += used
            if rank == 0:
                results = rank_results
        busy1, own1, wall1 = machine_busy_seconds(), cpu_seconds(), time.time()
    finally:
        # Every rank has reported (or one failed): tearing down gloo and torch takes seconds on a
        # busy machine and measures nothing, so ranks still exiting after a short grace are ended.
        grace = time.time() + 1.0
        for p in procs:
            p.join(timeout=max(0.0, grace - time.time()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    info = machine_info(torch.device("cpu"))
    if busy0 is not None and busy1 is not None:
        # CPU the rest of the machine used meanwhile: other users' jobs slow every benchmark
        foreign = max(0.0, (busy1 - busy0) - (own1 - own0) - rank_cpu) / max(1e-9, wall1 - wall0)
        info["foreign_load"] = f"{foreign:.2f}"
        if foreign > FOREIGN_LOAD_WARN and opts.verbose:
            print(f"calibrate: warning: other processes used {foreign:.2f} of {os.cpu_count()} cores on average "
                  f"during the measurements; the profile is pessimistic (calibrate again on a quiet machine)",
                  file=sys.stderr, flush=True)
    return results, info


def _run_cuda(opts: CalibrationOptions, t0: float) -> tuple[list[Any], dict[str, str]]:
    """UNTESTED (no GPU here): single-GPU benchmarks in this process, timed with CUDA events."""
    import torch

    from moegraph.runtime.microbench import Clock, Lockstep, RankEnv, machine_info, run_benches
    device = torch.device("cuda", torch.cuda.current_device())
    env = RankEnv(0, 1, device, opts.dtype, opts.backend, t0, t0 + opts.time_budget_s - RESERVE_S,
                  Lockstep(0, 1), Clock(device), verbose=opts.verbose)
    results = run_benches(env)
    info = machine_info(device)
    props = torch.cuda.get_device_properties(device)
    info["sm_count"] = str(props.multi_processor_count)
    info["memory"] = str(props.total_memory)
    return results, info


# --- fitting -----------------------------------------------------------------------------------

def _by_bench(results: Iterable[Any]) -> dict[str, list[Any]]:
    return {r.name: list(r.samples) for r in results}


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def binned_curve(points: Sequence[tuple[float, float, bool]], rate: float, *, width: float = BIN_WIDTH,
                 eff_floor: float = 1e-4) -> list[list[float]]:
    """points: (size, net seconds, from a real layer graph). One point per log10 bin of
    ``width``: eff = sum(size) / (rate * sum(net seconds)); a bin with graph points uses only
    those. Sizes strictly increase; eff is clamped to [eff_floor, 1]."""
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
        eff = _sig(min(1.0, max(eff_floor, eff)))
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


def refine_compute_curves(curves: dict[str, list[list[float]]], fitted: dict[str, list[Any]], peak: float,
                          bw: float, kappa: float, *, width: float = BIN_WIDTH, rounds: int = 60) -> None:
    """Adjust the compute and mem_eff curve points (in place) until, for every point, the cost
    model's predicted total over the samples of that point's bin equals their measured total.

    The cost model prices a compute node as kappa + max(flops / (P eff(flops)), mem_bytes /
    (W mem_eff(mem_bytes))) with efficiencies interpolated in log(size), so a node's price can
    come from the other curve, and its neighbours' points matter: a damped fixed-point
    iteration over every point handles both. A point is scaled by (predicted / measured) of
    the nodes whose binding term it prices; points stay within [1e-4, 1]."""
    import numpy as np
    rows = [(name, s) for name, ss in fitted.items() for s in ss]
    if not rows:
        return
    cls = np.array([name for name, _ in rows])
    flops = np.array([float(s.flops) for _, s in rows])
    mem = np.array([float(s.mem_bytes) for _, s in rows])
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
                t_flop[m] = flops[m] / (peak * eff(curves[name], flops[m]))
        m = cls == "mem_eff"
        t_flop[m] = flops[m] / peak                                      # memory-bound ops: eff 1
        t_mem = mem / (bw * eff(curves["mem_eff"], mem)) if "mem_eff" in curves else np.zeros(len(rows))
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
                    point[1] = min(1.0, max(1e-4, point[1] * ratio ** 0.7))
    for curve in curves.values():
        for point in curve:
            point[1] = _sig(point[1])


def _overall(points: Sequence[tuple[float, float, bool]], rate: float) -> float:
    net = sum(t for _, t, _ in points)
    eff = 1.0 if net <= 0 else sum(s for s, _, _ in points) / (rate * net)
    return _sig(min(1.0, max(1e-4, eff)))


def fit_profile(results: Sequence[Any], base: Hardware, opts: CalibrationOptions, info: dict[str, str],
                wall_s: float) -> dict[str, Any]:
    """Measured samples -> a Hardware mapping (plain types) that load_hardware accepts."""
    from moegraph.runtime.microbench import MEMORY_BOUND_OPS
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
    if rates:
        peak = max(rates)
        prof["peak_flops_bf16"] = _sig(peak)
        for curve, ops in COMPUTE_CURVES.items():
            chosen = graph_first([s for s in compute if s.op in ops and s.flops > 0], lambda s: s.flops)
            if chosen:
                pts = [(s.flops, s.seconds - kappa, False) for s in chosen]
                curves[curve] = binned_curve(pts, peak)
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
    if mem_ops:
        chosen = graph_first(mem_ops, lambda s: s.mem_bytes)
        pts = [(s.mem_bytes, s.seconds - kappa, False) for s in chosen]
        curves["mem_eff"] = binned_curve(pts, prof["hbm_bw_bytes_s"])
        prof["mem_eff"] = _overall(pts, prof["hbm_bw_bytes_s"])
        fitted["mem_eff"] = chosen
    else:
        unmeasured.append("mem_eff")
    if fitted:
        refine_compute_curves(curves, fitted, prof["peak_flops_bf16"], prof["hbm_bw_bytes_s"], kappa)

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
        # the link peak from messages whose time is mostly transfer (at least twice the fixed part),
        # large ones first: near the fixed part, noise in alpha would make the quotient explode
        big = [(k, s) for k, ss in comm.items() for s in ss if s.seconds >= 2 * fixed[k]]
        link = ([s.comm_bytes / (s.seconds - fixed[k]) for k, s in big if s.comm_bytes >= 1 << 20]
                or [s.comm_bytes / (s.seconds - fixed[k]) for k, s in big])
        bw = max(link) if link else max(s.comm_bytes / s.seconds for ss in comm.values() for s in ss)
        prof.update(nvlink_bw_bytes_s=_sig(bw), nic_bw_bytes_s=_sig(bw), intra_node_latency_us=_sig(alpha * 1e6),
                    inter_node_latency_us=_sig(alpha * 1e6), copy_engine_latency_us=0.0,
                    gpus_per_node=max(base.gpus_per_node, n))
        notes.append("link = loopback TCP between ranks (nvlink_bw_bytes_s; nic_bw_bytes_s and the inter-node "
                     "latency copy it: one host)")
        for curve, kinds in COMM_CURVES.items():
            pts = [(s.comm_bytes, s.seconds - fixed[k], False) for k in kinds for s in comm[k]]
            if pts:
                curves[curve] = binned_curve(pts, bw, width=math.log10(4))
                if curve != "all_reduce_eff":
                    prof[curve] = _overall(pts, bw)
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
        slow = statistics.fmean(s.get("compute_slowdown") for s in overlap)
        stretch = statistics.fmean(s.get("comm_stretch") for s in overlap)
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
        if "sm_count" in info and int(info["sm_count"]) > max(base.comm_sm_budgets):
            prof["sm_count"] = int(info["sm_count"])
    if 0 in prof["comm_sm_budgets"] and cpu:
        prof["copy_engine_eff"] = prof["ring_eff"]          # s(0) = copy_engine_eff / ring_eff = 1

    if cpu:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        prof["hbm_capacity_bytes"] = int(pages * page // max(1, n))
    elif "memory" in info:
        prof["hbm_capacity_bytes"] = int(info["memory"])

    skipped = [f"{r.name} ({r.skipped})" for r in results if r.skipped]
    prof["link_bit_s"] = float(opts.link.rate_bit_s) if opts.link else 0.0     # never the base's
    prof["link_latency_us"] = opts.link.latency_us if opts.link else 0.0
    prof["description"] = _description(opts, info)
    prof["curves"] = curves
    prof["measured"] = measured_info(opts, info, wall_s, unmeasured, skipped, notes)
    return prof


def _description(opts: CalibrationOptions, info: dict[str, str]) -> str:
    if opts.device == "cpu":
        return (f"Calibrated by moegraph calibrate: {info.get('cpu', '?')} ({info.get('cores', '?')} cores), "
                f"{opts.n} ranks x {opts.threads} thread(s), {opts.dtype}, gloo over "
                f"{f'an emulated {opts.link} link' if opts.link else 'loopback'}; peak_flops_bf16 "
                f"holds the measured {opts.dtype} GEMM peak, hbm = DRAM/cache, nvlink = loopback TCP")
    return (f"Calibrated by moegraph calibrate: {info.get('gpu', 'GPU')}, {opts.dtype}; compute measured, "
            f"collectives from {opts.base} (unmeasured)")


def measured_info(opts: CalibrationOptions, info: dict[str, str], wall_s: float, unmeasured: Sequence[str],
                  skipped: Sequence[str], notes: Sequence[str]) -> dict[str, str]:
    """The ``measured`` mapping. Its schema has three text keys (date, machine, notes); the
    structured facts go into notes as ``key=value`` items separated by "; " (parse_notes)."""
    machine = f"{info.get('host', '?')}: {info.get('gpu') or info.get('cpu', '?')}, {info.get('cores', '?')} cores"
    facts = [f"dtype={opts.dtype} (peak_flops_bf16 holds the measured {opts.dtype} peak)",
             f"device={opts.device}", f"backend={opts.backend}", f"n={opts.n}", f"threads_per_rank={opts.threads}",
             f"torch={info.get('torch', '?')}", f"host={info.get('host', '?')}", f"cpu={info.get('cpu', '?')}",
             f"time_budget_s={opts.time_budget_s:g}", f"wall_s={wall_s:.1f}",
             f"load_avg_1m_before={info.get('load_avg_1m', '?')}",
             f"foreign_load_cores={info.get('foreign_load', '?')}",
             f"unmeasured=[{', '.join(unmeasured)}]", f"skipped=[{', '.join(skipped)}]"]
    now = datetime.datetime.now().astimezone()
    return {"date": now.date().isoformat(), "machine": machine,
            "notes": "; ".join(facts + [f"time={now.isoformat(timespec='seconds')}"] + list(notes))}


def parse_notes(hw: Hardware) -> dict[str, str]:
    """The ``key=value`` facts of a calibrated profile's measured.notes (dtype, n, backend, ...)."""
    out = {}
    for item in dict(hw.measured).get("notes", "").split("; "):
        key, sep, value = item.partition("=")
        if sep and key.isidentifier():
            out[key] = value
    return out


def load_hardware_dict(profile: dict[str, Any], where: str) -> Hardware:
    """Validate a fitted profile exactly as load_hardware will (same checks, same errors)."""
    data = {k: v for k, v in profile.items() if k != "name"}
    return Hardware(name=profile["name"], **data)


# --- self-check --------------------------------------------------------------------------------

def fit_bin(s: Any) -> tuple[str, int] | None:
    """(curve, bin) a compute or memory-bound sample is fitted in; None for others (router, copy)."""
    from moegraph.runtime.microbench import MEMORY_BOUND_OPS
    curve = "mem_eff" if s.op in MEMORY_BOUND_OPS else next((c for c, ops in COMPUTE_CURVES.items() if s.op in ops),
                                                              None)
    size = s.mem_bytes if curve == "mem_eff" else s.flops
    return None if curve is None or size <= 0 else (curve, round(math.log10(size) / BIN_WIDTH))


def self_check(hw: Hardware, results: Sequence[Any], n: int) -> list[str]:
    """The fitted cost model against the samples it was fitted on: per benchmark the median
    |error| of single nodes, per model graph the error of the summed compute time. Synthetic
    compute samples in a bin that layer-graph nodes priced (graph_first) were not fitted and
    are only counted."""
    from moegraph.cost import CostModel
    from moegraph.ir import Node, OpKind, Phase
    cost = CostModel(hw)
    lines = []
    graphs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    graph_bins = {fit_bin(s) for r in results if r.name == "model_graphs" for s in r.samples} - {None}
    for res in results:
        errs, unfitted = [], 0
        for s in res.samples:
            if res.name != "model_graphs" and fit_bin(s) in graph_bins:
                unfitted += 1
                continue
            try:
                op = OpKind(s.op)
            except ValueError:
                continue                                             # copy, overlap: not IR nodes
            if op.is_comm:
                if res.name == "overlap":
                    continue
                node = Node("check", op, Phase.FORWARD, (), ("y",), comm_bytes=int(s.comm_bytes), group=n)
            else:
                node = Node("check", op, Phase.FORWARD, (), ("y",), flops=int(s.flops), mem_bytes=int(s.mem_bytes))
            pred = cost.node_time_us(node) / 1e6
            errs.append(abs(pred / s.seconds - 1))
            if res.name == "model_graphs":
                g = graphs[s.label.split(":")[0]]
                g[0] += pred
                g[1] += s.seconds
        if errs and res.name != "model_graphs":
            lines.append(f"{res.name}: median |error| {statistics.median(errs):.0%} over {len(errs)} cases"
                         + (f" (+{unfitted} priced from layer-graph nodes)" if unfitted else ""))
    graph_lines = [f"{label}: compute {p * 1e3:.1f} ms predicted vs {m * 1e3:.1f} ms measured ({p / m - 1:+.1%})"
                   for label, (p, m) in graphs.items()]
    return graph_lines + lines


def summarize_checks(checks: Sequence[str]) -> str:
    """One line: the range of the layer-graph total errors and each benchmark's median error."""
    totals = [float(m.group(1)) for c in checks if (m := re.search(r"measured \(([-+]\d+\.\d)%\)$", c))]
    parts = []
    if totals:
        parts.append(f"layer-graph compute totals {min(totals):+.0f}%..{max(totals):+.0f}% over {len(totals)} graphs")
    medians = [f"{m.group(1)} {m.group(2)}" for c in checks
               if (m := re.match(r"(\w+): median \|error\| (\d+%)", c))]
    if medians:
        parts.append("median |error| per node: " + ", ".join(medians))
    return "; ".join(parts)


# --- output ------------------------------------------------------------------------------------

def write_profile(path: Path, profile: dict[str, Any], results: Sequence[Any], checks: Sequence[str]) -> None:
    head = [f"# Hardware profile written by `moegraph calibrate` on {profile['measured']['date']}.",
            f"# {profile['description']}",
            "# Load it with moegraph.registry.load_hardware(path) or --hardware PATH. Fields:",
            "# moegraph.registry.Hardware; how each number is fitted: docs/calibration.md. Benchmarks:"]
    head += [f"#   {r.name:<18} {r.seconds:5.1f}s  {r.summary}" + (f" [{r.skipped}]" if r.skipped else "")
             for r in results]
    head += ["# Self-check (cost model vs the measurements it was fitted on):"] + [f"#   {c}" for c in checks]
    body = yaml.dump(_flow_pairs(profile), Dumper=_ProfileDumper, sort_keys=False, default_flow_style=False,
                     width=100, allow_unicode=False)
    path.write_text("\n".join(head) + "\n" + body)


class _FlowList(list):
    """A short list written on one line: [size, eff] points, SM budgets."""


class _ProfileDumper(yaml.SafeDumper):
    pass


_ProfileDumper.add_representer(
    _FlowList, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))


def _flow_pairs(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _flow_pairs(x) for k, x in v.items()}
    if isinstance(v, list):
        if all(isinstance(x, (int, float)) for x in v):
            return _FlowList(v)
        return [_flow_pairs(x) for x in v]
    return v


def write_samples(path: Path, results: Sequence[Any], opts: CalibrationOptions, info: dict[str, str]) -> None:
    """Every raw sample as JSON: {"options": ..., "machine": ..., "benchmarks": [{name, summary,
    seconds, skipped, samples: [{bench, op, seconds, flops, mem_bytes, comm_bytes, label, extra}]}]}."""
    import dataclasses
    import json
    doc = {"options": {k: str(v) for k, v in dataclasses.asdict(opts).items()}, "machine": info,
           "benchmarks": [{"name": r.name, "summary": r.summary, "seconds": r.seconds, "skipped": r.skipped,
                           "samples": [dataclasses.asdict(s) for s in r.samples]} for r in results]}
    path.write_text(json.dumps(doc, indent=1))


def read_samples(path: Path) -> list[Any]:
    """The BenchResults of a --samples file (to refit without measuring again)."""
    import json

    from moegraph.runtime.microbench import BenchResult, Sample
    doc = json.loads(Path(path).read_text())
    return [BenchResult(b["name"], tuple(Sample(**{**s, "extra": tuple(tuple(e) for e in s["extra"])})
                                          for s in b["samples"]), b["summary"], b["seconds"], b["skipped"])
            for b in doc["benchmarks"]]


def format_summary(profile: dict[str, Any], results: Sequence[Any], opts: CalibrationOptions, wall: float) -> str:
    p = profile
    rows = [("peak (GEMM, " + opts.dtype + ")", f"{p['peak_flops_bf16'] / 1e9:.1f} GFLOP/s"),
            ("memory bandwidth", f"{p['hbm_bw_bytes_s'] / 1e9:.1f} GB/s"),
            ("kernel latency", f"{p['kernel_latency_us']:.1f} us"),
            ("link bandwidth", f"{p['nvlink_bw_bytes_s'] / 1e9:.2f} GB/s"),
            ("collective step latency", f"{p['intra_node_latency_us']:.0f} us"),
            ("comm SM budget / sm_count", f"{p['comm_sm_budgets']} / {p['sm_count']}")]
    facts = parse_notes(Hardware(name=p["name"], **{k: v for k, v in p.items() if k != "name"}))
    rows.append(("other processes (cores)", facts.get("foreign_load_cores", "?")))
    out = [f"wrote {opts.output} ({wall:.1f} s)"] + [f"  {k:<26} {v}" for k, v in rows]
    skipped = [r.name for r in results if r.skipped]
    if skipped:
        out.append(f"  partly or not measured: {', '.join(skipped)}")
    return "\n".join(out)
