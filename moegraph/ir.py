"""The operator-graph IR: values, nodes, graphs, and the one verifier.

Notation (MegaScale-MoE Table 1), used in every shape comment in this package:
    b: micro-batch   s: sequence   h: hidden   n: group size (TP/SP/EP degree)
    k: top-k         m: q/kv head ratio        f: h_ffn / h     E: experts

A graph holds one MoE layer, forward *and* backward, as seen by one rank. Every rank
runs the same graph (SPMD); collectives name their group size. Backward is explicit:
data-gradient (``Role.DGRAD``) and weight-gradient (``Role.WGRAD``) nodes are separate so
a scheduler can move weight-gradient GEMMs into communication gaps.

Shapes are *planning* shapes. Rows of token-routed values (``Value.routed``) depend on the
router at run time; the IR records the balanced expectation (b*s*k/n rows per rank), which
is what the cost model and memory accounting use. The interpreter and runtime run the real,
data-dependent counts.

Everything here is a frozen dataclass; a pass builds a new graph with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

# the enumerations and the attribute records live in their own modules (the records name op kinds,
# verify reads the records); every name stays importable from here
from moegraph.kinds import (COMM_OPS, EXPERT_ROWS, LAYER_ATTR, ExpertRows, GraphError, OpKind, Phase,  # noqa: F401
                            Role, ValueKind, check_expert_rows)
from moegraph.node_attrs import (CHOICE_ATTRS, AttrError, NodeAttrs, PermuteIndex, Scoring,  # noqa: F401
                                 SplitMode, attrs_of, bad_choice)
from moegraph.strategy import (ActDtype, Attn, Compress, ConfigError, Dispatch, Ffn, Fuse, Gate, Remat,  # noqa: F401
                               LATER_FIELDS, Strategy, valid_dispatches)


def collective_bytes(op: OpKind, full_tensor_bytes: int, n: int) -> int:
    """Bytes one rank sends in a ring/pairwise collective over n ranks: the ``Node.comm_bytes`` rule.

    The one copy of the bytes-on-the-wire rule: lowering (``GraphBuilder.collective``), passes
    and calibration all call it.
    ALL_GATHER / REDUCE_SCATTER: full*(n-1)/n, full = the gathered (or pre-scatter) tensor.
    ALL_TO_ALL: input*(n-1)/n, input = this rank's send buffer (it keeps 1/n for itself).
    ALL_REDUCE: 2*full*(n-1)/n (a reduce-scatter then an all-gather).
    P2P: full, n = 2 (the sender sends the whole tensor to the receiver: a pipeline stage boundary).
    The tensor must split into n equal whole-byte shards, so the result is exact; anything
    else raises ValueError (lowering turns it into a ConfigError naming the node), never a
    silently rounded byte count.
    """
    if n < 2:
        raise ValueError(f"collective group size n={n} must be >= 2")
    if op is OpKind.P2P:
        if n != 2 or full_tensor_bytes < 0:
            raise ValueError(f"a point-to-point transfer has group n=2 and bytes >= 0, got n={n}, bytes={full_tensor_bytes}")
        return full_tensor_bytes
    if full_tensor_bytes < 0 or full_tensor_bytes % n:
        raise ValueError(f"full_tensor_bytes={full_tensor_bytes} is not divisible by n={n}")
    shard = full_tensor_bytes // n
    match op:
        case OpKind.ALL_GATHER | OpKind.REDUCE_SCATTER | OpKind.ALL_TO_ALL:
            return shard * (n - 1)
        case OpKind.ALL_REDUCE:
            return 2 * shard * (n - 1)
    raise NotImplementedError(f"no cost rule for {op}")


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int64": 8, "int32": 4}


@dataclass(frozen=True)
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: ValueKind
    alias_of: str | None = None  # a view into another value: no storage of its own
    routed: bool = False         # dim 0 is a data-dependent token count (balanced expectation here)

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"value {self.name!r}: dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise ValueError(f"value {self.name!r}: shape {self.shape} must be non-negative ints")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    @property
    def storage_bytes(self) -> int:
        """Bytes this value adds to device memory (0 for views)."""
        return 0 if self.alias_of else self.nbytes


def freeze_attrs(attrs: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()) -> tuple[tuple[str, Any], ...]:
    items = attrs.items() if isinstance(attrs, Mapping) else attrs
    return tuple(sorted((str(k), _freeze(v)) for k, v in items))


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return freeze_attrs(v)
    return v


@dataclass(frozen=True)
class Node:
    """One kernel (compute) or one collective (comm), as run by each rank.

    flops:      floating-point operations on this rank.
    mem_bytes:  bytes moved through device memory (reads + writes) on this rank.
    comm_bytes: bytes this rank sends over the network; 0 for compute (``collective_bytes``:
                ring all-gather and reduce-scatter send (n-1)/n of the full tensor,
                all-to-all (n-1)/n of the rank's input, all-reduce twice a ring's).
    group:      collective group size n (0 for compute).
    module:     qualified name of the nn.Module this node was lowered from (for errors and
                for grouping into attention / ffn).
    forward_of: for backward and recompute nodes, the forward node they derive from.
    """

    name: str
    op: OpKind
    phase: Phase
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    role: Role = Role.FORWARD
    flops: int = 0
    mem_bytes: int = 0
    comm_bytes: int = 0
    group: int = 0
    module: str = ""
    block: str = ""              # "attention" | "ffn" | "" : which half of the layer
    forward_of: str | None = None
    attrs: tuple[tuple[str, Any], ...] = ()

    @property
    def is_comm(self) -> bool:
        return self.op.is_comm

    @property
    def layer(self) -> int | None:
        """The node's layer index in a multi-layer graph (``moegraph.layers``), None in a one-layer graph."""
        return self.attr(LAYER_ATTR, None)

    @functools.cached_property
    def typed(self) -> NodeAttrs:
        """The attributes as the op's typed record (``moegraph.node_attrs``): read ``node.typed.eps``,
        not ``node.attr("eps")``; AttrError naming the node for an unknown, wrong-typed or missing one."""
        return attrs_of(self)

    def attr(self, key: str, default: Any = dataclasses.MISSING) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        if default is dataclasses.MISSING:
            raise KeyError(f"node {self.name!r} ({self.op.value}) has no attribute {key!r}")
        return default

    def with_attrs(self, **updates: Any) -> "Node":
        merged = dict(self.attrs)
        merged.update(updates)
        return dataclasses.replace(self, attrs=freeze_attrs(merged))

    def accumulating(self, acc: str, acc_bytes: int) -> "Node":
        """This weight-gradient node adding its result into ``acc`` (the earlier partials' sum, read
        last, ``acc_bytes`` read once more): attrs accumulate / accumulate_bytes, which
        ``kernels.run_compute`` applies and the cost model prices."""
        return dataclasses.replace(self, inputs=self.inputs + (acc,), mem_bytes=self.mem_bytes + acc_bytes,
                                   attrs=self.with_attrs(accumulate=True, accumulate_bytes=acc_bytes).attrs)


