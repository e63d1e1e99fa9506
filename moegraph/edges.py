"""The edges of a model step graph, read: the names, attributes and records later stages use.

A causal LM is embedding -> L decoder layers -> final norm -> LM head (-> x logit_scale)
(-> soft cap) -> loss, the final norm an RMSNorm or a LayerNorm (with or without a bias), the
logits' constant multiplier 1 and no soft cap unless the model has them (``EdgeHead``, the one
description of them every stage reads: Cohere's LayerNorm and ``logit_scale``, PhiMoE's biased
LayerNorm, Beam's ``final_logit_softcapping``). The edges
pass (``moegraph.passes.edges.add_edges``, the module docstring there describes the nodes)
appends their gradient syncs and priced eager compute to the step graph; this module holds what
the tracer, the cost model, the scheduler and the runtime read of them: the block and attribute
names, the embedding gradient's pattern (``EmbedGrad``), the router's auxiliary loss
(``AuxLoss``, which the tracer records on a registry model's graph) and ``EdgeValues``, the
value names ``graph.meta["edges"]`` holds.

Notation: b batch (one replica's rows), s sequence, h hidden, n ranks per replica, dp replicas,
V vocabulary, T = b*s/n tokens per rank.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Literal

from moegraph.ir import GraphError, Graph, Node

EDGES = "edges"
"""Block, node-name prefix and schedule group of the edge nodes."""

EDGE_ATTR = "edge"
"""Node attribute (True) marking an edge node (it has no ``layer``)."""

EAGER_ATTR = "eager"
"""Node attribute (True) marking an edge node lowered to no kernel: the runtime's autograd runs it
outside the plan, or the plan runs it at its position through a kernel the runtime supplies
(``Executor`` eager kernels: PARTIAL's ``edges.embed.scatter``, every eager node of a merged step)."""

EMBED_ATTR = "embed"
"""Node attribute (True) marking the embedding gradient's nodes (they follow layer 0's backward)."""

EMBED_SCATTER = f"{EDGES}.embed.scatter"
"""PARTIAL's eager node the plan runs: this rank's rows index_add-ed into a partial [V, h]."""
class EmbedGrad(enum.Enum):
    """How the embedding gradient crosses the replicas (module docstring)."""
    ROWS = "rows"          # gather the rows over the replicas, every rank scatters all dp*b*s
    PARTIAL = "partial"    # scatter this rank's rows into a partial [V, h], the parameter sync rule


@dataclass(frozen=True)
class AuxLoss:
    """The router's auxiliary load-balancing loss a causal LM adds (module docstring):
    ``coef`` (transformers' ``router_aux_loss_coef``, >= 0: at 0 the term is computed and returned
    as transformers' ``.aux_loss`` for the caller to weight, and adds nothing to ``.loss``), over
    its softmax top-``top_k`` routers of ``experts`` experts."""

    coef: float
    experts: int
    top_k: int

    def __post_init__(self):
        if isinstance(self.coef, bool) or not isinstance(self.coef, (int, float)) or not self.coef >= 0:
            raise ValueError(f"AuxLoss.coef={self.coef!r} must be a number >= 0")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"AuxLoss: top_k={self.top_k} must be in 1..experts={self.experts}")


FinalNorm = Literal["rms", "layer"]
"""The final norm the edges model: RMSNorm, or LayerNorm (mean removed, a weight, a bias or none)."""


