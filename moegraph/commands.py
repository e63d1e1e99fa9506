"""`moegraph trace`, plus the layer options every graph-taking command shares.

The flags become one ``CompileConfig`` here (``config_from_args``), the CLI's boundary: the
--passes text is parsed into typed steps once, and the commands hand the config to the driver
(``moegraph.schedules.driver``, imported lazily: a later stage)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
from typing import Any, Callable, Literal

from moegraph.config import RECORDED, CompileConfig, Edges, ModelEdges, PipelineSearch, config_layers
from moegraph.ir import Graph, Phase, Strategy
from moegraph.layers import layer_count
from moegraph.limits import MAX_MICRO_BATCHES, check_graph_size, check_limit
from moegraph.options import UsageError, byte_size, non_negative_int, positive_float, positive_int
from moegraph.pass_steps import DEFAULT_PASSES, parse_passes, step_label
from moegraph.registry import ModelConfig, load_model
from moegraph.strategy import node_fields

PASSES_DEFAULT_TEXT = ",".join(map(step_label, DEFAULT_PASSES))
"""--passes's default: the text form of ``moegraph.pass_steps.DEFAULT_PASSES`` ("gate-reorder,sar=paper")."""


def layers_arg(text: str) -> int | Literal["all"]:
    """--layers value: a positive layer count, or 'all' (the registry model's ``layers``)."""
    if text.strip().lower() == "all":
        return "all"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or 'all'") from None


