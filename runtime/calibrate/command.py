"""`moegraph calibrate`: measure this machine into a hardware profile the cost model reads.

    moegraph calibrate [--device cpu|cuda] [--backend gloo|nccl] [--n N] [--time-budget S]
                       [--base NAME] [--dtype fp32|bf16] [--samples FILE.json] [--quiet] [--json]
                       -o PROFILE.yaml

CPU (default): N ranks are started by ``moegraph.runtime.launch.spawn`` on loopback gloo with
max(1, cores // N) threads each, exactly as runtime ranks, and run ``moegraph.runtime.calibrate.benchmarks`` in lockstep.
CUDA: one process, single-GPU curves only (GEMM, grouped GEMM, attention, memory, kernel
latency, timed with CUDA events); collectives and the overlap slowdown need several GPUs and
keep the ``--base`` profile's values, listed as unmeasured. UNTESTED: no GPU was available
when this path was written.

The package: ``benchmarks`` (what runs inside each rank), ``fit`` (measurements -> profile),
``profile_io`` (the profile and samples files, the structured facts), ``steps`` (the in-step
stage), ``command`` (this command).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from moegraph.cli import UsageError
from moegraph.options import check_output
from moegraph.registry import load_hardware
from moegraph.runtime.calibrate.fit import BenchCheck, GraphCheck, fit_profile, self_check, summarize_checks
from moegraph.runtime.calibrate.options import (MAX_BUDGET_S, MAX_RANKS, MIN_BUDGET_S, MIN_IN_STEP_BUDGET_S,
                                                CalibrationError, CalibrationOptions, in_step_enabled)
from moegraph.runtime.calibrate.profile_io import Profile, read_samples, write_profile, write_samples
from moegraph.runtime.calibrate.results import BenchResult, MachineInfo
from moegraph.runtime.netns import add_link_args, emulated_link, link_from_args

__all__ = ["calibrate_command", "options_from_args", "run_calibration", "refit_options", "refit_calibration",
           "median_results", "Calibration", "format_summary"]

STARTUP_HINT_S = 5.0        # spawning ranks and importing torch on a 2-core machine
RESERVE_S = 1.5             # kept back from the budget for teardown, fitting and writing
HARD_LIMIT_EXTRA_S = 120.0  # ranks still running this long after the budget are killed
MAX_SAMPLES_BYTES = 64 << 20  # --refit reads at most this much per file: a bounded input
FOREIGN_LOAD_WARN = 0.15    # cores used by other processes during the run that make it suspect


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What one run produced: the written profile, the benchmark results, the checks, the wall time."""

    profile: Profile
    results: tuple[BenchResult, ...]
    checks: tuple[Any, ...]             # GraphCheck | BenchCheck | steps.StepCheck, each with line()
    wall_s: float


# --- command line ----------------------------------------------------------------------------

DEFAULT_TIME_BUDGET_S = 180.0


def calibrate_command(p: argparse.ArgumentParser):
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="what to calibrate (default cpu)")
    p.add_argument("--backend", default=None, choices=("gloo", "nccl"),
                   help="collective backend (default gloo on cpu, nccl on cuda)")
    p.add_argument("--n", type=int, default=2, metavar="N", help="ranks for the collective benchmarks (default %(default)s)")
    p.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET_S, metavar="S",
                   help="seconds for the whole calibration, startup included (default %(default)s)")
    p.add_argument("--base", default=None,
                   help="registry name or YAML path giving unmeasured fields (default cpu-gloo on cpu, h100 on cuda)")
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16"),
                   help="dtype of the kernels (default fp32 on cpu, bf16 on cuda)")
    p.add_argument("-o", "--output", required=True, metavar="PROFILE.yaml", help="where to write the profile")
    p.add_argument("--samples", default=None, metavar="FILE.json",
                   help="also write every raw sample (median seconds, sizes) as JSON, for inspection or refitting")
    p.add_argument("--refit", default=None, nargs="+", metavar="SAMPLES.json",
                   help="fit the profile from earlier runs' --samples files instead of measuring (several: each "
                        "case's median over the runs): their device, ranks, dtype and base (--base overrides it); "
                        "the in-step stage, which measures real steps, is skipped")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    add_link_args(p)
    return _handle


