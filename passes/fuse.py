"""fuse: mark comm+compute pairs that run as one tile-level fused kernel (MegaScale-MoE §4.2).

    fuse=auto   each eligible group whose fused kernel is faster than its members one after another
    fuse=all    every eligible group (also those the per-tile overheads make slower)
    fuse=none   none (the graph is returned unchanged)

A group is a collective and the compute chain it feeds or that feeds it, matching one of the
paper's four kernels (``moegraph.cost.FusedKind``):

    a2a+gemm                  ALL_TO_ALL -> GEMM(s) of the same phase (SP output projection)
    gemm+a2a                  GEMM -> memory ops (split, rope, ...) -> ALL_TO_ALL (SP QKV projection)
    ag+scatter+grouped_gemm   ALL_GATHER -> PERMUTE -> GROUPED_GEMM(s) (ag-rs token dispatch)
    grouped_gemm+gather+rs    GROUPED_GEMM(s) [-> ADD] -> row gather -> REDUCE_SCATTER (ag-rs token combine)

The row gather sums expert rows back into token rows by the index map: the combine's UNPERMUTE,
or in backward the dispatch's PERMUTE dgrad, fed by the FC1 and FC3 dgrads (summed by an ADD,
which the kernel folds into its tiles). Under ag-rs dispatch (e.g. sp+ep, n = 8; each chunk's
pairs with chunk=N) these match:

    forward   ln2_ag -> dispatch_scatter -> fc1, fc3                       ag+scatter+grouped_gemm
              fc2 -> combine_gather -> ffn_rs                               grouped_gemm+gather+rs
    backward  fc3.dgrad, fc1.dgrad -> add -> dispatch_scatter.dgrad -> ln2_ag.bwd   grouped_gemm+gather+rs

The forward dispatch is eligible because the router reads each rank's own tokens and only its
(small) result is gathered (``moegraph.lowering.blocks``: one ``routing_ag`` collective before the
token all-gather): the index map, and with it every tile's rows, is known before the tokens
arrive, as the paper's kernel needs (its tiles' signals depend on the routing, §4.2). The fused
price covers the token gather; the routing gather stays a separate small collective before the
kernel. The backward's AG+scatter (ffn_rs.bwd -> combine_gather.dgrad -> fc2.dgrad, fc2.wgrad) is
not eligible: fc2.dgrad's readers (the gate's or SwiGLU's dgrad) do not wait for fc2.wgrad, the
last GEMM and so the anchor, and with gate=after-fc2 the combine's dgrad also makes the routing
weights' gradient, read outside the group.

The pass only sets the node attribute ``moegraph.cost.FUSED_ATTR`` (``FusedGroup``) on each
member; nodes, values and edges stay as they are, so the same function is computed (the
invariant) and the runtime could run the members one by one. The cost model charges the
fused kernel's time to the group's anchor and 0 to the other members, so a group is eligible
only if that is sound for the scheduler: every value a member produces must reach a consumer
outside the group no earlier than the kernel's end. Comm-first groups put the anchor last, so
an outside consumer of an earlier member's output (a router reading the gathered tokens, a
weight gradient reading the dispatched rows) must descend from the anchor; compute-first
groups put it first, so every later member ends with it, and their other inputs must be ready
when it starts (produced by its ancestors). The scheduler still sees the members' collective as
a zero-time node: it does not model the link as busy during the kernel (docs/cost_model.md).

The chunked alternative is a separate lowering (``chunk=N``, stage 2); fuse runs after it, so
``chunk=4,fuse=all`` fuses each chunk's pairs (weights re-read per chunk) and ``fuse=all`` on
an unchunked layer fuses whole pairs (weights read once). Which one wins is the estimate's (or
the schedule's) call: per pair with fuse=auto, per layer across chunk counts.

Why auto decides per group on the group's own times and not on the layer's two-stream
estimate (``estimate.overlap_time_us``, what chunk=auto uses): that estimate ignores the
compute slowdown of SMs held by collectives, so it credits an unfused collective with free
overlap. Greedily keeping only the groups that lowered it kept 2 of 4 on mixtral-8x7b / h800,
and CP-SAT then scheduled that layer at 6,516.5 us against 6,139.6 us with all 4
(benchmarks/fuse_variants.py, 2026-11-23).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from moegraph.cost import FUSED_ATTR, CostModel, FusedGroup, FusedKind, shape_attrs
from moegraph.ir import Fuse, Graph, Node, OpKind, Role
from moegraph.passes.manager import Pass, PassResult, label, mark_rewritten, record, register

CHOICES = typing.get_args(Fuse)


@dataclass(frozen=True)
class Candidate:
    """An eligible group before it is marked: member names in graph order, the one charged the
    kernel's time, and its FusedGroup."""

    members: tuple[str, ...]
    anchor: str
    group: FusedGroup


