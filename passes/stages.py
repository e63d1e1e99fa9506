"""Pipeline stages: the layout (which layers each stage holds, where it runs) and the split pass.

Notation (moegraph.ir): b micro-batch, s sequence, h hidden, n ranks of a stage's group (its
TP/SP/EP group, one node), dp data-parallel replicas; P pipeline ranks, V virtual stages per
rank (S = P*V stages), L layers.

World and rank order. world = P * n * dp; global rank r of (pipeline rank p, replica d, group
member i) is ``r = (p * dp + d) * n + i`` (``world_rank``): the n ranks of a stage's group are
consecutive (one node: its all-to-alls and gathers stay on NVLink), a stage's dp replicas follow
one another, and the pipeline dimension is outermost (stage boundaries cross nodes, as
Megatron-Core lays out PP outside TP/EP/DP). Pipeline rank p's peers on the boundary tensors are
the ranks with the same (d, i) on p - 1 and p + 1: each group member sends its own shard
[b, s/n, h] to its counterpart.

Placement of virtual stages (``StageLayout.placement``): "loop" puts stage s on rank s mod P
(Megatron's interleaved 1F1B; torch's ``ScheduleInterleaved1F1B``), "v" puts stages s and
2P-1-s on rank s (torch's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``: the first and
last stage share rank 0). V = 1 is both.

Layers go to stages in order, contiguous, any count per stage (uneven layouts, as
Megatron-Core's flexible ``pipeline-model-parallel-layout``): ``balance`` cuts them so that the
costliest stage, embedding and head priced with the first and last stage, is as cheap as it can be.

The split pass (``split_stages``) rewrites a model step graph (a stack of layers with its
edges, moegraph.edges; one micro-batch) at step scope: every node gets the int attribute
``stage`` (``STAGE_ATTR``: its layer's stage; the embedding's nodes stage 0, the head's and
norm's the last), and every value one stage makes and the next one reads crosses the boundary
through a point-to-point node (``OpKind.P2P``, group 2, the whole tensor on the inter-stage link,
priced by the cost model like every collective):

    pp.<value>      P2P  stage k's <value> -> <value>@s<k+1>, read by stage k+1 in its place
                         forward: a layer's output [b, s/n, h]; backward: its input gradient

(attrs ``stage`` = the sender, ``to_stage`` = the receiver). Invariant: the same function is
computed (each reader gets the same tensor, moved), every node runs on exactly one stage, and a
value is read only on its own stage or, through one P2P, on the next or the previous one. A
value read two or more stages away (a skip connection, or the router's auxiliary loss, which
sums every layer's statistics) raises GraphError naming it: torch's pipeline runtime has no
such transfers either. ``stage_graph`` cuts one stage's part out as a verified graph.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, Iterable, Sequence

from moegraph.config import Placement
from moegraph.edges import EDGE_ATTR, EMBED_ATTR
from moegraph.ir import Graph, GraphError, Node, OpKind, Phase, Role, collective_bytes, freeze_attrs, verify
from moegraph.limits import check_graph_size
from moegraph.passes.manager import Pass, PassResult, register_model_pass

__all__ = ["STAGE_ATTR", "StageLayout", "Placement", "SplitStages", "world_rank", "rank_coords", "balance", "split_stages",
           "stage_of", "stage_graph", "subgraph"]

STAGE_ATTR = "stage"
"""Node attribute: the (virtual) pipeline stage a node runs on."""



def world_rank(pp_rank: int, replica: int, member: int, *, n: int, dp: int) -> int:
    """Global rank of pipeline rank p, data-parallel replica d, group member i (module docstring)."""
    if not (0 <= replica < dp and 0 <= member < n and pp_rank >= 0):
        raise ValueError(f"(pp rank {pp_rank}, replica {replica}, member {member}) is outside n={n}, dp={dp}")
    return (pp_rank * dp + replica) * n + member


def rank_coords(rank: int, *, n: int, dp: int) -> tuple[int, int, int]:
    """(pipeline rank, replica, member) of a global rank: the inverse of ``world_rank``."""
    if rank < 0:
        raise ValueError(f"rank={rank} must be >= 0")
    return rank // (n * dp), rank // n % dp, rank % n


@dataclass(frozen=True)
class StageLayout:
    """Which layers each stage holds and which pipeline rank runs it.

    stages:    per stage (S = P*V of them, in pipeline order), its layer indices: contiguous,
               together 0..L-1 once each, none empty.
    pp:        P, the pipeline ranks.
    placement: "loop" (stage s on rank s mod P) or "v" (stages s and 2P-1-s on rank s; V = 2).
    """

    stages: tuple[tuple[int, ...], ...]
    pp: int
    placement: Placement = "loop"

    def __post_init__(self):
        S, P = len(self.stages), self.pp
        if isinstance(P, bool) or not isinstance(P, int) or P < 1:
            raise ValueError(f"pp={P!r} must be a positive integer")
        check_graph_size(stages=S, layers=max(1, sum(len(s) for s in self.stages)))     # moegraph.limits
        if S < P or S % P:
            raise ValueError(f"{S} stages do not split over pp={P} ranks: the stage count must be a multiple of pp")
        if self.placement not in ("loop", "v"):
            raise ValueError(f"placement={self.placement!r} is not one of 'loop', 'v'")
        if self.placement == "v" and S != 2 * P:
            raise ValueError(f"placement='v' puts two stages on each rank: {S} stages need pp={S // 2}, got {P}")
        flat = [i for s in self.stages for i in s]
        if any(not s for s in self.stages):
            raise ValueError(f"stage {next(k for k, s in enumerate(self.stages) if not s)} holds no layer")
        if flat != list(range(len(flat))):
            raise ValueError(f"stages {self.stages} must hold layers 0..{len(flat) - 1} in order, each once")

    @property
    def virtual(self) -> int:
        """V, stages per pipeline rank."""
        return len(self.stages) // self.pp

    @property
    def layers(self) -> int:
        return sum(len(s) for s in self.stages)

    def rank_of(self, stage: int) -> int:
        S, P = len(self.stages), self.pp
        if not 0 <= stage < S:
            raise ValueError(f"stage={stage} is not in 0..{S - 1}")
        if self.placement == "v":
            return stage if stage < P else 2 * P - 1 - stage
        return stage % P

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s in range(len(self.stages)) if self.rank_of(s) == rank)

    def stage_of_layer(self, layer: int) -> int:
        for k, s in enumerate(self.stages):
            if layer in s:
                return k
        raise ValueError(f"layer {layer} is in no stage of {self.stages}")

    @classmethod
    def even(cls, layers: int, pp: int, virtual: int = 1, placement: Placement = "loop") -> "StageLayout":
        """Layers cut as evenly as whole layers allow, earlier stages taking the remainder."""
        S = pp * virtual
        if layers < S:
            raise ValueError(f"{layers} layers cannot fill {S} stages (pp={pp} x vpp={virtual})")
        base, extra = divmod(layers, S)
        sizes = [base + (k < extra) for k in range(S)]
        return cls(_cut(sizes), pp, placement)


def _cut(sizes: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    out, start = [], 0
    for size in sizes:
        out.append(tuple(range(start, start + size)))
        start += size
    return tuple(out)


def balance(layer_costs: Sequence[float], stages: int, *, first_extra: float = 0.0,
            last_extra: float = 0.0) -> tuple[tuple[int, ...], ...]:
    """Contiguous layers per stage minimising the costliest stage: stage cost = its layers' costs,
    plus ``first_extra`` on the first stage (the embedding) and ``last_extra`` on the last (norm,
    head, loss). Exact (dynamic programme over prefixes, O(S L^2)); ties keep earlier stages
    smaller, deterministic. Uneven layer counts come out wherever the costs call for them."""
    L = len(layer_costs)
    if stages < 1 or L < stages:
        raise ValueError(f"{L} layers cannot fill {stages} stages")
    if any((not math.isfinite(c)) or c < 0 for c in layer_costs):
        raise ValueError(f"layer costs must be finite and >= 0, got {list(layer_costs)}")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(k: int, i: int, j: int) -> float:       # stage k holds layers i..j-1
        return prefix[j] - prefix[i] + (first_extra if k == 0 else 0.0) + (last_extra if k == stages - 1 else 0.0)

    INF = float("inf")
    # best[k][j]: min over cuts of the max stage cost, stages 0..k holding layers 0..j-1
    best = [[INF] * (L + 1) for _ in range(stages)]
    cut = [[0] * (L + 1) for _ in range(stages)]
    for j in range(1, L + 1):
        best[0][j] = cost(0, 0, j)
    for k in range(1, stages):
        for j in range(k + 1, L + 1):
            for i in range(k, j):           # stage k holds i..j-1; earlier stages 0..i-1
                v = max(best[k - 1][i], cost(k, i, j))
                if v < best[k][j] - 1e-12 * max(1.0, abs(v)):
                    best[k][j], cut[k][j] = v, i
    sizes, j = [], L
    for k in reversed(range(stages)):
        i = cut[k][j] if k else 0
        sizes.append(j - i)
        j = i
    return _cut(list(reversed(sizes)))


def stage_of(node: Node) -> int:
    """The stage of a node of a split graph (``STAGE_ATTR``); GraphError when it has none."""
    k = node.attr(STAGE_ATTR, None)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise GraphError(f"node {node.name!r} has {STAGE_ATTR}={k!r}: not a node of a stage-split graph")
    return k


def _assign(node: Node, layout: StageLayout) -> int:
    """The stage a node of a model step graph runs on (module docstring)."""
    if node.layer is not None:
        return layout.stage_of_layer(node.layer)
    if node.attr(EDGE_ATTR, False):
        return 0 if node.attr(EMBED_ATTR, False) else len(layout.stages) - 1
    raise GraphError(f"node {node.name!r} belongs to no layer and to no edge: no stage to put it on")


def split_stages(layout: StageLayout) -> Pass:
    """The stage split of a model step graph (module docstring) as a pass."""

    def run(graph: Graph) -> PassResult:
        if graph.meta_get("micro_batches", 1) != 1:
            raise GraphError(f"graph {graph.name!r} holds {graph.meta_get('micro_batches')} micro-batches: split the "
                             "one-micro-batch step into stages (the pipeline schedule orders the micro-batches)")
        layers = {n.layer for n in graph.nodes if n.layer is not None}
        if layers != set(range(layout.layers)):
            raise GraphError(f"graph {graph.name!r} holds layers {sorted(layers)}, the layout {layout.layers} "
                             f"({layout.stages})")
        if any(n.attr(STAGE_ATTR, None) is not None for n in graph.nodes):
            raise GraphError(f"graph {graph.name!r} is split into stages already")
        stage = {n.name: _assign(n, layout) for n in graph.nodes}
        made_on = {v: stage[n.name] for v, n in graph.producer.items()}
        values = list(graph.values)
        declared = {v.name for v in values}
        sends: dict[str, Node] = {}          # value -> its P2P node
        readers: dict[str, dict[str, str]] = {}   # node -> {value: received name}
        for n in graph.nodes:
            k = stage[n.name]
            for v in dict.fromkeys(n.inputs):
                src = made_on.get(v)
                if src is None or src == k:
                    continue
                if abs(src - k) != 1:
                    raise GraphError(f"value {v!r} is made on stage {src} and read by {n.name!r} on stage {k}: "
                                     "only neighbouring stages exchange tensors (no skip connections)")
                recv = f"{v}@s{k}"
                if v not in sends:
                    val = graph.value[v]
                    forward = graph.producer[v].phase is Phase.FORWARD
                    if recv in declared:
                        raise GraphError(f"value {recv!r} exists already: cannot name the received {v!r}")
                    values.append(dataclasses.replace(val, name=recv, alias_of=None))
                    declared.add(recv)
                    # [b, s/n, h] on stage src -> the same shard on stage k (one transfer per group member)
                    sends[v] = Node(name=f"pp.{v}", op=OpKind.P2P, phase=Phase.FORWARD if forward else Phase.BACKWARD,
                                    inputs=(v,), outputs=(recv,), role=Role.FORWARD if forward else Role.DGRAD,
                                    comm_bytes=collective_bytes(OpKind.P2P, val.nbytes, 2), group=2,
                                    module="pipeline", block="pipeline",
                                    attrs=freeze_attrs({STAGE_ATTR: src, "to_stage": k, "scope": "inter"}))
                elif sends[v].attr("to_stage") != k:
                    raise GraphError(f"value {v!r} is read on stages {sends[v].attr('to_stage')} and {k}")
                readers.setdefault(n.name, {})[v] = recv
        nodes: list[Node] = []
        for n in graph.nodes:
            swap = readers.get(n.name, {})
            moved = dataclasses.replace(n, inputs=tuple(swap.get(v, v) for v in n.inputs)) if swap else n
            nodes.append(moved.with_attrs(**{STAGE_ATTR: stage[n.name]}))
            nodes += [sends[o] for o in n.outputs if o in sends]
        read_late = {v for n in nodes if n.phase is not Phase.FORWARD for v in n.inputs}
        saved = {v for v in graph.saved if v in read_late or v in graph.outputs}
        saved |= {p.outputs[0] for v, p in sends.items() if v in graph.saved and p.outputs[0] in read_late}
        out = dataclasses.replace(graph, values=tuple(values), nodes=tuple(nodes), saved=frozenset(saved),
                                  meta=freeze_attrs(dict(graph.meta) | {"stages": len(layout.stages),
                                                                        "pp": layout.pp}))
        return PassResult(verify(out), True, {"stages": [list(s) for s in layout.stages], "pp": layout.pp,
                                              "placement": layout.placement, "p2p": sorted(sends)})
    return run


@dataclass(frozen=True)
class SplitStages:
    """The model-level step: split a model step graph (one micro-batch, its edges added) into the
    stages of ``layout`` (``split_stages``). The pass manager runs it last (stage 12, scope step),
    after the stack and the edges it assigns to stages."""

    layout: StageLayout

    NAME: ClassVar[str] = "stages"

    def __post_init__(self):
        if not isinstance(self.layout, StageLayout):
            raise ValueError(f"layout={self.layout!r} must be a StageLayout")

    @property
    def arg(self) -> str:
        return "|".join(",".join(map(str, s)) for s in self.layout.stages)


@register_model_pass(SplitStages, stage=12)
def _split(step: SplitStages, cost=None) -> Pass:
    """The stage split of ``step.layout`` (``split_stages``), as the pass manager builds it."""
    return split_stages(step.layout)


def subgraph(graph: Graph, keep: Iterable[Node], name: str | None = None) -> Graph:
    """The verified graph of the nodes ``keep`` (in ``graph``'s order): values they read but do not
    make become inputs, values they make that the graph outputs or another node reads become
    outputs; parameters, gradients and the saved set restricted to what remains. Meta is kept (a
    merged graph's per-micro-batch barrier still applies to the nodes of each micro-batch)."""
    names = {n.name for n in keep}
    # a backward node whose forward node is left out keeps no link to it (``Node.forward_of``)
    nodes = tuple(n if n.forward_of is None or n.forward_of in names else dataclasses.replace(n, forward_of=None)
                  for n in graph.nodes if n.name in names)
    if len(nodes) != len(names):
        raise GraphError(f"subgraph of {graph.name!r}: {sorted(names - set(graph.node))[:3]} are not its nodes")
    made = {o for n in nodes for o in n.outputs}
    read = list(dict.fromkeys(v for n in nodes for v in n.inputs))
    used = set(made) | set(read)
    for v in list(used):
        while (alias := graph.value[v].alias_of) is not None:
            used.add(alias)
            v = alias
    outside = {v for n in graph.nodes if n.name not in names for v in n.inputs}
    params = tuple((p, s) for p, s in graph.params if p in used)
    inputs = tuple(dict.fromkeys([v for v in graph.inputs if v in used and v not in made]
                                 + [v for v in read if v not in made] + [p for p, _ in params]))
    outputs = tuple(v for v in dict.fromkeys([*graph.outputs, *sorted(made & outside)]) if v in made)
    defined = made | set(inputs)
    out = dataclasses.replace(
        graph, name=name or graph.name, values=tuple(v for v in graph.values if v.name in used | set(inputs)),
        nodes=nodes, inputs=inputs, outputs=outputs, saved=frozenset(v for v in graph.saved if v in defined),
        params=params, grads=tuple((p, g) for p, g in graph.grads if p in inputs and g in made))
    return verify(out)


def stage_graph(graph: Graph, stage: int, *, sends: bool = False) -> Graph:
    """Stage ``stage``'s part of a split graph (``split_stages``): its nodes, the values it
    receives as inputs; with ``sends`` also the P2P nodes it sends from."""
    keep = [n for n in graph.nodes if stage_of(n) == stage and (sends or n.op is not OpKind.P2P)]
    if not keep:
        raise GraphError(f"graph {graph.name!r} has no node on stage {stage}")
    return subgraph(graph, keep, f"{graph.name}.s{stage}")

