"""`moegraph demo`: the README's main job, the whole pipeline on built-in defaults.

trace the Mixtral-8x7B layer on h800 (n=8, seq 8192) -> compile it (CP-SAT vs baselines) ->
draw its Gantt chart -> run a small layer on 2 CPU ranks under its CP-SAT and sequential
schedules, printing predicted vs measured step time and the error against the eager module.
It lives in the last stage because it drives all four.
"""

from __future__ import annotations

import argparse

from moegraph.commands import layer_from_args
from moegraph.options import check_output_dir, positive_int
from moegraph.runtime.commands import measure_schedule
from moegraph.runtime.netns import Link, add_link_args, emulated_link, link_from_args, link_mismatch

DEMO_PAPER = ["--model", "mixtral-8x7b", "--hardware", "h800", "--n", "8", "--seq", "8192"]
DEMO_CPU = dict(model="small", hardware="cpu-2core-gloo", attn="sp", ffn="ep", dispatch="ag-rs", n=2, batch=1,
                seq=512, top_k=None, dtype="fp32", dp=1, passes="gate-reorder,sar=paper")


def demo_command(p: argparse.ArgumentParser):
    p.add_argument("-o", "--output", default="out",
                   help="folder for the schedule and its Gantt chart (default %(default)s)")
    p.add_argument("--steps", type=positive_int, default=10, help="measured steps of the CPU run (default %(default)s)")
    p.add_argument("--skip-run", action="store_true", help="stop after the Gantt chart (no CPU ranks)")
    add_link_args(p)

    def run(args) -> int:
        from moegraph.cli import main
        out = check_output_dir(args.output)
        link = link_from_args(args)
        sched, chart = out / "mixtral-8x7b-h800.json", out / "mixtral-8x7b-h800.png"
        steps = [
            ("1/4 trace: the Mixtral-8x7B layer, sp+ep, ag-rs dispatch, n=8, seq 8192, on h800",
             ["trace", *DEMO_PAPER]),
            ("2/4 compile: passes gate-reorder,sar=paper, CP-SAT schedule vs baselines and lower bound",
             ["compile", *DEMO_PAPER, "--passes", "gate-reorder,sar=paper", "-o", str(sched)]),
            (f"3/4 gantt: {chart}", ["gantt", str(sched), "-o", str(chart)]),
        ]
        with emulated_link(link):               # made first: a missing privilege fails before any work
            out.mkdir(parents=True, exist_ok=True)
            for title, argv in steps:
                print(f"\n== {title} ==", flush=True)
                rc = main(argv)
                if rc:
                    return rc
            if args.skip_run:
                return 0
            return _demo_cpu_run(args.steps, link)
    return run


def _demo_cpu_run(steps: int, link: Link | None = None) -> int:
    """The CPU run; with ``link`` the caller has entered its namespace (the ranks inherit it)."""
    a = argparse.Namespace(**DEMO_CPU)
    over = f"an emulated {link} link" if link else "gloo"
    print(f"\n== 4/4 run: the '{a.model}' layer on {a.n} CPU ranks ({over}), s={a.seq}, {a.attn}+{a.ffn} "
          f"{a.dispatch}, passes {a.passes}, profile {a.hardware} ==", flush=True)
    layer = layer_from_args(a)
    if warning := link_mismatch(layer.hardware, link):
        print(warning, flush=True)
    # one set of ranks per schedule: two compiled layers in one process slow each other down on
    # this VM (docs/runtime.md), which would blur the comparison
    rows = [measure_schedule(layer, method, steps=steps, warmup=2, check=method == "cpsat")
            for method in ("cpsat", "sequential")]
    print(f"{'schedule':<12} {'predicted ms':>13} {'measured ms':>12} {'error':>7}   (median of {steps} steps, slowest rank)")
    for r in rows:
        err = (r["predicted_us"] - r["step_us"]) / r["step_us"]
        print(f"{r['schedule']:<12} {r['predicted_us'] / 1e3:>13.2f} {r['step_us'] / 1e3:>12.2f} {err * 100:>+6.0f}%")
    c = rows[0]["check"]
    print(f"cpsat vs eager PyTorch: max rel err output {c['max_rel_err_output']:.1e}, "
          f"grads {c['max_rel_err_grads']:.1e}")
    print("(prediction error comes from this machine: docs/calibration.md; recalibrate with "
          "`moegraph calibrate -o my.yaml` and pass --hardware my.yaml)")
    return 0
