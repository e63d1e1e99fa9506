"""A whole causal LM's optimizer step as ONE merged micro-batch plan, edges included
(``moegraph.compile(model, input_ids, micro_batches=M)``, ``CompiledModel.train_step``): on 2 gloo
ranks each micro-batch's loss and every parameter gradient (embedding, every layer, final norm,
LM head) equal eager gradient accumulation ((loss / M).backward() per micro-batch) to the
tolerance tests/test_model.py uses; zeroing one micro-batch's seed in its edge kernel breaks it;
AdamW steps follow eager's, also on n=2 x dp=2 ranks; bad input is refused by name."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import model_workers as workers
from helpers import RANK_BATCH, fresh_seed
import moegraph
from moegraph.runtime import RuntimeFailure
from runtime_workers import reference_layer

TOL = 1e-5
HAS_HF = importlib.util.find_spec("transformers") is not None
DEFAULT = "gate-reorder,sar=paper"
CASES = [dict(model="ref", layers=2, attn="sp", ffn="ep", passes=DEFAULT, schedule="megatron-1f1b", M=2, steps=2),
         dict(model="ref", layers=2, attn="tp", ffn="tp", passes="", schedule="cpsat", M=3)]
HF_CASES = [dict(model="hf", layers=2, attn="sp", ffn="ep", passes=DEFAULT, schedule="cpsat", M=2)]


def _id(case: dict) -> str:
    return f"{case['model']}-{case['attn']}-{case['ffn']}-{case['schedule']}-M{case['M']}"


ALL = CASES + HF_CASES



# The rank functions run in the suite's shared 2- and 4-rank spawns (helpers.RankBatch).
N2 = RANK_BATCH.add(2, "microbatch_model.mb_train_cases", workers.mb_train_cases,
                    CASES + (HF_CASES if HAS_HF else []), fresh_seed(), timeout_s=600)
DP2 = {b: RANK_BATCH.add(4, f"microbatch_model.mb_dp_case-b{b}", workers.mb_dp_case, fresh_seed(), 2, 2, b, timeout_s=600)
       for b in (1, 2)}


@pytest.fixture(scope="module")
def n2(rank_results):
    res = rank_results(2, N2)
    for r in res[1:]:      # every rank reports the same losses (all-reduced terms)
        assert [t["losses"] for t in r] == [t["losses"] for t in res[0]]
    return {_id(t["case"]): t for t in res[0]}


@pytest.mark.parametrize("case", ALL, ids=[_id(c) for c in ALL])
def test_merged_model_step_equals_eager_accumulation(n2, case):
    if case["model"] != "ref" and not HAS_HF:
        pytest.skip("transformers is not installed")
    r = n2[_id(case)]
    print({k: v for k, v in r.items() if k not in ("case",)})
    assert r["eager_nodes"] == 6 * case["M"], r            # every micro-batch's head and norm, run by the plan
    assert not r["missing"], r
    assert r["max_rel_err_loss"] < TOL, r
    assert r["max_rel_err_grads"] < TOL, r
    assert len(r["edges_grads"]) == 3, r                     # the embedding, the final norm, the head
    assert max(r["edges_grads"].values()) < TOL, r          # embedding, final norm, head: never near zero
    assert r["accumulates"] < TOL, r                        # a second call adds to .grad
    # the comparison can fail: micro-batch 0 alone, or one micro-batch's seed zeroed, is far off
    assert r["first_only"] > 1e-2 and r["zeroed_seed"] > 1e-2, r
    # lr 1e-4, as train_against_eager: AdamW amplifies round-off in near-zero gradients
    assert r["adamw_loss"] < TOL and r["adamw_params"] < TOL and r["moved"] > 1e-4, r


def test_megatron_plan_interleaves_micro_batches(n2):
    """The merged plan really interleaves: micro-batch 1's forward runs between micro-batch 0's
    backward entries, so its edge kernels run inside the other micro-batch's backward."""
    assert n2[_id(CASES[0])]["interleaved"] > 0


def _model():
    return workers.reference_model(3, 1)


