"""`moegraph run`: execute a compiled layer on N local ranks, measure it, optionally check it.

The parent process lowers the registry model (``layer_from_args``: strategy, passes), builds the
plan once (so N ranks do not each run the scheduler), then spawns N ranks on loopback
(``moegraph.runtime.launch.spawn``). Each rank builds the reference layer
``MoETransformerLayer.from_config`` with the same seeded random weights, shards it, and runs
warm-up + K steps (forward + backward). Step time of a step = the slowest rank's; the report
gives the median over the K steps.

``--dp D`` runs n x D ranks (``world_size``): D replicas of the n-rank group, replica-major
(``moegraph.runtime.collectives.Layout``). The seeded input is the global batch [D*b, s, h];
replica p trains on rows p*b .. (p+1)*b - 1 (``CompiledLayer.shard_input``).

``--micro-batches M`` (M >= 2) runs one optimizer step of M micro-batches (gradient
accumulation) as the merged step graph (``moegraph.microbatch``): scheduled whole (cpsat, or
the paired baselines megatron-1f1b / dualpipe, or sequential), run by ``CompiledLayer.train_step``;
the step time is the whole step's. ``--check`` compares every parameter gradient (summed over
the M micro-batches) and each micro-batch's output and input gradient with eager gradient
accumulation on the same seeded micro-batches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moegraph.ir import EXPERT_ROWS, ConfigError, ExpertRows, Strategy
from moegraph.runtime import CUDA_GRAPH_MODES, CudaGraphs
from moegraph.runtime.reference import Implementation, seeded_stack
from moegraph.runtime.schedule_check import check_same_graph, check_schedule_file

# the layer flags a schedule file fixes (run --schedule FILE.json): taken from the file unless given
LAYER_FLAGS = ("model", "hardware", "attn", "ffn", "dispatch", "n", "batch", "seq", "top_k", "dtype", "dp", "passes",
               "micro_batches", "layers")
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
    from moegraph.schedules.api import METHODS, MICROBATCH_METHODS
    if text in METHODS + MICROBATCH_METHODS:
        return text
    if text.endswith(".json"):
        return Path(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(METHODS)}, "
                                     f"{', '.join(MICROBATCH_METHODS)} (with --micro-batches) or a schedule file (.json)")


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs; picklable (sent to spawned ranks)."""

    model: Any                    # registry ModelConfig
    graph: Any                    # moegraph.ir.Graph, lowered for n ranks
    plans: tuple                  # ExecutionPlans to time (the CLI: one; benchmarks: several)
    steps: int
    warmup: int
    seed: int
    dtype: str
    device: str                   # "cpu" | "cuda"
    timeout_s: float
    check: bool = False
    implementation: "Implementation" = "reference"
    cuda_graphs: CudaGraphs = "off"     # runtime.cudagraph: what each layer replays as CUDA graphs
    expert_rows: ExpertRows = "exact"   # moegraph.kernels.build_index_map: the local index maps' rows
    progress_t0: float | None = None    # the command's start (time.time()): rank 0 reports progress; None: silent


def progress(t0: float | None, text: str) -> None:
    """One progress line of `moegraph run` on stderr, stamped with the seconds since ``t0`` (the
    command's start; the ranks get it in their spec); None: silent (benchmarks, the demo)."""
    if t0 is not None:
        print(f"run [{time.time() - t0:6.1f}s] {text}", file=sys.stderr, flush=True)


def timed_steps(layer: Any, xs: Any, dys: Any, steps: int, barrier_group: Any = None,
                on_step: Any = None) -> list[float]:
    """Run ``steps`` training steps; per step, wall microseconds on this rank (ranks start each
    step together: a barrier precedes it). A step is forward+backward of the shard ``xs`` seeded
    with ``dys``, or, for a merged micro-batch layer (``xs``, ``dys``: lists of shards), one
    ``train_step`` of its M micro-batches. ``on_step(i, us)``: called after each step."""
    import torch
    import torch.distributed as dist
    merged = isinstance(xs, list)
    cuda = (xs[0] if merged else xs).is_cuda
    times = []
    for _ in range(steps):
        for p in layer.parameters():
            p.grad = None
        if not merged:
            xs.grad = None
        if dist.is_initialized():
            dist.barrier(group=barrier_group)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if merged:
            layer.train_step(xs, dys)
        else:
            layer(xs).backward(dys)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
        if on_step is not None:
            on_step(len(times), times[-1])
    return times


@dataclass
class DeviceMemory:
    """The CUDA allocator over one plan's measured steps on one rank (``measure`` each block):
    the peak (``torch.cuda.max_memory_allocated``, its statistic reset as each block begins) and
    what was already allocated then (resident: the seeded eager module, the layer's shards, the
    inputs), each the largest over the blocks. None until measured (CPU ranks never are: the CPU
    allocator keeps no such statistic)."""

    peak_bytes: int | None = None
    resident_bytes: int | None = None

    def measure(self, steps: Any) -> Any:
        """Run ``steps()`` (a block of timed steps), recording the allocator's peak across it."""
        import torch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        result = steps()
        torch.cuda.synchronize()
        self.peak_bytes = max(self.peak_bytes or 0, torch.cuda.max_memory_allocated())
        self.resident_bytes = max(self.resident_bytes or 0, resident)
        return result


