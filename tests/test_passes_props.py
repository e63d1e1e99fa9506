"""Property tests over random valid configurations and random pipelines (hypothesis).

1. No pipeline of passes yields a graph the verifier rejects; the only failure allowed is the
   documented one (a SAR budget below the smallest footprint), reported as PassError.
2. Activation memory never rises under sar, for any policy, and for any keep-set SAR can plan.
"""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import small_layer
from moegraph.cost import CostModel
from moegraph.ir import Phase, Strategy, verify
from moegraph.registry import load_hardware
from moegraph.tracer import relower, trace_module
from moegraph.passes import PassError, run_pipeline
from moegraph.passes.sar import plan, unit_of

COMBOS = [("tp", "ep", "a2a"), ("tp", "ep", "ag-rs"), ("tp", "tp", "ag-rs"),
          ("sp", "ep", "a2a"), ("sp", "ep", "ag-rs"), ("sp", "tp", "ag-rs")]
COST = CostModel(load_hardware("h800"))
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.lru_cache(maxsize=None)
def base_graph(n: int):
    return trace_module(small_layer(n), Strategy("sp", "ep", "ag-rs", n), batch=2, seq=16)


@st.composite
def layer_graphs(draw):
    n = draw(st.sampled_from([1, 2, 4]))
    attn, ffn, dispatch = draw(st.sampled_from(COMBOS))
    return relower(base_graph(n), attn=attn, ffn=ffn, dispatch=dispatch,
                   chunks=draw(st.sampled_from([1, 2, 4])), gate=draw(st.sampled_from(["after-fc2", "before-fc2"])),
                   dp=draw(st.sampled_from([1, 2])), dtype=draw(st.sampled_from(["bf16", "fp32"])))


@st.composite
def pipelines(draw, graph):
    full = graph.activation_bytes()
    choices = {
        "gate-reorder": [None, "before-fc2", "after-fc2"],
        "dispatch": ["auto", "ag-rs"] + (["a2a"] if graph.strategy.ffn == "ep" else []),
        "chunk": ["auto", "1", "2", "4"],
        "compress": ["dp-bf16", "tp-fp8"],
        "sar": ["paper", "none", f"budget:{draw(st.integers(1, full))}"],   # 0 is no size (options.byte_size)
    }
    names = draw(st.lists(st.sampled_from(sorted(choices)), unique=True, max_size=5))
    items = [n if (arg := draw(st.sampled_from(choices[n]))) is None else f"{n}={arg}" for n in names]
    random.Random(draw(st.integers(0, 2**16))).shuffle(items)
    return ",".join(items)


@pytest.mark.slow
@SETTINGS
@given(st.data())
def test_no_pipeline_yields_a_graph_the_verifier_rejects(data):
    graph = data.draw(layer_graphs())
    spec = data.draw(pipelines(graph))
    try:
        out, report = run_pipeline(graph, spec, cost=COST)
    except PassError as err:
        assert "below the smallest activation footprint" in str(err), f"{spec}: {err}"
        return
    verify(out)
    assert list(out.strategy.passes) == report["pipeline"]
    if "sar" in report:
        r = report["sar"]
        assert r["activation_bytes_after"] == out.activation_bytes() <= r["activation_bytes_before"]
        assert out.saved <= set(v.name for v in out.values)
        if "budget_bytes" in r:
            assert out.activation_bytes() <= r["budget_bytes"]


@pytest.mark.slow
@SETTINGS
@given(st.data())
def test_memory_never_rises_for_any_keep_set(data):
    graph = data.draw(layer_graphs())
    units = sorted({unit_of(v) for v in graph.saved})
    keep = frozenset(data.draw(st.lists(st.sampled_from(units), unique=True)))
    p = plan(graph, keep, COST)
    verify(p.graph)
    assert p.graph.saved <= graph.saved
    assert p.graph.activation_bytes() <= graph.activation_bytes()
    # a value held after the rewrite is one the policy kept, a routing value, the input, or a view of one
    for v in p.graph.saved:
        val = p.graph.value[v]
        assert unit_of(v) in keep or val.kind.value == "routing" or v in graph.inputs or val.alias_of is not None
    assert all(n.phase is not Phase.RECOMPUTE or n.forward_of in graph.node for n in p.graph.nodes)