class _Index:
    """Graph order, users, feeders and ancestor sets of a graph's nodes, by name."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.node = graph.node
        self.order = {n.name: i for i, n in enumerate(graph.nodes)}
        self._anc: dict[str, frozenset[str]] = {}
        for n in graph.nodes:              # topological order: predecessors are done first
            preds = [p.name for p in graph.predecessors(n)]
            self._anc[n.name] = frozenset(preds).union(*(self._anc[p] for p in preds))

    def ancestors(self, name: str) -> frozenset[str]:
        return self._anc[name]

    def users(self, name: str) -> list[str]:
        """Nodes consuming any output of ``name``, in graph order, without repeats."""
        seen = {c.name for v in self.node[name].outputs for c in self.graph.consumers.get(v, ())}
        return sorted(seen, key=self.order.get)

    def feeders(self, name: str) -> list[str]:
        return sorted({p.name for p in self.graph.predecessors(self.node[name])}, key=self.order.get)


def _candidate(ix: _Index, kind: FusedKind, members: list[str], anchor: str, comm: Node,
               cost: CostModel) -> Candidate | None:
    """The group if scheduling it with all time on ``anchor`` is sound (module docstring), else None."""
    mset = set(members)
    if any(FusedGroup.of(ix.node[m]) is not None for m in members):
        return None
    if anchor == members[-1]:          # comm-first: outside users of earlier members descend from the anchor
        below = {n for n in ix.node if anchor in ix.ancestors(n)}
        for m in members[:-1]:
            if any(u not in mset and u not in below for u in ix.users(m)):
                return None
    else:                              # compute-first: later members' other inputs are ready at the anchor's start
        ready = ix.ancestors(anchor) | {anchor}
        for m in members[1:]:
            if any(f not in mset and f not in ready for f in ix.feeders(m)):
                return None
    members = sorted(members, key=ix.order.get)
    compute = tuple((ix.node[m].op.value, ix.node[m].flops, ix.node[m].mem_bytes, ix.node[m].phase.value,
                     shape_attrs(dict(ix.node[m].attrs), ix.node[m].role))
                    for m in members if not ix.node[m].is_comm)
    group = FusedGroup(kind=kind, compute=compute, comm=(comm.op.value, comm.comm_bytes, comm.group, cost.scope(comm)))
    return Candidate(tuple(members), anchor, group)


def candidates(graph: Graph, cost: CostModel) -> list[Candidate]:
    """Every eligible group of ``graph``, in graph order of its collective."""
    ix = _Index(graph)
    out: list[Candidate] = []
    for c in graph.nodes:
        if not c.is_comm or c.group < 2:
            continue
        same_phase = [u for u in ix.users(c.name) if ix.node[u].phase is c.phase]
        match c.op:
            case OpKind.ALL_TO_ALL:
                if same_phase and all(ix.node[u].op is OpKind.GEMM for u in same_phase):
                    cand = _candidate(ix, "a2a+gemm", [c.name, *same_phase], same_phase[-1], c, cost)
                else:
                    cand = _compute_first_a2a(ix, c, cost)
            case OpKind.ALL_GATHER:
                cand = None
                if len(same_phase) == 1 and ix.node[same_phase[0]].op is OpKind.PERMUTE:
                    gemms = [u for u in ix.users(same_phase[0]) if ix.node[u].phase is c.phase]
                    if gemms and all(ix.node[u].op is OpKind.GROUPED_GEMM for u in gemms):
                        cand = _candidate(ix, "ag+scatter+grouped_gemm", [c.name, same_phase[0], *gemms],
                                          gemms[-1], c, cost)
            case OpKind.REDUCE_SCATTER:
                cand = None
                feeders = ix.feeders(c.name)
                if len(feeders) == 1 and _is_row_gather(ix.node[feeders[0]]):
                    chain = _gemms_summed(ix, feeders[0])
                    if chain is not None:
                        gg, adds = chain
                        cand = _candidate(ix, "grouped_gemm+gather+rs", [gg[0], *gg[1:], *adds, feeders[0], c.name],
                                          gg[0], c, cost)
            case OpKind.ALL_REDUCE:
                cand = None            # gradient synchronisation: no fused kernel in the paper
            case _:
                raise NotImplementedError(f"fuse: no rule for collective {c.op}")
        if cand is not None:
            out.append(cand)
    return out


def _is_row_gather(node: Node) -> bool:
    """Expert rows summed back into token rows by the index map: the combine's UNPERMUTE, or the
    dispatch's PERMUTE dgrad."""
    return ((node.op is OpKind.UNPERMUTE and node.role is Role.FORWARD)
            or (node.op is OpKind.PERMUTE and node.role is Role.DGRAD and node.typed.index == "token"))