def memory_report(plan: Any, results: list[dict[str, Any]] | None, device: str,
                  checked_budget: int | None = None, plan_index: int = 0) -> dict[str, Any]:
    """The memory fields of run's report: the plan's predicted peak (activations, the cost
    model's accounting) and the budget it was made under, ``checked_budget`` (--memory-budget
    checked against a schedule file's peak), and on CUDA the measured peak and resident bytes
    (``DeviceMemory``), each the largest over the ranks; on the CPU None (not measured)."""
    out: dict[str, Any] = {"predicted_peak_bytes": plan.peak_memory_bytes,
                           "memory_budget_bytes": plan.memory_budget_bytes}
    if checked_budget is not None:
        out["checked_memory_budget_bytes"] = checked_budget
    measured = [r["plans"][plan_index] for r in results or ()] if device == "cuda" else []
    peaks = [m["device_peak_bytes"] for m in measured if m.get("device_peak_bytes") is not None]
    resident = [m["device_resident_bytes"] for m in measured if m.get("device_resident_bytes") is not None]
    out.update({"measured_peak_bytes": max(peaks) if peaks else None,
                "measured_resident_bytes": max(resident) if resident else None, "memory_device": device})
    return out


def format_memory(r: dict[str, Any]) -> str:
    """The report's memory line (``memory_report``'s fields)."""
    from moegraph.options import format_bytes
    made = ("no budget" if r.get("memory_budget_bytes") is None
            else f"a budget of {format_bytes(r['memory_budget_bytes'])}")
    peak = r.get("predicted_peak_bytes")
    line = (f"memory: predicted peak {format_bytes(peak)} of live values, parameters and their gradients not counted"
            if peak is not None
            else "memory: no predicted peak (the plan has no schedule)") + f" (made under {made}"
    if r.get("checked_memory_budget_bytes") is not None:
        line += f"; within --memory-budget {format_bytes(r['checked_memory_budget_bytes'])}"
    line += "); "
    if r.get("measured_peak_bytes") is None:
        return line + f"measured peak: not available on {r.get('memory_device', 'cpu').upper()}"
    return line + (f"measured peak {format_bytes(r['measured_peak_bytes'])} (torch.cuda.max_memory_allocated, largest "
                   f"rank; {format_bytes(r['measured_resident_bytes'])} of it allocated before the steps: weights, "
                   "the eager module, inputs)")


def measurement_blocks(plans: int, steps: int) -> list[tuple[int, int]]:
    """(plan index, step count) blocks: each plan's steps in two halves, in ABBA order (A B ... B A),
    so slow drift on the machine hits every plan alike. Steps are not interleaved one by one:
    alternating between layers every step evicts each layer's working set (weights, gradient
    buffers) and on this project's VMs made every plan ~1.7x slower than it runs alone."""
    if plans == 1:
        return [(0, steps)]
    first, second = (steps + 1) // 2, steps // 2
    order = [(i, first) for i in range(plans)] + [(i, second) for i in reversed(range(plans))]
    return [(i, c) for i, c in order if c]


def run_rank(rank: int, n: int, spec: RunSpec) -> dict[str, Any]:
    """One rank of `moegraph run`: time every plan of ``spec`` (in ABBA blocks: ``measurement_blocks``)."""
    import torch
    from moegraph.runtime.check import check_against_eager
    from moegraph.runtime.module import build_layer
    from moegraph.runtime.trace import trace_to_dict
    from moegraph.layers import layer_count
    from moegraph.microbatch import micro_batch_count
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec.dtype]
    module, call = seeded_stack(spec.model, spec.seed, layer_count(spec.graph), spec.dtype, spec.implementation)
    module = module.to(spec.device)
    # buffers too: DeepSeek-V3's router reads its score-correction bias
    full = {k: t.detach() for k, t in [*module.named_parameters(), *module.named_buffers()]}
    n = spec.graph.strategy.n                   # ``rank`` is global: one of n x dp (world_size)
    layers = [build_layer(spec.graph, plan, full, rank=rank, n=n, timeout_s=spec.timeout_s, cuda_graphs=spec.cuda_graphs,
                          expert_rows=spec.expert_rows)
              for plan in spec.plans]
    M = micro_batch_count(spec.graph)
    batches = micro_batch_inputs(spec.graph, spec.seed, M, device=spec.device, dtype=dtype)
    if M > 1:
        xs = [layers[0].shard_input(x) for x, _ in batches]
        dys = [layers[0].shard_input(dy) for _, dy in batches]
    else:
        (x, dy), = batches
        xs, dys = layers[0].shard_input(x).requires_grad_(True), layers[0].shard_input(dy)
    meta = layers[0].executor.comm.world_meta     # barriers over every rank of every replica
    t0 = spec.progress_t0 if rank == 0 else None    # one rank reports: the ranks step together
    times: list[list[float]] = [[] for _ in layers]
    memory = [DeviceMemory() for _ in layers]
    for layer in layers:
        progress(t0, f"{spec.warmup} warm-up step{'s' * (spec.warmup != 1)}")
        timed_steps(layer, xs, dys, spec.warmup, meta)
        layer.clear_traces()
        layer.executor.host.reset()
    for i, count in measurement_blocks(len(layers), spec.steps):
        if spec.warmup and len(layers) > 1:                  # re-warm this layer's memory, unrecorded
            recording, layers[i].record = layers[i].record, False
            timed_steps(layers[i], xs, dys, 1, meta)
            layers[i].record = recording
        done = len(times[i])

        def block(i=i, count=count, done=done) -> list[float]:
            return timed_steps(layers[i], xs, dys, count, meta, on_step=lambda j, us: progress(
                t0, f"step {done + j}/{spec.steps}: {us / 1e3:.1f} ms on rank 0"))
        if spec.device == "cuda":
            for p in layers[i].parameters():         # the last block's gradients are not resident
                p.grad = None
            if M == 1:
                xs.grad = None
            times[i] += memory[i].measure(block)
        else:
            times[i] += block()
    out: dict[str, Any] = {"rank": rank, "plans": []}
    for layer, t, mem in zip(layers, times, memory):
        out["plans"].append({"method": layer.plan.method, "hash": layer.plan.hash, "step_us": t,
                             "device_peak_bytes": mem.peak_bytes, "device_resident_bytes": mem.resident_bytes,
                             "host_us_per_node": layer.executor.host.us_per_node(),
                             "traces": [trace_to_dict(tr) for tr in layer.traces]})
    if spec.check:
        progress(t0, "checking output and gradients against the eager module")
    if spec.check and M > 1:
        out["check"] = check_microbatches_against_eager(module, layers[0], batches, call=call)
    elif spec.check:
        out["check"] = check_against_eager(module, layers[0], x, dy, call=call)
    return out


