"""The edges pass: a causal LM's embedding, final norm and LM head around its decoder layers.

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
                (``edges.embed.grad_gather``, group n: (n-1)/n * b*s*h per rank); every rank then
                scatters the gathered rows into the FULL embedding gradient itself
                (``index_add`` by the full input_ids it holds), identical on every rank, with no
                further communication. For Mixtral (V=32000, b*s=8192 per replica) that is 8x
                fewer bytes than the all-reduce, and no compute sits between two collectives.
                It runs after layer 0's backward (a data dependency), as it must.
                With dp > 1 replicas the inter-node bytes decide between two patterns
                (``EmbedGrad``, recorded in ``EdgeValues.embed_grad``; ``embed_grad_choice``):
                  ROWS     the rows are gathered on, along the batch over the replicas
                           (``edges.embed.grad_gather_dp``, scope inter: [dp*b, s, h]) and every
                           rank scatters all dp*b*s rows, as above;
                  PARTIAL  every rank scatters its OWN rows [b, s/n, h] into a partial [V, h]
                           (``edges.embed.scatter``, below) and the partial is synchronised by the
                           replicated-parameter rule (``autodiff.param_grad``: the hierarchical
                           ``_dp_sync``, intra sum over n, inter mean over dp), as the head's.
                           No intra gather: the intra reduce-scatter sums the n ranks' partials,
                           whereas n copies of a gathered replica's partial would be summed n
                           times (and the gather would only add bytes).
                Inter-node bytes per rank of a step of M micro-batches (e: bytes per gradient
                element; w: the DP reduce-scatter's wire bytes per element, 4, or 2 with
                compress=dp-bf16; the all-gather stays fp32; b one micro-batch's rows):
                  ROWS     M * (dp-1) * b*s*h * e      (one gather per micro-batch)
                  PARTIAL  (dp-1)/dp * V*h/n * (w + 4) (one sync per step, whatever M)
                PARTIAL when strictly fewer (ties: ROWS) and V*h splits over n*dp. Mixtral at
                dp=4, b=8, s=8192, bf16, M=1: ROWS 1.6 GB, PARTIAL 98 MB. dp == 1 and a base
                model (no V given) keep ROWS; asking for PARTIAL there raises. In a merged step
                (M >= 2) micro-batch j's scatter (``mb{j}.edges.embed.scatter``, attr ``mb`` = j)
                adds its rows into micro-batch j-1's partial (attr accumulate, as the head's
                weight gradient) and ONE ``_dp_sync`` of the last micro-batch's partial runs
                per step (no ``mb``). Both patterns' inter-node collectives carry dp=True, as
                ``_dp_sync``'s: the DP exposure (``exposed_dp_sync_us``) and the DP warm starts
                count them.

Gradient buckets (``GRAD_BUCKET_BYTES``, DDP's default 25 MiB): a [V, h] partial (the head's;
PARTIAL's embedding's) of B bytes is synced in K = ceil(B / bucket) row blocks, as DDP and
Megatron sync gradient buckets, so that the scheduler can place K short collectives in the gaps
the layers' backward leaves on the comm stream instead of one long one after it (Mixtral's head:
one 3.2 ms all-reduce against gaps of at most ~0.4 ms):

  edges.lm_head.grad_buckets          SPLIT (mode split)  partial -> K views [V_i, h] (no copy)
  edges.lm_head.bucket{i}.<sync>      the replicated-parameter rule on view i (ALL_REDUCE, or
                                      ``_dp_sync``'s chain with dp > 1), writing rows i of the
                                      synced gradient (its result is a view of it)
  edges.lm_head.grad_concat           SPLIT (mode concat) K blocks -> ``d_edges.lm_head.synced``,
                                      planned zero-copy (the blocks are its views, as
                                      ``lowering.blocks`` joins token chunks, priced 0): readers
                                      depend on every block. The runtime's kernel concatenates
                                      (``torch.cat``, a [V, h] copy the plan does not price, as
                                      for chunk joins): writing in place is left to do

(``edges.embed.*`` likewise). The blocks have near-equal rows (whole rows divide as the rule
needs: with dp > 1 n*dp divides h, as the norm's sync needs); the bytes sent are the whole sync's. A
partial of at most one bucket, the norm's [h], and one rank's (nothing to sync) keep the one
sync (same names). The synced value's name is unchanged, so the runtime reads it as before.

The eager compute is in the graph too, so the scheduler prices it and orders around it: nodes
with the attribute ``eager`` (``EAGER_ATTR``) that the runtime does NOT execute from the plan
(autograd runs them; the executor skips them and takes their outputs as inputs), per micro-batch
the final norm and the LM head, forward and backward (``moegraph.passes.edges_head``): RMSNORM
(or a NORM of kind 'layer' for a LayerNorm, its bias priced in it) ``edges.norm``, GEMM ``edges.lm_head``
(2*T*h*V FLOPs each way), a SCALE ``edges.logit_scale`` where the logits are multiplied by a
constant and a LIMIT ``edges.logit_softcap`` where they are soft-capped (``moegraph.edges.EdgeHead``),
and their ``.dgrad`` / ``.wgrad``; ``edges.norm.dgrad``
makes the layers' seed,

and, with the PARTIAL embedding gradient, one the plan RUNS (its input is made by the plan and its
output read by the plan's sync; the runtime registers the kernel, ``Executor.set_eager_kernel``):

  backward  edges.embed.scatter  PERMUTE  dx [b, s/n, h] -> partial [V, h]   T*h adds, memory-bound:
                                          reads T*h, writes V*h elements

with T = b*s/n tokens on this rank. The cross-entropy itself and the embedding's ROWS scatter
(memory-bound, O(T*h + T*V)) are not priced (PARTIAL's is). The last layer's seed gradient,
formerly a graph input, is made by edges.norm.dgrad, so every layer's backward waits for the head's. A base model
(no head) has no head nodes; its incoming gradient is the graph input ``edges.d_normed``.

Merged micro-batch steps (``moegraph.microbatch``, M >= 2): every micro-batch j has its own
eager norm and head, forward and backward (``mb{j}.edges.norm`` ..., attr ``mb`` = j, priced
per micro-batch as above), between its forward and its backward; its ``edges.norm.dgrad`` makes
its seed ``mb{j}.<seed>``. The head and norm partial gradients are summed over the micro-batches
as ``merge_microbatches`` sums a replicated layer parameter's: micro-batch j >= 1's weight-
gradient node adds into micro-batch j-1's sum (attr accumulate, the sum read last), and the
sync runs once per step on the last micro-batch's sum (no ``mb``: one all-reduce of the same
bytes as a one-micro-batch step's, never M). The embedding gradient, after each micro-batch's
layer 0's backward: ROWS gathers per micro-batch (``mb{j}.edges.embed.grad_gather``); PARTIAL
scatters per micro-batch into the running partial (``mb{j}.edges.embed.scatter``, accumulate)
and syncs it once per step, after the last scatter.

With ``compress=dp-bf16`` among the passes (``graph.meta["dp_grad_wire"]``,
``moegraph.passes.compress``), the edges' own DP reduce-scatters are rewritten the same way: half
the bytes, as the layers'.

The router's auxiliary load-balancing loss (``AuxLoss``, transformers' ``load_balancing_loss_func``
with ``output_router_logits=True``; ``add_edges(..., aux=AuxLoss(...))``): over ALL layers' router
rows of a step's global batch (N = L * dp*b*s rows; a padded batch's, L * its tokens the
attention mask keeps: transformers' loss weights each row by the mask), P = softmax(logits) in fp32,

    aux = E * sum_i (count_i / N) * (psum_i / N),   loss = lm_loss + coef * aux,

count_i the top-k slots choosing expert i, psum_i the sum of P[:, i] (both over the kept rows).
The counts carry no gradient, so d loss / d P[t, i] = coef * E * count_i / N^2 (0 at a pad), one
constant per expert known once every layer has routed. In the graph, per micro-batch:

  forward   every ROUTER forward also writes its [3, E] fp32 stats (row 0 the counts, row 1 the
            prob sums over its rows, row 2 in every column the rows it counted: N's share, so a
            padded batch's N crosses the ranks with the sums; attr ``aux``, with ``aux_positions``
            and ``aux_chunks`` saying where its rows sit for the mask; priced T*(E + k) more
            FLOPs); ``edges.aux.sum`` (ADD) sums the L routers' stats (3E*(L-1) FLOPs);
            ``edges.aux.allreduce`` (ALL_REDUCE, group n) sums them over the replica's ranks, whose
            rows are distinct (every dispatch routes each rank's own shard; ag-rs gathers the
            routing, not the router's input: moegraph.lowering.blocks);
            ``edges.aux.allreduce_dp`` (scope inter, axis dp) sums over the replicas.
            The result ``edges.aux.stats`` is the global batch's, identical on every rank: the
            runtime reads it for the loss value (E * count . psum / N^2, E FLOPs, not priced).
  backward  every ROUTER dgrad / wgrad also reads ``edges.aux.stats`` and the aux seed
            ``edges.d_aux`` [1] (fp32; the runtime gives coef * dloss, x dp as the LM loss's
            seed) and adds d_aux * E * count / N^2 (N the stats' row 2) to its softmax's
            probability gradient at each row the mask keeps
            (softmax backward P * (g - sum(P g)), 4*T*E FLOPs more).
  precision the counts are the routers' own top-k (softmax of the fp32 logits); transformers'
            loss re-selects on the softmax of the logits in the model dtype: the same in fp32, in
            bf16 a near-tie may count to the other expert (a bf16 rounding-level difference).

Edge nodes carry ``block`` "edges" and the node attribute ``edge`` = True (``EDGE_ATTR``, no
``layer``): schedule summaries and Gantt charts group them as "edges". ``graph.meta["edges"]``
names the values (``edge_values``): the runtime feeds the seeds and the partial gradients and
reads the synchronised ones; in a merged step the plan runs every eager node itself, at its
position, by a kernel the runtime gives it (``Executor.step_edges``, ``CompiledModel.train_step``).

Notation: b batch (one replica's rows), s sequence, h hidden, n ranks per replica, dp replicas,
V vocabulary, T = b*s/n tokens per rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from moegraph.autodiff import param_grad
from moegraph.builder import GraphBuilder
from moegraph.cost import CostModel
from moegraph.edges import (AUX_META, EAGER_ATTR, EDGE_ATTR, EDGES, EMBED_ATTR, EMBED_SCATTER, AuxLoss, EdgeHead,
                            EdgeValues, EmbedGrad, edge_values)
from moegraph.ir import (ConfigError, Graph, GraphError, Node, OpKind, ParamSpec, Phase, Role, ValueKind, freeze_attrs,
                         verify)
from moegraph.microbatch import MB_ATTR, mb_name, micro_batch_count, micro_batch_of, microbatch_boundaries
from moegraph.passes.compress import DpGradWire, dp_bf16, dp_grad_wire, is_dp_fp32_reduce_scatter
from moegraph.passes.edges_head import eager_compute, wgrad_node
from moegraph.passes.manager import Pass, PassResult, register_model_pass
from moegraph.token_layout import local_tokens


@dataclass(frozen=True)
class AddEdges:
    """The model-level step: append a causal LM's edges (``add_edges``)."""

    vocab: int | None
    """The LM head's vocabulary V; None: a base model without a head."""
    aux: AuxLoss | None = None
    """The router's auxiliary loss; None: the graph's own (``graph.meta[AUX_META]``), if any."""
    embed_grad: EmbedGrad | None = None
    """The embedding gradient's pattern; None: chosen by inter-node bytes (``embed_grad_choice``)."""
    head: EdgeHead = EdgeHead()
    """The final norm and the logits' scale and soft cap (``moegraph.edges.EdgeHead``): RMSNorm, 1 and none by
    default."""

    NAME: ClassVar[str] = "edges"

    def __post_init__(self):
        v = self.vocab
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"vocab={v!r} must be a positive integer or None (no LM head)")

    @property
    def arg(self) -> str:
        return str(self.vocab)


