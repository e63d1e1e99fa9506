"""The pass manager: order a pipeline, build each pass from its typed step, run it, verify after each.

    graph, report = run_pipeline(graph, (GateReorder(), Sar("paper")), cost=cost)

A pass is a plain function ``Graph -> PassResult``, built from its typed step and the cost model
(``moegraph.pass_steps``: the step types hold its arguments; ``sar("paper", cost)`` builds one by
hand). The manager knows each pass by a ``PassSpec`` (its name, builder, stage and valid
arguments) and runs a ``BuiltPass``: the function, its label and its scope, a typed field saying
whether it rewrites one decoder layer or the whole step graph.

Order is data (``PassSpec.stage``), and the manager sorts the pipeline by it (stably), so
``sar=paper,dispatch=auto`` runs dispatch first. The table, lowest stage first:

    stage  pass          scope  kind      why here
    -1     stack         step   model     L identical layers (passes/stack.py): first, so that
                                          sar's model-wide budget sees the stack
    0      gate-reorder  layer  re-lower  changes the MoE block's op sequence; later searches price it
    1      dispatch      layer  re-lower  chunk=auto's search should see the chosen dispatch
    2      chunk         layer  re-lower  splits whatever dispatch chain was chosen
    3      compress      layer  rewrite   replaces collectives; a re-lowering after it would undo it
    4      sar           layer  rewrite   decides on the final graph's values, pricing the rebuilt
                         (step            nodes (compressed collectives included); sar=budget on a
                          budget)         stack shares the budget among its layers
    5      fuse          layer  annotate  marks fused comm+compute groups on the final nodes (chunked
                                          or not, recompute included); changes attributes only
    10     microbatches  step   model     M micro-batches of the rewritten stack (passes/microbatch.py)
    11     edges         step   model     the causal LM's embedding, norm, head (passes/edges.py): after
                                          the layers, per micro-batch, following compress=dp-bf16's wire format
    12     stages        step   model     the pipeline's stage split (passes/stages.py): last, as it assigns
                                          the edges to the first and last stages and adds the P2P nodes

The user names the passes of stages 0-5 (``moegraph.pass_steps.STEPS``); the driver adds the
model-level ones from ``CompileConfig`` (layers, micro_batches, edges, pp), and the report lists only
the user's. A layer-scoped pass on a stack runs once on the stack's layer graph (the layers are
identical) and is restacked.

Re-lowering passes rebuild the layer from its program (``moegraph.tracer.relower``), which
discards every graph rewrite, so all of them precede the rewrites; a re-lowering pass applied
by hand to a rewritten graph refuses (see ``require_unrewritten``). A pass named twice is an
error. Failures become ``PassError`` naming the pass and the passes that ran before it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

from moegraph.cost import CostModel
from moegraph.ir import Graph, verify
from moegraph.layers import LayerKinds, layer_count, layer_kinds
from moegraph.microbatch import micro_batch_count
from moegraph.pass_steps import STEPS, PassError, label, parse_passes, step_label  # noqa: F401 (re-exported)
from moegraph.passes.stack import StackLayers, stack_kinds, stack_layers


@dataclass(frozen=True)
class PassResult:
    """What a pass returns. ``changed`` is False when the graph computes with the same nodes,
    values and saved set (strategy bookkeeping aside); ``report`` is JSON-serialisable."""

    graph: Graph
    changed: bool
    report: Mapping[str, Any] = field(default_factory=dict, compare=False)


Pass = Callable[[Graph], PassResult]

Scope = Literal["layer", "step"]
"""What a pass rewrites: one decoder layer, or the whole step graph (module docstring)."""


@dataclass(frozen=True)
class BuiltPass:
    """A pass built for one pipeline: its label, its function and its scope."""

    label: str
    """What the graph records (``Strategy.passes``) and the report is keyed by."""
    run: Pass
    scope: Scope = "layer"
    """'layer': the pass rewrites one decoder layer; on a stack of identical layers the manager
    runs it on the stack's layer graph once and restacks, exact for a pass whose decisions are
    local to a layer. 'step': it rewrites the whole graph it is given (stacking, micro-batch
    merging, the model's edges, sar's model-wide budget)."""
    reported: bool = True
    """Whether the pipeline's report lists it: the user's passes are; the model-level steps the
    driver adds from the config's layers, micro-batches and edges are not (the graph shows them)."""


