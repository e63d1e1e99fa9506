"""In-step calibration: time real training steps and fit how much slower each op class runs
inside a step than alone.

The microbenchmarks of ``moegraph.runtime.calibrate.benchmarks`` time each kernel alone, with its operands warm in
cache and nothing else running. Inside a real step the same kernel finds its operands evicted by
the multi-MiB weight GEMMs before it, shares the cores with the collective threads, pays the
executor's per-node host overhead, and every collective also absorbs the other ranks' lateness
(uneven routing, OS scheduling). On the 2-core VM these made a `small` layer's step 1.4-1.7x
longer than the summed isolated prediction. This stage measures that directly:

1. For each layer of IN_STEP_LAYERS (CALIBRATION_LAYERS and ACCUMULATE_LAYER), lower it for ``n`` ranks and run it with the runtime
   (``moegraph.runtime.timing.spawn_plans``) under the sequential schedule: every node alone on the
   host, so a node's measured span is its in-step time.
2. Per node, the median over steps and ranks of its service time (m: its span minus any wait
   behind the node before it on the same stream, ``service_spans``); per step, the slowest
   rank's time; the median step (T). The freshly fitted isolated profile prices each node (p, its kernel latency
   kappa).
3. Fit, pooling the layers: per op class c (``moegraph.cost.op_class``) the factor
   F_c = sum_c (m - kappa) / sum_c (p - kappa), over the N priced nodes (views cost 0 in the
   model). Then every F_c is scaled by one r = (sum T - N kappa) / sum_c F_c sum_c (p - kappa):
   what the per-node medians miss (gaps between nodes, the slowest rank setting each step, the
   right skew of each node's spans) is spread over the classes in proportion to their time, so
   the profile's sequential makespan of the pooled layers equals their pooled measured steps.
   Expert GEMMs (GROUPED_GEMM) get two numbers instead of one factor: least squares over their
   nodes of m - kappa = F (p - kappa) + stream_bytes / W_s (``fit_stream``). stream_bytes is one
   expert's weights per row segment (moegraph/lowering/blocks.py): the calibration layers differ
   in it at similar FLOPs (all-to-all dispatch feeds two segments per expert, ag-rs one), which
   separates the weight traffic from the FLOPs; a chunked layer pays W_s once per chunk. W_s is
   scaled by r with the factors and stored as in_step_stream_bw_bytes_s.
   The chunked ACCUMULATE_LAYER, whose weight-gradient kernels but the last chunk's carry
   attr accumulate=True, stays out of all of that: what its accumulating kernels take beyond
   the same kernel without the running sum (the last chunk's, timed in the same steps; else
   their fitted price), summed, over their summed accumulate_bytes gives accumulate_bw_bytes_s
   (scaled by r too). The runtime adds the sum as a separate pass over a fresh weight-sized
   tensor, which inside a step cost 3-5 ms per 8 MiB on the 2-core VM (page faults on the new
   buffer included), 4x what the same kernel pair takes alone in a loop.

4. Collectives beside compute: each unchunked layer also times a greedy plan in the same launch;
   comm_overlap_stretch is fitted so that its measured order, re-timed with the in-step profile
   (``retimed_makespan_us``), takes the pooled measured steps (``fit_overlap_stretch``).

CALIBRATION_LAYERS is the calibration set, named as data: the factors are fitted on exactly these
layers, so a prediction for one of them is in-sample. Held-out validation
(benchmarks/heldout.py, docs/calibration.md "Calibration set") runs only layers outside it.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from moegraph.config import CompileConfig
from moegraph.registry import IN_STEP_CLASSES, Hardware

__all__ = ["CALIBRATION_LAYERS", "ACCUMULATE_LAYER", "IN_STEP_LAYERS", "SOLO_LAYERS", "measure_solo", "LayerConfig", "StepSample", "measure_steps", "service_spans", "fit_in_step", "fit_stream", "fit_overlap_stretch", "retimed_makespan_us", "MAX_STRETCH", "InStepFit", "in_step_checks", "relative_mad",
           "STEP_STAGE_S"]



@dataclass(frozen=True)
class LayerConfig:
    """One decoder layer as the calibration runs it: a model (registry name or YAML path), the
    sequence length s (batch 1) and the parallel strategy; no passes (the sequential schedule
    times every node alone). ``batch`` and ``attn_nodes`` (Strategy.attn_nodes) describe held-out
    layers only (benchmarks/heldout.py): the calibration runs none."""

    model: str
    seq: int
    attn: Literal["tp", "sp"]
    ffn: Literal["tp", "ep"]
    dispatch: Literal["a2a", "ag-rs"]
    chunks: int = 1                   # token chunks of the MoE block (the chunk pass's N)
    batch: int = 1
    attn_nodes: int = 1

    def __str__(self) -> str:
        return (f"{self.model} s={self.seq} {self.attn}/{self.ffn}/{self.dispatch}"
                + (f" chunk={self.chunks}" if self.chunks > 1 else "") + (f" b={self.batch}" if self.batch > 1 else "")
                + (f" attn_nodes={self.attn_nodes}" if self.attn_nodes > 1 else ""))


# The calibration set: both attention and FFN strategies and both dispatches, so every collective
# kind and every op class is timed. docs/calibration.md lists it; change both together.
CALIBRATION_LAYERS = (LayerConfig("small", 512, "sp", "ep", "ag-rs"), LayerConfig("small", 256, "tp", "ep", "a2a"),
                      LayerConfig("small", 384, "tp", "tp", "ag-rs"))
# Timed in the same stage after them: the first calibration layer in two token chunks, the one
# place the calibration sees a weight gradient accumulated into a running sum. It fits only
# accumulate_bw_bytes_s; a chunked layer of these sizes is in-sample for that number.
ACCUMULATE_LAYER = LayerConfig("small", 512, "sp", "ep", "ag-rs", chunks=2)
IN_STEP_LAYERS = CALIBRATION_LAYERS + (ACCUMULATE_LAYER,)
# Timed last, at n = 1 on two processes: what a rank's compute takes with no collective between its
# nodes (Hardware.solo_in_step_factors). Two sequence lengths, so that the expert GEMMs' weight
# streaming separates from their FLOPs. In the calibration set: an n = 1 layer of these sizes is in-sample.
SOLO_LAYERS = (LayerConfig("small", 512, "sp", "ep", "ag-rs"), LayerConfig("small", 256, "sp", "ep", "ag-rs"))
STEPS, WARMUP = 12, 2
STEP_STAGE_S = 60.0          # what the stage needs on the 2-core VM (four spawns of ~5-15 s)


@dataclass(frozen=True)
class StepSample:
    """One layer's measured sequential steps: per node the median span (us) over steps and
    ranks, and the median step (us, slowest rank per step)."""

    label: str
    graph: Any                        # moegraph.ir.Graph
    node_us: tuple[tuple[str, float], ...]
    step_us: float
    noise: float = 0.0                # relative median absolute deviation of the steps
    overlap_plan: Any = None          # the greedy plan timed beside the sequential one (ExecutionPlan)
    overlap_step_us: float = 0.0      # its median step (us, slowest rank per step)


def relative_mad(values: Sequence[float]) -> float:
    """median |v - median| / median: a spread measure that a few stalled steps do not dominate."""
    mid = statistics.median(values)
    return statistics.median(abs(v - mid) for v in values) / mid if mid > 0 else 0.0


def service_spans(nodes: Sequence[Any]) -> dict[str, float]:
    """Per node of one measured step (``moegraph.runtime.trace.NodeTiming``): the time it kept its
    stream busy, end - max(start, end of the previous node on the same stream).

    A collective's recorded span runs from its issue to its completion. The sequential plan issues
    back-to-back collectives (the weight-gradient all-reduces at the end of the backward) at once,
    and gloo runs one stream's collectives one after another, so each later span also holds the
    wait for the ones queued before it: on the 1 Gbit/s link the five all-reduces of a `small`
    sp layer summed 206 ms of spans in a 186 ms step. The cost model prices a node alone and
    the sequential makespan is the sum of the node prices, so the in-step fit needs each node's
    own service time."""
    out: dict[str, float] = {}
    free: dict[str, float] = {}                       # stream -> end of its last node so far
    for nt in sorted(nodes, key=lambda t: (t.start_us, t.end_us)):
        begin = max(nt.start_us, free.get(nt.stream, nt.start_us))
        out[nt.name] = max(0.0, nt.end_us - begin)
        free[nt.stream] = max(free.get(nt.stream, nt.end_us), nt.end_us)
    return out


def measure_steps(hw: Hardware, n: int, *, layers: Sequence[LayerConfig] = IN_STEP_LAYERS, steps: int = STEPS,
                  warmup: int = WARMUP, deadline: float | None = None,
                  log: Callable[[str], None] = lambda _: None, dp: int = 1) -> list[StepSample]:
    """Run each layer's sequential schedule on ``n`` x ``dp`` fresh gloo CPU ranks; stop early
    (fewer samples) when the next layer would start after ``deadline`` (time.time())."""
    from moegraph.runtime.timing import spawn_plans, step_stats
    from moegraph.runtime.trace import trace_from_dict
    out = []
    for lc in layers:
        if deadline is not None and time.time() + STEP_STAGE_S / len(layers) > deadline:
            break
        t = time.time()
        lowered, plan, probe = step_plans(lc, hw, n, dp)
        plans = (plan,) if probe is None else (plan, probe)
        results = spawn_plans(lowered, plans, steps=steps, warmup=warmup)
        graph = lowered.graph
        spans: dict[str, list[float]] = defaultdict(list)
        for r in results:
            for d in r["plans"][0]["traces"]:
                for name, us in service_spans(trace_from_dict(d).nodes).items():
                    spans[name].append(us)
        stats = step_stats(results)
        step = stats["step_us"]
        label = f"{lc} n={n}" + (f" dp={dp}" if dp > 1 else "")
        overlap_us = step_stats(results, 1)["step_us"] if probe is not None else 0.0
        out.append(StepSample(label, graph, tuple((k, statistics.median(v)) for k, v in spans.items()), step,
                              relative_mad(stats["step_us_all"]), probe, overlap_us))
        log(f"in-step {label}: {steps} sequential steps, median {step / 1e3:.1f} ms"
            + (f"; greedy {overlap_us / 1e3:.1f} ms" if probe is not None else "") + f" ({time.time() - t:.1f}s)")
    return out


def step_config(lc: LayerConfig, hw: Hardware, n: int, dp: int = 1) -> CompileConfig:
    """The config one in-step layer is compiled with: the registry model at fp32, no passes, its
    chunks lowered directly, on ``hw`` (the profile being calibrated), scheduled greedily (the
    overlap probe; the sequential plan is read off the same graph)."""
    from moegraph.ir import Strategy
    return CompileConfig(model=lc.model, strategy=Strategy(attn=lc.attn, ffn=lc.ffn, dispatch=lc.dispatch, n=n,
                                                           dtype="fp32", chunks=lc.chunks, dp=dp),
                         passes=(), schedule="greedy", batch=1, seq=lc.seq, hardware=hw)


def step_plans(lc: LayerConfig, hw: Hardware, n: int, dp: int = 1) -> tuple[Any, Any, Any]:
    """(the lowered layer, its sequential plan, the greedy probe plan or None) of one in-step
    layer, compiled by the driver (``step_config``). Sequential: one node at a time, so each span
    is in-step time; the unchunked layers also time the greedy plan (collectives beside compute)
    in the same launch, ABBA-interleaved: fit_overlap_stretch fits comm_overlap_stretch on it."""
    from moegraph.runtime.module import compiled_plan
    from moegraph.runtime.plan import ExecutionPlan
    from moegraph.schedules.driver import lower
    config = step_config(lc, hw, n, dp)
    if lc.chunks == 1 and n > 1:              # at n = 1 there is no collective to overlap
        lowered, probe = compiled_plan(config)
    else:
        lowered, probe = lower(config), None
    return lowered, ExecutionPlan.sequential(lowered.graph), probe


@dataclass(frozen=True)
class InStepFit:
    """What the in-step stage fits: per op class factors (Hardware.in_step_factors), the expert
    GEMMs' weight-streaming rate (Hardware.in_step_stream_bw_bytes_s) and the gradient
    accumulation rate (Hardware.accumulate_bw_bytes_s); a rate of 0 = no such term."""

    factors: dict[str, float]
    stream_bw_bytes_s: float = 0.0
    accumulate_bw_bytes_s: float = 0.0


def fit_stream(xs: Sequence[float], ys: Sequence[float], zs: Sequence[float]) -> tuple[float, float]:
    """Least squares y = F x + c z over one class's nodes (x: isolated price above kappa, z: the
    node's stream_bytes, y: measured above kappa); (F, c). Falls back to (sum y / sum x, 0) where
    the data cannot separate the two terms (every node the same z/x) or the fit gives c <= 0 or
    F <= 0, or the term would explain under 1% of the nodes' time: then no streaming term is
    claimed."""
    sxx = sum(x * x for x in xs)
    szz = sum(z * z for z in zs)
    sxz = sum(x * z for x, z in zip(xs, zs))
    sxy = sum(x * y for x, y in zip(xs, ys))
    szy = sum(z * y for z, y in zip(zs, ys))
    det = sxx * szz - sxz * sxz
    plain = (sum(ys) / sum(xs), 0.0) if sum(xs) > 0 else (1.0, 0.0)
    if szz <= 0 or det <= 1e-9 * sxx * szz:
        return plain
    f = (sxy * szz - szy * sxz) / det
    c = (szy * sxx - sxy * sxz) / det
    return (f, c) if f > 0 and c > 0 and c * sum(zs) >= 0.01 * sum(ys) else plain


def _kernel_key(node: Any, accumulate_bytes: int) -> tuple:
    """What makes two compute nodes the same kernel call, the running sum's input taken off."""
    return node.op, node.role, node.module, node.flops, node.mem_bytes - accumulate_bytes


