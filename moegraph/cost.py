"""Analytical cost model: one IR node -> microseconds on one Hardware profile.

Notation (MegaScale-MoE Table 1): n group size; B link bandwidth (bytes/s, unidirectional);
alpha per-step latency; P peak FLOP/s; W HBM bytes/s. docs/cost_model.md sets each formula
next to the paper's equations.

Compute (every op but SPLIT, which is a view and costs nothing):
    t = kernel_latency + max(flops / (P * eff_op), mem_bytes / (W * mem_eff))
    eff_op: GEMM, ROUTER -> gemm_eff; GROUPED_GEMM -> grouped_gemm_eff; ATTENTION -> attention_eff;
    memory-bound ops (norms, rope, swiglu, permutes, gates, add, bias, cast, index map, square sums) -> 1, because
    their few FLOPs never bind: the mem_bytes term decides.
Collectives (comm_bytes already holds what this rank sends, see ``moegraph.ir.collective_bytes``):
    all-gather, reduce-scatter: t = kernel_latency + (n-1)*alpha  + bytes / (B * ring_eff * s(sm))
    all-to-all:                 t = kernel_latency + (n-1)*alpha  + bytes / (B * a2a_eff  * s_a2a(sm))
    all-reduce (RS + AG):       t = kernel_latency + 2(n-1)*alpha + bytes / (B * ring_eff * s(sm))
    s(sm) = min(1, sm / comm_sm_saturation), s_a2a(sm) = min(1, sm / a2a_sm_saturation) for sm > 0;
    s(0) = copy_engine_eff / ring_eff (copy engines reach B * copy_engine_eff on a ring pattern,
    all-to-all keeps its relative penalty) and sm = 0 adds copy_engine_latency.
    B, alpha = NVLink and intra-node latency for scope "intra", NIC and inter-node latency for
    "inter"; scope comes from node attr "scope", else intra iff n <= gpus_per_node.
A collective holding `sm` SMs slows compute running beside it by sm_count / (sm_count - sm)
(``compute_slowdown``), and the collective itself stretches by hw.comm_overlap_stretch while
compute runs beside it; the scheduler applies both factors, this module prices nodes alone.
A measured curve in ``hw.curves`` replaces the matching scalar efficiency, evaluated at the
node's size: FLOPs for compute curves, mem_bytes for mem_eff, comm_bytes for comm curves.
In-step factors (``hw.in_step_factors``, measured from real steps by `moegraph calibrate`)
multiply everything above kernel_latency by the node's op class factor (``op_class``).
"""

from __future__ import annotations

import bisect
import math

from moegraph.ir import Node, OpKind, collective_bytes  # noqa: F401  (re-exported: calibration prices with it)
from moegraph.registry import Curve, Hardware

__all__ = ["CostModel", "collective_bytes", "interpolate", "op_class"]

_US = 1e6  # seconds -> microseconds


def interpolate(points: Curve, size: float) -> float:
    """Piecewise-linear in log(size) through sorted (size, eff) points, clamped at both ends."""
    sizes = [s for s, _ in points]
    if size <= sizes[0]:
        return points[0][1]
    if size >= sizes[-1]:
        return points[-1][1]
    i = bisect.bisect_right(sizes, size)
    (s0, e0), (s1, e1) = points[i - 1], points[i]
    w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return e0 + w * (e1 - e0)


def op_class(node: Node) -> str:
    """The node's class for in-step factors (moegraph.registry.IN_STEP_CLASSES)."""
    match node.op:
        case OpKind.GEMM | OpKind.ROUTER:
            return "gemm"
        case OpKind.GROUPED_GEMM:
            return "grouped_gemm"
        case OpKind.ATTENTION:
            return "attention"
        case (OpKind.RMSNORM | OpKind.ROPE | OpKind.SWIGLU | OpKind.PERMUTE | OpKind.UNPERMUTE
              | OpKind.GATE | OpKind.ADD | OpKind.CAST | OpKind.INDEX_MAP | OpKind.SPLIT
              | OpKind.BIAS | OpKind.SIGMOID_GATE | OpKind.SQUARE_SUM | OpKind.RMSNORM_SHARDED | OpKind.MLA_HEADS):
            return "memory"
        case OpKind.ALL_GATHER | OpKind.REDUCE_SCATTER | OpKind.ALL_TO_ALL | OpKind.ALL_REDUCE:
            return "comm"
    raise NotImplementedError(f"no cost rule for {node.op}")


# compute op class -> the efficiency that prices it (None: memory-bound, the mem_bytes term decides)
_CLASS_EFF = {"gemm": "gemm_eff", "grouped_gemm": "grouped_gemm_eff", "attention": "attention_eff", "memory": None}


