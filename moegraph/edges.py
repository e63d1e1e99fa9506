"""The edges of a model step graph: embedding, final norm and LM head around the decoder layers.

A causal LM is embedding -> L decoder layers (``moegraph.layers``) -> final RMSNorm -> LM head
-> loss. The layers are lowered; the edges' COMPUTE runs eagerly on each rank's sequence shard
(``moegraph.runtime.model``), but their replicated parameters' gradients are reduced by graph
collectives the scheduler places, appended here to the stacked graph (after the passes, which
rewrite one layer and restack it: ``add_edges`` is the last model-level step):

  head + norm   the eager head and norm backward run before the layers' backward (they are
                downstream of the layers) and make this rank's partial gradients
                (``edges.d_lm_head.partial`` [V, h], ``edges.d_norm.partial`` [h]); those are
                synchronised by the same rule as a replicated layer parameter
                (``autodiff.param_grad``: an ALL_REDUCE over the n ranks; with dp > 1 the
                hierarchical ``_dp_sync``). Nothing else reads them, so their sync may overlap
                every layer's backward.
  embedding     its gradient needs layer 0's input gradient dx [b, s/n, h], the last value the
                layers' backward makes. Instead of all-reducing n partial [V, h] gradients
                (2(n-1)/n * V*h per rank), the graph all-gathers dx along the sequence
                (``edges.embed.grad_gather``, group n: (n-1)/n * b*s*h per rank; with dp > 1 then
                along the batch over the replicas, scope inter: [dp*b, s, h]); every rank then
                scatters the gathered rows into the FULL embedding gradient itself
                (``index_add`` by the full input_ids it holds), identical on every rank, with no
                further communication. For Mixtral (V=32000, b*s=8192 per replica) that is 8x
                fewer bytes than the all-reduce, and no compute sits between two collectives.
                It runs after layer 0's backward (a data dependency), as it must.

The eager compute is in the graph too, so the scheduler prices it and orders around it: nodes
with the attribute ``eager`` (``EAGER_ATTR``) that the runtime does NOT execute from the plan
(autograd runs them; the executor skips them and takes their outputs as inputs):

  forward   edges.norm       RMSNORM  last layer output [b, s/n, h] -> normed [b, s/n, h]
            edges.lm_head    GEMM     normed -> logits [b, s/n, V]      2*T*h*V FLOPs
  backward  edges.lm_head.dgrad  GEMM  d_logits -> d_normed            2*T*h*V FLOPs
            edges.lm_head.wgrad  GEMM  -> the head's partial gradient  2*T*h*V FLOPs
            edges.norm.dgrad     RMSNORM -> the last layer's incoming gradient (the layers' seed)
            edges.norm.wgrad     RMSNORM -> the norm's partial gradient

with T = b*s/n tokens on this rank. The GEMMs' bytes read the weight [V, h] besides their
tensors (the weight is no graph value: the compiled model holds it). d_logits is priced as the
logits value (same shape); the cross-entropy itself and the embedding's gather and scatter
(memory-bound, O(T*h + T*V)) are not priced. The last layer's seed gradient, formerly a graph
input, is made by edges.norm.dgrad, so every layer's backward waits for the head's. A base model
(no head) has no head nodes; its incoming gradient is the graph input ``edges.d_normed``.

Edge nodes carry ``block`` "edges" and the node attribute ``edge`` = True (``EDGE_ATTR``, no
``layer``): schedule summaries and Gantt charts group them as "edges". ``graph.meta["edges"]``
names the values (``edge_values``): the runtime feeds the seed and the partial gradients and
reads the synchronised ones.

Notation: b batch (one replica's rows), s sequence, h hidden, n ranks per replica, dp replicas,
V vocabulary, T = b*s/n tokens per rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moegraph.autodiff import param_grad
from moegraph.builder import GraphBuilder
from moegraph.ir import Graph, GraphError, OpKind, ParamSpec, Phase, Role, ValueKind, freeze_attrs, verify
from moegraph.microbatch import micro_batch_count

EDGES = "edges"
"""Block, node-name prefix and schedule group of the edge nodes."""

EDGE_ATTR = "edge"
"""Node attribute (True) marking an edge node (it has no ``layer``)."""

EAGER_ATTR = "eager"
"""Node attribute (True) marking an edge node the runtime's autograd runs, not the plan."""