def global_batch(graph: Any, seed: int, *, device: Any = "cpu", dtype: Any = None):
    """The seeded input and seed gradient of one step for all replicas: [dp*b, s, h] each
    (replica p's rows p*b .. (p+1)*b - 1: distinct data per replica)."""
    return micro_batch_inputs(graph, seed, 1, device=device, dtype=dtype)[0]


def micro_batch_inputs(graph: Any, seed: int, micro_batches: int, *, device: Any = "cpu",
                       dtype: Any = None) -> list[tuple[Any, Any]]:
    """Seeded (input, seed gradient) of each of ``micro_batches`` micro-batches, [dp*b, s, h] each
    (the first is ``global_batch``'s)."""
    import torch
    dims, dp = graph.dims, graph.strategy.dp
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(micro_batches):
        x = torch.randn(dp * dims.b, dims.s, dims.h, generator=gen).to(device=device, dtype=dtype)
        dy = torch.randn(dp * dims.b, dims.s, dims.h, generator=gen).to(device=device, dtype=dtype)
        out.append((x, dy))
    return out


def check_microbatches_against_eager(module: Any, layer: Any, batches: list[tuple[Any, Any]], *,
                                     call: Any = None) -> dict[str, Any]:
    """One ``train_step`` against eager gradient accumulation (M forward/backward passes of the
    eager module into the same .grad) on the same full micro-batches (collective). Worst relative
    error over the micro-batches' outputs; over their input gradients and every parameter gradient."""
    import torch
    from moegraph.runtime.check import grad_report, rel_err     # near-zero gradients as run --check reports them
    for p in layer.parameters():
        p.grad = None
    ys, dxs = layer.train_step([layer.shard_input(x) for x, _ in batches], [layer.shard_input(dy) for _, dy in batches])
    grads = layer.full_grads()
    module.zero_grad(set_to_none=True)
    errs_y, pairs = [], {}
    for j, ((x, dy), y, dx) in enumerate(zip(batches, ys, dxs)):
        xr = x.detach().clone().requires_grad_(True)
        y_ref = call(module, xr) if call else module(xr)
        y_ref.backward(dy)
        errs_y.append(rel_err(layer.unshard_output(y), y_ref.detach()))
        pairs[f"<input mb{j}>"] = (layer.unshard_output(dx.contiguous()), xr.grad)
    dp = layer.layout.dp    # the DP sync averages parameter gradients over the replicas
    ref = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) / dp for k, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    missing = sorted(set(ref) - set(grads))
    if missing:
        raise KeyError(f"the compiled layer has no gradient for module parameters {missing}")
    report = grad_report({**pairs, **{k: (grads[k], g) for k, g in ref.items()}})
    report.pop("rel_err_input_grad")
    return {"max_rel_err_output": max(errs_y), **report}


MAX_LOCAL_RANKS = 64      # local CPU (gloo) ranks the launcher starts at most (as calibrate --n)


def world_size(args: argparse.Namespace) -> int:
    """n x dp ranks to launch; a UsageError (before any work) when this machine cannot start them:
    nccl needs one CUDA device per rank, gloo at most MAX_LOCAL_RANKS local processes."""
    from moegraph.options import UsageError
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


