"""Model-level graphs, read: L decoder layers stacked into one graph.

The rewrite that stacks them is a pass (``moegraph.passes.stack``); this module holds what the
stages after it read (the layer count, the one-layer graph, the chaining values, the names).

A one-layer graph (``moegraph.tracer.lower``) is lowered once and renamed L times: layer i's
nodes and values get the prefix ``l{i}.`` (``l3.attn_qkv``), its parameter sources the module
prefix ``layers.{i}.`` (as ``MoETransformer.layers`` and Hugging Face ``model.layers`` name
them), and every node carries its layer index as the int attribute ``layer`` (``Node.layer``).

Wiring: layer i+1 reads layer i's output in place of its own input (one value, so it is held
once when both layers hold it), and layer i's backward reads layer i+1's input gradient in
place of its own seed gradient. Nodes run all forwards (layer 0 first), then every backward
and recompute node, last layer first. Nothing else ties the layers together: a layer's
weight-gradient collectives depend only on that layer's backward, so the scheduler may run
them under earlier layers' backward.

Mixed stacks. A model whose layers differ (GPT-OSS's alternating sliding-window and full
attention, Llama 4's NoPE and dense layers, DeepSeek's dense first layers) is a stack of a few
distinct layer *kinds*: ``LayerKinds`` holds each kind's one-layer graph, lowered once, and the
pattern (layer i is kind ``pattern[i]``). A stack of one kind is the plain stack above; a mixed
one keeps its ``LayerKinds`` in ``graph.meta`` instead of one ``layer_graph`` (which then raises,
so a stage that reads one layer graph cannot silently take kind 0 for every layer). Before
stacking, the tracer hands the stack pass the kind-0 graph with its ``LayerKinds`` in its meta
(``KINDS_META``). The stacked graph's ``dims`` are layer 0's (b, s, h, n are every kind's).

Graph inputs: layer 0's input, every layer's parameters, the last layer's seed gradient.
Graph outputs: the last layer's output, layer 0's input gradient, every parameter gradient
(layer by layer). ``graph.meta`` keeps the one-layer graph (``layer_graph``) and the count
(``layers``), so a pass rewrites the layer once and restacks (``moegraph.passes.manager``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from typing import TYPE_CHECKING

from moegraph.ir import LAYER_ATTR, Graph, GraphError, ValueKind, freeze_attrs

if TYPE_CHECKING:
    from moegraph.tracer import LayerProgram

PARAM_PREFIX = "layers"
"""Module prefix of layer i's parameters: ``layers.{i}.<qualname in the layer>``."""


KINDS_META = "layer_kinds"
"""``graph.meta`` key of a mixed stack's ``LayerKinds`` (and of the kind-0 graph the tracer hands
the stack pass)."""


@dataclass(frozen=True)
class LayerKinds:
    """The distinct one-layer graphs of a stack and which one each layer is.

    graphs:  one one-layer graph per distinct kind, kind 0 first (layer 0's kind).
    pattern: layer i is ``graphs[pattern[i]]``; every kind occurs.
    """

    graphs: tuple[Graph, ...]
    pattern: tuple[int, ...]

    def __post_init__(self):
        if not self.graphs or not self.pattern or sorted(set(self.pattern)) != list(range(len(self.graphs))) \
                or self.pattern[0] != 0:
            raise GraphError(f"layer kinds: pattern {self.pattern} must start with kind 0 and use each of the "
                             f"{len(self.graphs)} kinds")

    @property
    def layers(self) -> int:
        return len(self.pattern)

    @property
    def mixed(self) -> bool:
        return len(self.graphs) > 1

    def period(self) -> int:
        """The shortest P dividing the layer count with layer i the kind of layer i mod P (1 for one
        kind; GPT-OSS's alternating layers 2; the layer count when nothing repeats, e.g. dense
        first layers)."""
        L = self.layers
        return next(P for P in range(1, L + 1) if not L % P and all(self.pattern[i] == self.pattern[i % P]
                                                                    for i in range(L)))

    def first_layer(self, kind: int) -> int:
        """The first layer of ``kind``."""
        return self.pattern.index(kind)

    def sub(self, layers) -> "LayerKinds":
        """The kinds of the layers ``layers`` (indices, in stack order; a pipeline stage's), the
        kinds renumbered by first appearance."""
        order = list(dict.fromkeys(self.pattern[i] for i in layers))
        return LayerKinds(tuple(self.graphs[k] for k in order), tuple(order.index(self.pattern[i]) for i in layers))

    def per_layer(self) -> tuple[Graph, ...]:
        """Layer i's graph for each i (identical layers share one graph object)."""
        return tuple(self.graphs[k] for k in self.pattern)


def layer_count(graph: Graph) -> int:
    """How many layers ``graph`` holds (1 for a one-layer graph)."""
    return int(graph.meta_get("layers", 1))


def layer_graph(graph: Graph) -> Graph:
    """The one-layer graph a multi-layer graph was stacked from (the graph itself for one layer).
    A mixed stack has several (``layer_kinds``): GraphError naming them."""
    if layer_count(graph) == 1:
        return graph
    kinds = graph.meta_get(KINDS_META)
    if kinds is not None:
        raise GraphError(f"graph {graph.name!r} stacks {len(kinds.graphs)} kinds of layers (pattern "
                         f"{_pattern_text(kinds.pattern)}): it has no one layer graph; read its layer_kinds")
    return graph.meta_get("layer_graph")


