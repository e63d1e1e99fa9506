"""Communication compression (MegaScale-MoE §5, DeepSeek-V3 §3.3): fewer bytes on the wire.

A reduce-scatter that sums in the wire format accumulates rounding at every ring step. The
paper instead casts once, exchanges shards with an all-to-all and sums locally in FP32:

    reduce-scatter(x)  ->  cast(x) -> all-to-all(shards) -> cast to fp32 -> local sum
    [.., X, ..]            [.., X, ..] -> [g, .., X/g, ..] (g shards, one per source rank) -> [.., X/g, ..]

The all-to-all takes over the reduce-scatter's node name (nodes deriving from it keep
pointing at it) and its output keeps the reduce-scatter's output value, so no reader is
rewired and ``saved`` is untouched; the new buffers are transient.

Modes
    dp-bf16   every data-parallel gradient reduce-scatter in FP32 (attr dp=True, added by
              lowering when strategy.dp > 1: intra- and inter-node stages) sends BF16: half
              the bytes. Main gradients stay FP32 before and after. The pass records
              graph.meta["dp_grad_wire"] = DpGradWire.BF16, and the model's edges (added
              after it, moegraph.passes.edges) rewrite their own DP syncs with the same
              ``dp_bf16``: one copy of the rule.
    tp-fp8    every forward (and recompute) tensor-parallel reduce-scatter of activations
              (attn='tp' output projection, ag-rs dispatch combine) sends FP8 E4M3 with a
              per-token scale (amax/448 per row, sent alongside as fp32), summed in FP32.
              Its backward all-gather is left in the activation dtype.
    ep-fp8    every all-to-all that sends rows to their experts' ranks (dispatch='a2a'): the
              forward (and recompute) token dispatch, and in backward the combine's gradient
              (DeepSeek-V3's "activation gradient before MoE down-projections"), sends FP8 E4M3
              rows with a per-row scale (amax/448, fp32) in the same exchange, dequantized on
              arrival:
                  rows [R, h] -> quant -> ([R, h] fp8, [R] fp32) -> all-to-all (payloads=2)
                  -> ([R', h] fp8, [R'] fp32) -> dequant -> [R', h]
              As DeepSeek-V3 (§3.3) and DeepEP dispatch: (h + 4) / (2h) of bf16's bytes. The
              combine and the dispatch's gradient stay in the activation dtype (DeepSeek-V3
              keeps both combine directions in BF16); so does the routing weights' all-to-all.

Invariant: the same function up to the wire format's rounding. Per compressed collective,
element-wise |out - exact| <= u * sum over sources |x_r| (+ for fp8 a subnormal floor of
2^-10 * scale per source), with u = 2^-8 for bf16 and 2^-4 for fp8 E4M3 (a dispatch has one
source per row); activation memory unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import typing

from moegraph.cost import CostModel
from moegraph.ir import Compress, Graph, Node, OpKind, Phase, Value, ValueKind, collective_bytes
from moegraph.passes.manager import Pass, PassResult, label, mark_rewritten, record, register

MODES = tuple(m for m in typing.get_args(Compress) if m != "none")


DP_WIRE_META = "dp_grad_wire"
"""``graph.meta`` key: the wire format of the graph's data-parallel gradient reduce-scatters."""


class DpGradWire(enum.Enum):
    """Wire format of the data-parallel gradient reduce-scatters (attr dp=True)."""
    FP32 = "fp32"          # as lowered (moegraph.autodiff._dp_sync)
    BF16 = "bf16"          # compress=dp-bf16: BF16 all-to-all + FP32 local sum


def dp_grad_wire(graph: Graph) -> DpGradWire:
    """The wire format the graph's DP gradient reduce-scatters use (FP32 unless rewritten)."""
    wire = graph.meta_get(DP_WIRE_META, DpGradWire.FP32)
    if not isinstance(wire, DpGradWire):
        raise ValueError(f"graph {graph.name!r}: meta {DP_WIRE_META}={wire!r} is not a DpGradWire")
    return wire


GROUP_ATTRS = ("axis", "scope", "span")
"""Where a collective runs and which link it crosses: a compressed collective keeps them (a folded
attention's reduce-scatter stays on its axis 'attn')."""


def group_attrs(node: Node) -> dict:
    return {k: v for k, v in node.attrs if k in GROUP_ATTRS}


def derived(like: Node, name: str, op: OpKind, inputs: tuple[str, ...], outputs: tuple[str, ...],
            values: dict[str, Value], *, attrs: dict, flops: int = 0, comm_bytes: int = 0) -> Node:
    """A node in ``like``'s place (phase, role, module, block, chunk tag); mem_bytes from its values."""
    chunk = {"chunk": like.attr("chunk")} if like.attr("chunk", None) is not None else {}
    node = dataclasses.replace(like, name=name, op=op, inputs=inputs, outputs=outputs, flops=flops,
                               mem_bytes=0 if op.is_comm else sum(values[v].nbytes for v in {*inputs, *outputs}),
                               comm_bytes=comm_bytes, group=like.group if op.is_comm else 0, attrs=())
    return node.with_attrs(**(chunk | attrs))