def _handle(args: argparse.Namespace) -> int:
    if args.refit is not None:
        opts, recorded = refit_options(args)
        cal = refit_calibration(opts, *recorded, runs=len(args.refit))
    else:
        opts = options_from_args(args)
        with emulated_link(opts.link):               # the ranks spawned inside talk over the emulated link
            cal = run_calibration(opts)
    if args.json:
        json.dump(summary_json(cal, opts), sys.stdout, indent=1)
        print()
    else:
        print(format_summary(cal, opts))
    return 0


def options_from_args(args: argparse.Namespace) -> CalibrationOptions:
    """Validate the command line; every rejection is a one-line UsageError."""
    if not 1 <= args.n <= MAX_RANKS:
        raise UsageError(f"--n {args.n}: the number of ranks must be between 1 and {MAX_RANKS}")
    budget = args.time_budget
    if not (math.isfinite(budget) and MIN_BUDGET_S <= budget <= MAX_BUDGET_S):
        raise UsageError(f"--time-budget {budget:g}: must be between {MIN_BUDGET_S:g} and {MAX_BUDGET_S:g} s "
                         f"(starting the ranks alone takes about {STARTUP_HINT_S:g} s; below {MIN_BUDGET_S:g} s most "
                         "benchmarks would be skipped and the profile would be mostly --base values)")
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