@dataclass(frozen=True)
class ParamSource:
    """One module parameter, optionally narrowed (e.g. the gate half of a fused gate_up).

    The view is taken in this order: ``unflatten`` E views a flat [E*f, ...] tensor as [E, f, ...]
    (DBRX's experts), ``transpose`` swaps the last two dims (weights stored [..., in, out], as
    GPT-OSS's and Llama 4's experts), then ``narrow`` keeps ``length`` entries of ``dim`` from
    ``start`` every ``step`` (step 2: the interleaved gate/up halves of GPT-OSS)."""

    qualname: str
    narrow: tuple[int, int, int] | None = None  # (dim, start, length)
    step: int = 1
    transpose: bool = False
    unflatten: int | None = None

    def view(self, t):
        """This source's view of the module tensor ``t`` (no copy; writable, for gradients)."""
        if self.unflatten is not None:
            t = t.unflatten(0, (self.unflatten, -1))
        if self.transpose:
            t = t.transpose(-2, -1)
        if self.narrow is not None:
            dim, start, length = self.narrow
            if self.step == 1:
                t = t.narrow(dim, start, length)
            else:
                index = [slice(None)] * t.dim()
                index[dim] = slice(start, start + self.step * (length - 1) + 1, self.step)
                t = t[tuple(index)]
        return t


