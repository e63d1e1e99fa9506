"""Reference interpreter: runs a graph forward and backward for n simulated ranks in one process.

Every node runs in graph order on every rank; a collective becomes a tensor exchange between
the simulated ranks' environments. This is the ground truth the passes are tested against
(fp32, CPU), and the runtime's numerics are tested the same way against the eager module.

Sharding: the layer input is split along the sequence ([b, s, h] -> n x [b, s/n, h]);
parameters are cut per ``ParamSpec``; gradients are reassembled into full module shapes.

Data parallelism (strategy.dp = D > 1): D replicas of the n-rank group are simulated, D*n
environments in all. Every replica gets the *same* input and seed gradient (identical copies),
so the DP-averaged gradient equals the single-replica gradient and the results (read from
replica 0) are compared against the eager module as for D = 1. Collectives with attr
axis="dp" run across the D replicas holding the same rank; axis="mp" (the default) within each
replica (``axis_of``, ``axis_groups``: the runtime uses the same layout on real ranks). With
strategy.ep_nodes = N > 1 the n ranks of a replica span N nodes of G = n/N consecutive ranks: the
hierarchical token dispatch runs on axis="node" (the G ranks of one node) and axis="rail" (the N
ranks with the same local index, one per node), both within a replica; a folded attention
(strategy.attn_nodes = N) runs on axis="attn" (its n/N consecutive ranks), its sharded parameters'
gradients summed over axis="attn_dp" (the N ranks with the same local index), and the layer input
is split by ``moegraph.token_layout`` ([b/N, s/(n/N), h]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import torch

from moegraph.index_map import IndexMap, RecvMap
from moegraph.ir import Graph, Node, OpKind, ParamSpec
from moegraph.kernels import RankContext, run_compute
from moegraph.microbatch import micro_batch_count, microbatch_boundaries
from moegraph.token_layout import shard_tokens, unshard_tokens


Axis = Literal["mp", "dp", "node", "rail", "attn", "attn_dp"]
AXES: tuple[Axis, ...] = ("mp", "dp", "node", "rail", "attn", "attn_dp")


def axis_of(node: Node) -> Axis:
    """The group axis a collective runs on (attr ``axis``; absent: "mp"); anything else raises."""
    axis = node.attr("axis", "mp")            # raw: any value is named below, with the valid axes
    for valid in AXES:
        if axis == valid:
            return valid
    raise ValueError(f"collective {node.name!r} has axis={axis!r}; valid axes: mp (within a replica), "
                     "dp (across replicas), node (the ranks of one node), rail (one rank per node, same "
                     "local index), attn (the ranks of one attention), attn_dp (one rank per attention, same "
                     "local index)")


def axis_groups(axis: Axis, n: int, d: int, node_ranks: int = 0, attn_ranks: int = 0) -> tuple[tuple[int, ...], ...]:
    """Every group of ``axis`` among n x d ranks laid out replica-major (rank p*n + r is rank r of
    replica p), as ranks in group-rank order: mp, the n ranks of each replica; dp, the d ranks
    holding the same rank r, in replica order. node and rail split each replica's n ranks into
    n/G nodes of G = ``node_ranks`` consecutive ranks: node, the G ranks of one node (q*G ..
    q*G+G-1); rail, the n/G ranks with the same local index r (r, r+G, ..), in node order. attn
    and attn_dp split them alike into attentions of G = ``attn_ranks`` ranks (Strategy.attn_nodes)."""
    if axis == "mp":
        return tuple(tuple(range(p * n, (p + 1) * n)) for p in range(d))
    if axis == "dp":
        return tuple(tuple(range(r, n * d, n)) for r in range(n))
    if axis in ("node", "rail", "attn", "attn_dp"):
        nodes = axis in ("node", "rail")
        g, least = (node_ranks, 2) if nodes else (attn_ranks, 1)
        if g < least or n % g or n // g < 2:
            what = "node_ranks (ranks per node, n / strategy.ep_nodes) >= 2" if nodes else \
                "attn_ranks (ranks per attention, n / strategy.attn_nodes) >= 1"
            raise ValueError(f"axis {axis!r} needs {what} dividing n={n} into at least 2 groups, got "
                             f"{'node_ranks' if nodes else 'attn_ranks'}={g}")
        if axis in ("node", "attn"):
            groups = [tuple(range(q * g, (q + 1) * g)) for q in range(n // g)]
        else:
            groups = [tuple(range(r, n, g)) for r in range(g)]
        return tuple(tuple(p * n + i for i in grp) for p in range(d) for grp in groups)
    raise ValueError(f"axis {axis!r} is not one of {', '.join(AXES)}")


@dataclass
class InterpreterResult:
    output: torch.Tensor                     # [b, s, h], the layer output, unsharded
    input_grad: torch.Tensor                 # [b, s, h], gradient of the layer input
    param_grads: dict[str, torch.Tensor]     # module qualname -> full gradient (parameters, not buffers)
    envs: list[dict[str, Any]]               # every value on every rank (replica-major), for debugging


def _rank_views(spec: ParamSpec, full: Mapping[str, torch.Tensor], rank: int, n: int) -> list[torch.Tensor]:
    """The views of the module's tensors ``full`` that make up this rank's piece of ``spec``, one
    per source (narrowed, then this rank's shard): read for parameters, written for gradients."""
    views = []
    parts = spec.shards(n)                     # n, or a node's G ranks (ParamSpec.shard_ranks)
    for src in spec.sources:
        t = src.view(full[src.qualname])
        if spec.shard_dim is not None:
            t = t.chunk(parts, spec.shard_dim)[rank % parts]
        views.append(t)
    return views


def writes_region(spec: ParamSpec, rank: int, n: int) -> bool:
    """Whether rank writes its piece of ``spec`` when full tensors are assembled by summing every
    rank's regions: each region once (a replicated parameter from rank 0, a node's attention shard
    from the first node)."""
    return rank < (1 if spec.shard_dim is None else spec.shards(n))


def shard_param(spec: ParamSpec, full: Mapping[str, torch.Tensor], rank: int, n: int) -> torch.Tensor:
    pieces = _rank_views(spec, full, rank, n)
    return torch.cat(pieces, dim=spec.cat_dim) if len(pieces) > 1 else pieces[0]


def unshard_grad(spec: ParamSpec, grad: torch.Tensor, rank: int, n: int, out: dict[str, torch.Tensor]) -> None:
    """Write this rank's gradient of a graph parameter into the full module gradients ``out``."""
    regions = _rank_views(spec, out, rank, n)
    sizes = [r.shape[spec.cat_dim] for r in regions]
    for region, piece in zip(regions, torch.split(grad, sizes, dim=spec.cat_dim)):
        region.copy_(piece)


@dataclass
class MicroBatchResult:
    outputs: list[torch.Tensor]              # per micro-batch [b, s, h] output, unsharded
    input_grads: list[torch.Tensor]          # per micro-batch gradient of its input
    param_grads: dict[str, torch.Tensor]     # module qualname -> full gradient summed over the micro-batches
    envs: list[dict[str, Any]]


def interpret(graph: Graph, params: Mapping[str, torch.Tensor], x: torch.Tensor, dy: torch.Tensor) -> InterpreterResult:
    """Run ``graph`` on full input ``x`` [b, s, h] with seed gradient ``dy`` [b, s, h]; ``params``
    maps module qualnames to full parameters and the buffers the graph reads (ParamSpec.buffer).

    Results are read from replica 0; ``envs`` holds all D*n environments, replica-major.
    A merged step graph of M micro-batches (moegraph.microbatch) runs with
    ``interpret_microbatches``.
    """
    if micro_batch_count(graph) != 1:
        raise ValueError(f"graph {graph.name!r} holds {micro_batch_count(graph)} micro-batches: run it with "
                         "interpret_microbatches (one input and seed gradient per micro-batch)")
    r = interpret_microbatches(graph, params, [x], [dy])
    return InterpreterResult(output=r.outputs[0], input_grad=r.input_grads[0], param_grads=r.param_grads,
                             envs=r.envs)


def interpret_microbatches(graph: Graph, params: Mapping[str, torch.Tensor], xs: Sequence[torch.Tensor],
                           dys: Sequence[torch.Tensor]) -> MicroBatchResult:
    """Run a merged step graph (or, with one of each, any graph): micro-batch j's full input
    ``xs[j]`` [b, s, h] and seed gradient ``dys[j]``; gradients are the step's (summed over the
    micro-batches by the graph itself)."""
    bounds = microbatch_boundaries(graph)
    if len(xs) != len(bounds) or len(dys) != len(bounds):
        raise ValueError(f"graph {graph.name!r} holds {len(bounds)} micro-batches but got {len(xs)} inputs and "
                         f"{len(dys)} seed gradients")
    n, d = graph.strategy.n, graph.strategy.dp
    st = graph.strategy
    node_ranks = n // st.ep_nodes                        # G, ranks per node (axes node and rail)
    missing = sorted({src.qualname for _, spec in graph.params for src in spec.sources} - set(params))
    if missing:
        raise ValueError(f"params lacks {', '.join(missing)}: pass every parameter and every buffer the graph reads "
                         "(dict(module.named_parameters()) | dict(module.named_buffers()))")
    envs: list[dict[str, Any]] = [{} for _ in range(n * d)]
    for i, env in enumerate(envs):
        r = i % n
        for (x_name, seed_name, _, _), x, dy in zip(bounds, xs, dys):   # moegraph.layers.boundary
            env[x_name] = shard_tokens(x, st, r)                         # [b/N, s/G, h]
            env[seed_name] = shard_tokens(dy, st, r)
        for pname, spec in graph.params:
            env[pname] = shard_param(spec, params, r, n)
    for node in graph.nodes:
        shapes = [graph.value[o].shape for o in node.outputs]
        if node.is_comm:
            outs: list[list[Any]] = [[] for _ in envs]
            axis = axis_of(node)
            for group in axis_groups(axis, n, d, node_ranks, st.attn_ranks):
                if len(group) != node.group:
                    raise RuntimeError(f"node {node.name!r}: group={node.group} but the interpreter's "
                                       f"{axis} group has {len(group)} ranks")
                res = run_collective(node, [[envs[i][v] for v in node.inputs] for i in group], shapes)
                for i, rank_outs in zip(group, res):
                    outs[i] = rank_outs
        else:
            outs = [run_compute(RankContext.of(graph, i % n), node, [env[v] for v in node.inputs], shapes)
                    for i, env in enumerate(envs)]
        for env, rank_outs in zip(envs, outs):
            if len(rank_outs) != len(node.outputs):
                raise RuntimeError(f"node {node.name!r} produced {len(rank_outs)} outputs, expected {len(node.outputs)}")
            env.update(zip(node.outputs, rank_outs))
    trainable = [(pname, spec) for pname, spec in graph.params if not spec.buffer]    # buffers get no gradient
    full_grads = {src.qualname: torch.zeros_like(params[src.qualname])
                  for _, spec in trainable for src in spec.sources}
    for pname, spec in trainable:
        for r in (r for r in range(n) if writes_region(spec, r, n)):
            unshard_grad(spec, envs[r][graph.grad_of[pname]], r, n, full_grads)
    replica0 = envs[:n]
    return MicroBatchResult(outputs=[unshard_tokens([e[y] for e in replica0], st) for _, _, y, _ in bounds],
                            input_grads=[unshard_tokens([e[dx] for e in replica0], st) for _, _, _, dx in bounds],
                            param_grads=full_grads, envs=envs)


# -- collectives over simulated ranks: ins[r] is rank r's input list -----------------------

def run_collective(node: Node, ins: list[list[Any]], shapes: list[tuple[int, ...]] | None = None) -> list[list[Any]]:
    """ins[r]: rank r's inputs; shapes: the output values' shapes (needed by flat=True gathers).

    flat=True collectives work on the flattened tensor (a gradient bucket); reduce="mean"
    averages instead of summing (data-parallel gradients; reduce-scatters only).
    """
    n = len(ins)
    flat = node.typed.flat
    if node.op is OpKind.ALL_GATHER:          # each input (a router's weights and ids: two) gathered along dim
        fulls = [torch.cat([x[t].reshape(-1) if flat else x[t] for x in ins], dim=node.typed.dim)
                 for t in range(len(ins[0]))]
        if flat and shapes:
            fulls = [full.view(shape) for full, shape in zip(fulls, shapes)]
        return [list(fulls) for _ in range(n)]
    if node.op is OpKind.REDUCE_SCATTER:
        stacked, how = torch.stack([x[0].reshape(-1) if flat else x[0] for x in ins]), node.typed.reduce
        if how not in ("sum", "mean"):
            raise ValueError(f"node {node.name!r}: reduce={how!r} is not one of 'sum', 'mean'")
        total = stacked.mean(0) if how == "mean" else stacked.sum(0)
        return [[part] for part in total.chunk(n, dim=node.typed.dim)]
    if node.op is OpKind.ALL_REDUCE:
        if node.typed.reduce != "sum":        # not averaged here: the runtime only sums
            raise ValueError(f"node {node.name!r}: reduce={node.typed.reduce!r}: an all_reduce only sums")
        total = torch.stack([x[0] for x in ins]).sum(0)
        return [[total.clone()] for _ in range(n)]
    if node.op is OpKind.ALL_TO_ALL:
        mode = node.typed.mode
        if mode == "heads":
            return _a2a_heads(node, ins)
        if mode == "tokens":
            return _a2a_tokens(node, ins)
        if mode == "shards":
            return _a2a_shards(node, ins)
        raise NotImplementedError(f"no all_to_all mode {mode!r} (node {node.name!r})")
    raise NotImplementedError(f"no collective {node.op.value} (node {node.name!r})")


def _a2a_heads(node: Node, ins):
    """Each tensor: split along split_dim into n, send part j to rank j, concat received along cat_dim."""
    n, split_dim, cat_dim = len(ins), node.typed.split_dim, node.typed.cat_dim
    outs = [[] for _ in range(n)]
    for t in range(len(ins[0])):
        parts = [x[t].chunk(n, dim=split_dim) for x in ins]
        for j in range(n):
            outs[j].append(torch.cat([parts[r][j] for r in range(n)], dim=cat_dim))
    return outs


def _a2a_shards(node: Node, ins):
    """Reduce-scatter as an exchange: each tensor split along split_dim into n shards, shard j to
    rank j, which stacks what it receives: [.., X, ..] -> [n, .., X/n, ..] (the sum is left to a
    local FP32 reduction, MegaScale-MoE §5). flat=True flattens first."""
    n, split_dim, flat = len(ins), node.typed.split_dim, node.typed.flat
    outs = [[] for _ in range(n)]
    for t in range(len(ins[0])):
        parts = [(x[t].reshape(-1) if flat else x[t]).chunk(n, dim=split_dim) for x in ins]
        for j in range(n):
            outs[j].append(torch.stack([parts[r][j] for r in range(n)]))
    return outs


def _a2a_tokens(node: Node, ins):
    """Uneven row exchange. to_experts splits by the sender's index map; from_experts by the recv map."""
    n, p = len(ins), node.typed.payloads
    # either direction splits by the map it reads: the sender's index map (to_experts) or the
    # recv map (from_experts); both carry ``splits``. Each payload ([R, ..]) is split alike.
    parts = [[torch.split(x[t], list(x[p].splits)) for t in range(p)] for x in ins]
    outs = [[torch.cat([parts[r][t][j] for r in range(n)]) for t in range(p)] for j in range(n)]
    if node.typed.emit_map:
        for j in range(n):
            outs[j].append(_recv_map([x[p] for x in ins], j))
    return outs


def _recv_map(send_maps: list[IndexMap], dest: int) -> RecvMap:
    """Segments arrive source by source; within a source, by expert (the sender's order)."""
    segments, splits = [], []
    for m in send_maps:
        per_dest = len(m.segments) // len(m.splits)
        segments.extend(m.segments[dest * per_dest:(dest + 1) * per_dest])
        splits.append(m.splits[dest])
    return RecvMap(tuple(segments), tuple(splits))