def _gemms_summed(ix: _Index, gather: str) -> tuple[list[str], list[str]] | None:
    """The GROUPED_GEMMs feeding ``gather``'s rows, directly or through ADDs of their phase (the
    FC1 and FC3 dgrads' sum), in graph order, and those ADDs; None if any other node feeds the
    rows. The gather's other feeders (the index map, the routing weights) are not walked."""
    node = ix.node[gather]
    rows = node.inputs[0]                      # both kinds read the expert rows first
    producer = next((p for p in ix.feeders(gather) if rows in ix.node[p].outputs), None)
    gemms, adds, frontier = [], [], [producer] if producer is not None else []
    while frontier:
        f = ix.node[frontier.pop()]
        if f.op is OpKind.GROUPED_GEMM and f.phase is node.phase and f.name not in gemms:
            gemms.append(f.name)
        elif f.op is OpKind.ADD and f.phase is node.phase and f.name not in adds:
            adds.append(f.name)
            frontier.extend(ix.feeders(f.name))
        else:
            return None
    if not gemms:
        return None
    return sorted(gemms, key=ix.order.get), sorted(adds, key=ix.order.get)


# ops between a QKV GEMM and its all-to-all that a fused GEMM+A2A epilogue applies per tile
_EPILOGUE_OPS = frozenset({OpKind.SPLIT, OpKind.ROPE, OpKind.BIAS})


def _compute_first_a2a(ix: _Index, c: Node, cost: CostModel) -> Candidate | None:
    """GEMM -> epilogue ops -> c: walk c's feeders back through epilogue ops to one GEMM."""
    chain, frontier, roots = [], list(ix.feeders(c.name)), set()
    while frontier:
        f = frontier.pop()
        node = ix.node[f]
        if node.op is OpKind.GEMM:
            roots.add(f)
        elif node.op in _EPILOGUE_OPS and node.phase is c.phase:
            if f not in chain:
                chain.append(f)
                frontier.extend(ix.feeders(f))
        else:
            return None
    if len(roots) != 1:
        return None
    (root,) = roots
    return _candidate(ix, "gemm+a2a", [root, *chain, c.name], root, c, cost)


def mark(graph: Graph, chosen: list[Candidate]) -> Graph:
    """``graph`` with every member of the chosen groups carrying its FusedGroup attribute.

    A node runs in at most one fused kernel, so chosen groups must be disjoint. The four kinds'
    shapes never share a node in the lowered layers (every model, strategy, chunking, sar and
    compress combination checked with fuse=all), so an overlap is a bug in ``candidates``: it is
    refused by name rather than letting one group's attribute overwrite the other's."""
    attr: dict[str, dict] = {}
    owner: dict[str, Candidate] = {}
    for cand in chosen:
        for m in cand.members:
            if m in owner:
                raise ValueError(f"fuse: node {m!r} is a member of two chosen groups, {owner[m].group.kind} "
                                 f"anchored at {owner[m].anchor!r} and {cand.group.kind} anchored at {cand.anchor!r}")
            owner[m] = cand
            attr[m] = cand.group.to_attr(anchor=m == cand.anchor)
    nodes = tuple(n.with_attrs(**{FUSED_ATTR: attr[n.name]}) if n.name in attr else n for n in graph.nodes)
    return dataclasses.replace(graph, nodes=nodes)


@register("fuse", stage=5, relowers=False)
def fuse(arg: str | None = None, cost: CostModel | None = None) -> Pass:
    """Mark fused comm+compute groups (module docstring). Invariant: the same nodes, values and
    saved set (only node attributes change), so the same function and the same memory."""
    choice = arg or "auto"
    if choice not in CHOICES:
        raise ValueError(f"not one of {', '.join(CHOICES)}")
    if cost is None:
        raise ValueError("fuse needs a cost model")
    me = label("fuse", arg)

    def run(graph: Graph) -> PassResult:
        cands = [] if choice == "none" else candidates(graph, cost)
        prices = [cost.fused_price(cand.group) for cand in cands]
        chosen = [c for c, p in zip(cands, prices) if choice == "all" or p.time_us < p.unfused_us]
        new = mark(graph, chosen) if chosen else graph
        groups = []
        for cand, price in zip(cands, prices):
            groups.append({"kind": cand.group.kind, "anchor": cand.anchor, "members": list(cand.members),
                           "fused": cand in chosen, "fused_us": round(price.time_us, 3),
                           "comm_us": round(price.comm_us, 3), "compute_us": round(price.compute_us, 3),
                           "unfused_us": round(price.unfused_us, 3), "sm": price.sm, "tiles": price.tiles})
        report = {"chosen": len(chosen), "eligible": len(groups), "groups": groups}
        # the choice is recorded even where nothing fused: a stack's kinds (Qwen3-Next's gated full
        # attention has no eligible group beside its linear layers' ones) carry one strategy
        new = record(new, me, fuse=choice) if choice != "none" else new
        if chosen:
            new = mark_rewritten(new, me)
        return PassResult(new, bool(chosen), report)
    return run
