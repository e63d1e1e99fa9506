"""Block specs: what a decoder layer's blocks compute, by the module parameters they read.

A rule (``moegraph.lowering.structural`` for transformers' families, ``reference`` for the
project's own layer) fills these from a module; the emitters (``blocks``, ``blocks_ext``) turn
them into IR nodes for a strategy. Every optional field defaults to the plain Mixtral-style block,
so a spec leaving them alone lowers to the graph it always did.

Notation: h hidden, H query heads, G kv heads, d head dim, E experts, f expert h_ffn, f_s shared
h_ffn; MLA: r_q, r_kv latent ranks, dn, dr, dv per-head no-RoPE, RoPE and value dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moegraph.ir import ParamSource, Scoring

Activation = Literal["silu", "gelu", "gelu_tanh", "clamped_swiglu"]
"""The gated MLP's activation act(gate) * up: SwiGLU (silu), GeGLU (exact or tanh GELU), or
GPT-OSS's clamped SwiGLU: (clamp(up, -l, l) + 1) * g sigmoid(alpha g), g = min(gate, l)."""
NormKind = Literal["rms", "layer"]
GroupScore = Literal["top2-sum", "max"]
GateAct = Literal["sigmoid", "softplus"]


@dataclass(frozen=True)
class NormSpec:
    """RMSNorm weight * x rsqrt(mean(x^2) + eps), or with kind 'layer' LayerNorm (mean removed,
    weight, then + bias when given). ``offset``: an RMSNorm scaling by (offset + weight), Gemma's
    1 + weight (MiniMax-M3's norms)."""

    weight: ParamSource
    eps: float
    kind: NormKind = "rms"
    bias: ParamSource | None = None
    offset: float = 0.0

    def __post_init__(self):
        if self.offset and self.kind != "rms":
            raise ValueError(f"NormSpec: offset={self.offset} on a {self.kind} norm (only an RMSNorm's is modelled)")

    @property
    def attrs(self) -> dict:
        """The norm node's attributes: eps, and the offset where there is one (so every other
        model's graph stays as it was)."""
        return {"eps": self.eps} | ({"offset": self.offset} if self.offset else {})


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding as a family's rotary module computes it.

    inv_freq: the inverse frequencies, d_r/2 of them (None: the default theta^(-2i/d_r)).
    scaling:  cos and sin are multiplied by it (YaRN's attention factor; 1 otherwise).
    dim:      rotated leading dims d_r of each head (partial RoPE), None: the whole head.
    interleave: pairs (2i, 2i+1) rotate together (Llama 4, GLM) instead of (i, i + d_r/2).
    """

    theta: float = 10000.0
    inv_freq: tuple[float, ...] | None = None
    scaling: float = 1.0
    dim: int | None = None
    interleave: bool = False

    @staticmethod
    def default_inv_freq(theta: float, dim: int) -> tuple[float, ...]:
        """theta^(-2i/dim) in fp32, exactly as transformers' default RoPE (and models.rope_cos_sin)."""
        import torch
        return tuple((1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))).tolist())

    def attrs(self) -> dict:
        """The ROPE node attributes beyond head_dim and theta: none for the default rotation."""
        out = {}
        if self.inv_freq is not None:
            out["inv_freq"] = self.inv_freq
        if self.scaling != 1.0:
            out["scaling"] = self.scaling
        if self.dim is not None:
            out["rotary_dim"] = self.dim
        if self.interleave:
            out["interleave"] = True
        return out


@dataclass(frozen=True)
class OutGateSpec:
    """A gated attention output: the attention's output [H*dv] times act(g_proj(x)) of the layer
    input x, before o_proj; one gate per head broadcast over its dv features (Laguna's default,
    weight [H, h]) or one per feature (weight [H*dv, h]; Laguna's 'per-element', AFMoE). ``weight``
    None: the gate's logits are q_proj's, each head's d rows after its query's (Qwen3-Next; per
    feature, sigmoid)."""

    weight: ParamSource | None
    act: GateAct
    per_head: bool


