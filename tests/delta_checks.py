"""What the linear-attention families' tests (tests/test_qwen3_next.py: Gated DeltaNet;
tests/test_kimi_linear.py: Kimi Delta Attention) check alike: the tolerances, the reference l2
norm, the padded/packed and n=2 result checks, a refusal's one line, and a decay or conv weight
perturbed so that it matters (compiled against the eager module)."""

from __future__ import annotations

import copy

import pytest
import torch

from family_workers import compile_case, step_errors
from moegraph.builder import ConfigError
from moegraph.ir import Strategy
from moegraph.lowering import LoweringError
from moegraph.tracer import trace_causal_lm

TOL = 1e-5
GRAD_TOL_RANKS = 3e-5
"""Gradients on 2 gloo ranks: a weight's gradient is the sum of the ranks' partial sums, rounded in
another order than eager's one-process sum; the delta rule's decay gradients (A_log, dt_bias) are
sums of many cancelling terms, so that reordering shows (seen 1.2e-5 once in CI, under the
arbitration against float64 of family_workers.step_errors)."""


def l2(x: torch.Tensor) -> torch.Tensor:
    """The references' l2 normalisation of the last dim (transformers' l2norm, eps 1e-6)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def check_batches(results) -> None:
    """Padded and packed batches (family_workers.batch_cases) within TOL of eager."""
    for res in results:
        assert "refused" not in res, res
        for form in ("padded", "packed"):
            assert res[form]["logits"] < TOL and res[form]["loss"] < TOL and res[form]["grads"] < TOL, (form, res)


def check_two_ranks(rank_results, batch, cases: list) -> None:
    """Every case of an n=2 spawn (helpers.RANK_BATCH) on both ranks within TOL (gradients GRAD_TOL_RANKS)."""
    for rank, results in enumerate(rank_results(2, batch)):
        assert len(results) == len(cases)
        for res in results:
            assert "refused" not in res, (rank, res)
            assert res["logits"] < TOL and res["loss"] < TOL and res["grads"] < GRAD_TOL_RANKS, (rank, res)


def refusal(model, **strategy) -> str:
    """The one line lowering ``model`` raises (sp/ep/a2a at n=1, fp32, unless ``strategy`` says)."""
    with pytest.raises((LoweringError, ConfigError)) as info:
        trace_causal_lm(model, Strategy(**({"attn": "sp", "ffn": "ep", "dispatch": "a2a", "n": 1, "dtype": "fp32"}
                                           | strategy)), batch=2, seq=16)
    text = str(info.value)
    assert "\n" not in text
    return text


def perturbed_weight_matches_eager(case: dict, seed: int, param_name: str, change) -> None:
    """``change`` applied to the parameter ``param_name`` moves eager's logits (it matters), and the
    compiled model of the changed weights matches eager again, its gradient nonzero."""
    import moegraph
    base, ids, _ = compile_case(case, seed)
    with torch.no_grad():
        before = base(input_ids=ids).logits
    moved = copy.deepcopy(base)
    param = moved.get_parameter(param_name)
    with torch.no_grad():
        param.copy_(change(param))
        after = moved(input_ids=ids).logits
    assert float((after - before).norm() / before.norm()) > 1e-3
    compiled = moegraph.compile(moved, ids, hardware="cpu-gloo", attn=case["attn"], ffn=case["ffn"],
                                dispatch=case["dispatch"], schedule="greedy", timeout_s=120.0)
    res = step_errors(compiled, moved, ids, ids.clone())
    assert res["logits"] < TOL and res["grads"] < TOL, res
    assert float(compiled.full_grads()[param_name].norm()) > 0
