"""The per-chunk collective stall (hw.chunk_stall_us; docs/cost_model.md "Chunked collectives"):
a collective of a chunked decomposition pays a fixed stall beyond its time alone, fitted on a800 to
MoNTA Fig 14 at 8K, so that one call beats the chunked pipelines at small volumes and chunks win
from 32K (MoNTA, Guo et al. 2024: O1 below 16K, O2/O3 from 32K to 256K).

Expected times are MoNTA Table 8's measured per-call latencies, not values the cost model produced.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from moegraph.cost import CostModel
from moegraph.ir import Node, OpKind, Phase, Strategy
from moegraph.passes import run_pipeline
from moegraph.registry import load_hardware, load_model
from moegraph.tracer import trace_model

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
A800 = load_hardware("a800")
KAPPA_ALPHA_US = A800.kernel_latency_us + A800.inter_node_latency_us     # one launch, one step (n = 2)


def _a2a(nbytes: int, chunk: int | None) -> Node:
    attrs = (("scope", "inter"),) + (() if chunk is None else (("chunk", chunk),))
    return Node("a2a", OpKind.ALL_TO_ALL, Phase.FORWARD, (), ("y",), comm_bytes=nbytes, group=2, attrs=attrs)


def test_one_call_prices_as_monta_table8():
    """O1's pairwise all-to-all, one call: MoNTA Table 8 measures 32 M at 63.3 %: 1.012 ms (16 MB sent)."""
    t = CostModel(A800).best_time_us(_a2a(16_000_000, None))
    assert t == pytest.approx(1012 + KAPPA_ALPHA_US, rel=0.02)


def test_a_chunk_pays_table8_plus_the_stall():
    """Each chunk of O2/O3 (8 M at 42.7 %: 0.374 ms, Table 8) plus the fitted stall; the unchunked
    call of the same bytes does not pay it."""
    cost = CostModel(A800)
    chunked, alone = cost.best_time_us(_a2a(4_000_000, 1)), cost.best_time_us(_a2a(4_000_000, None))
    assert alone == pytest.approx(374 + KAPPA_ALPHA_US, rel=0.02)
    assert chunked == pytest.approx(374 + KAPPA_ALPHA_US + 75.0, rel=0.02)


def test_the_stall_is_fitted_at_8k_and_is_the_registry_value():
    """fit_chunk_stall (benchmarks/fidelity.py) gives the registry's value, and O1 then wins at 8K
    by the smallest margin, while at 32K a chunked option still beats O1 (held out)."""
    sys.path.insert(0, str(BENCH))
    from fidelity import fit_chunk_stall, monta_options
    assert fit_chunk_stall(dataclasses.replace(A800, chunk_stall_us=0.0)) == A800.chunk_stall_us
    cost = CostModel(A800)
    at8 = monta_options(8192, cost)
    assert min(at8, key=at8.get) == ("O1", 1)
    at32 = monta_options(32768, cost)
    assert min(at32, key=at32.get)[1] > 1


@pytest.mark.parametrize("seq,chunked", [(8192, False), (32768, True)])
def test_chunk_auto_follows_montas_regime_on_a800_across_nodes(seq, chunked):
    """moegraph's own chunk=auto on a MoNTA-sized layer (fidelity.monta_layer: h 8192, top-2, n = 16)
    over two a800 nodes: one call at 8K (the fitted volume), chunks at 32K (held out)."""
    sys.path.insert(0, str(BENCH))
    from fidelity import monta_layer
    layer = monta_layer(seq)
    dispatch = [nd for nd in layer.nodes if nd.op is OpKind.ALL_TO_ALL and nd.block == "ffn"]
    assert dispatch and all(nd.group == 16 and CostModel(A800).scope(nd) == "inter" for nd in dispatch)
    chosen = run_pipeline(layer, "chunk=auto", cost=CostModel(A800))[1]["chunk"]["chosen"]
    assert (chosen > 1) is chunked, chosen


def test_no_stall_where_nothing_measured_it():
    """Every other profile keeps chunk_stall_us 0: a chunked collective prices as the same call alone
    (the calibrated CPU profiles and the datasheet GPUs: issue 29 acceptance, CPU pricing unchanged)."""
    from moegraph.registry.loading import _REGISTRY_DIR
    import yaml
    names = [n for n in yaml.safe_load((_REGISTRY_DIR / "hardware.yaml").read_text()) if n != "a800"]
    names += [p.stem for p in (_REGISTRY_DIR / "profiles").glob("*.yaml")]
    g = trace_model(load_model("tiny"), Strategy("sp", "ep", "a2a", 2, chunks=2), batch=1, seq=64)
    comms = [nd for nd in g.nodes if nd.is_comm and nd.attr("chunk", None) is not None]
    assert comms
    for name in names:
        hw = load_hardware(name)
        assert hw.chunk_stall_us == 0.0, name
        cost = CostModel(hw)
        for nd in comms:
            plain = dataclasses.replace(nd, attrs=tuple(kv for kv in nd.attrs if kv[0] != "chunk"))
            assert cost.node_time_us(nd) == cost.node_time_us(plain), (name, nd.name)
