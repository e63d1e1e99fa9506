"""The edges of a model step graph: the gradient sync of embedding, final norm and LM head.

A causal LM is embedding -> L decoder layers (``moegraph.layers``) -> final RMSNorm -> LM head
-> loss. The layers are lowered; the edges' COMPUTE runs eagerly on each rank's sequence shard
(``moegraph.runtime.model``), but their replicated parameters' gradients are reduced by graph
collectives the scheduler places, appended here to the stacked graph (after the passes, which
rewrite one layer and restack it: ``add_edges`` is the last model-level step):

  head + norm   the eager head and norm backward run before the layers' backward (they are
                downstream of the layers): their per-rank partial gradients enter the graph as
                PARAM_GRAD inputs (``edges.d_lm_head.partial`` [V, h], ``edges.d_norm.partial``
                [h]), available at the forward/backward barrier, and are synchronised by the
                same rule as a replicated layer parameter (``autodiff._param_grad``: an
                ALL_REDUCE over the n ranks; with dp > 1 the hierarchical ``_dp_sync``). Nothing
                else reads them, so their sync may overlap every layer's backward.
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

Edge nodes carry ``block`` "edges" and the node attribute ``edge`` = True (``EDGE_ATTR``, no
``layer``): schedule summaries and Gantt charts group them as "edges". ``graph.meta["edges"]``
names the values (``edge_values``): the runtime feeds the partial gradients and reads the
synchronised ones. The edges' eager compute is not in the graph (it is not scheduled: it runs
outside the plan, between its forward and backward phases).

Notation: b batch (one replica's rows), s sequence, h hidden, n ranks per replica, dp replicas,
V vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moegraph.autodiff import _param_grad
from moegraph.builder import GraphBuilder
from moegraph.ir import Graph, GraphError, OpKind, ParamSpec, Phase, Role, ValueKind, freeze_attrs, verify
from moegraph.microbatch import micro_batch_count

EDGES = "edges"
"""Block, node-name prefix and schedule group of the edge nodes."""

EDGE_ATTR = "edge"
"""Node attribute (True) marking an edge node (it has no ``layer``)."""


@dataclass(frozen=True)
class EdgeValues:
    """Value names of a graph's edges (``graph.meta["edges"]``).

    norm_partial / head_partial: inputs, this rank's partial gradient of the final norm [h] and
    of the LM head [V, h] (head: None for a base model without one).
    norm_synced / head_synced: the synchronised gradients (the partial itself when the world
    is one rank: nothing to sync).
    embed_rows: layer 0's input gradient gathered over every rank ([dp*b, s, h]: the global
    batch's rows in input_ids order); layer 0's input gradient itself when the world is one rank.
    """

    norm_partial: str
    norm_synced: str
    head_partial: str | None
    head_synced: str | None
    embed_rows: str

    @property
    def inputs(self) -> tuple[str, ...]:
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
    g = GraphBuilder(graph.name, graph.dims, graph.strategy)
    g.values = {v.name: v for v in graph.values}       # unique names against the whole graph
    g._node_names = {n.name for n in graph.nodes}
    grad_dtype = graph.value[dx].dtype
    kw = dict(phase=Phase.BACKWARD, role=Role.WGRAD, block=EDGES)

    def synced(name: str, shape: tuple[int, ...]) -> tuple[str, str]:
        # a replicated parameter's rule (autodiff._param_grad): ALL_REDUCE, or _dp_sync with dp > 1
        param = f"{EDGES}.{name}"
        partial = g.input(f"{EDGES}.d_{name}.partial", shape, kind=ValueKind.PARAM_GRAD)
        g.values[partial] = dataclasses.replace(g.values[partial], dtype=grad_dtype)
        g.params[param] = ParamSpec(sources=(), shard_dim=None)
        return partial, _param_grad(g, param, partial)

    norm_partial, norm_synced = synced("norm", (d.h,))
    head_partial = head_synced = None
    if vocab is not None:
        head_partial, head_synced = synced("lm_head", (vocab, d.h))
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
    names = EdgeValues(norm_partial, norm_synced, head_partial, head_synced, rows)
    old = {v.name for v in graph.values}
    new_values = tuple(v for name, v in g.values.items() if name not in old)
    new_nodes = tuple(dataclasses.replace(n, block=EDGES, module=EDGES).with_attrs(**{EDGE_ATTR: True})
                      for n in g.nodes)
    meta = dict(graph.meta) | {EDGES: freeze_attrs(dataclasses.asdict(names))}
    out_names = tuple(o for o in names.outputs if o not in graph.outputs and o not in names.inputs)
    edged = dataclasses.replace(graph, values=graph.values + new_values, nodes=graph.nodes + new_nodes,
                                inputs=graph.inputs + names.inputs, outputs=graph.outputs + out_names,
                                meta=freeze_attrs(meta))
    return verify(edged)


def is_edge(attrs) -> bool:
    """Whether a node's attributes (a Mapping) mark it as an edge node."""
    return attrs.get(EDGE_ATTR) is True


__all__ = ["EDGES", "EDGE_ATTR", "EdgeValues", "add_edges", "edge_values", "is_edge"]
