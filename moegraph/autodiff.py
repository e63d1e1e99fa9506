"""Reverse-mode differentiation at IR level: forward nodes in, explicit backward nodes out.

Each forward op has a VJP rule that emits backward IR nodes (data-gradient and
weight-gradient nodes separately) and returns the gradient values of its inputs. Gradients
of a value read by several nodes are summed with ADD nodes; a parameter read by several nodes
(one per token chunk) has its later weight-gradient kernels accumulate into the running sum
instead (attr accumulate=True). Parameters replicated across the group (shard_dim None) get
their per-rank partial gradients summed by an ALL_REDUCE; with data parallelism (dp > 1) every
parameter gradient is synchronised hierarchically instead (``_dp_sync``).

The unrewritten graph holds every forward activation for backward, which is how the
MegaScale-MoE paper counts a layer's activation memory without rematerialization (§4.1,
Fig 9); the ``sar`` pass shrinks that set.
"""

from __future__ import annotations

from typing import Callable

from moegraph.builder import ConfigError, GraphBuilder
from moegraph.ir import Node, OpKind, Phase, Role, ValueKind, bad_choice, collective_bytes

GRAD = ValueKind.GRAD


def add_backward(g: GraphBuilder, output: str, seed_name: str = "d_hidden_next") -> None:
    """Append backward nodes for everything upstream of ``output``; fill g.grads and g.outputs."""
    seed = g.input(seed_name, g.shape(output), kind=GRAD)
    pending: dict[str, list[str]] = {output: [seed]}
    for node in reversed(list(g.nodes)):
        if node.phase is not Phase.FORWARD:
            continue
        grads = [_accumulate(g, o, pending.pop(o, [])) for o in node.outputs]
        if not any(grads):
            continue
        rule = VJP_RULES.get(node.op)
        if rule is None:
            raise NotImplementedError(f"no backward rule for {node.op.value} (node {node.name!r})")
        for inp, d in zip(node.inputs, rule(g, node, grads)):
            if d is not None:
                pending.setdefault(inp, []).append(d)
    for inp in g.inputs:
        kind = g.values[inp].kind
        if kind is ValueKind.PARAM and g.params[inp].buffer:
            if pending.pop(inp, []):
                raise NotImplementedError(f"buffer {inp!r} received a gradient: buffers are never differentiated")
        elif kind is ValueKind.PARAM:
            g.grads[inp] = param_grad(g, inp, _accumulate_in_place(g, inp, pending.pop(inp, [])))
        elif kind is ValueKind.ACTIVATION:
            d = _accumulate(g, inp, pending.pop(inp, []))
            if d is not None:
                g.outputs.append(d)
        elif pending.get(inp):
            # a routing (or gradient) input a VJP rule differentiates: no output would carry it
            raise NotImplementedError(f"graph input {inp!r} ({kind.value}) receives a gradient from "
                                      f"{', '.join(map(repr, pending[inp]))}: only parameters and activation "
                                      "inputs are differentiated")
    g.outputs.extend(g.grads.values())


def _accumulate_in_place(g: GraphBuilder, param: str, parts: list[str]) -> str | None:
    """Sum a parameter's partial gradients (one per use, e.g. per token chunk) the way GEMM
    libraries do: each later weight-gradient kernel reads the running sum and adds into it
    (attr accumulate=True, the extra last input; ``kernels.run_compute`` applies it), so no
    separate ADD kernel re-reads a whole weight-sized gradient. Falls back to ADD nodes when a
    partial is not the single output of a weight-gradient node."""
    index = {n.outputs: i for i, n in enumerate(g.nodes)}
    acc = parts[0] if parts else None
    for k, part in enumerate(parts[1:], start=1):
        i = index.get((part,))
        node = g.nodes[i] if i is not None else None
        if node is None or node.role is not Role.WGRAD or i < index.get((acc,), len(g.nodes)):
            return _accumulate(g, param, [acc, *parts[k:]])   # plain ADD chain from here on
        g.nodes[i] = node.accumulating(acc, g.nbytes(acc))
        acc = part
    return acc