@dataclass(frozen=True)
class ParamSpec:
    """How a graph parameter value is cut from the module's full parameters on rank r.

    Each source is narrowed, then (if shard_dim is not None) split into n equal parts along
    shard_dim and part r kept, and the sources are concatenated along cat_dim.
    shard_dim None means the parameter is replicated on every rank of the group.
    shard_ranks G > 0 (an attention on a node's G ranks: Strategy.attn_nodes) splits into G parts
    instead and keeps part r mod G: each node holds the whole parameter once (``shards``).
    """

    sources: tuple[ParamSource, ...]
    shard_dim: int | None
    cat_dim: int = 0
    # a module buffer (e.g. DeepSeek-V3's router score-correction bias): read by the graph,
    # never differentiated; it has no gradient and the runtime holds it as a buffer
    buffer: bool = False
    # left out of the repr (and so of graph_digest, which records the Strategy's attn_nodes that sets it)
    # so digests from before the field keep holding
    shard_ranks: int = field(default=0, repr=False)

    def shards(self, n: int) -> int:
        """How many parts a sharded parameter is split into on a group of n ranks."""
        return self.shard_ranks or n


@dataclass(frozen=True)
class Dims:
    """Layer sizes. b, s, h, n, k as in Table 1; heads/kv_heads give m; ffn gives f."""

    b: int
    s: int
    h: int
    n: int
    k: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int                      # h_ffn, per expert
    experts: int

    @property
    def m(self) -> float:
        return self.heads / self.kv_heads

    @property
    def f(self) -> float:
        return self.ffn / self.h