@dataclass(frozen=True)
class PassSpec:
    """What the manager knows of a pass: how to build it from its typed step, where it runs."""

    name: str
    build: Callable[[Any, CostModel | None], BuiltPass]   # (step, cost model) -> the built pass
    stage: int
    valid: str                                            # the accepted arguments, for error messages
    relowers: bool
    step: type                                            # the typed step it is built from


PASSES: dict[str, PassSpec] = {}
"""The user's passes by name (what a pipeline may name: ``moegraph.pass_steps.STEPS``)."""
MODEL_PASSES: dict[type, PassSpec] = {}
"""The model-level rewrites the driver adds (stack, micro-batch merge, edges), by step type."""


def register(name: str, *, stage: int, relowers: bool, scope: Callable[[Any], Scope] = lambda step: "layer"):
    """Decorator on a builder ``(arg text or None, cost) -> Pass`` of a user pass: adds it to
    PASSES, built from its typed step (``moegraph.pass_steps.STEPS[name]``), labelled by it, with
    the scope ``scope(step)``."""
    step_type = STEPS[name]

    def wrap(build):
        def built(step, cost):
            return BuiltPass(step_label(step), build(step.arg, cost), scope(step))
        PASSES[name] = PassSpec(name, built, stage, step_type.VALID, relowers, step_type)
        return build
    return wrap


def register_model_pass(step_type: type, *, stage: int):
    """Decorator on a builder ``(step, cost) -> Pass`` of a model-level rewrite (scope 'step',
    not reported): adds it to MODEL_PASSES."""
    def wrap(build):
        def built(step, cost):
            return BuiltPass(step.NAME, build(step, cost), "step", reported=False)
        MODEL_PASSES[step_type] = PassSpec(step_type.NAME, built, stage, "", False, step_type)
        return build
    return wrap


def spec_of(step: Any) -> PassSpec:
    """The PassSpec a typed step is built by (PassError naming it when there is none)."""
    spec = MODEL_PASSES.get(type(step)) or PASSES.get(getattr(step, "NAME", None))
    if spec is None or not isinstance(step, spec.step):
        raise PassError(f"{step!r} is not a pass step; valid: {', '.join(sorted(PASSES))} "
                        "(moegraph.pass_steps), or a model-level step")
    return spec


def build_pass(step: Any, cost: CostModel | None) -> BuiltPass:
    """The pass ``step`` describes; a bad argument raises PassError listing the valid ones."""
    spec = spec_of(step)
    try:
        return spec.build(step, cost)
    except ValueError as err:
        raise PassError(f"pass {spec.name!r}: invalid argument {step.arg!r} ({err}); valid: {spec.valid}") from err


def staged(steps: str | Sequence[Any]) -> list[Any]:
    """The steps of a pipeline (typed, or its text form) in the order they run (by stage): the
    order their labels take in a graph's strategy.passes. A user pass named twice is a PassError."""
    steps = parse_passes(steps) if isinstance(steps, str) else tuple(steps)
    names = [s.NAME for s in steps if type(s) not in MODEL_PASSES]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise PassError(f"pass {twice[0]!r} is given twice in pipeline {steps!r}")
    return sorted(steps, key=lambda s: spec_of(s).stage)


def run_pipeline(graph: Graph, steps: str | Sequence[Any], *, cost: CostModel | None) -> tuple[Graph, dict[str, Any]]:
    """Run the passes of ``steps`` in stage order, verifying after each. ``steps``: typed steps
    (``moegraph.pass_steps``, and the model-level ones the driver adds), or a pipeline's text
    form ("gate-reorder,sar=paper", read by ``parse_passes``: for people, tests and benchmarks).

    Returns the final graph and the report: {"pipeline": [labels in run order], <pass name>:
    that pass's report, ...}, for the reported (user) passes.
    """
    return run_passes(graph, [build_pass(step, cost) for step in staged(steps)])


