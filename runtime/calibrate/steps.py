"""In-step calibration: time real training steps and fit how much slower each op class runs
inside a step than alone.

The microbenchmarks of ``moegraph.runtime.calibrate.benchmarks`` time each kernel alone, with its operands warm in
cache and nothing else running. Inside a real step the same kernel finds its operands evicted by
the multi-MiB weight GEMMs before it, shares the cores with the collective threads, pays the
executor's per-node host overhead, and every collective also absorbs the other ranks' lateness
(uneven routing, OS scheduling). On the 2-core VM these made a `small` layer's step 1.4-1.7x
longer than the summed isolated prediction. This stage measures that directly:

1. For each layer of CALIBRATION_LAYERS, lower it for ``n`` ranks and run it with the runtime
   (``moegraph.runtime.commands.spawn_plans``) under the sequential schedule: every node alone on the
   host, so a node's measured span is its in-step time.
2. Per node, the median span over steps and ranks (m); per step, the slowest rank's time; the
   median step (T). The freshly fitted isolated profile prices each node (p, its kernel latency
   kappa).
3. Fit, pooling the layers: per op class c (``moegraph.cost.op_class``) the factor
   F_c = sum_c (m - kappa) / sum_c (p - kappa), over the N priced nodes (views cost 0 in the
   model). Then every F_c is scaled by one r = (sum T - N kappa) / sum_c F_c sum_c (p - kappa):
   what the per-node medians miss (gaps between nodes, the slowest rank setting each step, the
   right skew of each node's spans) is spread over the classes in proportion to their time, so
   the profile's sequential makespan of the pooled layers equals their pooled measured steps.

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

from moegraph.registry import IN_STEP_CLASSES, Hardware

__all__ = ["CALIBRATION_LAYERS", "LayerConfig", "StepSample", "measure_steps", "fit_in_step", "in_step_checks", "relative_mad",
           "STEP_STAGE_S"]



@dataclass(frozen=True)
class LayerConfig:
    """One decoder layer as the calibration runs it: a model (registry name or YAML path), the
    sequence length s (batch 1) and the parallel strategy; no passes (the sequential schedule
    times every node alone)."""

    model: str
    seq: int
    attn: Literal["tp", "sp"]
    ffn: Literal["tp", "ep"]
    dispatch: Literal["a2a", "ag-rs"]

    def __str__(self) -> str:
        return f"{self.model} s={self.seq} {self.attn}/{self.ffn}/{self.dispatch}"


# The calibration set: both attention and FFN strategies and both dispatches, so every collective
# kind and every op class is timed. docs/calibration.md lists it; change both together.
CALIBRATION_LAYERS = (LayerConfig("small", 512, "sp", "ep", "ag-rs"), LayerConfig("small", 256, "tp", "ep", "a2a"),
                      LayerConfig("small", 384, "tp", "tp", "ag-rs"))
STEPS, WARMUP = 12, 2
STEP_STAGE_S = 60.0          # what the stage needs on the 2-core VM (three spawns of ~10-20 s)


@dataclass(frozen=True)
class StepSample:
    """One layer's measured sequential steps: per node the median span (us) over steps and
    ranks, and the median step (us, slowest rank per step)."""

    label: str
    graph: Any                        # moegraph.ir.Graph
    node_us: tuple[tuple[str, float], ...]
    step_us: float
    noise: float = 0.0                # relative median absolute deviation of the steps


def relative_mad(values: Sequence[float]) -> float:
    """median |v - median| / median: a spread measure that a few stalled steps do not dominate."""
    mid = statistics.median(values)
    return statistics.median(abs(v - mid) for v in values) / mid if mid > 0 else 0.0


def measure_steps(hw: Hardware, n: int, *, layers: Sequence[LayerConfig] = CALIBRATION_LAYERS, steps: int = STEPS,
                  warmup: int = WARMUP, deadline: float | None = None,
                  log: Callable[[str], None] = lambda _: None) -> list[StepSample]:
    """Run each layer's sequential schedule on ``n`` fresh gloo CPU ranks; stop early (fewer
    samples) when the next layer would start after ``deadline`` (time.time())."""
    from moegraph.commands import Layer
    from moegraph.cost import CostModel
    from moegraph.ir import Strategy
    from moegraph.registry import load_model
    from moegraph.tracer import trace_model
    from moegraph.runtime.commands import spawn_plans, step_stats
    from moegraph.runtime.plan import ExecutionPlan
    from moegraph.runtime.trace import trace_from_dict
    cost = CostModel(hw)
    out = []
    for lc in layers:
        model_name, seq, attn, ffn, dispatch = lc.model, lc.seq, lc.attn, lc.ffn, lc.dispatch
        if deadline is not None and time.time() + STEP_STAGE_S / len(layers) > deadline:
            break
        t = time.time()
        model = load_model(model_name)
        graph = trace_model(model, Strategy(attn=attn, ffn=ffn, dispatch=dispatch, n=n, dtype="fp32"),
                            batch=1, seq=seq)
        plan = ExecutionPlan.sequential(graph)      # one node at a time: each span is in-step time
        results = spawn_plans(Layer(model, hw, cost, graph, {}), (plan,), steps=steps, warmup=warmup)
        spans: dict[str, list[float]] = defaultdict(list)
        for r in results:
            for d in r["plans"][0]["traces"]:
                for nt in trace_from_dict(d).nodes:
                    spans[nt.name].append(nt.duration_us)
        stats = step_stats(results)
        step = stats["step_us"]
        label = f"{model_name} s={seq} {attn}/{ffn}/{dispatch} n={n}"
        out.append(StepSample(label, graph, tuple((k, statistics.median(v)) for k, v in spans.items()), step,
                              relative_mad(stats["step_us_all"])))
        log(f"in-step {label}: {steps} sequential steps, median {step / 1e3:.1f} ms ({time.time() - t:.1f}s)")
    return out


def fit_in_step(hw: Hardware, samples: Sequence[StepSample]) -> dict[str, float]:
    """Per-class factors as the module docstring's step 3 defines them."""
    from moegraph.cost import CostModel, op_class
    from moegraph.ir import OpKind
    if not samples:
        raise ValueError("fit_in_step needs at least one measured layer")
    cost, kappa = CostModel(hw), hw.kernel_latency_us
    measured: dict[str, float] = defaultdict(float)
    predicted: dict[str, float] = defaultdict(float)
    steps = 0.0
    priced = 0
    for s in samples:
        spans = dict(s.node_us)
        missing = [node.name for node in s.graph.nodes if node.name not in spans]
        if missing:
            raise ValueError(f"{s.label}: no measured span for node {missing[0]!r}")
        for node in s.graph.nodes:
            if node.op is OpKind.SPLIT:                    # a view: free in the cost model
                continue
            c = op_class(node)
            measured[c] += spans[node.name] - kappa
            predicted[c] += cost.node_time_us(node) - kappa
            priced += 1
        steps += s.step_us
    factors = {c: measured[c] / predicted[c] for c in IN_STEP_CLASSES if predicted[c] > 0}
    # What the medians of single nodes miss: gaps between nodes, the slowest rank setting each
    # step, and the skew of each node's spans (the sum of medians undershoots the median sum)
    scaled = sum(factors[c] * predicted[c] for c in factors)
    scale = max(1e-9, steps - priced * kappa) / scaled
    return {c: round(min(100.0, max(0.1, f * scale)), 4) for c, f in factors.items()}


@dataclass(frozen=True)
class StepCheck:
    """One measured layer: the sequential makespan the profile predicts against the measured step."""

    label: str
    predicted_us: float
    measured_us: float

    @property
    def error(self) -> float:
        return self.predicted_us / self.measured_us - 1

    def line(self) -> str:
        return (f"in-step {self.label}: sequential step {self.predicted_us / 1e3:.1f} ms predicted vs "
                f"{self.measured_us / 1e3:.1f} ms measured ({self.error:+.1%})")


def in_step_checks(hw: Hardware, samples: Sequence[StepSample]) -> list[StepCheck]:
    """Per measured layer: the sequential makespan ``hw`` predicts against the measured step."""
    from moegraph.cost import CostModel
    cost = CostModel(hw)
    return [StepCheck(s.label, sum(cost.node_time_us(node) for node in s.graph.nodes), s.step_us) for s in samples]
