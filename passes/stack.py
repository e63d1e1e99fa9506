"""The stack pass: L copies of a one-layer graph chained into one model-level graph.

Layout, wiring and names: ``moegraph.layers`` (what later stages read of a stack). Layer i's
nodes and values get the prefix ``l{i}.``, its parameter sources the module prefix
``layers.{i}.``, and each node the int attribute ``layer``. Layer i+1 reads layer i's output in
place of its own input, and layer i's backward reads layer i+1's input gradient in place of its
own seed gradient; nodes run all forwards (layer 0 first), then every backward and recompute
node, last layer first. ``graph.meta`` keeps the one-layer graph (``layer_graph``) and the count.

The pass manager runs ``StackLayers`` first (stage -1, scope step), so the user's layer passes
rewrite the one-layer graph once and restack it, and sar's model-wide budget sees the stack.
This module imports nothing of the manager (which restacks with ``stack_layers``).

A mixed stack (``moegraph.layers.LayerKinds``: the tracer hands over the kind-0 graph with the
kinds in its meta) chains layer i as its kind's graph, the same way: each kind's boundary values
(input, seed, output, input gradient) must have one shape, and every kind the same strategy.

Invariant: each layer computes what the one-layer graph computes; the stack holds L times one
layer's activations, less the L-1 chained inputs held once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from moegraph.ir import LAYER_ATTR, Graph, GraphError, Node, ParamSpec, Phase, freeze_attrs, verify
from moegraph.layers import KINDS_META, PARAM_PREFIX, LayerKinds, boundary, layer_count
from moegraph.limits import check_graph_size


@dataclass(frozen=True)
class StackLayers:
    """The model-level step: stack the traced layer ``layers`` times (1: the graph unchanged)."""

    layers: int

    NAME: ClassVar[str] = "stack"

    def __post_init__(self):
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1:
            raise ValueError(f"layers={self.layers!r} must be a positive integer")

    @property
    def arg(self) -> str:
        return str(self.layers)


def stack_layers(graph: Graph, layers: int) -> Graph:
    """``layers`` copies of the one-layer ``graph``, chained (module docstring); verified. A graph
    carrying layer kinds (``KINDS_META``) stacks them by their pattern, which must hold ``layers``.

    One layer returns ``graph`` unchanged, so single-layer names stay as they are.
    """
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers={layers!r} must be a positive integer")
    if layer_count(graph) != 1:
        raise GraphError(f"graph {graph.name!r} already holds {layer_count(graph)} layers; stack its one-layer "
                         "graph (layer_graph) instead")
    kinds = graph.meta_get(KINDS_META)
    if kinds is None:
        return graph if layers == 1 else stack_kinds(LayerKinds((graph,), (0,) * layers))
    if kinds.layers != layers:
        raise GraphError(f"graph {graph.name!r} carries the kinds of {kinds.layers} layers, not {layers}")
    own = dataclasses.replace(graph, meta=freeze_attrs({k: v for k, v in graph.meta if k != KINDS_META}))
    return stack_kinds(LayerKinds((own, *kinds.graphs[1:]), kinds.pattern))


def stack_kinds(kinds: LayerKinds) -> Graph:
    """The stack of ``kinds``: layer i a renamed copy of ``kinds.graphs[kinds.pattern[i]]``, chained
    (module docstring); its meta kind 0's, with the count and the one-layer graph (one kind) or
    the kinds (mixed). Verified."""
    graphs, pattern, L = kinds.graphs, kinds.pattern, kinds.layers
    if L == 1:
        return graphs[0]
    for g in graphs:
        if layer_count(g) != 1:
            raise GraphError(f"graph {g.name!r} already holds {layer_count(g)} layers: stack one-layer graphs")
        if g.strategy != graphs[0].strategy:
            raise GraphError(f"layer kinds {graphs[0].name!r} and {g.name!r} were lowered for different "
                             f"strategies ({graphs[0].strategy} vs {g.strategy}): a stack runs one")
    check_graph_size(layers=L, nodes_per_layer=max(len(g.nodes) for g in graphs))       # before copying it
    ends = [boundary(g) for g in graphs]
    shapes = {(graphs[k].value[ends[k][0]].shape, graphs[k].value[ends[k][0]].dtype) for k in range(len(graphs))}
    if len(shapes) != 1:
        raise GraphError(f"layer kinds of {graphs[0].name!r} take inputs of different shapes {sorted(shapes)}: "
                         "they cannot be chained")

    def rename(i: int, name: str) -> str:
        x, seed, _, _ = ends[pattern[i]]
        if name == x and i > 0:
            return f"l{i - 1}.{ends[pattern[i - 1]][2]}"        # layer i reads layer i-1's output
        if name == seed and i < L - 1:
            return f"l{i + 1}.{ends[pattern[i + 1]][3]}"        # layer i's backward starts from layer i+1's input gradient
        return f"l{i}.{name}"

    def owned(i: int, name: str) -> bool:
        """Whether layer i declares ``name`` (the chained ones belong to the neighbour)."""
        x, seed, _, _ = ends[pattern[i]]
        return not ((name == x and i > 0) or (name == seed and i < L - 1))

    values, params, grads, inputs, saved = [], [], [], [], set()
    for i in range(L):
        graph = graphs[pattern[i]]
        for v in graph.values:
            if owned(i, v.name):
                alias = rename(i, v.alias_of) if v.alias_of is not None else None
                values.append(dataclasses.replace(v, name=rename(i, v.name), alias_of=alias))
        inputs += [rename(i, v) for v in graph.inputs if owned(i, v)]
        params += [(rename(i, p), _prefixed(spec, i)) for p, spec in graph.params]
        grads += [(rename(i, p), rename(i, g)) for p, g in graph.grads]
        saved |= {rename(i, v) for v in graph.saved}
    # graph inputs in the one-layer order: layer 0's input, the parameters, the last seed
    last_seed = rename(L - 1, ends[pattern[L - 1]][1])
    inputs = [v for v in inputs if v != last_seed] + [last_seed]
    nodes = [_renamed(n, i, rename) for i in range(L) for n in graphs[pattern[i]].nodes if n.phase is Phase.FORWARD]
    nodes += [_renamed(n, i, rename) for i in reversed(range(L)) for n in graphs[pattern[i]].nodes
              if n.phase is not Phase.FORWARD]
    param_grads = [rename(i, o) for i in range(L) for o in graphs[pattern[i]].outputs[2:]]
    one = graphs[0]
    meta = dict(one.meta) | {"layers": L} | ({KINDS_META: kinds} if kinds.mixed else {"layer_graph": one})
    stacked = dataclasses.replace(
        one, values=tuple(values), nodes=tuple(nodes), inputs=tuple(inputs),
        outputs=(rename(L - 1, ends[pattern[L - 1]][2]), rename(0, ends[0][3]), *param_grads),
        saved=frozenset(saved), params=tuple(params), grads=tuple(grads), meta=freeze_attrs(meta))
    return verify(stacked)


def _renamed(node: Node, i: int, rename) -> Node:
    module = f"{PARAM_PREFIX}.{i}.{node.module}" if node.module else f"{PARAM_PREFIX}.{i}"
    forward_of = f"l{i}.{node.forward_of}" if node.forward_of is not None else None
    out = dataclasses.replace(node, name=f"l{i}.{node.name}", inputs=tuple(rename(i, v) for v in node.inputs),
                              outputs=tuple(rename(i, v) for v in node.outputs), module=module,
                              forward_of=forward_of)
    return out.with_attrs(**{LAYER_ATTR: i})


def _prefixed(spec: ParamSpec, i: int) -> ParamSpec:
    sources = tuple(dataclasses.replace(s, qualname=f"{PARAM_PREFIX}.{i}.{s.qualname}") for s in spec.sources)
    return dataclasses.replace(spec, sources=sources)


__all__ = ["StackLayers", "stack_kinds", "stack_layers"]
