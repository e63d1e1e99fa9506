"""The registry records: ModelConfig (one MoE transformer) and Hardware (one device type).

Frozen dataclasses; every field carries its check (moegraph.registry.fields) and a docstring.
Notation (MegaScale-MoE Table 1): h hidden, m = heads/kv_heads, f = h_ffn/h, E experts, k top-k.
Units: bytes, bytes/s, FLOP/s, microseconds; GB means 1e9 bytes (datasheet convention).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, Literal

from moegraph.canonical import canonical_json
from moegraph.registry.fields import (CURVE_NAMES, IN_STEP_CLASSES, Curve, RegistryError, checked, curves,
                                      fraction, fraction_or_zero, in_step, measured, nonneg_float,
                                      MAX_COUNT, MAX_SIZE, bounded_int, count_or_zero, flag, one_of, opt_bounded_int, pos_float, pos_int, sm_budgets, stretch, text, opt_text,
                                      validate_fields, gemm_tiles, head_dim_effs, sources,
                                      mem_traffic, traffic_factor)

__all__ = ["ModelConfig", "Hardware", "MAX_LAYER_PARAM_BYTES"]

# One layer's parameters (fp32) may take at most 16 TiB: about 380 times the largest registry
# layer (deepseek-v3's MoE layer, 46 GB: 256 experts), and small enough that every size the
# planner multiplies stays in int64.
MAX_LAYER_PARAM_BYTES = 2**44


def _as_plain(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_as_plain(x) for x in v]
    return v


class _Record:
    """to_dict / fingerprint shared by both registries."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML types; load_model/load_hardware accept it back unchanged."""
        return {f.name: _as_plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def fingerprint(self) -> str:
        """sha256 of canonical JSON (sorted keys, no whitespace): a cache key stable across runs."""
        return hashlib.sha256(canonical_json(self.to_dict()).encode()).hexdigest()


# --- models --------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ModelConfig(_Record):
    """One MoE transformer: MegaScale-MoE Table 2's columns, plus what today's families add
    (shared experts, q/k/v biases, q/k RMSNorm, the router's normalisation). The defaults of
    the added fields describe a Mixtral-like layer, so entries without them are unchanged."""

    name: str = checked(text)
    """Registry name (or the file stem for a user YAML without a name)."""
    layers: int = checked(bounded_int(MAX_COUNT))
    """Number of transformer layers (#layers)."""
    hidden: int = checked(bounded_int(MAX_SIZE))
    """Hidden size h."""
    heads: int = checked(bounded_int(MAX_COUNT))
    """Query heads (#heads)."""
    kv_heads: int = checked(bounded_int(MAX_COUNT))
    """Key/value heads; heads/kv_heads = m (grouped-query attention)."""
    ffn_hidden: int = checked(bounded_int(MAX_SIZE))
    """Intermediate size h_ffn of ONE expert."""
    experts: int = checked(bounded_int(MAX_COUNT))
    """Routed experts E per MoE layer."""
    top_k: int = checked(bounded_int(MAX_COUNT))
    """Experts each token is routed to (k)."""
    head_dim: int | None = checked(opt_bounded_int(MAX_SIZE), None)
    """Per-head size; None means hidden // heads (then heads must divide hidden)."""
    rope_theta: float = checked(pos_float, 1e6)
    """RoPE base (1e6 for Mixtral-like models, 1e4 for most others)."""
    rms_eps: float = checked(pos_float, 1e-5)
    """RMSNorm epsilon (also of the q/k norms when qk_norm)."""
    shared_experts: int = checked(count_or_zero(MAX_COUNT), 0)
    """Dense shared experts S every token goes through beside the routed ones (DeepSeekMoE: 2,
    Hunyuan-Large: 1, Qwen2-MoE: 1); 0 = none. Their outputs are summed, so they are lowered
    as one SwiGLU FFN of width S * shared_ffn_hidden."""
    shared_ffn_hidden: int | None = checked(opt_bounded_int(MAX_SIZE), None)
    """Intermediate size f_s of ONE shared expert; None means ffn_hidden. Only with shared_experts."""
    shared_gate: bool = checked(flag, False)
    """Scale the shared experts' output per token by sigmoid(x @ w_gate.T), w_gate [1, h]
    (Qwen2-MoE's shared_expert_gate). Only with shared_experts."""
    qkv_bias: bool = checked(flag, False)
    """The q, k, v projections carry biases (Qwen2-MoE)."""
    qk_norm: bool = checked(flag, False)
    """RMSNorm of q and k over their whole projection width (H*d and G*d) before RoPE (OLMoE).
    Not the per-head norm of Hunyuan-Large or Qwen3-MoE (a weight of head_dim shared by heads)."""
    normalize_topk: bool = checked(flag, True)
    """Renormalise the k routing weights to sum to 1 (Mixtral); false keeps the softmax
    probabilities as they are (transformers' norm_topk_prob=False: Qwen2-MoE, OLMoE, DeepSeekMoE)."""
    # DeepSeek-V3: multi-head latent attention (all five set, or none: plain GQA attention)
    q_lora_rank: int | None = checked(opt_bounded_int(MAX_SIZE), None)
    """MLA: rank r_q of the low-rank q projection (q_a [r_q, h], RMSNorm, q_b); None projects q
    directly (DeepSeek-V2-Lite). Only with kv_lora_rank."""
    kv_lora_rank: int | None = checked(opt_bounded_int(MAX_SIZE), None)
    """MLA: rank r_kv of the compressed kv latent (kv_a [r_kv + dr, h], RMSNorm, kv_b); set, the
    layer's attention is MLA (kv_heads must equal heads; head_dim is dn + dr)."""
    qk_nope_head_dim: int | None = checked(opt_bounded_int(MAX_SIZE), None)
    """MLA: per-head q/k dims without RoPE (dn)."""
    qk_rope_head_dim: int | None = checked(opt_bounded_int(MAX_SIZE), None)
    """MLA: per-head q/k dims with RoPE (dr, even); k's are one per token, shared by every head."""
    v_head_dim: int | None = checked(opt_bounded_int(MAX_SIZE), None)
    """MLA: per-head value dim (dv)."""
    # DeepSeek-V3's router
    router_scoring: Literal["softmax", "sigmoid"] = checked(one_of("softmax", "sigmoid"), "softmax")
    """'softmax' (Mixtral and most) or 'sigmoid' (DeepSeek-V3: per-expert sigmoid scores)."""
    n_group: int = checked(bounded_int(MAX_COUNT), 1)
    """Sigmoid scoring: equal expert groups; a token's experts come from its topk_group best groups
    (a group ranked by the sum of its two best scores). 1 = no grouping."""
    topk_group: int = checked(bounded_int(MAX_COUNT), 1)
    """Sigmoid scoring: groups a token may use."""
    routed_scaling_factor: float = checked(pos_float, 1.0)
    """Sigmoid scoring: the routed experts' weights are multiplied by it (DeepSeek-V3: 2.5)."""
    score_correction_bias: bool = checked(flag, False)
    """Sigmoid scoring: a per-expert bias buffer [E] added to the scores for the choice only
    (DeepSeek-V3's auxiliary-loss-free balancing; not trained by backprop)."""
    router_aux_loss_coef: float = checked(nonneg_float, 0.0)
    """transformers' router_aux_loss_coef: a model step (``compile``/``tune --layers L`` >= 2, with
    the edges) adds coef times the router's load-balancing loss to the loss, as
    output_router_logits=True does (moegraph.edges.AuxLoss; Mixtral 0.02, OLMoE 0.01, Qwen2-MoE
    0.001); 0 (the default) adds none. Softmax routers only."""
    # dense first layers
    first_k_dense_replace: int = checked(count_or_zero(MAX_COUNT), 0)
    """The first this many layers have a dense SwiGLU MLP of width dense_ffn_hidden instead of the
    MoE block (DeepSeek-V3: 3). ``trace``/``compile``/``tune`` lower an MoE layer."""
    dense_ffn_hidden: int | None = checked(opt_bounded_int(MAX_SIZE), None)
    """Intermediate size of the dense layers' MLP (DeepSeek-V3: 18432). Only with first_k_dense_replace."""
    hf_config: str | None = checked(opt_text, None)
    """The Hugging Face config.json this entry was read from (canonical JSON; moegraph.registry.hf):
    ``trace_model`` then lowers the family's own decoder layer (structurally) instead of the
    reference layer, so every part the family has (windows, sinks, biases, q/k norms) is planned.
    The fields above are that layer's sizes."""

    def __post_init__(self):
        validate_fields(self)
        self._check_deepseek_fields()
        if self.router_aux_loss_coef > 0 and self.router_scoring != "softmax":
            raise RegistryError(f"router_aux_loss_coef={self.router_aux_loss_coef}: the load-balancing loss is "
                                f"modelled for softmax routers only (router_scoring={self.router_scoring!r})",
                                field="router_aux_loss_coef")
        if self.heads % self.kv_heads:
            raise RegistryError(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.top_k > self.experts:
            raise RegistryError(f"top_k={self.top_k} exceeds experts={self.experts}")
        if not self.shared_experts:
            unused = [f for f in ("shared_ffn_hidden", "shared_gate") if getattr(self, f) not in (None, False)]
            if unused:
                raise RegistryError(f"{unused[0]}={getattr(self, unused[0])} needs shared_experts > 0 "
                                    f"(shared_experts=0: there is no shared expert)", field=unused[0])
        elif self.shared_ffn_hidden is None:
            object.__setattr__(self, "shared_ffn_hidden", self.ffn_hidden)
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise RegistryError(f"hidden={self.hidden} is not divisible by heads={self.heads}; "
                                    f"set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.layer_param_bytes > MAX_LAYER_PARAM_BYTES:
            raise RegistryError(f"one layer's parameters take {self.layer_param_bytes:,} bytes in fp32 (hidden="
                                f"{self.hidden}, heads={self.heads}, head_dim={self.head_dim}, ffn_hidden="
                                f"{self.ffn_hidden}, experts={self.experts}), over the {MAX_LAYER_PARAM_BYTES:,} "
                                f"bytes (16 TiB) this tool plans for")

    def _check_deepseek_fields(self) -> None:
        mla = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.kv_lora_rank is None:
            given = [f for f in mla if getattr(self, f) is not None]
            if given:
                raise RegistryError(f"{given[0]}={getattr(self, given[0])} needs kv_lora_rank (multi-head latent "
                                    "attention)", field=given[0])
        else:
            missing = [f for f in mla[1:] if getattr(self, f) is None]
            if missing:
                raise RegistryError(f"{missing[0]}: kv_lora_rank={self.kv_lora_rank} (multi-head latent attention) "
                                    f"needs it", field=missing[0])
            if self.qk_rope_head_dim % 2:
                raise RegistryError(f"qk_rope_head_dim={self.qk_rope_head_dim} is odd; RoPE rotates pairs",
                                    field="qk_rope_head_dim")
            if self.kv_heads != self.heads:
                raise RegistryError(f"kv_heads={self.kv_heads} must equal heads={self.heads} with kv_lora_rank "
                                    "(MLA expands one k and v per head)", field="kv_heads")
            for f in ("qkv_bias", "qk_norm"):
                if getattr(self, f):
                    raise RegistryError(f"{f}=true is not modelled with kv_lora_rank (multi-head latent attention)",
                                        field=f)
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.head_dim not in (None, qk):
                raise RegistryError(f"head_dim={self.head_dim} differs from qk_nope_head_dim + qk_rope_head_dim = "
                                    f"{qk}, the MLA q/k head dim", field="head_dim")
            object.__setattr__(self, "head_dim", qk)
        if self.router_scoring == "softmax":
            for f, default in (("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 1.0),
                               ("score_correction_bias", False)):
                if getattr(self, f) != default:
                    raise RegistryError(f"{f}={getattr(self, f)} needs router_scoring: sigmoid (modelled for "
                                        "DeepSeek-V3's router only)", field=f)
        else:
            if self.experts % self.n_group or self.experts // self.n_group < 2:
                raise RegistryError(f"n_group={self.n_group} must split experts={self.experts} into equal groups "
                                    "of at least 2 (a group ranks by its two best scores)", field="n_group")
            if self.topk_group > self.n_group:
                raise RegistryError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}", field="topk_group")
            if self.top_k > self.topk_group * (self.experts // self.n_group):
                raise RegistryError(f"top_k={self.top_k} exceeds the experts of topk_group={self.topk_group} groups",
                                    field="top_k")
        if (self.first_k_dense_replace > 0) != (self.dense_ffn_hidden is not None):
            f = "dense_ffn_hidden" if self.dense_ffn_hidden is not None else "first_k_dense_replace"
            raise RegistryError(f"{f}={getattr(self, f)}: first_k_dense_replace and dense_ffn_hidden go together "
                                "(dense first layers and their MLP width)", field=f)
        if self.first_k_dense_replace >= self.layers:
            raise RegistryError(f"first_k_dense_replace={self.first_k_dense_replace} leaves no MoE layer of "
                                f"layers={self.layers}", field="first_k_dense_replace")

    @property
    def moe_layers(self) -> int:
        """Layers with the MoE block: all but the first_k_dense_replace dense ones. A traced stack
        of identical layers holds at most this many (the dense layers are another graph)."""
        return self.layers - self.first_k_dense_replace

    @property
    def all_layers(self) -> int:
        """The stack ``layers='all'`` means: every decoder layer of a Hugging Face config (its layer
        kinds mixed, dense first layers included: ``moegraph.registry.hf.hf_stack``); a registry
        model's MoE layers (``moe_layers``: its dense layers are another graph)."""
        return self.layers if self.hf_config is not None else self.moe_layers

    @property
    def hf_vocab(self) -> int | None:
        """The vocab_size of the Hugging Face config this entry was read from (its text config's for
        a multimodal family), or None: the registry's own entries carry no vocabulary."""
        if self.hf_config is None:
            return None
        import json
        data = json.loads(self.hf_config)
        vocab = data.get("vocab_size", (data.get("text_config") or {}).get("vocab_size"))
        return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None

    def stackable(self, layers: int) -> bool:
        """Whether a stack of ``layers`` fits the model: 1 to ``moe_layers`` (from the first MoE
        layer on), or ``all_layers``."""
        return 1 <= layers <= self.moe_layers or layers == self.all_layers

    def layers_phrase(self) -> str:
        """'{name}'s N layers', or '... N MoE layers (K dense first layers lower to another graph)'."""
        if self.hf_config is not None and self.first_k_dense_replace:
            return (f"{self.name}'s {self.moe_layers} layers from its first MoE layer on, or all its "
                    f"{self.layers} layers")
        if not self.first_k_dense_replace:
            return f"{self.name}'s {self.layers} layers"
        return (f"{self.name}'s {self.moe_layers} MoE layers (its first_k_dense_replace={self.first_k_dense_replace} "
                "dense layers lower to another graph)")

    @property
    def shared_ffn_total(self) -> int:
        """Width S * f_s of the one SwiGLU FFN the shared experts amount to; 0 when there are none."""
        return self.shared_experts * (self.shared_ffn_hidden or 0)

    @property
    def layer_param_bytes(self) -> int:
        """Bytes of one MoE layer's parameters in fp32: attention (q, k, v, o, biases, q/k norms; or
        MLA's projections and latent norms), router (and its score bias buffer), routed and shared
        experts (and their gate), the two layer norms."""
        h, d, H, G = self.hidden, self.head_dim, self.heads, self.kv_heads
        if self.kv_lora_rank is None:
            attention = 2 * h * H * d + 2 * h * G * d
            attention += (H + 2 * G) * d * self.qkv_bias + (H + G) * d * self.qk_norm
        else:
            rq, rkv, dr, dv = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim
            q = H * d * h if rq is None else rq * h + rq + H * d * rq
            attention = q + (rkv + dr) * h + rkv + H * (self.qk_nope_head_dim + dv) * rkv + h * H * dv
        shared = 3 * self.shared_ffn_total * h + h * self.shared_gate
        router = self.experts * h + self.experts * self.score_correction_bias
        return 4 * (attention + router + 3 * self.experts * self.ffn_hidden * h + shared + 2 * h)

    @property
    def m(self) -> float:
        """q/kv head ratio m (a float, as ``ir.Dims.m``; exact since kv_heads divides heads)."""
        return self.heads / self.kv_heads

    @property
    def f(self) -> float:
        """h_ffn / h."""
        return self.ffn_hidden / self.hidden


# --- hardware ------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Hardware(_Record):
    """One GPU (or CPU) type as the cost model sees it. Bandwidths are per GPU, per direction."""

    name: str = checked(text)
    """Registry name."""
    description: str = checked(text)
    """Free text: what the numbers describe and where they come from."""
    peak_flops_bf16: float = checked(pos_float)
    """Dense bf16 tensor-core peak, FLOP/s (no sparsity)."""
    hbm_bw_bytes_s: float = checked(pos_float)
    """Device-memory bandwidth, bytes/s."""
    hbm_capacity_bytes: int = checked(pos_int)
    """Device-memory capacity, bytes (1 GB = 1e9 B as datasheets quote it)."""
    sm_count: int = checked(pos_int)
    """Streaming multiprocessors; compute slows by sm_count/(sm_count - SMs held by comm)."""
    nvlink_bw_bytes_s: float = checked(pos_float)
    """Intra-node link bandwidth, UNIDIRECTIONAL, per GPU, bytes/s (MoNTA Table 5 convention;
    MegaScale-MoE Table 4 quotes bidirectional totals, twice these numbers)."""
    nic_bw_bytes_s: float = checked(pos_float)
    """Inter-node bandwidth per GPU, per direction, bytes/s."""
    pp_link_bw_bytes_s: float = checked(nonneg_float, 0.0)
    """Bandwidth of the link between pipeline stages (``OpKind.P2P`` sends), per GPU, per direction,
    bytes/s. Stages sit on different nodes (Megatron-Core: expert and tensor parallelism inside the
    NVLink island, pipeline stages across nodes), so each GPU sends over its own NIC; 0 (the
    default, CPU profiles): nic_bw_bytes_s."""
    gpus_per_node: int = checked(pos_int, 8)
    """GPUs sharing one NVLink domain; a collective with group <= this is intra-node by default."""
    intra_node_latency_us: float = checked(nonneg_float)
    """Per-step latency alpha of an intra-node collective (a ring of n pays (n-1) steps)."""
    inter_node_latency_us: float = checked(nonneg_float)
    """Per-step latency alpha of an inter-node collective."""
    kernel_latency_us: float = checked(nonneg_float)
    """Fixed launch/tail cost charged to every node (except views), so ever finer chunking
    eventually stops paying off."""
    copy_engine_latency_us: float = checked(nonneg_float)
    """Extra fixed cost of a collective driven by copy engines (SM budget 0): one DMA
    descriptor per peer plus a host-visible sync instead of one fused kernel."""
    gemm_eff: float = checked(fraction, 0.75)
    """Fraction of peak reached by dense GEMMs (also the router). Default: typical large bf16
    cuBLAS GEMMs on Hopper reach 70-80% of dense peak."""
    grouped_gemm_eff: float = checked(fraction, 0.65)
    """Fraction of peak reached by grouped (per-expert) GEMMs: smaller, ragged problems
    (MegaScale-MoE §7 on GroupedGEMM overheads); default 0.65."""
    attention_eff: float = checked(fraction, 0.55)
    """Fraction of peak reached by fused causal attention (FlashAttention-2-class kernels on
    Hopper reach roughly half of peak); default 0.55."""
    mem_eff: float = checked(fraction, 0.8)
    """Fraction of HBM bandwidth reached by memory-bound kernels; default 0.8 (MoNTA Table 8:
    D2D copy at 80%)."""
    mem_op_traffic: tuple[tuple[str, float], ...] = checked(mem_traffic, ())
    """Optional, memory-bound op kind (an OpKind value), or "kind.role", -> factor: the HBM traffic of the kernel that runs that
    op per byte the IR counts (node.mem_bytes), relative to the streaming kernel the mem_eff curve
    is fitted on (ADD). It multiplies the memory term of that op's nodes: the node's "kind.role"
    entry, else "kind" (its roles pooled), else "other" (calibrate: the measured ops' pooled
    factor), else 1.
    The runtime runs some ops as several eager torch kernels that re-read their rows (on the H200,
    2026-11-27: RMSNORM at ~13x ADD's time per IR byte, SWIGLU ~1.7x), which one mem_eff curve
    cannot price beside ADD. Fitted by ``moegraph calibrate`` on the ops it measures; empty (every
    datasheet profile): fused kernels, as production frameworks run these ops."""
    # Collective efficiencies, one per pattern and link: an all-to-all inside an NVSwitch node
    # and one across NICs are bottlenecked by different hardware, so one number measured on one
    # of them misprices the other. Required (no defaults): every entry names its source beside it.
    ring_eff_intra: float = checked(fraction)
    """Bus-bandwidth fraction of NVLink ring collectives (all-gather, reduce-scatter, all-reduce)
    inside a node (scope "intra")."""
    ring_eff_inter: float = checked(fraction)
    """Bus-bandwidth fraction of ring collectives across nodes (scope "inter", NIC-bound)."""
    a2a_eff_intra: float = checked(fraction)
    """Bandwidth fraction of all-to-all inside a node (scope "intra", NVLink/NVSwitch)."""
    a2a_eff_inter: float = checked(fraction)
    """Bandwidth fraction of all-to-all across nodes (scope "inter", NIC-bound)."""
    copy_engine_eff: float = checked(fraction_or_zero, 0.6)
    """Link-bandwidth fraction a copy-engine collective reaches; 0 = no copy-engine path.
    Default 0.6: assumed below SM-driven rings, so that giving a collective copy engines trades
    bandwidth for leaving every SM to compute (the choice MegaScale-MoE §4.2 makes by hand)."""
    fused_tile_overhead_us: float = checked(nonneg_float, 0.5)
    """Extra time per tile of a fused comm+compute kernel (moegraph.cost, "Fused tile-level
    variants"): the device-memory flag a tile waits on or raises and its smaller GEMM tile wave.
    Default 0.5 us: assumed (MegaScale-MoE §4.2 gives no number); one tile per rank."""
    # Shape and size effects (moegraph.efficiency; docs/cost_model.md "Shapes"). Each default
    # models no effect, so a profile written before they existed prices as it did.
    gemm_tiles: tuple[tuple[int, int, float], ...] = checked(gemm_tiles, ())
    """GEMM tiles [tile_m, tile_n, relative efficiency] the library picks from (tile and wave
    quantization over sm_count); () = no tile model. gemm_eff is then the efficiency of a large,
    well-tiled GEMM, and each shape runs at gemm_eff times its factor."""
    gemm_wave_exponent: float = checked(fraction_or_zero, 0.0)
    """gamma: the wave-quantization factor is raised to it (0 = hidden by the library's split-K /
    stream-K kernels, 1 = the raw ceil(tiles/SMs) effect)."""
    gemm_k_half: float = checked(nonneg_float, 0.0)
    """k_half: a GEMM of reduction length k runs at k/(k + k_half) of its tile efficiency (each
    output tile's prologue and epilogue); 0 = no small-K penalty."""
    attention_seq_half: float = checked(nonneg_float, 0.0)
    """s_half: causal attention over s tokens runs at s/(s + s_half) of attention_eff; 0 = no
    sequence-length effect (then an attention node needs no ``seq`` attribute)."""
    attention_head_dim_eff: tuple[tuple[int, float], ...] = checked(head_dim_effs, ())
    """[[head dim, relative efficiency], ...], linear in log2(d) between points, clamped; () = 1."""
    attention_bwd_factor: float = checked(fraction, 1.0)
    """The attention backward's efficiency relative to the forward's (flash backward kernels
    recompute and write dq, dk, dv); 1 = the same."""
    ring_half_bytes_intra: float = checked(nonneg_float, 0.0)
    """Ring collectives inside a node reach ring_eff_intra * b/(b + this) at b bytes sent; 0 = flat."""
    ring_half_bytes_inter: float = checked(nonneg_float, 0.0)
    """As ring_half_bytes_intra, across nodes."""
    a2a_half_bytes_intra: float = checked(nonneg_float, 0.0)
    """All-to-all inside a node reaches a2a_eff_intra * b/(b + this) at b bytes sent; 0 = flat."""
    a2a_half_bytes_inter: float = checked(nonneg_float, 0.0)
    """As a2a_half_bytes_intra, across nodes."""
    sources: tuple[tuple[str, str], ...] = checked(sources, ())
    """field -> where its value comes from, for the efficiencies, curve parameters and stretches
    (fields.SOURCED_FIELDS); every hardware.yaml entry names all of them."""
    comm_sm_budgets: tuple[int, ...] = checked(sm_budgets)
    """SM counts a collective may be given, strictly increasing; 0 = copy engines (only if
    copy_engine_eff > 0). Each must leave SMs for compute (< sm_count)."""
    comm_sm_saturation: int = checked(pos_int)
    """SMs at which a ring collective reaches full bandwidth (about 16 on Hopper NVLink)."""
    a2a_sm_saturation: int = checked(pos_int)
    """SMs at which all-to-all reaches full bandwidth (more than a ring: n-1 peers at once)."""
    comm_overlap_stretch: float = checked(stretch, 1.0)
    """Factor (in [1, 10]) by which a collective runs longer while compute runs beside it
    (the two share memory bandwidth, and on CPU the cores). 1 = no stretch (the registry's GPU
    profiles: fitted to MoNTA Fig 14, see their sources); ``moegraph calibrate`` measures it
    where it can run collectives.
    The scheduler gives each collective two modes when it is > 1: alone (no compute may
    overlap it) at the plain time, or beside compute at this factor times it."""
    comm_hbm_traffic: float = checked(nonneg_float, 0.0)
    """HBM bytes a collective moves per byte it sends (it reads what it sends and writes what it
    receives: 2). Compute beside collectives that hold b SMs then has the HBM bandwidth those
    collectives leave (``CostModel.beside_comm_us``): its FLOP term slows by S/(S-b), its memory
    term by W/(W - traffic * link rate). 0 = not modelled: the whole node slows by S/(S-b)
    (calibrated CPU profiles, where b counts cores)."""
    chunk_stall_us: float = checked(nonneg_float, 0.0)
    """Fixed time each collective of a chunked decomposition (node attr ``chunk``) pays beyond
    its time alone: the stall MoNTA (Guo et al. 2024, "Dissussions") measures when chunks of
    small volume run beside each other's kernels (all-gather / copy scheduling, the first chunk
    waiting on the other node's host). 0 = not modelled (every profile without a chunked-pipeline
    measurement: the calibrated CPU ones price chunks as before)."""
    step_noise: float = checked(fraction_or_zero, 0.0)
    """Step-to-step noise of real steps on this machine: the relative median absolute deviation
    of measured step times (``moegraph calibrate``'s in-step stage); 0 = not measured. ``moegraph
    tune`` keeps the tp+tp sequential baseline unless a candidate's predicted gain exceeds it:
    smaller gains cannot be confirmed by measuring on this machine."""
    link_bit_s: float = checked(nonneg_float, 0.0)
    """Rate of the emulated link (``--link``, docs/runtime.md "Emulated link") the profile was
    calibrated under, bits/s; 0 = none (plain loopback, or real hardware). ``moegraph run`` warns
    when it differs from the run's ``--link``: collective prices describe the calibration's link."""
    link_latency_us: float = checked(nonneg_float, 0.0)
    """That link's added one-way delay (``--link-latency``), microseconds; 0 = none."""
    link_burst_bytes: float = checked(nonneg_float, 0.0)
    """That link's token-bucket depth, bytes (runtime/netns.py ``bucket_bytes``): a lone pipeline
    send passes this much at once and the rest at link_bit_s; 0 = none recorded."""
    curves: tuple[tuple[str, Curve], ...] = checked(curves, ())
    """Optional measured efficiency curves, name -> ((size, eff), ...), size in FLOPs for compute
    curves and bytes for memory/comm curves; interpolated linearly in log(size), clamped at the
    ends; a present curve replaces the scalar factor. Names: CURVE_NAMES."""
    in_step_factors: tuple[tuple[str, float], ...] = checked(in_step, ())
    """Optional, op class (IN_STEP_CLASSES) -> factor: how much longer that class's nodes run
    inside a real training step than alone (caches shared with the rest of the step, host
    overhead, collectives absorbing rank skew), measured by ``moegraph calibrate`` from real steps.
    Multiplies a node's time above kernel_latency_us; a missing class counts 1."""
    in_step_stream_bw_bytes_s: float = checked(nonneg_float, 0.0)
    """Optional, bytes/s: the rate at which an expert GEMM (GROUPED_GEMM) streams its expert weights
    inside a real step, once per row segment (node attr ``stream_bytes``). The time is added to
    the node's in-step compute time, so a chunked or all-to-all-fed expert GEMM, which runs one
    GEMM per chunk and segment, pays for every pass over the weights. Fitted by ``moegraph
    calibrate``'s in-step stage; 0 (the default, and every profile written before it existed):
    not modelled, no term."""
    accumulate_bw_bytes_s: float = checked(nonneg_float, 0.0)
    """Optional, bytes/s: the rate at which a weight-gradient kernel that accumulates into a running
    sum (attr accumulate=True: every token chunk's but the last) adds its result to that sum, bytes
    of the sum (node attr ``accumulate_bytes``) per second, as the runtime runs it. Fitted by
    ``moegraph calibrate``'s in-step stage on its chunked layer (ACCUMULATE_LAYER); 0 (the default, and every profile written before
    it existed): not modelled, no term."""
    solo_in_step_factors: tuple[tuple[str, float], ...] = checked(in_step, ())
    """Optional, compute op class -> factor: in_step_factors for a group of one rank (n = 1: a
    pipeline stage, a one-device layer), where no collective runs between a rank's nodes. The
    n-rank factors are fitted on steps in which each collective makes every rank wait for the
    slowest, which the fit spreads over the classes; a lone rank has none of it, and its classes
    differ by more than one scale (on the 2-core VM: GEMMs and memory-bound nodes 25-45% faster than
    their n-rank price, expert GEMMs as priced). Fitted by ``moegraph calibrate``'s in-step stage
    on SOLO_LAYERS at n = 1 on two processes (the way two pipeline stages share a host); empty
    (every GPU profile): not measured. ``for_group(1)`` applies them."""
    solo_in_step_stream_bw_bytes_s: float = checked(nonneg_float, 0.0)
    """in_step_stream_bw_bytes_s fitted with solo_in_step_factors (0: no streaming term at n = 1)."""
    measured: tuple[tuple[str, str], ...] = checked(measured, ())
    """Optional provenance of calibrated numbers: date, machine, notes."""

    def __post_init__(self):
        validate_fields(self)
        budgets = self.comm_sm_budgets
        if 0 in budgets and self.copy_engine_eff == 0:
            raise RegistryError(f"comm_sm_budgets={list(budgets)} contains 0 (copy engines) "
                                f"but copy_engine_eff=0.0")
        if budgets[-1] >= self.sm_count:
            raise RegistryError(f"comm_sm_budgets max {budgets[-1]} leaves no SMs for compute "
                                f"(sm_count={self.sm_count})")
        for sat in ("comm_sm_saturation", "a2a_sm_saturation"):
            if getattr(self, sat) > self.sm_count:
                raise RegistryError(f"{sat}={getattr(self, sat)} exceeds sm_count={self.sm_count}")

    def for_group(self, n: int) -> "Hardware":
        """This profile as it prices a layer whose ranks form groups of ``n``: itself for n > 1 or
        without solo factors; for n = 1 its compute classes' in-step factors and streaming rate
        replaced by the solo ones (the collectives keep theirs: a lone rank's only collectives, the
        data-parallel sync, run as the n-rank steps' do)."""
        if n > 1 or not self.solo_in_step_factors:
            return self
        comm = tuple((c, f) for c, f in self.in_step_factors if c == "comm")
        solo = tuple((c, f) for c, f in self.solo_in_step_factors if c != "comm")
        return dataclasses.replace(self, in_step_factors=tuple(sorted(solo + comm)), solo_in_step_factors=(),
                                   in_step_stream_bw_bytes_s=self.solo_in_step_stream_bw_bytes_s,
                                   solo_in_step_stream_bw_bytes_s=0.0)

    def without_copy_engines(self) -> "Hardware":
        """This profile with its collectives on SMs only: SM budget 0 (copy engines) left out of
        ``comm_sm_budgets``, for a runtime that does not run copy-engine collectives (moegraph's
        on NCCL: docs/runtime.md, "SM budgets"). A profile with budget 0 alone is refused."""
        if 0 not in self.comm_sm_budgets:
            return self
        budgets = tuple(b for b in self.comm_sm_budgets if b > 0)
        if not budgets:
            raise RegistryError(f"hardware {self.name!r} allows only SM budget 0 (copy engines; comm_sm_budgets="
                                f"{list(self.comm_sm_budgets)}): without copy engines no budget is left; give "
                                "the GPUs' profile, or one whose comm_sm_budgets has a budget of 1 SM or more")
        return dataclasses.replace(self, comm_sm_budgets=budgets)

    def without_gemm_shapes(self) -> "Hardware":
        """This profile with no GEMM shape factor (no tiles, no small-K penalty): every GEMM at its
        class efficiency whatever its shape. For kernels the tiles do not describe (fp32 without
        TF32 runs no tensor-core tiles) and for isolating the shape part of a figure."""
        return dataclasses.replace(self, gemm_tiles=(), gemm_k_half=0.0)

    def curve(self, name: str) -> Curve | None:
        """The measured curve ``name`` (one of CURVE_NAMES), or None if not calibrated."""
        if name not in CURVE_NAMES:
            raise ValueError(f"unknown curve {name!r}; valid: {', '.join(CURVE_NAMES)}")
        return dict(self.curves).get(name)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["curves"] = {name: [list(p) for p in pts] for name, pts in self.curves}
        d["in_step_factors"] = dict(self.in_step_factors)
        d["mem_op_traffic"] = dict(self.mem_op_traffic)
        d["solo_in_step_factors"] = dict(self.solo_in_step_factors)
        d["measured"] = dict(self.measured)
        d["sources"] = dict(self.sources)
        d["gemm_tiles"] = [list(t) for t in self.gemm_tiles]
        d["attention_head_dim_eff"] = [list(p) for p in self.attention_head_dim_eff]
        return d

    def mem_traffic(self, op: str, role: str = "forward") -> float:
        """The memory-traffic factor of op kind ``op`` (an OpKind value) in ``role`` (a Role value):
        its "op.role" entry, else "op", else "other", else 1 (not calibrated)."""
        return traffic_factor(dict(self.mem_op_traffic), op, role)

    def in_step_factor(self, op_class: str) -> float:
        """The in-step factor of ``op_class`` (one of IN_STEP_CLASSES); 1 if not calibrated."""
        if op_class not in IN_STEP_CLASSES:
            raise ValueError(f"unknown op class {op_class!r}; valid: {', '.join(IN_STEP_CLASSES)}")
        return dict(self.in_step_factors).get(op_class, 1.0)