def _accumulate(g: GraphBuilder, value: str, parts: list[str]) -> str | None:
    """Sum the partial gradients of ``value``: a chain of ADD nodes named after it."""
    if not parts:
        return None
    acc = parts[0]
    for i, part in enumerate(parts[1:], start=1):
        out = g.like(f"d_{value}_sum{i}", acc, kind=_grad_kind(g, value))
        g.node(f"d_{value}.accumulate{i}", OpKind.ADD, (acc, part), (out,), phase=Phase.BACKWARD,
               role=Role.DGRAD, flops=g.values[acc].numel, block=_block_of(g, value))
        acc = out
    return acc


def param_grad(g: GraphBuilder, param: str, grad: str | None) -> str:
    if grad is None:
        raise NotImplementedError(f"parameter {param!r} receives no gradient; the graph does not use it")
    spec = g.params[param]
    if spec.shard_dim is not None and spec.shard_ranks and g.strategy.attn_nodes > 1:
        # a shard of a folded attention (Strategy.attn_nodes = N): every attention group holds the same
        # shard and computed its gradient on its own b/N rows, so the N copies are summed over attn_dp,
        # whose ranks lie among all n (span: priced on the NICs when n spans nodes)
        summed = g.like(f"d_{param}.attn_dp_sum", grad, kind=ValueKind.PARAM_GRAD)
        g.collective(f"{param}.grad_attn_dp_allreduce", OpKind.ALL_REDUCE, (grad,), (summed,),
                     group=g.strategy.attn_nodes, full_bytes=g.nbytes(grad), flops=g.values[grad].numel,
                     phase=Phase.BACKWARD, role=Role.WGRAD, block=_block_of(g, param),
                     attrs={"axis": "attn_dp", "span": g.strategy.n})
        grad = summed
    if g.strategy.dp > 1:
        return _dp_sync(g, param, grad)
    if g.params[param].shard_dim is not None or g.strategy.n == 1:
        return grad
    out = g.like(f"d_{param}.synced", grad, kind=ValueKind.PARAM_GRAD)
    # ring all-reduce = reduce-scatter + all-gather: each rank sends 2(n-1)/n of the tensor
    g.collective(f"{param}.grad_allreduce", OpKind.ALL_REDUCE, (grad,), (out,),
                 full_bytes=g.nbytes(grad), flops=g.values[grad].numel,
                 phase=Phase.BACKWARD, role=Role.WGRAD, block=_block_of(g, param))
    return out


