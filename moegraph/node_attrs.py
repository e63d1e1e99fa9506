"""Typed node attributes: one frozen record per op kind, the schema ``verify`` checks.

A node stores its attributes as sorted (key, value) pairs (``Node.attrs``: what graph digests
hash, unchanged). ``Node.typed`` reads them into the op's record below: every key the op takes,
typed, with its default where it has one. A field without a default is required; a key the op
does not take, a value of the wrong type, or a required key missing is a GraphError naming the
node and the key, raised by ``verify`` (``moegraph.ir``) after every pass and by any reader of
``Node.typed`` on a node no verifier saw. So a misspelt or forgotten attribute can never select a
kernel's default silently.

``NodeAttrs`` holds the annotations any node may carry (added by passes and model-level rewrites:
layer, micro-batch, chunk, the model's edges, fused groups, gradient accumulation); ``CommAttrs``
those of every collective. A node marked ``eager`` (the model's edges: run by its own callable,
not a kernel) needs none of its op's required attributes.

A new attribute is declared here, as a field of its op's record (or of ``NodeAttrs`` if any op may
carry it), with the type its readers expect.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Union

from moegraph.kinds import GraphError, OpKind, Role

SplitMode = Literal["split", "concat", "heads"]
"""SPLIT's attr ``mode``: cut one buffer into views of it ('split': q, k, v of qkv; token chunks),
or write chunks into their slices of one buffer ('concat'), or cut each head's features of the
last dim by ``sizes`` into as many copies ('heads': Qwen3-Next's per-head query and gate)."""
PermuteIndex = Literal["token", "slot"]
"""PERMUTE's attr ``index``: what the index map gathers, token rows ([T, h] -> [R, h]) or routing
slots ([T, k] routing weights -> [R])."""
Scoring = Literal["softmax", "sigmoid"]
"""ROUTER's attr ``scoring``: softmax over the experts (Mixtral) or per-expert sigmoid (DeepSeek-V3).
(``moegraph.models`` keeps its own copy: the eager reference imports nothing from the IR.)"""
Positions = Literal["shard", "full", "chunk_major"]
"""Where a RoPE kernel's rows sit in the sequence (``moegraph.kernels.chunk_positions``)."""
IndexLayout = Literal["local", "all", "by_dest", "by_node", "in_node"]
"""INDEX_MAP's rows: this rank's experts, every expert, every row by destination rank, one row per
(token, destination node), or the rows of this node's experts by local rank (moegraph.index_map)."""
Reduce = Literal["sum", "mean"]
NormKind = Literal["layer", "head_rms", "l2"]
"""NORM's attr ``kind``: LayerNorm, RMSNorm of each head's ``group`` features, weightless L2 norm of each head."""
GluAct = Literal["gelu", "gelu_tanh", "clamped_swiglu", "sigmoid", "softplus"]
"""GLU's attr ``act``: act(a) * b for exact or tanh GELU, or GPT-OSS's clamped SwiGLU; sigmoid or
softplus for a gated attention output (a: the gate's logits, per feature or, attr ``group``, per head)."""
LimitHow = Literal["clamp", "softcap"]
"""LIMIT's attr ``how``: clamp(x, -c, c), or the soft cap c * tanh(x / c), c the attr ``limit``."""
DeltaLayout = Literal["grouped", "flat", "kda"]
"""GATED_DELTA's attr ``layout``: its projection inputs qkvz and ba grouped by key head (Qwen3-Next),
one input of q, k, v, z, b, a one after another (Qwen3.5-MoE), or Kimi Delta Attention's q, k, v, b,
its forget gate's per-key-feature decay input and its output gate, with a sigmoid-gated norm
(Kimi Linear; ``moegraph.delta_kernels.projections``)."""
DtypeName = Literal["fp32", "bf16", "fp16", "fp8", "int64", "int32"]

CHOICE_ATTRS: Mapping[tuple[OpKind, Role], tuple[str, tuple[str, ...]]] = {
    (OpKind.SPLIT, Role.FORWARD): ("mode", typing.get_args(SplitMode)),
    (OpKind.SPLIT, Role.DGRAD): ("mode", typing.get_args(SplitMode)),
    (OpKind.PERMUTE, Role.FORWARD): ("index", typing.get_args(PermuteIndex)),
    (OpKind.PERMUTE, Role.DGRAD): ("index", typing.get_args(PermuteIndex)),
    (OpKind.ROUTER, Role.FORWARD): ("scoring", typing.get_args(Scoring)),
    (OpKind.ROUTER, Role.DGRAD): ("scoring", typing.get_args(Scoring)),
    (OpKind.ROUTER, Role.WGRAD): ("scoring", typing.get_args(Scoring)),
    (OpKind.NORM, Role.FORWARD): ("kind", typing.get_args(NormKind)),
    (OpKind.NORM, Role.DGRAD): ("kind", typing.get_args(NormKind)),
    (OpKind.NORM, Role.WGRAD): ("kind", typing.get_args(NormKind)),
    (OpKind.GLU, Role.FORWARD): ("act", typing.get_args(GluAct)),
    (OpKind.GLU, Role.DGRAD): ("act", typing.get_args(GluAct)),
    (OpKind.LIMIT, Role.FORWARD): ("how", typing.get_args(LimitHow)),
    (OpKind.LIMIT, Role.DGRAD): ("how", typing.get_args(LimitHow)),
    (OpKind.GATED_DELTA, Role.FORWARD): ("layout", typing.get_args(DeltaLayout)),
    (OpKind.GATED_DELTA, Role.DGRAD): ("layout", typing.get_args(DeltaLayout)),
}
"""(op, role) -> (attribute, its valid values): attributes whose value picks what a kernel (and the
op's VJP rule) computes; a switch over one ends in ``bad_choice``. (PERMUTE's weight-gradient role
is the model edges' embedding scatter, run by its own eager kernel, which reads no ``index``.)"""


class AttrError(GraphError):
    """A node's attributes do not match its op's record; the message names the node and the key."""


def bad_choice(node: Any) -> GraphError:
    """The error ending a switch over a CHOICE_ATTRS attribute: the node, the value, the valid ones."""
    key, valid = CHOICE_ATTRS[node.op, node.role]
    return GraphError(f"node {node.name!r} ({node.op.value}/{node.role.value}): {key}={node.attr(key, None)!r} "
                      f"is not one of {', '.join(map(repr, valid))}")


# -- the records -------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class NodeAttrs:
    """Annotations any node may carry."""

    layer: int | None = None             # layer index in a multi-layer graph (moegraph.layers)
    mb: int | None = None                # micro-batch of a merged step graph (moegraph.microbatch)
    chunk: int | None = None             # token chunk (the chunk pass; RoPE's positions read it)
    edge: bool = False                   # a model edge node (moegraph.edges)
    eager: bool = False                  # run by its own callable, not a kernel (moegraph.edges)
    embed: bool = False                  # the embedding's gradient path (moegraph.edges)
    fused: tuple | None = None           # a fused comm+compute group (moegraph.cost.FusedGroup)
    accumulate: bool = False             # a weight gradient added into the running sum (autodiff)
    accumulate_bytes: int | None = None  # that sum's bytes, read once more (cost model)
    stage: int | None = None             # pipeline stage (moegraph.passes.stages)


@dataclass(frozen=True, kw_only=True)
class CommAttrs(NodeAttrs):
    """Annotations any collective may carry (data-parallel syncs, compressed wires)."""

    dp: bool = False                     # a data-parallel gradient sync
    flat: bool = False                   # over a flattened bucket of gradients
    axis: Literal["mp", "dp", "node", "rail", "attn", "attn_dp"] | None = None
    scope: Literal["intra", "inter"] | None = None
    span: int | None = None              # the consecutive ranks a strided group lies among (attn_dp: n)
    compressed: DtypeName | None = None  # the wire dtype of a compressed collective


@dataclass(frozen=True, kw_only=True)
class GemmAttrs(NodeAttrs):
    mnk: tuple[int, ...] | None = None   # the forward product's (m, n, k) (moegraph.efficiency, cost model)


@dataclass(frozen=True, kw_only=True)
class GroupedGemmAttrs(GemmAttrs):
    stream_bytes: int | None = None      # expert weights streamed in the step (cost model)
    groups: int | None = None            # expert GEMMs E the mnk rows are split over (moegraph.efficiency)


@dataclass(frozen=True, kw_only=True)
class AttentionAttrs(NodeAttrs):
    head_dim: int
    causal: bool = True
    chunks: int = 1                      # token chunks given, each of q, k, v
    v_head_dim: int | None = None        # MLA: values narrower than q/k heads
    # structural lowering (moegraph.family_kernels.attend): a mask narrower than causal, a softmax
    # scale other than d^-0.5, per-head sink logits (an input after q, k, v)
    window: int | None = None
    chunk_size: int | None = None
    scale: float | None = None
    sinks: bool = False
    seq: int | None = None               # tokens each head attends over (moegraph.efficiency, cost model)


@dataclass(frozen=True, kw_only=True)
class RmsNormAttrs(NodeAttrs):
    eps: float
    offset: float = 0.0                  # the scale is offset + weight (Gemma's 1 + weight)


@dataclass(frozen=True, kw_only=True)
class RopeAttrs(NodeAttrs):
    head_dim: int
    theta: float
    positions: Positions
    chunks: int = 1
    # structural lowering (moegraph.family_kernels.rotate): the rotary module's frequencies and
    # cos/sin scale, partial rotation, interleaved pairs
    inv_freq: tuple[float, ...] | None = None
    scaling: float | None = None
    rotary_dim: int | None = None
    interleave: bool = False


@dataclass(frozen=True, kw_only=True)
class RouterAttrs(NodeAttrs):
    scoring: Scoring
    top_k: int
    experts: int
    normalize: bool = True
    groups: int | None = None            # sigmoid scoring: expert groups, the best topk_groups kept
    topk_groups: int | None = None
    scale: float | None = None           # sigmoid scoring: routed weights' scale
    score_bias: bool = False             # sigmoid scoring: a selection-bias buffer input
    aux: bool = False                    # emits the aux loss's stats (moegraph.edges)
    # a padded batch's aux loss counts the rows the attention mask keeps: where the router's rows
    # sit in the sequence ('shard': this rank's own, what every lowered router reads), of chunks
    aux_positions: Positions | None = None
    aux_chunks: int = 1
    # structural lowering (moegraph.family_kernels.route_general): every field explicit, a group
    # ranked by its best score, a trained logit bias input (and its weight-gradient node: wrt)
    general: bool = False
    group_score: Literal["top2-sum", "max"] | None = None
    logit_bias: bool = False
    bias_on_logits: bool = False         # the choice bias is added to the logits before scoring (Kolibri)
    expert_scale: bool = False           # a trained [E] input: each chosen weight times its expert's (Gemma 4)
    wrt: Literal["weight", "logit_bias", "expert_scale"] | None = None
    topk_first: bool = False             # softmax over the top-k logits (GPT-OSS), not top-k of the softmax

    def problem(self, role: Role) -> str | None:
        if self.scoring == "sigmoid" and None in (self.groups, self.topk_groups, self.scale):
            return "scoring='sigmoid' needs groups, topk_groups and scale"
        if self.topk_first and not (self.general and self.scoring == "softmax" and self.normalize
                                    and not self.score_bias and self.groups == 1):
            return "topk_first=True needs general=True, softmax scoring, normalize, no score_bias and one group"
        if self.bias_on_logits and not (self.general and self.score_bias):
            return "bias_on_logits=True needs general=True and a score_bias input"
        if self.expert_scale and not self.general:
            return "expert_scale=True needs general=True (family_kernels.route_general applies it)"
        return None


@dataclass(frozen=True, kw_only=True)
class IndexMapAttrs(NodeAttrs):
    layout: IndexLayout
    experts_per_rank: int
    top_k: int
    node_ranks: int = 0                  # G, ranks per node: layouts 'by_node' and 'in_node' only


@dataclass(frozen=True, kw_only=True)
class PermuteAttrs(NodeAttrs):
    index: PermuteIndex


@dataclass(frozen=True, kw_only=True)
class UnpermuteAttrs(NodeAttrs):
    weighted: bool


@dataclass(frozen=True, kw_only=True)
class SplitAttrs(NodeAttrs):
    mode: SplitMode
    dim: int
    sizes: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class AddAttrs(NodeAttrs):
    reduce_dim: int | None = None        # the sum (or mean) of one input over this dim
    reduce: Reduce = "sum"
    to: DtypeName | None = None          # the reduction's output dtype


@dataclass(frozen=True, kw_only=True)
class RmsNormShardedAttrs(NodeAttrs):
    eps: float
    width: int                           # the whole row's width, across ranks
    offset: float = 0.0                  # as RmsNormAttrs'


@dataclass(frozen=True, kw_only=True)
class MlaHeadsAttrs(NodeAttrs):
    heads: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    theta: float
    positions: Positions
    interleave: bool = False
    chunks: int = 1
    inv_freq: tuple[float, ...] | None = None   # the rotary module's frequencies (YaRN) and cos/sin scale
    scaling: float | None = None


@dataclass(frozen=True, kw_only=True)
class NormAttrs(NodeAttrs):
    kind: NormKind
    eps: float
    group: int | None = None             # head_rms, l2: the head width each norm covers
    offset: float = 0.0                  # head_rms: the scale is offset + weight (Gemma's 1 + weight)


@dataclass(frozen=True, kw_only=True)
class SwigluAttrs(NodeAttrs):
    row_weights: bool = False            # a third input [R]: each row's routing weight scales the output


@dataclass(frozen=True, kw_only=True)
class GluAttrs(NodeAttrs):
    act: GluAct
    limit: float | None = None           # clamped_swiglu: the clamp and the sigmoid's alpha
    alpha: float | None = None
    group: int | None = None             # a [.., X] broadcast over groups of this many of b [.., X*group]
    row_weights: bool = False            # as SwigluAttrs.row_weights


@dataclass(frozen=True, kw_only=True)
class ScaleAttrs(NodeAttrs):
    factor: float
    by_input: bool = False               # also times its second input, a [1] buffer (Gemma 4's layer_scalar)


@dataclass(frozen=True, kw_only=True)
class LimitAttrs(NodeAttrs):
    how: LimitHow
    limit: float                         # c > 0


@dataclass(frozen=True, kw_only=True)
class GatedDeltaAttrs(NodeAttrs):
    k_heads: int                         # this rank's key heads Hk and value heads Hv (Hk divides Hv)
    v_heads: int
    k_dim: int
    v_dim: int
    conv: int                            # the causal depthwise convolution's width K
    eps: float                           # the gated RMSNorm's
    l2_eps: float = 1e-6                 # q and k's L2 norm
    chunk_size: int = 64                 # the delta rule's chunk L
    seq: int | None = None               # positions each head runs over (moegraph.efficiency, cost model)
    head_dim: int | None = None          # priced as an attention of this head dim (cost model)
    layout: DeltaLayout = "grouped"      # the projections' rows (moegraph.delta_kernels.projections)

    def problem(self, role: Role) -> str | None:
        if min(self.k_heads, self.v_heads, self.k_dim, self.v_dim, self.conv, self.chunk_size) < 1 or \
                self.v_heads % self.k_heads:
            return "sizes must be positive and k_heads must divide v_heads"
        return None


@dataclass(frozen=True, kw_only=True)
class GroupedBiasAttrs(NodeAttrs):
    share: int = 1                       # tp experts: each rank adds bias/share to its partial sums


@dataclass(frozen=True, kw_only=True)
class CastAttrs(NodeAttrs):
    to: DtypeName
    scale: Literal["per_token", "apply"] | None = None


@dataclass(frozen=True, kw_only=True)
class GatherScatterAttrs(CommAttrs):
    dim: int
    reduce: Reduce = "sum"               # reduce-scatter: sum or average; all-gather: unused


@dataclass(frozen=True, kw_only=True)
class AllReduceAttrs(CommAttrs):
    reduce: Reduce = "sum"               # verify refuses 'mean': an all-reduce only sums


@dataclass(frozen=True, kw_only=True)
class AllToAllAttrs(CommAttrs):
    mode: Literal["heads", "tokens", "shards"]
    split_dim: int | None = None
    cat_dim: int | None = None
    direction: Literal["to_experts", "from_experts"] | None = None
    emit_map: bool = False               # a token dispatch that also delivers the received row map
    payloads: int = 1                    # tokens: the leading inputs (and outputs) exchanged row for row by
                                         # one split (an FP8 dispatch's rows and their per-row scales)


@dataclass(frozen=True, kw_only=True)
class P2PAttrs(CommAttrs):
    to_stage: int                        # the receiving pipeline stage (``stage``: the sender's)


RECORDS: Mapping[OpKind, type[NodeAttrs]] = {
    OpKind.GEMM: GemmAttrs, OpKind.GROUPED_GEMM: GroupedGemmAttrs, OpKind.ATTENTION: AttentionAttrs,
    OpKind.RMSNORM: RmsNormAttrs, OpKind.ROPE: RopeAttrs, OpKind.SWIGLU: SwigluAttrs, OpKind.ROUTER: RouterAttrs,
    OpKind.INDEX_MAP: IndexMapAttrs, OpKind.PERMUTE: PermuteAttrs, OpKind.UNPERMUTE: UnpermuteAttrs,
    OpKind.GATE: NodeAttrs, OpKind.SPLIT: SplitAttrs, OpKind.ADD: AddAttrs, OpKind.BIAS: NodeAttrs,
    OpKind.SIGMOID_GATE: NodeAttrs, OpKind.SQUARE_SUM: NodeAttrs, OpKind.RMSNORM_SHARDED: RmsNormShardedAttrs,
    OpKind.MLA_HEADS: MlaHeadsAttrs, OpKind.CAST: CastAttrs, OpKind.ALL_GATHER: GatherScatterAttrs,
    OpKind.REDUCE_SCATTER: GatherScatterAttrs, OpKind.ALL_REDUCE: AllReduceAttrs, OpKind.ALL_TO_ALL: AllToAllAttrs,
    OpKind.P2P: P2PAttrs, OpKind.NORM: NormAttrs, OpKind.GLU: GluAttrs, OpKind.SCALE: ScaleAttrs, OpKind.LIMIT: LimitAttrs,
    OpKind.GROUPED_BIAS: GroupedBiasAttrs, OpKind.GATED_DELTA: GatedDeltaAttrs,
}
"""Op kind -> its attribute record (every OpKind has one: ``attrs_of`` raises for a kind without)."""


# -- reading and checking ------------------------------------------------------------------------

@dataclass(frozen=True)
class _Field:
    name: str
    hint: Any
    required: bool


@functools.cache
def _fields(cls: type[NodeAttrs]) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(_Field(f.name, hints[f.name], f.default is dataclasses.MISSING)
                 for f in dataclasses.fields(cls))


def _fits(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return isinstance(value, str) and value in args
    if origin in (Union, type(int | None)):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is tuple or origin is tuple:
        return isinstance(value, tuple) and (not args or all(_fits(v, args[0]) for v in value))
    raise NotImplementedError(f"no attribute check for type {hint!r}")


def _expected(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (Union, type(int | None)):
        return " or ".join(_expected(a) for a in args)
    if origin is tuple:
        return f"a tuple of {_expected(args[0]).removeprefix('an ').removeprefix('a ')}s"
    return {bool: "a bool", int: "an int", float: "a number", str: "a string", tuple: "a tuple",
            type(None): "None"}[hint]


def attrs_of(node: Any) -> NodeAttrs:
    """``node``'s attributes as its op's record (``Node.typed`` caches it); AttrError naming the node
    and the key for an unknown key, a wrong-typed value or a missing required one (module doc)."""
    cls = RECORDS.get(node.op)
    if cls is None:
        raise NotImplementedError(f"no attribute record for {node.op.value} (node {node.name!r})")
    where = f"node {node.name!r} ({node.op.value}/{node.role.value})"
    given = dict(node.attrs)
    fields = _fields(cls)
    unknown = sorted(set(given) - {f.name for f in fields})
    if unknown:
        raise AttrError(f"{where}: unknown attribute {unknown[0]!r}; {node.op.value} nodes take "
                        f"{', '.join(sorted(f.name for f in fields))} (declare new ones in moegraph/node_attrs.py)")
    eager = given.get("eager") is True
    values = {}
    for f in fields:
        if f.name in given:
            value = given[f.name]
        elif f.required and not eager:
            value = None                 # a missing key reads as None: the message below names it
        else:
            continue
        if not _fits(value, f.hint) and not (eager and value is None):
            raise AttrError(f"{where}: {f.name}={value!r} is not {_expected(f.hint)}")
        values[f.name] = value
    if eager:
        values.update({f.name: None for f in fields if f.required and f.name not in values})
    record = cls(**values)
    problem = getattr(record, "problem", lambda role: None)(node.role)
    if problem is not None:
        raise AttrError(f"{where}: {problem}")
    return record