@register_model_pass(AddEdges, stage=11)
def edges(step: AddEdges, cost: CostModel | None = None) -> Pass:
    """The edges pass of ``step`` (``add_edges``)."""
    def run(graph: Graph) -> PassResult:
        return PassResult(add_edges(graph, vocab=step.vocab, embed_grad=step.embed_grad, aux=step.aux,
                                    head=step.head), True)
    return run


GRAD_BUCKET_BYTES = 25 * 2**20
"""Bucket size of the [V, h] gradient syncs (the head's, PARTIAL's embedding's) at dp == 1: DDP's
default ``bucket_cap_mb=25``. A partial gradient of B bytes is synced as ceil(B / bucket) row
blocks (module docstring, "gradient buckets"); ``add_edges(..., grad_bucket_bytes=)`` overrides it."""

DP_GRAD_BUCKET_BYTES: int | None = None
"""The same at dp > 1; None: one sync. Measured (benchmarks/RESULTS.md, 2026-11-24): at dp == 1
the buckets hide the head's 3.2 ms all-reduce (mixtral-8x7b h800, 4 layers 30,326.2 -> 29,996.5
us); at dp = 2 the step's tail is layer 0's own DP sync, and ten buckets' chains (94 more tasks)
only lengthened CP-SAT's step, 0.35% at 10 s and 1.7% at 30 s."""

