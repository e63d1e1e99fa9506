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

Invariant: each layer computes what the one-layer graph computes; the stack holds L times one
layer's activations, less the L-1 chained inputs held once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from moegraph.ir import LAYER_ATTR, Graph, GraphError, Node, ParamSpec, Phase, freeze_attrs, verify
from moegraph.layers import PARAM_PREFIX, boundary, layer_count
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
    """``layers`` copies of the one-layer ``graph``, chained (module docstring); verified.

    One layer returns ``graph`` unchanged, so single-layer names stay as they are.
    """
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers={layers!r} must be a positive integer")
    if layer_count(graph) != 1:
        raise GraphError(f"graph {graph.name!r} already holds {layer_count(graph)} layers; stack its one-layer "
                         "graph (layer_graph) instead")
    if layers == 1:
        return graph
    check_graph_size(layers=layers, nodes_per_layer=len(graph.nodes))       # before copying it
    x, seed, y, dx = boundary(graph)
    L = layers

    def rename(i: int, name: str) -> str:
        if name == x and i > 0:
            return f"l{i - 1}.{y}"           # layer i reads layer i-1's output
        if name == seed and i < L - 1:
            return f"l{i + 1}.{dx}"          # layer i's backward starts from layer i+1's input gradient
        return f"l{i}.{name}"

    def owned(i: int, name: str) -> bool:
        """Whether layer i declares ``name`` (the chained ones belong to the neighbour)."""
        return not ((name == x and i > 0) or (name == seed and i < L - 1))

    values, params, grads, inputs, saved = [], [], [], [], set()
    for i in range(L):
        for v in graph.values:
            if owned(i, v.name):
                alias = rename(i, v.alias_of) if v.alias_of is not None else None
                values.append(dataclasses.replace(v, name=rename(i, v.name), alias_of=alias))
        inputs += [rename(i, v) for v in graph.inputs if owned(i, v)]
        params += [(rename(i, p), _prefixed(spec, i)) for p, spec in graph.params]
        grads += [(rename(i, p), rename(i, g)) for p, g in graph.grads]
        saved |= {rename(i, v) for v in graph.saved}
    # graph inputs in the one-layer order: layer 0's input, the parameters, the last seed
    last_seed = rename(L - 1, seed)
    inputs = [v for v in inputs if v != last_seed] + [last_seed]
    forward = [n for n in graph.nodes if n.phase is Phase.FORWARD]
    backward = [n for n in graph.nodes if n.phase is not Phase.FORWARD]
    nodes = [_renamed(n, i, rename) for i in range(L) for n in forward]
    nodes += [_renamed(n, i, rename) for i in reversed(range(L)) for n in backward]
    param_grads = [rename(i, o) for i in range(L) for o in graph.outputs[2:]]
    meta = dict(graph.meta) | {"layers": L, "layer_graph": graph}
    stacked = dataclasses.replace(
        graph, values=tuple(values), nodes=tuple(nodes), inputs=tuple(inputs),
        outputs=(rename(L - 1, y), rename(0, dx), *param_grads), saved=frozenset(saved), params=tuple(params),
        grads=tuple(grads), meta=freeze_attrs(meta))
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


__all__ = ["StackLayers", "stack_layers"]