def fit_in_step(hw: Hardware, samples: Sequence[StepSample]) -> InStepFit:
    """Factors and rates as the module docstring's step 3 defines them. ``hw`` prices the nodes
    alone: its own in-step factors and in-step rates are ignored. A layer with accumulating
    kernels (the chunked ACCUMULATE_LAYER) gives only the accumulation rate, so the factors,
    the streaming rate and the common scale come from the unchunked calibration layers alone."""
    import dataclasses

    from moegraph.cost import CostModel, byte_attr, op_class
    from moegraph.ir import OpKind
    if not samples:
        raise ValueError("fit_in_step needs at least one measured layer")
    stream_fit = "the in-step fit prices in_step_stream_bw_bytes_s by it"
    alone = dataclasses.replace(hw, in_step_factors=(), in_step_stream_bw_bytes_s=0.0, accumulate_bw_bytes_s=0.0)
    cost, kappa = CostModel(alone), hw.kernel_latency_us
    measured: dict[str, float] = defaultdict(float)
    predicted: dict[str, float] = defaultdict(float)
    grouped: list[tuple[float, float, float]] = []    # (x, y, z) of the expert GEMMs
    summing: list[tuple[str, float, float, float, float, tuple[float, float] | None]] = []
    # ^ (class, x, y, z, accumulate_bytes, (x, y) of the same kernel without the sum in that layer or None)
    steps = 0.0
    priced = streamed = 0
    for s in samples:
        spans = dict(s.node_us)
        missing = [node.name for node in s.graph.nodes if node.name not in spans]
        if missing:
            raise ValueError(f"{s.label}: no measured span for node {missing[0]!r}")
        nodes = [node for node in s.graph.nodes if node.op is not OpKind.SPLIT]   # views: free in the model
        x = {node.name: cost.node_time_us(node) - kappa for node in nodes}
        if any(node.attr("accumulate", False) for node in nodes):
            # the last chunk's kernel of the same shapes runs without the running sum: its sibling
            plain = {_kernel_key(node, 0): (x[node.name], spans[node.name] - kappa) for node in nodes
                     if not node.attr("accumulate", False)}
            for node in nodes:
                if node.attr("accumulate", False):
                    w = byte_attr(node, "accumulate_bytes", "the in-step fit prices accumulate_bw_bytes_s by it")
                    z = float(byte_attr(node, "stream_bytes", stream_fit)) if node.op is OpKind.GROUPED_GEMM else 0.0
                    summing.append((op_class(node), x[node.name], spans[node.name] - kappa, z, float(w),
                                    plain.get(_kernel_key(node, w))))
            continue
        for node in nodes:
            c = op_class(node)
            measured[c] += spans[node.name] - kappa
            predicted[c] += x[node.name]
            if node.op is OpKind.GROUPED_GEMM:
                grouped.append((x[node.name], spans[node.name] - kappa,
                                float(byte_attr(node, "stream_bytes", stream_fit))))
            priced += 1
        steps += s.step_us
    if priced == 0:
        raise ValueError("fit_in_step needs at least one measured layer without gradient accumulation")
    factors = {c: measured[c] / predicted[c] for c in IN_STEP_CLASSES if predicted[c] > 0}
    us_per_byte = 0.0
    if grouped:
        xs, ys, zs = zip(*grouped)
        factors["grouped_gemm"], us_per_byte = fit_stream(xs, ys, zs)
        streamed = sum(zs)
    # What the medians of single nodes miss: gaps between nodes, the slowest rank setting each
    # step, and the skew of each node's spans (the sum of medians undershoots the median sum)
    scaled = sum(factors[c] * predicted[c] for c in factors) + us_per_byte * streamed
    scale = max(1e-9, steps - priced * kappa) / scaled
    # accumulating kernels: what they take beyond the same kernel without the running sum, timed
    # in the same steps where the layer has one (a paired difference: neither load drift between
    # layers nor the fits above enter it; the sum's input is also priced as memory traffic, so the
    # price difference of the two comes off), else beyond their fitted price
    us_per_sum_byte = 0.0
    sum_bytes = sum(w for *_, w, _ in summing)
    if sum_bytes > 0:
        extra = sum(y - (sib[1] + factors.get(c, 1.0) * (x - sib[0]) if sib is not None
                         else factors.get(c, 1.0) * x + us_per_byte * z)
                    for c, x, y, z, _, sib in summing)
        us_per_sum_byte = max(0.0, extra) / sum_bytes

    def rate(us: float) -> float:
        return float(f"{1e6 / (us * scale):.4g}") if us > 0 else 0.0
    return InStepFit({c: round(min(100.0, max(0.1, f * scale)), 4) for c, f in factors.items()},
                     rate(us_per_byte), rate(us_per_sum_byte))