class CostModel:
    """Prices IR nodes on ``hw``. Pure: the same node and budget always give the same time."""

    def __init__(self, hw: Hardware):
        self.hw = hw

    def sm_count(self) -> int:
        return self.hw.sm_count

    def node_time_us(self, node: Node, sm_budget: int | None = None) -> float:
        """Time of ``node`` alone. sm_budget applies to collectives only (None -> default);
        compute nodes ignore it."""
        if node.op is OpKind.SPLIT:
            return 0.0  # a view into a fused tensor: no kernel runs
        cls = op_class(node)
        if cls == "comm":
            budget = self.default_sm_budget(node) if sm_budget is None else sm_budget
            return self._comm_us(node, budget)
        return self._compute_us(node, cls)

    def comm_sm_budgets(self, node: Node) -> tuple[int, ...]:
        """SM counts this collective may hold (0 = copy engines)."""
        self._require_comm(node)
        return self.hw.comm_sm_budgets

    def default_sm_budget(self, node: Node) -> int:
        """The smallest allowed budget that saturates the link (what NCCL would roughly use);
        the largest allowed one if none does."""
        saturation = self._collective(node.op)[2]
        budgets = self.comm_sm_budgets(node)
        return next((b for b in budgets if b >= saturation), budgets[-1])

    def best_time_us(self, node: Node) -> float:
        """Fastest time over the allowed budgets (compute: its only time). For lower bounds."""
        if not node.op.is_comm:
            return self.node_time_us(node)
        return min(self.node_time_us(node, b) for b in self.comm_sm_budgets(node))

    def compute_slowdown(self, sms_held_by_comm: int) -> float:
        """Factor (>= 1) by which compute stretches while collectives hold this many SMs:
        compute keeps sm_count - held SMs and its throughput scales with them."""
        held, total = sms_held_by_comm, self.hw.sm_count
        if held < 0:
            raise ValueError(f"sms_held_by_comm={held} must be >= 0")
        if held >= total:
            raise ValueError(f"sms_held_by_comm={held} leaves no SMs for compute (sm_count={total})")
        return total / (total - held)

    def comm_overlap_stretch(self) -> float:
        """Factor (>= 1) by which a collective stretches while compute runs beside it; node_time_us
        prices it alone, the scheduler applies this factor to the overlapped mode."""
        return self.hw.comm_overlap_stretch

    # --- internals --------------------------------------------------------------------------

    def _eff(self, curve_name: str, size: float, scalar: float) -> float:
        points = self.hw.curve(curve_name)
        return scalar if points is None else interpolate(points, size)

    def _compute_us(self, node: Node, cls: str) -> float:
        hw, eff_name = self.hw, _CLASS_EFF[cls]
        flops_s = 0.0
        if node.flops:
            eff = 1.0 if eff_name is None else self._eff(eff_name, node.flops, getattr(hw, eff_name))
            flops_s = node.flops / (hw.peak_flops_bf16 * eff)
        mem_s = 0.0
        if node.mem_bytes:
            mem_s = node.mem_bytes / (hw.hbm_bw_bytes_s * self._eff("mem_eff", node.mem_bytes, hw.mem_eff))
        return hw.kernel_latency_us + max(flops_s, mem_s) * _US * hw.in_step_factor(cls)

    def _collective(self, op: OpKind) -> tuple[int, float, int, tuple[str, ...]]:
        """(latency steps per (n-1), scalar efficiency, SM saturation, curve names in priority)."""
        hw = self.hw
        match op:
            case OpKind.ALL_GATHER | OpKind.REDUCE_SCATTER:
                return 1, hw.ring_eff, hw.comm_sm_saturation, ("ring_eff",)
            case OpKind.ALL_TO_ALL:
                return 1, hw.a2a_eff, hw.a2a_sm_saturation, ("a2a_eff",)
            case OpKind.ALL_REDUCE:
                return 2, hw.ring_eff, hw.comm_sm_saturation, ("all_reduce_eff", "ring_eff")
        raise NotImplementedError(f"no cost rule for {op}")

    def _link(self, node: Node) -> tuple[float, float]:
        """(bandwidth bytes/s, per-step latency us) for the node's scope."""
        hw = self.hw
        scope = node.attr("scope", "intra" if node.group <= hw.gpus_per_node else "inter")
        if scope == "intra":
            return hw.nvlink_bw_bytes_s, hw.intra_node_latency_us
        if scope == "inter":
            return hw.nic_bw_bytes_s, hw.inter_node_latency_us
        raise ValueError(f"node {node.name!r}: scope {scope!r} is not one of 'intra', 'inter'")

    def _comm_us(self, node: Node, sm: int) -> float:
        hw = self.hw
        budgets = self.comm_sm_budgets(node)
        if sm not in budgets:
            raise ValueError(f"sm_budget={sm} is not allowed for {node.name!r} ({node.op.value}) "
                             f"on {hw.name}; allowed: {', '.join(map(str, budgets))}")
        steps, eff, saturation, curve_names = self._collective(node.op)
        for name in curve_names:
            points = hw.curve(name)
            if points is not None:
                eff = interpolate(points, node.comm_bytes)
                break
        bandwidth, alpha = self._link(node)
        latency = steps * (node.group - 1) * alpha
        if sm == 0:
            scale = hw.copy_engine_eff / hw.ring_eff
            latency += hw.copy_engine_latency_us
        else:
            scale = min(1.0, sm / saturation)
        wire = latency + node.comm_bytes / (bandwidth * eff * scale) * _US
        return hw.kernel_latency_us + wire * hw.in_step_factor("comm")

    def _require_comm(self, node: Node) -> None:
        if not node.op.is_comm:
            raise ValueError(f"node {node.name!r} ({node.op.value}) is not a collective; "
                             f"SM budgets apply to collectives only")
