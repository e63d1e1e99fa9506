"""Batches as training feeds them (issue 27, item 5; moegraph.tokens): right-padded rows with an
attention_mask and packed documents with restarting position_ids match the eager transformers model
(use_cache=False, as training runs), logits, loss and every trainable parameter's gradient, fp32
within 1e-5, on one rank and on two gloo ranks (the suite's shared spawn); the forms not modelled
are refused in one line naming them.

Each case compiles its tiny model (tests/family_zoo.py) once for a plain batch and runs both forms
through it (tests/family_workers.batch_cases). The cases cover the mask's paths: GQA through SDPA
(Mixtral, sequence-parallel with 2 chunks, with the router's aux loss over the unpadded tokens),
sliding-window attention with sinks in a mixed stack (GPT-OSS), chunked attention and NoPE (Llama
4), q/k norms over 2 replicas (Qwen3-MoE, dp=2), MLA (DeepSeek-V3, one rank and, under ag-rs, two).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from family_workers import B, S, accumulation_case, batch_cases, real_batches  # noqa: E402
from family_zoo import VOCAB, moe_causal_lms, tiny_model  # noqa: E402
from helpers import RANK_BATCH  # noqa: E402

TOL = 1e-5
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.5)
LMS = dict(moe_causal_lms())
FORMS = ("padded", "packed")

pytestmark = pytest.mark.usefixtures("one_thread")


def _case(family: str, attn: str, ffn: str, dispatch: str, **extra) -> dict:
    return dict(family=family, cls=LMS[family], attn=attn, ffn=ffn, dispatch=dispatch, **extra)


def _assert_matches(results: list[dict], where) -> None:
    for res in results:
        assert "refused" not in res, (where, res)
        for form in FORMS:
            r = res[form]
            assert r["logits"] < TOL and r["loss"] < TOL and r["grads"] < TOL, (where, res["case"]["family"], form, r)


@pytest.mark.slow
def test_the_forms_change_what_eager_computes():
    """The forms are not no-ops (else matching them would test nothing): padding changes the pads'
    own logits only (they attend to no pad), packing every later document's."""
    model = tiny_model("mixtral", LMS["mixtral"], seed=1)
    ids = torch.randint(3, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        forms = {f: model(input_ids=ids, use_cache=False, **kw).logits for f, kw in real_batches().items()}
    changed = lambda got: (got - plain).abs().amax(-1) > 1e-4  # noqa: E731 - [b, s]: which tokens' logits moved
    assert changed(forms["padded"]).nonzero().tolist() == [[1, c] for c in range(11, S)]   # no real token sees a pad
    packed = changed(forms["packed"])
    assert not packed[0, :7].any() and packed[0, 7:].all() and packed[1, 5:].all()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3"])
def test_padded_and_packed_batches_match_eager_on_one_rank(family):
    _assert_matches(batch_cases(0, 1, [_case(family, "sp", "ep", "a2a")], seed=31), "n=1")


# Mixtral with the router's aux loss (coef 0.5, so that pads counted in it would show: 8e-4 in the
# loss, 0.36 in the router's gradient): transformers leaves the pads out of it. Under both dispatches
# each rank routes its own tokens (ag-rs gathers the routing after; b = 2 rows, so the gathered
# routing's [b, nL] order must be the tokens'), also DeepSeek-V3's score-biased, group-limited router
N2_CASES = [_case("mixtral", "sp", "ep", "a2a", passes="chunk=2", overrides=AUX),
            _case("mixtral", "tp", "ep", "ag-rs", passes="chunk=2", overrides=AUX),
            _case("deepseek_v3", "sp", "ep", "ag-rs"),
            _case("gpt_oss", "tp", "tp", "ag-rs", overrides=dict(layer_types=["sliding_attention", "full_attention"])),
            _case("llama4", "sp", "tp", "ag-rs"),
            _case("qwen3_moe", "tp", "ep", "ag-rs", dp=2)]
N2 = RANK_BATCH.add(2, "batches.batch_cases", batch_cases, N2_CASES, int.from_bytes(os.urandom(3), "little"))


def test_padded_and_packed_batches_on_two_gloo_ranks_match_eager(rank_results):
    for rank, results in enumerate(rank_results(2, N2)):
        assert len(results) == len(N2_CASES)
        _assert_matches(results, f"rank {rank}")


# The attention on each of 2 nodes of 2 ranks (attn_nodes=2): each node's attention holds one of the
# b = 2 rows, so the padded row's mask and the packed rows' documents must follow the row to its node
# (runtime.model_steps.rank_rows), its RoPE positions the rank's sequence shard of 2, not of 4.
# MLA's replicated down-projections (partial gradients per rank under TP) and GPT-OSS's sinks and
# sliding window too.
N4_CASES = [_case("mixtral", "sp", "ep", "a2a", attn_nodes=2, overrides=AUX),
            _case("qwen3_moe", "tp", "ep", "a2a", attn_nodes=2),
            _case("deepseek_v3", "tp", "ep", "a2a", attn_nodes=2),
            _case("gpt_oss", "sp", "ep", "a2a", attn_nodes=2,
                  overrides=dict(layer_types=["sliding_attention", "full_attention"]))]
N4 = RANK_BATCH.add(4, "batches.batch_cases", batch_cases, N4_CASES, int.from_bytes(os.urandom(3), "little"))


def test_padded_and_packed_batches_with_the_attention_on_each_node_match_eager(rank_results):
    for rank, results in enumerate(rank_results(4, N4)):
        assert len(results) == len(N4_CASES)
        _assert_matches(results, f"rank {rank}")


# -- gradient accumulation: CompiledModel.train_step, M = 2 micro-batches in one merged step -------

ACCUMULATION = RANK_BATCH.add(2, "batches.accumulation_case", accumulation_case, _case("qwen3_moe", "sp", "ep", "a2a"),
                              int.from_bytes(os.urandom(3), "little"))


def test_train_step_accumulates_a_padded_and_a_packed_micro_batch_as_eager(rank_results):
    """Micro-batch 0 right-padded, 1 packed, on 2 gloo ranks (Qwen3-MoE sequence-parallel: RoPE and
    the masks on each rank's half): both losses and every gradient as eager's
    ``(loss_j / 2).backward()`` per micro-batch, and, given num_items_in_batch, as transformers'
    Trainer's ``loss_j.backward()`` of each summed cross-entropy / the step's scored tokens; a
    left-padded micro-batch is refused naming it."""
    for rank, res in enumerate(rank_results(2, ACCUMULATION)):
        assert "refused" not in res, (rank, res)
        for reduction in ("mean", "items"):
            assert res[reduction]["loss"] < TOL and res[reduction]["grads"] < TOL, (rank, reduction, res)
        assert res["refusal"].startswith("micro-batch 1's attention_mask row 1 starts with a 0 (left padding)"), res
        assert "\n" not in res["refusal"]


# -- the forms not modelled: one line each, naming the form ----------------------------------------

@pytest.fixture(scope="module")
def compiled():
    import moegraph
    model = tiny_model("mixtral", LMS["mixtral"], seed=2)
    ids = torch.randint(3, VOCAB, (B, S), generator=torch.Generator().manual_seed(2))
    return moegraph.compile(model, ids, hardware="cpu-gloo", schedule="greedy", passes=""), ids


def _mask(*holes: tuple[int, int]) -> torch.Tensor:
    mask = torch.ones(B, S, dtype=torch.long)
    for row, col in holes:
        mask[row, col] = 0
    return mask


@pytest.mark.parametrize("kwargs, message", [
    (dict(attention_mask=_mask((1, 0), (1, 1))), r"attention_mask row 1 starts with a 0 \(left padding\)"),
    (dict(attention_mask=_mask((0, 5))), "attention_mask row 0 has a 1 after a 0: only right padding"),
    (dict(attention_mask=_mask(*((1, c) for c in range(S)))), r"^attention_mask row 1 is all zeros: it masks every token"),
    (dict(attention_mask=_mask()[:, None, None, :].float()), r"attention_mask: a 4-D mask \[2, 1, 1, 16\] is not"),
    (dict(attention_mask=_mask() * 2), "attention_mask holds values other than 0 and 1"),
    (dict(attention_mask=_mask()[:, :8]), r"attention_mask has shape \[2, 8\]"),
    (dict(attention_mask=_mask((1, 15)), position_ids=torch.arange(S)[None]), "attention_mask and position_ids together"),
    (dict(position_ids=torch.arange(S)[None].float()), r"position_ids is torch.float32 \[1, 16\]"),
    (dict(position_ids=(torch.arange(S) % 8)[None]), "pass use_cache=False"),       # transformers' cache default
])
def test_forms_not_modelled_are_refused_in_one_line(compiled, kwargs, message):
    model, ids = compiled
    with pytest.raises(ValueError, match=message) as err:
        model(ids, **kwargs)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def aux_step():
    """A tiny Mixtral with the router's aux loss, compiled for a step of 2 micro-batches, and 2 batches."""
    import moegraph
    model = tiny_model("mixtral", LMS["mixtral"], seed=5, **AUX)
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, VOCAB, (B, S), generator=gen) for _ in range(2)]
    return model, moegraph.compile(model, ids[0], hardware="cpu-gloo", schedule="greedy", passes="", micro_batches=2), ids


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_items_in_batch=0), "num_items_in_batch=0: pass the step's count of scored tokens"),
])
def test_train_step_refuses_in_one_line(aux_step, kwargs, message):
    _, compiled, ids = aux_step
    with pytest.raises(ValueError, match=message) as err:
        compiled.train_step(ids, ids, **kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("reduction", ["mean", "items"])
def test_train_step_with_the_aux_loss_and_a_padded_micro_batch_matches_eager(aux_step, reduction):
    """Micro-batch 0 right-padded (its labels -100 at the pads, as SFT collators): its aux loss over
    its unpadded tokens (transformers' load_balancing_loss_func weights the rows by the mask),
    micro-batch 1 plain. ``mean``: eager ``(loss_j / 2).backward()``; ``items``: transformers'
    Trainer's reduction, each loss_j = its summed cross-entropy / N + coef * its aux loss,
    backward of each, no 1/M."""
    from moegraph.runtime.check import grad_report
    model, compiled, ids = aux_step
    mask = _mask(*((1, c) for c in range(10, S)))
    labels = [ids[0].masked_fill(mask == 0, -100), ids[1].masked_fill(_mask((1, 9), (0, 3)) == 0, -100)]
    items = sum(int((y[:, 1:] != -100).sum()) for y in labels)
    kw, scale = ({}, 0.5) if reduction == "mean" else ({"num_items_in_batch": items}, 1.0)
    model.zero_grad(set_to_none=True)
    compiled.zero_grad(set_to_none=True)
    losses = compiled.train_step(ids, labels, attention_mask=[mask, None], **kw)
    for x, y, m, got in zip(ids, labels, (mask, None), losses):
        loss = model(input_ids=x, labels=y, attention_mask=m, use_cache=False, **kw).loss
        (loss * scale).backward()
        assert abs(float(got) - loss.item()) < TOL * loss.item()
    grads = compiled.full_grads()
    report = grad_report({k: (grads[k], p.grad) for k, p in model.named_parameters()})
    assert report["max_rel_err_grads"] < TOL, report


@pytest.mark.slow
def test_gpt_oss_micro_batches_accumulate_the_sinks_gradient_as_eager():
    """A merged step of M micro-batches sums each gradient over them; GPT-OSS's sinks gradient is
    one of its attention backward's several outputs (with dq, dk, dv), summed by an ADD node."""
    import moegraph
    from moegraph.runtime.check import grad_report
    model = tiny_model("gpt_oss", LMS["gpt_oss"], seed=4)
    gen = torch.Generator().manual_seed(4)
    ids = [torch.randint(3, VOCAB, (B, S), generator=gen) for _ in range(2)]
    compiled = moegraph.compile(model, ids[0], hardware="cpu-gloo", schedule="greedy", passes="", micro_batches=2)
    compiled.train_step(ids, ids)
    for x in ids:                                        # eager accumulation of (loss / M).backward()
        (model(input_ids=x, labels=x).loss / 2).backward()
    grads = compiled.full_grads()
    report = grad_report({k: (grads[k], p.grad) for k, p in model.named_parameters()})
    assert report["max_rel_err_grads"] < TOL, report