def _ids(seed: int = 0, s: int = workers.S):
    return torch.randint(0, workers.VOCAB, (workers.B, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
def test_bad_input_refused_by_name():
    model = _model()
    ids = _ids()
    with pytest.raises(ValueError, match="micro_batches=0 must be a positive integer"):
        moegraph.compile(model, ids, micro_batches=0)
    layer = reference_layer(1)
    with pytest.raises(ValueError, match="micro_batches=2 applies to a whole causal LM"):
        moegraph.compile(layer, torch.zeros(1, 16, 64), micro_batches=2)
    one = moegraph.compile(model, ids, schedule="sequential")
    with pytest.raises(RuntimeFailure, match="compiled for one micro-batch"):
        one.train_step([ids, ids], [ids, ids])
    two = moegraph.compile(model, ids, schedule="sequential", micro_batches=2)
    with pytest.raises(RuntimeFailure, match="train_step"):
        two(ids, labels=ids)
    with pytest.raises(ValueError, match="sequence of 2 tensors .* got 1"):
        two.train_step([ids], [ids])
    with pytest.raises(ValueError, match=r"sequence of 2 tensors .* got one tensor"):
        two.train_step(ids, [ids, ids])
    with pytest.raises(ValueError, match=r"micro-batch 1's input_ids is torch.int64 \[2, 8\]"):
        two.train_step([ids, _ids(1, 8)], [ids, ids])
    with pytest.raises(ValueError, match="micro-batch 0's labels"):
        two.train_step([ids, ids], [_ids(1, 8), ids])
    assert all(p.grad is None for p in two.parameters())      # nothing ran
    losses = two.train_step([ids, _ids(2)], [ids, _ids(2)])   # n=1: the same path, no collectives
    assert len(losses) == 2 and all(torch.isfinite(x) for x in losses)


@pytest.mark.slow
def test_cli_run_train_steps_micro_batches_check(capsys):
    """`run --train-steps 2 --micro-batches 2 --check --json`: two AdamW steps, each one merged plan
    of 2 micro-batches on 2 ranks, against eager gradient accumulation."""
    import json

    from moegraph.cli import main
    assert main(["run", "--train-steps", "2", "--micro-batches", "2", "--check", "--json", "--seq", "32",
                 "--schedule", "megatron-1f1b", "--vocab", "128"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["micro_batches"] == 2 and len(r["losses"]) == 2 and all(len(x) == 2 for x in r["losses"]), r
    assert r["max_rel_err_loss"] < TOL and r["max_rel_err_params"] < TOL and r["max_rel_err_grads"] < TOL, r


@pytest.mark.parametrize("b, pattern", [(1, "rows"), (2, "partial")])
def test_merged_model_step_n2_dp2(b, pattern, rank_results):
    """n=2 x dp=2 on 4 gloo ranks, M=2, replicas of b rows (h=32, s=16, V=64, fp32): the merged
    step's gradients (x dp seeds under the plan's DP mean) equal eager accumulation on the global
    batch, whose replicas score different numbers of tokens; 2 AdamW steps too. b=1: two
    micro-batches' rows 2 * 2048 bytes tie PARTIAL's 4096: ROWS (gathered, scattered / dp);
    b=2: 8192 > 4096: PARTIAL, each micro-batch's scatter run by the plan into the running
    partial, one sync; with micro-batch 1's scatter scattering nothing the embedding gradient is
    off and nothing else is (the plan's sync is the gradient)."""
    r = rank_results(4, DP2[b])[0]
    print(r)
    assert r["pattern"] == pattern
    assert r["max_rel_err_loss"] < TOL and r["max_rel_err_grads"] < TOL and r["max_rel_err_params"] < TOL, r
    if pattern == "partial":
        assert sorted(r["planned_scatters"]) == ["mb0.edges.embed.scatter", "mb1.edges.embed.scatter"]
        assert r["dropped"]["embed.weight"] > 1e-2, r["dropped"]
        assert max(v for k, v in r["dropped"].items() if k != "embed.weight") < TOL, r["dropped"]
    else:
        assert r["planned_scatters"] == [] and r["dropped"] == {}


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_partial_scatter_kernel_accumulates_and_zeroes_the_padding_row():
    """The PARTIAL scatter kernel of a merged step's micro-batch j >= 1 (``_embed_scatter``,
    accumulate): the previous micro-batch's partial plus nn.Embedding's own weight gradient of
    these rows (autograd through F.embedding with padding_idx), padding row zero; the wrong input
    count is refused by name."""
    import torch.nn.functional as F
    model = workers.mixtral_model(5, 1, pad_token_id=0)
    ids = _ids(3)
    ids[:, ::3] = 0                                        # the padding token in every row
    compiled = moegraph.compile(model, ids, schedule="sequential")
    V, h = compiled.embed.shape
    gen = torch.Generator().manual_seed(7)
    rows, prev = torch.randn(*ids.shape, h, generator=gen), torch.randn(V, h, generator=gen)
    prev[0] = 0                                            # as micro-batch j-1's kernel left it
    w = torch.zeros(V, h, requires_grad=True)
    F.embedding(ids, w, padding_idx=0).backward(rows)
    (got,) = compiled._embed_scatter(ids, [rows, prev], accumulate=True)
    assert torch.allclose(got, prev + w.grad, rtol=1e-6, atol=1e-6)
    assert float(got[0].abs().max()) == 0.0 and float(w.grad[0].abs().max()) == 0.0
    assert not torch.equal(got, prev)                     # something was scattered
    (first,) = compiled._embed_scatter(ids, [rows])
    assert torch.allclose(first, w.grad, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeFailure, match="takes 2 input"):
        compiled._embed_scatter(ids, [rows], accumulate=True)