def layer_kinds(graph: Graph) -> LayerKinds:
    """The kinds of a stack (one kind, L times, for a plain stack), or of the kind-0 graph the
    tracer hands the stack pass (``KINDS_META``); a one-layer graph is one kind once."""
    kinds = graph.meta_get(KINDS_META)
    if kinds is not None:
        return kinds
    return LayerKinds((layer_graph(graph),), (0,) * layer_count(graph))


def _pattern_text(pattern: tuple[int, ...]) -> str:
    return "".join(chr(ord("A") + k) for k in pattern) if len(pattern) <= 16 else \
        "".join(chr(ord("A") + k) for k in pattern[:16]) + f"... ({len(pattern)} layers)"


def costed_layer(graph: Graph) -> Graph:
    """The one-layer graph of a plain stack priced as its layer 0 (``costed_kinds``)."""
    return costed_kinds(graph).graphs[0] if layer_count(graph) > 1 else graph


def costed_kinds(graph: Graph) -> LayerKinds:
    """The layer kinds of a stack (``layer_kinds``), each kind's graph with each node priced as the
    stack's first layer of that kind prices it: the stages after stacking (the aux loss, ``moegraph.edges``) rewrite the
    stacked layers' nodes (a router's flops, bytes and attrs), not the one-layer graph kept in
    ``meta``, so a schedule unit stacked from it must take them over to be the stack's layer.
    Inputs and outputs stay the one-layer graph's (an edge's values are not the layer's).
    Not verified again: the kernels it describes are not run from it, only priced."""
    kinds = layer_kinds(graph)
    if layer_count(graph) == 1:
        return kinds
    stacked = {n.name: n for n in graph.nodes}
    costed = []
    for k, one in enumerate(kinds.graphs):
        i = kinds.first_layer(k)
        nodes = []
        for n in one.nodes:
            s = stacked.get(f"l{i}.{n.name}")
            if s is None or s.op is not n.op or s.phase is not n.phase:
                raise GraphError(f"graph {graph.name!r} has no layer-{i} node like {n.name!r} of its one-layer "
                                 "graph: the layers were not stacked from it")
            attrs = {key: v for key, v in s.attrs if key != LAYER_ATTR}
            nodes.append(dataclasses.replace(n, flops=s.flops, mem_bytes=s.mem_bytes, comm_bytes=s.comm_bytes,
                                             group=s.group, attrs=freeze_attrs(attrs)))
        costed.append(dataclasses.replace(one, nodes=tuple(nodes)))
    return LayerKinds(tuple(costed), kinds.pattern)


def boundary(graph: Graph) -> tuple[str, str, str, str]:
    """(input, seed gradient, output, input gradient) of a one-layer graph: the values that
    chain one layer to the next. The input is the one activation graph input, the seed the one
    gradient graph input; outputs[0] and outputs[1] are the layer output and input gradient."""
    acts = [v for v in graph.inputs if graph.value[v].kind is ValueKind.ACTIVATION]
    seeds = [v for v in graph.inputs if graph.value[v].kind is ValueKind.GRAD]
    if len(acts) != 1 or len(seeds) != 1 or len(graph.outputs) < 2:
        raise GraphError(f"graph {graph.name!r} has activation inputs {acts}, seed gradients {seeds} and "
                         f"{len(graph.outputs)} outputs: a stackable layer has one input, one seed gradient, "
                         "an output and an input gradient")
    x, seed = acts[0], seeds[0]
    y, dx = graph.outputs[0], graph.outputs[1]
    if graph.value[y].shape != graph.value[x].shape or graph.value[dx].shape != graph.value[x].shape \
            or graph.value[dx].kind is not ValueKind.GRAD:
        raise GraphError(f"graph {graph.name!r}: output {y!r} and input gradient {dx!r} must have the input "
                         f"{x!r}'s shape {graph.value[x].shape} to chain layers")
    return x, seed, y, dx


__all__ = ["KINDS_META", "LAYER_ATTR", "PARAM_PREFIX", "LayerKinds", "boundary", "costed_kinds", "costed_layer",
           "layer_count", "layer_graph", "layer_kinds", "describe_kinds"]


def describe_kinds(graph: Graph) -> list[dict] | None:
    """A mixed stack's kinds (``moegraph.layers.LayerKinds``) for ``moegraph trace``: each kind's
    layers, graph and what first differs from kind 0 (its block and field); None for one kind."""
    kinds = layer_kinds(graph) if layer_count(graph) > 1 else graph.meta_get(KINDS_META)
    if kinds is None or not kinds.mixed:
        return None
    first = kinds.graphs[0].meta_get("program")
    out = []
    for k, g in enumerate(kinds.graphs):
        program = g.meta_get("program")
        differs = (_first_difference(first, program) if k and first is not None and program is not None else None)
        out.append({"kind": k, "graph": g.name, "layers": [i for i, x in enumerate(kinds.pattern) if x == k],
                    "nodes": len(g.nodes), "differs_from_kind_0": differs})
    return out


def _first_difference(a: LayerProgram, b: LayerProgram) -> str:
    """Which block of two layer programs differs first, and in which field, for the error line."""
    for sa, sb in zip(a.steps, b.steps):
        if sa != sb:
            if type(sa.spec) is type(sb.spec) and dataclasses.is_dataclass(sa.spec):
                field = next((f.name for f in dataclasses.fields(sa.spec)
                              if getattr(sa.spec, f.name) != getattr(sb.spec, f.name)), "?")
                return f"{sb.module or sb.kind}: {field} {getattr(sa.spec, field)!r} vs {getattr(sb.spec, field)!r}"
            return f"{sb.module or sb.kind}"
    return f"{len(a.steps)} vs {len(b.steps)} steps"