@dataclass(frozen=True)
class EdgeHead:
    """What the eager edges compute between the last layer and the loss, beyond the LM head's
    product: the one description the lowering builds (``ModelSpec.edge_head``), the edges pass
    prices, the graph carries (``EdgeValues.head``) and the runtime computes.

    norm:        'rms': RMSNorm, priced as an RMSNORM node; 'layer': LayerNorm, a NORM node of kind
                 'layer', as the layers' LayerNorms.
    eps:         the norm's epsilon; None where only the price is wanted (a registry model's plan),
                 not a model the runtime runs.
    bias:        the LayerNorm adds a bias [h] (PhiMoE's): its gradient travels with the weight's,
                 one partial [2h] (weight, then bias) and one sync.
    logit_scale: the logits' constant multiplier (Cohere's ``logits * self.logit_scale``; 1: none,
                 and no node).
    softcap:     the logits, after the scale, soft-capped to c * tanh(logits / c) (Beam's
                 ``final_logit_softcapping`` c; None: none, and no node).
    offset:      an RMSNorm scaling by offset + weight (Gemma's 1 + weight: MiniMax-M3's); 0: weight.
    embed_scale: the embedding's rows times it before layer 0, and so its gradient rows (Gemma 4's
                 scaled word embedding, sqrt(h); 1: none). The lookup runs outside the plan
                 (``embed_rows``); PARTIAL's ``edges.embed.scatter`` prices the T*h multiplies.
    The default is the plain RMSNorm -> head of most families."""

    norm: FinalNorm = "rms"
    eps: float | None = None
    bias: bool = False
    logit_scale: float = 1.0
    softcap: float | None = None
    offset: float = 0.0
    embed_scale: float = 1.0

    def __post_init__(self):
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"EdgeHead.norm={self.norm!r} is not one of 'rms', 'layer'")
        e = self.eps
        if e is not None and (isinstance(e, bool) or not isinstance(e, (int, float)) or not e > 0):
            raise ValueError(f"EdgeHead.eps={e!r} must be a number > 0 or None")
        if self.norm == "layer" and e is None:
            raise ValueError("EdgeHead: a final LayerNorm needs its eps > 0, got eps=None")
        if not isinstance(self.bias, bool) or (self.bias and self.norm != "layer"):
            raise ValueError(f"EdgeHead.bias={self.bias!r}: a bias (True) is a LayerNorm's (norm='layer')")
        s = self.logit_scale
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            raise ValueError(f"EdgeHead.logit_scale={s!r} must be a finite number")
        c = self.softcap
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c)
                              or not c > 0):
            raise ValueError(f"EdgeHead.softcap={c!r} must be None or a finite number > 0")
        o = self.offset
        if isinstance(o, bool) or not isinstance(o, (int, float)) or not math.isfinite(o) or (o and self.norm != "rms"):
            raise ValueError(f"EdgeHead.offset={o!r} must be a finite number, nonzero only on an RMSNorm")
        e = self.embed_scale
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not math.isfinite(e):
            raise ValueError(f"EdgeHead.embed_scale={e!r} must be a finite number")

    @property
    def norm_params(self) -> int:
        """How many [h] vectors the final norm holds: its weight, and its bias where it has one."""
        return 1 + self.bias

    @property
    def plain(self) -> bool:
        """The logits are the LM head's product itself (no scale, no soft cap): what a base model,
        which has no head, must have."""
        return self.logit_scale == 1 and self.softcap is None


def embed_rows(ids, weight, head: EdgeHead, padding_idx: int | None):
    """The embedding of token ids [...] -> [..., h]: weight's rows, times ``head.embed_scale`` (the one
    copy: every runtime path embeds through it)."""
    import torch.nn.functional as F
    x = F.embedding(ids, weight, padding_idx=padding_idx)
    return x * head.embed_scale if head.embed_scale != 1 else x


AUX_META = "aux_loss"
"""graph.meta key: the AuxLoss of a registry model traced with router_aux_loss_coef > 0
(``moegraph.tracer.trace_model``), which ``add_edges`` adds when given none."""

AUX_STATS = f"{EDGES}.aux.stats"
"""The global [3, E] router stats (counts, prob sums, rows counted) of a one-micro-batch step's aux loss."""


def aux_loss_value(stats, experts: int):
    """transformers' aux loss of the global stats [3, E] (counts, prob sums, and in every column
    N, the rows counted: a padded batch's those its mask keeps; tensors):
    E * sum_i (count_i / N) * (psum_i / N)."""
    rows = stats[2, 0]
    return (stats[0] / rows * (stats[1] / rows)).sum() * experts