def available_memory_bytes() -> int | None:
    """MemAvailable of this machine (Linux /proc/meminfo), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_rank_memory(model: Any, layers: int, world: int, *, what: str, available: int | None = None) -> None:
    """UsageError (before any work) when ``world`` local ranks cannot fit in this machine's memory.

    A lower bound, not an estimate: every rank builds the whole seeded module in fp32 before
    sharding it (``seeded_stack``; ``MoETransformer.from_config`` for --train-steps), so it holds
    at least ``layers`` x ``ModelConfig.layer_param_bytes`` at once; activations, gradients and
    shards come on top. Past the machine's available memory the kernel kills a rank minutes in
    (a GPU-sized layer such as mixtral-8x7b on 8 CPU ranks needs ~46 GiB of weights alone)."""
    from moegraph.options import UsageError, format_bytes
    available = available_memory_bytes() if available is None else available
    per_rank = layers * model.layer_param_bytes
    if available is None or world * per_rank <= available:
        return
    stack = f"{layers} layers of {model.name}" if layers > 1 else f"a {model.name} layer"
    raise UsageError(f"{what} on this machine's CPU would hold at least {format_bytes(world * per_rank)}: each rank "
                     f"builds {stack} in fp32 ({format_bytes(per_rank)}) before sharding it, and only "
                     f"{format_bytes(available)} is available; run it on GPUs (--backend nccl) or with a smaller "
                     "--model, --layers or --n")


def step_stats(results: list[dict[str, Any]], plan_index: int = 0) -> dict[str, Any]:
    """Per step the slowest rank's time; the median over steps (and min, max)."""
    per_rank = [r["plans"][plan_index]["step_us"] for r in results]
    steps = [max(ts) for ts in zip(*per_rank)]
    return {"step_us": round(statistics.median(steps), 1), "step_us_min": round(min(steps), 1),
            "step_us_max": round(max(steps), 1), "step_us_all": [round(t, 1) for t in steps]}


# -- the command ----------------------------------------------------------------------------------

CPU_PROFILES = frozenset({"cpu-gloo", "cpu-2core-gloo", "cpu-2core-gloo-1gbit"})      # the shipped CPU profiles: not for --backend nccl


def run_command(p: argparse.ArgumentParser):
    from moegraph.commands import add_layer_args, add_memory_budget_arg, add_micro_batch_arg, print_result
    from moegraph.options import non_negative_int, positive_float, positive_int
    from moegraph.schedules.api import METHODS, MICROBATCH_METHODS
    from moegraph.runtime.netns import add_link_args
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
    from moegraph.options import UsageError
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
                     "top_k": g["dims"]["k"], "dtype": st["dtype"], "dp": st["dp"], "passes": tuple(st["passes"]),
                     # a merged step's nodes carry their micro-batch (moegraph.microbatch.MB_ATTR)
                     "micro_batches": len({n.attrs[MB_ATTR] for n in schedule.nodes if n.attrs.get(MB_ATTR) is not None})
                     or 1,
                     # a stack's nodes carry their layer index (moegraph.layers)
                     "layers": 1 + max((n.attrs[LAYER_ATTR] for n in schedule.nodes
                                        if n.attrs.get(LAYER_ATTR) is not None), default=0)}
    except (KeyError, TypeError) as err:
        raise UsageError(f"--schedule {path}: its graph or hardware misses {err}") from None
    try:
        # the graph is rebuilt from this typed value (moegraph.passes.lower_strategy), not from its labels
        strategy = Strategy.from_dict(st)
    except (ConfigError, TypeError) as err:
        raise UsageError(f"--schedule {path}: its strategy is not valid ({err})") from None
    for flag, value in given.items():
        want = from_file[flag]
        if flag == "layers" and value == "all":
            from moegraph.commands import resolve_layers
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
    from moegraph.passes.manager import label, staged
    return tuple(label(name, arg) for name, arg in staged(spec))


def _model_and_layers(args: argparse.Namespace) -> tuple[Any, int]:
    """The registry model and layer count ``args`` ask for (cheap: nothing traced)."""
    from moegraph.commands import resolve_layers
    from moegraph.registry import load_model
    model = load_model(args.model)
    return model, resolve_layers(getattr(args, "layers", 1), model)


def _ranks_phrase(args: argparse.Namespace, world: int) -> str:
    return f"--n {args.n} x --dp {args.dp} = {world} gloo ranks" if args.dp > 1 else f"--n {args.n} gloo ranks"


def load_model_name(model: str) -> str:
    from moegraph.registry import load_model
    return load_model(model).name


def _hardware_name(hardware: str) -> str:
    from moegraph.registry import load_hardware
    return load_hardware(hardware).name