def retimed_makespan_us(graph: Any, cost: Any, plan: Any, stretch: float) -> float:
    """The makespan of ``plan``'s fixed order (per stream, forward before backward) when ``cost``
    prices every node and each collective that the plan runs beside compute takes ``stretch``
    times its alone time; a node starts once its inputs' producers and the node before it on its
    stream have ended. The order stays what was measured, so the makespan grows with stretch."""
    from moegraph.schedules.problem import mode_duration_us   # the scheduler's own pricing of a mode
    producer, node = graph.producer, graph.node
    end: dict[str, float] = {}
    stream_free: dict[str, float] = defaultdict(float)
    fwd_end = 0.0
    fwd, bwd = plan.split(graph)
    for phase_entries, is_fwd in ((fwd, True), (bwd, False)):
        for e in phase_entries:
            nd = node[e.name]
            # a compute entry's sm_budget: the SMs it runs on (0: unset, all)
            held = e.sm_budget if nd.is_comm else (cost.sm_count() - e.sm_budget if e.sm_budget else 0)
            us = mode_duration_us(nd, cost, held, alone=e.alone, stretch=stretch)
            ready = max([end[producer[v].name] for v in nd.inputs if v in producer and producer[v].name in end],
                        default=0.0)
            begin = max(ready, stream_free[e.stream], 0.0 if is_fwd else fwd_end)
            end[e.name] = begin + us
            stream_free[e.stream] = end[e.name]
        if is_fwd:
            fwd_end = max(end.values(), default=0.0)
    return max(end.values(), default=0.0)


