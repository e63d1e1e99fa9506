"""Strategy passes: choose a Strategy field and re-lower the layer with it; and
``lowering_strategy`` / ``passes_for`` / ``rewrite_as``, the typed path from a whole Strategy
value to its graph (no pipeline string in between; the driver composes it for
``CompileConfig(passes=RECORDED)``, how a schedule file's graph is rebuilt).

gate-reorder, dispatch and chunk change *how the layer is lowered* (blocks.py reads
Strategy.gate, .dispatch, .chunks), so they re-run the lowering through
``moegraph.tracer.relower`` rather than patch nodes. Each records its choice in the graph's
strategy and appends its label to strategy.passes; each refuses a graph that a rewrite pass
(compress, sar) has already changed, since re-lowering would silently drop that rewrite.
"""

from __future__ import annotations

import dataclasses
import typing

from moegraph.cost import CostModel
from moegraph.ir import Gate, Graph, Strategy, valid_dispatches
from moegraph.tracer import relower
from moegraph.limits import MAX_CHUNKS, check_limit
from moegraph.passes.estimate import overlap_time_us, serial_time_us
from moegraph.passes.compress import compress
from moegraph.passes.fuse import fuse
from moegraph.passes.manager import (BuiltPass, Pass, PassError, PassResult, label, record, register,
                                     require_unrewritten, run_passes, same_computation)
from moegraph.passes.sar import remat_label, remat_pass, remat_scope

GATE_ORDERS = typing.get_args(Gate)
DISPATCH_CHOICES = ("auto", "a2a", "ag-rs")
# chunk=auto stops once this many consecutive candidates fail to beat the best so far
# (MoNTA stops at a minimum chunk size; here the per-op latency makes the time turn up)
PATIENCE = 2
# chunk=auto's search range: at most MAX_AUTO_CHUNKS chunks, and never a graph of more than
# MAX_AUTO_NODES nodes. Unbounded, the search once tried up to 1024 chunks and picked 256 on
# mixtral-8x7b (a 10,007-node graph, 79 s to search; the scheduler then works on 10k nodes) for a
# predicted gain the per-kernel latency model cannot resolve that finely. 16 chunks of the
# tiny layer are about 600 nodes; an explicit chunk=N is not bounded.
MAX_AUTO_CHUNKS = 16
MAX_AUTO_NODES = 1000


@register("gate-reorder", stage=0, relowers=True)
def gate_reorder(arg: str | None = None, cost: CostModel | None = None) -> Pass:
    """Multiply routing weights into SwiGLU's output before FC2 ('before-fc2', the default;
    MegaScale-MoE §4.1 and Megatron-Core) or into FC2's output at the combine ('after-fc2', §7 FP8).

    Invariant: the same function (FC2 is linear without bias, so W2(p*h) = p*W2(h)); the
    unrewritten activation set gains only the gated SwiGLU output, and with 'before-fc2' the
    weight gradient no longer reads FC2's output, so ``sar`` need not keep or rebuild it.
    Under all-to-all dispatch the per-row weights take an extra all-to-all of R fp32 values
    (nodes ``gate_weights_a2a*``, priced like any collective).
    """
    gate = arg or "before-fc2"
    if gate not in GATE_ORDERS:
        raise ValueError("not a gate order")
    me = label("gate-reorder", arg)

    def run(graph: Graph) -> PassResult:
        require_unrewritten(graph, me)
        new = graph if graph.strategy.gate == gate else relower(graph, gate=gate)
        return PassResult(record(new, me, gate=gate), not same_computation(graph, new), {"gate": gate})
    return run