def run(args: argparse.Namespace) -> dict[str, Any]:
    from moegraph.cli import UsageError
    from moegraph.commands import layer_from_args
    from moegraph.layers import layer_count
    from moegraph.microbatch import micro_batch_count
    from moegraph.runtime.module import make_plan
    from moegraph.expert_rows import expert_rows_refusal, padded_rows_extra_bytes
    from moegraph.runtime.cudagraph import capture_refusal
    from moegraph.runtime.plan import FUSED_AS_MEMBERS, ExecutionPlan, fused_group_count
    from moegraph.runtime.netns import emulated_link, link_from_args, link_mismatch
    t0 = time.time()
    hardware_given = not isinstance(args.hardware, Unset)
    args, schedule = resolve_layer_args(args)
    for flag in ("steps",):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag}={getattr(args, flag)} must be a positive integer")
    if args.warmup < 0 or args.timeout <= 0:
        raise UsageError(f"--warmup={args.warmup} must be >= 0 and --timeout={args.timeout} > 0")
    check_cuda_graph_args(args)
    if args.trace:
        trace_paths(args.trace)                       # refused before the ranks run, not after
    if args.expert_rows != "exact" and args.train_steps is not None:
        raise UsageError(f"--expert-rows {args.expert_rows} applies to the timed layer; --train-steps trains a whole "
                         "model with exact expert rows (leave --expert-rows out)")
    link = link_from_args(args)
    if link is not None and args.backend != "gloo":
        raise UsageError(f"--link {link} shapes gloo's loopback sockets; --backend {args.backend} moves data "
                         f"over the GPUs' own links, which it cannot shape")
    check_micro_batch_args(args)
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
        layer = layer_from_args(args, multi_layer=True)
        if warning := link_mismatch(layer.hardware, link):
            print(warning, file=sys.stderr, flush=True)
        if schedule is not None:
            check_same_graph(layer.graph, schedule, args.schedule)
        if why := expert_rows_refusal(layer.graph, args.expert_rows) or capture_refusal(
                layer.graph, ExecutionPlan.sequential(layer.graph), args.cuda_graphs, args.expert_rows):
            raise UsageError(why)                         # before scheduling and spawning
        # said once planned: a budget below the least feasible peak fails inside make_plan, and bad
        # input gets exactly one stderr line
        plan = make_plan(layer.graph, layer.cost, schedule if schedule is not None else args.schedule,
                         memory_budget=args.memory_budget, time_limit_s=args.time_limit)
        progress(t0, f"planned: schedule {plan.method}")
        results = spawn_plans(layer, (plan,), steps=args.steps, warmup=args.warmup, seed=args.seed, device=device,
                              backend=args.backend, timeout_s=args.timeout, check=args.check,
                              cuda_graphs=args.cuda_graphs, expert_rows=args.expert_rows, progress_t0=t0)
    g = layer.graph
    report: dict[str, Any] = {
        "model": layer.model.name, "hardware": layer.hardware.name, "backend": args.backend, "n": args.n,
        "layers": layer_count(g), "dp": g.strategy.dp,
        "link": str(link) if link else "none",
        "strategy": {"attn": g.strategy.attn, "ffn": g.strategy.ffn, "dispatch": g.strategy.dispatch,
                     "dtype": g.strategy.dtype, "passes": list(g.strategy.passes)},
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
    if fused := fused_group_count(g):
        report.update({"fused_groups": fused, "executed_as": FUSED_AS_MEMBERS})
    if args.check:
        c = results[0]["check"]
        report.update({k: v for k, v in c.items() if k != "rel_err_input_grad"})
    traces = _rank_traces(results)
    if args.compare_prediction:
        from moegraph.runtime.trace import compare_prediction
        report["prediction"] = compare_prediction(plan, traces[0], step_us=report["step_us"])
    if args.trace:
        report["trace"] = write_traces(args.trace, g, plan, traces, report["step_us_all"], layer.hardware)
    return report


def check_cuda_graph_args(args: argparse.Namespace) -> None:
    """--cuda-graphs against the other flags (UsageError before any work): CUDA graphs need NCCL
    ranks on CUDA devices, capture one-micro-batch layers, and record no per-node traces."""
    from moegraph.options import UsageError
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
    from moegraph.options import UsageError
    from moegraph.schedules.api import MICROBATCH_METHODS
    M = getattr(args, "micro_batches", 1)       # code that builds run's args by hand may leave it out
    if args.schedule in MICROBATCH_METHODS and M < 2:
        raise UsageError(f"--schedule {args.schedule} pairs one micro-batch's forward with another's backward: "
                         f"it needs --micro-batches M >= 2 (got {M})")


@dataclass(frozen=True)
class TrainSpec:
    """What a training rank needs (``train_rank``); picklable."""

    model: Any                    # registry ModelConfig
    layers: int
    vocab: int
    plan: Any                     # ExecutionPlan of the model's stacked layers
    attn: str
    ffn: str
    dispatch: str
    passes: str | Strategy        # a --passes pipeline, or a schedule file's strategy (compile_model)
    hardware: Any                 # registry Hardware
    batch: int
    seq: int
    steps: int
    seed: int
    check: bool
    timeout_s: float
    dp: int = 1                   # replicas: the spawned world is n x dp ranks
    micro_batches: int = 1        # M >= 2: each step one merged plan of M micro-batches (train_step)
    progress_t0: float | None = None   # rank 0 reports progress (``progress``); None: silent
    dtype: str = "fp32"           # the parameters' dtype: the plan's graph was lowered in it


def train_rank(rank: int, world: int, spec: TrainSpec) -> dict[str, Any]:
    """One rank (of ``world`` = n x dp) of ``run --train-steps``: seeded MoETransformer, compiled
    with the parent's plan, trained ``spec.steps`` AdamW steps on seeded random tokens (labels =
    the tokens: next-token prediction; the global batch [dp*b, s], replica p its rows p*b ..);
    with ``check``, the eager model trained alike on the global batch is compared (every rank)."""
    import torch
    from moegraph.models import MoETransformer
    from moegraph.runtime.check import train_against_eager, train_microbatches_against_eager
    from moegraph.runtime.model import compile_model
    torch.manual_seed(spec.seed)
    # in the plan's dtype: compile_model lowers the model in its parameters' dtype
    model = MoETransformer.from_config(spec.model, layers=spec.layers, vocab=spec.vocab).to(
        {"fp32": torch.float32, "bf16": torch.bfloat16}[spec.dtype])
    gen = torch.Generator().manual_seed(spec.seed + 1)
    M = spec.micro_batches
    batches = [(ids, ids) for ids in (torch.randint(0, spec.vocab, (spec.dp * spec.batch, spec.seq), generator=gen)
                                      for _ in range(spec.steps * M))]
    compiled = compile_model(model, batches[0][0], hardware=spec.hardware, attn=spec.attn, ffn=spec.ffn,
                             dispatch=spec.dispatch, passes=spec.passes, schedule=spec.plan, n=world // spec.dp,
                             timeout_s=spec.timeout_s, dp=spec.dp, micro_batches=M)
    t0 = time.perf_counter()
    shown = spec.progress_t0 if rank == 0 else None
    steps = [batches[k * M:(k + 1) * M] for k in range(spec.steps)]
    if spec.check:
        progress(shown, f"training {spec.steps} steps compiled, then eager alike (--check)")
    if M > 1 and spec.check:
        res = train_microbatches_against_eager(model, compiled, steps)
    elif M > 1:
        opt = torch.optim.AdamW(compiled.parameters(), lr=1e-4)
        losses = []
        for step in steps:
            opt.zero_grad()
            losses.append([x.item() for x in compiled.train_step(*map(list, zip(*step)))])
            opt.step()
            progress(shown, f"step {len(losses)}/{spec.steps}: losses {', '.join(f'{x:.4f}' for x in losses[-1])}")
        res = {"losses": losses}
    elif spec.check:
        res = train_against_eager(model, compiled, batches)
    else:
        opt = torch.optim.AdamW(compiled.parameters(), lr=1e-4)
        losses = []
        for ids, labels in batches:
            opt.zero_grad()
            loss = compiled(ids, labels=labels).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
            progress(shown, f"step {len(losses)}/{spec.steps}: loss {losses[-1]:.4f}")
        res = {"losses": losses}
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


def is_model_step(schedule: Any) -> bool:
    """Whether a schedule file schedules a model step (a stack with the model's edges: embedding,
    final norm, LM head; what compile and tune write for --layers L >= 2, schedules.api.model_step)
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
    from moegraph.options import UsageError
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
    from moegraph.cli import UsageError
    from moegraph.commands import layer_from_args
    from moegraph.edges import add_edges
    from moegraph.layers import layer_count
    from moegraph.microbatch import micro_batch_count
    from moegraph.registry import load_model
    from moegraph.runtime.launch import spawn
    from moegraph.runtime.module import make_plan
    refused = [flag for flag, given in (("--trace", args.trace), ("--compare-prediction", args.compare_prediction),
                                         ("--link", link is not None), ("--backend nccl", args.backend != "gloo"))
               if given]
    if refused:
        raise UsageError(f"--train-steps runs a CPU training check; it does not take {', '.join(refused)}")
    model = load_model(args.model)
    if model.first_k_dense_replace:
        raise UsageError(f"--train-steps: {model.name} has {model.first_k_dense_replace} dense first layers; the "
                         "compiled model needs identical layers")
    if model.router_aux_loss_coef:
        # the trained model (moegraph.models.MoETransformer) has no load-balancing term, so neither its
        # compiled copy nor its eager check could add one: the plan's aux nodes would match nothing
        raise UsageError(f"--train-steps: {model.name} has router_aux_loss_coef={model.router_aux_loss_coef:g}; "
                         "the CPU training check runs the project's MoETransformer, which has no load-balancing "
                         "loss (set it to 0; compile and tune schedule the term, and transformers' models train "
                         "with it through moegraph.compile)")
    world = world_size(args)
    check_rank_memory(*_model_and_layers(args), world, what=_ranks_phrase(args, world))
    layer = layer_from_args(args, multi_layer=True)
    layers = layer_count(layer.graph)
    # the graph compile_model builds on every rank: the stack (merged over --micro-batches M by
    # layer_from_args) plus the edges
    graph = add_edges(layer.graph, vocab=args.vocab)
    if schedule is not None:
        check_same_graph(graph, schedule, args.schedule)
    plan = make_plan(graph, layer.cost, schedule if schedule is not None else args.schedule,
                     memory_budget=args.memory_budget, time_limit_s=args.time_limit)
    progress(t0, f"planned: schedule {plan.method} of the {layers}-layer model step")
    st = layer.graph.strategy
    # with a schedule file, every rank rebuilds the file's graph from its typed strategy
    passes = getattr(args, "schedule_strategy", None) or args.passes
    spec = TrainSpec(layer.model, layers, args.vocab, plan, st.attn, st.ffn, st.dispatch, passes,
                     layer.hardware, args.batch, args.seq, args.train_steps, args.seed, args.check, args.timeout, st.dp,
                     micro_batch_count(layer.graph), t0, st.dtype)
    progress(t0, f"starting {world} gloo ranks (each compiles the model)")
    results = spawn(train_rank, world, args=(spec,), timeout_s=args.timeout * 4 + 300, pg_timeout_s=args.timeout)
    r = results[0]
    report: dict[str, Any] = {
        "model": layer.model.name, "layers": layers, "vocab": args.vocab, "hardware": layer.hardware.name,
        "n": st.n, "dp": st.dp, "strategy": {"attn": st.attn, "ffn": st.ffn, "dispatch": st.dispatch, "dtype": st.dtype,
                                "passes": list(st.passes)},
        "batch": args.batch, "seq": args.seq, "schedule": plan.method, "plan_hash": plan.hash,
        "train_steps": args.train_steps, "micro_batches": spec.micro_batches, "losses": r["losses"],
        "seconds": max(x["seconds"] for x in results),
        **memory_report(plan, None, "cpu", args.memory_budget if schedule is not None else None)}
    if args.check:
        report.update({k: r[k] for k in ("eager_losses", "max_rel_err_loss", "max_rel_err_params", "worst_param",
                                         "max_rel_err_grads", "worst_grad")})
    return report


def format_train_report(r: dict[str, Any]) -> str:
    st = r["strategy"]
    lines = [f"{r['model']} ({r['layers']} layers, vocab {r['vocab']}) on {r['hardware']}: attn={st['attn']} "
             f"ffn={st['ffn']} dispatch={st['dispatch']} n={r['n']}" + (f" x dp={r['dp']}" if r.get("dp", 1) > 1 else "")
             + f" b={r['batch']} s={r['seq']} {st['dtype']}"
             + (f" passes={','.join(st['passes'])}" if st["passes"] else ""),
             f"schedule {r['schedule']} (plan {r['plan_hash'][:12]}), {r['train_steps']} AdamW steps"
             + (f" of {r['micro_batches']} micro-batches (one merged plan each)"
                if r.get("micro_batches", 1) > 1 else "")
             + f" in {r['seconds']:.2f} s",
             format_memory(r),
             "losses: " + ", ".join(f"{x:.5f}" if isinstance(x, float) else "[" + ", ".join(f"{y:.5f}" for y in x) + "]"
                                    for x in r["losses"])]
    if "max_rel_err_loss" in r:
        what = "training with gradient accumulation" if r.get("micro_batches", 1) > 1 else "training"
        lines.append(f"check vs eager {what}: max rel err loss {r['max_rel_err_loss']:.2e}, final params "
                     f"{r['max_rel_err_params']:.2e} (worst: {r['worst_param']}), first-step grads "
                     f"{r['max_rel_err_grads']:.2e} (worst: {r['worst_grad']})")
    return "\n".join(lines)


def spawn_plans(layer: Any, plans: tuple, *, steps: int, warmup: int, seed: int = 0, device: str = "cpu",
                backend: str = "gloo", timeout_s: float = 120.0, check: bool = False,
                implementation: Implementation = "reference", cuda_graphs: CudaGraphs = "off",
                expert_rows: ExpertRows = "exact", progress_t0: float | None = None) -> list[dict[str, Any]]:
    """Start the layer's n ranks, time every plan on each (``run_rank``); one result per rank.
    ``progress_t0``: the command's start, to report progress on stderr (``progress``).
    ``implementation``: the eager module the layer's graph was traced from (its parameter names);
    ``cuda_graphs``: what the layers replay as CUDA graphs (``runtime.cudagraph``);
    ``expert_rows``: the local index maps' rows (``moegraph.kernels.build_index_map``)."""
    from moegraph.runtime.launch import spawn
    spec = RunSpec(layer.model, layer.graph, tuple(plans), steps, warmup, seed, layer.graph.strategy.dtype, device,
                   timeout_s, check, implementation, cuda_graphs, expert_rows, progress_t0)
    world = layer.graph.strategy.n * layer.graph.strategy.dp         # n x dp ranks, replica-major
    progress(progress_t0, f"starting {world} {backend} ranks (each builds its shard of the layer)")
    return spawn(run_rank, world, args=(spec,), backend=backend, timeout_s=timeout_s * 4 + 300,
                 pg_timeout_s=timeout_s)


def measure_schedule(layer: Any, method: str, *, steps: int = 10, warmup: int = 2, check: bool = False,
                     time_limit_s: float = 10.0) -> dict[str, Any]:
    """One schedule of a lowered layer on fresh gloo CPU ranks: predicted and measured (median,
    slowest rank) step us, and with ``check`` the error against the eager module."""
    from moegraph.runtime.module import make_plan
    plan = make_plan(layer.graph, layer.cost, method, time_limit_s=time_limit_s)
    results = spawn_plans(layer, (plan,), steps=steps, warmup=warmup, check=check)
    row = {"schedule": plan.method, "predicted_us": plan.predicted_makespan_us, **step_stats(results)}
    if check:
        row["check"] = results[0]["check"]
    return row


def _rank_traces(results: list[dict[str, Any]], plan_index: int = 0):
    from moegraph.runtime.trace import trace_from_dict
    return [[trace_from_dict(t) for t in r["plans"][plan_index]["traces"]] for r in results]


def write_traces(out: str, graph: Any, plan: Any, traces: list[list[Any]], steps_us: list[float],
                 hardware: Any = None) -> dict[str, Any]:
    """The median step (``traced_step``): rank 0's as a measured schedule file (OUT), the plan's
    prediction as a schedule file (OUT.predicted.json), all ranks' as a Chrome trace
    (OUT.chrome.json). Also returns which step that is and its time."""
    from moegraph.runtime.trace import chrome_trace, measured_schedule, predicted_schedule, schedule_json, write_json
    k = traced_step(steps_us)
    paths = trace_paths(out)
    measured = measured_schedule(traces[0][k], graph, plan, hardware=hardware, step=k, step_us=steps_us[k])
    written = {"schedule": str(write_json(paths["schedule"], schedule_json(measured)))}
    predicted = predicted_schedule(graph, plan, hardware=hardware)
    if predicted is not None:
        written["predicted"] = str(write_json(paths["predicted"], schedule_json(predicted)))
    written["chrome"] = str(write_json(paths["chrome"], chrome_trace([t[k] for t in traces], graph)))
    return {**written, "step": k, "step_us": steps_us[k], "of_steps": len(steps_us)}


def traced_step(steps_us: list[float]) -> int:
    """The step ``run --trace`` draws: the median step, a step that ran. With an even count no step
    has the median time (the mean of the middle two), so it is the faster middle step (the low
    median); the report names its index and time beside the median."""
    order = sorted(range(len(steps_us)), key=steps_us.__getitem__)
    return order[(len(order) - 1) // 2]


def trace_paths(out: str) -> dict[str, Path]:
    """The files ``run --trace OUT`` writes (``write_traces``), each checked before any work
    (``moegraph.options.check_output``: a UsageError naming the path, nothing written)."""
    from moegraph.options import check_output
    path = check_output(out, flag="--trace")
    paths = {"schedule": path, "predicted": path.with_suffix(".predicted.json"),
             "chrome": path.with_suffix(".chrome.json")}
    for p in paths.values():
        check_output(p, flag="--trace")
    return paths


def format_report(r: dict[str, Any]) -> str:
    if "train_steps" in r:
        return format_train_report(r)
    st = r["strategy"]
    lines = [f"{r['model']} on {r['hardware']}: attn={st['attn']} ffn={st['ffn']} dispatch={st['dispatch']} "
             f"n={r['n']}" + (f" x dp={r['dp']}" if r.get("dp", 1) > 1 else "")
             + f" b={r['batch']} s={r['seq']} {st['dtype']} backend={r['backend']}"
             + (f" cuda_graphs={r['cuda_graphs']}" if r.get("cuda_graphs", "off") != "off" else "")
             + (f" layers={r['layers']}" if r.get("layers", 1) > 1 else "")
             + (f" link={r['link']}" if r.get("link", "none") != "none" else "")
             + (f" passes={','.join(st['passes'])}" if st["passes"] else ""),
             f"schedule {r['schedule']} (plan {r['plan_hash'][:12]}), {r['steps']} steps after {r['warmup']} warm-up"
             + (f", {r['micro_batches']} micro-batches per step" if r.get("micro_batches", 1) > 1 else ""),
             f"step time: median {r['step_us'] / 1e3:.3f} ms (min {r['step_us_min'] / 1e3:.3f}, "
             f"max {r['step_us_max'] / 1e3:.3f})"
             + (f", predicted {r['predicted_step_us'] / 1e3:.3f} ms" if r.get("predicted_step_us") else ""),
             format_memory(r)]
    if r.get("fused_groups"):
        lines.append(f"{r['fused_groups']} {r['executed_as']}")
    if r.get("expert_rows", "exact") != "exact":
        from moegraph.options import format_bytes
        lines.append(f"expert rows {r['expert_rows']}: {format_bytes(r['padded_rows_extra_bytes'])} of expert-row "
                     "buffers per step beyond the plan's memory accounting")
    if "max_rel_err_output" in r:
        lines.append(("check vs eager gradient accumulation" if r.get("micro_batches", 1) > 1 else "check vs eager")
                     + f": max rel err output {r['max_rel_err_output']:.2e}, "
                     f"grads {r['max_rel_err_grads']:.2e} (worst: {r['worst_grad']})")
        if r.get("near_zero_grads"):
            lines.append(f"  analytically zero gradients {', '.join(r['near_zero_grads'])}: error "
                         f"{r['max_err_near_zero_grads']:.1e} of the largest gradient norm")
    if "prediction" in r:
        pr = r["prediction"]
        lines += ["", f"{'node':<34} {'stream':<8} {'predicted us':>13} {'measured us':>12} {'error':>8}"]
        for row in pr["nodes"]:
            err = "" if row["rel_err"] is None else f"{row['rel_err'] * 100:+.0f}%"
            lines.append(f"{row['name']:<34} {row['stream']:<8} {row['predicted_us']:>13.1f} "
                         f"{row['measured_us']:>12.1f} {err:>8}")
        t = pr["total"]
        if t["predicted_us"] is not None:
            lines.append(f"{'total (makespan vs step)':<43} {t['predicted_us']:>13.1f} {t['measured_us']:>12.1f} "
                         f"{t['rel_err'] * 100:+7.0f}%")
        if pr["mean_abs_rel_err"] is not None:
            lines.append(f"mean |per-node error|: {pr['mean_abs_rel_err'] * 100:.0f}%")
    if "trace" in r:
        tr = r["trace"]
        which = (f"step {tr['step']} ({tr['step_us'] / 1e3:.3f} ms, "
                 + (f"the faster of the two middle steps of {tr['of_steps']}" if tr["of_steps"] % 2 == 0
                    else "the median step") + ")") if "step" in tr else "the median step"
        lines.append(f"trace of {which}: {tr['schedule']} (measured schedule)"
                     + (f", {tr['predicted']} (predicted)" if "predicted" in tr else "")
                     + f", {tr['chrome']} (Chrome trace)")
    return "\n".join(lines)