@dataclass(frozen=True)
class AttentionSpec:
    q: ParamSource            # [H*d, h]
    k: ParamSource            # [G*d, h]
    v: ParamSource            # [G*d, h]
    o: ParamSource            # [h, H*d]
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    tuple_output: bool = False   # the module returns (output, attention weights), as transformers' do
    qkv_bias: tuple[ParamSource, ParamSource, ParamSource] | None = None   # [H*d], [G*d], [G*d] (Qwen2)
    # RMSNorm of q over its full width H*d and of k over G*d, before RoPE (OLMoE); with
    # qk_norm_per_head over each head's d (Qwen3, weights [d])
    q_norm: NormSpec | None = None
    k_norm: NormSpec | None = None
    qk_norm_per_head: bool = False
    qk_norm_after_rope: bool = False       # per-head norms applied after RoPE (HunYuan, Llama 4)
    qk_l2_eps: float | None = None         # a weightless L2 norm of each q and k head (Llama 4), its eps
    rope: RopeSpec | None = None     # None: the default RoPE of rope_theta
    use_rope: bool = True            # False: no rotary embedding at all (Llama 4's NoPE layers)
    o_bias: ParamSource | None = None      # [h], added after the output projection (GPT-OSS)
    scale: float | None = None             # softmax scale (None: d^-0.5)
    window: int | None = None              # sliding window: keys in (q - window, q]
    chunk: int | None = None               # chunked attention: keys in q's chunk of this size
    sinks: ParamSource | None = None       # [H] per-head sink logits in the softmax denominator (GPT-OSS)
    # Llama 4's attention temperature tuning of a NoPE layer scales q at position p by
    # 1 + attn_scale * log1p(floor((p + 1) / floor_scale)): exactly 1 while p + 1 < floor_scale, so
    # the layer is lowered (without it) for sequences s < floor_scale only; this is floor_scale
    temperature_floor: int | None = None
    v_head_dim: int | None = None          # each value head's width where it is not d (MiMo-V2-Flash)
    v_scale: float = 1.0                   # values multiplied by it before attending (MiMo-V2-Flash)
    out_gate: OutGateSpec | None = None    # the output gated before o_proj (Laguna)
    qkv_clip: float | None = None          # q, k, v clamped to [-c, c] after their projection (DBRX's clip_qkv)
    v_from_k: bool = False                 # the values are k_proj's output, before k's norm and RoPE (Gemma 4's
                                           # attention_k_eq_v): ``v`` is then k's source and not read twice
    v_norm_eps: float | None = None        # a weightless RMSNorm of each value head, its eps (Gemma 4's v_norm)

    @property
    def rotary(self) -> RopeSpec:
        return self.rope if self.rope is not None else RopeSpec(theta=self.rope_theta)


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet (Qwen3-Next's and Qwen3.5-MoE's ``linear_attention`` layers;
    ``moegraph.delta_kernels`` has the math). Layout 'grouped' (Qwen3-Next): qkvz [Hk*(2dk + 2r dv), h]
    and ba [Hk*2r, h] with rows grouped by key head (q, k, v, z; b, a), r = Hv/Hk value heads per key
    head; layout 'flat' (Qwen3.5-MoE): qkvz is in_proj_qkv [2 Hk dk + Hv dv, h] (q, k, v of every
    head), z [Hv dv, h], b and a [Hv, h] their own. Both: the causal depthwise conv weight [C, 1, K]
    over the channels (q of every key head, k of every key head, v of every value head); A_log and
    dt_bias [Hv]; the gated RMSNorm's weight [dv] (eps ``eps``); out [h, Hv*dv].
    Layout 'kda' (Kimi Delta Attention, Hk = Hv): q, k, v [Hv d, h] (qkvz, k, v), b [Hv, h]; the forget
    gate a = a_down then a [Hv dk, rank] with dt_bias [Hv dk] and A_log [1, 1, Hv, 1] (a decay per key
    feature); the output gate z = z_down then z [Hv dv, rank], sigmoid-gating the norm."""

    qkvz: ParamSource
    ba: ParamSource | None
    conv: ParamSource
    a_log: ParamSource
    dt_bias: ParamSource
    norm: ParamSource
    out: ParamSource
    k_heads: int              # Hk
    v_heads: int              # Hv
    k_dim: int                # dk
    v_dim: int                # dv
    conv_size: int            # K
    eps: float
    chunk_size: int = 64      # the delta rule's chunk L (transformers' torch_chunk_gated_delta_rule's)
    layout: Literal["grouped", "flat", "kda"] = "grouped"
    z: ParamSource | None = None     # flat: in_proj_z, in_proj_b, in_proj_a; kda: g_b_proj, b_proj, f_b_proj
    b: ParamSource | None = None
    a: ParamSource | None = None
    k: ParamSource | None = None     # kda: k_proj and v_proj (qkvz is q_proj)
    v: ParamSource | None = None
    z_down: ParamSource | None = None    # kda: the low-rank gates' down projections g_a_proj, f_a_proj
    a_down: ParamSource | None = None
    gate_rank: int = 0               # kda: their rank (g_a's and f_a's outputs; the one for both)


@dataclass(frozen=True)
class MLPSpec:
    """A dense gated MLP: a dense layer's FFN (DeepSeek-V3's first_k_dense_replace layers), or
    the shared expert every token goes through beside the routed ones (Qwen2-MoE, DeepSeekMoE),
    then optionally scaled by sigmoid(x @ gate.T) per token (Qwen2-MoE)."""

    w1: ParamSource           # [f_s, h] gate projection
    w3: ParamSource           # [f_s, h] up projection
    w2: ParamSource           # [h, f_s] down projection
    ffn_hidden: int           # f_s
    hidden: int               # h
    gate: ParamSource | None = None   # [1, h]
    activation: Activation = "silu"
    swiglu_alpha: float | None = None   # clamped_swiglu's alpha and limit (MiniMax-M3's shared expert)
    swiglu_limit: float | None = None
    # as a shared expert, a norm of its own on the block input and one on its output (Gemma 4's dense
    # MLP beside the experts: pre_feedforward_layernorm, post_feedforward_layernorm_1)
    input_norm: NormSpec | None = None
    output_norm: NormSpec | None = None


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3). Per token x [h]:
        q  = q_b(norm_q(q_a(x)))  (or q(x) without a q rank)     [H*(dn+dr)], per head (q_nope, q_rot)
        kv_a(x) = (c [r_kv], k_pe [dr]);  kv = kv_b(norm_kv(c))  [H*(dn+dv)], per head (k_nope, v)
        query = (q_nope, rope(q_rot)), key = (k_nope, rope(k_pe)) (k_pe shared by every head)
        out = o(causal attention(query, key, value))             [h]
    q/k head dim dn+dr differs from the value head dim dv; scaling is (dn+dr)^-0.5 unless ``scale``.
    A forward that rotates nothing (Kimi Linear's MLA: NoPE, k_pe shared unrotated) has ``rope`` of
    zero frequencies, the identity rotation."""

    q: ParamSource | None     # [H*(dn+dr), h]  when q is projected directly (q_rank None)
    q_a: ParamSource | None   # [r_q, h]
    q_norm: NormSpec | None   # over r_q
    q_b: ParamSource | None   # [H*(dn+dr), r_q]
    kv_a: ParamSource         # [r_kv + dr, h]
    kv_norm: NormSpec         # over r_kv
    kv_b: ParamSource         # [H*(dn+dv), r_kv]
    o: ParamSource            # [h, H*dv]
    heads: int                # H
    nope_dim: int             # dn
    rope_dim: int             # dr
    v_dim: int                # dv
    q_rank: int | None        # r_q
    kv_rank: int              # r_kv
    rope_theta: float
    rope_interleave: bool     # RoPE pairs (2i, 2i+1) instead of (i, i + dr/2)
    tuple_output: bool = True
    rope: RopeSpec | None = None     # non-default frequencies or scaling (YaRN)
    scale: float | None = None       # softmax scale (YaRN's mscale^2 (dn+dr)^-0.5)
    # Mistral 4's query scale 1 + beta * log(1 + floor(p / P)) (rope_parameters' llama_4_scaling_beta
    # and original_max_position_embeddings P): exactly 1 for positions p < P, so the layer is lowered
    # (without it) for sequences s <= P only; this is P
    query_scale_from: int | None = None

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim


@dataclass(frozen=True)
class MoESpec:
    router: ParamSource       # [E, h]
    w1: ParamSource           # [E, h_ffn, h] gate projection
    w3: ParamSource           # [E, h_ffn, h] up projection
    w2: ParamSource           # [E, h, h_ffn] down projection
    experts: int
    top_k: int
    ffn_hidden: int
    hidden: int
    normalize: bool = True    # renormalise the top-k weights to sum to 1 (Mixtral; not Qwen2-MoE)
    shared: MLPSpec | None = None
    shared_average: bool = False              # output (routed + shared) / 2, not their sum (Cohere2-MoE)
    # DeepSeek-V3's router: sigmoid scores; experts chosen by score + score_bias (a buffer, used
    # for the choice only) among the best topk_groups of `groups` expert groups (a group ranked by
    # its two best scores, or with group_score 'max' its best: DeepSeek-V2); the chosen scores
    # (renormalised if normalize) times `scale` weigh them
    scoring: Scoring = "softmax"
    score_bias: ParamSource | None = None     # [E]
    bias_on_logits: bool = False              # score_bias is added to the logits, not the scores (Kolibri)
    groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0
    group_score: GroupScore = "top2-sum"
    activation: Activation = "silu"
    router_bias: ParamSource | None = None    # [E] added to the router logits (GPT-OSS), trained
    topk_first: bool = False                  # the softmax over the top-k logits (GPT-OSS; RouterRow.order)
    expert_bias: tuple[ParamSource, ParamSource, ParamSource] | None = None   # [E, f], [E, f], [E, h]
    tuple_output: bool = False                # the block returns (output, router scores)
    swiglu_alpha: float | None = None         # clamped_swiglu's alpha and limit
    swiglu_limit: float | None = None
    weighted_input: bool = False              # the routing weight scales the expert's input rows (Llama 4)
    post_norm: NormSpec | None = None         # a norm on the block's output, before the residual add (A.X-K1)
    # Gemma 4's router and experts beside its dense MLP (``RouterSpec``): the router reads its own
    # norm of the block input times a constant, and each chosen weight times a trained per-expert scale;
    # the routed experts read their own norm of the block input and pass their own output norm
    router_norm: NormSpec | None = None       # weight [h]: the router's learned scale
    router_input_scale: float = 1.0           # the router's input times it (Gemma 4: h^-0.5)
    expert_scale: ParamSource | None = None   # [E]: the chosen weights times expert_scale[expert]
    routed_norm: NormSpec | None = None       # the experts' input norm (pre_feedforward_layernorm_2)
    routed_post_norm: NormSpec | None = None  # the experts' output norm (post_feedforward_layernorm_2)

    @property
    def plain_router(self) -> bool:
        """The router the ROUTER kernel always computed: no group max, no softmax choice bias, no logit bias,
        no choice bias on the logits, no top-k before the softmax, no per-expert scale."""
        return (self.group_score == "top2-sum" and self.router_bias is None and not self.bias_on_logits
                and not self.topk_first and self.expert_scale is None
                and not (self.scoring == "softmax" and (self.score_bias is not None or self.groups != 1
                                                        or self.scale != 1.0)))


