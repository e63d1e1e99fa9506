"""`moegraph run`: execute a compiled layer on N local ranks, measure it, optionally check it.

The parent process turns the flags into one ``CompileConfig`` (``config_from_args``: strategy,
passes), compiles it once with the driver (``moegraph.schedules.driver``: so N ranks do not each
run the scheduler), then spawns N ranks on loopback (``moegraph.runtime.timing.spawn_plans``).
Each rank builds the reference layer ``MoETransformerLayer.from_config`` with the same seeded
random weights, shards it, and runs warm-up + K steps (forward + backward). Step time of a step
= the slowest rank's; the report gives the median over the K steps.

``--dp D`` runs n x D ranks (``world_size``): D replicas of the n-rank group, replica-major
(``moegraph.runtime.layout.Layout``). The seeded input is the global batch [D*b, s, h];
replica p trains on rows p*b .. (p+1)*b - 1 (``CompiledLayer.shard_input``).

``--micro-batches M`` (M >= 2) runs one optimizer step of M micro-batches (gradient
accumulation) as the merged step graph (``moegraph.passes.microbatch``): scheduled whole (cpsat,
or the paired baselines megatron-1f1b / dualpipe, or sequential), run by
``CompiledLayer.train_step``; the step time is the whole step's. ``--check`` compares every
parameter gradient (summed over the M micro-batches) and each micro-batch's output and input
gradient with eager gradient accumulation on the same seeded micro-batches.

This module is the command line (flags, their checks, the report's assembly); the work is in
``timing`` (ranks and step times), ``training`` (--train-steps), ``device_memory`` (memory lines and
limits), ``trace`` (--trace files) and ``report`` (the text report).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moegraph.commands import (add_layer_args, add_memory_budget_arg, add_micro_batch_arg, config_from_args,
                               print_result, resolve_layers)
from moegraph.config import CompileConfig, ModelEdges, SolverEffort
from moegraph.ir import EXPERT_ROWS, ConfigError, Strategy
from moegraph.layers import layer_count
from moegraph.microbatch import micro_batch_count
from moegraph.options import UsageError, non_negative_int, positive_float, positive_int
from moegraph.pass_steps import parse_passes, step_label
from moegraph.runtime import CUDA_GRAPH_MODES
from moegraph.runtime.device_memory import check_rank_memory, memory_report
from moegraph.runtime.netns import add_link_args, emulated_link, link_from_args, link_mismatch
from moegraph.runtime.options import RuntimeOptions
from moegraph.runtime.report import format_report
from moegraph.runtime.schedule_check import check_schedule_file
from moegraph.runtime.timing import progress, rank_traces, spawn_plans, step_stats
from moegraph.runtime.trace import trace_paths, write_traces
from moegraph.schedules.api import METHODS, MICROBATCH_METHODS
from moegraph.schedules.driver import lower


LAYER_FLAGS = ("model", "hardware", "attn", "ffn", "dispatch", "n", "batch", "seq", "top_k", "dtype", "dp", "ep_nodes",
               "attn_nodes", "passes", "micro_batches", "layers")

VOCAB_DEFAULT = 1024        # run --vocab's default: the --train-steps model's vocabulary when no file sets it

@dataclass(frozen=True)
class Unset:
    """A flag's default, marked so ``run`` can tell it from a value given on the command line."""

    value: Any

    def __str__(self) -> str:
        return str(self.value)

def schedule_arg(text: str) -> "str | Path":
    """--schedule value: a method name (``moegraph.schedules`` METHODS, or MICROBATCH_METHODS with
    --micro-batches), or a schedule file written by ``compile`` or ``tune``."""
    if text in METHODS + MICROBATCH_METHODS:
        return text
    if text.endswith(".json"):
        return Path(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(METHODS)}, "
                                     f"{', '.join(MICROBATCH_METHODS)} (with --micro-batches) or a schedule file (.json)")

MAX_LOCAL_RANKS = 64      # local CPU (gloo) ranks the launcher starts at most (as calibrate --n)

