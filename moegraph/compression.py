"""The BF16 data-parallel gradient sync (MegaScale-MoE §5), as a graph rewrite both the
``compress=dp-bf16`` pass (moegraph.passes.compress) and the model's edges (moegraph.edges,
appended after the passes) apply: one copy of the rule, in the earliest stage that needs it.

A reduce-scatter that sums in the wire format accumulates rounding at every ring step. The
paper instead casts once, exchanges shards with an all-to-all and sums locally in FP32:

    reduce-scatter(x)  ->  cast(x) -> all-to-all(shards) -> cast to fp32 -> local sum
    [P] (fp32)             [P] bf16 -> [g, P/g] (g shards, one per source rank) -> [P/g] fp32

with P a flat gradient bucket's elements and g the collective's group. The all-to-all takes
over the reduce-scatter's node name and its output keeps the reduce-scatter's output value,
so no reader is rewired. A graph whose DP reduce-scatters were rewritten records it as
``graph.meta["dp_grad_wire"]`` = ``DpGradWire.BF16`` (``dp_grad_wire``), so anything appended
to the graph later (the edges' sync) follows the same wire format.
"""

from __future__ import annotations

import dataclasses
import enum

from moegraph.ir import Graph, Node, OpKind, Value, collective_bytes

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
    keep = {k: v for k, v in rs.attrs if k in ("scope", "axis", "dp")}
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


__all__ = ["DP_WIRE_META", "DpGradWire", "derived", "dp_bf16", "dp_grad_wire", "is_dp_fp32_reduce_scatter"]
