"""Limits on every size that multiplies the operator graph, checked before a graph is built.

Notation (moegraph.ir): L layers stacked in one graph, M micro-batches merged into one step,
N token chunks per block, n group size, D data-parallel degree (n x D ranks), P pipeline stages.

The graph of one step has about (nodes of one layer at N chunks) x L x M nodes, and nothing
else bounds L, M or N: ``compile --micro-batches 1000000000`` once grew to 10.3 GB of memory in
180 s without a word. ``check_graph_size`` is called with plain values by every entry that
builds a graph (the CLI's layer options, ``trace_model``/``stack_layers``, ``merge_microbatches``,
the chunk pass, and the typed compile config), before the work, and raises ``SizeLimitError``:
one line naming the value and its limit, or the graph's estimated nodes and host memory and the
limit they break. Each limit is far above any real configuration and its source is given beside
it; the node limit is what keeps host memory bounded. docs/rules.md lists them with every other
rule that can refuse a configuration.

Estimates before anything is traced are lower bounds (``NODES_PER_LAYER`` and
``NODES_PER_EXTRA_CHUNK``: the smallest layer in the model registry), so they refuse only what is
certainly too big; once one layer is traced, ``stack_layers`` and ``merge_microbatches`` check
again with its real node count.
"""

from __future__ import annotations

from dataclasses import dataclass

from moegraph.ir import ConfigError
from moegraph.options import format_bytes

__all__ = ["SizeLimitError", "GraphSize", "MAX_LAYERS", "MAX_MICRO_BATCHES", "MAX_CHUNKS", "MAX_STAGES",
           "MAX_RANKS", "MAX_TOKENS", "MAX_GRAPH_NODES", "NODES_PER_LAYER", "NODES_PER_EXTRA_CHUNK", "HOST_BYTES_PER_NODE",
           "estimate_graph", "check_graph_size", "check_limit"]

# Each multiplier alone. The largest public MoE models have at most 128 layers (fields.MAX_COUNT
# bounds a model file's layers at 65,536, so L needs its own bound); pipeline schedules use M up
# to a few hundred micro-batches per step; chunk=auto searches N <= 16 (passes.strategy).
MAX_LAYERS = 1024
MAX_MICRO_BATCHES = 1024
MAX_CHUNKS = 1024
MAX_STAGES = 1024
MAX_RANKS = 2**17
"""n x D: above the largest reported training runs (~100,000 GPUs)."""
MAX_TOKENS = 2**31
"""b x s, one micro-batch's tokens: 200x Llama 4 Scout's 10M-token context. Times and bytes grow
with it, and CP-SAT's integer variables (int64) must hold the step's ticks: s = 10^14 overflowed
them with a traceback (2026-11-28)."""

# The graph as a whole. 100,000 nodes: 18x DeepSeek-V3's 58 MoE layers at 94 nodes each.
MAX_GRAPH_NODES = 100_000
NODES_PER_LAYER = 54
"""The smallest one-layer graph (forward + backward) of the registry's models: tp+tp at N = 1
(mixtral-8x7b, tiny; deepseek-v3 has 94). Measured with trace_model."""
NODES_PER_EXTRA_CHUNK = 39
"""Nodes each further token chunk adds at least (the registry's smallest: 179 - 101 nodes from
N = 2 to N = 4 for mixtral-8x7b tp+tp, i.e. 39 per chunk)."""
HOST_BYTES_PER_NODE = 8 * 2**10
"""Host memory to build and list-schedule a graph, per node: `compile --schedule greedy` of tiny
at M = 64 (3,500 nodes) peaked 20 MiB above M = 1 (6 KiB a node; the graph itself holds 1.2 KiB
a node, tracemalloc, vm 2 cores). CP-SAT takes more (about 140 KiB a node at 850 nodes) under
its own effort limit."""


class SizeLimitError(ConfigError):
    """A size that multiplies the graph is over its limit, or the graph would be: one line."""


@dataclass(frozen=True)
class GraphSize:
    """An estimate of a step graph before it is built."""

    nodes: int
    host_bytes: int
    exact_layer: bool
    """Whether the per-layer node count was measured (a traced layer), not the lower bound."""


def check_limit(what: str, value: int, limit: int) -> None:
    """SizeLimitError unless 1 <= ``value`` <= ``limit``; ``what`` names the value ("micro-batches")."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SizeLimitError(f"{what}={value!r} is not an integer")
    if value < 1:
        raise SizeLimitError(f"{what}={value} must be at least 1")
    if value > limit:
        raise SizeLimitError(f"{what}={value:,} is over the limit of {limit:,} (moegraph.limits; docs/rules.md)")


def estimate_graph(*, layers: int = 1, micro_batches: int = 1, chunks: int = 1,
                   nodes_per_layer: int | None = None) -> GraphSize:
    """Nodes and host memory of the step graph of ``layers`` x ``micro_batches`` layers of
    ``nodes_per_layer`` nodes each (None: the registry's smallest at ``chunks`` chunks)."""
    per_layer = (NODES_PER_LAYER + NODES_PER_EXTRA_CHUNK * (chunks - 1)) if nodes_per_layer is None \
        else nodes_per_layer
    nodes = per_layer * layers * micro_batches
    return GraphSize(nodes, nodes * HOST_BYTES_PER_NODE, nodes_per_layer is not None)


def check_graph_size(*, layers: int = 1, micro_batches: int = 1, chunks: int = 1, dp: int = 1, n: int = 1,
                     stages: int = 1, nodes_per_layer: int | None = None) -> GraphSize:
    """Check each multiplier against its limit, then the estimated graph (``estimate_graph``)
    against ``MAX_GRAPH_NODES``; return the estimate. Plain values, so the CLI, the API and the
    typed config share it. ``nodes_per_layer``: a traced layer's node count (at ``chunks``)."""
    for what, value, limit in (("layers", layers, MAX_LAYERS), ("micro-batches", micro_batches, MAX_MICRO_BATCHES),
                               ("chunks", chunks, MAX_CHUNKS), ("stages", stages, MAX_STAGES),
                               ("n", n, MAX_RANKS), ("dp", dp, MAX_RANKS)):
        check_limit(what, value, limit)
    if n * dp > MAX_RANKS:
        raise SizeLimitError(f"n x dp = {n:,} x {dp:,} = {n * dp:,} ranks is over the limit of {MAX_RANKS:,} "
                             "(moegraph.limits; docs/rules.md)")
    size = estimate_graph(layers=layers, micro_batches=micro_batches, chunks=chunks, nodes_per_layer=nodes_per_layer)
    if size.nodes > MAX_GRAPH_NODES:
        per = (f"{nodes_per_layer:,} nodes per layer" if nodes_per_layer is not None
               else f"at least {size.nodes // (layers * micro_batches):,} nodes per layer at {chunks} "
                  f"chunk{'s' if chunks > 1 else ''}")
        raise SizeLimitError(
            f"the graph would have {'' if size.exact_layer else 'at least '}{size.nodes:,} nodes (~"
            f"{format_bytes(size.host_bytes)} of host memory: {layers:,} layers x {micro_batches:,} micro-batches x "
            f"{per}), over the limit of {MAX_GRAPH_NODES:,} nodes (moegraph.limits; docs/rules.md): use fewer "
            "layers, micro-batches or chunks")
    return size
