"""Whole-step memory of one rank: parameters, gradients, optimizer states, activations, buffers.

Notation (moegraph.ir): b micro-batch, s sequence, h hidden, n ranks of a stage's group
(TP/SP/EP), V vocabulary; P pipeline stages, dp data-parallel replicas, M micro-batches per step.

A rank of pipeline stage p holds, for every layer of its stage(s) and the edges it owns
(the embedding on the first stage, the final norm and LM head on the last):

  params        this rank's parameter shards in the model dtype (the graph's PARAM values:
                a replicated parameter whole, a sharded one 1/n), module buffers included
                (DeepSeek-V3's router bias: no gradient, no optimizer state);
  grads         the fp32 main gradient of every trained element (Megatron-Core accumulates
                micro-batch gradients into a contiguous fp32 buffer, never sharded);
  optimizer     Adam's fp32 master weights and two fp32 moments, sharded over the dp replicas
                as a distributed optimizer (ZeRO-1) does: 12/dp bytes per element;
  activations   what the forward leaves for the backward (``Graph.activation_bytes``: the
                saved set after rematerialization) times the micro-batches the schedule holds
                in flight at its peak (1F1B: P - p on stage p; ``in_flight``);
  comm_buffers  the point-to-point buffers of the stage boundaries: at each neighbour one
                receive and one send buffer of one micro-batch's boundary tensor [b, s/n, h]
                (the activation one way, its gradient the other).

Closed form per trained element (Megatron-Core's distributed-optimizer guide, bf16 parameters
and fp32 gradients): 2 + 4 + 12/dp = 6 + 12/dp bytes; non-distributed 18 (``OptimizerSpec``).
With fp32 parameters the master copy is the parameter itself: 4 + 4 + 8/dp.

Not modelled: the op-level transient of the backward (buffers freed within a layer; the
op-level schedule's peak covers it), allocator fragmentation, CUDA context and workspace.
The expert-parallel data-parallel group is the dp replicas for experts too (experts shard over
the n ranks inside a stage's node, MegaScale-MoE's EP); a parameter replicated over the n ranks
(SP attention, norms) keeps a full optimizer shard on each of them, sharded over dp only, as
Megatron-Core's DP group excludes the model-parallel ranks (MegaScale-MoE §6.2: SP's replicated
attention costs parameters, gradients AND optimizer states).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from moegraph.ir import DTYPE_BYTES, Graph, Phase, ValueKind
from moegraph.layers import boundary

__all__ = ["OptimizerSpec", "ADAM_DISTRIBUTED", "ADAM", "ParamCount", "StageMemory", "layer_params",
           "edge_params", "edge_activation_bytes", "edge_held_values", "boundary_bytes", "stage_memory", "pipeline_memory",
           "stack_activation_bytes", "one_f_one_b_in_flight", "rank_memory", "graph_memory", "COMPONENTS"]

COMPONENTS = ("params", "grads", "optimizer", "activations", "comm_buffers")
"""The memory components, in the order reports list them."""


@dataclass(frozen=True)
class OptimizerSpec:
    """Bytes per trained parameter element beyond the parameter itself.

    Defaults: Adam under Megatron-Core's distributed optimizer (docs "Distributed Optimizer":
    bf16 params + fp32 grads = 6 + 12/d bytes per parameter; 18 without distribution)."""

    main_grad_bytes: int = 4
    """The fp32 main gradient (not sharded)."""
    master_bytes: int = 4
    """The fp32 master copy of a low-precision parameter (none when the parameter is fp32)."""
    moment_bytes: int = 8
    """Adam's two fp32 moments (exp_avg, exp_avg_sq)."""
    distributed: bool = True
    """Master weights and moments sharded over the dp replicas (ZeRO-1)."""

    def state_bytes(self, elements: int, param_dtype_bytes: int, dp: int) -> int:
        """Optimizer-state bytes of ``elements`` trained elements on one rank (rounded up: a
        distributed optimizer pads its shards to equal sizes)."""
        master = 0 if param_dtype_bytes >= 4 else self.master_bytes
        total = elements * (master + self.moment_bytes)
        return -(-total // dp) if self.distributed else total


ADAM_DISTRIBUTED = OptimizerSpec()
ADAM = OptimizerSpec(distributed=False)


@dataclass(frozen=True)
class ParamCount:
    """Parameter elements one rank holds: ``trained`` (have a gradient) and ``buffers`` (not)."""

    trained: int
    buffers: int
    dtype_bytes: int

    def __add__(self, other: "ParamCount") -> "ParamCount":
        if self.dtype_bytes != other.dtype_bytes:
            raise ValueError(f"parameter dtypes differ: {self.dtype_bytes} vs {other.dtype_bytes} bytes per element")
        return ParamCount(self.trained + other.trained, self.buffers + other.buffers, self.dtype_bytes)

    def times(self, k: int) -> "ParamCount":
        return ParamCount(self.trained * k, self.buffers * k, self.dtype_bytes)


def layer_params(graph: Graph) -> ParamCount:
    """This rank's parameter elements of ``graph`` (a layer or a stack): its PARAM values, which
    hold this rank's shards; buffers apart (``ParamSpec.buffer``)."""
    spec = graph.param_spec
    trained = buffers = 0
    sizes = set()
    for v in graph.values:
        if v.kind is not ValueKind.PARAM:
            continue
        sizes.add(DTYPE_BYTES[v.dtype])
        if spec[v.name].buffer:
            buffers += v.numel
        else:
            trained += v.numel
    if len(sizes) > 1:
        raise ValueError(f"graph {graph.name!r} mixes parameter dtypes ({sorted(sizes)} bytes per element)")
    return ParamCount(trained, buffers, sizes.pop() if sizes else DTYPE_BYTES[graph.strategy.dtype])


def edge_params(*, vocab: int, h: int, embedding: bool, head: bool, tied: bool, dtype_bytes: int) -> ParamCount:
    """Elements of the edges a stage owns, replicated on every rank (moegraph.edges: the compiled
    model holds them whole): the embedding [V, h] (first stage), the final norm [h] and the LM
    head [V, h] (last stage). Tied embeddings (one parameter) on one stage count once; split over
    two stages each holds its copy, as Megatron-Core does (its first and last stage all-reduce the
    two copies' gradients)."""
    trained = 0
    if embedding:
        trained += vocab * h
    if head:
        trained += h + (0 if tied and embedding else vocab * h)
    return ParamCount(trained, 0, dtype_bytes)


def boundary_bytes(graph: Graph) -> int:
    """Bytes of one micro-batch's tensor crossing a stage boundary: a layer's input [b, s/n, h]
    (the activation forward, its gradient backward: same shape and dtype)."""
    return graph.value[boundary(graph)[0]].nbytes


def edge_held_values(graph: Graph) -> frozenset[str]:
    """The values the edge nodes of a model step graph (moegraph.edges, attr ``edge``) leave for
    the backward and the layers do not hold already (their saved set): what their forward makes
    (or reads from the last layer) and a backward edge node reads (normed, logits)."""
    edge_fwd = [n for n in graph.nodes if n.attr("edge", False) and n.phase is Phase.FORWARD]
    made = {o for n in edge_fwd for o in n.outputs} | {i for n in edge_fwd for i in n.inputs}
    read = {graph.base_of(i) for n in graph.nodes if n.phase is not Phase.FORWARD and n.attr("edge", False)
            for i in n.inputs if i in made}
    return frozenset(v for v in read if graph.value[v].kind is ValueKind.ACTIVATION and v not in graph.saved)


def edge_activation_bytes(graph: Graph) -> int:
    """Bytes of ``edge_held_values``: the head's activations per micro-batch."""
    return sum(graph.value[v].storage_bytes for v in edge_held_values(graph))


def stack_activation_bytes(layers: Sequence[Graph]) -> int:
    """Bytes a chain of one-layer graphs leaves for the backward (``Graph.activation_bytes`` of
    each): a layer's output is the next layer's input, one tensor, counted once where both
    layers hold it (as ``moegraph.layers.stack_layers`` makes it one value)."""
    total = 0
    for i, g in enumerate(layers):
        total += g.activation_bytes()
        if i + 1 < len(layers):
            y = boundary(g)[2]
            nxt = boundary(layers[i + 1])[0]
            if y in g.saved and nxt in layers[i + 1].saved:
                total -= g.value[y].storage_bytes
    return total


@dataclass(frozen=True)
class StageMemory:
    """One rank's peak memory of one pipeline stage (all bytes), component by component."""

    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int
    comm_buffers: int
    in_flight: int
    """Micro-batches whose activations are held at the peak."""
    activation_bytes_per_mb: int

    @property
    def states(self) -> int:
        """What the step holds whatever the schedule: parameters, gradients, optimizer, buffers."""
        return self.params + self.grads + self.optimizer + self.comm_buffers

    @property
    def total(self) -> int:
        return self.states + self.activations

    def with_in_flight(self, in_flight: int) -> "StageMemory":
        return dataclasses.replace(self, in_flight=in_flight, activations=in_flight * self.activation_bytes_per_mb)

    def as_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, **{c: getattr(self, c) for c in COMPONENTS}, "total": self.total,
                "in_flight": self.in_flight, "activation_bytes_per_mb": self.activation_bytes_per_mb}


