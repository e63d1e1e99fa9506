"""Capacity-padded expert rows (``expert_rows='padded'``, moegraph.index_map.build_index_map): the
local index map of ffn=ep under dispatch=ag-rs holds the static C = T * min(k, El) rows instead of
this step's R, dropless, with rows R..C-1 contributing nothing. Numerics against the eager module
(n=2 and n=4, n ranks in threads over the reference collectives), including routing where one rank
receives every row and another none; the padding rows' content (NaN) never leaks.

Notation: T tokens routed on a rank (after the all-gather), k top-k, El experts per rank,
R this rank's routed rows, C = T * min(k, El).
"""

from __future__ import annotations

import pytest
import torch

import comm_workers
import test_fake_device as tfd
from helpers import eager_step, rel_err, small_layer
from moegraph import grouped_gemm, kernels
from moegraph.pass_steps import DEFAULT_PASSES
from moegraph.interpreter import shard_param
from moegraph.ir import Strategy
from moegraph.expert_rows import padded_rows_extra_bytes
from moegraph.index_map import IndexMap, build_index_map, mask_padding
from moegraph.passes import run_pipeline
from moegraph.runtime.module import CompiledLayer, make_plan
from moegraph.tracer import trace_module

pytestmark = pytest.mark.usefixtures("one_thread")      # conftest: one torch thread per rank thread

B, S, H = 2, 16, 64
TOL = 1e-5


# -- the index map --------------------------------------------------------------------------------