def measure_solo(hw: Hardware, *, layers: Sequence[LayerConfig] = (), steps: int = STEPS, warmup: int = WARMUP,
                 deadline: float | None = None, log: Callable[[str], None] = lambda _: None) -> list[StepSample]:
    """SOLO_LAYERS (or ``layers``) at n = 1 under the sequential schedule, each on two gloo
    processes (dp = 2, its replicas: both cores busy, as two pipeline stages keep them), compiled on
    ``hw``; stops early as ``measure_steps`` does."""
    return measure_steps(hw, 1, layers=layers or SOLO_LAYERS, steps=steps, warmup=warmup, deadline=deadline,
                         log=log, dp=2)


MAX_STRETCH = 4.0


def fit_overlap_stretch(hw: Hardware, samples: Sequence[StepSample]) -> float | None:
    """comm_overlap_stretch fitted in-step: the x in [1, MAX_STRETCH] at which the pooled
    retimed makespans of the probed (greedy) plans equal their pooled measured steps, by
    bisection (the retimed makespan does not fall as x grows). ``hw`` must already carry the
    in-step factors, so the sequential steps are priced right and what the overlapped steps
    take beyond the retimed order is put down to the collectives beside compute (on a CPU their
    transfer threads share the cores with the compute). None without a probed layer; 1 when
    the measured steps are no longer than the retimed order at x = 1."""
    from moegraph.cost import CostModel
    probed = [s for s in samples if s.overlap_plan is not None and s.overlap_step_us > 0]
    if not probed:
        return None
    cost = CostModel(hw)
    target = sum(s.overlap_step_us for s in probed)

    def total(x: float) -> float:
        return sum(retimed_makespan_us(s.graph, cost, s.overlap_plan, x) for s in probed)
    if total(1.0) >= target:
        return 1.0
    if total(MAX_STRETCH) <= target:
        return MAX_STRETCH
    lo, hi = 1.0, MAX_STRETCH
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) < target else (lo, mid)
    return round((lo + hi) / 2, 3)


