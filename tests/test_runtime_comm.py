"""Collective edge cases: a rank that receives zero expert rows (gloo), and SM budgets on NCCL."""

from __future__ import annotations

import pytest
import torch

import comm_workers
import runtime_workers as workers
from helpers import RANK_BATCH

TOL = 1e-4
CASES = [dict(attn="sp", ffn="ep", dispatch="a2a"), dict(attn="tp", ffn="ep", dispatch="a2a", schedule="sequential"),
         dict(attn="sp", ffn="ep", dispatch="ag-rs")]
EXCHANGE_CASES = [dict(attn="sp", ffn="ep", dispatch="a2a"), dict(attn="sp", ffn="ep", dispatch="ag-rs")]
# Both rank functions run in the suite's shared 2-rank spawn (helpers.RankBatch).
ZERO_ROWS = RANK_BATCH.add(2, "runtime_comm.zero_rows_cases", comm_workers.zero_rows_cases, CASES, 4321)
EXCHANGES = RANK_BATCH.add(2, "runtime_comm.count_exchanges", comm_workers.count_exchanges, 77, EXCHANGE_CASES)


def test_skewed_routing_sends_rank1_no_rows():
    """The routing the gloo test relies on: with ep over 2 ranks (experts 0-3 on rank 0), every
    token picks experts of rank 0 only, so rank 1's expert shard receives zero rows."""
    module = workers.reference_layer(7)
    comm_workers.skew_routing_to_rank0(module, 4)
    x = comm_workers.skewed_input(torch.Generator().manual_seed(8))
    with torch.no_grad():
        h = x + module.attn(module.input_norm(x))
        logits = module.post_attn_norm(h).reshape(-1, workers.H) @ module.moe.router.weight.T
    assert int(logits.topk(3, dim=-1).indices.max()) < 4


def test_all_to_all_with_a_rank_receiving_zero_rows_matches_eager(rank_results):
    res = rank_results(2, ZERO_ROWS)
    for r in res[0] + res[1]:
        assert r["max_rel_err_output"] < TOL and r["max_rel_err_grads"] < TOL, r


def test_sm_budgets_map_to_real_nccl_cta_counts():
    """min = max CTAs pins a NCCL collective's SMs: budgets beyond NCCL's channel limit become
    that limit, and budget 0 (copy engines, which this runtime does not run) has no CTA count:
    it is refused, never silently run on 1 CTA or on an unconstrained communicator."""
    from moegraph.runtime import PlanError
    from moegraph.runtime.native_budgets import NCCL_MAX_CTAS, nccl_ctas
    assert [nccl_ctas(b) for b in (1, 16)] == [1, 16]
    assert nccl_ctas(10 * NCCL_MAX_CTAS) == NCCL_MAX_CTAS
    with pytest.raises(PlanError, match="budget 0"):
        nccl_ctas(0)


def test_rank_major_layouts_copy_only_when_they_must():
    """Reduce-scatter sends and all-gather receives [n, ..S..] rank-major buffers: they equal the
    stacked chunks / the concatenation, and are views of the tensor (no copy) when nothing
    precedes the split dim (flat buckets, token rows, b = 1)."""
    from moegraph.runtime.collectives import _from_rank_major, _to_rank_major
    n = 2
    for shape, dim in [((1, 8, 3), 1), ((8, 3), 0), ((2, 8, 3), 1), ((2, 3, 8), -1)]:
        x = torch.randn(shape)
        rm = _to_rank_major(x, dim, n)
        assert torch.equal(rm, torch.stack(x.chunk(n, dim=dim)))
        assert torch.equal(_from_rank_major(rm, dim), x)
        leading = all(d == 1 for d in shape[:dim % len(shape)])
        assert (rm.data_ptr() == x.data_ptr()) == leading, (shape, dim)
        if leading:
            assert _from_rank_major(rm, dim).data_ptr() == rm.data_ptr()


def test_one_split_size_exchange_per_step(rank_results):
    """The host-blocking split-size exchange runs once per step, for the dispatch; the combine
    and the backward all-to-alls know their sizes from the RecvMap. ag-rs has none."""
    res = rank_results(2, EXCHANGES)
    assert res[0] == res[1] == [1, 0]


def test_run_with_nccl_refuses_the_cpu_profile(monkeypatch, capsys):
    """--backend nccl must not plan the GPU run with the default CPU profile (checked as if the
    machine had the GPUs)."""
    from moegraph.cli import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(["run", "--backend", "nccl"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--hardware cpu-2core-gloo, a CPU profile" in err and "h100" in err and "\n" not in err


def test_index_map_from_splits_is_a_by_destination_map():
    from moegraph.index_map import IndexMap
    m = IndexMap.from_splits(torch.arange(5), (2, 0, 3))
    assert m.splits == (2, 0, 3) and m.segments == ((0, 2), (0, 0), (0, 3)) and m.offsets is None


def test_the_emulated_collectives_are_the_backends_not_a_ranks_runtime_switch(monkeypatch):
    """Which collectives are emulated is decided from the backend before the first collective
    (gloo and MPI: reduce_scatter), identically on every rank. A native reduce_scatter that
    fails is an error: one rank switching to the all_to_all emulation alone would leave its
    peers waiting in a different collective."""
    from moegraph.ir import Node, OpKind, Phase, freeze_attrs
    from moegraph.runtime import collectives
    assert collectives.emulated_collectives("gloo") == {"reduce_scatter"}
    assert collectives.emulated_collectives("mpi") == {"reduce_scatter"}
    assert collectives.emulated_collectives("nccl") == set()
    assert collectives.emulated_collectives("nccl", frozenset({"reduce_scatter"})) == {"reduce_scatter"}

    def unsupported(*args, **kwargs):
        raise RuntimeError("this backend does not support reduce_scatter")
    monkeypatch.setattr(collectives, "_reduce_scatter_single", unsupported)
    comm = collectives.Comm.__new__(collectives.Comm)      # a native-reduce_scatter rank (no process group)
    comm.emulate = collectives.emulated_collectives("nccl")
    node = Node("rs", OpKind.REDUCE_SCATTER, Phase.FORWARD, ("x",), ("y",), attrs=freeze_attrs({"dim": 1}), group=2)
    with pytest.raises(RuntimeError, match="does not support reduce_scatter"):
        comm._reduce_scatter(node, torch.randn(1, 4, 3), None, 2)
    assert comm.emulate == set()