def world_size(args: argparse.Namespace) -> int:
    """n x dp ranks to launch; a UsageError (before any work) when this machine cannot start them:
    nccl needs one CUDA device per rank, gloo at most MAX_LOCAL_RANKS local processes."""
    world = args.n * args.dp
    what = f"--n {args.n} x --dp {args.dp} = {world} ranks" if args.dp > 1 else f"--n {args.n} ranks"
    if args.backend == "nccl":
        import torch
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < world:
            need = f"{world} CUDA devices" + (f" ({what})" if args.dp > 1 else "")
            raise UsageError(f"--backend nccl needs {need}, this machine has {have}")
    elif world > MAX_LOCAL_RANKS:
        raise UsageError(f"{what}: the gloo launcher starts at most {MAX_LOCAL_RANKS} local ranks")
    return world

CPU_PROFILES = frozenset({"cpu-gloo", "cpu-2core-gloo", "cpu-2core-gloo-1gbit"})      # the shipped CPU profiles: not for --backend nccl

def run_command(p: argparse.ArgumentParser):
    add_layer_args(p, model_default="tiny")
    add_micro_batch_arg(p)
    # the shipped calibrated CPU profile: the uncalibrated cpu-gloo placeholder predicts ~-86% off
    # (--backend nccl refuses the CPU profiles, see ``run``)
    p.set_defaults(seq=128, n=2, dtype="fp32", hardware="cpu-2core-gloo")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                   help="gloo: CPU ranks; nccl: one CUDA device per rank (default %(default)s)")
    p.add_argument("--schedule", default="cpsat", type=schedule_arg, metavar="METHOD|FILE.json",
                   help=f"a scheduling method ({', '.join(METHODS)}; with --micro-batches also "
                        f"{', '.join(MICROBATCH_METHODS)}), or a schedule file written by compile "
                        "or tune: its model, strategy, passes and hardware are used, and any of those flags "
                        "given must agree with it (default %(default)s)")
    p.add_argument("--steps", type=positive_int, default=5, help="measured steps (default %(default)s)")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="unmeasured steps first (default %(default)s)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="weights and inputs seed (default %(default)s)")
    p.add_argument("--check", action="store_true",
                   help="compare output and every gradient with the eager unsharded module")
    p.add_argument("--train-steps", type=positive_int, default=None, metavar="K",
                   help="instead of timing the layers: train the whole model (moegraph.models.MoETransformer "
                        "with --layers layers) K AdamW steps, compiled on the N ranks; with --check, compare "
                        "every step's loss and the final parameters with the eager model trained the same way")
    p.add_argument("--vocab", type=positive_int, default=VOCAB_DEFAULT, metavar="V",
                   help="vocabulary size of the --train-steps model (the registry has none; default %(default)s)")
    p.add_argument("--trace", metavar="OUT", help="write the measured schedule file (OUT), the predicted one "
                   "(OUT with suffix .predicted.json) and a Chrome trace (suffix .chrome.json)")
    p.add_argument("--compare-prediction", action="store_true",
                   help="per-node and total error of the cost model against the measured steps")
    add_memory_budget_arg(p)
    add_link_args(p)
    g = p.add_argument_group("pipeline stages (docs/pipeline.md)")
    # dests of their own: config_from_args reads args.pp as compile's pipeline options (with --vocab
    # a pipeline-only flag there, while run's --vocab sizes --train-steps' model)
    g.add_argument("--pp", dest="pp_ranks", type=positive_int, default=1, metavar="P",
                   help="train the model (--layers, default all) as P pipeline stages on P x n gloo ranks, "
                        "--steps AdamW steps of --micro-batches M, in the order compile --pp finds (default 1)")
    g.add_argument("--vpp", dest="pp_vpp", type=positive_int, default=1, metavar="V",
                   help="stages per pipeline rank (default 1)")
    g.add_argument("--placement", dest="pp_placement", default="loop", choices=("loop", "v"),
                   help="where a rank's V stages sit (docs/pipeline.md; default %(default)s)")
    p.add_argument("--time-limit", type=positive_float, default=10.0, metavar="S",
                   help="CP-SAT search effort in deterministic seconds (default %(default)s)")
    p.add_argument("--timeout", type=positive_float, default=120.0,
                   help="seconds any collective may take before the run fails naming it (default %(default)s)")
    p.add_argument("--cuda-graphs", default="off", choices=CUDA_GRAPH_MODES, metavar="MODE",
                   help="replay CUDA graphs (--backend nccl): attention = each phase's static prefix and suffix "
                        "(the attention block with its collectives), layer = whole phases (refused, naming the "
                        "node, where routing makes shapes data-dependent); no per-node traces then. "
                        f"One of {', '.join(CUDA_GRAPH_MODES)} (default %(default)s)")
    p.add_argument("--expert-rows", default="exact", choices=EXPERT_ROWS, metavar="ROWS",
                   help="rows of the local index map (--ffn ep --dispatch ag-rs): exact = this step's routed rows "
                        "(one host read per map), padded = the static worst case T*min(k, E/n), still dropless, no "
                        "host read, so --cuda-graphs layer captures it; costs memory, reported as "
                        f"padded_rows_extra_bytes. One of {', '.join(EXPERT_ROWS)} (default %(default)s)")
    p.set_defaults(**{flag: Unset(p.get_default(flag)) for flag in LAYER_FLAGS})

    def handler(args) -> int:
        print_result(run(args), args.json, format_report)
        return 0
    return handler