@dataclass(frozen=True)
class StepCheck:
    """One measured layer: the sequential makespan the profile predicts against the measured step."""

    label: str
    predicted_us: float
    measured_us: float
    schedule: str = "sequential"

    @property
    def error(self) -> float:
        return self.predicted_us / self.measured_us - 1

    def line(self) -> str:
        return (f"in-step {self.label}: {self.schedule} step {self.predicted_us / 1e3:.1f} ms predicted vs "
                f"{self.measured_us / 1e3:.1f} ms measured ({self.error:+.1%})")


def in_step_checks(hw: Hardware, samples: Sequence[StepSample]) -> list[StepCheck]:
    """Per measured layer: the sequential makespan ``hw`` predicts against the measured step; per
    probed layer also its greedy plan's retimed makespan against its measured step."""
    from moegraph.cost import CostModel
    cost = CostModel(hw)
    checks = [StepCheck(s.label, sum(cost.node_time_us(node) for node in s.graph.nodes), s.step_us) for s in samples]
    # the greedy probes at the profile's stretch (fitted pooled over them: in-sample, per-layer spread)
    return checks + [StepCheck(s.label, retimed_makespan_us(s.graph, cost, s.overlap_plan, hw.comm_overlap_stretch),
                               s.overlap_step_us, "greedy") for s in samples if s.overlap_plan is not None]