def run_passes(graph: Graph, passes: Sequence[BuiltPass]) -> tuple[Graph, dict[str, Any]]:
    """Run built passes in the order given, verifying after each: what run_pipeline does once
    the steps are built, and what the typed path (``passes_for``) runs. A layer-scoped pass on
    a stack runs once on its layer graph and is restacked (``BuiltPass.scope``). Returns the
    final graph and the report (as run_pipeline's)."""
    report: dict[str, Any] = {"pipeline": [p.label for p in passes if p.reported]}
    done: list[str] = []
    for p in passes:
        if p.scope == "layer" and micro_batch_count(graph) > 1:
            # a layer pass rewrites one micro-batch's layer (restacking would drop the other micro-batches)
            raise PassError(f"graph {graph.name!r} is a merged step of {micro_batch_count(graph)} micro-batches: "
                            f"run {p.label!r} on the micro-batch graph, then merge (moegraph.passes.microbatch)")
        try:
            result = _run_scoped(p, graph)
            verify(result.graph)
        except (ValueError, NotImplementedError) as err:
            before = ", ".join(done) if done else "none"
            raise PassError(f"pass {p.label!r} failed (passes before it: {before}): {err}") from err
        graph = result.graph
        if p.reported:
            report[p.label.partition("=")[0]] = dict(result.report)
        done.append(p.label)
    return graph, report


def _run_scoped(p: BuiltPass, graph: Graph) -> PassResult:
    """``p`` on ``graph`` by its scope: a layer pass on a stack rewrites each distinct layer graph
    once (one, or each kind of a mixed stack: ``moegraph.layers.LayerKinds``) and the result is
    restacked, its report the (first kind's) one layer's with ``layers`` added."""
    layers = layer_count(graph)
    if p.scope == "step" or layers == 1:
        return p.run(graph)
    if p.scope != "layer":
        raise PassError(f"pass {p.label!r} has scope {p.scope!r}; valid: layer, step")
    kinds = layer_kinds(graph)
    results = [p.run(g) for g in kinds.graphs]
    report = {**results[0].report, "layers": layers, "report_is": "per layer"}
    if kinds.mixed:
        report |= {"layer_kinds": len(kinds.graphs), "report_is": "per layer, of the first layer's kind"}
    return PassResult(stack_kinds(LayerKinds(tuple(r.graph for r in results), kinds.pattern)),
                      any(r.changed for r in results), report)


@register_model_pass(StackLayers, stage=-1)
def stack(step: StackLayers, cost: CostModel | None = None) -> Pass:
    """The stack pass (``moegraph.passes.stack``): registered here, as the manager restacks with it."""
    def run(graph: Graph) -> PassResult:
        out = stack_layers(graph, step.layers)
        return PassResult(out, out is not graph)
    return run


# -- helpers the passes share ------------------------------------------------------------

def record(graph: Graph, pass_label: str, **strategy_changes: Any) -> Graph:
    """``graph`` with strategy fields changed and ``pass_label`` appended to strategy.passes."""
    strategy = dataclasses.replace(graph.strategy, passes=graph.strategy.passes + (pass_label,),
                                   **strategy_changes)
    return dataclasses.replace(graph, strategy=strategy)


def mark_rewritten(graph: Graph, pass_label: str) -> Graph:
    """Note in graph.meta that a rewrite ran, so a later re-lowering pass can refuse."""
    return graph.with_meta(rewritten_by=tuple(graph.meta_get("rewritten_by", ())) + (pass_label,))


def require_unrewritten(graph: Graph, pass_label: str) -> None:
    done = graph.meta_get("rewritten_by", ())
    if done:
        raise ValueError(f"{pass_label} re-lowers the layer, which would discard the rewrites of "
                         f"{', '.join(done)}; run it before them")


def same_computation(a: Graph, b: Graph) -> bool:
    """True when b has a's nodes, values and saved set (what ``changed`` reports)."""
    return a.nodes == b.nodes and a.values == b.values and a.saved == b.saved
