"""`moegraph compile`, `moegraph verify`, `moegraph gantt`, `moegraph tune`: their flags and output.

The library behind them: the driver (``moegraph.schedules.driver``), ``verify``, ``gantt`` and
``tune``."""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

from moegraph.commands import (add_layer_args, add_layers_arg, add_memory_budget_arg, add_micro_batch_arg,
                               add_pipeline_args, config_from_args, print_result, progress_on_stderr,
                               resolve_layers)
from moegraph.config import LAUNCH_ORDERS, SolverEffort
from moegraph.cost import variant
from moegraph.limits import check_graph_size
from moegraph.edges import edge_values
from moegraph.microbatch import micro_batch_count
from moegraph.layers import layer_count
from moegraph.options import (UsageError, check_distinct_files, check_output, check_output_dir, format_bytes,
                              fraction, make_parents, positive_float, positive_int)
from moegraph.registry import load_hardware, load_model
from moegraph.schedules.api import METHODS, MICROBATCH_METHODS
from moegraph.schedules.driver import COMM_STREAMS, build
from moegraph.schedules.schedule_file import Schedule, dp_sync_exposure, group_label, load_schedule, per_layer_summary
from moegraph.schedules.tune import Cache, format_table, over_device_note, tune
from moegraph.strategy import node_fields



def add_compile_args(p: argparse.ArgumentParser) -> None:
    add_layer_args(p, pipeline=True)
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
    p.add_argument("--launch-order", default="free", choices=LAUNCH_ORDERS,
                   help="free: a hardware queue per stream; program or megatron-1f1b: one queue "
                        "(CUDA_DEVICE_MAX_CONNECTIONS=1) fed in that order, megatron-1f1b needs --micro-batches "
                        "M >= 2 (default %(default)s)")
    p.add_argument("--no-copy-engines", dest="copy_engines", action="store_false",
                   help="schedule every collective on SMs (no SM budget 0): what `run --backend nccl` runs, "
                        "which refuses a schedule file that gives a collective budget 0 (docs/runtime.md)")
    p.add_argument("-o", "--output", default=None, metavar="SCHED.json|ORDERS.csv",
                   help="write the schedule file here; with --pp, the returned order as torch's action CSV "
                        "(.csv: _PipelineScheduleRuntime._load_csv reads it)")
    add_pipeline_args(p, search=True)


def _model_files(args) -> list[tuple[str, str]]:
    """The files a command reads for --model and --hardware (a registry name reads none)."""
    return [(f"--{flag}", value) for flag in ("model", "hardware")
            if isinstance(value := getattr(args, flag, None), str) and Path(value).is_file()]


def compile_from_args(args):
    """(the lowered graph, the CompileResult) of `moegraph compile`'s flags, built by the driver."""
    if args.output is not None:
        check_output(args.output, suffixes=(".csv",) if args.pp > 1 else (".json",))
        check_distinct_files([("-o", args.output)], _model_files(args))
    if args.schedule in MICROBATCH_METHODS and args.micro_batches < 2:
        raise UsageError(f"--schedule {args.schedule} pairs one micro-batch's forward with another's backward: "
                         f"it needs --micro-batches M >= 2 (got {args.micro_batches})")
    if args.launch_order == "megatron-1f1b" and args.micro_batches < 2:
        raise UsageError(f"--launch-order megatron-1f1b launches one micro-batch's forward beside another's backward: "
                         f"it needs --micro-batches M >= 2 (got {args.micro_batches})")
    # a model step (one micro-batch or the merged step of M): for a stack, the embedding, final
    # norm and LM head gradients are synchronised by graph collectives the scheduler places
    config = config_from_args(args, multi_layer=True, edges="auto", schedule=args.schedule,
                              memory_budget=args.memory_budget, solver=SolverEffort(args.time_limit),
                              comm_streams=args.comm_streams, launch_order=args.launch_order,
                              copy_engines=args.copy_engines)
    compiled = build(config)
    return compiled.lowered, compiled.result


def comm_streams_from(args: argparse.Namespace) -> tuple[str, ...]:
    """--comm-streams 1: one stream; 2: intra- and inter-node streams (docs/scheduler.md)."""
    return COMM_STREAMS[args.comm_streams]


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