@dataclass(frozen=True)
class EdgeValues:
    """Value names of a graph's edges (``graph.meta["edges"]``).

    seed: the last layer's incoming gradient [b, s/n, h], made by the eager norm backward.
    norm_partial / head_partial: inputs, this rank's partial gradient of the final norm [h] and
    of the LM head [V, h] (head: None for a base model without one).
    norm_synced / head_synced: the synchronised gradients (the partial itself when the world
    is one rank: nothing to sync).
    embed_rows: layer 0's input gradient gathered over every rank ([dp*b, s, h]: the global
    batch's rows in input_ids order); layer 0's input gradient itself when the world is one rank.
    """

    seed: str
    norm_partial: str
    norm_synced: str
    head_partial: str | None
    head_synced: str | None
    embed_rows: str

    @property
    def partials(self) -> tuple[str, ...]:
        """The partial gradients the eager backward makes, (norm, head)."""
        return tuple(v for v in (self.norm_partial, self.head_partial) if v is not None)

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(v for v in (self.norm_synced, self.head_synced, self.embed_rows)
                                   if v is not None))


def edge_values(graph: Graph) -> EdgeValues | None:
    """The graph's edges, or None when ``add_edges`` did not run on it."""
    names = graph.meta_get(EDGES)
    return None if names is None else EdgeValues(**dict(names))


