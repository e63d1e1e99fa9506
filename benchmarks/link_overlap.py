"""CP-SAT against sequential on an emulated link: predicted and measured step times.

The ranks run in a private network namespace whose loopback is rate-limited (``--link``, default
1gbit; moegraph.runtime.netns, needs root), so collectives take wire time while the cores stay
free for compute, as NICs and copy engines leave the SMs free on a cluster. Each of ``--rounds``
launches times both schedules in ABBA blocks (``measurement_blocks``), so load that drifts on a
shared machine hits both alike; step time of a step is the slowest rank's, the table gives the
medians over all rounds' steps and the paired speed-up (median over rounds of the ratio of the
round's medians). ``--link none`` runs the same on plain loopback, for comparison.

    sudo .venv/bin/python benchmarks/link_overlap.py             # small, s=512, n=2, 1gbit, 4 x 6 steps
    sudo .venv/bin/python benchmarks/link_overlap.py --link none
    sudo .venv/bin/python benchmarks/link_overlap.py --hardware my-link-profile.yaml

The default layer is the demo's (``small``, sp+ep, ag-rs, passes gate-reorder,sar=paper) under the
shipped profile cpu-2core-gloo, which was calibrated on plain loopback: on the link its
predictions price the collectives at loopback speed (see the comm line the script prints).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moegraph.commands import add_layer_args, config_from_args  # noqa: E402
from moegraph.schedules.driver import lower  # noqa: E402
from moegraph.options import positive_int  # noqa: E402
from moegraph.runtime.timing import spawn_plans, step_stats  # noqa: E402
from moegraph.runtime.module import make_plan  # noqa: E402
from moegraph.runtime.netns import add_link_args, emulated_link, link_from_args, link_mismatch  # noqa: E402

METHODS = ("cpsat", "sequential")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_args(p, model_default="small")
    p.set_defaults(seq=512, n=2, dtype="fp32", hardware="cpu-2core-gloo", batch=1, attn="sp", ffn="ep",
                   dispatch="ag-rs", passes="gate-reorder,sar=paper")
    add_link_args(p)
    p.set_defaults(link=10**9)
    p.add_argument("--steps", type=positive_int, default=24, help="measured steps per schedule, all rounds "
                   "together (default %(default)s)")
    p.add_argument("--rounds", type=positive_int, default=4, help="launches the steps are split over (default "
                   "%(default)s)")
    p.add_argument("--warmup", type=positive_int, default=2, help="unmeasured steps per launch (default %(default)s)")
    p.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT deterministic seconds")
    args = p.parse_args(argv)
    link = link_from_args(args)
    with emulated_link(link):
        layer = lower(config_from_args(args))
        if warning := link_mismatch(layer.hardware, link):
            print(warning)
        g, cost = layer.graph, layer.cost
        plans = tuple(make_plan(g, cost, m, time_limit_s=args.time_limit) for m in METHODS)
        per_round = -(-args.steps // args.rounds)
        rounds = [[step_stats(res, i) for i in range(len(plans))]
                  for res in (spawn_plans(layer, plans, steps=per_round, warmup=args.warmup)
                              for _ in range(args.rounds))]
    steps_us = [[t for r in rounds for t in r[i]["step_us_all"]] for i in range(len(plans))]
    stats = [{"step_us": statistics.median(t), "step_us_min": min(t), "step_us_max": max(t)} for t in steps_us]
    comp = sum(cost.node_time_us(nd) for nd in g.nodes if not nd.is_comm)
    comm = sum(cost.node_time_us(nd, cost.default_sm_budget(nd)) for nd in g.nodes if nd.is_comm)
    wire = sum(nd.comm_bytes for nd in g.nodes if nd.is_comm) * g.strategy.n
    st = g.strategy
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{layer.model.name}: attn={st.attn} ffn={st.ffn} dispatch={st.dispatch} n={st.n} b={g.dims.b} "
          f"s={g.dims.s} {st.dtype}, passes {','.join(st.passes)}, gloo, link {link or 'none'}, "
          f"{per_round * args.rounds} steps per schedule in {args.rounds} launches (ABBA blocks, +{args.warmup} "
          f"warm-up each)")
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.node() or 'unknown'} "
          f"({os.cpu_count()} cores), load average {load:.1f}")
    line = (f"cost model ({layer.hardware.name}): compute {comp / 1e3:.2f} ms, comm {comm / 1e3:.2f} ms; "
            f"{wire / 2**20:.2f} MiB cross the loopback per step")
    if link:
        line += f" = {wire * 8 / link.rate_bit_s * 1e3:.1f} ms of wire time at {link}"
    print(line + "\n")
    seq = METHODS.index("sequential")
    print("| schedule | predicted ms | measured median ms | min ms | max ms | error | speed-up (medians) "
          "| paired speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for m, plan, s in zip(METHODS, plans, stats):
        pred = plan.predicted_makespan_us
        err = (pred - s["step_us"]) / s["step_us"]
        i = METHODS.index(m)
        paired = statistics.median(r[seq]["step_us"] / r[i]["step_us"] for r in rounds)
        print(f"| {m} | {pred / 1e3:.1f} | {s['step_us'] / 1e3:.1f} | {s['step_us_min'] / 1e3:.1f} | "
              f"{s['step_us_max'] / 1e3:.1f} | {err * 100:+.0f}% | {stats[seq]['step_us'] / s['step_us']:.3f}x | "
              f"{paired:.3f}x |")
    print("per launch, median ms (" + ", ".join(METHODS) + "): "
          + "; ".join(" / ".join(f"{x['step_us'] / 1e3:.0f}" for x in r) for r in rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
