"""moegraph.limits: each multiplier against its limit, the graph-size estimate, and that the
estimate made before tracing is a true lower bound of every registry model's layer."""

from __future__ import annotations

import pytest

from moegraph.ir import ConfigError, Strategy
from moegraph.limits import (MAX_CHUNKS, MAX_GRAPH_NODES, MAX_LAYERS, MAX_MICRO_BATCHES, MAX_RANKS, MAX_STAGES,
                             NODES_PER_EXTRA_CHUNK, NODES_PER_LAYER, SizeLimitError, check_graph_size, estimate_graph)
from moegraph.registry import load_model, model_names
from moegraph.tracer import trace_model

LIMITS = {"layers": ("layers", MAX_LAYERS), "micro_batches": ("micro-batches", MAX_MICRO_BATCHES),
          "chunks": ("chunks", MAX_CHUNKS), "stages": ("stages", MAX_STAGES), "n": ("n", MAX_RANKS),
          "dp": ("dp", MAX_RANKS)}


@pytest.mark.parametrize("field", list(LIMITS))
def test_each_multiplier_is_bounded(field):
    shown, limit = LIMITS[field]
    kw = {"nodes_per_layer": 1}                 # the graph-size check stays out of the way here
    check_graph_size(**kw, **{field: limit})
    with pytest.raises(SizeLimitError) as err:
        check_graph_size(**kw, **{field: limit + 1})
    assert str(err.value) == f"{shown}={limit + 1:,} is over the limit of {limit:,} (moegraph.limits; docs/rules.md)"
    assert isinstance(err.value, ConfigError)      # the CLI's expected errors: one line, exit 2
    for bad in (0, -3, 2.5, True):
        with pytest.raises(SizeLimitError, match=f"^{shown}="):
            check_graph_size(**kw, **{field: bad})


def test_ranks_are_bounded_as_a_product():
    with pytest.raises(SizeLimitError, match=r"^n x dp = 1,024 x 1,024 = 1,048,576 ranks is over the limit of 131,072"):
        check_graph_size(n=1024, dp=1024)


def test_the_graph_size_is_checked_with_the_real_layer_once_traced():
    assert estimate_graph(layers=4, micro_batches=8, nodes_per_layer=94).nodes == 4 * 8 * 94
    check_graph_size(layers=1000, micro_batches=1, nodes_per_layer=100)           # exactly the limit
    with pytest.raises(SizeLimitError, match=r"^the graph would have 100,100 nodes \(~782.03MiB of host memory: "
                                             r"1,001 layers x 1 micro-batches x 100 nodes per layer\), over the "
                                             f"limit of {MAX_GRAPH_NODES:,} nodes"):
        check_graph_size(layers=1001, nodes_per_layer=100)


@pytest.mark.parametrize("model", model_names())
def test_the_estimate_before_tracing_is_a_lower_bound(model):
    """The refusal before anything is traced claims "at least": it must never exceed a real layer."""
    cfg = load_model(model)
    for strategy in (Strategy("tp", "tp", "ag-rs", 2), Strategy("sp", "ep", "a2a", 2)):
        for chunks in (1, 2, 4):
            try:
                g = trace_model(cfg, Strategy(**{**strategy.as_dict(), "chunks": chunks}), batch=1, seq=256)
            except ConfigError:
                continue                         # a strategy this model refuses (n must divide its heads, ...)
            assert NODES_PER_LAYER + NODES_PER_EXTRA_CHUNK * (chunks - 1) <= len(g.nodes), (model, chunks)