def add_edges(graph: Graph, *, vocab: int | None) -> Graph:
    """``graph`` (one layer or a stack, after the passes) with the edges' gradient sync appended
    (module docstring); ``vocab`` V, or None for a base model without an LM head. Verified."""
    if edge_values(graph) is not None:
        raise GraphError(f"graph {graph.name!r} already has its edges")
    if micro_batch_count(graph) > 1:
        raise GraphError(f"graph {graph.name!r} is a step of {micro_batch_count(graph)} micro-batches: the edges' "
                         "gradient sync is modelled for a one-micro-batch step only")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
        raise ValueError(f"vocab={vocab!r} must be a positive integer or None (no LM head)")
    st, d = graph.strategy, graph.dims
    dx = graph.outputs[1]                              # layer 0's input gradient (moegraph.layers)
    if graph.value[dx].kind is not ValueKind.GRAD or graph.value[dx].shape != (d.b, d.s // st.n, d.h):
        raise GraphError(f"graph {graph.name!r}: outputs[1] {dx!r} is not layer 0's input gradient [b, s/n, h]")
    seeds = [v for v in graph.inputs if graph.value[v].kind is ValueKind.GRAD]
    if len(seeds) != 1:
        raise GraphError(f"graph {graph.name!r} has seed gradients {seeds}; the edges join a stack with one")
    seed, y = seeds[0], graph.outputs[0]               # the last layer's incoming gradient and output
    g = GraphBuilder(graph.name, graph.dims, graph.strategy)
    g.values = {v.name: v for v in graph.values}       # unique names against the whole graph
    g._node_names = {n.name for n in graph.nodes}
    grad_dtype = graph.value[dx].dtype
    T, h = d.b * d.s // st.n, d.h                       # tokens on this rank, hidden
    item = graph.value[y].nbytes // (T * h)             # bytes per element of the activations
    eager = dict(block=EDGES, attrs={EAGER_ATTR: True})

    # the eager compute, priced (module docstring): forward, then the backward that makes the seed
    normed = g.like(f"{EDGES}.normed", y)
    g.node(f"{EDGES}.norm", OpKind.RMSNORM, (y,), (normed,), flops=4 * T * h, mem_bytes=(2 * T * h + h) * item,
           **eager)
    norm_partial = g.value(f"{EDGES}.d_norm.partial", (h,), kind=ValueKind.PARAM_GRAD, dtype=grad_dtype)
    head_partial = None
    if vocab is not None:
        logits = g.value(f"{EDGES}.logits", (d.b, d.s // st.n, vocab))
        gemm = 2 * T * h * vocab
        g.node(f"{EDGES}.lm_head", OpKind.GEMM, (normed,), (logits,), flops=gemm,
               mem_bytes=(T * h + vocab * h + T * vocab) * item, **eager)
        d_normed = g.like(f"{EDGES}.d_normed", normed, kind=ValueKind.GRAD)
        head_partial = g.value(f"{EDGES}.d_lm_head.partial", (vocab, h), kind=ValueKind.PARAM_GRAD, dtype=grad_dtype)
        bwd = dict(phase=Phase.BACKWARD, flops=gemm, mem_bytes=(T * h + vocab * h + T * vocab) * item, **eager)
        g.node(f"{EDGES}.lm_head.dgrad", OpKind.GEMM, (logits,), (d_normed,), role=Role.DGRAD, **bwd)
        g.node(f"{EDGES}.lm_head.wgrad", OpKind.GEMM, (normed, logits), (head_partial,), role=Role.WGRAD, **bwd)
    else:
        d_normed = g.input(f"{EDGES}.d_normed", g.shape(normed), kind=ValueKind.GRAD)
    # as autodiff's rmsnorm rule: the data gradient twice the forward's FLOPs, the weight's once
    g.node(f"{EDGES}.norm.dgrad", OpKind.RMSNORM, (y, d_normed), (seed,), phase=Phase.BACKWARD, role=Role.DGRAD,
           flops=8 * T * h, mem_bytes=3 * T * h * item, **eager)
    g.node(f"{EDGES}.norm.wgrad", OpKind.RMSNORM, (y, d_normed), (norm_partial,), phase=Phase.BACKWARD,
           role=Role.WGRAD, flops=4 * T * h, mem_bytes=(2 * T * h + h) * item, **eager)
    n_compute = len(g.nodes)

    # the replicated parameters' rule (autodiff.param_grad): ALL_REDUCE, or _dp_sync with dp > 1
    def synced(name: str, partial: str) -> str:
        param = f"{EDGES}.{name}"
        g.params[param] = ParamSpec(sources=(), shard_dim=None)
        return param_grad(g, param, partial)

    norm_synced = synced("norm", norm_partial)
    head_synced = synced("lm_head", head_partial) if head_partial is not None else None
    kw = dict(phase=Phase.BACKWARD, role=Role.WGRAD, block=EDGES)
    rows = dx
    if st.n > 1:                                        # [b, s/n, h] -> [b, s, h]
        out = g.value(f"{EDGES}.d_embed_rows" if st.dp == 1 else f"{EDGES}.d_embed_rows_replica",
                      (d.b, d.s, d.h), kind=ValueKind.GRAD, dtype=graph.value[dx].dtype)
        g.collective(f"{EDGES}.embed.grad_gather", OpKind.ALL_GATHER, (rows,), (out,), group=st.n,
                     full_bytes=g.nbytes(out), attrs={"dim": 1}, **kw)
        rows = out
    if st.dp > 1:                                       # [b, s, h] -> [dp*b, s, h], replica-major
        out = g.value(f"{EDGES}.d_embed_rows", (st.dp * d.b, d.s, d.h), kind=ValueKind.GRAD,
                      dtype=graph.value[dx].dtype)
        g.collective(f"{EDGES}.embed.grad_gather_dp", OpKind.ALL_GATHER, (rows,), (out,), group=st.dp,
                     full_bytes=g.nbytes(out), attrs={"dim": 0, "scope": "inter", "axis": "dp"}, **kw)
        rows = out
    names = EdgeValues(seed, norm_partial, norm_synced, head_partial, head_synced, rows)
    old = {v.name for v in graph.values}
    new_values = tuple(v for name, v in g.values.items() if name not in old)
    marked = [dataclasses.replace(n, block=EDGES, module=EDGES).with_attrs(**{EDGE_ATTR: True}) for n in g.nodes]
    compute, sync = marked[:n_compute], marked[n_compute:]
    # the eager compute runs between the layers' forward and backward; the sync after the layers
    first_bwd = next(i for i, n in enumerate(graph.nodes) if n.phase is not Phase.FORWARD)
    nodes = graph.nodes[:first_bwd] + tuple(compute) + graph.nodes[first_bwd:] + tuple(sync)
    meta = dict(graph.meta) | {EDGES: freeze_attrs(dataclasses.asdict(names))}
    out_names = tuple(o for o in names.outputs if o not in graph.outputs)
    edged = dataclasses.replace(graph, values=graph.values + new_values, nodes=nodes,
                                inputs=tuple(v for v in graph.inputs if v != seed) + tuple(g.inputs),
                                outputs=graph.outputs + out_names, meta=freeze_attrs(meta))
    return verify(edged)


def is_eager(attrs) -> bool:
    """Whether a node's attributes (a Mapping) mark it as eager edge compute (not run by the plan)."""
    return attrs.get(EAGER_ATTR) is True


def is_edge(attrs) -> bool:
    """Whether a node's attributes (a Mapping) mark it as an edge node."""
    return attrs.get(EDGE_ATTR) is True


__all__ = ["EDGES", "EDGE_ATTR", "EAGER_ATTR", "EdgeValues", "add_edges", "edge_values", "is_edge", "is_eager"]