def _experts(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("rank", [0, 1])
def test_padded_index_map_is_the_exact_one_plus_static_padding(rank):
    """T=4 tokens, k=2 of E=4 experts on n=2 ranks (El=2): C = 4 * min(2, 2) = 8 rows whatever the
    routing; the first R rows, the counts and the offsets are the exact map's; R stays on the device."""
    experts = _experts([[0, 3], [2, 1], [1, 0], [3, 2]])
    exact = build_index_map(experts, "local", 2, rank, 2)
    padded = build_index_map(experts, "local", 2, rank, 2, "padded")
    R = exact.flat.shape[0]
    assert R == 4 and padded.flat.shape == (8,) and exact.rows is None
    assert int(padded.rows) == R and padded.rows.dim() == 0
    assert torch.equal(padded.flat[:R], exact.flat)
    assert torch.equal(padded.counts, exact.counts) and torch.equal(padded.offsets, exact.offsets)
    # the padding rows are the other rank's slots (valid indices, never routed here)
    mine = {t * 2 + j for t, row in enumerate(experts.tolist()) for j, e in enumerate(row) if e // 2 == rank}
    assert set(padded.flat[:R].tolist()) == mine and not set(padded.flat[R:].tolist()) & mine


def test_padded_index_map_holds_every_row_and_none():
    """One rank receives every row (R = C, no padding) and the other none (R = 0, all padding)."""
    experts = _experts([[0, 1], [1, 0], [0, 1]])                      # every token on rank 0's experts
    full = build_index_map(experts, "local", 2, 0, 2, "padded")
    empty = build_index_map(experts, "local", 2, 1, 2, "padded")
    assert full.flat.shape == empty.flat.shape == (6,)
    assert int(full.rows) == 6 and int(empty.rows) == 0
    assert empty.counts.tolist() == [0, 0] and empty.offsets.tolist() == [0, 0]
    x = torch.randn(6, 16)
    assert torch.equal(empty.real_rows(x), torch.zeros(6, 16)) and torch.equal(full.real_rows(x), x)


def test_padded_rows_is_the_tight_worst_case():
    """k=3 of El=2 local experts: a token puts at most 2 rows here, so C = 2T (not 3T), and a routing
    that picks both local experts for every token fills it exactly."""
    experts = _experts([[0, 1, 2], [1, 3, 0], [0, 5, 1]])              # El=2 on each of n=4 ranks
    m = build_index_map(experts, "local", 2, 0, 4, "padded")
    assert m.flat.shape == (6,) and int(m.rows) == 6
    with pytest.raises(ValueError, match=r"expert_rows='wide' is not one of 'exact', 'padded'"):
        build_index_map(experts, "local", 2, 0, 4, "wide")


def _masked(x, w, seg, transpose_w=False):
    """grouped_rows by the masked formulation (what a GPU without the native op runs), on CPU."""
    b = w if transpose_w else w.transpose(-2, -1)
    return mask_padding(grouped_gemm.masked_rows(x, b, seg.offsets), seg.rows)


def _masked_wgrad(x, dy, seg, w_shape):
    return grouped_gemm.masked_group_sums(dy.T, x, seg.offsets)


PATHS = {"grouped_mm": (grouped_gemm.grouped_rows, grouped_gemm.grouped_weight_grad),
         "host_segments": (grouped_gemm.grouped_rows, grouped_gemm.grouped_weight_grad),
         "masked": (_masked, _masked_wgrad)}


@pytest.mark.parametrize("path", list(PATHS))
def test_padded_grouped_gemm_zeroes_padding_and_ignores_nan_rows(path, monkeypatch):
    """Rows past R hold NaN (as uncomputed memory may): the grouped GEMM's padding rows come out
    exactly zero, its real rows and its weight gradient equal the host loop over the exact map's
    segments; the host-segment fallback also gives C rows."""
    if path == "host_segments":
        monkeypatch.setattr(grouped_gemm, "_GROUPED_MM", None)
    rows_fn, wgrad_fn = PATHS[path]
    experts = _experts([[0, 3], [2, 1], [1, 0], [3, 2], [0, 2], [3, 1]])
    exact = build_index_map(experts, "local", 2, 0, 2)
    padded = build_index_map(experts, "local", 2, 0, 2, "padded")
    R, C = exact.flat.shape[0], padded.flat.shape[0]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2, 8, 16, generator=gen)                            # [El, out, in]
    x = torch.randn(C, 16, generator=gen)
    x[R:] = float("nan")
    dy = torch.randn(C, 8, generator=gen)
    dy[R:] = float("nan")
    ref_y, ref_dx, ref_dw, start = [], [], torch.zeros_like(w), 0
    for e, count in exact.segments:                                     # the independent reference
        ref_y.append(x[start:start + count] @ w[e].T)
        ref_dx.append(dy[start:start + count] @ w[e])
        ref_dw[e] = dy[start:start + count].T @ x[start:start + count]
        start += count
    y = rows_fn(x, w, padded)
    assert y.shape == (C, 8) and torch.equal(y[R:], torch.zeros(C - R, 8))
    assert torch.allclose(y[:R], torch.cat(ref_y), atol=1e-5)
    dx = rows_fn(dy, w, padded, transpose_w=True)
    assert torch.equal(dx[R:], torch.zeros(C - R, 16)) and torch.allclose(dx[:R], torch.cat(ref_dx), atol=1e-5)
    dw = wgrad_fn(x, dy, padded, w.shape)
    assert torch.isfinite(dw).all() and torch.allclose(dw, ref_dw, atol=1e-5)


def test_masked_grouped_gemm_handles_empty_groups_and_expert_blocks(monkeypatch):
    """The masked formulation with an empty first and last group, over one expert per block (the
    memory bound) and all at once: equal to the host loop over the same segments."""
    experts = _experts([[1, 2], [2, 1], [1, 2]])                         # experts 0 and 3 get no rows
    m = build_index_map(experts, "all", 4, 0, 1)
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(4, 8, 16, generator=gen), torch.randn(6, 16, generator=gen)
    dy = torch.randn(6, 8, generator=gen)
    monkeypatch.setattr(grouped_gemm, "_GROUPED_MM", None)               # the host loop: the reference
    want_y, want_dw = grouped_gemm.grouped_rows(x, w, m), grouped_gemm.grouped_weight_grad(x, dy, m, w.shape)
    for cap in (1, grouped_gemm.MASKED_BLOCK_BYTES):
        monkeypatch.setattr(grouped_gemm, "MASKED_BLOCK_BYTES", cap)
        assert torch.allclose(_masked(x, w, m), want_y, atol=1e-5)
        dw = _masked_wgrad(x, dy, m, w.shape)
        assert torch.allclose(dw, want_dw, atol=1e-5) and not dw[0].any() and not dw[3].any()


def _counting_grouped_mm(monkeypatch, fail_after: int | None = None):
    """torch._grouped_mm behind a call counter, the (device, dtype) probes cleared; calls past
    ``fail_after`` raise as a shape bug in the caller would."""
    real, calls = torch._grouped_mm, []

    def op(a, b, offs):
        calls.append(a.dtype)
        if fail_after is not None and len(calls) > fail_after:
            raise RuntimeError("grouped gemm: a bad shape from the caller")
        return real(a, b, offs=offs)
    monkeypatch.setattr(grouped_gemm, "_GROUPED_MM", op)
    monkeypatch.setattr(grouped_gemm, "_NATIVE", {})
    return calls


def test_grouped_gemm_support_is_probed_once_and_call_errors_propagate(monkeypatch):
    """Support for a (device, dtype) is probed up front (fp64: torch._grouped_mm refuses it, so the
    host loop runs, with no further attempts); an error from a real call where the op runs is
    raised, not taken as "unsupported" and switched off."""
    experts = _experts([[0, 3], [2, 1], [1, 0], [3, 2]])
    m = build_index_map(experts, "local", 2, 0, 2)
    R = m.flat.shape[0]
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(2, 8, 16, generator=gen), torch.randn(R, 16, generator=gen)
    ref, start = [], 0
    for e, count in m.segments:
        ref.append(x[start:start + count] @ w[e].T)
        start += count
    calls = _counting_grouped_mm(monkeypatch)
    for _ in range(2):
        assert torch.allclose(grouped_gemm.grouped_rows(x.double(), w.double(), m), torch.cat(ref).double(), atol=1e-12)
    assert calls == [torch.float64]                       # the probe's first call, then never again
    calls = _counting_grouped_mm(monkeypatch, fail_after=2)  # the fp32 probe's two calls succeed
    with pytest.raises(RuntimeError, match="a bad shape from the caller"):
        grouped_gemm.grouped_rows(x, w, m)
    assert grouped_gemm._NATIVE == {("cpu", torch.float32): True}


def test_padding_rows_never_reach_tokens_or_routing_slots():
    """UNPERMUTE (combine), PERMUTE's backward and UNPERMUTE's weight gradient over a padded map whose
    padding rows are NaN: results equal the exact map's on its R rows."""
    from moegraph.ir import Node, OpKind, Phase, Role
    experts = _experts([[0, 3], [2, 1], [1, 0], [3, 2]])
    exact = build_index_map(experts, "local", 2, 1, 2)
    padded = build_index_map(experts, "local", 2, 1, 2, "padded")
    R, C = exact.flat.shape[0], padded.flat.shape[0]
    ctx = kernels.RankContext(1, 2, 4)
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(C, 8, generator=gen)
    rows[R:] = float("nan")
    weights, dy = torch.rand(4, 2, generator=gen), torch.randn(4, 8, generator=gen)

    def node(op, role, **attrs):
        return Node(name="n", op=op, phase=Phase.FORWARD, role=role, inputs=(), outputs=(),
                    attrs=tuple(sorted(attrs.items())))

    for m, r in ((padded, rows), (exact, rows[:R])):
        got = [kernels.KERNELS[(OpKind.UNPERMUTE, Role.FORWARD)](ctx, node(OpKind.UNPERMUTE, Role.FORWARD, weighted=True),
                                                                  [r, weights, m], [(4, 8)])[0],
               kernels.KERNELS[(OpKind.PERMUTE, Role.DGRAD)](ctx, node(OpKind.PERMUTE, Role.DGRAD, index="token"),
                                                             [r, m], [(4, 8)])[0],
               kernels.KERNELS[(OpKind.PERMUTE, Role.DGRAD)](ctx, node(OpKind.PERMUTE, Role.DGRAD, index="slot"),
                                                             [r[:, 0], m], [(4, 2)])[0],
               *kernels.KERNELS[(OpKind.UNPERMUTE, Role.DGRAD)](ctx, node(OpKind.UNPERMUTE, Role.DGRAD, weighted=True),
                                                                [dy, r, weights, m], [])[1:]]
        if m is padded:
            want = got
        else:
            for a, b in zip(want, got):
                assert torch.isfinite(a).all() and torch.allclose(a, b, atol=1e-6)


# -- the layer against eager ----------------------------------------------------------------------

def _layer(n, spec, seed, skew):
    module = small_layer(n, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if skew:                     # every token on experts 0-3: at n=2 rank 0 gets all rows, rank 1 none
        comm_workers.skew_routing_to_rank0(module, 4)
        x = comm_workers.skewed_input(gen)
    else:
        x = torch.randn(B, S, H, generator=gen)
    dy = torch.randn(B, S, H, generator=gen)
    graph = trace_module(module, Strategy("sp", "ep", "ag-rs", n, dtype="fp32"), batch=B, seq=S)
    if spec:
        graph, _ = run_pipeline(graph, spec, cost=tfd.COST)
    return module, graph, x, dy


LAYER_CASES = [(2, DEFAULT_PASSES, False), (2, "", True), (4, DEFAULT_PASSES, False), (4, "chunk=2,sar=paper", True)]


@pytest.mark.parametrize("n,spec,skew", LAYER_CASES, ids=[f"n{n}-{s or 'none'}-{'skew' if k else 'random'}"
                                                           for n, s, k in LAYER_CASES])
def test_padded_layer_matches_eager(n, spec, skew, monkeypatch):
    """ffn=ep, dispatch=ag-rs with padded expert rows: output, input gradient and every parameter
    gradient equal the eager module's; every local index map really was padded (C rows, C > R on
    some rank) and, with skewed routing, some rank had no rows at all."""
    module, graph, x, dy = _layer(n, spec, 11, skew)
    y_ref, dx_ref, g_ref = eager_step(module, x, dy)
    full = {k: p.detach() for k, p in module.named_parameters()}
    plan = make_plan(graph, tfd.COST, "greedy")
    shared = tfd.ThreadComm(n)
    maps: list[IndexMap] = []
    real = kernels.build_index_map

    def spy(*args, **kw):
        m = real(*args, **kw)
        if args[1] == "local":
            maps.append(m)
        return m

    monkeypatch.setattr(kernels, "build_index_map", spy)
    got: dict[int, tuple] = {}

    def rank_main(rank):
        layer = CompiledLayer(graph, plan, full, rank=rank, n=n, comm=shared.for_rank(rank), expert_rows="padded")
        xs = layer.shard_input(x).requires_grad_(True)
        y = layer(xs)
        y.backward(layer.shard_input(dy))
        got[rank] = (y.detach(), xs.grad, {p: s.grad for p, s in layer.named_shards()})

    tfd.run_rank_threads(n, rank_main, shared)
    assert rel_err(torch.cat([got[r][0] for r in range(n)], dim=1), y_ref) < TOL
    assert rel_err(torch.cat([got[r][1] for r in range(n)], dim=1), dx_ref) < TOL
    for r in range(n):
        for pname, spec_ in graph.params:
            assert rel_err(got[r][2][pname], shard_param(spec_, g_ref, r, n)) < TOL, f"rank {r}: gradient of {pname}"
    T, k, El = B * S // (2 if "chunk=2" in spec else 1), 3, 8 // n
    assert maps and all(m.flat.shape[0] == T * min(k, El) for m in maps)
    assert any(int(m.rows) < m.flat.shape[0] for m in maps)
    if skew:
        assert any(int(m.rows) == 0 for m in maps)


# -- memory honesty --------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4])
def test_padded_rows_extra_bytes_counts_the_padding(n):
    """small_layer: T = b*s = 32 tokens per rank after the all-gather, k=3, El = 8/n: C = 96 (n=2)
    or 64 (n=4) rows where the plan expects T*k/n = 48 or 24; every routed value grows by C/R - 1."""
    _, graph, _, _ = _layer(n, DEFAULT_PASSES, 0, False)
    C, R = {2: (96, 48), 4: (64, 24)}[n]
    routed = [v for v in graph.values if v.routed]
    assert routed and all(v.shape[0] == R for v in routed)
    assert padded_rows_extra_bytes(graph) == sum(v.nbytes * (C - R) // R for v in routed)
    tp = trace_module(small_layer(2), Strategy("tp", "tp", "ag-rs", 2, dtype="fp32"), batch=B, seq=S)
    assert padded_rows_extra_bytes(tp) == 0


def test_expert_rows_api_errors():
    import moegraph
    module = small_layer(1)
    x = torch.randn(B, S, H)
    with pytest.raises(ValueError, match=r"expert_rows='wide' is not one of 'exact', 'padded'"):
        moegraph.compile(module, x, expert_rows="wide", schedule="sequential")
    with pytest.raises(ValueError, match=r"expert_rows='padded' pads the local index map of ffn=ep with "
                                         r"dispatch=ag-rs; graph .* \(ffn=tp, dispatch=ag-rs\) has none"):
        moegraph.compile(module, x, ffn="tp", expert_rows="padded", schedule="sequential")
    from moegraph.models import MoETransformer
    from moegraph.registry import load_model
    model = MoETransformer.from_config(load_model("tiny"), vocab=64)
    with pytest.raises(ValueError, match=r"expert_rows='padded' applies to a compiled layer; a whole model"):
        moegraph.compile(model, torch.zeros(2, 16, dtype=torch.long), expert_rows="padded")
    layer = moegraph.compile(module, x, expert_rows="padded", schedule="sequential")     # n=1: El = E
    assert layer.expert_rows == "padded" and "expert_rows=padded" in repr(layer)
    y_ref, dx_ref, _ = eager_step(module, x, torch.ones_like(x))
    xs = x.clone().requires_grad_(True)
    y = layer(xs)
    y.backward(torch.ones_like(x))
    assert rel_err(y.detach(), y_ref) < TOL and rel_err(xs.grad, dx_ref) < TOL


@pytest.mark.slow
def test_run_padded_on_gloo_matches_eager_and_reports_the_extra_bytes(capsys):
    """``moegraph run --expert-rows padded --check --json`` on 2 gloo ranks (tiny: E=4, k=2, so
    El=2 and C = 2T, twice the T*k/n = T rows the plan expects): matches eager, and reports the
    padding's bytes, one more copy of every routed value."""
    import json

    from moegraph.cli import main
    from moegraph.registry import load_model
    from moegraph.tracer import trace_model
    rc = main(["run", "--n", "2", "--steps", "1", "--warmup", "0", "--schedule", "greedy", "--expert-rows", "padded",
               "--check", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["expert_rows"] == "padded"
    assert report["max_rel_err_output"] < 1e-5 and report["max_rel_err_grads"] < 1e-5
    from moegraph.cost import CostModel
    from moegraph.registry import load_hardware
    graph, _ = run_pipeline(trace_model(load_model("tiny"), Strategy("sp", "ep", "ag-rs", 2, dtype="fp32"), batch=1,
                                        seq=128), DEFAULT_PASSES, cost=CostModel(load_hardware("cpu-2core-gloo")))
    routed = sum(v.storage_bytes for v in graph.values if v.routed)
    assert routed > 0 and report["padded_rows_extra_bytes"] == routed
