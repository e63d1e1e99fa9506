"""`moegraph demo`: the README's main job, the whole pipeline on built-in defaults.

trace the Mixtral-8x7B layer on h800 (n=8, seq 8192) -> compile it (CP-SAT vs baselines) ->
draw its Gantt chart -> run a small layer on 2 CPU ranks under its CP-SAT and sequential
schedules, printing predicted vs measured step time and the error against the eager module.
It lives in the last stage because it drives all four.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from typing import Callable

from moegraph.config import CompileConfig
from moegraph.ir import Strategy
from moegraph.options import check_output_dir, positive_int
from moegraph.pass_steps import GateReorder, Sar, step_label
from moegraph.registry import load_hardware
from moegraph.runtime.timing import measure_schedule
from moegraph.runtime.netns import (AUTO, PLAIN_PROFILE, Link, LinkUnavailable, add_link_args, emulated_link,
                                    link_from_args, link_mismatch, namespace_privilege, profile_for)

DEMO_PAPER = ["--model", "mixtral-8x7b", "--hardware", "h800", "--n", "8", "--seq", "8192"]
AUTO_LINK = Link(10**9)                         # --link auto's link: enough wire time to overlap on 2 cores
DEMO_CPU = CompileConfig(model="small", strategy=Strategy("sp", "ep", "ag-rs", 2, dtype="fp32"),
                         passes=(GateReorder(), Sar("paper")), batch=1, seq=512, hardware=PLAIN_PROFILE)
"""The CPU run's layer (step 4/4): small enough for 2 CPU ranks in seconds."""


@dataclass(frozen=True)
class LinkChoice:
    """The link the demo's CPU run uses, the profile that prices it, and what to tell the user."""

    link: Link | None
    hardware: str
    note: str


def choose_link(requested: "Link | None | str", probe: Callable[[], str | None] = namespace_privilege) -> LinkChoice:
    """--link auto: AUTO_LINK when ``probe`` finds the privilege to make a namespace, else plain
    loopback with the reason; an explicit RATE or none is taken as given."""
    if requested == AUTO:
        reason = probe()
        if reason is not None:
            return LinkChoice(None, PLAIN_PROFILE, f"link: plain loopback, no emulated link: {reason} "
                                                   f"(the CP-SAT schedule can only fill idle core time)")
        hardware, note = profile_for(AUTO_LINK)
        return LinkChoice(AUTO_LINK, hardware, f"link: an emulated {AUTO_LINK} link (--link auto; --link none for "
                                               f"plain loopback); {note}")
    if requested is not None and not isinstance(requested, Link):
        raise ValueError(f"choose_link: {requested!r} is not a Link, None or {AUTO!r}")
    hardware, note = profile_for(requested)
    return LinkChoice(requested, hardware, f"link: {f'an emulated {requested} link' if requested else 'plain loopback'}"
                                           f"; {note}")


def demo_command(p: argparse.ArgumentParser):
    p.add_argument("-o", "--output", default="out",
                   help="folder for the schedule and its Gantt chart (default %(default)s)")
    p.add_argument("--steps", type=positive_int, default=10, help="measured steps of the CPU run (default %(default)s)")
    p.add_argument("--skip-run", action="store_true", help="stop after the Gantt chart (no CPU ranks)")
    add_link_args(p, auto=True)

    def run(args) -> int:
        from moegraph.cli import main
        out = check_output_dir(args.output)
        auto = args.link == AUTO
        # auto + --link-latency is refused like --link-latency alone: a delay needs a chosen link
        requested = AUTO if auto and link_from_args(argparse.Namespace(link=None, link_latency=args.link_latency)) \
            is None else link_from_args(args)
        # --skip-run starts no ranks: no link is made, probed or reported
        choice = LinkChoice(None, PLAIN_PROFILE, "") if args.skip_run else choose_link(requested)
        sched, chart = out / "mixtral-8x7b-h800.json", out / "mixtral-8x7b-h800.png"
        steps = [
            ("1/4 trace: the Mixtral-8x7B layer, sp+ep, ag-rs dispatch, n=8, seq 8192, on h800",
             ["trace", *DEMO_PAPER]),
            ("2/4 compile: passes gate-reorder,sar=paper, CP-SAT schedule vs baselines and lower bound",
             ["compile", *DEMO_PAPER, "--passes", "gate-reorder,sar=paper", "-o", str(sched)]),
            (f"3/4 gantt: {chart}", ["gantt", str(sched), "-o", str(chart)]),
        ]
        with contextlib.ExitStack() as stack:
            try:                                # made first: a missing privilege fails before any work
                stack.enter_context(emulated_link(choice.link))
            except LinkUnavailable as err:
                if not auto:
                    raise
                choice = LinkChoice(None, PLAIN_PROFILE, f"link: plain loopback, no emulated link: {err}")
            if choice.note:
                print(choice.note, flush=True)
            out.mkdir(parents=True, exist_ok=True)
            for title, argv in steps:
                print(f"\n== {title} ==", flush=True)
                rc = main(argv)
                if rc:
                    return rc
            if args.skip_run:
                return 0
            return _demo_cpu_run(args.steps, choice.link, choice.hardware)
    return run


def _demo_cpu_run(steps: int, link: Link | None = None, hardware: str = PLAIN_PROFILE) -> int:
    """The CPU run; with ``link`` the caller has entered its namespace (the ranks inherit it)."""
    config = DEMO_CPU.replace(hardware=hardware)
    st, over = config.strategy, f"an emulated {link} link" if link else "gloo"
    print(f"\n== 4/4 run: the '{config.model}' layer on {st.n} CPU ranks ({over}), s={config.seq}, {st.attn}+{st.ffn} "
          f"{st.dispatch}, passes {','.join(map(step_label, config.passes))}, profile {hardware} ==", flush=True)
    if warning := link_mismatch(load_hardware(hardware), link):
        print(warning, flush=True)
    # one set of ranks per schedule: two compiled layers in one process slow each other down on
    # this VM (docs/runtime.md), which would blur the comparison
    rows = [measure_schedule(config.replace(schedule=method), steps=steps, warmup=2, check=method == "cpsat")
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
