"""The pass manager: parse a pipeline spec, order it, run each pass, verify after each.

    graph, report = run_pipeline(graph, "sar=paper,gate-reorder,dispatch=auto,chunk=auto", cost=cost)

A pass is a plain function ``Graph -> PassResult``; a pass with options is built from its
argument and its context (``sar("paper", cost=cost)``). The manager knows each pass by a
``PassSpec``: its name, how to build it, its stage and the arguments it accepts.

Order is data (``PassSpec.stage``), and the manager sorts the pipeline by it (stably), so
``sar=paper,dispatch=auto`` runs dispatch first. The table, lowest stage first:

    stage  pass          kind      why here
    0      gate-reorder  re-lower  changes the MoE block's op sequence; later searches price it
    1      dispatch      re-lower  chunk=auto's search should see the chosen dispatch
    2      chunk         re-lower  splits whatever dispatch chain was chosen
    3      compress      rewrite   replaces collectives; a re-lowering after it would undo it
    4      sar           rewrite   decides on the final graph's values, pricing the rebuilt
                                   nodes (compressed collectives included)
    5      fuse          annotate  marks fused comm+compute groups on the final nodes (chunked
                                   or not, recompute included); changes attributes only

Re-lowering passes rebuild the layer from its program (``moegraph.tracer.relower``), which
discards every graph rewrite, so all of them precede the rewrites; a re-lowering pass applied
by hand to a rewritten graph refuses (see ``require_unrewritten``). A pass named twice is an
error. Failures become ``PassError`` naming the pass and the passes that ran before it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from moegraph.cost import CostModel
from moegraph.ir import Graph, verify
from moegraph.layers import layer_count, layer_graph, stack_layers
from moegraph.microbatch import micro_batch_count


class PassError(ValueError):
    """A bad pipeline spec, or a pass that failed; the message names the pass (and its predecessors)."""


@dataclass(frozen=True)
class PassResult:
    """What a pass returns. ``changed`` is False when the graph computes with the same nodes,
    values and saved set (strategy bookkeeping aside); ``report`` is JSON-serialisable."""

    graph: Graph
    changed: bool
    report: Mapping[str, Any] = field(default_factory=dict, compare=False)


Pass = Callable[[Graph], PassResult]


@dataclass(frozen=True)
class PassSpec:
    name: str
    build: Callable[[str | None, CostModel], Pass]   # (argument or None, cost model) -> pass
    stage: int
    valid: str                                       # the accepted arguments, for error messages
    relowers: bool


def register(name: str, *, stage: int, valid: str, relowers: bool):
    """Decorator on a builder ``(arg, cost) -> Pass``; adds it to PASSES."""
    def wrap(build):
        PASSES[name] = PassSpec(name, build, stage, valid, relowers)
        return build
    return wrap


PASSES: dict[str, PassSpec] = {}


def label(name: str, arg: str | None) -> str:
    return name if arg is None else f"{name}={arg}"


def parse_pipeline(spec: str | list[str] | tuple[str, ...]) -> list[tuple[str, str | None]]:
    """``"a,b=x"`` or ``["a", "b=x"]`` -> [("a", None), ("b", "x")]; unknown names raise PassError."""
    if isinstance(spec, str) and not spec.strip():
        return []
    items = [item.strip() for item in (spec.split(",") if isinstance(spec, str) else spec)]
    out: list[tuple[str, str | None]] = []
    for item in items:
        if not item:
            raise PassError(f"empty pass name in pipeline {spec!r}; valid: {', '.join(sorted(PASSES))}")
        name, eq, arg = item.partition("=")
        name, arg = name.strip(), (arg.strip() if eq else None)
        if name not in PASSES:
            raise PassError(f"unknown pass {name!r}; valid: {', '.join(sorted(PASSES))}")
        if any(name == seen for seen, _ in out):
            raise PassError(f"pass {name!r} is given twice in pipeline {spec!r}")
        out.append((name, arg))
    return out


def build_pass(name: str, arg: str | None, cost: CostModel) -> Pass:
    """The pass ``name=arg``; a bad argument raises PassError listing the valid ones."""
    spec = PASSES[name]
    try:
        return per_layer(spec.build(arg, cost))
    except ValueError as err:
        raise PassError(f"pass {name!r}: invalid argument {arg!r} ({err}); valid: {spec.valid}") from err


def per_layer(run: Pass) -> Pass:
    """``run`` on a multi-layer graph (``moegraph.layers``): the layers are identical, so the
    pass rewrites the one-layer graph once and the result is restacked. Exact for every pass
    whose decisions are local to a layer; a pass deciding at model level (sar=budget) refuses
    multi-layer graphs itself, before this runs. The report is the one layer's, with
    ``layers`` added; a one-layer graph passes straight through. A pass that handles layers
    itself is marked ``layer_aware`` and returned as it is."""
    if getattr(run, "layer_aware", False):
        return run

    def wrapped(graph: Graph) -> PassResult:
        layers = layer_count(graph)
        if layers == 1:
            return run(graph)
        result = run(layer_graph(graph))
        return PassResult(stack_layers(result.graph, layers), result.changed,
                          {**result.report, "layers": layers, "report_is": "per layer"})
    wrapped.layer_aware = True
    return wrapped


def run_pipeline(graph: Graph, spec: str | list[str] | tuple[str, ...], *,
                 cost: CostModel) -> tuple[Graph, dict[str, Any]]:
    """Run the passes of ``spec`` in stage order, verifying after each.

    Returns the final graph and the report: {"pipeline": [labels in run order], <pass name>:
    that pass's report, ...}.
    """
    return run_passes(graph, [(label(name, arg), build_pass(name, arg, cost)) for name, arg in staged(spec)])


def staged(spec: str | list[str] | tuple[str, ...]) -> list[tuple[str, str | None]]:
    """``spec``'s (name, argument) pairs in the order they run (by stage): the order their labels
    take in a graph's strategy.passes."""
    return sorted(parse_pipeline(spec), key=lambda it: PASSES[it[0]].stage)


def run_passes(graph: Graph, passes: list[tuple[str, Pass]]) -> tuple[Graph, dict[str, Any]]:
    """Run built ``(label, pass)`` pairs in the order given, verifying after each: what
    run_pipeline does once the spec is parsed, and what the typed path (``passes_for``) runs.
    Returns the final graph and the report (as run_pipeline's)."""
    if micro_batch_count(graph) > 1:
        # a pass rewrites one micro-batch's layer (restacking would drop the other micro-batches)
        raise PassError(f"graph {graph.name!r} is a merged step of {micro_batch_count(graph)} micro-batches: run the "
                        "passes on the micro-batch graph, then merge (moegraph.microbatch.merge_microbatches)")
    report: dict[str, Any] = {"pipeline": [lab for lab, _ in passes]}
    done: list[str] = []
    for lab, run in passes:
        try:
            result = run(graph)
            verify(result.graph)
        except (ValueError, NotImplementedError) as err:
            before = ", ".join(done) if done else "none"
            raise PassError(f"pass {lab!r} failed (passes before it: {before}): {err}") from err
        graph = result.graph
        report[lab.partition("=")[0]] = dict(result.report)
        done.append(lab)
    return graph, report


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
