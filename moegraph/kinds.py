"""The IR's enumerations (op kinds, phases, roles, value kinds, expert rows) and its error type.

Split from ``moegraph.ir`` so that the per-op attribute records (``moegraph.node_attrs``), which the
IR's verifier reads, can name op kinds without importing the IR; ``moegraph.ir`` re-exports every
name here.
"""

from __future__ import annotations

import enum
import typing
from typing import Any, Literal


class OpKind(enum.Enum):
    # compute
    GEMM = "gemm"
    GROUPED_GEMM = "grouped_gemm"
    ATTENTION = "attention"
    RMSNORM = "rmsnorm"
    ROPE = "rope"
    SWIGLU = "swiglu"            # silu(a) * b (attr row_weights: times each row's routing weight, gate-reorder)
    ROUTER = "router"            # logits -> softmax or sigmoid (+ selection bias, groups) -> top-k -> renormalise, scale
    INDEX_MAP = "index_map"      # routing -> row mapping, computed once per step (paper §3.2)
    PERMUTE = "permute"          # scatter by index map: token rows -> expert-ordered rows
    UNPERMUTE = "unpermute"      # gather by index map: expert rows -> token rows (weighted sum)
    GATE = "gate"                # multiply expert rows by their routing weight (Llama 4's expert input)
    SPLIT = "split"              # views into a fused tensor (q, k, v of qkv)
    ADD = "add"
    BIAS = "bias"                # x + b, b [X] broadcast over the leading dims (q/k/v biases)
    SIGMOID_GATE = "sigmoid_gate"  # x * sigmoid(g), g [..., 1]: the shared expert's gate (Qwen2-MoE)
    SQUARE_SUM = "square_sum"    # x [..., X] -> sum of squares [..., 1] (fp32): a sharded norm's partial
    RMSNORM_SHARDED = "rmsnorm_sharded"  # (x, w, ss) -> x rsqrt(ss/width + eps) w, ss all-reduced (OLMoE q/k norm)
    MLA_HEADS = "mla_heads"      # (q, kv, k_pe) -> per-head query, key, value of latent attention (DeepSeek-V3)
    CAST = "cast"                # precision change for compressed communication
    # structural lowering's ops (moegraph.lowering.structural; kernels in moegraph.family_kernels)
    NORM = "norm"                # LayerNorm, per-head RMSNorm (Qwen3 q/k) or weightless L2 norm (Llama 4 q/k)
    GLU = "glu"                  # act(a) * b: GeGLU, GPT-OSS's clamped SwiGLU, a gated attention output (Laguna)
    SCALE = "scale"              # x * factor, a constant (Granite's residual multiplier)
    GROUPED_BIAS = "grouped_bias"  # expert rows + their expert's bias (GPT-OSS expert biases)
    LIMIT = "limit"              # x bounded by c: clamp to [-c, c] (DBRX's clip_qkv) or c*tanh(x/c) (a logit soft cap)
    GATED_DELTA = "gated_delta"  # Gated DeltaNet's core: conv, decay, chunked delta rule, gated norm (moegraph.delta_kernels)
    # communication
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    ALL_REDUCE = "all_reduce"
    P2P = "p2p"                  # one send/recv between two pipeline stages (group 2: sender, receiver)

    @property
    def is_comm(self) -> bool:
        return self in COMM_OPS


LAYER_ATTR = "layer"
"""Node attribute holding the node's layer index (an int) in a multi-layer graph (``moegraph.layers``)."""

COMM_OPS = frozenset({OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.ALL_TO_ALL, OpKind.ALL_REDUCE, OpKind.P2P})
# memory-bound ops: their few FLOPs never bind, the bytes they move decide (moegraph.cost's class
# "memory"); the structural lowering's elementwise ops (NORM ... LIMIT) included
MEMORY_BOUND_OPS = frozenset({
    OpKind.RMSNORM, OpKind.ROPE, OpKind.SWIGLU, OpKind.PERMUTE, OpKind.UNPERMUTE, OpKind.GATE, OpKind.ADD,
    OpKind.CAST, OpKind.INDEX_MAP, OpKind.SPLIT, OpKind.BIAS, OpKind.SIGMOID_GATE, OpKind.SQUARE_SUM,
    OpKind.RMSNORM_SHARDED, OpKind.MLA_HEADS, OpKind.NORM, OpKind.GLU, OpKind.SCALE, OpKind.GROUPED_BIAS,
    OpKind.LIMIT})


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"      # forward work re-run during backward (moegraph.passes.sar)


class Role(enum.Enum):
    FORWARD = "forward"          # the op itself (also when re-run as recompute)
    DGRAD = "dgrad"              # gradient w.r.t. data inputs
    WGRAD = "wgrad"              # gradient w.r.t. parameters


class ValueKind(enum.Enum):
    ACTIVATION = "activation"    # forward tensors; the ones counted as activation memory
    PARAM = "param"              # this rank's shard of a parameter
    GRAD = "grad"                # gradients of activations (transient, backward only)
    PARAM_GRAD = "param_grad"    # gradients of parameters (persistent buffers)
    ROUTING = "routing"          # routing weights, expert ids, index maps: O(b*s*k), not O(b*s*h)


class GraphError(ValueError):
    """A malformed graph; the message names the offending node or value."""


ExpertRows = Literal["exact", "padded"]
"""Rows of the local index map (ffn='ep', dispatch='ag-rs'; ``moegraph.index_map.build_index_map``):
exactly this rank's R routed rows (R read on the host once per map), or padded to the static worst
case C = T * min(k, E/n), rows R..C-1 zero (dropless; no host read, so the layer can be captured
whole as a CUDA graph). A runtime choice, not a graph property: the graph's routed values keep
their balanced expectation (planning shapes)."""
EXPERT_ROWS: tuple[str, ...] = typing.get_args(ExpertRows)


def check_expert_rows(value: Any) -> ExpertRows:
    """``value`` if it is one of EXPERT_ROWS, else ValueError naming the valid ones."""
    if not isinstance(value, str) or value not in EXPERT_ROWS:
        raise ValueError(f"expert_rows={value!r} is not one of {', '.join(map(repr, EXPERT_ROWS))}")
    return typing.cast(ExpertRows, value)