def refit_options(args: argparse.Namespace) -> tuple[CalibrationOptions, tuple[list[BenchResult], MachineInfo]]:
    """--refit: the recorded runs' options (their device, backend, ranks, dtype, base unless --base
    is given) with this command's output; (options, (their results, the first run's machine)):
    one file's results as recorded, several files' as each case's median (median_results). One-line
    UsageErrors for a file that is not a samples file, runs that differ in what they measured, and
    flags that only a measuring run uses."""
    paths = [Path(p) for p in args.refit]
    path = paths[0]
    for flag, value in (("--samples", args.samples), ("--link", getattr(args, "link", None)),
                        ("--link-latency", getattr(args, "link_latency", None)),
                        ("--time-budget", getattr(args, "time_budget", DEFAULT_TIME_BUDGET_S) != DEFAULT_TIME_BUDGET_S)):
        if value:
            raise UsageError(f"--refit {path}: {flag} measures or records a run; a refit does neither")
    runs, machines, setups = [], [], set()
    for p in paths:
        try:
            if p.stat().st_size > MAX_SAMPLES_BYTES:
                raise UsageError(f"--refit {p}: {p.stat().st_size:,} bytes, over the {MAX_SAMPLES_BYTES:,} a "
                                 "samples file may hold (a full CPU run writes under 1 MB)")
            doc = json.loads(p.read_text())
            recorded = doc["options"]
            runs.append(read_samples(p))
            machines.append(MachineInfo(**doc["machine"]))
            device, backend, n, dtype = recorded["device"], recorded["backend"], int(recorded["n"]), recorded["dtype"]
            budget = float(recorded["time_budget_s"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UsageError(f"--refit {p}: not a samples file written by --samples "
                             f"({type(err).__name__}: {err})") from None
        setups.add((device, backend, n, dtype, machines[-1].gpu or machines[-1].cpu))
    if len(setups) > 1:
        raise UsageError(f"--refit: the files record different runs (device, backend, n, dtype, machine): "
                         f"{sorted(setups)}; refit one machine's runs together")
    results = runs[0] if len(runs) == 1 else median_results(runs)
    given = {"--device": (args.device, "cpu", device), "--backend": (args.backend, None, backend),
             "--n": (args.n, 2, n), "--dtype": (args.dtype, None, dtype)}
    for flag, (value, default, was) in given.items():
        if value != default and str(value) != str(was):
            raise UsageError(f"--refit {path}: {flag} {value} differs from the recorded run's {was}; "
                             f"a refit fits what was measured (leave {flag} out)")
    output = Path(args.output)
    _check_writable(output)
    base = args.base or recorded["base"]
    load_hardware(base)
    opts = CalibrationOptions(device, backend, n, budget, base, dtype, output, not args.quiet, None, None)
    return opts, (results, machines[0])


def median_results(runs: list[list[BenchResult]]) -> list[BenchResult]:
    """Several runs' results as one: each case (benchmark, label) at its median time over the runs
    that measured it; the first run's order, benchmarks and summaries (a case only later runs
    measured is left out: the first run's budget decides what is fitted)."""
    times: dict[tuple[str, str], list[float]] = {}
    for results in runs:
        for r in results:
            for smp in r.samples:
                times.setdefault((r.name, smp.label), []).append(smp.seconds)
    return [dataclasses.replace(r, samples=tuple(dataclasses.replace(smp, seconds=statistics.median(
                times[(r.name, smp.label)])) for smp in r.samples)) for r in runs[0]]


def refit_calibration(opts: CalibrationOptions, results: list[BenchResult], info: MachineInfo,
                      runs: int = 1) -> Calibration:
    """Fit and write ``opts.output`` from recorded benchmark results, as run_calibration fits a
    measured run (the isolated regime only: the in-step stage measures real steps)."""
    wall = sum(r.seconds for r in results)
    profile = fit_profile(results, load_hardware(opts.base), opts, info, wall)
    checks: list[Any] = list(self_check(profile.hardware(), results, opts.n))
    profile = profile.with_remark("self-check: " + summarize_checks(checks)).with_remark(
        f"refit from {runs} recorded run(s)" + (", each case's median" if runs > 1 else "")
        + "; in_step=skipped (a refit measures no step)")
    write_profile(opts.output, profile, results, checks)
    return Calibration(profile, tuple(results), tuple(checks), wall)


def _check_writable(path: Path, suffixes: tuple[str, ...] = (".yaml", ".yml")) -> None:
    flag = "-o" if ".yaml" in suffixes else "--samples"
    if path.suffix not in suffixes:
        raise UsageError(f"-o {path}: a profile is a .yaml or .yml file (load_hardware reads it by that suffix)")
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory")
    # the one output rule: missing folders are made when it is written, the folder must take files
    check_output(path, flag=flag)


# --- running the benchmarks --------------------------------------------------------------------

def run_calibration(opts: CalibrationOptions) -> Calibration:
    """Measure, fit and write ``opts.output`` (and ``opts.samples``)."""
    t0 = time.time()
    base = load_hardware(opts.base)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
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
    info = dataclasses.replace(info, load_avg_1m=load)
    profile = fit_profile(results, base, opts, info, wall)
    checks: list[Any] = list(self_check(profile.hardware(), results, opts.n))   # the isolated regime
    profile = profile.with_remark("self-check: " + summarize_checks(checks))
    profile, step_checks = _in_step_stage(profile, opts, t0)
    checks += step_checks
    write_profile(opts.output, profile, results, checks)
    if opts.samples is not None:
        write_samples(opts.samples, results, opts, info)
    if opts.verbose:
        for c in checks:
            print(f"calibrate [{time.time() - t0:6.1f}s] self-check {c.line()}", file=sys.stderr, flush=True)
    return Calibration(profile, tuple(results), tuple(checks), time.time() - t0)


def _in_step_stage(profile: Profile, opts: CalibrationOptions, t0: float) -> tuple[Profile, list[Any]]:
    """Measure real steps, store what they fit in the profile (the in-step factors, the expert
    weight-streaming and gradient-accumulation rates, the in-step comm_overlap_stretch);
    (profile, StepChecks)."""
    from moegraph.runtime.calibrate.steps import (fit_in_step, fit_overlap_stretch, in_step_checks, measure_solo,
                                                  measure_steps)
    if not in_step_enabled(opts):
        why = "CUDA: not implemented" if opts.device != "cpu" else (
            "n=1 times no collective" if opts.n < 2 else f"--time-budget < {MIN_IN_STEP_BUDGET_S:g} s")
        return profile.with_remark(f"in_step=skipped ({why})"), []
    t = time.time()

    def log(msg: str) -> None:
        if opts.verbose:
            print(f"calibrate [{time.time() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)
    samples = measure_steps(profile.hardware(), opts.n, deadline=t0 + opts.time_budget_s - RESERVE_S, log=log)
    if not samples:
        return profile.with_remark("in_step=skipped (out of time)"), []
    fit = fit_in_step(profile.hardware(), samples)
    noise = round(statistics.median(s.noise for s in samples), 4)
    source = (f"measured by moegraph calibrate's in-step stage on {profile.facts.cpu} (real steps of "
              "CALIBRATION_LAYERS; docs/calibration.md)")
    profile = profile.with_fields(in_step_factors=fit.factors, in_step_stream_bw_bytes_s=fit.stream_bw_bytes_s,
                                  accumulate_bw_bytes_s=fit.accumulate_bw_bytes_s, step_noise=noise,
                                  sources={**profile.fields.get("sources", {}), "in_step_factors": source})
    stretch = fit_overlap_stretch(profile.hardware(), samples)
    if stretch is not None:
        profile = profile.with_fields(comm_overlap_stretch=stretch)
    solo = measure_solo(profile.hardware(), deadline=t0 + opts.time_budget_s - RESERVE_S, log=log)
    if solo:
        solo_fit = fit_in_step(profile.hardware(), solo)
        compute = {c: f for c, f in solo_fit.factors.items() if c != "comm"}
        profile = profile.with_fields(solo_in_step_factors=compute,
                                      solo_in_step_stream_bw_bytes_s=solo_fit.stream_bw_bytes_s).with_remark(
            "solo_in_step=[" + ", ".join(f"{c} x{f:.2f}" for c, f in compute.items())
            + (f", expert weights streamed at {solo_fit.stream_bw_bytes_s / 1e9:.2f} GB/s" if solo_fit.stream_bw_bytes_s
               else "") + f"] from {len(solo)} layer(s) at n=1 on two processes")
    checks = in_step_checks(profile.hardware(), samples) + in_step_checks(profile.hardware().for_group(1), solo)
    text = ", ".join(f"{c} x{f:.2f}" for c, f in fit.factors.items()) + (
        f", expert weights streamed at {fit.stream_bw_bytes_s / 1e9:.2f} GB/s" if fit.stream_bw_bytes_s else "") + (
        f", gradients accumulated at {fit.accumulate_bw_bytes_s / 1e9:.2f} GB/s" if fit.accumulate_bw_bytes_s else "")
    profile = profile.with_remark(f"in_step=[{text}] from {len(samples)} layer(s) in {time.time() - t:.0f}s; "
                                  f"step_noise {noise} (median over layers of the steps' relative MAD)")
    if stretch is not None:
        profile = profile.with_remark(f"comm_overlap_stretch {stretch} fitted in-step on the greedy plans of "
                                      f"{sum(s.overlap_plan is not None for s in samples)} layer(s) "
                                      "(replaces the microbenchmark's)")
    log(f"in-step factors {text}" + (f"; comm_overlap_stretch {stretch} (greedy plans)" if stretch is not None else ""))
    return profile, checks


def _run_cpu(opts: CalibrationOptions, t0: float) -> tuple[list[BenchResult], MachineInfo]:
    import torch

    from moegraph.runtime.calibrate.benchmarks import rank_benchmarks
    from moegraph.runtime.calibrate.results import cpu_seconds, machine_busy_seconds, machine_info
    from moegraph.runtime.launch import RankCrash, spawn
    deadline = t0 + opts.time_budget_s - RESERVE_S
    if in_step_enabled(opts):
        from moegraph.runtime.calibrate.steps import STEP_STAGE_S
        deadline -= STEP_STAGE_S                                   # left for the in-step stage
    busy0, own0, wall0 = machine_busy_seconds(), cpu_seconds(), time.time()
    spec = {"backend": opts.backend, "dtype": opts.dtype, "t0": t0, "deadline": deadline,
            "pg_timeout_s": max(60.0, opts.time_budget_s), "verbose": opts.verbose}
    hard = opts.time_budget_s + HARD_LIMIT_EXTRA_S - (time.time() - t0)
    try:
        per_rank = spawn(rank_benchmarks, opts.n, args=(spec,), backend=opts.backend, timeout_s=hard,
                         pg_timeout_s=spec["pg_timeout_s"], threads=opts.threads)
    except RankCrash as err:                     # a bug in a rank: its traceback; RankFailure stays one line
        raise CalibrationError(f"calibration {err}") from None
    busy1, own1, wall1 = machine_busy_seconds(), cpu_seconds(), time.time()
    results = per_rank[0][0]
    rank_cpu = sum(used for _, used in per_rank)
    info = machine_info(torch.device("cpu"))
    if busy0 is not None and busy1 is not None:
        # CPU the rest of the machine used meanwhile: other users' jobs slow every benchmark
        foreign = max(0.0, (busy1 - busy0) - (own1 - own0) - rank_cpu) / max(1e-9, wall1 - wall0)
        info = dataclasses.replace(info, foreign_load_cores=round(foreign, 2))
        if foreign > FOREIGN_LOAD_WARN and opts.verbose:
            print(f"calibrate: warning: other processes used {foreign:.2f} of {os.cpu_count()} cores on average "
                  f"during the measurements; the profile is pessimistic (calibrate again on a quiet machine)",
                  file=sys.stderr, flush=True)
    return results, info


def _run_cuda(opts: CalibrationOptions, t0: float) -> tuple[list[BenchResult], MachineInfo]:
    """UNTESTED (no GPU here): single-GPU benchmarks in this process, timed with CUDA events."""
    import torch

    from moegraph.runtime.calibrate.benchmarks import run_benches
    from moegraph.runtime.calibrate.harness import Clock, Lockstep, RankEnv
    from moegraph.runtime.calibrate.results import machine_info
    device = torch.device("cuda", torch.cuda.current_device())
    env = RankEnv(0, 1, device, opts.dtype, opts.backend, t0, t0 + opts.time_budget_s - RESERVE_S,
                  Lockstep(0, 1), Clock(device), verbose=opts.verbose)
    return run_benches(env), machine_info(device)


def format_summary(cal: Calibration, opts: CalibrationOptions) -> str:
    p, facts = cal.profile.fields, cal.profile.facts
    rows = [("peak (GEMM, " + opts.dtype + ")", f"{p['peak_flops_bf16'] / 1e9:.1f} GFLOP/s"),
            ("memory bandwidth", f"{p['hbm_bw_bytes_s'] / 1e9:.1f} GB/s"),
            ("kernel latency", f"{p['kernel_latency_us']:.1f} us"),
            ("link bandwidth", f"{p['nvlink_bw_bytes_s'] / 1e9:.2f} GB/s"),
            ("collective step latency", f"{p['intra_node_latency_us']:.0f} us"),
            ("comm SM budget / sm_count", f"{p['comm_sm_budgets']} / {p['sm_count']}"),
            ("other processes (cores)", "?" if facts.foreign_load_cores is None else f"{facts.foreign_load_cores:.2f}")]
    out = [f"wrote {opts.output} ({cal.wall_s:.1f} s)"] + [f"  {k:<26} {v}" for k, v in rows]
    skipped = [r.name for r in cal.results if r.skipped]
    if skipped:
        out.append(f"  partly or not measured: {', '.join(skipped)}")
    return "\n".join(out)


def summary_json(cal: Calibration, opts: CalibrationOptions) -> dict[str, Any]:
    """``calibrate --json``: the profile written, its facts, each benchmark and each check."""
    graphs = [c for c in cal.checks if isinstance(c, GraphCheck)]
    return {"output": str(opts.output), "samples": None if opts.samples is None else str(opts.samples),
            "wall_s": round(cal.wall_s, 1), "profile": cal.profile.as_dict(),
            "facts": dataclasses.asdict(cal.profile.facts),
            "benchmarks": [{"name": r.name, "seconds": round(r.seconds, 2), "samples": len(r.samples),
                            "summary": r.summary, "skipped": r.skipped} for r in cal.results],
            "self_check": {"graphs": [{"label": c.label, "predicted_s": c.predicted_s, "measured_s": c.measured_s,
                                       "error": round(c.error, 4)} for c in graphs],
                           "benchmarks": [{"bench": c.bench, "median_error": None if c.median_error is None
                                           else round(c.median_error, 4), "cases": c.cases, "not_ops": c.not_ops}
                                          for c in cal.checks if isinstance(c, BenchCheck)],
                           "lines": [c.line() for c in cal.checks]}}
