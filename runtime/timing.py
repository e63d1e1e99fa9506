"""Timing a compiled layer: its plans run on spawned ranks, step by step, and the step statistics.

The parent compiles (``moegraph.schedules.driver``) and hands each rank a ``RunSpec``: the
registry model (each rank builds the seeded reference module from it), the graph, the execution
plans to time and the runtime options. A rank runs warm-up steps, then every plan's measured
steps in ABBA blocks (``measurement_blocks``); the step time of a step is the slowest rank's.
What `moegraph run`, the demo, calibration and the benchmarks time.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from moegraph.config import CompileConfig
from moegraph.runtime.device_memory import DeviceMemory
from moegraph.runtime.options import RuntimeOptions
from moegraph.runtime.reference import Implementation, seeded_stack
from moegraph.layers import layer_count
from moegraph.microbatch import micro_batch_count


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
    options: RuntimeOptions       # how each rank's layers run their plan (timeout, CUDA graphs, expert rows)
    check: bool = False
    implementation: "Implementation" = "reference"
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
    from moegraph.runtime.check import check_against_eager, check_microbatches_against_eager
    from moegraph.runtime.module import build_layer
    from moegraph.runtime.trace import trace_to_dict
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec.dtype]
    module, call = seeded_stack(spec.model, spec.seed, layer_count(spec.graph), spec.dtype, spec.implementation)
    module = module.to(spec.device)
    # buffers too: DeepSeek-V3's router reads its score-correction bias
    full = {k: t.detach() for k, t in [*module.named_parameters(), *module.named_buffers()]}
    n = spec.graph.strategy.n                   # ``rank`` is global: one of n x dp (world_size)
    layers = [build_layer(spec.graph, plan, full, rank=rank, n=n, options=spec.options) for plan in spec.plans]
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

def step_stats(results: list[dict[str, Any]], plan_index: int = 0) -> dict[str, Any]:
    """Per step the slowest rank's time; the median over steps (and min, max)."""
    per_rank = [r["plans"][plan_index]["step_us"] for r in results]
    steps = [max(ts) for ts in zip(*per_rank)]
    return {"step_us": round(statistics.median(steps), 1), "step_us_min": round(min(steps), 1),
            "step_us_max": round(max(steps), 1), "step_us_all": [round(t, 1) for t in steps]}


# -- the command ----------------------------------------------------------------------------------

def spawn_plans(layer: Any, plans: tuple, *, steps: int, warmup: int, seed: int = 0, device: str = "cpu",
                backend: str = "gloo", options: RuntimeOptions = RuntimeOptions(timeout_s=120.0), check: bool = False,
                implementation: Implementation = "reference", progress_t0: float | None = None) -> list[dict[str, Any]]:
    """Start the layer's n ranks, time every plan on each (``run_rank``); one result per rank.
    ``layer``: a lowered registry model (``moegraph.schedules.driver.Lowered``: its model and
    graph); ``options``: how the ranks' layers run (``RuntimeOptions``); ``progress_t0``: the
    command's start, to report progress on stderr (``progress``); ``implementation``: the eager
    module the layer's graph was traced from (its parameter names)."""
    from moegraph.runtime.launch import spawn
    spec = RunSpec(layer.model, layer.graph, tuple(plans), steps, warmup, seed, layer.graph.strategy.dtype, device,
                   options, check, implementation, progress_t0)
    world = layer.graph.strategy.n * layer.graph.strategy.dp         # n x dp ranks, replica-major
    progress(progress_t0, f"starting {world} {backend} ranks (each builds its shard of the layer)")
    return spawn(run_rank, world, args=(spec,), backend=backend, timeout_s=options.timeout_s * 4 + 300,
                 pg_timeout_s=options.timeout_s)

def measure_schedule(config: CompileConfig, *, steps: int = 10, warmup: int = 2, check: bool = False) -> dict[str, Any]:
    """One config compiled by the driver (its schedule method) and run on fresh gloo CPU ranks:
    predicted and measured (median, slowest rank) step us, and with ``check`` the error against
    the eager module."""
    from moegraph.runtime.module import compiled_plan
    lowered, plan = compiled_plan(config)
    results = spawn_plans(lowered, (plan,), steps=steps, warmup=warmup, check=check)
    row = {"schedule": plan.method, "predicted_us": plan.predicted_makespan_us, **step_stats(results)}
    if check:
        row["check"] = results[0]["check"]
    return row

def rank_traces(results: list[dict[str, Any]], plan_index: int = 0):
    """Per rank, the step traces of plan ``plan_index`` that ``run_rank`` recorded."""
    from moegraph.runtime.trace import trace_from_dict
    return [[trace_from_dict(t) for t in r["plans"][plan_index]["traces"]] for r in results]


__all__ = ["RunSpec", "global_batch", "measure_schedule", "measurement_blocks", "micro_batch_inputs", "progress",
           "rank_traces", "run_rank", "spawn_plans", "step_stats", "timed_steps"]
