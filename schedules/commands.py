"""`moegraph compile`, `moegraph verify`, `moegraph gantt`."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
from pathlib import Path

from moegraph.commands import (add_layer_args, add_memory_budget_arg, add_micro_batch_arg, layer_from_args, print_result,
                               progress_on_stderr)
from moegraph.cost import variant
from moegraph.edges import edge_values
from moegraph.microbatch import micro_batch_count
from moegraph.layers import layer_count
from moegraph.options import UsageError, check_output, format_bytes, make_parents, positive_float
from moegraph.schedules.api import METHODS, MICROBATCH_METHODS, compile_graph, model_step
from moegraph.schedules.problem import ScheduleError
from moegraph.schedules.schedule_file import Schedule, dp_sync_exposure, group_label, per_layer_summary



def add_compile_args(p: argparse.ArgumentParser) -> None:
    add_layer_args(p)
    add_memory_budget_arg(p)
    p.add_argument("--time-limit", type=positive_float, default=10.0, metavar="S",
                   help="CP-SAT search effort in deterministic seconds (default %(default)s); a memory budget "
                        "that binds costs two solves of S (without the budget first)")
    p.add_argument("--schedule", default="cpsat", choices=METHODS + MICROBATCH_METHODS,
                   help="how to schedule: CP-SAT or one of the baselines; megatron-1f1b and dualpipe need "
                        "--micro-batches M >= 2 (default %(default)s)")
    add_micro_batch_arg(p)
    p.add_argument("--comm-streams", type=int, default=1, choices=(1, 2),
                   help="1: one comm stream; 2: intra- and inter-node comm streams (default %(default)s)")
    p.add_argument("-o", "--output", default=None, metavar="SCHED.json", help="write the schedule file here")


def compile_from_args(args):
    if args.output is not None:
        check_output(args.output, suffixes=(".json",))
    if args.schedule in MICROBATCH_METHODS and args.micro_batches < 2:
        raise UsageError(f"--schedule {args.schedule} pairs one micro-batch's forward with another's backward: "
                         f"it needs --micro-batches M >= 2 (got {args.micro_batches})")
    layer = layer_from_args(args, multi_layer=True)
    # a model step (one micro-batch or the merged step of M): the embedding, final norm and LM
    # head gradients are synchronised by graph collectives the scheduler places
    layer = dataclasses.replace(layer, graph=model_step(layer.graph))
    streams = comm_streams_from(args)
    result = compile_graph(layer.graph, layer.cost, memory_budget_bytes=args.memory_budget,
                           time_limit_s=args.time_limit, comm_streams=streams, method=args.schedule)
    return layer, result


def comm_streams_from(args: argparse.Namespace) -> tuple[str, ...]:
    """--comm-streams 1: one stream; 2: intra- and inter-node streams (docs/scheduler.md)."""
    return ("comm",) if args.comm_streams == 1 else ("comm.intra", "comm.inter")


def dp_summary(layer, result, comm_streams) -> dict:
    """DP sync of a dp > 1 step: scheduled and exposed (schedule_file.dp_sync_exposure), and the
    least exposure any schedule could have (bound.dp_sync_exposure_bound), so a large exposure
    can be told apart from an unavoidable one."""
    from moegraph.schedules.bound import dp_sync_exposure_bound
    from moegraph.schedules.problem import build_problem
    bound = dp_sync_exposure_bound(build_problem(layer.graph, layer.cost, comm_streams=comm_streams))
    return {**dp_sync_exposure(result.schedule.nodes), "exposed_dp_sync_bound_us": round(bound, 3)}


def baseline_peaks(layer, comm_streams, budget: int) -> dict[str, int]:
    """Each baseline's peak memory, so the table can mark those that break ``budget``: their
    makespans are listed for comparison, but a schedule over the budget is no alternative."""
    from moegraph.schedules.baselines import baselines_for
    from moegraph.schedules.problem import build_problem
    from moegraph.schedules.solution import peak_memory_bytes
    problem = build_problem(layer.graph, layer.cost, comm_streams=comm_streams, memory_budget_bytes=budget)
    return {name: peak_memory_bytes(problem, fn(problem)) for name, fn in baselines_for(problem).items()}


def compile_summary(layer, result, output: str | None, comm_streams=("comm",), memory_budget: int | None = None) -> dict:
    s = result.schedule.summary
    return {"model": layer.model.name, "hardware": layer.hardware.name,
            "strategy": layer.graph.strategy.as_dict(), "makespan_us": s["makespan_us"],
            "lower_bound_us": s["lower_bound_us"], "baselines": s["baselines"],
            "peak_memory_bytes": s["peak_memory_bytes"], "exposed_comm_us": s["exposed_comm_us"],
            "source": result.source, "status": result.status,
            "solver": {**s["solver"], "wall_s": round(result.wall_s, 3), "wall_cap_hit": result.wall_cap_hit},
            "nodes": len(result.schedule.nodes), "hash": result.schedule.hash, "output": output,
            "variants": dict(collections.Counter(variant(n) for n in layer.graph.nodes)),
            "passes": layer.report, "micro_batches": micro_batch_count(layer.graph),
            **({"layers": _with_embed_grad(per_layer_summary(result.schedule), layer.graph)}
               if layer_count(layer.graph) > 1 else {}),
            **(dp_summary(layer, result, comm_streams) if layer.graph.strategy.dp > 1 else {}),
            **({"memory_budget_bytes": memory_budget,
                "baseline_peak_memory_bytes": baseline_peaks(layer, comm_streams, memory_budget)}
               if memory_budget is not None else {})}


def _with_embed_grad(rows: list[dict], graph) -> list[dict]:
    """The per-layer rows, the "edges" row noting the embedding gradient's pattern across the
    replicas (moegraph.edges.EmbedGrad: "rows" or "partial")."""
    edges = edge_values(graph)
    if edges is None:
        return rows
    return [r | {"embed_grad": edges.embed_grad.value} if r["layer"] == "edges" else r for r in rows]


def format_compile(c: dict) -> str:
    mbs = f", {c['micro_batches']} micro-batches" if c.get("micro_batches", 1) > 1 else ""
    bound = c["lower_bound_us"] or 1.0
    budget, peaks = c.get("memory_budget_bytes"), c.get("baseline_peak_memory_bytes", {})
    # the returned schedule's row is marked *; a baseline that is the returned schedule is not
    # listed twice, and the name column fits the longest name (megatron-1f1b)
    rows = [(f"{c['source']} *", c["makespan_us"]),
            *((k, v) for k, v in sorted(c["baselines"].items()) if k != c["source"])]
    width = max(12, *(len(name) for name, _ in rows))
    over = [name for name, _ in rows if budget is not None and peaks.get(name, 0) > budget]
    lines = [f"{c['model']} on {c['hardware']}: {c['nodes']} nodes{mbs}, strategy "
             + " ".join(f"{k}={c['strategy'][k]}" for k in ("attn", "ffn", "dispatch", "n", "chunks", "remat", "gate"))
             + (f" dp={c['strategy']['dp']}" if c["strategy"].get("dp", 1) > 1 else ""),   # replicas: more nodes
             f"{'schedule':<{width}} {'makespan us':>12} {'vs bound':>9}"]
    for name, span in rows:
        note = f"  over budget: peak {format_bytes(peaks[name])}" if name in over else ""
        lines.append(f"{name:<{width}} {span:>12.1f} {span / bound:>8.3f}x{note}")
    lines.append(f"{'lower bound':<{width}} {c['lower_bound_us']:>12.1f}   (* returned)")
    if over:
        lines.append(f"{', '.join(over)} break the memory budget {format_bytes(budget)}: listed for comparison "
                     "only, not schedules within the budget")
    lines += [f"peak memory {format_bytes(c['peak_memory_bytes'])}, exposed comm {c['exposed_comm_us']:.1f} us, "
              f"returned: {c['source']} ({c['status']}); solver {c['solver']['status']} in "
              f"{c['solver']['wall_s']:.2f} s",
              f"schedule hash {c['hash'][:16]}" + (f", written to {c['output']}" if c["output"] else "")]
    if "layers" in c:
        count = sum(isinstance(r["layer"], int) for r in c["layers"])
        lines.append(f"{count} layers, exposed comm per layer (us): "
                     + " ".join(f"{group_label(r['layer'])} {r['exposed_comm_us']:.1f}" for r in c["layers"]))
        lines += [f"embedding gradient across replicas: {r['embed_grad']}" for r in c["layers"]
                  if "embed_grad" in r and c["strategy"].get("dp", 1) > 1]
    return "\n".join(lines)


def compile_command(p: argparse.ArgumentParser):
    add_compile_args(p)

    def run(args) -> int:
        with progress_on_stderr("moegraph.schedules"):
            layer, result = compile_from_args(args)
        if args.output:
            result.schedule.save(make_parents(args.output))
        summary = compile_summary(layer, result, args.output, comm_streams=comm_streams_from(args),
                                  memory_budget=args.memory_budget)
        print_result(summary, args.json, format_compile)
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
    p.add_argument("schedule", metavar="SCHED.json", help="a schedule file written by compile, tune or run --trace")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (ok, origin, violations, skipped checks) instead of text")

    def run(args) -> int:
        from moegraph.schedules.verify import verdict
        v = verdict(load_schedule(args.schedule))
        if args.json:
            print(json.dumps({"file": args.schedule, **v.to_dict()}, indent=1))
            return 0 if v.ok else 1
        if not v.ok:      # one line: the first violation; --json lists them all and counts them
            more = (f" ({len(v.violations) - 1} more violation{'s' if len(v.violations) > 2 else ''}: --json "
                    "lists them)") if len(v.violations) > 1 else ""
            print(f"{args.schedule}: {v.violations[0]}{more}", file=sys.stderr)
            return 1
        skipped = f" ({v.origin} file; not checked: {', '.join(k for k, _ in v.skipped)})" if v.skipped else ""
        print(f"{args.schedule}: ok{skipped}")
        return 0
    return run


def gantt_command(p: argparse.ArgumentParser):
    p.add_argument("schedule", metavar="SCHED.json", help="a schedule file written by compile, tune or run --trace")
    p.add_argument("-o", "--output", required=True, metavar="OUT.{png,svg,html,json}",
                   help="the chart; .json is Chrome Trace Event format (Perfetto)")
    p.add_argument("--compare", default=None, metavar="OTHER.json", help="draw a second schedule on the same axis")
    p.add_argument("--json", action="store_true", help="print one JSON object (the file written, the panels drawn)")

    def run(args) -> int:
        from moegraph.schedules.gantt import check_drawable, labels, render
        from moegraph.schedules.verify import verdict
        check_output(args.output, suffixes=(".png", ".svg", ".html", ".json"))
        files = [f for f in (args.schedule, args.compare) if f]
        scheds = [load_schedule(f) for f in files]
        for f, s in zip(files, scheds):
            check_drawable(s, f)   # before anything is written
        # a damaged file is still drawn (users inspect them), but never passes for a valid one:
        # one warning line each, and the panel is marked NOT VALID
        not_valid = []
        for f, s in zip(files, scheds):
            bad = verdict(s).violations
            if bad:
                more = f" ({len(bad) - 1} more)" if len(bad) > 1 else ""
                print(f"warning: {f} does not verify: {bad[0]}{more}", file=sys.stderr)
            not_valid.append(bool(bad))
        sources = tuple(Path(f).name for f in files)
        render(scheds[0], make_parents(args.output), compare=scheds[1] if args.compare else None, sources=sources,
               not_valid=tuple(not_valid))
        if args.json:
            print(json.dumps({"output": args.output, "panels": [
                {"file": f, "label": label, "origin": s.origin, "makespan_us": s.makespan_us, "valid": not bad}
                for f, s, label, bad in zip(files, scheds, labels(scheds, sources, tuple(not_valid)), not_valid)]},
                indent=1))
        else:
            print(f"wrote {args.output}")
        return 0
    return run