def add_layer_args(p: argparse.ArgumentParser, *, model_default: str = "mixtral-8x7b", pipeline: bool = False) -> None:
    """The trace options: model, hardware, strategy, sizes, passes. Shared by compile/run/tune.
    ``pipeline``: the command takes --pp (then --layers defaults to all)."""
    p.add_argument("--model", default=model_default, help="registry name or YAML path (default %(default)s)")
    p.add_argument("--hardware", default="h800", help="registry name or YAML path (default %(default)s)")
    p.add_argument("--attn", default="sp", choices=("tp", "sp"), help="attention parallelism (default %(default)s)")
    p.add_argument("--ffn", default="ep", choices=("tp", "ep"), help="FFN parallelism (default %(default)s)")
    p.add_argument("--dispatch", default="ag-rs", choices=("a2a", "ag-rs"),
                   help="token dispatch for ffn=ep (default %(default)s)")
    p.add_argument("--n", type=positive_int, default=8, help="group size n (default %(default)s)")
    p.add_argument("--batch", type=positive_int, default=1, help="micro-batch b (default %(default)s)")
    p.add_argument("--seq", type=positive_int, default=8192, help="sequence length s (default %(default)s)")
    p.add_argument("--top-k", type=positive_int, default=None, help="override the model's top-k")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="activation dtype (default %(default)s)")
    p.add_argument("--dp", type=positive_int, default=1, help="data-parallel degree D (default %(default)s)")
    p.add_argument("--ep-nodes", type=positive_int, default=1, metavar="N",
                   help="nodes the group spans for the expert all-to-all (dispatch=a2a): N > 1 sends each token "
                        "once per destination node over the NICs and forwards it within the node, as DeepEP "
                        "(default %(default)s)")
    p.add_argument("--attn-nodes", type=positive_int, default=1, metavar="N",
                   help="nodes the attention is data-parallel over (dispatch=a2a): N > 1 runs the attention TP/SP "
                        "within each node's n/N ranks on b/N of the batch while the experts stay EP over all n, "
                        "as Megatron-Core's MoE parallel folding (default %(default)s)")
    add_layers_arg(p, pipeline=pipeline)
    p.add_argument("--passes", default=PASSES_DEFAULT_TEXT,
                   help="comma-separated pass pipeline, e.g. sar=paper,gate-reorder,chunk=auto; 'none' for no "
                        "passes (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def add_micro_batch_arg(p: argparse.ArgumentParser) -> None:
    """--micro-batches M: schedule the step of M micro-batches (moegraph.microbatch)."""
    p.add_argument("--micro-batches", type=positive_int, default=1, metavar="M",
                   help="micro-batches per optimizer step (gradient accumulation): M >= 2 schedules one step "
                        "graph in which a micro-batch's forward may overlap another's backward (default %(default)s)")

def add_layers_arg(p: argparse.ArgumentParser, *, pipeline: bool = False) -> None:
    """--layers, shared by the layer options and `moegraph tune` (resolved by ``resolve_layers``).
    ``pipeline``: the command takes --pp, and --layers defaults to all with it (None: not given)."""
    p.add_argument("--layers", type=layers_arg, default=None if pipeline else 1, metavar="L|all",
                   help="decoder layers in the graph, at most the model's; 'all' = the model's count "
                        + ("(default 1; with --pp: all, the model's layers, its dense first layers included)"
                           if pipeline else "(default %(default)s)"))


def add_pipeline_args(p: argparse.ArgumentParser, *, search: bool = False) -> None:
    """The pipeline options (docs/pipeline.md) of trace, compile and tune: --pp, --vpp,
    --placement, --vocab; with ``search`` (compile) how the step is priced and searched."""
    g = p.add_argument_group("pipeline stages (docs/pipeline.md)")
    g.add_argument("--pp", type=positive_int, default=1, metavar="P",
                   help="pipeline ranks: the model's layers cut into P x V stages balanced by predicted cost, the "
                        "step of --micro-batches M ordered by CP-SAT against torch.distributed.pipelining's "
                        "schedules; --memory-budget then caps each rank's whole memory (default 1: no pipeline)")
    g.add_argument("--vpp", type=positive_int, default=1, metavar="V",
                   help="virtual stages per pipeline rank; needs --pp (default %(default)s)")
    g.add_argument("--placement", default="loop", choices=("loop", "v"),
                   help="where a rank's V stages sit: loop (stage s on rank s mod P) or v (--vpp 2: stages s and "
                        "2P-1-s on rank s) (default %(default)s)")
    g.add_argument("--vocab", type=positive_int, default=None, metavar="VOCAB",
                   help="with --pp: the LM head's vocabulary, priced with the last stage (default: a Hugging "
                        "Face config's vocab_size, else 32000, moegraph.models.VOCAB)")
    if search:
        g.add_argument("--unit-time-limit", type=positive_float, default=1.0, metavar="S",
                       help="with --pp: CP-SAT effort per op-level unit price (F, I, W, B, F&B), deterministic "
                            "seconds (default %(default)s)")
        g.add_argument("--windows", type=non_negative_int, default=0, metavar="N",
                       help="with --pp: then up to N windows of 4 micro-batches per sweep re-ordered by CP-SAT "
                            "(the window search; default %(default)s: none)")
        g.add_argument("--overlap-param-gather", action="store_true",
                       help="with --pp: the gradient sync's all-gather half runs at the next step's start, beside "
                            "the forward (Megatron's --overlap-param-gather)")


PIPELINE_ONLY = {"vocab": None, "unit_time_limit": PipelineSearch().unit_time_limit_s,
                 "windows": PipelineSearch().windows, "overlap_param_gather": False}
"""The pipeline options that mean nothing without --pp, and their defaults."""


def pipeline_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The CompileConfig fields of the pipeline options (none when the command has no --pp)."""
    if not hasattr(args, "pp"):
        return {}
    pp = args.pp
    if pp == 1:
        given = [flag for flag, default in PIPELINE_ONLY.items() if getattr(args, flag, default) != default]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} applies to a pipeline: give --pp P (P >= 2)")
        return {"vpp": args.vpp, "placement": args.placement}
    search = PipelineSearch(unit_time_limit_s=getattr(args, "unit_time_limit", PIPELINE_ONLY["unit_time_limit"]),
                            windows=getattr(args, "windows", PIPELINE_ONLY["windows"]),
                            overlap_param_gather=getattr(args, "overlap_param_gather", False))
    return {"pp": pp, "vpp": args.vpp, "placement": args.placement, "pipeline": search,
            **({"edges": ModelEdges(args.vocab)} if args.vocab is not None else {})}


def add_memory_budget_arg(p: argparse.ArgumentParser) -> None:
    """--memory-budget, one unit on every command (moegraph.options.byte_size)."""
    p.add_argument("--memory-budget", type=byte_size, default=None, metavar="SIZE",
                   help="peak memory cap for activations and buffers: 1.5GiB, 800MiB or plain bytes; "
                        "with --pp, each pipeline rank's whole memory (parameters, fp32 gradients, optimizer "
                        "states, in-flight activations, p2p buffers) (default: none)")


def config_from_args(args: argparse.Namespace, *, multi_layer: bool = False, edges: Edges = "none",
                     **fields: Any) -> CompileConfig:
    """The CompileConfig the layer options describe (the CLI's one boundary: --passes text is
    parsed here, --layers and --top-k are checked against the model with the flags' names).
    ``multi_layer``: the command handles a graph of several layers (trace, compile, run); the
    others refuse --layers above 1 before any work. ``edges``: the config's (compile's model step:
    'auto'). ``fields``: further config fields the command sets (schedule, memory budget, ...).
    With ``args.schedule_strategy`` (run --schedule FILE) the file's typed strategy is rebuilt
    as it records (RECORDED)."""
    for flag in ("n", "batch", "seq", "dp"):
        if getattr(args, flag) < 1:  # also reached from code that builds args by hand (demo, benchmarks)
            raise UsageError(f"--{flag}={getattr(args, flag)} must be a positive integer")
    model = load_model(args.model)
    pipeline = pipeline_fields(args)
    if pipeline.get("pp", 1) > 1:
        return _pipeline_config(args, model, pipeline, fields)
    layers = resolve_layers(getattr(args, "layers", 1), model)
    if layers > 1 and not multi_layer:
        raise UsageError(f"--layers={layers}: this command runs one layer (multi-layer execution is not supported "
                         "yet); use --layers 1, or trace, compile or run for a multi-layer graph")
    if args.top_k is not None and not 1 <= args.top_k <= model.experts:
        raise UsageError(f"--top-k={args.top_k} must be between 1 and the expert count {model.experts} of {model.name}")
    file_strategy = getattr(args, "schedule_strategy", None)
    # every size that multiplies the graph, before anything is traced (and torch imported, ~1 s)
    check_graph_size(layers=layers, micro_batches=getattr(args, "micro_batches", 1), n=args.n, dp=args.dp,
                     chunks=file_strategy.chunks if file_strategy is not None else 1)
    if file_strategy is not None:
        # run --schedule FILE: the file's typed strategy rebuilds its graph (its labels are a record)
        strategy, passes = file_strategy, RECORDED
    else:
        strategy = _strategy(args)
        passes = parse_passes(args.passes) if isinstance(args.passes, str) else args.passes
    return CompileConfig(model=model, strategy=strategy, passes=passes, layers=layers, batch=args.batch, seq=args.seq,
                         top_k=args.top_k, micro_batches=getattr(args, "micro_batches", 1), edges=edges,
                         hardware=args.hardware, **(pipeline | fields))


def _strategy(args: argparse.Namespace) -> Strategy:
    """The layer strategy the graph flags name."""
    return Strategy(attn=args.attn, ffn=args.ffn, dispatch=args.dispatch, n=args.n, dtype=args.dtype, dp=args.dp,
                    ep_nodes=getattr(args, "ep_nodes", 1), attn_nodes=getattr(args, "attn_nodes", 1))


def _pipeline_config(args: argparse.Namespace, model: ModelConfig, pipeline: dict[str, Any],
                     fields: dict[str, Any]) -> CompileConfig:
    """``config_from_args`` with --pp: the config of the pipeline step, its layers checked
    against the model (``config_layers``) before anything is traced. The pipeline lowers one
    graph per distinct layer and a two-layer boundary step, so the graph-size check counts those;
    the layers and micro-batches are checked against their own limits."""
    layers = "all" if getattr(args, "layers", None) is None else args.layers
    if args.top_k is not None and not 1 <= args.top_k <= model.experts:
        raise UsageError(f"--top-k={args.top_k} must be between 1 and the expert count {model.experts} of {model.name}")
    check_graph_size(layers=2, n=args.n, dp=args.dp, stages=pipeline["pp"] * pipeline["vpp"])
    check_limit("micro-batches", getattr(args, "micro_batches", 1), MAX_MICRO_BATCHES)
    strategy = _strategy(args)
    passes = parse_passes(args.passes) if isinstance(args.passes, str) else args.passes
    config = CompileConfig(model=model, strategy=strategy, passes=passes, layers=layers, batch=args.batch,
                           seq=args.seq, top_k=args.top_k, micro_batches=getattr(args, "micro_batches", 1),
                           hardware=args.hardware, **(pipeline | fields))
    config_layers(config, model)            # pp x vpp <= layers <= the model's, before any tracing
    return config


def resolve_layers(layers: int | str | None, model: ModelConfig) -> int:
    """--layers against the model: 'all' is ``ModelConfig.all_layers`` (a registry model's MoE
    layers; every layer of a Hugging Face config); a count it cannot stack is a UsageError. None
    (not given): 1."""
    if layers is None:
        return 1
    if layers == "all":
        return model.all_layers
    if isinstance(layers, bool) or not isinstance(layers, int) or not model.stackable(layers):
        raise UsageError(f"--layers={layers} must be between 1 and {model.layers_phrase()}, or 'all'")
    return layers


# -- trace ---------------------------------------------------------------------------------

def forward_comm_bytes(graph: Graph) -> dict[str, int]:
    """Per block, the bytes the forward's collectives move per rank (the paper's Table 2 terms)."""
    return {block: graph.forward_comm_bytes(block) for block in ("attention", "ffn")}


def trace_summary(layer: Any) -> dict[str, Any]:
    """``moegraph trace``'s result of a lowered config (``moegraph.schedules.driver.Lowered``)."""
    g, cost = layer.graph, layer.cost
    nodes = [{"name": n.name, "kind": "comm" if n.is_comm else "compute", "op": n.op.value, "phase": n.phase.value,
              "role": n.role.value, "block": n.block, "flops": n.flops, "bytes": n.mem_bytes,
              "comm_bytes": n.comm_bytes, "time_us": round(cost.node_time_us(n), 3)} for n in g.nodes]
    strategy = g.strategy.as_dict()
    by_phase = {p.value: round(sum(x["time_us"] for x in nodes if x["phase"] == p.value), 3) for p in Phase}
    from moegraph.layers import describe_kinds
    kinds = describe_kinds(g)
    return {**({"layer_kinds": kinds} if kinds else {}), "model": layer.model.name, "hardware": layer.hardware.name, "strategy": strategy,
            "dims": dataclasses.asdict(g.dims), "layers": layer_count(g), "nodes": nodes,
            "forward_comm_bytes": forward_comm_bytes(g), "activation_bytes": g.activation_bytes(),
            "time_us_by_phase": by_phase, "step_memory": step_memory(g, layer.model.hf_vocab), "passes": layer.report}


