"""Analytical cost model: one IR node -> microseconds on one Hardware profile.

Notation (MegaScale-MoE Table 1): n group size; B link bandwidth (bytes/s, unidirectional);
alpha per-step latency; P peak FLOP/s; W HBM bytes/s. docs/cost_model.md sets each formula
next to the paper's equations.

Compute (every op but SPLIT, which is a view and costs nothing):
    t = kernel_latency + max(flops / (P * eff_op), mem_bytes * traffic_op / (W * mem_eff))
    eff_op: GEMM, ROUTER -> gemm_eff; GROUPED_GEMM -> grouped_gemm_eff (times the shape factor, on a
    calibrated curve too); ATTENTION -> attention_eff; memory-bound ops -> 1; traffic_op: hw.mem_traffic.
Collectives (comm_bytes already holds what this rank sends, see ``moegraph.ir.collective_bytes``):
    all-gather, reduce-scatter: t = kernel_latency + (n-1)*alpha  + bytes / (B * ring_eff * s(sm))
    all-to-all:                 t = kernel_latency + (n-1)*alpha  + bytes / (B * a2a_eff  * s_a2a(sm))
    all-reduce (RS + AG):       t = kernel_latency + 2(n-1)*alpha + bytes / (B * ring_eff * s(sm))
    p2p (pipeline stages):      t = kernel_latency + alpha_inter  + bytes / (B_pp * ring_eff_inter * s(sm))
                                B_pp = hw.pp_link_bw_bytes_s (0: the NIC's): stages sit on different nodes;
                                emulated link (hw.link_bit_s > 0): B_pp = link_bit_s / 8, eff 1, bytes less the
                                bucket's depth hw.link_burst_bytes (passed at once): its one token bucket (runtime/
                                netns.py) gives a lone send what n ranks' collectives share; a stage's sends both
                                ways take turns on it (PipelineProblem.shared_link)
    s(sm) = min(1, sm / comm_sm_saturation), s_a2a(sm) = min(1, sm / a2a_sm_saturation) for sm > 0;
    s(0) = min(1, copy_engine_eff / ring_eff) (copy engines reach B * copy_engine_eff on a ring
    pattern, at most a saturated ring's rate on that link; all-to-all keeps its relative penalty)
    and sm = 0 adds copy_engine_latency; a reduce-scatter or
    all-reduce has no sm = 0 (copy engines cannot add; a fused kernel's SMs add for its transfers).
    a collective of a chunked decomposition (node attr "chunk") adds hw.chunk_stall_us: MoNTA (Guo
    et al. 2024) measures chunked all-to-all pipelines losing to one call at small volumes (8K
    tokens on A800) and names per-chunk stalls (kernel scheduling beside the other chunks' kernels,
    host dispatch skew) that no alone-time curve contains; 0 on profiles without such a measurement.
    B, alpha, ring_eff, a2a_eff by scope: NVLink, intra-node latency, ring_eff_intra, a2a_eff_intra
    for "intra"; NIC, inter-node latency, ring_eff_inter, a2a_eff_inter for "inter". Scope comes
    from node attr "scope", else intra iff n <= gpus_per_node (``scope``).
Interference, both directions (``beside_comm_us``, docs/cost_model.md "Interference"): compute
beside collectives that hold `sm` SMs runs its FLOP term on the SMs left, x S/(S - sm)
(``compute_slowdown``), and its memory term on the HBM bandwidth left, x W'/(W' - c * R)
(``hbm_slowdown``: W' = W * mem_eff, c = comm_hbm_traffic, R the NVLink rate those SMs reach);
the collective itself stretches by hw.comm_overlap_stretch while compute runs beside it. The
scheduler applies these factors; node_time_us prices nodes alone.
A measured curve in ``hw.curves`` replaces the scalar efficiency, at the node's FLOPs, mem_bytes
or comm_bytes. In-step factors (``hw.in_step_factors``, from real steps by `moegraph calibrate`)
multiply everything above kernel_latency by the node's op class factor (``op_class``).
In-step weight streaming: an expert GEMM (GROUPED_GEMM) runs one GEMM per row segment (per
local expert, and per source rank when all-to-all fed it; again for every chunk), and inside a
step each of them reads that expert's weights (dgrad, forward) or writes its weight gradient
(wgrad) from memory the rest of the step has evicted from cache. Where the profile has a rate
W_s = ``hw.in_step_stream_bw_bytes_s`` > 0 the node adds
    t_stream = stream_bytes / W_s          (node attr "stream_bytes", moegraph/lowering/blocks.py)
after the in-step factor; W_s = 0 (datasheet GPU profiles, older CPU profiles): no term.
Gradient accumulation: a weight-gradient kernel with attr accumulate=True (each token chunk's
but the last, moegraph.autodiff) adds its result to the running sum in a separate pass over a
fresh weight-sized tensor (``kernels.run_compute``); where W_a = ``hw.accumulate_bw_bytes_s`` > 0
the node adds t_acc = accumulate_bytes / W_a (attr "accumulate_bytes"); W_a = 0: no term.
A fused group prices its members without either in-step term (``in_step_terms=False``): its kernel
reads each expert's weights once and accumulates in its epilogue, not in a separate pass.

Fused tile-level variants (MegaScale-MoE §4.2, Fig 10; the `fuse` pass marks them): a group of
one collective and the compute chain it feeds (or that feeds it) runs as one kernel, pipelined
over n tiles, one per source/destination rank (the local tile needs no transfer):
    comm-first  (a2a+gemm, ag+scatter+grouped_gemm):  transfer tiles [0, c, ..., c] then compute
    compute-first (gemm+a2a, grouped_gemm+gather+rs): compute tiles then transfers [c, ..., c, 0]
    c = (comm(b) - kernel_latency) / (n-1),  g = (compute - kernel_latency) * S/(S-b) / n + tile_overhead
    T = kernel_latency + two-stage flow time of those tiles  (``tile_pipeline_us``)
      = kernel_latency + max(comm, compute) + fill/drain (one tile of the other stage) when tiles
        are even, with b (SMs the kernel gives its transfers; 0 = copy engines) the allowed budget
        that minimises T. The compute is the chain's unchunked GEMMs: weights are read once, not
        once per tile as chunking does; its memory-bound members (scatter, gather, rope) are folded
        into the GEMM tiles (read by index, applied in the epilogue) and add nothing. The unfused
        baseline (``FusedPrice.unfused_us``) pays the collective at its default (NCCL-like) budget
        and every member as its own kernel. The whole T is charged to the group's anchor node
        (``FusedGroup.is_anchor``); the group's other nodes cost 0.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, get_args

from moegraph.efficiency import attention_factor, gemm_shape, gemm_shape_factor, size_eff
from moegraph.ir import Node, OpKind, Phase, Role, collective_bytes  # noqa: F401  (re-exported: calibration prices with it)
from moegraph.kinds import MEMORY_BOUND_OPS
from moegraph.registry import Curve, Hardware, RegistryError

__all__ = ["SHAPE_KEYS", "shape_attrs", "shaped_node", "CostModel", "byte_attr", "collective_bytes", "interpolate", "op_class", "FusedGroup", "FusedKind", "FusedPrice",
           "FUSED_ATTR", "Variant", "tile_pipeline_us", "variant", "variant_of"]

_US = 1e6  # seconds -> microseconds

Scope = Literal["intra", "inter"]

# --- fused tile-level variants ----------------------------------------------------------------

FusedKind = Literal["a2a+gemm", "gemm+a2a", "ag+scatter+grouped_gemm", "grouped_gemm+gather+rs"]
"""MegaScale-MoE §4.2's four fused kernels, named "first+then" as the paper does."""
COMM_FIRST: frozenset[str] = frozenset({"a2a+gemm", "ag+scatter+grouped_gemm"})
Variant = Literal["unfused", "chunked", "fused"]
"""How a node is predicted to run: alone, as one of a chunked decomposition, or in a fused kernel."""
FUSED_ATTR = "fused"
"""Node attribute marking a member of a fused group (``FusedGroup.to_attr``)."""


