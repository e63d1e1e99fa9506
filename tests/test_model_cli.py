"""`moegraph run --layers L` and `run --train-steps K --check` on 2 gloo ranks, on a tiny
two-layer model from a user YAML (h=32): the compiled runs match eager."""

from __future__ import annotations

import json

import pytest

from moegraph.cli import main

TINY2 = "name: tiny2\nlayers: 2\nhidden: 32\nheads: 4\nkv_heads: 2\nffn_hidden: 48\nexperts: 4\ntop_k: 2\n"
COMMON = ["--n", "2", "--seq", "16", "--batch", "2", "--schedule", "greedy", "--hardware", "cpu-gloo", "--json"]


@pytest.fixture
def tiny2(tmp_path):
    path = tmp_path / "tiny2.yaml"
    path.write_text(TINY2)
    return str(path)


def _run(argv, capsys) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_run_train_steps_check_matches_eager(tmp_path, capsys):
    """With the routers' load-balancing loss (coef 0.5): the eager MoETransformer adds it as
    transformers' Mixtral does, so a compiled step without it would miss by 0.5 x aux (~1.0 here)."""
    path = tmp_path / "tiny2aux.yaml"
    path.write_text(TINY2 + "router_aux_loss_coef: 0.5\n")
    r = _run(["run", "--model", str(path), "--layers", "all", "--train-steps", "3", "--vocab", "64", "--check",
              *COMMON], capsys)
    assert r["layers"] == 2 and len(r["losses"]) == len(r["eager_losses"]) == 3
    assert r["max_rel_err_loss"] < 1e-5 and r["max_rel_err_params"] < 1e-5 and r["max_rel_err_grads"] < 1e-5, r
    assert r["losses"][0] != r["losses"][-1]


@pytest.mark.slow
def test_run_layers_checks_the_stack_against_eager(tiny2, capsys):
    r = _run(["run", "--model", tiny2, "--layers", "2", "--check", "--steps", "1", "--warmup", "0", *COMMON], capsys)
    assert r["layers"] == 2
    assert r["max_rel_err_output"] < 1e-5 and r["max_rel_err_grads"] < 1e-5, r
    assert r["worst_grad"].startswith("layers.")


@pytest.mark.slow
def test_run_train_steps_dp2_check_matches_eager(tiny2, capsys):
    """n=2 x dp=2 (4 ranks): the global batch [dp*b, s] is split over the replicas; training still
    follows eager training on the whole batch."""
    r = _run(["run", "--model", tiny2, "--layers", "all", "--train-steps", "2", "--vocab", "64", "--dp", "2",
              "--check", *COMMON], capsys)
    assert r["n"] == 2 and r["dp"] == 2 and len(r["losses"]) == 2
    assert r["max_rel_err_loss"] < 1e-5 and r["max_rel_err_params"] < 1e-5 and r["max_rel_err_grads"] < 1e-5, r