def resolve_layer_args(args: argparse.Namespace) -> tuple[argparse.Namespace, Any]:
    """(args with every layer flag set, the Schedule of ``--schedule FILE.json`` or None).

    With a schedule file, the flags not given come from the file; a given one that disagrees
    with it is a UsageError naming both values."""
    given = {f: getattr(args, f) for f in LAYER_FLAGS if not isinstance(getattr(args, f, None), Unset)}
    plain = argparse.Namespace(**{**vars(args), **{f: getattr(args, f).value for f in LAYER_FLAGS
                                                   if isinstance(getattr(args, f, None), Unset)}})
    if not isinstance(args.schedule, Path):
        return plain, None
    from moegraph.ir import LAYER_ATTR
    from moegraph.microbatch import MB_ATTR
    from moegraph.registry import RegistryError, load_hardware
    from moegraph.schedules.schedule_file import Schedule, ScheduleFormatError
    path = args.schedule
    try:
        schedule = Schedule.load(path)
    except FileNotFoundError:
        raise UsageError(f"--schedule {path}: no such file") from None
    except (OSError, UnicodeDecodeError, ScheduleFormatError) as err:
        raise UsageError(f"--schedule {path}: not a schedule file ({err})") from None
    g, st = schedule.graph, schedule.graph.get("strategy", {})
    try:
        from_file = {"model": g["name"], "hardware": schedule.hardware["name"], "attn": st["attn"], "ffn": st["ffn"],
                     "dispatch": st["dispatch"], "n": st["n"], "batch": g["dims"]["b"], "seq": g["dims"]["s"],
                     "top_k": g["dims"]["k"], "dtype": st["dtype"], "dp": st["dp"],
                     "ep_nodes": st.get("ep_nodes", 1), "attn_nodes": st.get("attn_nodes", 1),
                     "passes": tuple(st["passes"]),
                     # a merged step's nodes carry their micro-batch (moegraph.microbatch.MB_ATTR)
                     "micro_batches": len({n.attrs[MB_ATTR] for n in schedule.nodes if n.attrs.get(MB_ATTR) is not None})
                     or 1,
                     # a stack's nodes carry their layer index (moegraph.layers)
                     "layers": 1 + max((n.attrs[LAYER_ATTR] for n in schedule.nodes
                                        if n.attrs.get(LAYER_ATTR) is not None), default=0)}
    except (KeyError, TypeError) as err:
        raise UsageError(f"--schedule {path}: its graph or hardware misses {err}") from None
    try:
        # the graph is rebuilt from this typed value (CompileConfig passes=RECORDED), not from its labels
        strategy = Strategy.from_dict(st)
    except (ConfigError, TypeError) as err:
        raise UsageError(f"--schedule {path}: its strategy is not valid ({err})") from None
    for flag, value in given.items():
        want = from_file[flag]
        if flag == "layers" and value == "all":
            from moegraph.registry import load_model
            value = resolve_layers(value, load_model(given.get("model", from_file["model"])))
        if flag == "passes":            # the labels the given pipeline records, in run order (joined to be shown)
            value = ",".join(pipeline_labels(value)) or "none"
            want = ",".join(want) or "none"
        ok = (load_model_name(value) == want) if flag == "model" else (
            _hardware_name(value) == want if flag == "hardware" else value == want)
        if not ok:
            raise UsageError(f"--{flag.replace('_', '-')} {value} does not match the schedule file {path}, which has "
                             f"{flag.replace('_', '-')}={want} (leave the flag out to use the file's)")
    if "hardware" not in given:
        try:
            registry = load_hardware(from_file["hardware"]).to_dict()
        except (RegistryError, FileNotFoundError):
            registry = None
        if registry != schedule.hardware:
            raise UsageError(f"--schedule {path}: its hardware {from_file['hardware']!r} is not the registry profile "
                             "of that name; pass --hardware PATH to the profile it was compiled for")
    if "model" not in given:
        try:
            load_model_name(from_file["model"])
        except (RegistryError, FileNotFoundError):
            raise UsageError(f"--schedule {path}: its model {from_file['model']!r} is not in the registry; pass "
                             "--model PATH to the model it was compiled for") from None
    return argparse.Namespace(**{**vars(plain), **{f: v for f, v in from_file.items() if f not in given},
                                 "schedule_strategy": strategy}), schedule