def embed_grad_inter_bytes(pattern: EmbedGrad, *, n: int, dp: int, b: int, s: int, h: int, vocab: int,
                           elem: int, wire: int = 4, micro_batches: int = 1) -> int:
    """Inter-node bytes per rank of one step's embedding gradient by ``pattern`` (module
    docstring): ROWS M*(dp-1)*b*s*h*e, PARTIAL (dp-1)/dp * V*h/n * (w+4); ``elem`` e, ``wire`` w,
    ``micro_batches`` M (b: one micro-batch's rows)."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} must be a positive integer")
    if dp == 1:
        return 0
    if pattern is EmbedGrad.ROWS:
        return micro_batches * (dp - 1) * b * s * h * elem
    if pattern is EmbedGrad.PARTIAL:
        if (vocab * h) % (n * dp):
            raise ConfigError(f"the PARTIAL embedding gradient [V={vocab}, h={h}] does not split over "
                             f"n={n} x dp={dp} ranks")
        return (dp - 1) * (vocab * h // (n * dp)) * (wire + 4)
    raise ValueError(f"embedding gradient pattern {pattern!r} is not one of {[p.value for p in EmbedGrad]}")


def embed_grad_choice(*, n: int, dp: int, b: int, s: int, h: int, vocab: int | None, elem: int,
                      wire: int = 4, micro_batches: int = 1) -> EmbedGrad:
    """The pattern with fewer inter-node bytes per step and rank over ``micro_batches`` M (ties,
    dp == 1, no V, or a V*h that does not split over n*dp: ROWS)."""
    if dp == 1 or vocab is None or (vocab * h) % (n * dp):
        return EmbedGrad.ROWS
    kw = dict(n=n, dp=dp, b=b, s=s, h=h, vocab=vocab, elem=elem, wire=wire, micro_batches=micro_batches)
    partial = embed_grad_inter_bytes(EmbedGrad.PARTIAL, **kw)
    return EmbedGrad.PARTIAL if partial < embed_grad_inter_bytes(EmbedGrad.ROWS, **kw) else EmbedGrad.ROWS

def add_edges(graph: Graph, *, vocab: int | None, embed_grad: EmbedGrad | None = None,
              aux: AuxLoss | None = None, grad_bucket_bytes: int | None = None, head: EdgeHead = EdgeHead()) -> Graph:
    """``graph`` (one layer or a stack, after the passes; or the merged step of M micro-batches
    of one, ``moegraph.microbatch``) with the edges appended (module docstring); ``vocab`` V, or
    None for a base model without an LM head. ``embed_grad``: the embedding gradient's pattern,
    None to choose by inter-node bytes (``embed_grad_choice``); PARTIAL where it cannot apply
    raises. ``aux``: the router's auxiliary loss (a causal LM only); None: the graph's own
    (``graph.meta[AUX_META]``, a registry model's router_aux_loss_coef), if any.
    ``grad_bucket_bytes``: the [V, h] gradient syncs' bucket size (None: ``GRAD_BUCKET_BYTES`` at
    dp == 1, ``DP_GRAD_BUCKET_BYTES`` at dp > 1, where None syncs each whole). ``head``: the final
    norm and the logits' multiplier (``EdgeHead``; a base model's multiplier must be 1). Verified."""
    bucket = grad_bucket_bytes
    if bucket is None:
        bucket = GRAD_BUCKET_BYTES if graph.strategy.dp == 1 else DP_GRAD_BUCKET_BYTES
    elif isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
        raise ValueError(f"grad_bucket_bytes={grad_bucket_bytes!r} must be a positive integer (bytes) or None")
    aux = graph.meta_get(AUX_META) if aux is None else aux
    if aux is not None and not isinstance(aux, AuxLoss):
        raise ValueError(f"aux={aux!r} must be None or an AuxLoss")
    if aux is not None and vocab is None:
        raise GraphError(f"graph {graph.name!r}: the router's auxiliary loss is added to a causal LM's loss; "
                         "a base model (no vocab) has none")
    if edge_values(graph) is not None:
        raise GraphError(f"graph {graph.name!r} already has its edges")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
        raise ValueError(f"vocab={vocab!r} must be a positive integer or None (no LM head)")
    if not isinstance(head, EdgeHead) or (vocab is None and not head.plain):
        raise ValueError(f"head={head!r} must be an EdgeHead, with logit_scale 1 and no soft cap for a base model "
                         "(no LM head)")
    if embed_grad is not None and not isinstance(embed_grad, EmbedGrad):
        raise ValueError(f"embed_grad={embed_grad!r} must be None or one of {list(EmbedGrad)}")
    st, d = graph.strategy, graph.dims
    M = micro_batch_count(graph)
    at = (lambda j, name: name) if M == 1 else mb_name      # micro-batch j's copy of a name
    bounds = microbatch_boundaries(graph)                    # per micro-batch (x, seed, y, dx)
    for _, _, _, dx in bounds:                               # layer 0's input gradient (moegraph.layers)
        if graph.value[dx].kind is not ValueKind.GRAD or graph.value[dx].shape != (*local_tokens(d.b, d.s, st), d.h):
            raise GraphError(f"graph {graph.name!r}: {dx!r} is not layer 0's input gradient [b/N, s/G, h] "
                             "(moegraph.token_layout)")
    g = GraphBuilder.extend(graph)                          # unique names against the whole graph
    grad_dtype = graph.value[bounds[0][3]].dtype
    T, h = d.b * d.s // st.n, d.h                           # tokens on this rank (per micro-batch), hidden
    item = graph.value[bounds[0][2]].nbytes // (T * h)      # bytes per element of the activations
    elem = graph.value[bounds[0][3]].nbytes // (T * h)      # bytes per element of the gradients
    bf16_wire = dp_grad_wire(graph) is DpGradWire.BF16
    pattern = _embed_pattern(graph, embed_grad, vocab, M, elem=elem, wire=2 if bf16_wire else 4)
    computes: list[list[Node]] = []
    aux_values: dict = {}
    if aux is not None:                                     # the layers' routers rewritten; the stats
        graph, aux_values, aux_nodes = aux_loss_graph(graph, g, aux, M, at)   # sums and all-reduces
    norm_partial = head_partial = None                      # the running sums over the micro-batches
    for j, (_, seed, y, _) in enumerate(bounds):
        first = len(g.nodes)
        if aux is not None:                                 # after every router of micro-batch j
            g.nodes.extend(aux_nodes[j])
        norm_partial, head_partial = eager_compute(g, j, at, seed, y, vocab, head, T, h, item, grad_dtype,
                                                   norm_partial, head_partial)
        computes.append(g.nodes[first:])

    def compressed(nodes: list[Node]) -> list[Node]:
        if not bf16_wire:
            return nodes
        # the passes compressed the layers' DP reduce-scatters (compress=dp-bf16): the edges' too,
        # never an fp32 sync beside bf16 ones
        return [r for n in nodes for r in (dp_bf16(n, g.values) if is_dp_fp32_reduce_scatter(g.values, n) else [n])]

    # the replicated parameters' rule (autodiff.param_grad): ALL_REDUCE, or _dp_sync with dp > 1;
    # once per step on the summed partials (as merge_microbatches syncs a layer's parameters)
    first = len(g.nodes)

    def synced(name: str, partial: str, bucketed: bool = True) -> str:
        sizes = _bucket_rows(g, partial, bucket) if bucketed and bucket is not None else (g.shape(partial)[0],)
        return _bucketed_sync(g, f"{EDGES}.{name}", partial, sizes)

    norm_synced = synced("norm", norm_partial, bucketed=False)      # [h]: tiny, always one sync
    head_synced = synced("lm_head", head_partial) if head_partial is not None else None
    sync = compressed(g.nodes[first:])
    gathers, gathered = [], []
    embed_partial = embed_synced = None
    if pattern is EmbedGrad.ROWS:
        for j, (_, _, _, dx) in enumerate(bounds):
            first = len(g.nodes)
            gathered.append(_embed_gather(g, j, at, dx))
            gathers.append(g.nodes[first:])
    else:                                                   # PARTIAL
        # micro-batch j's rows scatter into the running partial (j-1's, attr accumulate, as the
        # head's weight gradient); one sync per step of the last partial, after the last scatter
        embed_attrs = {EAGER_ATTR: True, EMBED_ATTR: True}
        for j, (_, _, _, dx) in enumerate(bounds):
            first = len(g.nodes)
            out = g.value(at(j, f"{EDGES}.d_embed.partial"), (vocab, h), kind=ValueKind.PARAM_GRAD, dtype=grad_dtype)
            wgrad_node(g, at(j, EMBED_SCATTER), OpKind.PERMUTE, (dx,), out, embed_partial, phase=Phase.BACKWARD,
                   block=EDGES, flops=T * h * (1 + (head.embed_scale != 1)),       # + the rows' scale (Gemma 4)
                   mem_bytes=(T * h + vocab * h) * elem, attrs=embed_attrs)
            embed_partial = out
            gathers.append(g.nodes[first:])
        first = len(g.nodes)
        embed_synced = synced("embed", embed_partial)
        embed_sync = [n.with_attrs(**{EMBED_ATTR: True}) for n in compressed(g.nodes[first:])]
        if M == 1:                                          # the M=1 order: scatter, then its sync
            gathers[0] += embed_sync
        else:
            sync += embed_sync
    names = EdgeValues(tuple(b[1] for b in bounds), norm_partial, norm_synced, head_partial, head_synced,
                       tuple(gathered), pattern, embed_partial, embed_synced, **aux_values, head=head)

    def marked(nodes, j):
        mb = {MB_ATTR: j} if M > 1 and j is not None else {}
        return [dataclasses.replace(n, block=EDGES, module=EDGES).with_attrs(**{EDGE_ATTR: True}, **mb)
                for n in nodes]

    nodes = _splice(graph, [marked(c, j) for j, c in enumerate(computes)], marked(sync, None),
                    [marked(c, j) for j, c in enumerate(gathers)])
    meta = dict(graph.meta) | {EDGES: freeze_attrs(dataclasses.asdict(names))}
    out_names = tuple(o for o in names.outputs if o not in graph.outputs)
    seeds = set(names.seeds)
    edged = dataclasses.replace(graph, values=graph.values + g.added_values(), nodes=nodes,
                                inputs=tuple(v for v in graph.inputs if v not in seeds) + tuple(g.inputs),
                                outputs=graph.outputs + out_names, meta=freeze_attrs(meta))
    return verify(edged)


def aux_loss_graph(graph: Graph, g: GraphBuilder, aux: AuxLoss, M: int, at) -> tuple[Graph, dict, list[list[Node]]]:
    """The aux loss's graph (module docstring): ``graph`` with its routers rewritten, the
    EdgeValues fields, and per micro-batch the forward nodes that make its global stats (made
    with ``g``, not yet in ``g.nodes``: the caller places them before micro-batch j's head)."""
    st, d = graph.strategy, graph.dims
    E, f32 = aux.experts, 4
    mb = (lambda nd: micro_batch_of(nd)) if M > 1 else (lambda nd: 0)
    routers = [nd for nd in graph.nodes if nd.op is OpKind.ROUTER]
    for nd in routers:
        if nd.attr("scoring") != "softmax" or nd.attr("experts") != E or nd.attr("top_k") != aux.top_k:
            raise GraphError(f"router {nd.name!r} ({nd.attr('scoring')}, experts {nd.attr('experts')}, "
                             f"top-k {nd.attr('top_k')}): the aux loss is modelled for softmax top-{aux.top_k} "
                             f"routers of {E} experts only")
    forward = [nd for nd in routers if nd.phase is Phase.FORWARD]
    if not forward:
        raise GraphError(f"graph {graph.name!r} has no router: no auxiliary load-balancing loss to add")
    rows_of = {nd.name: graph.value[nd.inputs[0]].numel // d.h for nd in forward}      # T of each router
    moe_layers = len({nd.layer for nd in forward if mb(nd) == 0})
    local = sum(rows_of[nd.name] for nd in forward if mb(nd) == 0)                     # rows over the layers
    # the routers' rows: each rank's own sequence shard (every dispatch; n == 1: the replica's)
    if local != moe_layers * d.b * d.s // st.n:
        raise GraphError(f"graph {graph.name!r}: its routers see {local} rows over {moe_layers} layers, not each "
                         f"rank's shard (b*s/n={d.b * d.s // st.n} per layer): the aux loss's reduction is not "
                         "known for it")
    # where the routers' rows sit, for a padded batch's mask (moegraph.kernels.chunk_positions)
    where = dict(aux_positions="shard", aux_chunks=st.chunks)
    stats_of: dict[str, str] = {}
    replaced: dict[str, Node] = {}
    for nd in forward:
        T = rows_of[nd.name]
        stats_of[nd.name] = g.value(f"{nd.name}.aux_stats", (3, E), kind=ValueKind.ROUTING, dtype="fp32")
        replaced[nd.name] = dataclasses.replace(nd, outputs=nd.outputs + (stats_of[nd.name],),
                                                flops=nd.flops + T * (E + aux.top_k),
                                                mem_bytes=nd.mem_bytes + 3 * E * f32).with_attrs(aux=True, **where)
    kw = dict(block=EDGES, phase=Phase.FORWARD)
    stats, seeds, nodes = [], [], []
    for j in range(M):
        first = len(g.nodes)
        parts = [stats_of[nd.name] for nd in forward if mb(nd) == j]
        total = g.value(at(j, f"{EDGES}.aux.stats_local"), (3, E), kind=ValueKind.ROUTING, dtype="fp32")
        g.node(at(j, f"{EDGES}.aux.sum"), OpKind.ADD, tuple(parts), (total,), flops=3 * E * (len(parts) - 1),
               mem_bytes=(len(parts) + 1) * 3 * E * f32, **kw)
        if st.n > 1:                                        # the replica's ranks hold distinct rows
            out = g.value(at(j, f"{EDGES}.aux.stats_replica"), (3, E), kind=ValueKind.ROUTING, dtype="fp32")
            g.collective(at(j, f"{EDGES}.aux.allreduce"), OpKind.ALL_REDUCE, (total,), (out,), group=st.n,
                         full_bytes=3 * E * f32, flops=3 * E, **kw)
            total = out
        if st.dp > 1:                                       # the replicas hold distinct rows
            out = g.value(at(j, f"{EDGES}.aux.stats_global"), (3, E), kind=ValueKind.ROUTING, dtype="fp32")
            g.collective(at(j, f"{EDGES}.aux.allreduce_dp"), OpKind.ALL_REDUCE, (total,), (out,), group=st.dp,
                         full_bytes=3 * E * f32, flops=3 * E, attrs={"scope": "inter", "axis": "dp"}, **kw)
            total = out
        stats.append(total)
        seed = g.value(at(j, f"{EDGES}.d_aux"), (1,), kind=ValueKind.GRAD, dtype="fp32")
        g.inputs.append(seed)
        seeds.append(seed)
        nodes.append(g.nodes[first:])
        del g.nodes[first:]
    for nd in routers:
        if nd.phase is not Phase.BACKWARD:
            continue                                        # a recompute re-routes: its stats are not needed
        j = mb(nd)
        T = graph.value[nd.inputs[0]].numel // d.h
        # a weight-gradient kernel adding into a running sum reads that sum last (Node.accumulating)
        ins = (nd.inputs[:-1] + (stats[j], seeds[j], nd.inputs[-1]) if nd.attr("accumulate", False)
               else nd.inputs + (stats[j], seeds[j]))
        replaced[nd.name] = dataclasses.replace(nd, inputs=ins,
                                                flops=nd.flops + 4 * T * E,
                                                mem_bytes=nd.mem_bytes + 3 * E * f32 + f32
                                                ).with_attrs(aux=True, **where)
    graph = dataclasses.replace(graph, nodes=tuple(replaced.get(nd.name, nd) for nd in graph.nodes))
    values = dict(aux_stats=tuple(stats), aux_seeds=tuple(seeds), aux_coef=float(aux.coef), aux_experts=E)
    return graph, values, nodes


def _bucket_rows(g: GraphBuilder, partial: str, bucket: int) -> tuple[int, ...]:
    """Row counts of the blocks a replicated [V, h] partial gradient is synced in (module
    docstring, "gradient buckets"): K = ceil(bytes / ``bucket``) blocks of near-equal rows (at most
    V). Each block must be a size the sync rule takes: with dp > 1 ``_dp_sync``'s reduce-scatters
    need a multiple of n*dp elements, which every whole row is, as the final norm's [h] gradient
    takes the same sync (its ``_dp_sync`` raises first where h does not divide). One block (V,):
    the partial is synced whole, as without buckets (also on one rank, where nothing is synced)."""
    st = g.strategy
    V = g.shape(partial)[0]
    K = min(-(-g.nbytes(partial) // bucket), V)
    if K <= 1 or st.n * st.dp == 1:
        return (V,)
    return tuple(V // K + (i < V % K) for i in range(K))


def _bucketed_sync(g: GraphBuilder, param: str, partial: str, rows: tuple[int, ...]) -> str:
    """``partial`` [V, h] synchronised by the replicated-parameter rule (``autodiff.param_grad``)
    in len(``rows``) row blocks: a SPLIT into views of the partial (``{param}.grad_buckets``), one
    sync per block (``{param}.bucket{i}.grad_allreduce``, or ``_dp_sync``'s chain), each writing
    its rows of the synced gradient (the block's result is a view of it), and a SPLIT concat
    (``{param}.grad_concat``; planned zero-copy, priced 0, though the runtime's kernel copies:
    module docstring) so that readers of the synced gradient depend on every block, as
    ``lowering.blocks`` joins token chunks. One block: the whole sync, as without
    buckets (same names). Returns the synced gradient's name (``d_{param}.synced``)."""
    g.params[param] = ParamSpec(sources=(), shard_dim=None)
    if len(rows) == 1:
        return param_grad(g, param, partial)
    V, h = g.shape(partial)
    kw = dict(phase=Phase.BACKWARD, mem_bytes=0, block=EDGES)
    # views of the partial (no copy), as lowering.blocks cuts token chunks; role FORWARD: the
    # kernel does what ``mode`` says (a DGRAD SPLIT runs its forward's transpose)
    parts = [g.value(f"{partial}.bucket{i}", (r, h), kind=ValueKind.PARAM_GRAD, dtype=g.values[partial].dtype,
                     alias_of=partial) for i, r in enumerate(rows)]
    g.node(f"{param}.grad_buckets", OpKind.SPLIT, (partial,), parts,
           attrs={"dim": 0, "sizes": rows, "mode": "split"}, **kw)
    blocks = []
    for i, part in enumerate(parts):
        g.params[f"{param}.bucket{i}"] = ParamSpec(sources=(), shard_dim=None)
        blocks.append(param_grad(g, f"{param}.bucket{i}", part))
    first = g.values[blocks[0]]
    out = g.value(f"d_{param}.synced", (V, h), kind=ValueKind.PARAM_GRAD, dtype=first.dtype)
    for b in blocks:                                        # each sync writes its rows of ``out``
        g.values[b] = dataclasses.replace(g.values[b], alias_of=out)
    g.node(f"{param}.grad_concat", OpKind.SPLIT, tuple(blocks), (out,),
           attrs={"dim": 0, "sizes": rows, "mode": "concat"}, **kw)
    return out


def _embed_pattern(graph: Graph, asked: EmbedGrad | None, vocab: int | None, M: int, *, elem: int,
                   wire: int) -> EmbedGrad:
    """The embedding gradient's pattern: ``asked``, checked, or the closed-form choice."""
    st, d = graph.strategy, graph.dims
    kw = dict(n=st.n, dp=st.dp, b=d.b, s=d.s, h=d.h, vocab=vocab, elem=elem, wire=wire, micro_batches=M)
    if asked is None or asked is EmbedGrad.ROWS:
        return embed_grad_choice(**kw) if asked is None else asked
    if asked is not EmbedGrad.PARTIAL:
        raise ValueError(f"embedding gradient pattern {asked!r} is not one of {[p.value for p in EmbedGrad]}")
    why = ("dp == 1 (no replicas: the intra gather is the cheaper one)" if st.dp == 1 else
           "a base model (no vocab given)" if vocab is None else None)
    if why is not None:
        raise ConfigError(f"graph {graph.name!r}: the PARTIAL embedding gradient does not apply to {why}")
    embed_grad_inter_bytes(EmbedGrad.PARTIAL, **kw)         # raises when V*h does not split over n*dp
    return asked


def _embed_gather(g: GraphBuilder, j: int, at, dx: str) -> str:
    """Micro-batch j's layer-0 input gradient gathered over every rank (module docstring); the
    gathered value (``dx`` itself on one rank)."""
    st, d = g.strategy, g.dims
    kw = dict(phase=Phase.BACKWARD, role=Role.WGRAD, block=EDGES)
    embed = {EMBED_ATTR: True}
    rows = dx
    N = st.attn_nodes                                   # the rows are gathered in the order of gathered_tokens
    if st.n > 1:                                        # [b/N, s/G, h] -> [b/N, N s, h] ([b, s, h] when N = 1)
        out = g.value(at(j, f"{EDGES}.d_embed_rows" if st.dp == 1 else f"{EDGES}.d_embed_rows_replica"),
                      (d.b // N, d.s * N, d.h), kind=ValueKind.GRAD, dtype=g.values[dx].dtype)
        g.collective(at(j, f"{EDGES}.embed.grad_gather"), OpKind.ALL_GATHER, (rows,), (out,), group=st.n,
                     full_bytes=g.nbytes(out), attrs={"dim": 1} | embed, **kw)
        rows = out
    if st.dp > 1:                                       # [b/N, N s, h] -> [dp*b/N, N s, h], replica-major
        out = g.value(at(j, f"{EDGES}.d_embed_rows"), (st.dp * d.b // N, d.s * N, d.h), kind=ValueKind.GRAD,
                      dtype=g.values[dx].dtype)
        # dp=True: a DP collective like _dp_sync's, counted by exposed_dp_sync_us
        # (schedule_file.dp_sync_exposure) and the DP warm starts; not a reduce-scatter, so
        # compress=dp-bf16 (is_dp_fp32_reduce_scatter) leaves it as it is
        g.collective(at(j, f"{EDGES}.embed.grad_gather_dp"), OpKind.ALL_GATHER, (rows,), (out,), group=st.dp,
                     full_bytes=g.nbytes(out), attrs={"dim": 0, "scope": "inter", "axis": "dp", "dp": True} | embed,
                     **kw)
        rows = out
    return rows


def _splice(graph: Graph, computes: list[list[Node]], sync: list[Node], gathers: list[list[Node]]) -> tuple[Node, ...]:
    """``graph``'s nodes with the edges in one valid topological order: micro-batch j's eager
    compute between its forward and its backward (before its first backward node), its
    embedding gather after its last node (layer 0's backward), the step's sync at the end. A
    one-micro-batch graph keeps the order sync, then gather."""
    M = len(computes)
    mb = [(micro_batch_of(n) if M > 1 else 0) for n in graph.nodes]
    first_bwd = {j: next(i for i, n in enumerate(graph.nodes) if mb[i] == j and n.phase is not Phase.FORWARD)
                 for j in range(M)}
    last = {j: max(i for i in range(len(graph.nodes)) if mb[i] == j) for j in range(M)}
    out: list[Node] = []
    for i, node in enumerate(graph.nodes):
        for j in range(M):
            if first_bwd[j] == i:
                out += computes[j]
        out.append(node)
        for j in range(M):
            if M > 1 and last[j] == i:
                out += gathers[j]
    return tuple(out + sync + (gathers[0] if M == 1 else []))

__all__ = ["AddEdges", "DP_GRAD_BUCKET_BYTES", "GRAD_BUCKET_BYTES", "add_edges", "aux_loss_graph", "embed_grad_choice", "embed_grad_inter_bytes"]
