"""`moegraph compile`, `moegraph verify`, `moegraph gantt`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moegraph.commands import add_layer_args, layer_from_args
from schedules.api import METHODS, compile_graph
from schedules.problem import ScheduleError
from schedules.schedule_file import Schedule

# The paper's configuration (§4.1): gating applied before FC2, Fig 9's rematerialization.
DEFAULT_PASSES = "gate-reorder,sar=paper"
GIB = 2**30


def add_compile_args(p: argparse.ArgumentParser) -> None:
    add_layer_args(p)
    p.set_defaults(passes=DEFAULT_PASSES)
    p.add_argument("--memory-budget", type=float, default=None, metavar="GiB",
                   help="peak memory cap for activations and buffers, in GiB (default: none)")
    p.add_argument("--time-limit", type=float, default=10.0, metavar="S",
                   help="CP-SAT search effort in deterministic seconds (default %(default)s)")
    p.add_argument("--method", default="cpsat", choices=METHODS, help="scheduler (default %(default)s)")
    p.add_argument("--comm-streams", type=int, default=1, choices=(1, 2),
                   help="1: one comm stream; 2: intra- and inter-node comm streams (default %(default)s)")
    p.add_argument("-o", "--output", default=None, metavar="SCHED.json", help="write the schedule file here")


def memory_budget_bytes(args) -> int | None:
    from moegraph.cli import UsageError
    if args.memory_budget is None:
        return None
    if args.memory_budget <= 0:
        raise UsageError(f"--memory-budget={args.memory_budget} must be a positive number of GiB")
    return int(args.memory_budget * GIB)


def compile_from_args(args):
    from moegraph.cli import UsageError
    if args.time_limit <= 0:
        raise UsageError(f"--time-limit={args.time_limit} must be a positive number of seconds")
    layer = layer_from_args(args)
    streams = ("comm",) if args.comm_streams == 1 else ("comm.intra", "comm.inter")
    result = compile_graph(layer.graph, layer.cost, memory_budget_bytes=memory_budget_bytes(args),
                           time_limit_s=args.time_limit, comm_streams=streams, method=args.method)
    return layer, result


def compile_summary(layer, result, output: str | None) -> dict:
    s = result.schedule.summary
    return {"model": layer.model.name, "hardware": layer.hardware.name,
            "strategy": layer.graph.strategy.as_dict(), "makespan_us": s["makespan_us"],
            "lower_bound_us": s["lower_bound_us"], "baselines": s["baselines"],
            "peak_memory_bytes": s["peak_memory_bytes"], "exposed_comm_us": s["exposed_comm_us"],
            "solver": {**s["solver"], "status": result.status, "wall_s": round(result.wall_s, 3)},
            "nodes": len(result.schedule.nodes), "hash": result.schedule.hash, "output": output,
            "passes": layer.report}


def format_compile(c: dict) -> str:
    b = c["baselines"]
    lines = [f"{c['model']} on {c['hardware']}: {c['nodes']} nodes, strategy "
             + " ".join(f"{k}={c['strategy'][k]}" for k in ("attn", "ffn", "dispatch", "n", "chunks", "remat", "gate")),
             f"{'schedule':<12} {'makespan us':>12} {'vs bound':>9}"]
    bound = c["lower_bound_us"] or 1.0
    for name, span in [("cp-sat", c["makespan_us"]), *sorted(b.items())]:
        lines.append(f"{name:<12} {span:>12.1f} {span / bound:>8.3f}x")
    lines += [f"{'lower bound':<12} {c['lower_bound_us']:>12.1f}",
              f"peak memory {c['peak_memory_bytes'] / GIB:.3f} GiB, exposed comm {c['exposed_comm_us']:.1f} us, "
              f"solver {c['solver']['status']} in {c['solver']['wall_s']:.2f} s",
              f"schedule hash {c['hash'][:16]}" + (f", written to {c['output']}" if c["output"] else "")]
    return "\n".join(lines)


def compile_command(p: argparse.ArgumentParser):
    add_compile_args(p)

    def run(args) -> int:
        layer, result = compile_from_args(args)
        if args.output:
            result.schedule.save(args.output)
        summary = compile_summary(layer, result, args.output)
        print(json.dumps(summary, indent=1) if args.json else format_compile(summary))
        return 0
    return run


def load_schedule(path: str) -> Schedule:
    if not Path(path).is_file():
        raise FileNotFoundError(f"no schedule file {path!r}")
    try:
        return Schedule.load(path)
    except (ValueError, KeyError, TypeError) as err:
        raise ScheduleError(f"{path}: not a moegraph schedule file: {err}") from err


def verify_command(p: argparse.ArgumentParser):
    p.add_argument("schedule", metavar="SCHED.json")

    def run(args) -> int:
        from schedules.verify import verify_schedule
        violations = verify_schedule(load_schedule(args.schedule))
        if violations:
            print(f"{args.schedule}: {violations[0]}", file=sys.stderr)
            if len(violations) > 1:
                print(f"({len(violations) - 1} more violations)", file=sys.stderr)
            return 1
        print(f"{args.schedule}: ok")
        return 0
    return run


def gantt_command(p: argparse.ArgumentParser):
    p.add_argument("schedule", metavar="SCHED.json")
    p.add_argument("-o", "--output", required=True, metavar="OUT.{png,svg,html,json}")
    p.add_argument("--compare", default=None, metavar="OTHER.json", help="draw a second schedule on the same axis")

    def run(args) -> int:
        from moegraph.cli import UsageError
        from schedules.gantt import render
        suffix = Path(args.output).suffix
        if suffix not in (".png", ".svg", ".html", ".json"):
            raise UsageError(f"-o {args.output}: extension {suffix or '(none)'} is not one of .png, .svg, .html, .json")
        other = load_schedule(args.compare) if args.compare else None
        render(load_schedule(args.schedule), args.output, compare=other)
        print(f"wrote {args.output}")
        return 0
    return run