def pipeline_labels(spec: str) -> tuple[str, ...]:
    """The labels a --passes pipeline records in a graph's strategy.passes (in stage order)."""
    from moegraph.passes import staged
    return tuple(step_label(step) for step in staged(parse_passes(spec)))

def _model_and_layers(args: argparse.Namespace) -> tuple[Any, int]:
    """The registry model and layer count ``args`` ask for (cheap: nothing traced)."""
    from moegraph.registry import load_model
    model = load_model(args.model)
    return model, resolve_layers(getattr(args, "layers", 1), model)

def _ranks_phrase(args: argparse.Namespace, world: int) -> str:
    return f"--n {args.n} x --dp {args.dp} = {world} gloo ranks" if args.dp > 1 else f"--n {args.n} gloo ranks"

def load_model_name(model: str) -> str:
    from moegraph.registry import load_model
    return load_model(model).name

def gpu_plan_on_cpu_note(hardware: str, device: str) -> str | None:
    """The note a CPU run of a plan priced for a shipped GPU profile carries (a schedule file
    compiled for h800, or --hardware h800 with gloo): its predicted step is that GPU's, set beside
    this machine's measurement. None where the two describe one machine (or a profile given as a
    file, which this cannot tell)."""
    from moegraph.registry import hardware_names
    if device != "cpu" or hardware in CPU_PROFILES or hardware not in hardware_names():
        return None
    return (f"the plan is priced for {hardware}, a GPU profile, and runs here on the CPU over gloo: its predicted "
            f"step is {hardware}'s, not this machine's; plan with --hardware cpu-2core-gloo (or a profile "
            "`calibrate` fitted here) to compare a prediction")


def _hardware_name(hardware: str) -> str:
    from moegraph.registry import load_hardware
    return load_hardware(hardware).name

def run_config(args: argparse.Namespace, schedule: Any, **fields: Any) -> CompileConfig:
    """The CompileConfig run's flags describe: --schedule METHOD, or (a schedule file) the file's
    strategy rebuilt as it records, its plan taken from the file (``compiled_plan``)."""
    method = args.schedule if isinstance(args.schedule, str) else "cpsat"     # a file: not scheduled here
    return config_from_args(args, multi_layer=True, schedule=method, memory_budget=args.memory_budget,
                            solver=SolverEffort(args.time_limit), **fields)

