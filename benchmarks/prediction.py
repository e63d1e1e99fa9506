"""How close are the cost model's step times to measured ones? (gloo, CPU, n=2 by default)

For each schedule, --repeats times: fresh ranks run it (moegraph.runtime.timing.measure_schedule:
warm-up, then --steps steps; step = the slowest rank's, median over steps) and the table sets the
measured median beside the prediction of the plan the scheduler made for --hardware. Runs go in
ABBA blocks (``runtime.timing.measurement_blocks`` over repeats: each schedule's first half of
the repeats in order, then the second halves in reverse) so slow drift on the machine hits every
schedule alike, not the first one of each round best. Before every run
a 1024^3 fp32 GEMM probe (best of 5, one thread) is timed in the parent: on a shared VM the
machine's speed itself drifts, and the probe column shows by how much.

    .venv/bin/python benchmarks/prediction.py --model small --seq 512 --attn tp --ffn ep --dispatch a2a \\
        --hardware cpu-2core-gloo --schedules cpsat,sequential --repeats 3 --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moegraph.atomic import append_atomic  # noqa: E402
from moegraph.commands import add_layer_args, config_from_args  # noqa: E402
from moegraph.schedules.driver import lower  # noqa: E402
from moegraph.runtime.timing import measure_schedule, measurement_blocks  # noqa: E402


def gemm_probe_gflops() -> float:
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(5):
            a @ b
        best = min(best, (time.perf_counter() - t) / 5)
    torch.set_num_threads(threads)
    return 2 * 1024 ** 3 / best / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_args(p, model_default="small")
    p.set_defaults(seq=512, n=2, dtype="fp32", hardware="cpu-2core-gloo", batch=1, attn="tp", dispatch="a2a")
    p.add_argument("--schedules", default="cpsat,sequential", help="comma-separated (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--results", default=None, help="append the table to this markdown file")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        p.error(f"--repeats={args.repeats} and --steps={args.steps} must be >= 1")
    config = config_from_args(args)
    layer = lower(config)
    methods = [m.strip() for m in args.schedules.split(",") if m.strip()]
    rows = []
    done = [0] * len(methods)                  # runs of each schedule so far
    for i, count in measurement_blocks(len(methods), args.repeats):
        method = methods[i]
        for _ in range(count):
            done[i] += 1
            probe = gemm_probe_gflops()
            r = measure_schedule(config.replace(schedule=method), steps=args.steps, warmup=args.warmup)
            err = r["predicted_us"] / r["step_us"] - 1
            rows.append((done[i], method, r["predicted_us"] / 1e3, r["step_us"] / 1e3, err, probe))
            print(f"run {done[i]} {method}: predicted {rows[-1][2]:.1f} ms, measured {rows[-1][3]:.1f} ms "
                  f"({err:+.0%}), GEMM probe {probe:.1f} GFLOP/s", file=sys.stderr, flush=True)
    st = layer.graph.strategy
    head = (f"{layer.model.name}: attn={st.attn} ffn={st.ffn} dispatch={st.dispatch} n={st.n} b={args.batch} "
            f"s={args.seq} {st.dtype}, gloo, hardware {layer.hardware.name} (calibrated "
            f"{dict(layer.hardware.measured).get('date', '-')}), {args.steps} steps (+{args.warmup} warm-up) per run, "
            f"{datetime.date.today().isoformat()} on {platform.node()} ({os.cpu_count()} cores), "
            f"load average {os.getloadavg()[0]:.1f}")
    lines = [head, "", "| run | schedule | predicted ms | measured median ms | error | GEMM probe GFLOP/s |",
             "|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {i} | {m} | {p_:.1f} | {ms:.1f} | {e:+.0%} | {g:.1f} |" for i, m, p_, ms, e, g in rows]
    errs = [abs(e) for *_, e, _ in rows]
    within = sum(1 for e in errs if e <= 0.2)
    lines += ["", f"|error| median {statistics.median(errs):.0%}, max {max(errs):.0%}; within 20%: {within}/{len(rows)} "
              f"runs. Error = predicted / measured - 1."]
    for method in methods[1:]:
        pairs = [(a[3], b[3]) for a, b in zip((r for r in rows if r[1] == methods[0]), (r for r in rows if r[1] == method))]
        faster = sum(1 for a, b in pairs if a <= b)
        ratio_of_medians = statistics.median(b for _, b in pairs) / statistics.median(a for a, _ in pairs)
        lines.append(f"{methods[0]} measured no slower than {method} in {faster}/{len(pairs)} paired runs "
                     f"(median of the per-run ratios {statistics.median(b / a for a, b in pairs):.3f}x, ratio of the "
                     f"medians {ratio_of_medians:.3f}x).")
    text = "\n".join(lines)
    print(text)
    if args.results:
        append_atomic(args.results, "\n" + text + "\n")      # the whole table or none of it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
