"""`moegraph run --pp`: the pipeline step compiled by the one driver and trained on P x n gloo
ranks in torch's runtime (runtime/pipeline_run.py), checked against eager; its refusals.

Tiny: a 2-layer copy of the registry's `tiny` (h=64, 4 experts top-2) at s=16, vocab 64, P=2,
n=1, dp=2, M=4, the router's aux loss (coef 0.5), stage layers list-scheduled, 2 AdamW steps."""

from __future__ import annotations

import json

import pytest

from moegraph.cli import main

TINY2 = """name: tiny2
layers: 2
hidden: 64
heads: 4
kv_heads: 2
ffn_hidden: 128
experts: 4
top_k: 2
"""


def flags(tmp_path, schedule: str = "greedy", extra_fields: str = "") -> list[str]:
    model = tmp_path / "tiny2.yaml"
    model.write_text(TINY2 + extra_fields)
    return ["run", "--model", str(model), "--n", "1", "--seq", "16", "--micro-batches", "4", "--vocab", "64",
            "--schedule", schedule, "--time-limit", "1"]


@pytest.mark.slow
def test_run_pp_trains_the_pipeline_step_as_eager(tmp_path, capsys):
    """Two stages of one layer each, two data-parallel replicas of them on four ranks, the
    driver's order in torch's runtime, the replicas' gradients averaged after each step, the
    router's aux loss summed over the stages: every micro-batch loss of 2 AdamW steps matches the
    eager model's gradient accumulation over the global batch (dp x M micro-batches; without the
    average the second step's differ by ~5e-4, without the aux loss every one by ~1)."""
    assert main([*flags(tmp_path, extra_fields="router_aux_loss_coef: 0.5\n"), "--pp", "2", "--dp", "2", "--steps",
                 "2", "--warmup", "0", "--check", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["pp"], r["dp"], r["world"], r["stages"], r["micro_batches"]) == (2, 2, 4, [[0], [1]], 4)
    assert r["strategy"]["passes"] == ["gate-reorder", "sar=paper"]     # the default passes, as lowered (not [])
    assert len(r["losses"]) == 2 and all(len(step) == 2 * 4 for step in r["losses"])
    assert r["max_rel_err_loss"] < 1e-5, r
    assert r["step_us"] > 0 and r["predicted_step_us"] > 0


@pytest.mark.slow
def test_run_pp_with_a_folded_attention_and_node_dispatch_trains_as_eager(tmp_path, capsys):
    """Two stages on n=4 ranks as 2 nodes of 2: the attention TP on each node's 2 ranks over one of
    the b=2 rows, the experts' dispatch in two hops; stage boundaries carry [b/2, s/2, h] per rank.
    Both fields reach the stages' graphs (their collectives run on the node and attention axes; `run
    --pp` once dropped --ep-nodes), and the losses of 2 AdamW steps match eager's."""
    assert main([*flags(tmp_path), "--n", "4", "--batch", "2", "--dispatch", "a2a", "--attn", "tp", "--attn-nodes", "2",
                 "--ep-nodes", "2", "--pp", "2", "--steps", "2", "--warmup", "0", "--check", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["pp"], r["world"], r["strategy"]["attn_nodes"], r["strategy"]["ep_nodes"]) == (2, 8, 2, 2), r
    assert {"attn", "attn_dp", "node", "rail"} <= set(r["axes"]), r["axes"]
    assert r["max_rel_err_loss"] < 1e-5, r


@pytest.mark.parametrize("extra, schedule, fields, message", [
    (["--vpp", "2"], "greedy", "", "--vpp and --placement apply to a pipeline: give --pp P"),
    (["--pp", "2", "--train-steps", "1"], "greedy", "", "it does not take --train-steps"),
    (["--pp", "2"], "sequential", "", "by greedy or cpsat"),
    (["--pp", "3"], "greedy", "", "pp=3 x vpp=1 = 3 stages exceed the 2 layers"),
])
def test_run_pp_refuses_what_it_cannot_run_in_one_line(tmp_path, capsys, extra, schedule, fields, message):
    """Exit 2, one stderr line naming the flag, before any rank starts."""
    try:
        rc = main([*flags(tmp_path, schedule, fields), *extra])
    except SystemExit as stop:
        rc = stop.code
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert message in err


def test_the_reference_models_aux_loss_is_transformers():
    """moegraph.models.load_balancing_loss (the eager reference `run --pp --check` trains against)
    is transformers' load_balancing_loss_func on the same router logits, and MoETransformer adds
    coef x it to its loss."""
    import torch
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    from moegraph.models import MoETransformer, MoETransformerLayer, causal_lm_loss, load_balancing_loss
    gen = torch.Generator().manual_seed(3)
    logits = [torch.randn(24, 8, generator=gen) for _ in range(3)]
    want = mixtral.load_balancing_loss_func(tuple(logits), 8, 2)
    assert abs(float(load_balancing_loss(logits, 2)) - float(want)) < 1e-6 * float(want)
    torch.manual_seed(0)
    model = MoETransformer(64, [MoETransformerLayer(32, 4, 2, 48, 8, 2) for _ in range(2)], 32, router_aux_loss_coef=0.5)
    ids = torch.randint(0, 64, (2, 12), generator=gen)
    with torch.no_grad():
        plain = causal_lm_loss(model(ids).logits, ids)
        assert float(model(ids, labels=ids).loss - plain) > 0.5      # aux >= 1 (equality at a uniform router)
