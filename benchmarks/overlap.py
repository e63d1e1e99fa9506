"""Does the overlapped schedule beat the sequential one on real ranks? (gloo, CPU, n=2 by default)

One launch: every rank builds one CompiledLayer per schedule (same weights, same inputs) and
times them in ABBA blocks (``runtime.timing.measurement_blocks``: each schedule's first half
of the steps in order, then the second halves in reverse), so slow drift on the machine hits
every schedule alike; not step by step, which evicts each layer's working set and slowed every
schedule ~1.7x. Step time of a step = the slowest rank's; the table gives the median over
--steps steps, the cost model's predicted makespan, the speed-up over 'sequential' (ratio of
medians) and the paired speed-up (median over i of the ratio of the i-th sequential step to the
schedule's i-th step, the same position in their blocks: less sensitive to drift during the run
than the ratio of medians, which matters on a shared machine).

    .venv/bin/python benchmarks/overlap.py                      # tiny, b=1, s=128, n=2, 300 steps
    .venv/bin/python benchmarks/overlap.py --schedules sequential,cpsat --results benchmarks/RESULTS.md

The default configuration (tiny, b=1, s=128, sp/ep/ag-rs, n=2, fp32) is one where the cost
model (hardware cpu-2core-gloo, the shipped CPU calibration with in-step factors) predicts
communication comparable to compute (the script prints the ratio). Steps on the 2-core VM vary
3-4x, so the default is the median over 300 steps (~2% standard error on a ~25 ms step). 'greedy'
is the schedules stage's list schedule (collectives issued as early as possible).
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

from moegraph.atomic import append_atomic  # noqa: E402
from moegraph.commands import add_layer_args, config_from_args  # noqa: E402
from moegraph.schedules.driver import lower  # noqa: E402
from moegraph.runtime.timing import RunSpec, run_rank, step_stats  # noqa: E402
from moegraph.runtime.launch import spawn  # noqa: E402
from moegraph.runtime.module import make_plan  # noqa: E402
from moegraph.runtime.options import RuntimeOptions  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_args(p, model_default="tiny")
    p.set_defaults(seq=128, n=2, dtype="fp32", hardware="cpu-2core-gloo", batch=1)
    p.add_argument("--schedules", default="sequential,cpsat,greedy", help="comma-separated (default %(default)s)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--time-limit", type=float, default=10.0)
    p.add_argument("--results", default=None, help="append the table to this markdown file")
    args = p.parse_args(argv)
    if args.steps < 10:
        p.error("--steps must be at least 10")
    layer = lower(config_from_args(args))
    g, cost = layer.graph, layer.cost
    comp = sum(cost.node_time_us(nd) for nd in g.nodes if not nd.is_comm)
    comm = sum(cost.node_time_us(nd, cost.default_sm_budget(nd)) for nd in g.nodes if nd.is_comm)
    methods = [m.strip() for m in args.schedules.split(",") if m.strip()]
    plans = tuple(make_plan(g, cost, m, time_limit_s=args.time_limit) for m in methods)
    spec = RunSpec(layer.model, g, plans, args.steps, args.warmup, 0, args.dtype, "cpu", RuntimeOptions(timeout_s=120.0))
    results = spawn(run_rank, args.n, args=(spec,), backend="gloo", timeout_s=1800)
    stats = [step_stats(results, i) for i in range(len(plans))]
    base = stats[methods.index("sequential")]["step_us"] if "sequential" in methods else stats[0]["step_us"]
    st = g.strategy
    head = (f"{layer.model.name}: attn={st.attn} ffn={st.ffn} dispatch={st.dispatch} n={st.n} b={g.dims.b} "
            f"s={g.dims.s} {st.dtype}, gloo, {args.steps} steps (+{args.warmup} warm-up), "
            f"{datetime.date.today()} on {platform.node() or 'unknown'} ({os.cpu_count()} cores)")
    ref = methods.index("sequential") if "sequential" in methods else 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [head + f", load average {load:.1f}",
             f"cost model ({layer.hardware.name}): compute {comp / 1e3:.2f} ms, comm {comm / 1e3:.2f} ms "
             f"(comm/compute {comm / comp:.2f})", "",
             "| schedule | predicted ms | measured median ms | min ms | max ms | speed-up (medians) "
             "| paired speed-up | steps faster |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m, plan, s in zip(methods, plans, stats):
        pred = plan.predicted_makespan_us
        ratios = [a / b for a, b in zip(stats[ref]["step_us_all"], s["step_us_all"])]
        faster = sum(r > 1 for r in ratios)
        lines.append(f"| {m} | {'' if pred is None else f'{pred / 1e3:.2f}'} | {s['step_us'] / 1e3:.2f} | "
                     f"{s['step_us_min'] / 1e3:.2f} | {s['step_us_max'] / 1e3:.2f} | {base / s['step_us']:.3f}x | "
                     f"{statistics.median(ratios):.3f}x | {faster}/{len(ratios)} |")
    lines.append("")
    lines.append("paired speed-up: median over i of (i-th sequential step time / the schedule's i-th step time), "
                 "steps timed in ABBA blocks (each schedule's first halves in order, second halves reversed)")
    hidden = _exposed_waits(results, methods)
    if hidden:
        lines += ["", "host time blocked on collectives, median per step (rank 0): "
                  + ", ".join(f"{m} {v / 1e3:.2f} ms" for m, v in hidden.items())]
    text = "\n".join(lines)
    print(text)
    if args.results:
        append_atomic(args.results, "\n" + text + "\n")      # the whole table or none of it
    return 0


def _exposed_waits(results, methods) -> dict[str, float]:
    out = {}
    for i, m in enumerate(methods):
        traces = results[0]["plans"][i]["traces"]
        per_step = [sum(w["end_us"] - w["start_us"] for w in t["waits"]) for t in traces]
        if per_step:
            out[m] = statistics.median(per_step)
    return out


if __name__ == "__main__":
    sys.exit(main())
