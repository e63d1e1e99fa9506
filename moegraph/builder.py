"""GraphBuilder: the mutable scratchpad lowering rules and autodiff write into.

It hands out unique value and node names, fills in default memory traffic, and freezes
into an ``ir.Graph`` at the end. Nothing else in the package mutates graph state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Iterator, Mapping

from moegraph.ir import (ConfigError, Dims, Graph, Node, OpKind, ParamSpec, Phase, Role, Strategy,
                         Value, ValueKind, collective_bytes, freeze_attrs)


def check_strategy(dims: Dims, strategy: Strategy) -> None:
    """Reject strategies the layer's sizes cannot be split by, naming the values involved (the
    strategy's own fields are valid by construction: ``Strategy.__post_init__``)."""
    n = strategy.n
    dense = dims.experts == 0 and dims.k == 0     # a dense layer (DeepSeek-V3's first layers): no router
    if not dense and (dims.k < 1 or dims.k > dims.experts):
        raise ConfigError(f"top-k={dims.k} must be between 1 and the expert count {dims.experts}")
    G, N = strategy.attn_ranks, strategy.attn_nodes    # the attention's ranks, and the nodes it is data-parallel over
    across = f"n/attn_nodes={G}" if N > 1 else f"n={n}"
    for what, size in (("heads", dims.heads), ("kv_heads", dims.kv_heads), ("seq", dims.s)):
        if size % G:
            raise ConfigError(f"{across} does not divide {what}={size}" + fold_hint(dims, strategy, what))
    if dims.b % N:
        raise ConfigError(f"attn_nodes={N} does not divide the batch b={dims.b} (each node's attention takes b/N rows)")
    if strategy.ffn == "ep" and not dense and dims.experts % n:
        raise ConfigError(f"n={n} does not divide experts={dims.experts} (ffn='ep' places experts/n per rank)")
    if strategy.ffn == "tp" and dims.ffn % n:
        raise ConfigError(f"n={n} does not divide ffn_hidden={dims.ffn} (ffn='tp' splits each expert's (or the dense MLP's) h_ffn)")
    if dims.heads % dims.kv_heads:
        raise ConfigError(f"heads={dims.heads} is not divisible by kv_heads={dims.kv_heads}")


def attention_fold(n: int, heads: int, kv_heads: int, seq: int) -> int:
    """The fewest attention groups N (Strategy.attn_nodes) whose n/N ranks split the heads, kv heads and
    sequence: n over the largest such group."""
    return n // math.gcd(n, heads, kv_heads, seq)


def fold_hint(dims: Dims, strategy: Strategy, what: str) -> str:
    """For heads an expert-parallel group of n cannot split: the fold that can, as a suggestion ('' when
    the experts cannot span n either, or the attention is already folded)."""
    n = strategy.n
    if what == "seq" or strategy.attn_nodes > 1 or strategy.ffn != "ep" or not dims.experts or dims.experts % n:
        return ""
    fold = attention_fold(n, dims.heads, dims.kv_heads, dims.s)
    batch = "" if dims.b % fold == 0 else f" (--batch a multiple of {fold}: b={dims.b})"
    return (f"; the experts can still span n={n}: with dispatch='a2a', attn_nodes={fold} (--attn-nodes {fold}) runs the "
            f"attention on n/{fold}={n // fold} ranks over b/{fold} of the batch{batch}"
            + (f"; or a multiple of {fold} if fewer than {n // fold} GPUs share a node" if fold < n else ""))


