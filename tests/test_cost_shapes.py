"""Shape- and size-dependent efficiencies (issue 29 items 1, 2, 6): hand computations of the
curves, the registry's fitted values reproduced from their published points, and the fitted GEMM
model checked on H200 shapes that no fit used.

Hand numbers: h800 (hardware.yaml) P = 989e12, W = 3.4e12, 132 SMs, kernel 4 us, mem_eff 0.8,
gemm_eff 0.726, tiles 128x256 (1.0) / 128x128 (0.7) / 64x128 (0.45), gamma 0, k_half 128.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

import pytest

from helpers import FLAT
from moegraph.cost import CostModel, FusedGroup, op_class
from moegraph.cost_fit import PUBLISHED, fit_attention, fit_gemm_shape, gemm_errors, read_shape_file
from moegraph.efficiency import fit_size_eff, gemm_shape, size_eff
from moegraph.ir import Node, OpKind, Phase, Role, Strategy
from moegraph.registry import load_hardware, load_model
from moegraph.tracer import trace_model

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data"


def gemm(m, n, k, role=Role.FORWARD, groups=1, mem=0):
    op = OpKind.GROUPED_GEMM if groups > 1 else OpKind.GEMM
    attrs = (("mnk", (m, n, k)),) + ((("groups", groups),) if groups > 1 else ())
    return Node("g", op, Phase.FORWARD, (), ("y",), role=role, flops=2 * m * n * k, mem_bytes=mem, attrs=attrs)


def test_gemm_shape_by_role():
    assert gemm_shape(gemm(1024, 6144, 4096)) == (1, 1024, 6144, 4096)
    assert gemm_shape(gemm(1024, 6144, 4096, Role.DGRAD)) == (1, 1024, 4096, 6144)      # dx[m, k], reduce n
    assert gemm_shape(gemm(2048, 14336, 4096, Role.WGRAD, groups=8)) == (8, 14336, 4096, 256)  # dw[n, k] per expert


def test_gemm_factor_by_hand():
    cm = CostModel(load_hardware("h800"))
    # 16384 x 4096 x 4096: 128x256 tiles fit exactly (pad 1), k/(k+128) = 4096/4224
    node = gemm(16384, 4096, 4096)
    t = 4 + 2 * 16384 * 4096 * 4096 / (989e12 * 0.726 * 4096 / 4224) * 1e6
    assert cm.node_time_us(node) == pytest.approx(t, rel=1e-9)
    # m = 64 rows: a 128-row tile is half empty (0.5); 64x128 tiles run at 0.45; so 0.5 wins
    small = gemm(64, 4096, 4096)
    assert cm._shape(small, "gemm") == pytest.approx(0.5 * 4096 / 4224)
    # small K: k = 128 halves the efficiency against k_half = 128
    assert cm._shape(gemm(16384, 4096, 128), "gemm") == pytest.approx(0.5)


def test_narrow_tp_gemms_pay_their_shape():
    """MegaScale-MoE §3.2 / Fig 14's second reason: TP splits the expert's h_ffn, and the narrow
    fc2 (k = h_ffn/n) runs at a lower efficiency than EP's full-width one."""
    cm = CostModel(load_hardware("h800"))
    ep = cm._shape(gemm(2048, 4096, 14336), "gemm")
    tp = cm._shape(gemm(2048, 4096, 14336 // 8), "gemm")
    assert tp < ep * 0.95


def test_memory_bound_regime_is_the_roofline():
    cm = CostModel(load_hardware("h800"))
    node = gemm(16384, 64, 4096, mem=2 * (16384 * 4096 + 4096 * 64 + 16384 * 64))
    assert cm.node_time_us(node) == pytest.approx(4 + node.mem_bytes / (3.4e12 * 0.8) * 1e6, rel=1e-9)


def test_attention_factor_by_hand():
    cm = CostModel(load_hardware("h800"))
    fwd = Node("a", OpKind.ATTENTION, Phase.FORWARD, (), ("y",), flops=10**12,
               attrs=(("head_dim", 128), ("causal", True), ("seq", 4096)))
    f = 4096 / (4096 + 496)
    assert cm.node_time_us(fwd) == pytest.approx(4 + 1e12 / (989e12 * 0.643 * f) * 1e6, rel=1e-9)
    bwd = dataclasses.replace(fwd, role=Role.DGRAD)
    assert cm._shape(bwd, "attention") == pytest.approx(f * 0.8)
    d64 = fwd.with_attrs(head_dim=64)
    assert cm._shape(d64, "attention") == pytest.approx(f * 0.75)
    with pytest.raises(ValueError, match="no 'seq' attribute"):
        cm.node_time_us(Node("a", OpKind.ATTENTION, Phase.FORWARD, (), ("y",), flops=10**12,
                             attrs=(("head_dim", 128),)))


def test_collective_size_curve_by_hand():
    cm = CostModel(load_hardware("a800"))
    nbytes = 4_000_000
    node = Node("c", OpKind.ALL_TO_ALL, Phase.FORWARD, (), ("y",), comm_bytes=nbytes, group=2,
                attrs=(("scope", "inter"),))
    eff = 0.759 * nbytes / (nbytes + 3.15e6)
    want = 4 + 1 * 5 + nbytes / (25e9 * eff) * 1e6
    assert cm.node_time_us(node, 24) == pytest.approx(want, rel=1e-9)
    assert size_eff(0.8, 0.0, 1.0) == 0.8


def test_registry_fits_reproduce_from_published_points():
    """hardware.yaml's "fitted to" values come out of moegraph.cost_fit from the points it cites."""
    hw = load_hardware("a800")
    e, h = fit_size_eff(PUBLISHED["monta_a2a_inter_a800"])
    assert (round(e, 3), h) == (hw.a2a_eff_inter, pytest.approx(hw.a2a_half_bytes_inter, rel=0.01))
    e, h = fit_size_eff(PUBLISHED["monta_ag_intra_a800"])
    assert (round(e, 3), h) == (hw.ring_eff_intra, pytest.approx(hw.ring_half_bytes_intra, rel=0.01))
    e, s_half = fit_attention(PUBLISHED["fa3_causal_d128_h100"], 989e12)
    h800 = load_hardware("h800")
    assert (round(e, 3), round(s_half)) == (h800.attention_eff, h800.attention_seq_half)
    # MoNTA's own points back: 0.427 at 4 MB sent, 0.741 at 128 MB (within 1%)
    assert size_eff(0.759, 3.15e6, 4e6) == pytest.approx(0.427, rel=0.01)
    assert size_eff(0.759, 3.15e6, 128e6) == pytest.approx(0.741, rel=0.01)


def test_gemm_fit_reproduces_registry_and_beats_constant_on_heldout_shapes():
    base = dataclasses.replace(load_hardware("h200"), gemm_tiles=(), gemm_k_half=0.0)
    grid, _ = read_shape_file(DATA / "h200-shapes-2026-11-27.txt")
    held, _ = read_shape_file(DATA / "h200-shapes-heldout-2026-11-27.txt")
    fields = fit_gemm_shape(base, grid)
    h200 = load_hardware("h200")
    for k, v in fields.items():
        assert getattr(h200, k) == (tuple(v) if isinstance(v, tuple) else pytest.approx(v, abs=6e-4)), k
    shaped = statistics.median(abs(e) for e in gemm_errors(h200, held))
    constant = statistics.median(abs(e) for e in gemm_errors(dataclasses.replace(h200, **FLAT), held))
    assert len(held) == 40 and shaped < 0.08 and shaped < constant


def test_fused_members_are_priced_by_their_shapes():
    """A fused group keeps each member's shape attributes, so the kernel's compute is the unfused
    nodes' (issue 29 item 4); a schedule file's group without them still loads."""
    hw = load_hardware("h800")
    g = trace_model(load_model("mixtral-8x7b"), Strategy("sp", "ep", "ag-rs", 8), batch=1, seq=8192)
    from moegraph.passes.fuse import candidates
    cands = candidates(g, CostModel(hw))
    assert cands
    for cand in cands:
        nodes = [g.node[m] for m in cand.members if not g.node[m].is_comm]
        members = cand.group.compute_nodes()
        cm = CostModel(hw)
        assert [cm.node_time_us(a) for a in members] == pytest.approx(
            [cm._compute_us(b, op_class(b), in_step_terms=False) if b.op is not OpKind.SPLIT else 0.0 for b in nodes])
    old = FusedGroup.of(Node("x", OpKind.GEMM, Phase.FORWARD, (), ("y",), attrs=(("fused", {
        "variant": "fused", "kind": "a2a+gemm", "anchor": True, "comm": ["all_to_all", 10, 8, "intra"],
        "compute": [["gemm", 100, 0, "forward"]]}),)))
    assert old.compute_nodes()[0].role is Role.FORWARD and old.compute_nodes()[0].attr("mnk", None) is None
    assert not math.isnan(CostModel(hw).fused_price(old).time_us)
