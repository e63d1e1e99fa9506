"""The router's auxiliary loss in a pipeline stage: its routers' share of the statistics.

Notation (moegraph.ir): b micro-batch, s sequence, h hidden, n ranks of a stage's group; E
experts, L layers; P pipeline stages.

transformers' ``load_balancing_loss_func`` reads every layer's routers at once:

    aux = E * sum_i (count_i / N) * (psum_i / N)

over the step's N router rows (L * the tokens the mask keeps), count_i the top-k slots choosing
expert i, psum_i the sum of the softmax probabilities of expert i (moegraph.passes.edges). It does
not split into per-layer terms, so a pipeline sums the statistics along its stages: stage k's
[3, E] fp32 stats (counts, prob sums, rows counted) are its routers' (``edges.aux.sum``, and
over the group's n ranks, each routing its own rows: the edges pass's own nodes,
``aux_loss_graph``), which the runtime adds to the sum of the stages before it and sends on with the
activation; the last stage computes aux from the total. The counts and N carry no gradient, so
the loss's gradient reaches the stats only at the prob sums: d loss / d psum_i = coef * E *
count_i / N^2, one number per expert, which travels back with the activation gradient.

The routers' backward (moegraph.router_kernels.router_pullback) reads that coefficient as the
graph's (global stats, aux seed) pair: c_i = seed * E / N^2 * stats[0, i]. A stage's
runtime gives it (stats = [d psum, 0, 1], seed = 1 / E), which makes c_i = d psum_i,
the probability gradient of the whole model's aux loss.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moegraph.builder import GraphBuilder
from moegraph.edges import AuxLoss
from moegraph.ir import Graph, OpKind, Phase, ValueKind, verify
from moegraph.passes.edges import aux_loss_graph

__all__ = ["StageAux", "stage_aux"]


@dataclass(frozen=True)
class StageAux:
    """A stage graph's aux-loss values: ``stats`` its routers' [3, E] stats (a forward value the
    routers' backward reads), ``seed`` the [1] aux seed input; ``experts`` E."""

    stats: str
    seed: str
    experts: int


def stage_aux(graph: Graph, aux: AuxLoss) -> tuple[Graph, StageAux | None]:
    """``graph`` (a stage's layers, passes applied, one micro-batch) with its routers' aux stats
    (module docstring): the routers rewritten, the stats' sum (and group all-reduce) placed
    after the last forward node; verified. A stage without a router is returned as it is, None."""
    if not any(nd.op is OpKind.ROUTER for nd in graph.nodes):
        return graph, None
    g = GraphBuilder.extend(graph)
    graph, values, nodes = aux_loss_graph(graph, g, aux, 1, lambda j, name: name)
    first_bwd = next(i for i, nd in enumerate(graph.nodes) if nd.phase is not Phase.FORWARD)
    spliced = graph.nodes[:first_bwd] + tuple(nodes[0]) + graph.nodes[first_bwd:]
    seed = values["aux_seeds"][0]
    # the seed is a constant the runtime hands the backward (module docstring), not a gradient
    # seed: a stage's layers have one, their output's (the executor runs layers with one)
    added = tuple(dataclasses.replace(v, kind=ValueKind.ROUTING) if v.name == seed else v for v in g.added_values())
    out = dataclasses.replace(graph, values=graph.values + added, nodes=spliced, inputs=graph.inputs + tuple(g.inputs))
    return verify(out), StageAux(values["aux_stats"][0], seed, values["aux_experts"])