@dataclass(frozen=True)
class EdgeValues:
    """Value names of a graph's edges (``graph.meta["edges"]``).

    seeds: per micro-batch, the last layer's incoming gradient [b, s/n, h], made by that
    micro-batch's eager norm backward (one entry for a one-micro-batch graph).
    norm_partial / head_partial: this rank's partial gradient of the final norm [h] ([2h]: weight,
    then bias, with a bias) and of the
    LM head [V, h] for the whole step (head: None for a base model without one), made by the
    eager weight-gradient nodes; in a merged step each micro-batch's adds into the previous
    one's (attr accumulate), so this is the last micro-batch's, the sum over all of them.
    norm_synced / head_synced: the synchronised gradients, once per step (the partial itself
    when the world is one rank: nothing to sync).
    embed_gathered: ROWS: per micro-batch, its layer 0's input gradient gathered over every rank
    ([dp*b, s, h]: the global batch's rows in input_ids order); layer 0's input gradient itself
    when the world is one rank. PARTIAL: empty.
    embed_grad: the pattern (``EmbedGrad``, module docstring).
    embed_partial / embed_synced: PARTIAL: this rank's partial [V, h], made by
    ``edges.embed.scatter`` (in a merged step the last micro-batch's, the sum over all of them),
    and the synchronised embedding gradient [V, h] (fp32, already the mean over the replicas);
    ROWS: None.
    head: the final norm, the logits' scale and soft cap the edge nodes price (``EdgeHead``); the
    runtime computes the same (it checks).
    aux_stats / aux_seeds: with the aux loss (``AuxLoss``), per micro-batch the global router
    stats [3, E] (``edges.aux.stats``, read for the loss value) and the aux seed [1] the runtime
    gives to the routers' backward; empty without. aux_coef, aux_experts: the loss's coefficient
    and E (N, the rows counted, is the stats' row 2: a padded micro-batch counts fewer).
    """

    seeds: tuple[str, ...]
    norm_partial: str
    norm_synced: str
    head_partial: str | None
    head_synced: str | None
    embed_gathered: tuple[str, ...]
    embed_grad: EmbedGrad = EmbedGrad.ROWS
    embed_partial: str | None = None
    embed_synced: str | None = None
    aux_stats: tuple[str, ...] = ()
    aux_seeds: tuple[str, ...] = ()
    aux_coef: float = 0.0
    aux_experts: int = 0
    head: EdgeHead = EdgeHead()

    def __post_init__(self):
        if not isinstance(self.head, EdgeHead):     # graph.meta holds it frozen: (field, value) pairs
            object.__setattr__(self, "head", EdgeHead(**dict(self.head)))

    @property
    def seed(self) -> str:
        """The one seed of a one-micro-batch graph."""
        return self._one(self.seeds, "seeds")

    @property
    def embed_rows(self) -> str:
        """The one gathered embedding gradient of a one-micro-batch graph (ROWS)."""
        if self.embed_grad is not EmbedGrad.ROWS:
            raise GraphError(f"the embedding gradient is {self.embed_grad.value}: no gathered rows; read "
                             "EdgeValues.embed_synced")
        return self._one(self.embed_gathered, "embed_gathered")

    @staticmethod
    def _one(names: tuple[str, ...], field: str) -> str:
        if len(names) != 1:
            raise GraphError(f"the edges of a step of {len(names)} micro-batches have one value per micro-batch: "
                             f"read EdgeValues.{field} ({', '.join(names)})")
        return names[0]

    @property
    def partials(self) -> tuple[str, ...]:
        """The partial gradients the eager backward makes, (norm, head)."""
        return tuple(v for v in (self.norm_partial, self.head_partial) if v is not None)

    @property
    def backward_inputs(self) -> tuple[str, ...]:
        """What the runtime gives the plan's backward besides the seeds: the partials, then the
        aux seeds."""
        return self.partials + self.aux_seeds

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(v for v in (self.norm_synced, self.head_synced, *self.embed_gathered,
                                                self.embed_synced) if v is not None))


def edge_values(graph: Graph) -> EdgeValues | None:
    """The graph's edges, or None when ``add_edges`` did not run on it."""
    names = graph.meta_get(EDGES)
    return None if names is None else EdgeValues(**dict(names))

def is_eager(attrs) -> bool:
    """Whether a node's attributes (a Mapping) mark it as eager edge compute (not run by the plan)."""
    return attrs.get(EAGER_ATTR) is True


def is_edge(attrs) -> bool:
    """Whether a node's attributes (a Mapping) mark it as an edge node."""
    return attrs.get(EDGE_ATTR) is True


def edge_layer(node: Node, layers: int) -> int:
    """The layer an edge node is placed beside by the hand-written orders (the paired
    micro-batch baselines' slots, the DP stream's order): the embedding gathers beside layer 0,
    whose backward they follow; everything else (the head and norm, forward and backward, and
    their gradient sync) beside the last layer L-1, whose forward it follows and whose backward
    it starts (the sync's partials exist from then on)."""
    if not is_edge(dict(node.attrs)):
        raise GraphError(f"node {node.name!r} is not an edge node (attr {EDGE_ATTR!r})")
    return 0 if node.attr(EMBED_ATTR, False) is True else layers - 1

__all__ = ["AUX_META", "AUX_STATS", "AuxLoss", "aux_loss_value", "EDGES", "EDGE_ATTR", "EAGER_ATTR", "EMBED_ATTR",
           "EMBED_SCATTER", "EdgeHead", "embed_rows", "FinalNorm", "EdgeValues", "EmbedGrad", "edge_layer", "edge_values", "is_edge", "is_eager"]