def print_result(result: dict[str, Any], as_json: bool, table: Callable[[dict[str, Any]], str]) -> None:
    """A command's result on stdout: one JSON object (``--json``) or its human-readable table."""
    print(json.dumps(result, indent=1) if as_json else table(result))


@contextlib.contextmanager
def progress_on_stderr(logger: str):
    """While a long command runs: the INFO lines of ``logger`` (a later stage's progress, e.g.
    "moegraph.schedules": CP-SAT phases, window search) on stderr, each with the elapsed time in
    tune's form ``[  12.3s] ...``. Library calls stay silent: only a command installs this."""
    t0 = time.perf_counter()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Elapsed(t0))
    log = logging.getLogger(logger)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


class _Elapsed(logging.Formatter):
    def __init__(self, t0: float):
        super().__init__()
        self.t0 = t0

    def format(self, record: logging.LogRecord) -> str:
        return f"[{time.perf_counter() - self.t0:6.1f}s] {record.getMessage()}"


def trace_command(p: argparse.ArgumentParser):
    add_layer_args(p, pipeline=True)
    add_micro_batch_arg(p)
    add_pipeline_args(p)

    def run(args) -> int:
        from moegraph.schedules.driver import lower
        config = config_from_args(args, multi_layer=True)
        if config.pp > 1:       # the pipeline's estimate, list-scheduled: nothing is solved
            from moegraph.schedules.pipeline_report import estimate_summary, format_estimate
            print_result(estimate_summary(lower(config)), args.json, format_estimate)
            return 0
        print_result(trace_summary(lower(config)), args.json, format_trace)
        return 0
    return run