class GraphBuilder:
    def __init__(self, name: str, dims: Dims, strategy: Strategy):
        self.name, self.dims, self.strategy = name, dims, strategy
        self.values: dict[str, Value] = {}
        self.nodes: list[Node] = []
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.params: dict[str, ParamSpec] = {}
        self.grads: dict[str, str] = {}
        self.saved: set[str] = set()
        self._node_names: set[str] = set()
        self._extended: frozenset[str] = frozenset()      # the continued graph's values (``extend``)
        self._in_attention_group = False                          # inside ``attention_group`` with attn_nodes > 1

    @classmethod
    def extend(cls, graph: Graph) -> "GraphBuilder":
        """A builder that continues ``graph``: its values are readable (``values``, ``shape``,
        ``like``) and new value and node names are unique against the whole graph, but ``nodes``,
        ``inputs``, ``outputs``, ``params`` and ``grads`` hold only what is added from here on
        (the caller splices them into ``graph``: ``added_values`` lists the new values)."""
        g = cls(graph.name, graph.dims, graph.strategy)
        g.values = {v.name: v for v in graph.values}
        g._node_names = {n.name for n in graph.nodes}
        g._extended = frozenset(g.values)
        return g

    def added_values(self) -> tuple[Value, ...]:
        """The values made since ``extend`` (every value of a fresh builder)."""
        return tuple(v for name, v in self.values.items() if name not in self._extended)

    @contextlib.contextmanager
    def attention_group(self) -> Iterator[None]:
        """Emit the attention block on the ranks it spans (Strategy.attn_nodes = N > 1): inside, the
        builder's strategy has n = G (n/N) and its dims b = b/N, so the attention's lowering, written
        for a group of n ranks holding [b, s/n, h], emits it for the G ranks of one node holding
        [b/N, s/G, h] (``moegraph.token_layout``); its collectives run on axis 'attn' and its sharded
        parameters are split G ways (ParamSpec.shard_ranks). With N = 1 nothing changes."""
        st = self.strategy
        if st.attn_nodes == 1:
            yield
            return
        saved = self.strategy, self.dims
        self.strategy = dataclasses.replace(st, n=st.attn_ranks, ep_nodes=1, attn_nodes=1)
        self.dims = dataclasses.replace(self.dims, b=self.dims.b // st.attn_nodes, n=st.attn_ranks)
        self._in_attention_group = True
        try:
            yield
        finally:
            (self.strategy, self.dims), self._in_attention_group = saved, False

    # -- values -------------------------------------------------------------------------
    @property
    def act_dtype(self) -> str:
        return self.strategy.dtype

    def value(self, name: str, shape: tuple[int, ...], *, kind: ValueKind = ValueKind.ACTIVATION,
              dtype: str | None = None, alias_of: str | None = None, routed: bool = False) -> str:
        name = self._unique(name, self.values)
        self.values[name] = Value(name, tuple(int(d) for d in shape), dtype or self.act_dtype, kind,
                                  alias_of=alias_of, routed=routed)
        return name

    def like(self, name: str, other: str, *, kind: ValueKind | None = None, dtype: str | None = None) -> str:
        """A new value with the shape (and routed-ness) of ``other``."""
        v = self.values[other]
        return self.value(name, v.shape, kind=kind or v.kind, dtype=dtype or v.dtype, routed=v.routed)

    def input(self, name: str, shape: tuple[int, ...], *, kind: ValueKind = ValueKind.ACTIVATION) -> str:
        name = self.value(name, shape, kind=kind)
        self.inputs.append(name)
        return name

    def param(self, name: str, shape: tuple[int, ...], spec: ParamSpec) -> str:
        if self._in_attention_group and spec.shard_dim is not None:
            spec = dataclasses.replace(spec, shard_ranks=self.strategy.n)
        name = self.input(name, shape, kind=ValueKind.PARAM)
        self.params[name] = spec
        return name

    def shape(self, name: str) -> tuple[int, ...]:
        return self.values[name].shape

    def nbytes(self, *names: str) -> int:
        return sum(self.values[v].nbytes for v in names)

    # -- nodes --------------------------------------------------------------------------
    def node(self, name: str, op: OpKind, inputs: tuple[str, ...] | list[str], outputs: tuple[str, ...] | list[str], *,
             module: str = "", block: str = "", phase: Phase = Phase.FORWARD, role: Role = Role.FORWARD,
             flops: int = 0, mem_bytes: int | None = None, comm_bytes: int = 0, group: int = 0,
             forward_of: str | None = None, attrs: Mapping[str, Any] | None = None) -> Node:
        """Append a node. mem_bytes defaults to reading every input once and writing every output once."""
        if mem_bytes is None:
            mem_bytes = self.nbytes(*dict.fromkeys(inputs)) + self.nbytes(*outputs)
        node = Node(name=self._unique(name, self._node_names), op=op, phase=phase, role=role,
                    inputs=tuple(inputs), outputs=tuple(outputs), flops=int(flops), mem_bytes=int(mem_bytes),
                    comm_bytes=int(comm_bytes), group=int(group), module=module, block=block,
                    forward_of=forward_of, attrs=freeze_attrs(attrs or {}))
        self._node_names.add(node.name)
        self.nodes.append(node)
        return node

    def collective(self, name: str, op: OpKind, inputs, outputs, *, full_bytes: int, group: int | None = None,
                   **kw) -> Node:
        """A collective over ``group`` ranks (default: the strategy's n); a no-op group of 1 is never
        emitted (callers check). ``full_bytes`` is the tensor ``ir.collective_bytes`` defines for ``op``
        (the gathered / pre-scatter tensor, or this rank's all-to-all send buffer); comm_bytes follows
        from it exactly, and a tensor that does not split into ``group`` whole-byte shards is a
        ConfigError naming the node."""
        n = self.strategy.n if group is None else group
        if self._in_attention_group:
            kw["attrs"] = {"axis": "attn"} | dict(kw.get("attrs") or {})
        try:
            comm_bytes = collective_bytes(op, full_bytes, n)
        except ValueError as err:
            raise ConfigError(f"collective {name!r} ({op.value}): {full_bytes} bytes do not split into "
                              f"{n} equal shards ({err})") from None
        return self.node(name, op, inputs, outputs, comm_bytes=comm_bytes, group=n, **kw)

    # -- freeze -------------------------------------------------------------------------
    def build(self, **meta: Any) -> Graph:
        return Graph(name=self.name, dims=self.dims, strategy=self.strategy, values=tuple(self.values.values()),
                     nodes=tuple(self.nodes), inputs=tuple(self.inputs), outputs=tuple(self.outputs),
                     saved=frozenset(self.saved), params=tuple(self.params.items()),
                     grads=tuple(self.grads.items()), meta=freeze_attrs(meta))

    @staticmethod
    def _unique(name: str, taken) -> str:
        if name not in taken:
            return name
        i = 2
        while f"{name}_{i}" in taken:
            i += 1
        return f"{name}_{i}"