def is_dp_fp32_reduce_scatter(graph_values: dict[str, Value], node: Node) -> bool:
    """An FP32 data-parallel gradient reduce-scatter (``_dp_sync``'s, attr dp=True): what the
    BF16 sync rewrites."""
    return (node.op is OpKind.REDUCE_SCATTER and bool(node.attr("dp", False))
            and graph_values[node.inputs[0]].dtype == "fp32")


def dp_bf16(rs: Node, values: dict[str, Value]) -> list[Node]:
    """FP32 gradient reduce-scatter -> BF16 all-to-all + FP32 local sum (flat buckets); the new
    buffers are added to ``values``."""
    (x,), (y,), g = rs.inputs, rs.outputs, rs.group
    xv, numel = values[x], values[x].numel
    values[f"{x}.bf16"] = dataclasses.replace(xv, name=f"{x}.bf16", dtype="bf16", alias_of=None)
    values[f"{y}.parts"] = dataclasses.replace(values[y], name=f"{y}.parts", shape=(g, numel // g), dtype="bf16")
    values[f"{y}.parts32"] = dataclasses.replace(values[f"{y}.parts"], name=f"{y}.parts32", dtype="fp32")
    keep = group_attrs(rs) | ({"dp": True} if rs.attr("dp", False) else {})
    return [
        derived(rs, f"{rs.name}.cast", OpKind.CAST, (x,), (f"{x}.bf16",), values, attrs={"to": "bf16"}),
        derived(rs, rs.name, OpKind.ALL_TO_ALL, (f"{x}.bf16",), (f"{y}.parts",), values,
                comm_bytes=collective_bytes(OpKind.ALL_TO_ALL, values[f"{x}.bf16"].nbytes, g),
                attrs=keep | {"mode": "shards", "split_dim": 0, "flat": True, "compressed": "bf16"}),
        derived(rs, f"{rs.name}.upcast", OpKind.CAST, (f"{y}.parts",), (f"{y}.parts32",), values,
                attrs={"to": "fp32"}),
        derived(rs, f"{rs.name}.sum", OpKind.ADD, (f"{y}.parts32",), (y,), values, flops=numel,
                attrs={"reduce_dim": 0, "reduce": rs.attr("reduce", "sum"), "to": "fp32"}),
    ]



def _tp_fp8(rs: Node, values: dict[str, Value]) -> list[Node]:
    """Activation reduce-scatter along ``dim`` -> FP8 all-to-all (per-token scales) + FP32 sum."""
    (x,), (y,), g = rs.inputs, rs.outputs, rs.group
    dim, xv, yv = rs.typed.dim, values[x], values[y]
    values[f"{x}.fp8"] = dataclasses.replace(xv, name=f"{x}.fp8", dtype="fp8", alias_of=None)
    values[f"{x}.scale"] = dataclasses.replace(xv, name=f"{x}.scale", shape=xv.shape[:-1], dtype="fp32", alias_of=None)
    parts = (g,) + yv.shape
    values[f"{y}.parts"] = dataclasses.replace(yv, name=f"{y}.parts", shape=parts, dtype="fp8", alias_of=None)
    values[f"{y}.scale_parts"] = dataclasses.replace(yv, name=f"{y}.scale_parts", shape=parts[:-1], dtype="fp32",
                                                     alias_of=None)
    values[f"{y}.parts32"] = dataclasses.replace(yv, name=f"{y}.parts32", shape=parts, dtype="fp32", alias_of=None)
    sent = values[f"{x}.fp8"].nbytes + values[f"{x}.scale"].nbytes
    return [
        derived(rs, f"{rs.name}.quant", OpKind.CAST, (x,), (f"{x}.fp8", f"{x}.scale"), values,
                 attrs={"to": "fp8", "scale": "per_token"}),
        derived(rs, rs.name, OpKind.ALL_TO_ALL, (f"{x}.fp8", f"{x}.scale"), (f"{y}.parts", f"{y}.scale_parts"),
                 values, comm_bytes=collective_bytes(OpKind.ALL_TO_ALL, sent, g),
                 attrs=group_attrs(rs) | {"mode": "shards", "split_dim": dim, "compressed": "fp8"}),
        derived(rs, f"{rs.name}.dequant", OpKind.CAST, (f"{y}.parts", f"{y}.scale_parts"), (f"{y}.parts32",),
                 values, attrs={"to": "fp32", "scale": "apply"}),
        derived(rs, f"{rs.name}.sum", OpKind.ADD, (f"{y}.parts32",), (y,), values, flops=values[x].numel,
                 attrs={"reduce_dim": 0, "reduce": "sum", "to": yv.dtype}),
    ]


def _ep_fp8(a2a: Node, values: dict[str, Value]) -> list[Node]:
    """Token dispatch -> per-row FP8 quantization, one all-to-all of rows and scales, dequantization."""
    (x, *maps), (y, *recv) = a2a.inputs, a2a.outputs
    xv, yv = values[x], values[y]
    values[f"{x}.fp8"] = dataclasses.replace(xv, name=f"{x}.fp8", dtype="fp8", alias_of=None)
    values[f"{x}.scale"] = dataclasses.replace(xv, name=f"{x}.scale", shape=xv.shape[:1], dtype="fp32", alias_of=None)
    values[f"{y}.fp8"] = dataclasses.replace(yv, name=f"{y}.fp8", dtype="fp8", alias_of=None)
    values[f"{y}.scale"] = dataclasses.replace(yv, name=f"{y}.scale", shape=yv.shape[:1], dtype="fp32", alias_of=None)
    sent = values[f"{x}.fp8"].nbytes + values[f"{x}.scale"].nbytes         # [R, h] fp8 + [R] fp32
    return [
        derived(a2a, f"{a2a.name}.quant", OpKind.CAST, (x,), (f"{x}.fp8", f"{x}.scale"), values,
                attrs={"to": "fp8", "scale": "per_token"}),
        derived(a2a, a2a.name, OpKind.ALL_TO_ALL, (f"{x}.fp8", f"{x}.scale", *maps), (f"{y}.fp8", f"{y}.scale", *recv),
                values, comm_bytes=collective_bytes(OpKind.ALL_TO_ALL, sent, a2a.group),
                attrs=dict(a2a.attrs) | {"payloads": 2, "compressed": "fp8"}),
        derived(a2a, f"{a2a.name}.dequant", OpKind.CAST, (f"{y}.fp8", f"{y}.scale"), (y,), values,
                attrs={"to": yv.dtype, "scale": "apply"}),
    ]


def is_token_dispatch(graph_values: dict[str, Value], node: Node) -> bool:
    """An all-to-all of rows to their experts: forward (or recompute) activations, or in backward
    the combine's gradient (DeepSeek-V3's "activation gradient before MoE down-projections");
    not routing weights."""
    kind = graph_values[node.inputs[0]].kind
    return (node.op is OpKind.ALL_TO_ALL and node.typed.mode == "tokens" and node.typed.direction == "to_experts"
            and node.typed.payloads == 1 and graph_values[node.inputs[0]].dtype in ("bf16", "fp16", "fp32")
            and ((node.phase in (Phase.FORWARD, Phase.RECOMPUTE) and kind is ValueKind.ACTIVATION)
                 or (node.phase is Phase.BACKWARD and kind is ValueKind.GRAD)))


def _targets(graph: Graph, mode: str) -> list[Node]:
    if mode == "dp-bf16":
        return [n for n in graph.nodes if is_dp_fp32_reduce_scatter(graph.value, n)]
    if mode == "ep-fp8":
        return [n for n in graph.nodes if is_token_dispatch(graph.value, n)]
    return [n for n in graph.nodes if n.op is OpKind.REDUCE_SCATTER and not n.typed.dp
            and n.phase in (Phase.FORWARD, Phase.RECOMPUTE)]


_REWRITES = {"dp-bf16": dp_bf16, "tp-fp8": _tp_fp8, "ep-fp8": _ep_fp8}
_NOTHING = {"dp-bf16": "dp=1: no data-parallel reduce-scatter", "tp-fp8": "no tensor-parallel reduce-scatter",
            "ep-fp8": "no token dispatch all-to-all (dispatch='a2a' with n > 1 has one)"}


@register("compress", stage=3, relowers=False)
def compress(arg: str | None = None, cost: CostModel | None = None) -> Pass:
    """Compress reductions on the wire (module docstring); ``compress`` needs a mode.

    Invariant: the same function up to the documented rounding bound; activation memory unchanged.
    """
    if arg not in MODES:
        raise ValueError("a mode is required" if arg is None else "not a compression mode")
    rewrite = _REWRITES[arg]
    me = label("compress", arg)

    def run(graph: Graph) -> PassResult:
        targets = {n.name for n in _targets(graph, arg)}
        if not targets:
            return PassResult(record(graph, me, compress=arg), False,
                              {"mode": arg, "compressed": [], "note": _NOTHING[arg]})
        values = dict(graph.value)
        nodes, before, after = [], [], []
        for node in graph.nodes:
            if node.name not in targets:
                nodes.append(node)
                continue
            chain = rewrite(node, values)
            nodes.extend(chain)
            before.append(node)
            after.extend(chain)
        new = dataclasses.replace(graph, nodes=tuple(nodes), values=tuple(values.values()))
        report = {"mode": arg, "compressed": sorted(targets),
                  "comm_bytes_before": sum(n.comm_bytes for n in before),
                  "comm_bytes_after": sum(n.comm_bytes for n in after)}
        if cost is not None:
            report["predicted_us_before"] = round(sum(cost.node_time_us(n) for n in before), 3)
            report["predicted_us_after"] = round(sum(cost.node_time_us(n) for n in after), 3)
        if arg == "dp-bf16":
            # what is appended after the passes (the model's edges) syncs the same way
            new = new.with_meta(**{DP_WIRE_META: DpGradWire.BF16})
        return PassResult(mark_rewritten(record(new, me, compress=arg), me), True, report)
    return run
