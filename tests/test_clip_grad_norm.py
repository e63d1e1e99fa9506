"""CompiledModel.clip_grad_norm_ (moegraph.runtime.grad_norm) at n=2 on gloo against eager's
torch.nn.utils.clip_grad_norm_: the same total norm, the same parameters after a clipped SGD step,
and every rank's replicated copies identical (torch's own utility on compiled.parameters() takes
each rank's shards' norm: the ranks clip by different factors and the copies drift)."""

from __future__ import annotations

import importlib.util

import pytest

import clip_workers as workers
from helpers import RANK_BATCH

TOL = 1e-6
HAS_HF = importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")

CASES = {
    "sp-ep-clipped": dict(seed=21, max_norm=0.1, attn="sp", ffn="ep"),
    "tp-tp-clipped": dict(seed=22, max_norm=0.1, attn="tp", ffn="tp"),
    "sp-ep-not-clipped": dict(seed=23, max_norm=1e6, attn="sp", ffn="ep"),
    "tp-tp-inf-norm": dict(seed=24, max_norm=0.01, attn="tp", ffn="tp", norm_type=float("inf")),
}
if HAS_HF:
    N2 = RANK_BATCH.add(2, "clip.n2", workers.cases, list(CASES.values()), timeout_s=600)


@pytest.fixture(scope="module")
def n2(rank_results):
    res = rank_results(2, N2)
    return [dict(zip(CASES, rank)) for rank in res]


@pytest.mark.parametrize("case", list(CASES))
def test_global_norm_and_clipped_step_match_eager(n2, case):
    for rank in n2:
        r = rank[case]
        assert r["norm"] < TOL and r["params"] < TOL, r
    assert n2[0][case]["total"] == n2[1][case]["total"]            # the same norm, so the same scale
    assert n2[0][case]["replicated"] == n2[1][case]["replicated"]  # replicated copies stay identical
    assert n2[0][case]["n_replicated"] >= 3
    if CASES[case]["max_norm"] < 1:
        assert n2[0][case]["eager_total"] > 2 * CASES[case]["max_norm"]   # the clip does act