def compile_summary(layer, result, output: str | None, comm_streams=("comm",), memory_budget: int | None = None,
                    copy_engines: bool = True) -> dict:
    s = result.schedule.summary
    return {"model": layer.model.name, "hardware": layer.hardware.name, "copy_engines": copy_engines,
            "strategy": layer.graph.strategy.as_dict(), "makespan_us": s["makespan_us"],
            "lower_bound_us": s["lower_bound_us"], "baselines": s["baselines"],
            "peak_memory_bytes": s["peak_memory_bytes"], "exposed_comm_us": s["exposed_comm_us"],
            "device_memory_bytes": layer.hardware.hbm_capacity_bytes, "source": result.source, "status": result.status,
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
    sm_only = "" if c.get("copy_engines", True) else " (collectives on SMs only: --no-copy-engines)"
    lines = [f"{c['model']} on {c['hardware']}{sm_only}: {c['nodes']} nodes{mbs}, strategy "
             + " ".join(f"{k}={c['strategy'][k]}" for k in ("attn", "ffn", "dispatch", "n", "chunks", "remat", "gate"))
             + node_fields(c["strategy"])
             + (f" dp={c['strategy']['dp']}" if c["strategy"].get("dp", 1) > 1 else ""),   # replicas: more nodes
             f"{'schedule':<{width}} {'makespan us':>12} {'vs bound':>9}"]
    for name, span in rows:
        note = f"  over budget: peak {format_bytes(peaks[name])}" if name in over else ""
        lines.append(f"{name:<{width}} {span:>12.1f} {span / bound:>8.3f}x{note}")
    lines.append(f"{'lower bound':<{width}} {c['lower_bound_us']:>12.1f}   (* returned)")
    if over:
        lines.append(f"{', '.join(over)} break the memory budget {format_bytes(budget)}: listed for comparison "
                     "only, not schedules within the budget")
    if note := over_device_note(c["peak_memory_bytes"], c.get("device_memory_bytes"), c["hardware"], budget):
        lines.append(note)
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
        if args.pp > 1:
            return compile_pipeline(args)
        with progress_on_stderr("moegraph.schedules"):
            layer, result = compile_from_args(args)
        if args.output:
            result.schedule.save(make_parents(args.output))
        summary = compile_summary(layer, result, args.output, comm_streams=comm_streams_from(args),
                                  memory_budget=args.memory_budget, copy_engines=args.copy_engines)
        print_result(summary, args.json, format_compile)
        return 0
    return run


def compile_pipeline(args) -> int:
    """`compile --pp`: the pipeline step (the driver's ``CompiledPipeline``), reported per order
    and per rank; -o writes the returned order as torch's action CSV."""
    from moegraph.schedules.pipeline_report import compile_summary, format_pipeline
    if args.output is not None:
        check_output(args.output, suffixes=(".csv",))
    config = config_from_args(args, multi_layer=True, schedule=args.schedule, memory_budget=args.memory_budget,
                              solver=SolverEffort(args.time_limit), comm_streams=args.comm_streams,
                              launch_order=args.launch_order, copy_engines=args.copy_engines)
    with progress_on_stderr("moegraph.schedules"):
        compiled = build(config)
    if args.output:
        compiled.write_csv(make_parents(args.output))
    print_result(compile_summary(compiled, args.output), args.json, format_pipeline)
    return 0


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
        check_distinct_files([("-o", args.output)], [("SCHED.json", args.schedule), ("--compare", args.compare)])
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


def tune_command(p: argparse.ArgumentParser):
    p.add_argument("--model", default="mixtral-8x7b", help="registry name or YAML path (default %(default)s)")
    p.add_argument("--hardware", default="h800", help="registry name or profile YAML (default %(default)s)")
    p.add_argument("--n", type=positive_int, default=8, help="group size n (default %(default)s)")
    p.add_argument("--batch", type=positive_int, default=1, help="micro-batch b (default %(default)s)")
    p.add_argument("--seq", type=positive_int, default=8192, help="sequence length s (default %(default)s)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="activation dtype (default %(default)s)")
    add_layers_arg(p, pipeline=True)
    add_memory_budget_arg(p)
    add_micro_batch_arg(p)
    add_pipeline_args(p)
    p.add_argument("--time-limit", type=positive_float, default=5.0, metavar="S",
                   help="CP-SAT effort per refined candidate, deterministic seconds (default %(default)s)")
    p.add_argument("--refine", type=positive_int, default=3, help="candidates refined by CP-SAT, plus the best of "
                   "each attn x ffn family; under --memory-budget every candidate whose greedy schedule breaks the "
                   "budget (but whose memory bound fits) is scheduled by CP-SAT too (default %(default)s)")
    p.add_argument("--cache", default=os.environ.get("MOEGRAPH_CACHE", ".moegraph-cache"),
                   help="cache folder ('' disables; not used with --pp; default %(default)s)")
    p.add_argument("-o", "--output", default=None, metavar="BEST.json|BEST.csv",
                   help="best schedule file (default out/tune-best.json; with --pp the best order as torch's "
                        "action CSV, default out/tune-best.csv; '' ranks only, writing nothing)")
    p.add_argument("--gantt", default=None, help="Gantt chart of the best schedule (default: OUTPUT with .png)")
    p.add_argument("--min-gain", type=fraction, default=None, metavar="FRACTION",
                   help="keep the tp+tp sequential baseline unless the best candidate is predicted this much "
                        "faster (default: the profile's step_noise; 0 for registry profiles)")
    p.add_argument("--fuse", action="store_true",
                   help="also rank each candidate with its tile-level fused comm+compute groups (fuse=auto); "
                        "`run` executes a fused schedule's groups as their member kernels")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    def run(args) -> int:
        if args.pp > 1:
            return tune_pipeline_command(args)
        args.output = "out/tune-best.json" if args.output is None else args.output
        if args.min_gain is not None and not args.min_gain < 1:
            raise UsageError(f"--min-gain={args.min_gain} must be a fraction in [0, 1) (0.05 = 5%)")
        model = load_model(args.model)
        layers = resolve_layers(args.layers, model)
        check_graph_size(layers=layers, micro_batches=args.micro_batches, n=args.n)   # before any graph
        if args.cache:
            check_output_dir(args.cache, flag="--cache")
        if args.output == "" and args.gantt:
            raise UsageError(f"--gantt {args.gantt!r} draws the best schedule tune writes; with -o '' it writes "
                             "none: give -o BEST.json, or leave --gantt out")
        if args.output:
            check_output(args.output, suffixes=(".json",))
            gantt = args.gantt or str(Path(args.output).with_suffix(".png"))
            check_output(gantt, flag="--gantt", suffixes=(".png", ".svg", ".html", ".json"))
            check_distinct_files([("-o", args.output), ("--gantt", gantt)], _model_files(args))
        budget = args.memory_budget
        t0 = time.perf_counter()

        def say(msg: str) -> None:
            # tune()'s own lines carry their elapsed time; the writing steps get the same clock
            print(msg if msg.startswith("[") else f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr,
                  flush=True)
        res = tune(model, load_hardware(args.hardware), n=args.n, batch=args.batch, seq=args.seq, layers=layers,
                   dtype=args.dtype, memory_budget=budget, time_limit=args.time_limit, refine=args.refine,
                   cache=Cache(Path(args.cache) if args.cache else None), min_gain=args.min_gain,
                   micro_batches=args.micro_batches,
                   progress=say, fuse=args.fuse)
        schedule_json = res.pop("_best_schedule")
        if args.output:
            say(f"writing {args.output} and its Gantt chart")
            sched = Schedule.from_json(schedule_json)
            gantt = args.gantt or str(Path(args.output).with_suffix(".png"))
            Path(gantt).unlink(missing_ok=True)    # a kill between the two writes leaves no chart of another pick
            sched.save(make_parents(args.output))
            from moegraph.schedules.gantt import render
            render(sched, make_parents(gantt))
            res |= {"schedule_file": args.output, "gantt": gantt}
            say(f"wrote {args.output} and {gantt}")
        print_result(res, args.json, format_table)
        return 0
    return run


def tune_pipeline_command(args) -> int:
    """`tune --pp`: strategies ranked by the predicted whole pipeline step (schedules/tune_pipeline.py);
    -o writes the best order as torch's action CSV, --gantt its chart."""
    from moegraph.commands import pipeline_fields
    from moegraph.config import CompileConfig, config_layers
    from moegraph.ir import Strategy
    from moegraph.limits import MAX_MICRO_BATCHES, check_limit
    from moegraph.schedules.pipeline_gantt import render_pipeline
    from moegraph.schedules.tune_pipeline import format_pipeline_table, tune_pipeline
    for flag, value in (("--fuse", args.fuse), ("--min-gain", args.min_gain is not None)):
        if value:
            raise UsageError(f"{flag} is not supported with --pp (tune --pp ranks unfused candidates by their "
                             "predicted step)")
    output = "out/tune-best.csv" if args.output is None else args.output
    check_output(output, suffixes=(".csv",))
    gantt = args.gantt or str(Path(output).with_suffix(".png"))
    check_output(gantt, flag="--gantt", suffixes=(".png", ".svg"))
    check_distinct_files([("-o", output), ("--gantt", gantt)], _model_files(args))
    model = load_model(args.model)
    fields = pipeline_fields(args)
    check_graph_size(layers=2, n=args.n, stages=fields["pp"] * fields["vpp"])    # as config_from_args with --pp
    check_limit("micro-batches", args.micro_batches, MAX_MICRO_BATCHES)
    base = CompileConfig(model=model, strategy=Strategy("tp", "tp", "ag-rs", args.n, dtype=args.dtype), passes=(),
                         layers="all" if args.layers is None else args.layers, batch=args.batch, seq=args.seq,
                         micro_batches=args.micro_batches, memory_budget=args.memory_budget,
                         solver=SolverEffort(args.time_limit), hardware=args.hardware, **fields)
    config_layers(base, model)              # pp x vpp <= layers <= the model's, before any tracing
    t0 = time.perf_counter()
    res = tune_pipeline(base, refine=args.refine,
                        progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    best = res.pop("_best")
    from moegraph.schedules.pipeline_torch import write_csv
    Path(gantt).unlink(missing_ok=True)            # a kill between the two writes leaves no chart of another pick
    write_csv(best["_timeline"].orders, make_parents(output))
    render_pipeline(best["_timeline"], make_parents(gantt), title=f"{res['model']}: best pipeline step")
    print(f"[{time.perf_counter() - t0:6.1f}s] wrote {output} and {gantt}", file=sys.stderr)
    print_result(res | {"schedule_file": output, "gantt": gantt}, args.json, format_pipeline_table)
    return 0
