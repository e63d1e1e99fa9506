"""The registry records: ModelConfig (one MoE transformer) and Hardware (one device type).

Frozen dataclasses; every field carries its check (moegraph.registry.fields) and a docstring.
Notation (MegaScale-MoE Table 1): h hidden, m = heads/kv_heads, f = h_ffn/h, E experts, k top-k.
Units: bytes, bytes/s, FLOP/s, microseconds; GB means 1e9 bytes (datasheet convention).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from moegraph.registry.fields import (CURVE_NAMES, IN_STEP_CLASSES, Curve, RegistryError, checked, curves,
                                      fraction, fraction_or_zero, in_step, measured, nonneg_float,
                                      MAX_COUNT, MAX_SIZE, bounded_int, count_or_zero, flag, opt_bounded_int, pos_float, pos_int, sm_budgets, stretch, text,
                                      validate_fields)

__all__ = ["ModelConfig", "Hardware", "MAX_LAYER_PARAM_BYTES"]

# One layer's parameters (fp32) may take at most 16 TiB: about 770 times the largest registry
# layer (hunyuan-large), and small enough that every size the planner multiplies stays in int64.
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
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


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

    def __post_init__(self):
        validate_fields(self)
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

    @property
    def shared_ffn_total(self) -> int:
        """Width S * f_s of the one SwiGLU FFN the shared experts amount to; 0 when there are none."""
        return self.shared_experts * (self.shared_ffn_hidden or 0)

    @property
    def layer_param_bytes(self) -> int:
        """Bytes of one layer's parameters in fp32: attention (q, k, v, o, biases, q/k norms),
        router, routed and shared experts (and their gate), the two layer norms."""
        h, d, H, G = self.hidden, self.head_dim, self.heads, self.kv_heads
        attention = 2 * h * H * d + 2 * h * G * d
        attention += (H + 2 * G) * d * self.qkv_bias + (H + G) * d * self.qk_norm
        shared = 3 * self.shared_ffn_total * h + h * self.shared_gate
        return 4 * (attention + self.experts * h + 3 * self.experts * self.ffn_hidden * h + shared + 2 * h)

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
    ring_eff: float = checked(fraction, 0.726)
    """Bus-bandwidth fraction of ring all-gather/reduce-scatter; default 0.726 (MoNTA Table 8,
    per-chunk AllGather)."""
    a2a_eff: float = checked(fraction, 0.427)
    """Bandwidth fraction of all-to-all; default 0.427 (MoNTA Table 8, per-chunk AllToAll)."""
    copy_engine_eff: float = checked(fraction_or_zero, 0.6)
    """Link-bandwidth fraction a copy-engine collective reaches; 0 = no copy-engine path.
    Default 0.6: assumed below SM-driven rings, so that giving a collective copy engines trades
    bandwidth for leaving every SM to compute (the choice MegaScale-MoE §4.2 makes by hand)."""
    comm_sm_budgets: tuple[int, ...] = checked(sm_budgets)
    """SM counts a collective may be given, strictly increasing; 0 = copy engines (only if
    copy_engine_eff > 0). Each must leave SMs for compute (< sm_count)."""
    comm_sm_saturation: int = checked(pos_int)
    """SMs at which a ring collective reaches full bandwidth (about 16 on Hopper NVLink)."""
    a2a_sm_saturation: int = checked(pos_int)
    """SMs at which all-to-all reaches full bandwidth (more than a ring: n-1 peers at once)."""
    comm_overlap_stretch: float = checked(stretch, 1.0)
    """Factor (in [1, 10]) by which a collective runs longer while compute runs beside it
    (the two share memory bandwidth, and on CPU the cores). 1 = not modelled (the registry's
    GPU profiles: unmeasured); ``moegraph calibrate`` measures it where it can run collectives.
    The scheduler gives each collective two modes when it is > 1: alone (no compute may
    overlap it) at the plain time, or beside compute at this factor times it."""
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
    curves: tuple[tuple[str, Curve], ...] = checked(curves, ())
    """Optional measured efficiency curves, name -> ((size, eff), ...), size in FLOPs for compute
    curves and bytes for memory/comm curves; interpolated linearly in log(size), clamped at the
    ends; a present curve replaces the scalar factor. Names: CURVE_NAMES."""
    in_step_factors: tuple[tuple[str, float], ...] = checked(in_step, ())
    """Optional, op class (IN_STEP_CLASSES) -> factor: how much longer that class's nodes run
    inside a real training step than alone (caches shared with the rest of the step, host
    overhead, collectives absorbing rank skew), measured by ``moegraph calibrate`` from real steps.
    Multiplies a node's time above kernel_latency_us; a missing class counts 1."""
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

    def curve(self, name: str) -> Curve | None:
        """The measured curve ``name`` (one of CURVE_NAMES), or None if not calibrated."""
        if name not in CURVE_NAMES:
            raise ValueError(f"unknown curve {name!r}; valid: {', '.join(CURVE_NAMES)}")
        return dict(self.curves).get(name)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["curves"] = {name: [list(p) for p in pts] for name, pts in self.curves}
        d["in_step_factors"] = dict(self.in_step_factors)
        d["measured"] = dict(self.measured)
        return d

    def in_step_factor(self, op_class: str) -> float:
        """The in-step factor of ``op_class`` (one of IN_STEP_CLASSES); 1 if not calibrated."""
        if op_class not in IN_STEP_CLASSES:
            raise ValueError(f"unknown op class {op_class!r}; valid: {', '.join(IN_STEP_CLASSES)}")
        return dict(self.in_step_factors).get(op_class, 1.0)