def stage_memory(stage: int, params: ParamCount, *, dp: int, activation_bytes_per_mb: int, in_flight: int,
                 boundary: int, neighbours: int, optimizer: OptimizerSpec = ADAM_DISTRIBUTED) -> StageMemory:
    """The memory of a stage holding ``params`` whose forward leaves ``activation_bytes_per_mb``
    per micro-batch, ``in_flight`` of them at the peak; ``neighbours`` stages it exchanges
    ``boundary``-byte tensors with (0 without pipeline, 1 at an end, 2 inside)."""
    for name, value in (("dp", dp), ("in_flight", in_flight)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if neighbours not in (0, 1, 2):
        raise ValueError(f"neighbours={neighbours!r} must be 0, 1 or 2 (a stage has a previous and a next one)")
    return StageMemory(stage=stage, params=(params.trained + params.buffers) * params.dtype_bytes,
                       grads=params.trained * optimizer.main_grad_bytes,
                       optimizer=optimizer.state_bytes(params.trained, params.dtype_bytes, dp),
                       activations=in_flight * activation_bytes_per_mb, comm_buffers=2 * neighbours * boundary,
                       in_flight=in_flight, activation_bytes_per_mb=activation_bytes_per_mb)


def one_f_one_b_in_flight(stages: int, micro_batches: int) -> tuple[int, ...]:
    """Micro-batches stage p holds at 1F1B's peak: min(P - p, M) (its warm-up forwards plus the
    one of the steady state; PipeDream-Flush / Megatron's non-interleaved schedule)."""
    return tuple(min(stages - p, micro_batches) for p in range(stages))


def pipeline_memory(stage_layers: Sequence[Sequence[Graph]], *, vocab: int | None, tied: bool, dp: int,
                    in_flight: Sequence[int], head_activation_bytes: int,
                    optimizer: OptimizerSpec = ADAM_DISTRIBUTED) -> tuple[StageMemory, ...]:
    """Per stage, its memory (``stage_memory``): stage p holds the layer graphs
    ``stage_layers[p]`` (one graph per layer, the same object for identical layers), the
    embedding when p = 0 and the final norm and head when p is the last (``vocab`` None: a base
    model, no edges), ``in_flight[p]`` micro-batches at its peak; the last stage also holds the
    head's ``head_activation_bytes`` per micro-batch (``edge_activation_bytes``)."""
    P = len(stage_layers)
    if P < 1 or len(in_flight) != P:
        raise ValueError(f"{P} stages but {len(in_flight)} in-flight counts")
    out = []
    for p, layers in enumerate(stage_layers):
        if not layers:
            raise ValueError(f"stage {p} holds no layer")
        count = layer_params(layers[0])
        for g in layers[1:]:
            count = count + layer_params(g)
        first, last = p == 0, p == P - 1
        if vocab is not None:
            count = count + edge_params(vocab=vocab, h=layers[0].dims.h, embedding=first, head=last, tied=tied,
                                        dtype_bytes=count.dtype_bytes)
        act = stack_activation_bytes(layers) + (head_activation_bytes if last else 0)
        out.append(stage_memory(p, count, dp=dp, activation_bytes_per_mb=act, in_flight=in_flight[p],
                                boundary=boundary_bytes(layers[0]), neighbours=(not first) + (not last),
                                optimizer=optimizer))
    return tuple(out)


def rank_memory(stages: Sequence[StageMemory], peak_activations: int) -> dict[str, int]:
    """One rank holding the virtual stages ``stages``: their states summed, and the activations
    its schedule holds at its peak (``peak_activations``: the sum over its stages at the worst
    moment, not the sum of each stage's own peak)."""
    out = {c: sum(getattr(s, c) for s in stages) for c in COMPONENTS if c != "activations"}
    out["activations"] = peak_activations
    return {c: out[c] for c in COMPONENTS} | {"total": sum(out.values())}


def graph_memory(graph: Graph, *, vocab: int | None, tied: bool = False, dp: int | None = None,
                 in_flight: int = 1, optimizer: OptimizerSpec = ADAM_DISTRIBUTED) -> StageMemory:
    """The memory of a rank running ``graph`` (a layer or a stack, with or without the edges) as
    one pipeline stage: its parameters, the edges' when ``vocab`` is given, ``in_flight``
    micro-batches of its activations; dp from the graph's strategy unless given. What `moegraph
    trace --json` reports (``step_memory``) without solving."""
    count = layer_params(graph)
    if vocab is not None:
        count = count + edge_params(vocab=vocab, h=graph.dims.h, embedding=True, head=True, tied=tied,
                                    dtype_bytes=count.dtype_bytes)
    act = graph.activation_bytes() + edge_activation_bytes(graph)
    return stage_memory(0, count, dp=graph.strategy.dp if dp is None else dp, activation_bytes_per_mb=act,
                        in_flight=in_flight, boundary=0, neighbours=0, optimizer=optimizer)
