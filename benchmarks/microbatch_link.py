"""Merged micro-batch steps measured on the emulated link, on a held-out layer (issue 16, measured).

Issue 16 asks that on the emulated link the merged schedule (M micro-batches in one step graph, a
micro-batch's forward free to overlap another's backward) be at least 1.10x faster than the best
non-merged schedule, with predictions within 10%. A step of M micro-batches without merging is M
single-micro-batch steps, so the non-merged time is M x the faster of the single CP-SAT and greedy
steps. The layer must lie outside the calibration set (benchmarks/heldout.py refuses calibration
layers), so every prediction here is held-out.

Each round runs, in an order rotated per round so no command always runs first:
    moegraph run --model MODEL --seq S ... --link RATE --hardware PROFILE --steps K --json
        --schedule cpsat | --schedule greedy | --micro-batches M --schedule cpsat
        | --micro-batches M --schedule megatron-1f1b
and reports each command's median step (slowest rank) and its prediction.

    sudo .venv/bin/python benchmarks/microbatch_link.py                       # mid.yaml s=512, 3 rounds
    sudo .venv/bin/python benchmarks/microbatch_link.py --config small:768:sp/ep/ag-rs --rounds 2

Needs root for the namespace (moegraph.runtime.netns). Prints one Markdown block for RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from heldout import N, check_held_out, parse_config  # noqa: E402
from moegraph.options import UsageError, positive_int  # noqa: E402

TARGET = 1.10       # issue 16: merged >= 1.10x the best non-merged schedule
TOLERANCE = 0.10    # issue 16: predictions within 10%


def commands(args, config) -> dict[str, list[str]]:
    lc = config.layer
    base = [sys.executable, "-m", "moegraph", "run", "--model", lc.model, "--seq", str(lc.seq), "--n", str(N),
            "--attn", lc.attn, "--ffn", lc.ffn, "--dispatch", lc.dispatch, "--link", args.link,
            "--hardware", args.hardware, "--steps", str(args.steps), "--passes", args.passes, "--json"]
    merged = ["--micro-batches", str(args.micro_batches)]
    return {"single cpsat": base + ["--schedule", "cpsat"],
            "single greedy": base + ["--schedule", "greedy"],
            f"merged M={args.micro_batches} cpsat": base + merged + ["--schedule", "cpsat"],
            f"merged M={args.micro_batches} megatron-1f1b": base + merged + ["--schedule", "megatron-1f1b"]}


def run_one(cmd: list[str]) -> tuple[float, float]:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}")
    out = json.loads(done.stdout)
    return out["step_us"], out["predicted_step_us"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="mid", help="held-out layer: a benchmarks/heldout.py preset or "
                   "MODEL:SEQ:ATTN/FFN/DISPATCH (default %(default)s; hf-mixtral is not available here)")
    p.add_argument("--hardware", default="cpu-2core-gloo-1gbit", help="profile (default %(default)s)")
    p.add_argument("--link", default="1gbit", help="emulated link rate (default %(default)s)")
    p.add_argument("--micro-batches", type=positive_int, default=2)
    p.add_argument("--steps", type=positive_int, default=10, help="measured steps per command (default %(default)s)")
    p.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds (default %(default)s)")
    p.add_argument("--passes", default="gate-reorder,sar=paper")
    args = p.parse_args(argv)
    try:
        config = parse_config(args.config)
        check_held_out(config)
        if config.implementation != "reference":
            raise UsageError(f"{args.config!r}: only reference layers run through the CLI here")
        if args.micro_batches < 2:
            raise UsageError(f"--micro-batches {args.micro_batches}: merging needs at least 2")
    except UsageError as err:
        print(f"microbatch_link: {err}", file=sys.stderr)
        return 2

    cmds = commands(args, config)
    names = list(cmds)
    measured: dict[str, list[float]] = {k: [] for k in names}
    predicted: dict[str, float] = {}
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            step, pred = run_one(cmds[name])
            measured[name].append(step)
            predicted[name] = pred
            print(f"round {r + 1}: {name}: {step / 1e3:.1f} ms (predicted {pred / 1e3:.1f})", file=sys.stderr, flush=True)

    M = args.micro_batches
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"merged micro-batch steps on the emulated link: {config} (held-out), n={N} gloo ranks, link {args.link}, "
          f"profile {args.hardware}, passes {args.passes}, M={M}, {args.steps} steps per command, {args.rounds} "
          f"rounds (order rotated), medians of the slowest rank's step")
    print(f"{when} on {platform.node()} ({os.cpu_count()} cores), load average {load0:.1f} -> {os.getloadavg()[0]:.1f}\n")
    print("| round | " + " | ".join(names) + " | merged / best non-merged |")
    print("|---|" + "---:|" * (len(names) + 1))
    merged_name = names[2]
    ups = []
    for r in range(args.rounds):
        best_single = min(measured[names[0]][r], measured[names[1]][r])
        up = M * best_single / measured[merged_name][r]
        ups.append(up)
        print(f"| {r + 1} | " + " | ".join(f"{measured[k][r] / 1e3:.1f}" for k in names) + f" | {up:.3f}x |")
    print("| predicted | " + " | ".join(f"{predicted[k] / 1e3:.1f}" for k in names) + " | |")
    print()
    errs = {k: [predicted[k] / m - 1 for m in measured[k]] for k in names}
    for k in names:
        print(f"- {k}: prediction error per round " + ", ".join(f"{e * 100:+.1f}%" for e in errs[k]))
    worst = max(abs(e) for v in errs.values() for e in v)
    print(f"\nmerged speed-up over {M} x the best non-merged step: median {statistics.median(ups):.3f}x "
          f"(target >= {TARGET:.2f}x); worst prediction error {worst * 100:.1f}% (target <= {TOLERANCE:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