@register("dispatch", stage=1, relowers=True)
def dispatch(arg: str | None = None, cost: CostModel | None = None) -> Pass:
    """Token dispatch for the MoE block: all-to-all or all-gather + reduce-scatter.

    'auto' re-lowers the layer both ways and keeps the one with the smaller predicted
    forward + backward time, the serial sum of every node's cost-model time (estimate.py):
    no fixed top-k threshold, the crossover falls where the cost model puts it (bytes
    k/n * bsh for a2a vs bsh for ag-rs, at a2a's lower link efficiency, plus the n-fold router
    and permute work of ag-rs). With ffn='tp' only 'ag-rs' is valid. A group that spans whole
    nodes of the cost model's gpus_per_node (n a multiple, at least 2 nodes) also tries the
    node-spanning all-to-all (ep_nodes = n / gpus_per_node; the report's ``ep_nodes``), where a
    folded attention's groups lie within those nodes (attn_nodes a multiple of them). With
    ep_nodes > 1 or attn_nodes > 1 only the all-to-all is valid: 'auto' keeps it.

    Invariant: the same function (both dispatches route every token to the same experts);
    activation memory may differ (the choice is made on time).
    """
    choice = arg or "auto"
    if choice not in DISPATCH_CHOICES:
        raise ValueError("not a dispatch mode")
    if choice == "auto" and cost is None:
        raise ValueError("dispatch=auto needs a cost model")
    me = label("dispatch", arg)

    def run(graph: Graph) -> PassResult:
        require_unrewritten(graph, me)
        valid = valid_dispatches(graph.strategy.ffn)
        # the node-spanning dispatch, and an attention folded onto b/N rows (whose experts take tokens
        # from every rank's own rows), are an all-to-all's
        pinned = [f for f in ("ep_nodes", "attn_nodes") if getattr(graph.strategy, f) > 1]
        if pinned:
            if choice == "ag-rs":
                given = " and ".join(f"{f}={getattr(graph.strategy, f)}" for f in pinned)
                raise ValueError(f"dispatch='ag-rs' with {given}: these need the all-to-all "
                                 f"(use dispatch=a2a, or set {' and '.join(pinned)} to 1)")
            valid = ("a2a",)
        if choice != "auto" and choice not in valid:
            raise ValueError(f"dispatch={choice!r} needs ffn='ep' (ffn={graph.strategy.ffn!r}: only 'ag-rs')")
        variants = {c: {"dispatch": c} for c in (valid if choice == "auto" else (choice,))}
        n, per_node = graph.strategy.n, cost.hw.gpus_per_node if cost else 0
        if choice == "auto" and "a2a" in variants and graph.strategy.ep_nodes == 1 and per_node >= 2 \
                and n % per_node == 0 and n // per_node >= 2 \
                and (graph.strategy.attn_nodes == 1 or graph.strategy.attn_nodes % (n // per_node) == 0):
            variants[f"a2a ep_nodes={n // per_node}"] = {"dispatch": "a2a", "ep_nodes": n // per_node}
        lowered = {k: graph if all(getattr(graph.strategy, f) == v for f, v in kw.items()) else relower(graph, **kw)
                   for k, kw in variants.items()}
        predicted = {k: round(serial_time_us(g, cost), 3) for k, g in lowered.items()} if cost else {}
        key = min(predicted, key=predicted.get) if choice == "auto" else choice
        new, chosen = lowered[key], variants[key]["dispatch"]
        report = {"chosen": chosen, "ep_nodes": new.strategy.ep_nodes, "predicted_us": predicted,
                  "estimate": "serial forward+backward",
                  "ffn_forward_comm_bytes": {k: g.forward_comm_bytes("ffn") for k, g in lowered.items()}}
        return PassResult(record(new, me, dispatch=chosen), not same_computation(graph, new), report)
    return run


@register("chunk", stage=2, relowers=True)
def chunk(arg: str | None = None, cost: CostModel | None = None) -> Pass:
    """Split attention's comm/GEMM pairs and the MoE dispatch -> experts -> combine chain into
    N token chunks (blocks.py, Strategy.chunks), so chunk j's collective can overlap chunk
    j+1's compute.

    'auto' is a MoNTA-style search: for N = 1 and each larger divisor of the local sequence
    s/n up to MAX_AUTO_CHUNKS, re-lower and predict the layer's forward + backward makespan with
    a two-stream list schedule (estimate.overlap_time_us); the cost model charges every kernel
    and collective a fixed latency, so past some N more chunks cost more than the overlap they
    buy. The search stops once PATIENCE candidates in a row fail to beat the best, or at the
    first N whose graph has more than MAX_AUTO_NODES nodes (not a candidate).

    Invariant: the same function (every op chunked is token-wise, and attention sees the whole
    sequence with true positions); the same activation bytes up to rounding of per-chunk shapes.
    """
    auto = arg is None or arg == "auto"
    if not auto and (not arg.isdigit() or int(arg) < 1):
        raise ValueError("not a positive integer")
    if not auto:
        check_limit("chunks", int(arg), MAX_CHUNKS)           # before any graph is re-lowered
    if auto and cost is None:
        raise ValueError("chunk=auto needs a cost model")
    me = label("chunk", arg)

    def run(graph: Graph) -> PassResult:
        require_unrewritten(graph, me)
        if not auto:
            n_chunks = int(arg)
            new = graph if graph.strategy.chunks == n_chunks else relower(graph, chunks=n_chunks)
            predicted = {n_chunks: round(overlap_time_us(new, cost), 3)} if cost else {}
        else:
            local = graph.dims.s // graph.strategy.n
            predicted, lowered, misses = {}, {}, 0
            for n_chunks in (c for c in range(1, min(local, MAX_AUTO_CHUNKS) + 1) if local % c == 0):
                g = graph if graph.strategy.chunks == n_chunks else relower(graph, chunks=n_chunks)
                if predicted and len(g.nodes) > MAX_AUTO_NODES:
                    break
                lowered[n_chunks] = g
                predicted[n_chunks] = round(overlap_time_us(g, cost), 3)
                misses = 0 if predicted[n_chunks] == min(predicted.values()) else misses + 1
                if misses >= PATIENCE:
                    break
            n_chunks = min(predicted, key=lambda c: (predicted[c], c))
            new = lowered[n_chunks]
        report = {"chosen": n_chunks, "predicted_us": predicted, "estimate": "two-stream list schedule"}
        if auto:
            report["search"] = f"N <= {MAX_AUTO_CHUNKS} dividing s/n, graphs <= {MAX_AUTO_NODES} nodes"
        return PassResult(record(new, me, chunks=n_chunks), not same_computation(graph, new), report)
    return run


def lowering_strategy(strategy: Strategy) -> Strategy:
    """What a graph of ``strategy`` is traced for: its lowering fields (gate and chunks
    included: lowered directly, no re-lowering pass runs), no rewrite, and the labels of the
    passes that the lowering stands for (``gate-reorder`` when gate='before-fc2', ``chunk=N``
    when N > 1), so that ``rewrite_as`` completes the record."""
    relowered = (("gate-reorder",) if strategy.gate == "before-fc2" else ()) + \
        ((label("chunk", str(strategy.chunks)),) if strategy.chunks > 1 else ())
    return dataclasses.replace(strategy, remat="none", remat_budget=None, compress="none", fuse="none",
                               passes=relowered)


def passes_for(strategy: Strategy, cost: CostModel | None) -> list[BuiltPass]:
    """The rewrite passes ``strategy`` records, built from its typed fields (compress, remat and
    remat_budget, fuse), in stage order for ``run_passes``. The lowering fields (gate, chunks,
    dispatch, ...) are not passes here: the graph is lowered for them."""
    out: list[BuiltPass] = []
    if strategy.compress != "none":
        out.append(BuiltPass(label("compress", strategy.compress), compress(strategy.compress, cost)))
    if strategy.remat != "none":
        out.append(BuiltPass(remat_label(strategy.remat, strategy.remat_budget),
                             remat_pass(strategy.remat, strategy.remat_budget, cost), remat_scope(strategy.remat)))
    if strategy.fuse != "none":
        out.append(BuiltPass(label("fuse", strategy.fuse), fuse(strategy.fuse, cost)))
    return out


def rewrite_as(graph: Graph, strategy: Strategy, cost: CostModel | None) -> tuple[Graph, dict]:
    """``graph`` (lowered for ``strategy``'s lowering fields) rewritten by ``passes_for(strategy)``.
    The result's strategy must equal ``strategy`` in every typed field (else PassError naming
    them: the graph was lowered for another strategy); ``strategy.passes``, when not empty, is
    kept as the record (how the passes were spelled when the graph was first built)."""
    graph, report = run_passes(graph, passes_for(strategy, cost))
    got, want = graph.strategy, strategy
    differ = [f.name for f in dataclasses.fields(Strategy)
              if f.name != "passes" and getattr(got, f.name) != getattr(want, f.name)]
    if differ:
        raise PassError("the rebuilt graph's strategy differs from the one asked for in "
                        + ", ".join(f"{k} ({getattr(got, k)!r}, not {getattr(want, k)!r})" for k in differ))
    if strategy.passes:
        graph = dataclasses.replace(graph, strategy=strategy)
    return graph, report
