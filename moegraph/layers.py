"""Model-level graphs, read: L identical decoder layers stacked into one graph.

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

Graph inputs: layer 0's input, every layer's parameters, the last layer's seed gradient.
Graph outputs: the last layer's output, layer 0's input gradient, every parameter gradient
(layer by layer). ``graph.meta`` keeps the one-layer graph (``layer_graph``) and the count
(``layers``), so a pass rewrites the layer once and restacks (``moegraph.passes.manager``).
"""

from __future__ import annotations

import dataclasses

from moegraph.ir import LAYER_ATTR, Graph, GraphError, ValueKind, freeze_attrs

PARAM_PREFIX = "layers"
"""Module prefix of layer i's parameters: ``layers.{i}.<qualname in the layer>``."""


def layer_count(graph: Graph) -> int:
    """How many layers ``graph`` holds (1 for a one-layer graph)."""
    return int(graph.meta_get("layers", 1))


def layer_graph(graph: Graph) -> Graph:
    """The one-layer graph a multi-layer graph was stacked from (the graph itself for one layer)."""
    return graph.meta_get("layer_graph") if layer_count(graph) > 1 else graph


def costed_layer(graph: Graph) -> Graph:
    """The one-layer graph of a stack (``layer_graph``) with each node priced as the stack's
    layer 0 prices it: the stages after stacking (the aux loss, ``moegraph.edges``) rewrite the
    stacked layers' nodes (a router's flops, bytes and attrs), not the one-layer graph kept in
    ``meta``, so a schedule unit stacked from it must take them over to be the stack's layer.
    Inputs and outputs stay the one-layer graph's (an edge's values are not the layer's).
    Not verified again: the kernels it describes are not run from it, only priced."""
    one = layer_graph(graph)
    if layer_count(graph) == 1:
        return graph
    stacked = {n.name: n for n in graph.nodes}
    nodes = []
    for n in one.nodes:
        s = stacked.get(f"l0.{n.name}")
        if s is None or s.op is not n.op or s.phase is not n.phase:
            raise GraphError(f"graph {graph.name!r} has no layer-0 node like {n.name!r} of its one-layer graph: "
                             "the layers were not stacked from it")
        attrs = {k: v for k, v in s.attrs if k != LAYER_ATTR}
        nodes.append(dataclasses.replace(n, flops=s.flops, mem_bytes=s.mem_bytes, comm_bytes=s.comm_bytes,
                                         group=s.group, attrs=freeze_attrs(attrs)))
    return dataclasses.replace(one, nodes=tuple(nodes))


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


__all__ = ["LAYER_ATTR", "PARAM_PREFIX", "boundary", "costed_layer", "layer_count", "layer_graph"]