def _dp_sync(g: GraphBuilder, param: str, grad: str) -> str:
    """Data-parallel gradient synchronisation over D = strategy.dp replicas (MegaScale-MoE A.1).

    The layer's gradient of ``param`` is cast to an FP32 main gradient, then averaged over the
    D replicas that hold the same shard. A parameter replicated across the n-rank group (SP
    attention, norms, router) first sums its n partial gradients, hierarchically:
        intra-node reduce-scatter [P] -> [P/n]        (group n, NVLink; NICs when n spans nodes)
        inter-node reduce-scatter [P/n] -> [P/(nD)]   (group D, NIC; mean over replicas)
        inter-node all-gather     [P/(nD)] -> [P/n]   (group D, NIC)
        intra-node all-gather     [P/n] -> [P]        (group n, as the reduce-scatter)
    A sharded parameter (TP/EP) takes the two inter-node steps on its shard only. Collectives
    work on the flattened gradient (attr flat=True, as on a flat gradient bucket); inter-node
    ones carry scope="inter" (the cost model prices them on the NIC; the scheduler gives them a
    stream of their own, moegraph.schedules.problem.DP_STREAM) and axis="dp" (the interpreter
    runs them across replicas). Every DP reduce-scatter is marked dp=True, which is
    what ``compress=dp-bf16`` rewrites. Lowering adds these nodes whenever strategy.dp > 1.
    """
    n, d = g.strategy.n, g.strategy.dp
    intra = g.params[param].shard_dim is None and n > 1
    kw = dict(phase=Phase.BACKWARD, role=Role.WGRAD, block=_block_of(g, param))
    numel = g.values[grad].numel
    shard = numel // n if intra else numel
    if (intra and numel % n) or shard % d:
        factors = f"n={n} x dp={d}" if intra else f"dp={d}"
        raise ConfigError(f"data-parallel sync of {param!r}: its {numel} gradient elements on this rank "
                          f"do not split evenly over {factors}")
    x = grad
    if g.values[grad].dtype != "fp32":
        x = g.like(f"d_{param}.main", grad, kind=ValueKind.PARAM_GRAD, dtype="fp32")
        g.node(f"{param}.grad_main", OpKind.CAST, (grad,), (x,), attrs={"to": "fp32"}, **kw)
    flat = {"dim": 0, "flat": True, "dp": True}
    inter = flat | {"scope": "inter", "axis": "dp"}
    if intra:
        y = g.value(f"d_{param}.rs_intra", (shard,), kind=ValueKind.PARAM_GRAD, dtype="fp32")
        g.collective(f"{param}.grad_rs_intra", OpKind.REDUCE_SCATTER, (x,), (y,), group=n, flops=numel,
                     full_bytes=numel * 4, attrs=flat | {"reduce": "sum"}, **kw)
        x = y
    y = g.value(f"d_{param}.rs_inter", (shard // d,), kind=ValueKind.PARAM_GRAD, dtype="fp32")
    g.collective(f"{param}.grad_rs_inter", OpKind.REDUCE_SCATTER, (x,), (y,), group=d, flops=shard,
                 full_bytes=shard * 4, attrs=inter | {"reduce": "mean"}, **kw)
    shape = (shard,) if intra else g.values[grad].shape
    z = g.value(f"d_{param}.ag_inter" if intra else f"d_{param}.synced", shape,
                kind=ValueKind.PARAM_GRAD, dtype="fp32")
    g.collective(f"{param}.grad_ag_inter", OpKind.ALL_GATHER, (y,), (z,), group=d,
                 full_bytes=shard * 4, attrs=inter, **kw)
    if not intra:
        return z
    out = g.value(f"d_{param}.synced", g.values[grad].shape, kind=ValueKind.PARAM_GRAD, dtype="fp32")
    g.collective(f"{param}.grad_ag_intra", OpKind.ALL_GATHER, (z,), (out,), group=n,
                 full_bytes=numel * 4, attrs=flat, **kw)
    return out


def _grad_kind(g: GraphBuilder, value: str) -> ValueKind:
    return ValueKind.PARAM_GRAD if g.values[value].kind is ValueKind.PARAM else GRAD


def _block_of(g: GraphBuilder, value: str) -> str:
    for n in g.nodes:
        if value in n.inputs or value in n.outputs:
            return n.block
    return ""


def _grad_value(g: GraphBuilder, of: str) -> str:
    return g.like(f"d_{of}", of, kind=_grad_kind(g, of))


def _bwd(g: GraphBuilder, node: Node, suffix: str, op: OpKind, inputs, outputs, *, role=Role.DGRAD,
         flops: int = 0, attrs=None, comm_bytes: int = 0, extra_bytes: int = 0) -> None:
    """``extra_bytes``: what the backward kernel moves beyond its inputs and outputs (the default
    traffic), e.g. a chunked kernel's recomputed states and their gradients."""
    kw = dict(phase=Phase.BACKWARD, role=role, flops=flops, module=node.module, block=node.block,
              forward_of=node.name, attrs=dict(node.attrs) | (attrs or {}))
    if extra_bytes:
        kw["mem_bytes"] = g.nbytes(*dict.fromkeys(inputs)) + g.nbytes(*outputs) + extra_bytes
    if op.is_comm:
        # the transposed collective (all-gather <-> reduce-scatter, all-to-all back) moves the
        # forward's bytes over the same group, so it reuses the forward's ir.collective_bytes count
        g.node(f"{node.name}.{suffix}", op, inputs, outputs, comm_bytes=comm_bytes, group=node.group, **kw)
    else:
        g.node(f"{node.name}.{suffix}", op, inputs, outputs, **kw)


# -- VJP rules: (builder, forward node, grads of outputs) -> grads of inputs (None = no grad) --

def _gemm(g, node, grads):
    (dy,), (x, w) = grads, node.inputs
    dx, dw = _grad_value(g, x), _grad_value(g, w)
    _bwd(g, node, "dgrad", OpKind.GEMM, (dy, w), (dx,), flops=node.flops)
    _bwd(g, node, "wgrad", OpKind.GEMM, (x, dy), (dw,), role=Role.WGRAD, flops=node.flops)
    return dx, dw


def _grouped_gemm(g, node, grads):
    (dy,), (x, w, seg) = grads, node.inputs
    dx, dw = _grad_value(g, x), _grad_value(g, w)
    _bwd(g, node, "dgrad", OpKind.GROUPED_GEMM, (dy, w, seg), (dx,), flops=node.flops)
    _bwd(g, node, "wgrad", OpKind.GROUPED_GEMM, (x, dy, seg), (dw,), role=Role.WGRAD, flops=node.flops)
    return dx, dw, None


def _rmsnorm(g, node, grads):
    (dy,), (x, w) = grads, node.inputs
    dx, dw = _grad_value(g, x), _grad_value(g, w)
    _bwd(g, node, "dgrad", OpKind.RMSNORM, (x, w, dy), (dx,), flops=2 * node.flops)
    _bwd(g, node, "wgrad", OpKind.RMSNORM, (x, dy), (dw,), role=Role.WGRAD, flops=node.flops)
    return dx, dw


def _split(g, node, grads):
    mode = node.typed.mode
    if mode == "concat":
        # chunks written into one buffer: the gradient is the same buffer cut back into chunks
        (dy,) = grads
        dparts = tuple(_grad_value(g, x) for x in node.inputs)
        _bwd(g, node, "dgrad", OpKind.SPLIT, (dy,), dparts)
        return dparts
    if mode in ("split", "heads"):      # heads: the gradients interleaved back per head
        (qkv,) = node.inputs
        dqkv = _grad_value(g, qkv)
        _bwd(g, node, "dgrad", OpKind.SPLIT, tuple(grads), (dqkv,))   # concatenation: a copy, not a view
        return (dqkv,)
    raise bad_choice(node)


def _rope(g, node, grads):
    dins = tuple(_grad_value(g, x) for x in node.inputs)
    _bwd(g, node, "dgrad", OpKind.ROPE, tuple(grads), dins, flops=node.flops)
    return dins


def _attention(g, node, grads):
    # inputs: N chunks each of q, k, v; outputs: N chunks of o (N = attr chunks, default 1)
    dins = tuple(_grad_value(g, x) for x in node.inputs)
    # flash-attention backward: 5 matmuls against the forward's 2, so 2.5x the FLOPs
    _bwd(g, node, "dgrad", OpKind.ATTENTION, (*node.inputs, *node.outputs, *grads), dins,
         flops=node.flops * 5 // 2)
    return dins


def _add(g, node, grads):
    (dy,) = grads
    return dy, dy


def _data_grads(g, node, grads, *, flops: int):
    """One data-gradient node reading the forward inputs and dy, giving every input's gradient."""
    (dy,) = grads
    dins = tuple(_grad_value(g, x) for x in node.inputs)
    _bwd(g, node, "dgrad", node.op, (*node.inputs, dy), dins, flops=flops)
    return dins


def _swiglu(g, node, grads):
    return _data_grads(g, node, grads, flops=2 * node.flops)


def _router(g, node, grads):
    # inputs: x, w, and DeepSeek-V3's score bias (a buffer: it picks experts, it gets no gradient),
    # then (attr logit_bias) GPT-OSS's trained logit bias, whose gradient a second wgrad node gives
    (dweights, _), (x, w, *bias) = grads, node.inputs
    if dweights is None:
        return (None,) * len(node.inputs)
    dx, dw = _grad_value(g, x), _grad_value(g, w)
    _bwd(g, node, "dgrad", OpKind.ROUTER, (*node.inputs, dweights), (dx,), flops=node.flops)
    _bwd(g, node, "wgrad", OpKind.ROUTER, (*node.inputs, dweights), (dw,), role=Role.WGRAD, flops=node.flops)
    # then (attr expert_scale) Gemma 4's trained per-expert scale, last: a wgrad node of its own too
    trained = [a for a in ("logit_bias", "expert_scale") if node.attr(a, False)]
    dextra = [None] * (len(bias) - len(trained))
    for wrt, value in zip(trained, bias[len(dextra):]):
        dextra.append(_grad_value(g, value))
        _bwd(g, node, "bias_wgrad" if wrt == "logit_bias" else "scale_wgrad", OpKind.ROUTER,
             (*node.inputs, dweights), (dextra[-1],), role=Role.WGRAD, flops=g.values[dweights].numel,
             attrs={"wrt": wrt})
    return (dx, dw, *dextra)


def _mla_heads(g, node, grads):
    dins = tuple(_grad_value(g, x) for x in node.inputs)
    _bwd(g, node, "dgrad", OpKind.MLA_HEADS, (*node.inputs, *grads), dins, flops=node.flops)
    return dins


def _permute(g, node, grads):
    (drows,), (x, imap) = grads, node.inputs
    dx = _grad_value(g, x)
    # scatter's gradient sums the k copies of each token back: a gather by the same index map
    _bwd(g, node, "dgrad", OpKind.PERMUTE, (drows, imap), (dx,))
    return dx, None


def _unpermute(g, node, grads):
    (dy,) = grads
    if not node.typed.weighted:
        rows, imap = node.inputs
        drows = _grad_value(g, rows)
        _bwd(g, node, "dgrad", OpKind.UNPERMUTE, (dy, imap), (drows,), flops=node.flops)
        return drows, None
    rows, weights, imap = node.inputs
    drows, dweights = _grad_value(g, rows), _grad_value(g, weights)
    _bwd(g, node, "dgrad", OpKind.UNPERMUTE, (dy, rows, weights, imap), (drows, dweights), flops=node.flops)
    return drows, dweights, None


def _gate(g, node, grads):
    (dy,), (rows, gates) = grads, node.inputs
    drows, dgates = _grad_value(g, rows), _grad_value(g, gates)
    _bwd(g, node, "dgrad", OpKind.GATE, (dy, rows, gates), (drows, dgates), flops=2 * node.flops)
    return drows, dgates


def _bias(g, node, grads):
    (dy,), b = grads, node.inputs[1]
    db = _grad_value(g, b)
    # the data gradient passes through unchanged; the bias's is dy summed over the tokens
    _bwd(g, node, "wgrad", OpKind.BIAS, (dy,), (db,), role=Role.WGRAD, flops=g.values[dy].numel)
    return dy, db


def _sigmoid_gate(g, node, grads):
    return _data_grads(g, node, grads, flops=3 * node.flops)


def _square_sum(g, node, grads):
    (dss,), (x,) = grads, node.inputs
    dx = _grad_value(g, x)
    _bwd(g, node, "dgrad", OpKind.SQUARE_SUM, (x, dss), (dx,), flops=2 * g.values[x].numel)
    return (dx,)


def _rmsnorm_sharded(g, node, grads):
    (dy,), (x, w, ss) = grads, node.inputs
    dx, dw, dss = _grad_value(g, x), _grad_value(g, w), _grad_value(g, ss)
    _bwd(g, node, "dgrad", OpKind.RMSNORM_SHARDED, (x, w, ss, dy), (dx, dss), flops=2 * node.flops)
    _bwd(g, node, "wgrad", OpKind.RMSNORM_SHARDED, (x, w, ss, dy), (dw,), role=Role.WGRAD, flops=node.flops)
    return dx, dw, dss


def _norm(g, node, grads):
    # NORM (structural lowering): LayerNorm / per-head RMSNorm with a weight, or a weightless L2 norm
    (dy,), (x, *w) = grads, node.inputs
    dx = _grad_value(g, x)
    _bwd(g, node, "dgrad", OpKind.NORM, (*node.inputs, dy), (dx,), flops=2 * node.flops)
    if not w:
        return (dx,)
    dw = _grad_value(g, w[0])
    _bwd(g, node, "wgrad", OpKind.NORM, (*node.inputs, dy), (dw,), role=Role.WGRAD, flops=node.flops)
    return dx, dw


def _scale(g, node, grads):
    # attr by_input: x times a [1] buffer as well (Gemma 4's layer_scalar), which gets no gradient
    (dy,), (x, *by) = grads, node.inputs
    dx = _grad_value(g, x)
    _bwd(g, node, "dgrad", OpKind.SCALE, (dy, *by), (dx,), flops=node.flops)
    return (dx, *(None for _ in by))


def _limit(g, node, grads):
    # clamp: dy where -c <= x <= c, else 0; soft cap: dy (1 - tanh(x/c)^2); both read the input x
    (dy,), (x,) = grads, node.inputs
    dx = _grad_value(g, x)
    _bwd(g, node, "dgrad", OpKind.LIMIT, (x, dy), (dx,), flops=3 * g.values[dy].numel)
    return (dx,)


def _gated_delta(g, node, grads):
    # Gated DeltaNet's core: one backward kernel gives every input's gradient, the projections'
    # (qkvz, ba) and the weights' (conv, A_log, dt_bias, norm), as a chunked kernel's backward does;
    # about twice the forward's FLOPs (each chunk product is differentiated against both operands);
    # its bytes: the forward's chunk states recomputed (written, read back) and their gradients
    # (written, read back), twice the forward's state traffic (FLA's chunk_gated_delta_rule backward
    # recomputes h and produces dh chunk by chunk)
    (dy,) = grads
    dins = tuple(_grad_value(g, x) for x in node.inputs)
    states = node.mem_bytes - g.nbytes(*node.inputs) - g.nbytes(*node.outputs)       # the forward's
    _bwd(g, node, "dgrad", OpKind.GATED_DELTA, (*node.inputs, dy), dins, flops=2 * node.flops,
         extra_bytes=2 * max(states, 0))
    return dins


def _grouped_bias(g, node, grads):
    # rows + bias[e] (x row weight): the rows' gradient passes through; the bias's sums its rows;
    # the row weights' (gate before fc2) is the row's dy . bias[e]
    (dy,), (rows, bias, seg, *row_w) = grads, node.inputs
    db = _grad_value(g, bias)
    _bwd(g, node, "wgrad", OpKind.GROUPED_BIAS, (bias, seg, *row_w, dy), (db,), role=Role.WGRAD,
         flops=g.values[dy].numel)
    if not row_w:
        return dy, db, None
    dw = _grad_value(g, row_w[0])
    _bwd(g, node, "dgrad", OpKind.GROUPED_BIAS, (bias, seg, row_w[0], dy), (dw,), flops=g.values[dy].numel)
    return dy, db, None, dw


def _all_reduce(g, node, grads):
    # y = sum_r x_r on every rank: dx_r = sum over ranks of dy (each rank's dy is a partial)
    (dy,), (x,) = grads, node.inputs
    dx = _grad_value(g, x)
    _bwd(g, node, "bwd", OpKind.ALL_REDUCE, (dy,), (dx,), comm_bytes=node.comm_bytes, flops=g.values[dy].numel)
    return (dx,)


def _all_gather(g, node, grads):
    if len(node.inputs) > 1:            # a router's weights and expert ids: only the weights get a gradient
        return _all_gather_some(g, node, grads)
    (dy,), (x,) = grads, node.inputs
    dx = _grad_value(g, x)
    _bwd(g, node, "bwd", OpKind.REDUCE_SCATTER, (dy,), (dx,), comm_bytes=node.comm_bytes, flops=g.values[dy].numel)
    return (dx,)


def _all_gather_some(g, node, grads):
    """A gather of several values: one reduce-scatter of the gradients it has (the transposed
    collective of those values' share of the forward's bytes); None for the others."""
    dins = tuple(None if d is None else _grad_value(g, x) for x, d in zip(node.inputs, grads))
    dys = tuple(d for d in grads if d is not None)
    if len(dys) != 1:
        raise NotImplementedError(f"all_gather {node.name!r}: gradients of {len(dys)} of its {len(grads)} outputs; "
                                  "the backward reduce-scatters exactly one")
    (dy,) = dys
    _bwd(g, node, "bwd", OpKind.REDUCE_SCATTER, dys, tuple(d for d in dins if d is not None),
         comm_bytes=collective_bytes(OpKind.REDUCE_SCATTER, g.nbytes(dy), node.group), flops=g.values[dy].numel)
    return dins


def _reduce_scatter(g, node, grads):
    (dy,), (x,) = grads, node.inputs
    dx = _grad_value(g, x)
    _bwd(g, node, "bwd", OpKind.ALL_GATHER, (dy,), (dx,), comm_bytes=node.comm_bytes)
    return (dx,)


def _all_to_all(g, node, grads):
    mode = node.typed.mode
    if mode == "heads":
        dins = tuple(_grad_value(g, x) for x in node.inputs)
        # the reverse exchange: split what was gathered, gather what was split
        _bwd(g, node, "bwd", OpKind.ALL_TO_ALL, tuple(grads), dins, comm_bytes=node.comm_bytes,
             attrs={"split_dim": node.typed.cat_dim, "cat_dim": node.typed.split_dim})
        return dins
    if mode == "tokens":
        if node.typed.direction == "to_experts":
            # dispatch: gradients of the expert rows go home, split by what each rank received
            recv = node.outputs[1] if node.typed.emit_map else _recv_map_of(g, node)
            ins, direction = (grads[0], recv), "from_experts"
        elif node.typed.direction == "from_experts":
            # combine: gradients go back to the experts, split by the original send map
            ins, direction = (grads[0], _send_map_of(g, node), node.inputs[1]), "to_experts"
        else:
            raise NotImplementedError(f"no backward rule for token all_to_all direction {node.typed.direction!r} "
                                      f"(node {node.name!r}); valid: 'to_experts', 'from_experts'")
        dpayload = _grad_value(g, node.inputs[0])
        _bwd(g, node, "bwd", OpKind.ALL_TO_ALL, ins, (dpayload,), comm_bytes=node.comm_bytes,
             attrs={"direction": direction, "emit_map": False})
        return (dpayload,) + (None,) * (len(node.inputs) - 1)
    raise NotImplementedError(f"no backward rule for all_to_all mode {mode!r} (node {node.name!r})")


def _recv_map_of(g: GraphBuilder, a2a: Node) -> str:
    """The recv map emitted by the dispatch all-to-all that used the same send index map."""
    for n in g.nodes:
        if n.op is OpKind.ALL_TO_ALL and n.typed.emit_map and n.inputs[1] == a2a.inputs[1]:
            return n.outputs[1]
    raise NotImplementedError(f"all-to-all {a2a.name!r} rides on no dispatch that emits a recv map")


def _send_map_of(g: GraphBuilder, combine: Node) -> str:
    """The index map of the dispatch whose recv map this combine all-to-all reads."""
    for n in g.nodes:
        if n.op is OpKind.ALL_TO_ALL and n.typed.emit_map and n.outputs[1] == combine.inputs[1]:
            return n.inputs[1]
    raise NotImplementedError(f"combine all-to-all {combine.name!r} has no matching dispatch")


VJP_RULES: dict[OpKind, Callable] = {
    OpKind.GEMM: _gemm,
    OpKind.GROUPED_GEMM: _grouped_gemm,
    OpKind.RMSNORM: _rmsnorm,
    OpKind.SPLIT: _split,
    OpKind.ROPE: _rope,
    OpKind.ATTENTION: _attention,
    OpKind.ADD: _add,
    OpKind.SWIGLU: _swiglu,
    OpKind.ROUTER: _router,
    OpKind.PERMUTE: _permute,
    OpKind.UNPERMUTE: _unpermute,
    OpKind.GATE: _gate,
    OpKind.BIAS: _bias,
    OpKind.SIGMOID_GATE: _sigmoid_gate,
    OpKind.SQUARE_SUM: _square_sum,
    OpKind.RMSNORM_SHARDED: _rmsnorm_sharded,
    OpKind.MLA_HEADS: _mla_heads,
    OpKind.NORM: _norm,
    OpKind.GLU: _swiglu,
    OpKind.SCALE: _scale,
    OpKind.LIMIT: _limit,
    OpKind.GROUPED_BIAS: _grouped_bias,
    OpKind.GATED_DELTA: _gated_delta,
    OpKind.ALL_REDUCE: _all_reduce,
    OpKind.ALL_GATHER: _all_gather,
    OpKind.REDUCE_SCATTER: _reduce_scatter,
    OpKind.ALL_TO_ALL: _all_to_all,
}
