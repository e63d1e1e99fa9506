"""The micro-batch merge pass: the step graph of M micro-batches (gradient accumulation).

Layout, naming and the gradient accumulation rule: ``moegraph.microbatch`` (what later stages
read of a merged graph). The pass manager runs ``MergeMicroBatches`` after the user's passes
(stage 10, scope step): they rewrite one micro-batch's layer, which is then copied M times, and
before the edges (stage 11), which add per micro-batch nodes.

Invariant: micro-batch j computes what ``graph`` computes on its own input; each parameter's
gradient is the sum over the micro-batches, synchronised once per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from moegraph.cost import CostModel
from moegraph.ir import Graph, GraphError, Node, OpKind, Phase, Role, ValueKind, freeze_attrs, verify
from moegraph.layers import boundary, layer_count
from moegraph.limits import check_graph_size
from moegraph.microbatch import MB_ATTR, mb_name, micro_batch_count, micro_batch_of
from moegraph.passes.manager import Pass, PassResult, register_model_pass
from moegraph.passes.stages import subgraph


@dataclass(frozen=True)
class MergeMicroBatches:
    """The model-level step: merge ``count`` micro-batches of the graph (1: unchanged)."""

    count: int

    NAME: ClassVar[str] = "microbatches"

    def __post_init__(self):
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"micro_batches={self.count!r} must be a positive integer")

    @property
    def arg(self) -> str:
        return str(self.count)


@register_model_pass(MergeMicroBatches, stage=10)
def merge(step: MergeMicroBatches, cost: CostModel | None = None) -> Pass:
    """The merge pass of ``step.count`` micro-batches (``merge_microbatches``)."""
    def run(graph: Graph) -> PassResult:
        out = merge_microbatches(graph, step.count)
        return PassResult(out, out is not graph)
    return run


def _is_sync(graph: Graph, node: Node) -> bool:
    """A gradient-synchronisation step of a parameter gradient: a collective (all-reduce, DP
    reduce-scatter / all-gather) or the cast to the FP32 main gradient, reading one parameter
    gradient. Linear in its input, so syncing the sum equals summing the syncs."""
    return (node.role is Role.WGRAD and len(node.inputs) == 1 and len(node.outputs) == 1
            and graph.value[node.inputs[0]].kind is ValueKind.PARAM_GRAD
            and (node.is_comm or node.op is OpKind.CAST))


def _sync_chains(graph: Graph) -> dict[str, tuple[str, tuple[Node, ...]]]:
    """parameter -> (its raw gradient before synchronisation, the sync nodes in order)."""
    out = {}
    for p, g in graph.grads:
        chain = []
        while (prod := graph.producer.get(g)) is not None and _is_sync(graph, prod):
            chain.append(prod)
            g = prod.inputs[0]
        if graph.producer.get(g) is None:
            raise GraphError(f"gradient {g!r} of parameter {p!r} has no producer in graph {graph.name!r}")
        out[p] = (g, tuple(reversed(chain)))
    return out


def merge_microbatches(graph: Graph, micro_batches: int) -> Graph:
    """The step graph of ``micro_batches`` micro-batches of ``graph`` (module docstring); verified.

    ``micro_batches`` = 1 returns ``graph`` unchanged. ``graph`` is a one-layer or stacked
    graph (passes already applied), not a merged one.
    """
    M = micro_batches
    if isinstance(M, bool) or not isinstance(M, int) or M < 1:
        raise ValueError(f"micro_batches={M!r} must be a positive integer")
    if micro_batch_count(graph) != 1 or any(micro_batch_of(n) is not None for n in graph.nodes):
        raise GraphError(f"graph {graph.name!r} already holds {micro_batch_count(graph)} micro-batches; merge its "
                         "micro-batch graph (micro_batch_graph) instead")
    if M == 1:
        return graph
    L = layer_count(graph)
    check_graph_size(layers=L, micro_batches=M, nodes_per_layer=-(-len(graph.nodes) // L))    # before copying it
    x, seed, y, dx = boundary(graph)
    chains = _sync_chains(graph)
    sync_nodes = {n.name for _, chain in chains.values() for n in chain}
    sync_values = {o for _, chain in chains.values() for n in chain for o in n.outputs}
    raw_of = {p: raw for p, (raw, _) in chains.items()}
    shared = {v.name for v in graph.values if v.kind is ValueKind.PARAM} | sync_values

    def rename(j: int, name: str) -> str:
        return name if name in shared else mb_name(j, name)

    values = [v for v in graph.values if v.name in shared]
    for j in range(M):
        for v in graph.values:
            if v.name not in shared:
                alias = rename(j, v.alias_of) if v.alias_of is not None else None
                values.append(dataclasses.replace(v, name=mb_name(j, v.name), alias_of=alias))
    nodes: list[Node] = []
    total: dict[str, str] = {}                 # raw gradient -> the value holding its running sum
    for j in range(M):
        copies = [_renamed(n, j, rename) for n in graph.nodes if n.name not in sync_nodes]
        if j > 0:
            where = {o: i for i, c in enumerate(copies) for o in c.outputs}
            for raw in raw_of.values():
                done = _accumulate_into(copies, where, mb_name(j, raw), total[raw], values)
                if done is not None:
                    copies.append(done)
        nodes += copies
        total = {raw: mb_name(j, raw) for raw in raw_of.values()}
    # the step's synchronisation: once, on the summed gradient
    for raw, chain in chains.values():
        for n in chain:
            nodes.append(dataclasses.replace(n, inputs=tuple(total[raw] if v == raw else v for v in n.inputs)))
    grads = tuple((p, total[g] if g in total else g) for p, g in graph.grads)
    param_grads = [total.get(o, o) for o in graph.outputs[2:]]
    outputs = tuple(name for j in range(M) for name in (mb_name(j, y), mb_name(j, dx))) + tuple(param_grads)
    inputs = tuple(mb_name(j, x) for j in range(M)) + tuple(v for v in graph.inputs if v not in (x, seed)) \
        + tuple(mb_name(j, seed) for j in range(M))
    saved = frozenset(rename(j, v) for j in range(M) for v in graph.saved)
    meta = dict(graph.meta) | {"micro_batches": M, "mb_graph": graph}
    merged = dataclasses.replace(graph, values=tuple(values), nodes=tuple(nodes), inputs=inputs, outputs=outputs,
                                 saved=saved, grads=grads, meta=freeze_attrs(meta))
    return verify(merged)


def _renamed(node: Node, j: int, rename) -> Node:
    forward_of = mb_name(j, node.forward_of) if node.forward_of is not None else None
    out = dataclasses.replace(node, name=mb_name(j, node.name), inputs=tuple(rename(j, v) for v in node.inputs),
                              outputs=tuple(rename(j, v) for v in node.outputs), forward_of=forward_of)
    return out.with_attrs(**{MB_ATTR: j})


def _accumulate_into(copies: list[Node], where: dict, part: str, acc: str, values: list) -> Node | None:
    """Make micro-batch j's gradient ``part`` the running sum ``acc`` + its own partial.

    The first weight-gradient kernel of ``part``'s chain (a parameter's per-chunk kernels
    already add into one another, attr accumulate) reads ``acc`` and adds into it, as a fused
    GEMM accumulating into the main gradient does; ``copies`` is updated in place and None
    returned. Otherwise an ADD node (returned) sums them: ``part`` is a raw gradient, read only
    by the step's sync or the next micro-batch's sum, so the ADD's output takes ``part``'s name
    and its producer writes ``<part>.partial`` instead. ``where``: output -> index in ``copies``."""
    i = where.get(part)
    if i is None:
        raise GraphError(f"gradient {part!r} is the output of no node")
    head = i
    while copies[head].attr("accumulate", False):
        prev = where.get(copies[head].inputs[-1])
        if prev is None:
            break
        head = prev
    node = copies[head]
    if node.role is Role.WGRAD and not node.is_comm and len(node.outputs) == 1 and not node.attr("accumulate", False):
        nbytes = next(v.nbytes for v in values if v.name == acc)
        copies[head] = node.accumulating(acc, nbytes)
        return None
    # the partial keeps being produced under a new name; the ADD writes the sum as ``part``
    partial = f"{part}.partial"
    value = next(v for v in values if v.name == part)
    values.append(dataclasses.replace(value, name=partial))
    prod = copies[i]          # one output, or one of several (attention's backward: d_sinks with dq, dk, dv)
    copies[i] = dataclasses.replace(prod, outputs=tuple(partial if o == part else o for o in prod.outputs))
    return Node(name=f"{part}.accumulate", op=OpKind.ADD, phase=Phase.BACKWARD, inputs=(acc, partial), outputs=(part,),
                role=Role.WGRAD, flops=value.numel, mem_bytes=3 * value.nbytes, module=prod.module, block=prod.block,
                attrs=freeze_attrs({k: v for k, v in prod.attrs if k in ("layer", MB_ATTR)}))


def pair_graph(graph: Graph) -> Graph:
    """The overlapped F&B pair of ``graph`` (one layer or a stack, passes applied, not merged):
    micro-batch 1's forward beside micro-batch 0's whole backward (its recompute and its own
    gradient synchronisation included, as an unmerged backward runs them), one verified graph in
    the merged graph's layout (``mb{j}.`` names, the ``mb`` attribute, meta ``micro_batches`` 2:
    the barrier holds per micro-batch, so the op-level schedule interleaves the two). No
    gradient accumulation: micro-batch 0's gradients are its own. Inputs: ``mb1.<x>``,
    ``mb0.<seed>``, the values micro-batch 0's backward reads of its forward (``mb0.<v>``), the
    parameters; outputs: ``mb1.<y>`` and the values micro-batch 1's backward will read,
    ``mb0.<dx>`` and micro-batch 0's synchronised parameter gradients (``grads``). What a
    pipeline stage runs for torch's OVERLAP_F_B (moegraph.runtime.pipeline_pair) and, less its
    synchronisation (once per step), what the pair is priced at (moegraph.schedules.pipeline_price)."""
    if micro_batch_count(graph) != 1 or any(micro_batch_of(n) is not None for n in graph.nodes):
        raise GraphError(f"graph {graph.name!r} is a merged step graph; pair its micro-batch graph (micro_batch_graph)")
    shared = {v.name for v in graph.values if v.kind is ValueKind.PARAM}

    def rename(j: int, name: str) -> str:
        return name if name in shared else mb_name(j, name)

    values = [v for v in graph.values if v.name in shared] + [
        dataclasses.replace(v, name=mb_name(j, v.name), alias_of=None if v.alias_of is None else rename(j, v.alias_of))
        for j in (0, 1) for v in graph.values if v.name not in shared]
    both = dataclasses.replace(
        graph, values=tuple(values), nodes=tuple(_renamed(n, j, rename) for j in (0, 1) for n in graph.nodes),
        inputs=tuple(dict.fromkeys(rename(j, v) for j in (0, 1) for v in graph.inputs)),
        outputs=tuple(dict.fromkeys(rename(j, v) for j in (0, 1) for v in graph.outputs)),
        saved=frozenset(rename(j, v) for j in (0, 1) for v in graph.saved),
        grads=tuple((p, mb_name(0, g)) for p, g in graph.grads),
        meta=freeze_attrs(dict(graph.meta) | {"micro_batches": 2, "mb_graph": graph}))
    keep = [n for n in both.nodes if (micro_batch_of(n) == 1) == (n.phase is Phase.FORWARD)]
    return subgraph(both, keep, f"{graph.name}.F&B")


__all__ = ["MergeMicroBatches", "merge_microbatches", "pair_graph"]