@dataclass(frozen=True)
class FusedGroup:
    """One fused kernel: a collective and the compute chain around it, as a node attribute.

    kind:    which of the four kernels.
    comm:    the collective's (op, comm_bytes, group n, scope).
    compute: the compute members' (op, flops, mem_bytes, phase, shape attrs), in graph order; the
             shape attrs (``SHAPE_KEYS``: role, mnk, groups, seq, head_dim) price each member by
             its shape as the unfused node is priced.
    Each member's attribute adds ``anchor``: true on the one member charged the whole fused time
    (comm-first: the last compute node; compute-first: the first), so every value the group
    produces is available only when the kernel ends (passes/fuse.py checks that for consumers
    outside the group). A flag, not a node name: restacking layers renames nodes.
    Plain data (strings, ints, a bool), so a schedule file carries it and prices it again.
    """

    kind: FusedKind
    comm: tuple[str, int, int, Scope]
    compute: tuple[tuple[str, int, int, str, tuple[tuple[str, Any], ...]], ...]

    def __post_init__(self):
        if self.kind not in get_args(FusedKind):
            raise ValueError(f"fused kind {self.kind!r} is not one of {', '.join(get_args(FusedKind))}")
        if self.comm[2] < 2:
            raise ValueError(f"fused {self.kind} needs a collective over n >= 2 ranks, got n={self.comm[2]}")
        if not self.compute:
            raise ValueError(f"fused {self.kind} has no compute node")
        # a member given as (op, flops, mem_bytes, phase) has no shape attributes: forward, unshaped
        object.__setattr__(self, "compute", tuple(tuple(c) if len(c) == 5 else (*c, shape_attrs({}))
                                                  for c in self.compute))

    def to_attr(self, anchor: bool) -> dict[str, Any]:
        return {"variant": "fused", "kind": self.kind, "anchor": anchor, "comm": list(self.comm),
                "compute": [[*c[:4], dict(c[4])] for c in self.compute]}

    @staticmethod
    def is_anchor(node: Node) -> bool:
        """True for the member that carries the fused kernel's time (``of`` checks the flag)."""
        return dict(node.attr(FUSED_ATTR))["anchor"] is True

    @classmethod
    def of(cls, node: Node) -> "FusedGroup | None":
        """The group ``node`` belongs to, or None. A malformed attribute raises, naming the node."""
        raw = node.attr(FUSED_ATTR, None)
        if raw is None:
            return None
        try:
            d = dict(raw)
            if not isinstance(d["anchor"], bool):
                raise ValueError(f"anchor {d['anchor']!r} is not true or false")
            op, nbytes, group, scope = d["comm"]
            return cls(kind=d["kind"], comm=(op, int(nbytes), int(group), scope),
                       compute=tuple((c[0], int(c[1]), int(c[2]), c[3], shape_attrs(dict(c[4]) if len(c) > 4 else {}))
                                     for c in d["compute"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"node {node.name!r}: bad {FUSED_ATTR!r} attribute: {err}") from None

    def comm_node(self) -> Node:
        op, nbytes, group, scope = self.comm
        return Node(name=f"fused.{self.kind}.comm", op=OpKind(op), phase=Phase.FORWARD, inputs=(), outputs=(),
                    comm_bytes=nbytes, group=group, attrs=(("scope", scope),))

    def compute_nodes(self) -> tuple[Node, ...]:
        return tuple(shaped_node(f"fused.{self.kind}.compute{i}", op, attrs, phase=Phase(phase), flops=flops,
                                 mem_bytes=mem)
                     for i, (op, flops, mem, phase, attrs) in enumerate(self.compute))


@dataclass(frozen=True)
class FusedPrice:
    """A fused group's predicted time and what it is made of (all us)."""

    time_us: float           # the fused kernel
    comm_us: float           # the collective alone at the budget the kernel uses
    compute_us: float        # the compute chain alone, one kernel latency (full SMs)
    unfused_us: float        # the group's nodes one after another, each at its own best
    sm: int                  # SMs the kernel gives its transfers (0 = copy engines)
    tiles: int


SHAPE_KEYS = ("mnk", "groups", "seq", "head_dim")
"""Node attributes the compute rules read (moegraph.efficiency); a fused group keeps them per member."""


def shape_attrs(attrs: Mapping[str, Any], role: Role | str = Role.FORWARD) -> tuple[tuple[str, Any], ...]:
    """The pricing attributes of a node (``SHAPE_KEYS``, lists made tuples) and its role, as a
    fused group member stores them."""
    out = {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items() if k in SHAPE_KEYS}
    out["role"] = role.value if isinstance(role, Role) else role
    return tuple(sorted(out.items()))


def shaped_node(name: str, op: OpKind | str, shape: Iterable[tuple[str, Any]], *, phase: Phase | None = None,
                flops: int = 0, mem_bytes: int = 0) -> Node:
    """A compute node priced as the one whose ``shape_attrs`` were ``shape`` (its role included):
    how a fused group's member and the calibration's self-check price what they stored. The
    phase follows the role unless given."""
    attrs = dict(shape)
    role = Role(attrs.pop("role", Role.FORWARD.value))
    if phase is None:
        phase = Phase.FORWARD if role is Role.FORWARD else Phase.BACKWARD
    return Node(name=name, op=OpKind(op), phase=phase, inputs=(), outputs=(), role=role, flops=int(flops),
                mem_bytes=int(mem_bytes), attrs=tuple(sorted(attrs.items())))


def variant_of(attrs: Mapping[str, Any]) -> Variant:
    """The variant a node with these attributes is priced as (what the Gantt chart and compile
    --json show): a fused group's member, one of a chunked decomposition (attr "chunk"), or alone."""
    if attrs.get(FUSED_ATTR) is not None:
        return "fused"
    return "chunked" if attrs.get("chunk") is not None else "unfused"


def variant(node: Node) -> Variant:
    return variant_of(dict(node.attrs))


def tile_pipeline_us(first: list[float] | tuple[float, ...], second: list[float] | tuple[float, ...]) -> float:
    """Two-stage flow time: stage-1 tiles run back to back; tile i's stage 2 starts when its stage 1
    and tile i-1's stage 2 are done (a transfer and a GEMM tile each have one engine)."""
    if len(first) != len(second):
        raise ValueError(f"tile_pipeline_us: {len(first)} first-stage tiles vs {len(second)} second-stage tiles")
    done1 = done2 = 0.0
    for a, b in zip(first, second):
        done1 += a
        done2 = max(done2, done1) + b
    return done2


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


def byte_attr(node: Node, key: str, used_by: str) -> int:
    """A byte count the lowering writes on a node (``stream_bytes`` of an expert GEMM,
    ``accumulate_bytes`` of a summing weight-gradient kernel). ``used_by`` says what prices or
    fits by it. A node without it (a graph built by other code) would be priced, or fitted, without
    that term, so it is an error, not a 0. The one reader: the cost model and the in-step
    calibration (moegraph.runtime.calibrate.steps) both use it."""
    value = node.attr(key, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"node {node.name!r} ({node.op.value}) has {key}={value!r}, but {used_by}: expected a "
                         f"byte count >= 0 (moegraph/lowering/blocks.py and moegraph/autodiff.py write it)")
    return value


def op_class(node: Node) -> str:
    """The node's class for in-step factors (moegraph.registry.IN_STEP_CLASSES)."""
    match node.op:
        case OpKind.GEMM | OpKind.ROUTER:
            return "gemm"
        case OpKind.GROUPED_GEMM:
            return "grouped_gemm"
        case OpKind.ATTENTION | OpKind.GATED_DELTA:      # the delta rule's chunk products: attention-like
            return "attention"
        case kind if kind in MEMORY_BOUND_OPS:
            return "memory"
        case OpKind.ALL_GATHER | OpKind.REDUCE_SCATTER | OpKind.ALL_TO_ALL | OpKind.ALL_REDUCE | OpKind.P2P:
            return "comm"
    raise NotImplementedError(f"no cost rule for {node.op}")


# compute op class -> the efficiency that prices it (None: memory-bound, the mem_bytes term decides)
_CLASS_EFF = {"gemm": "gemm_eff", "grouped_gemm": "grouped_gemm_eff", "attention": "attention_eff", "memory": None}


def collective_scope(node: Node, gpus_per_node: int) -> Scope:
    """Which link a collective crosses: node attr "scope", else intra iff the ranks its group lies among
    (attr "span", else the group) fit in a node of ``gpus_per_node``; the scheduler streams it so."""
    scope = node.attr("scope", "intra" if (node.attr("span", None) or node.group) <= gpus_per_node else "inter")
    if scope not in ("intra", "inter"):
        raise ValueError(f"node {node.name!r}: scope {scope!r} is not one of 'intra', 'inter'")
    return scope


def _not_finite(hw: Hardware, node: Node, sm_budget: int | None, t: float) -> RegistryError:
    """The error for a node ``hw`` prices at ``t`` (not finite, or negative): the field to blame
    is the one whose neutral value (1 for a number, nothing for curves and in-step factors) makes
    the time finite, and the message names it with its value; if no single field does, the
    message says so."""
    where = f"node {node.name!r} ({node.op.value})"
    for name, neutral in _neutral_fields(hw):
        try:
            fixed = CostModel(dataclasses.replace(hw, **{name: neutral}))._node_time_us(node, sm_budget)
        except (ValueError, NotImplementedError):      # the neutral value breaks another rule
            continue
        if math.isfinite(fixed) and fixed >= 0:
            value = getattr(hw, name)
            shown = f"{value!r}" if not isinstance(value, tuple) else f"{dict(value)!r}"
            return RegistryError(f"hardware profile {hw.name!r}: {name}={shown} makes {where} take {t!r} us, not a "
                                 f"finite duration; correct {name} in the profile", field=name)
    return RegistryError(f"hardware profile {hw.name!r} prices {where} at {t!r} us, not a finite duration, and no "
                         "single field explains it: check its rates, efficiencies and latencies")


def _neutral_fields(hw: Hardware):
    """(field, neutral value) for every field of ``hw`` that enters a price."""
    for f in dataclasses.fields(hw):
        value = getattr(hw, f.name)
        if isinstance(value, bool) or f.name in ("comm_sm_budgets", "measured"):
            continue
        if isinstance(value, (int, float)):
            yield f.name, type(value)(1)
        elif f.name in ("curves", "in_step_factors", "mem_op_traffic") and value:
            yield f.name, ()


class CostModel:
    """Prices IR nodes on ``hw``. Pure: the same node and budget always give the same time."""

    def __init__(self, hw: Hardware):
        self.hw = hw

    def sm_count(self) -> int:
        return self.hw.sm_count

    def node_time_us(self, node: Node, sm_budget: int | None = None) -> float:
        """Time of ``node`` alone. sm_budget applies to collectives only (None -> default);
        compute nodes ignore it. A time that is not a finite number >= 0 is the profile's fault
        (every node field is checked by the IR): RegistryError naming the field (``_culprit``)."""
        t = self._node_time_us(node, sm_budget)
        if not (math.isfinite(t) and t >= 0):
            raise _not_finite(self.hw, node, sm_budget, t)
        return t

    def _node_time_us(self, node: Node, sm_budget: int | None = None) -> float:
        if node.op is OpKind.SPLIT:
            return 0.0  # a view into a fused tensor: no kernel runs
        group = FusedGroup.of(node)
        if group is not None:
            if node.is_comm and sm_budget not in (None, 0):
                raise ValueError(f"sm_budget={sm_budget} is not allowed for {node.name!r}: it runs inside a "
                                 f"fused {group.kind} kernel; allowed: 0")
            return self.fused_price(group).time_us if FusedGroup.is_anchor(node) else 0.0
        cls = op_class(node)
        if cls == "comm":
            budget = self.default_sm_budget(node) if sm_budget is None else sm_budget
            return self._comm_us(node, budget)
        return self._compute_us(node, cls)

    def comm_sm_budgets(self, node: Node) -> tuple[int, ...]:
        """SM counts this collective may hold: 0 = copy engines, which move bytes but cannot add (so
        not a reduce-scatter's or all-reduce's); inside a fused kernel none (its anchor prices it)."""
        self._require_comm(node)
        if FusedGroup.of(node) is not None:
            return (0,)
        budgets, adds = self.hw.comm_sm_budgets, node.op in (OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE)
        return tuple(b for b in budgets if b > 0) if adds and any(budgets) else budgets

    def fused_price(self, group: FusedGroup) -> FusedPrice:
        """The fused kernel's time from its tile pipeline (module docstring), at the SM budget
        that minimises it."""
        hw, kappa = self.hw, self.hw.kernel_latency_us
        comm = group.comm_node()
        n = comm.group
        members = group.compute_nodes()
        alone = [0.0 if c.op is OpKind.SPLIT else self._compute_us(c, op_class(c), in_step_terms=False)
                 for c in members]
        # the chain as one kernel: one launch (views cost 0); the memory-bound members (the
        # scatter, the gather, the QKV epilogue's rope) are folded into the GEMM's tiles, which
        # read rows by the index map or apply them to the tile in registers (MegaScale-MoE §4.2,
        # Fig 10c): no HBM pass of their own
        body = sum(t - kappa for t, c in zip(alone, members) if t > 0 and op_class(c) != "memory")
        best: tuple[float, int] | None = None
        for b in hw.comm_sm_budgets:
            c = (self._comm_us(comm, b, hw.comm_sm_budgets) - kappa) / (n - 1)   # the kernel's SMs reduce
            g = body * self.compute_slowdown(b) / n + hw.fused_tile_overhead_us
            if group.kind in COMM_FIRST:
                t = tile_pipeline_us([0.0] + [c] * (n - 1), [g] * n)
            else:
                t = tile_pipeline_us([g] * n, [c] * (n - 1) + [0.0])
            if best is None or kappa + t < best[0]:
                best = (kappa + t, b)
        time_us, sm = best
        # the unfused baseline (Fig 16's "without fine-grained overlap"): the collective at the
        # NCCL-like default budget, then every member as its own kernel, scatter and gather included
        return FusedPrice(time_us=time_us, comm_us=self._comm_us(comm, sm, hw.comm_sm_budgets), compute_us=kappa + body,
                          unfused_us=self.node_time_us(comm) + sum(alone), sm=sm, tiles=n)

    def default_sm_budget(self, node: Node) -> int:
        """The smallest allowed budget that saturates the link (what NCCL would roughly use);
        the largest allowed one if none does."""
        budgets = self.comm_sm_budgets(node)
        if budgets == (0,):
            return 0
        saturation = self._collective(node.op, self.scope(node))[2]
        return next((b for b in budgets if b >= saturation), budgets[-1])

    def best_time_us(self, node: Node) -> float:
        """Fastest time over the allowed budgets (compute: its only time). For lower bounds."""
        if not node.op.is_comm or FusedGroup.of(node) is not None:
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

    def hbm_slowdown(self, sms_held_by_comm: int) -> float:
        """Factor (>= 1) by which a memory-bound kernel stretches beside collectives holding this
        many SMs: they move comm_hbm_traffic bytes of HBM per byte sent, at most at the NVLink
        rate their SMs reach, W' = W * mem_eff - that rate is left (1 where comm_hbm_traffic = 0)."""
        hw = self.hw
        if sms_held_by_comm <= 0 or hw.comm_hbm_traffic <= 0:
            return 1.0
        rate = (hw.comm_hbm_traffic * hw.nvlink_bw_bytes_s * hw.ring_eff_intra
                * min(1.0, sms_held_by_comm / hw.comm_sm_saturation))
        hbm = hw.hbm_bw_bytes_s * hw.mem_eff
        if rate >= hbm:
            raise ValueError(f"collectives on {sms_held_by_comm} SMs move {rate:.3g} B/s of HBM, at least the "
                             f"{hbm:.3g} B/s {hw.name} has (comm_hbm_traffic={hw.comm_hbm_traffic})")
        return hbm / (hbm - rate)

    def beside_comm_us(self, node: Node, sms_held_by_comm: int) -> float:
        """Time of compute ``node`` while collectives hold ``sms_held_by_comm`` SMs (interference,
        docs/cost_model.md): its FLOP term on the SMs left (``compute_slowdown``), its memory term
        on the HBM bandwidth left (``hbm_slowdown``). A profile without comm_hbm_traffic, a fused
        kernel and a view slow as a whole by compute_slowdown (a view: 0 either way)."""
        if node.is_comm:
            raise ValueError(f"node {node.name!r} ({node.op.value}) is a collective: beside_comm_us prices compute")
        alone = self.node_time_us(node)
        held = sms_held_by_comm
        if held == 0 or alone == 0.0:
            return alone * self.compute_slowdown(held)
        if self.hw.comm_hbm_traffic <= 0 or FusedGroup.of(node) is not None:
            return alone * self.compute_slowdown(held)
        return self._compute_us(node, op_class(node), sm_slow=self.compute_slowdown(held),
                                hbm_slow=self.hbm_slowdown(held))

    def comm_overlap_stretch(self) -> float:
        """Factor (>= 1) by which a collective stretches while compute runs beside it; node_time_us
        prices it alone, the scheduler applies this factor to the overlapped mode."""
        return self.hw.comm_overlap_stretch

    # --- internals --------------------------------------------------------------------------

    def _eff(self, curve_name: str, size: float, scalar: float) -> float:
        points = self.hw.curve(curve_name)
        return scalar if points is None else interpolate(points, size)

    def _compute_us(self, node: Node, cls: str, in_step_terms: bool = True, sm_slow: float = 1.0,
                    hbm_slow: float = 1.0) -> float:
        """kappa + max(FLOP term * sm_slow, memory term * hbm_slow) (+ the in-step terms, memory
        traffic, * hbm_slow); the slowdowns are those of ``beside_comm_us`` (1: alone)."""
        hw, eff_name = self.hw, _CLASS_EFF[cls]
        flops_s = 0.0
        if node.flops:
            eff = 1.0 if eff_name is None else self._class_eff(node, cls, eff_name)
            flops_s = node.flops / (hw.peak_flops_bf16 * eff)
        mem_s = 0.0
        if node.mem_bytes:
            traffic = hw.mem_traffic(node.op.value, node.role.value) if cls == "memory" else 1.0   # GEMM: one pass
            mem_s = node.mem_bytes * traffic / (hw.hbm_bw_bytes_s * self._eff("mem_eff", node.mem_bytes, hw.mem_eff))
        t = hw.kernel_latency_us + max(flops_s * sm_slow, mem_s * hbm_slow) * _US * hw.in_step_factor(cls)
        return t + (self._stream_us(node) + self._accumulate_us(node)) * hbm_slow if in_step_terms else t

    def _class_eff(self, node: Node, cls: str, eff_name: str) -> float:
        """A GEMM's curve by FLOPs (or scalar) times its shape factor (calibration fits the curve
        to samples divided by theirs); attention's curve replaces scalar and factor together."""
        gemm, scalar, shape = cls in ("gemm", "grouped_gemm"), getattr(self.hw, eff_name), self._shape(node, cls)
        return self._eff(eff_name, node.flops, scalar) * shape if gemm else self._eff(eff_name, node.flops, scalar * shape)

    def _shape(self, node: Node, cls: str) -> float:
        """The shape factor (<= 1) of a GEMM, grouped GEMM or attention node (moegraph.efficiency);
        1 for other classes, and for a GEMM without the ``mnk`` attribute (the router; graphs
        built by other code), which runs at the large-GEMM efficiency."""
        if cls in ("gemm", "grouped_gemm"):
            shape = gemm_shape(node)
            return 1.0 if shape is None else gemm_shape_factor(self.hw, shape)
        if cls == "attention":
            return attention_factor(self.hw, node)
        return 1.0

    def _stream_us(self, node: Node) -> float:
        """In-step weight streaming of an expert GEMM (module docstring): stream_bytes / the
        profile's in_step_stream_bw_bytes_s; 0 where the profile has no rate."""
        bw = self.hw.in_step_stream_bw_bytes_s
        if node.op is not OpKind.GROUPED_GEMM or bw <= 0:
            return 0.0
        used_by = f"profile {self.hw.name!r} prices it by in_step_stream_bw_bytes_s"
        return byte_attr(node, "stream_bytes", used_by) / bw * _US

    def _accumulate_us(self, node: Node) -> float:
        """Adding a weight-gradient kernel's result to the running sum (module docstring):
        accumulate_bytes / the profile's accumulate_bw_bytes_s; 0 where the profile has no rate."""
        bw = self.hw.accumulate_bw_bytes_s
        if bw <= 0 or not node.attr("accumulate", False):
            return 0.0
        used_by = f"profile {self.hw.name!r} prices it by accumulate_bw_bytes_s"
        return byte_attr(node, "accumulate_bytes", used_by) / bw * _US

    def scope(self, node: Node) -> Scope:
        """Which link a collective crosses on this profile (``collective_scope``)."""
        return collective_scope(node, self.hw.gpus_per_node)

    def ring_eff(self, scope: Scope) -> float:
        """The scalar ring (all-gather, reduce-scatter, all-reduce) efficiency on ``scope``'s link."""
        return self.hw.ring_eff_intra if scope == "intra" else self.hw.ring_eff_inter

    def _collective(self, op: OpKind, scope: Scope) -> tuple[int, float, int, tuple[str, ...]]:
        """(latency steps per (n-1), scalar efficiency, SM saturation, curve names in priority).
        A measured curve (``moegraph calibrate``: one link, both scopes) overrides either scope's
        scalar."""
        hw = self.hw
        match op:
            case OpKind.ALL_GATHER | OpKind.REDUCE_SCATTER:
                return 1, self.ring_eff(scope), hw.comm_sm_saturation, ("ring_eff",)
            case OpKind.ALL_TO_ALL:
                a2a = hw.a2a_eff_intra if scope == "intra" else hw.a2a_eff_inter
                return 1, a2a, hw.a2a_sm_saturation, ("a2a_eff",)
            case OpKind.ALL_REDUCE:
                return 2, self.ring_eff(scope), hw.comm_sm_saturation, ("all_reduce_eff", "ring_eff")
            case OpKind.P2P:       # one step on the inter-stage link (``_pp_link``), at a ring step's efficiency
                return 1, 1.0 if self.emulated_link() else hw.ring_eff_inter, hw.comm_sm_saturation, ()
        raise NotImplementedError(f"no cost rule for {op}")

    def _half_bytes(self, op: OpKind, scope: Scope) -> float:
        """The size-curve half point of ``op`` on ``scope``'s link (moegraph.efficiency.size_eff)."""
        hw = self.hw
        match op:
            case OpKind.ALL_GATHER | OpKind.REDUCE_SCATTER | OpKind.ALL_REDUCE:
                return hw.ring_half_bytes_intra if scope == "intra" else hw.ring_half_bytes_inter
            case OpKind.ALL_TO_ALL:
                return hw.a2a_half_bytes_intra if scope == "intra" else hw.a2a_half_bytes_inter
            case OpKind.P2P:       # no published send/recv size curve: flat (the ring's is fitted to
                return 0.0         # MoNTA's inter-node all-to-all, ~90 us per call, not a p2p send)
        raise NotImplementedError(f"no cost rule for {op}")

    def _link(self, scope: Scope) -> tuple[float, float]:
        """(bandwidth bytes/s, per-step latency us) of ``scope``'s link."""
        hw = self.hw
        if scope == "intra":
            return hw.nvlink_bw_bytes_s, hw.intra_node_latency_us
        return hw.nic_bw_bytes_s, hw.inter_node_latency_us

    def emulated_link(self) -> bool:
        """Stages on the calibration's emulated link: a lone send has its whole rate, both directions share it."""
        return self.hw.link_bit_s > 0 and not self.hw.pp_link_bw_bytes_s

    def _pp_link(self) -> tuple[float, float]:
        """(bytes/s, us) of the stages' link (``OpKind.P2P``): hw.pp_link_bw_bytes_s (0: the NIC's;
        an emulated link's rate), the inter-node latency (stages sit on different nodes)."""
        hw = self.hw
        if self.emulated_link():
            return hw.link_bit_s / 8, hw.inter_node_latency_us
        return hw.pp_link_bw_bytes_s or hw.nic_bw_bytes_s, hw.inter_node_latency_us

    def _comm_us(self, node: Node, sm: int, budgets: tuple[int, ...] | None = None) -> float:
        hw = self.hw
        budgets = self.comm_sm_budgets(node) if budgets is None else budgets
        if sm not in budgets:
            raise ValueError(f"sm_budget={sm} is not allowed for {node.name!r} ({node.op.value}) "
                             f"on {hw.name}; allowed: {', '.join(map(str, budgets))}")
        scope = self.scope(node)
        steps, eff, saturation, curve_names = self._collective(node.op, scope)
        for name in curve_names:
            points = hw.curve(name)
            if points is not None:
                eff = interpolate(points, node.comm_bytes)
                break
        else:        # no measured curve: the sourced size curve (an all-reduce sends 2x a ring's bytes per half)
            per_pass = node.comm_bytes / steps
            eff = size_eff(eff, self._half_bytes(node.op, scope), per_pass)
        bandwidth, alpha = self._pp_link() if node.op is OpKind.P2P else self._link(scope)
        latency = steps * (node.group - 1) * alpha
        if sm == 0:          # copy engines never outrun what a saturated ring gets of the link
            scale = min(1.0, hw.copy_engine_eff / self.ring_eff(scope))
            latency += hw.copy_engine_latency_us
        else:
            scale = min(1.0, sm / saturation)
        sent = node.comm_bytes - (hw.link_burst_bytes if node.op is OpKind.P2P and self.emulated_link() else 0)
        wire = latency + max(0.0, sent) / (bandwidth * eff * scale) * _US
        return hw.kernel_latency_us + wire * hw.in_step_factor("comm") + self._chunk_stall_us(node)

    def _chunk_stall_us(self, node: Node) -> float:
        """hw.chunk_stall_us for a collective of a chunked decomposition (attr ``chunk``), else 0 (docstring)."""
        return self.hw.chunk_stall_us if node.attr("chunk", None) is not None else 0.0

    def _require_comm(self, node: Node) -> None:
        if not node.op.is_comm:
            raise ValueError(f"node {node.name!r} ({node.op.value}) is not a collective; "
                             f"SM budgets apply to collectives only")