@dataclass(frozen=True)
class RouterSpec:
    """A router that is a child of the decoder layer itself, beside an experts child (Gemma 4): on
    tokens x [.., h], logits = proj(norm(x) * scale * input_scale) [E] (``norm`` an RMSNorm whose
    weight is the router's ``scale``), softmax, top-k, renormalised when ``normalize``, each chosen
    weight times ``expert_scale`` [E] of its expert. Only a step of the traced layer: folded with its
    experts into one MoESpec (``moegraph.lowering.parallel_ffn``) before anything is emitted."""

    proj: ParamSource         # [E, h]
    experts: int
    top_k: int
    hidden: int
    norm: NormSpec | None
    input_scale: float = 1.0
    expert_scale: ParamSource | None = None
    scoring: Scoring = "softmax"
    normalize: bool = True
    tuple_output: int = 3     # (probabilities, top-k weights, top-k experts)


@dataclass(frozen=True)
class ExpertsSpec:
    """Routed experts that are a child of the decoder layer, called as experts(x, top_k_index,
    top_k_weights) (Gemma 4): fused 3-D weights as MoESpec's. Folded like RouterSpec."""

    w1: ParamSource           # [E, f, h]
    w3: ParamSource
    w2: ParamSource           # [E, h, f]
    experts: int
    ffn_hidden: int
    hidden: int
    activation: Activation = "silu"
