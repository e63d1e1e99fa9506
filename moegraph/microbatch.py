"""Step graphs of M micro-batches (gradient accumulation): one graph, M forwards and backwards.

Notation (moegraph.ir): b micro-batch, s sequence, h hidden, n group size; M micro-batches per
optimizer step (each of [b, s, h]).

Within one micro-batch the forward's dispatch and combine cannot be hidden: the expert GEMMs
need the dispatched tokens and the next block needs the combined output. Megatron-Core's EP
overlap and DeepSeek's DualPipe hide them under *another* micro-batch's backward. This module
builds the graph in which that is a scheduling decision: the merge pass
(``moegraph.passes.microbatch.merge_microbatches(graph, M)``; this module holds what the stages
after it read of a merged graph) holds M renamed copies of ``graph``'s forward and backward (a one-layer graph, or a stack of
L layers from ``moegraph.layers``):

* micro-batch j's nodes and values are ``mb{j}.<name>`` and carry the int node attribute
  ``mb`` (``MB_ATTR``; ``micro_batch_of``); parameters are shared (one value each);
* micro-batch j's backward reads only micro-batch j's forward, so micro-batch j+1's forward
  may interleave with micro-batch j's backward; the forward/backward barrier applies per
  micro-batch (moegraph.schedules.problem). Warm-up (micro-batch 0's forward) and cool-down
  (the last backward) are part of the step;
* each parameter's gradient is summed over the micro-batches *before* its gradient
  synchronisation (replicated-parameter all-reduce, data-parallel sync), as Megatron-Core
  accumulates into the main gradient and syncs once per step: micro-batch j >= 1's first
  weight-gradient kernel of the parameter adds into micro-batch j-1's total (attr
  accumulate=True, which the interpreter and runtime kernels run), or, where the partial
  gradient is not the single output of a weight-gradient kernel, an ADD node
  ``<grad>.mb{j}_accumulate`` sums it. The synchronisation nodes run once per step, on the
  total, unrenamed and without ``mb``;
* the dgrad/wgrad split is already in every graph (moegraph.autodiff emits data-gradient and
  weight-gradient nodes separately), so the scheduler may delay wgrad past another
  micro-batch's forward.

Graph inputs: per micro-batch its input ``mb{j}.<x>``, the parameters (once), per micro-batch
its seed gradient ``mb{j}.<seed>``. Outputs: per micro-batch its output and input gradient
(``mb0.y, mb0.dx, mb1.y, ...``), then every parameter gradient (summed over the micro-batches),
in ``graph``'s order. Node order: micro-batch 0's nodes in ``graph``'s order, then micro-batch 1's,
..., then the step's gradient synchronisation: one valid topological order, and the no-overlap
sequential baseline is exactly M times the micro-batch's (plus one sync).
``graph.meta`` keeps ``micro_batches`` (M) and ``mb_graph`` (``graph``).
"""

from __future__ import annotations

from moegraph.ir import Graph, GraphError, Node
from moegraph.layers import boundary

__all__ = ["MB_ATTR", "micro_batch_count", "micro_batch_graph", "micro_batch_of", "microbatch_boundaries", "mb_name"]

MB_ATTR = "mb"
"""Node attribute holding the node's micro-batch index (an int) in a merged step graph."""


def mb_name(j: int, name: str) -> str:
    """Micro-batch j's copy of a node or value ``name``."""
    return f"mb{j}.{name}"


def micro_batch_of(node: Node) -> int | None:
    """The node's micro-batch in a merged graph; None for step-level nodes (gradient sums and
    synchronisation) and for every node of an unmerged graph."""
    j = node.attr(MB_ATTR, None)
    if j is not None and (isinstance(j, bool) or not isinstance(j, int) or j < 0):
        raise GraphError(f"node {node.name!r}: attribute {MB_ATTR}={j!r} is not a micro-batch index (int >= 0)")
    return j


def micro_batch_count(graph: Graph) -> int:
    """M of a merged graph (1 for any other graph)."""
    return int(graph.meta_get("micro_batches", 1))


def micro_batch_graph(graph: Graph) -> Graph:
    """The graph a merged graph was built from (the graph itself when not merged)."""
    return graph.meta_get("mb_graph") if micro_batch_count(graph) > 1 else graph


def microbatch_boundaries(graph: Graph) -> tuple[tuple[str, str, str, str], ...]:
    """Per micro-batch (input, seed gradient, output, input gradient) of a merged graph, or the
    one ``moegraph.layers.boundary`` of any other graph."""
    M = micro_batch_count(graph)
    if M == 1:
        return (boundary(graph),)
    x, seed, y, dx = boundary(micro_batch_graph(graph))
    return tuple((mb_name(j, x), mb_name(j, seed), mb_name(j, y), mb_name(j, dx)) for j in range(M))