def step_memory(graph: Graph, vocab: int | None = None) -> dict[str, int]:
    """The whole-step memory of one rank running ``graph`` as one stage (moegraph.memory): a
    stack with the model's edges at ``vocab`` (a Hugging Face config's own; None: the default
    VOCAB), as compile schedules it."""
    from moegraph.memory import graph_memory
    from moegraph.passes.edges import add_edges
    from moegraph.models import VOCAB
    if layer_count(graph) > 1:
        vocab = vocab or VOCAB
        return graph_memory(add_edges(graph, vocab=vocab), vocab=vocab).as_dict()
    return graph_memory(graph, vocab=None).as_dict()


def format_trace(s: dict[str, Any]) -> str:
    st = s["strategy"]
    lines = [f"{s['model']} on {s['hardware']}" + (f" ({s['layers']} layers)" if s["layers"] > 1 else "")
             + f": attn={st['attn']} ffn={st['ffn']} dispatch={st['dispatch']} n={st['n']}"
             + node_fields(st) + f" dp={st['dp']} "
             f"dtype={st['dtype']}" + (f" passes={','.join(st['passes'])}" if st["passes"] else ""),
             f"{'node':<34} {'op':<15} {'phase':<9} {'GFLOP':>9} {'MB mem':>9} {'MB sent':>9} {'time us':>9}"]
    for n in s["nodes"]:
        lines.append(f"{n['name']:<34} {n['op']:<15} {n['phase']:<9} {n['flops'] / 1e9:>9.2f} "
                     f"{n['bytes'] / 1e6:>9.1f} {n['comm_bytes'] / 1e6:>9.1f} {n['time_us']:>9.1f}")
    fc = s["forward_comm_bytes"]
    lines += ["",
              f"nodes: {len(s['nodes'])}   serial time by phase (us): "
              + ", ".join(f"{k} {v:.1f}" for k, v in s["time_us_by_phase"].items()),
              f"forward comm bytes per rank: attention {fc['attention']:,}  ffn {fc['ffn']:,}",
              f"activation bytes held for backward: {s['activation_bytes']:,} ({s['activation_bytes'] / 2**30:.3f} GiB)",
              "step memory per rank (GiB): " + ", ".join(f"{k} {s['step_memory'][k] / 2**30:.3f}" for k in
                                                       ("params", "grads", "optimizer", "activations", "total"))]
    for k in s.get("layer_kinds") or ():
        layers = k["layers"]
        shown = ", ".join(map(str, layers[:12])) + (f", ... ({len(layers)} layers)" if len(layers) > 12 else "")
        lines.append(f"layer kind {k['kind']} ({k['nodes']} nodes): layers {shown}"
                     + (f"; differs from kind 0 at {k['differs_from_kind_0']}" if k["differs_from_kind_0"] else ""))
    for key, value in (s.get("passes") or {}).items():
        lines.append(f"{key}: {value}")
    return "\n".join(lines)