def check_runnable_model(name: str) -> None:
    """`run` builds moegraph's own layers and MoETransformer from a registry model's sizes; a
    Hugging Face config.json's family layers (its norms, activations, shared experts, vocabulary)
    are what it compiles, not what those would run: refused, pointing at the API that runs them."""
    from moegraph.registry import load_model
    model = load_model(name)
    if model.hf_config is not None:
        raise UsageError(f"--model {name}: run executes moegraph's own layers from a registry model's sizes, not a "
                         "Hugging Face family's; trace, compile and tune it, and run the family's module with "
                         "moegraph.compile(model, input_ids) (docs/api.md)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """`moegraph run`: every flag checked before any work, the config compiled by the driver (or
    a schedule file's graph rebuilt), the plan timed on spawned ranks; the report."""
    from moegraph.expert_rows import expert_rows_refusal, padded_rows_extra_bytes
    from moegraph.runtime.cudagraph import capture_refusal
    from moegraph.runtime.module import compiled_plan
    from moegraph.runtime.native_budgets import check_native_budgets, runnable_config
    from moegraph.runtime.plan import FUSED_AS_MEMBERS, ExecutionPlan, fused_group_count
    t0 = time.time()
    hardware_given = not isinstance(args.hardware, Unset)
    pp = getattr(args, "pp_ranks", 1)                 # code that builds run's args by hand may leave it out
    if pp == 1 and (getattr(args, "pp_vpp", 1) != 1 or getattr(args, "pp_placement", "loop") != "loop"):
        raise UsageError("--vpp and --placement apply to a pipeline: give --pp P (P >= 2)")
    if pp > 1 and isinstance(args.layers, Unset):
        args.layers = Unset("all")                    # a pipeline's stages cut the whole model by default
    args, schedule = resolve_layer_args(args)
    check_runnable_model(args.model)
    for flag in ("steps",):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag}={getattr(args, flag)} must be a positive integer")
    if args.warmup < 0 or args.timeout <= 0:
        raise UsageError(f"--warmup={args.warmup} must be >= 0 and --timeout={args.timeout} > 0")
    check_cuda_graph_args(args)
    if args.trace:
        from moegraph.options import check_distinct_files
        written = trace_paths(args.trace)             # refused before the ranks run, not after
        check_distinct_files([("--trace", p) for p in written.values()],
                             [("--schedule", args.schedule)] if isinstance(args.schedule, Path) else [])
    if args.expert_rows != "exact" and args.train_steps is not None:
        raise UsageError(f"--expert-rows {args.expert_rows} applies to the timed layer; --train-steps trains a whole "
                         "model with exact expert rows (leave --expert-rows out)")
    link = link_from_args(args)
    if link is not None and args.backend != "gloo":
        raise UsageError(f"--link {link} shapes gloo's loopback sockets; --backend {args.backend} moves data "
                         f"over the GPUs' own links, which it cannot shape")
    check_micro_batch_args(args)
    if pp > 1:
        return run_pipeline_flags(args, link, t0)
    if schedule is not None:
        check_schedule_file(schedule, args.schedule, args.memory_budget)
        model_step_file_args(args, schedule, t0)
    profile_note = None
    if link is not None and not hardware_given and schedule is None:
        from moegraph.runtime.netns import profile_for
        hardware, note = profile_for(link)           # the shipped profile calibrated on this link, if any
        if hardware != args.hardware:
            args.hardware, profile_note = hardware, f"run: --link {link}: {note}"
    if args.train_steps is not None:
        return train(args, link, t0, schedule)
    device = "cpu"
    world = world_size(args)
    if args.backend == "gloo":
        check_rank_memory(*_model_and_layers(args), world, what=_ranks_phrase(args, world))
    if args.backend == "nccl":
        if args.hardware in CPU_PROFILES:
            from moegraph.registry import hardware_names
            gpus = [h for h in hardware_names() if h not in CPU_PROFILES]
            raise UsageError(f"--backend nccl with --hardware {args.hardware}, a CPU profile (run's default), "
                             f"would plan the GPU run with CPU costs; give the GPUs' profile ({', '.join(gpus)})")
        device = "cuda"
    with emulated_link(link):                         # a missing privilege fails here, before any work
        if profile_note:                              # said once the link exists (else the error alone)
            print(profile_note, file=sys.stderr, flush=True)
        config = run_config(args, schedule)
        if schedule is None:                          # planned for what the ranks run (NCCL: no budget 0)
            config = runnable_config(config, args.backend)     # a file's plan is checked as given, below
        layer = lower(config)
        if warning := link_mismatch(layer.hardware, link):
            print(warning, file=sys.stderr, flush=True)
        if why := expert_rows_refusal(layer.graph, args.expert_rows) or capture_refusal(
                layer.graph, ExecutionPlan.sequential(layer.graph), args.cuda_graphs, args.expert_rows):
            raise UsageError(why)                         # before scheduling and spawning
        # said once planned: a budget below the least feasible peak fails inside the scheduler, and
        # bad input gets exactly one stderr line
        _, plan = compiled_plan(config, schedule, lowered=layer, source=str(args.schedule))
        check_native_budgets(plan.comm_keys(layer.graph), args.backend)     # before spawning
        if note := gpu_plan_on_cpu_note(layer.hardware.name, device):      # said once the input is accepted
            print(f"run: {note}", file=sys.stderr, flush=True)
        progress(t0, f"planned: schedule {plan.method}")
        options = RuntimeOptions(timeout_s=args.timeout, cuda_graphs=args.cuda_graphs, expert_rows=args.expert_rows)
        results = spawn_plans(layer, (plan,), steps=args.steps, warmup=args.warmup, seed=args.seed, device=device,
                              backend=args.backend, options=options, check=args.check, progress_t0=t0)
    g = layer.graph
    report: dict[str, Any] = {
        "model": layer.model.name, "hardware": layer.hardware.name, "backend": args.backend, "n": args.n,
        "layers": layer_count(g), "dp": g.strategy.dp,
        "link": str(link) if link else "none",
        "strategy": {"attn": g.strategy.attn, "ffn": g.strategy.ffn, "dispatch": g.strategy.dispatch,
                     "ep_nodes": g.strategy.ep_nodes, "attn_nodes": g.strategy.attn_nodes, "dtype": g.strategy.dtype,
                     "passes": list(g.strategy.passes)},
        "batch": g.dims.b, "seq": g.dims.s, "micro_batches": micro_batch_count(g),
        "schedule": plan.method, "plan_hash": plan.hash,
        "steps": args.steps, "warmup": args.warmup, **step_stats(results),
        "predicted_step_us": None if plan.predicted_makespan_us is None else round(plan.predicted_makespan_us, 1),
        # the slowest rank's host time per node (runtime.executor.HostTime; CPU: includes the kernels;
        # with CUDA graphs: replay launch overhead, copies in and out included)
        "host_us_per_node": max(r["plans"][0]["host_us_per_node"] for r in results),
        # per-node timing events cannot be recorded inside a CUDA graph: such a run keeps step times only
        "cuda_graphs": args.cuda_graphs, "per_node_traces": args.cuda_graphs == "off",
        # padding holds C = T*min(k, E/n) rows where the plan's memory accounting expects about T*k/n:
        # the bytes every expert-row buffer of a step adds on top (docs/runtime.md, "CUDA graphs")
        "expert_rows": args.expert_rows,
        "padded_rows_extra_bytes": padded_rows_extra_bytes(g) if args.expert_rows == "padded" else 0,
        **memory_report(plan, results, device, args.memory_budget if schedule is not None else None)}
    if note:
        report["prediction_note"] = note
    if fused := fused_group_count(g):
        report.update({"fused_groups": fused, "executed_as": FUSED_AS_MEMBERS})
    if args.check:
        c = results[0]["check"]
        report.update({k: v for k, v in c.items() if k != "rel_err_input_grad"})
    traces = rank_traces(results)
    if args.compare_prediction:
        from moegraph.runtime.trace import compare_prediction
        report["prediction"] = compare_prediction(plan, traces[0], step_us=report["step_us"])
    if args.trace:
        report["trace"] = write_traces(args.trace, g, plan, traces, report["step_us_all"], layer.hardware)
    return report

def run_pipeline_flags(args: argparse.Namespace, link: Any, t0: float) -> dict[str, Any]:
    """``run --pp P``: the flags checked (one line before any work) and turned into the pipeline
    config (``PipelineSearch(runnable=True)``: the order compiled stages run), then
    ``moegraph.runtime.pipeline_run.run_pipeline``."""
    from moegraph.config import PipelineSearch
    from moegraph.runtime.pipeline_run import run_pipeline
    refused = [flag for flag, given in (
        ("--backend nccl", args.backend != "gloo"),
        ("--schedule FILE.json", isinstance(args.schedule, Path)), ("--trace", args.trace),
        ("--compare-prediction", args.compare_prediction), ("--link", link is not None),
        ("--expert-rows padded", args.expert_rows != "exact"), ("--train-steps", args.train_steps is not None)) if given]
    if refused:
        raise UsageError(f"--pp {args.pp_ranks} trains the pipeline step on local gloo ranks (--steps AdamW steps); "
                         f"it does not take {', '.join(refused)}")
    if args.schedule not in ("greedy", "cpsat"):
        raise UsageError(f"--pp {args.pp_ranks} --schedule {args.schedule}: each stage's layers are scheduled alone, "
                         "by greedy or cpsat")
    # config_from_args reads compile's pipeline options under these names
    flags = argparse.Namespace(**vars(args), pp=args.pp_ranks, vpp=args.pp_vpp, placement=args.pp_placement)
    config = config_from_args(flags, multi_layer=True, schedule=args.schedule, memory_budget=args.memory_budget,
                              solver=SolverEffort(args.time_limit), edges=ModelEdges(args.vocab),
                              pipeline=PipelineSearch(runnable=True))
    return run_pipeline(config, steps=args.steps, warmup=args.warmup, seed=args.seed, check=args.check,
                        timeout_s=args.timeout, t0=t0)

def check_cuda_graph_args(args: argparse.Namespace) -> None:
    """--cuda-graphs against the other flags (UsageError before any work): CUDA graphs need NCCL
    ranks on CUDA devices, capture one-micro-batch layers, and record no per-node traces."""
    mode = args.cuda_graphs
    if mode == "off":
        return
    if args.backend != "nccl":
        raise UsageError(f"--cuda-graphs {mode} needs --backend nccl on CUDA devices (--backend {args.backend} runs "
                         "CPU ranks)")
    refused = [flag for flag, given in (("--trace", args.trace), ("--compare-prediction", args.compare_prediction),
                                         ("--train-steps", args.train_steps is not None),
                                         ("--micro-batches", getattr(args, "micro_batches", 1) > 1)) if given]
    if refused:
        raise UsageError(f"--cuda-graphs {mode} records no per-node traces and captures one-micro-batch layers only; "
                         f"it does not take {', '.join(refused)}")

def check_micro_batch_args(args: argparse.Namespace) -> None:
    """--micro-batches against the other flags (UsageError before any work): the paired baselines
    need M >= 2."""
    M = getattr(args, "micro_batches", 1)       # code that builds run's args by hand may leave it out
    if args.schedule in MICROBATCH_METHODS and M < 2:
        raise UsageError(f"--schedule {args.schedule} pairs one micro-batch's forward with another's backward: "
                         f"it needs --micro-batches M >= 2 (got {M})")

def is_model_step(schedule: Any) -> bool:
    """Whether a schedule file schedules a model step (a stack with the model's edges: embedding,
    final norm, LM head; what compile and tune write for --layers L >= 2: the driver's edges='auto')
    rather than one layer."""
    from moegraph.edges import EDGE_ATTR
    return any(n.attrs.get(EDGE_ATTR) for n in schedule.nodes)

def model_step_file_args(args: argparse.Namespace, schedule: Any, t0: float | None) -> None:
    """``run --schedule FILE.json`` of a model step: it runs as the model it schedules, trained
    (``train``): the timed layer path has no embedding or LM head. --train-steps defaults to
    --steps; the vocabulary is the one compile and tune schedule (moegraph.models.VOCAB). A
    one-layer file cannot drive --train-steps (the trained model has edges the file lacks).
    UsageError before any work."""
    from moegraph.models import VOCAB
    path = args.schedule
    if not is_model_step(schedule):
        if args.train_steps is not None:
            raise UsageError(f"--train-steps trains the model step (embedding, layers, LM head); --schedule {path} "
                             "schedules one layer alone (compile or tune --layers L >= 2 write model steps)")
        return
    refused = [flag for flag, given in (("--trace", args.trace), ("--compare-prediction", args.compare_prediction),
                                         ("--backend nccl", args.backend != "gloo")) if given]
    if refused:
        raise UsageError(f"--schedule {path} schedules the {args.layers}-layer model step (embedding and LM head "
                         f"included), which run executes by training the model; that does not take "
                         f"{', '.join(refused)}")
    if args.vocab not in (VOCAB, VOCAB_DEFAULT):
        raise UsageError(f"--vocab {args.vocab} does not match the schedule file {path}, whose LM head has "
                         f"vocab={VOCAB} (leave --vocab out)")
    args.vocab = VOCAB
    if args.train_steps is None:
        args.train_steps = args.steps
        progress(t0, f"--schedule {path} schedules the {args.layers}-layer model step (embedding and LM head "
                     f"included): training the model {args.steps} AdamW steps under it (--train-steps)")

def train(args: argparse.Namespace, link: Any, t0: float | None = None, schedule: Any = None) -> dict[str, Any]:
    """``run --train-steps K``: plan once here, train on n x dp spawned ranks (``train_rank``);
    ``schedule``: the Schedule of a model-step file (``model_step_file_args``) to plan from."""
    from moegraph.registry import load_model
    from moegraph.runtime.launch import spawn
    from moegraph.runtime.module import compiled_plan
    from moegraph.runtime.training import TrainSpec, train_rank
    refused = [flag for flag, given in (("--trace", args.trace), ("--compare-prediction", args.compare_prediction),
                                         ("--link", link is not None), ("--backend nccl", args.backend != "gloo"))
               if given]
    if refused:
        raise UsageError(f"--train-steps runs a CPU training check; it does not take {', '.join(refused)}")
    model = load_model(args.model)
    if model.first_k_dense_replace:
        raise UsageError(f"--train-steps: {model.name} has {model.first_k_dense_replace} dense first layers; the "
                         "compiled model needs identical layers")
    world = world_size(args)
    check_rank_memory(*_model_and_layers(args), world, what=_ranks_phrase(args, world))
    # the graph compile_model builds on every rank: the stack (merged over --micro-batches M) plus the edges
    config = run_config(args, schedule, edges=ModelEdges(args.vocab))
    layer = lower(config)
    _, plan = compiled_plan(config, schedule, lowered=layer, source=str(args.schedule))
    layers = layer_count(layer.graph)
    progress(t0, f"planned: schedule {plan.method} of the {layers}-layer model step")
    st = layer.graph.strategy
    spec = TrainSpec(layer.model, layers, args.vocab, config, plan, args.train_steps, args.seed, args.check,
                     RuntimeOptions(timeout_s=args.timeout), micro_batch_count(layer.graph), t0)
    progress(t0, f"starting {world} gloo ranks (each compiles the model)")
    results = spawn(train_rank, world, args=(spec,), timeout_s=args.timeout * 4 + 300, pg_timeout_s=args.timeout)
    r = results[0]
    report: dict[str, Any] = {
        "model": layer.model.name, "layers": layers, "vocab": args.vocab, "hardware": layer.hardware.name,
        "n": st.n, "dp": st.dp, "strategy": {"attn": st.attn, "ffn": st.ffn, "dispatch": st.dispatch, "dtype": st.dtype,
                                "ep_nodes": st.ep_nodes, "attn_nodes": st.attn_nodes, "passes": list(st.passes)},
        "batch": args.batch, "seq": args.seq, "schedule": plan.method, "plan_hash": plan.hash,
        "train_steps": args.train_steps, "micro_batches": spec.micro_batches, "losses": r["losses"],
        "seconds": max(x["seconds"] for x in results),
        **memory_report(plan, None, "cpu", args.memory_budget if schedule is not None else None)}
    if args.check:
        report.update({k: r[k] for k in ("eager_losses", "max_rel_err_loss", "max_rel_err_params", "worst_param",
                                         "max_rel_err_grads", "worst_grad")})
    return report


__all__ = ["run", "run_command", "run_config", "train", "world_size"]