@dataclass(frozen=True)
class Graph:
    """A verified DAG. ``nodes`` is in a valid topological order.

    inputs:  graph inputs (the layer input, this rank's parameter shards, the seed gradient
             of the layer output).
    outputs: the layer output, the gradient of the layer input, and every parameter gradient.
    saved:   forward values held from the forward pass until backward (activation memory).
    params:  parameter value name -> how it is cut from the module.
    grads:   parameter value name -> the value holding its final gradient.
    """

    name: str
    dims: Dims
    strategy: Strategy
    values: tuple[Value, ...]
    nodes: tuple[Node, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    saved: frozenset[str] = frozenset()
    params: tuple[tuple[str, ParamSpec], ...] = ()
    grads: tuple[tuple[str, str], ...] = ()
    meta: tuple[tuple[str, Any], ...] = field(default=(), compare=True)

    @functools.cached_property
    def value(self) -> dict[str, Value]:
        return {v.name: v for v in self.values}

    @functools.cached_property
    def node(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    @functools.cached_property
    def producer(self) -> dict[str, Node]:
        return {out: n for n in self.nodes for out in n.outputs}

    @functools.cached_property
    def consumers(self) -> dict[str, tuple[Node, ...]]:
        acc: dict[str, list[Node]] = {v.name: [] for v in self.values}
        for n in self.nodes:
            for i in dict.fromkeys(n.inputs):
                acc[i].append(n)
        return {k: tuple(v) for k, v in acc.items()}

    @functools.cached_property
    def param_spec(self) -> dict[str, ParamSpec]:
        return dict(self.params)

    @functools.cached_property
    def grad_of(self) -> dict[str, str]:
        return dict(self.grads)

    def predecessors(self, node: Node) -> tuple[Node, ...]:
        """Nodes producing this node's inputs (graph inputs have none), without repeats."""
        prods = (self.producer.get(i) for i in node.inputs)
        return tuple({p.name: p for p in prods if p is not None}.values())

    def meta_get(self, key: str, default: Any = None) -> Any:
        return dict(self.meta).get(key, default)

    def with_meta(self, **updates: Any) -> "Graph":
        merged = dict(self.meta)
        merged.update(updates)
        return dataclasses.replace(self, meta=freeze_attrs(merged))

    def activation_bytes(self) -> int:
        """Bytes of forward activations held for backward (views excluded)."""
        return sum(self.value[v].storage_bytes for v in self.saved
                   if self.value[v].kind is ValueKind.ACTIVATION)

    def base_of(self, name: str) -> str:
        """The value holding ``name``'s storage: itself, or the end of its chain of views."""
        seen = set()
        while (alias := self.value[name].alias_of) is not None:
            if name in seen:
                raise GraphError(f"value {name!r} is a view of itself (an alias cycle)")
            seen.add(name)
            name = alias
        return name

    def forward_comm_bytes(self, block: str) -> int:
        """Bytes the forward's collectives of ``block`` ("attention", "ffn") move per rank."""
        return sum(n.comm_bytes for n in self.nodes if n.is_comm and n.phase is Phase.FORWARD and n.block == block)

    def nodes_in(self, phase: Phase) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.phase is phase)


def graph_digest(graph: Graph) -> str:
    """sha256 of everything that decides what a rank computes and what it costs: name, dims,
    strategy, every value and node (all fields, costs included), inputs, outputs, the saved set,
    parameter specs and gradients. Not ``meta`` (pass bookkeeping). The one graph digest: the
    tune cache keys on it, and an execution plan hashes it so every rank runs the same graph.
    Deterministic across processes: reprs of frozen dataclasses, enums, tuples; ``saved`` sorted.
    """
    h = hashlib.sha256()
    # the strategy's repr leaves out the node fields at their default: digests from before them keep holding
    st = graph.strategy
    strategy = "Strategy(" + ", ".join(f"{f.name}={getattr(st, f.name)!r}" for f in dataclasses.fields(st)
                                       if f.name not in LATER_FIELDS or getattr(st, f.name) != 1) + ")"
    h.update(("(" + ", ".join([repr(graph.name), repr(graph.dims), strategy] + [repr(x) for x in (
        graph.inputs, graph.outputs, sorted(graph.saved), graph.params, graph.grads)]) + ")").encode())
    for v in graph.values:
        h.update(repr(v).encode())
    for n in graph.nodes:
        h.update(repr(n).encode())
    return h.hexdigest()


def verify(graph: Graph) -> Graph:
    """Check the graph is well formed; raise GraphError naming the first bad node.

    Checks: unique names; every input defined before use (so no cycles, topological order);
    each value produced once and never a graph input too; comm nodes carry a group size > 1
    dividing nothing illegal; compute nodes carry none; outputs/saved/params/grads refer to
    existing values; forward nodes read no gradients; views point at existing values; every node's
    attributes fit its op's record (``moegraph.node_attrs``: known keys, right types, required ones
    present); an all-reduce sums (no ``reduce`` but "sum").
    Returns the graph so it can be chained.
    """
    names = [v.name for v in graph.values]
    dup = _first_duplicate(names)
    if dup:
        raise GraphError(f"value {dup!r} is declared twice")
    dup = _first_duplicate([n.name for n in graph.nodes])
    if dup:
        raise GraphError(f"node {dup!r} is declared twice")
    known = graph.value
    defined: set[str] = set()
    for name in graph.inputs:
        if name not in known:
            raise GraphError(f"graph input {name!r} is not a declared value")
        defined.add(name)
    for node in graph.nodes:
        _verify_node(graph, node, defined)
        for out in node.outputs:
            defined.add(out)
    for name in graph.outputs:
        if name not in defined:
            raise GraphError(f"graph output {name!r} is never produced\n{format_graph(graph)}")
    for name in graph.saved:
        if name not in defined:
            raise GraphError(f"saved value {name!r} is never produced")
    for pname, _ in graph.params:
        if pname not in graph.inputs or known[pname].kind is not ValueKind.PARAM:
            raise GraphError(f"parameter {pname!r} must be a graph input of kind param")
    for pname, gname in graph.grads:
        if gname not in defined or known[gname].shape != known[pname].shape:
            raise GraphError(f"gradient {gname!r} of parameter {pname!r} is missing or mis-shaped")
    for v in graph.values:
        if v.alias_of is not None and v.alias_of not in known:
            raise GraphError(f"value {v.name!r} is a view of unknown value {v.alias_of!r}")
    for v in graph.values:
        graph.base_of(v.name)            # raises on an alias cycle
    return graph


def _verify_node(graph: Graph, node: Node, defined: set[str]) -> None:
    where = f"node {node.name!r} ({node.op.value}, {node.phase.value})"
    for i in node.inputs:
        if i not in graph.value:
            raise GraphError(f"{where} reads unknown value {i!r}")
        if node.phase is Phase.FORWARD and graph.value[i].kind is ValueKind.GRAD:
            raise GraphError(f"{where} is a forward node but reads gradient {i!r}")
        if i not in defined:
            raise GraphError(f"{where} reads {i!r} before it is produced (cycle or bad order)")
    if not node.outputs:
        raise GraphError(f"{where} produces nothing")
    for o in node.outputs:
        if o not in graph.value:
            raise GraphError(f"{where} writes undeclared value {o!r}")
        if o in defined:
            raise GraphError(f"{where} writes {o!r}, which is already produced or a graph input")
    if node.is_comm:
        if node.group < 2:
            raise GraphError(f"{where} is a collective without a group size > 1 (group={node.group})")
    elif node.group or node.comm_bytes:
        raise GraphError(f"{where} is compute but has group={node.group}, comm_bytes={node.comm_bytes}")
    if node.phase is not Phase.FORWARD and node.forward_of is not None and node.forward_of not in graph.node:
        raise GraphError(f"{where} derives from unknown forward node {node.forward_of!r}")
    if min(node.flops, node.mem_bytes, node.comm_bytes) < 0:
        raise GraphError(f"{where} has a negative cost field")
    if node.op is OpKind.ALL_TO_ALL and node.attr("mode") == "tokens":
        _verify_token_exchange(graph, node, where)
    if node.op is OpKind.ALL_REDUCE and node.attr("reduce", "sum") != "sum":
        raise GraphError(f"{where} has reduce={node.attr('reduce')!r}: an all-reduce only sums (a mean is "
                         "modelled for reduce-scatters only)")
    node.typed                       # its op's attribute record: raises AttrError naming the bad key


def _verify_token_exchange(graph: Graph, node: Node, where: str) -> None:
    """Token all-to-all: ``payloads`` row tensors (same rows) and its map(s) in, as many (+ recv map) out."""
    p = node.attr("payloads", 1)
    if isinstance(p, bool) or not isinstance(p, int) or p < 1 or len(node.inputs) <= p:
        raise GraphError(f"{where}: a token all-to-all reads payloads={p!r} row tensors (>= 1) and then its "
                         f"split map, but has {len(node.inputs)} inputs")
    if len(node.outputs) != p + bool(node.attr("emit_map", False)):
        raise GraphError(f"{where}: writes {len(node.outputs)} values; expected its {p} payload(s)"
                         + (" and the recv map" if node.attr("emit_map", False) else ""))
    rows = {graph.value[v].shape[0] for v in node.inputs[:p]} | {graph.value[v].shape[0] for v in node.outputs[:p]}
    if len(rows) != 1:
        raise GraphError(f"{where}: its payloads {node.inputs[:p]} -> {node.outputs[:p]} differ in rows {sorted(rows)}")


def _first_duplicate(items: list[str]) -> str | None:
    seen: set[str] = set()
    for x in items:
        if x in seen:
            return x
        seen.add(x)
    return None


def format_graph(graph: Graph) -> str:
    """One line per node: name, op, phase, inputs -> outputs (for error messages and debugging)."""
    lines = [f"graph {graph.name}: {len(graph.nodes)} nodes"]
    for n in graph.nodes:
        lines.append(f"  {n.name:<28} {n.op.value:<15} {n.phase.value:<9} "
                     f"({', '.join(n.inputs)}) -> ({', '.join(n.outputs)})")
    return "\n".join(lines)
