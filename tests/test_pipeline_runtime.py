"""A CP-SAT pipeline order, exported as torch's action CSV, runs in torch's _PipelineScheduleRuntime
on gloo (P=2, M=4) and matches the eager model: per-micro-batch losses and every gradient."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

import pipeline_workers
from helpers import RANK_BATCH, fresh_seed, rel_err
from moegraph.models import causal_lm_loss
from moegraph.passes.stages import StageLayout
from moegraph.schedules.pipeline import Action, Pair, PipelineProblem, StageWork
from moegraph.schedules.pipeline_cpsat import solve_pipeline
from moegraph.schedules.pipeline_torch import csv_text, torch_orders, torch_schedules_for

M = 4
SEED = fresh_seed()
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@functools.cache
def cpsat_order(layout: StageLayout, saving: int) -> tuple:
    """CP-SAT's order for costs where splitting W (heavy) and, on a V-shape, pairing pay."""
    S = len(layout.stages)
    work = tuple(StageWork(10, 10, 10, 20, saving, 0, 1, 0) for _ in range(S))
    problem = PipelineProblem(layout, M, work, (1,) * (S - 1), (1,) * (S - 1), (0,) * layout.pp,
                              (0,) * layout.pp)
    warm = {n: torch_orders(n, layout, M) for n in torch_schedules_for(layout)}
    res = solve_pipeline(problem, warm, time_limit_s=1)
    assert res.source == "cpsat"
    return res.timeline.orders


CASES = {
    "one stage per rank": (StageLayout(((0, 1), (2,)), 2, "loop"), 0),
    "V-shape with pairs": (StageLayout(((0,), (1,), (2,), (3,)), 2, "v"), 8),
}


def _register(name: str, layout: StageLayout, saving: int) -> str:
    def args():
        text = csv_text(cpsat_order(layout, saving))
        return (text, layout.stages, layout.placement, M, SEED)
    return RANK_BATCH.add(2, f"pipeline.torch_runtime.{name}", pipeline_workers.torch_runtime_step, make_args=args,
                          timeout_s=120)


RUNS = {name: _register(name, *case) for name, case in CASES.items()}


def eager(layers: int) -> tuple[list[float], dict]:
    model = pipeline_workers.tiny_model(layers, SEED)
    ids, labels = pipeline_workers.batch(M, SEED)
    losses = [causal_lm_loss(model(ids[j * pipeline_workers.B:(j + 1) * pipeline_workers.B]).logits, labels[j * pipeline_workers.B:(j + 1) * pipeline_workers.B])
              for j in range(M)]
    torch.stack(losses).mean().backward()
    return [float(x.detach()) for x in losses], {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_cpsat_csv_runs_in_torch_runtime_and_matches_eager(name, tmp_path):
    layout, saving = CASES[name]
    ranks = RANK_BATCH.get(2, RUNS[name], tmp_path)
    losses_ref, grads_ref = eager(layout.layers)
    last = layout.rank_of(len(layout.stages) - 1)
    assert ranks[last]["losses"] == pytest.approx(losses_ref, rel=1e-5), f"seed {SEED}"
    got = {k: g for r in ranks for k, g in r["grads"].items()}
    assert set(got) == set(grads_ref)
    for k, g in got.items():
        err = ((g - grads_ref[k]).norm() / grads_ref[k].norm().clamp_min(1e-30)).item()
        assert err < 1e-5, f"gradient of {k}: {err:.2e} (seed {SEED})"


@pytest.mark.slow
def test_the_orders_use_what_torch_runs():
    """The V-shape order overlaps pairs and the other splits W: both are what the runtime executes."""
    v = cpsat_order(*CASES["V-shape with pairs"])
    assert any(isinstance(i, Pair) for row in v for i in row)
    one = cpsat_order(*CASES["one stage per rank"])
    assert any(isinstance(i, Action) and i.kind == "W" for row in one for i in row)


# -- moegraph's compiled stages: a whole Hugging Face model trained 3 steps ------------------------

MIB = 2**20


@functools.cache
def compiled_order() -> tuple:
    """CP-SAT's order (B only: a compiled stage runs its backward as one plan; no pairs: the
    stages' own plans alone, paired_order covers the merged F&B) for a
    P=2 step whose transfers take half a forward, under a cap of 3 micro-batches in flight: it
    beats both torch schedules that fit (1F1B; GPipe holds 4)."""
    layout = StageLayout(((0,), (1,)), 2)
    work = tuple(StageWork(10, 20, 10, 20, 0, 0, MIB, 0) for _ in range(2))
    problem = PipelineProblem(layout, M, work, (10,), (10,), (0, 0), (0, 0), memory_cap_bytes=3 * MIB)
    res = solve_pipeline(problem, {n: torch_orders(n, layout, M) for n in torch_schedules_for(layout)},
                         time_limit_s=1, pairs=False, split=False)
    assert res.source == "cpsat"
    return res.timeline.orders


def _register_compiled(n: int) -> str:
    def args():
        text = csv_text(compiled_order())
        return (text, ((0,), (1,)), n, M, SEED)
    return RANK_BATCH.add(2 * n, f"pipeline.compiled.n{n}", pipeline_workers.compiled_training, make_args=args,
                          timeout_s=240)


COMPILED = {n: _register_compiled(n) for n in (1, 2)} if HAS_TRANSFORMERS else {}


@functools.cache
def paired_order() -> tuple:
    """CP-SAT's order (B only) for a P=2 step where an F&B pair saves its whole F: it overlaps
    pairs on both ranks, a stage's F beside its own B ((0F2;0B0), (1F1;1B0), (1F3;1B2))."""
    return _pairing_order(StageLayout(((0,), (1,)), 2), send=10, memory_cap_bytes=3 * MIB)


def _pairing_order(layout: StageLayout, send: int, memory_cap_bytes: int | None = None) -> tuple:
    """CP-SAT's order (B only) on ``layout`` when an F&B pair saves its whole F (each stage F 10,
    B 20 ticks, a send ``send``): the orders the pair tests run."""
    S = len(layout.stages)
    work = tuple(StageWork(10, 20, 10, 20, 20, 0, MIB, 0) for _ in range(S))
    problem = PipelineProblem(layout, M, work, (send,) * (S - 1), (send,) * (S - 1), (0,) * layout.pp,
                              (0,) * layout.pp, memory_cap_bytes=memory_cap_bytes)
    res = solve_pipeline(problem, {n: torch_orders(n, layout, M) for n in torch_schedules_for(layout)},
                         time_limit_s=1, split=False)
    assert res.source == "cpsat"
    return res.timeline.orders


def _register_paired() -> str:
    def args():
        text = csv_text(paired_order())
        return (text, ((0,), (1,)), 1, M, SEED, True, ("sgd",))
    return RANK_BATCH.add(2, "pipeline.compiled.pairs", pipeline_workers.compiled_training, make_args=args,
                          timeout_s=120)


PAIRED = _register_paired() if HAS_TRANSFORMERS else None


def eager_training(optimizers: tuple = tuple(pipeline_workers.OPTIMIZERS), layers: int = 2) -> dict:
    """The same model, data and optimizers, eager: gradient accumulation over the M micro-batches."""
    from model_workers import mixtral_model
    from moegraph.runtime.check import eager_accumulate
    data = pipeline_workers.hf_batches(SEED, M)
    out = {}
    for name in optimizers:
        make = pipeline_workers.OPTIMIZERS[name]
        model = mixtral_model(SEED, layers)
        init = {k: p.detach().clone() for k, p in model.named_parameters()}
        opt = make(model.parameters())
        losses = []
        for ids, labels in data:
            opt.zero_grad()
            losses.append(eager_accumulate(model, list(zip(ids.chunk(M), labels.chunk(M)))))
            opt.step()
        out[name] = {"losses": losses, "params": {k: p.detach() for k, p in model.named_parameters()}, "init": init}
    return out


def assert_sgd_params_match(ranks: list, ref: dict) -> None:
    """Every parameter after the SGD steps (and its update) matches eager's."""
    got = {k: v for r in ranks for k, v in r["sgd"]["params"].items()}
    want, init = ref["sgd"]["params"], ref["sgd"]["init"]
    assert set(got) == set(want)
    for k, p in got.items():
        assert rel_err(p, want[k]) < 1e-5, f"parameter {k} (seed {SEED})"
        assert rel_err(p - init[k], want[k] - init[k]) < 1e-4, f"update of {k} (seed {SEED})"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("n", [1, 2])
def test_compiled_stages_train_hf_mixtral_as_eager(n, tmp_path):
    """P=2 compiled stages (n ranks each) in torch's runtime, CP-SAT's order, M=4: after 3 SGD
    steps every parameter (and its update) matches eager's, and 3 AdamW steps give eager's losses."""
    ranks = RANK_BATCH.get(2 * n, COMPILED[n], tmp_path)
    assert all(r["kinds"] == ["CompiledLayer"] for r in ranks)
    ref = eager_training()
    last = ranks[-1]                                  # rank (P-1)*n + n-1 holds the last stage
    for name in ("sgd", "adamw"):
        got = [x for step in last[name]["losses"] for x in step]
        assert got == pytest.approx([x for step in ref[name]["losses"] for x in step], rel=1e-5), f"{name}, seed {SEED}"
    assert_sgd_params_match(ranks, ref)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_merged_pairs_train_hf_mixtral_as_eager(tmp_path):
    """CP-SAT's order with F&B pairs on both ranks, each run as the stage's merged F&B plan
    (torch's OVERLAP_F_B by register_custom_function), P=2 n=1 M=4: after 3 SGD steps every
    parameter matches eager's."""
    pairs = [i for row in paired_order() for i in row if isinstance(i, Pair)]
    assert pairs and all(p.forward.stage == p.backward.stage for p in pairs)
    ranks = RANK_BATCH.get(2, PAIRED, tmp_path)
    for r, row in zip(ranks, paired_order()):
        mine = sum(isinstance(i, Pair) for i in row)
        assert r["merged"] == mine and r["pair_runs"] == mine * pipeline_workers.STEPS, r
    ref = eager_training(("sgd",))
    assert_sgd_params_match(ranks, ref)
    assert [x for step in ranks[-1]["sgd"]["losses"] for x in step] == pytest.approx(
        [x for step in ref["sgd"]["losses"] for x in step], rel=1e-5)


def test_a_pair_without_its_plan_is_refused_by_name():
    """A V-shape's turn pairs stage 0's F with stage 3's B: stages compiled without that pair's
    plan (compile_stages(cross_pairs=...)), or without merged plans at all, refuse it by name."""
    from types import SimpleNamespace

    from moegraph.runtime import RuntimeFailure
    from moegraph.runtime.pipeline_pair import check_merged_pairs
    orders = ((Pair(Action("F", 0, 1), Action("B", 3, 0)),), ())
    class Runner:                               # a stage's PairRunner with only its own pair's plan
        def __init__(self):
            self.plans = {self: None}
    own = {k: SimpleNamespace(pair=Runner()) for k in (0, 3)}
    with pytest.raises(RuntimeFailure, match=r"pair \(0F1;3B0\) overlaps stage 0's forward with stage 3's backward, "
                                             r"but the stages were compiled without that pair's plan"):
        check_merged_pairs(orders, own, (0, 3))
    same = ((Pair(Action("F", 0, 1), Action("B", 0, 0)),), ())
    with pytest.raises(RuntimeFailure, match="stage 0 was compiled without its merged F&B plan"):
        check_merged_pairs(same, {0: object()}, (0,))


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_a_compiled_last_stage_computes_the_models_final_layernorm_and_logit_scale():
    """Cohere2-MoE (a bias-free final LayerNorm, logits x logit_scale=0.0625) as one compiled stage
    (first and last, n=1, in this process): its logits, loss and the final norm's and head's
    gradients match eager; against eager with the scale forced to 1 the logits differ."""
    from family_zoo import VOCAB, moe_causal_lms, tiny_model
    from moegraph.runtime.pipeline import ShardLoss, compile_stages
    lms = dict(moe_causal_lms())
    if "cohere2_moe" not in lms:
        pytest.skip("the installed transformers has no cohere2_moe")
    model = tiny_model("cohere2_moe", lms["cohere2_moe"], seed=SEED % 1000)
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(SEED))
    (stage,) = compile_stages(model, StageLayout(((0, 1),), 1), ids, hardware="cpu-gloo", passes="",
                              schedule="greedy").values()
    logits = stage(ids)
    ShardLoss(0, stage.layers.graph.strategy)(logits, ids).backward()
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    assert rel_err(logits, ref.logits) < 1e-5
    assert rel_err(stage.norm.grad, model.model.norm.weight.grad) < 1e-5
    assert rel_err(stage.lm_head.grad, model.lm_head.weight.grad) < 1e-5
    model.logit_scale = 1.0
    with torch.no_grad():
        assert rel_err(logits, model(input_ids=ids).logits) > 0.9


# -- batches as training feeds them: padded and packed micro-batches, both loss reductions --------

def _register_batches(n: int, overrides: dict) -> str:
    def args():
        text = csv_text(paired_order())
        return (text, ((0,), (1,)), n, M, SEED, True, overrides)
    name = f"pipeline.compiled.batches.n{n}{'.aux' if overrides else ''}"
    return RANK_BATCH.add(2 * n, name, pipeline_workers.compiled_batch_step, make_args=args, timeout_s=120)


# the router's aux loss (coef 0.5, so that pads counted in it would show), summed over the stages
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.5)
BATCHES = ({(1, ""): _register_batches(1, {}), (1, "aux"): _register_batches(1, AUX), (2, "aux"): _register_batches(2, AUX)}
           if HAS_TRANSFORMERS else {})


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("n, aux", list(BATCHES))
def test_padded_and_packed_micro_batches_match_eager(n, aux, tmp_path):
    """P=2 compiled stages, CP-SAT's order with merged F&B pairs on both ranks, M=4 micro-batches
    alternately right-padded and packed (tests/family_workers.real_batches): the losses and every
    parameter's gradient match eager gradient accumulation within 1e-5, for the mean of the
    micro-batch losses and for num_items_in_batch."""
    ranks = RANK_BATCH.get(2 * n, BATCHES[n, aux], tmp_path)
    assert all(r["merged"] > 0 for r in ranks)
    ref = pipeline_workers.eager_batch_step(SEED, M, 2, AUX if aux else {})
    for reduction in pipeline_workers.REDUCTIONS:
        got = ranks[-1][reduction]["losses"]
        assert rel_err(got, ref[reduction]["losses"]) < 1e-5, (reduction, got, ref[reduction]["losses"], SEED)
        grads = {k: g for r in ranks for k, g in r[reduction]["grads"].items()}
        assert set(grads) == set(ref[reduction]["grads"])
        for k, g in grads.items():
            assert rel_err(g, ref[reduction]["grads"][k]) < 1e-5, f"{reduction}: gradient of {k} (seed {SEED})"


# -- a V-shape's turn: F&B pairs of two stages, merged ---------------------------------------------

V_LAYOUT = StageLayout(((0,), (1,), (2,), (3,)), 2, "v")


@functools.cache
def v_order() -> tuple:
    """CP-SAT's order (B only) for a V-shape (stages 0 and 3 on rank 0, 1 and 2 on rank 1) where
    an F&B pair saves its whole F: it overlaps pairs of two stages both ways at the turn
    ((0F2;3B0), (3F2;0B0), (1F2;2B0), (2F2;1B0), ...) beside a stage's own."""
    return _pairing_order(V_LAYOUT, send=1)


def _register_v() -> str:
    def args():
        text = csv_text(v_order())
        return (text, V_LAYOUT.stages, 1, M, SEED, True, ("sgd",), "v")
    return RANK_BATCH.add(2, "pipeline.compiled.v_pairs", pipeline_workers.compiled_training, make_args=args,
                          timeout_s=120)


V_PAIRS = _register_v() if HAS_TRANSFORMERS else None


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_v_shape_pairs_of_two_stages_train_as_eager(tmp_path):
    """The V-shape's order with pairs of two stages (cross_pair_graph: one stage's forward beside
    another's backward, each stage's parameters its own), each run as one merged plan, P=2 n=1
    M=4, 4 layers: after 3 SGD steps every parameter matches eager's."""
    pairs = [i for row in v_order() for i in row if isinstance(i, Pair)]
    assert any(p.forward.stage != p.backward.stage for p in pairs)
    ranks = RANK_BATCH.get(2, V_PAIRS, tmp_path)
    for r, row in zip(ranks, v_order()):
        mine = sum(isinstance(i, Pair) for i in row)
        assert r["merged"] == mine and r["pair_runs"] == mine * pipeline_workers.STEPS, r
    ref = eager_training(("sgd",), layers=4)
    assert_sgd_params_match(ranks, ref)
    assert [x for step in ranks[0]["sgd"]["losses"] for x in step] == pytest.approx(
        [x for step in ref["sgd"]["losses"] for x in step], rel=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_a_batch_form_a_stage_cannot_run_is_refused_in_one_line():
    """As train_step's: a left-padded micro-batch, both forms in one micro-batch, a step's forms
    as one tensor instead of one per micro-batch: one line naming the micro-batch and the form."""
    from model_workers import mixtral_model
    from moegraph.runtime.pipeline import compile_stages
    from moegraph.tokens import micro_batch_forms
    model = mixtral_model(SEED, 2)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(SEED))
    (stage,) = compile_stages(model, StageLayout(((0, 1),), 1), ids, passes="", schedule="greedy").values()
    ones = torch.ones(2, 16, dtype=torch.long)
    left = ones.clone()
    left[1, :3] = 0
    with pytest.raises(ValueError, match=r"^micro-batch 1's attention_mask row 1 starts with a 0 \(left padding\)"):
        stage.set_layouts([(None, None), (left, None)])
    with pytest.raises(ValueError, match="^micro-batch 0's attention_mask and position_ids together are not supported"):
        stage.set_layouts([(left.flip(-1), torch.arange(16)[None])])
    with pytest.raises(ValueError, match=r"a step of 2 micro-batches takes attention_mask as None or a sequence of 2 "
                                         r"entries .* got one tensor \[4, 16\]"):
        micro_batch_forms(torch.ones(4, 16), None, 2)
    stage.set_layouts([(ones, None), (None, torch.arange(16)[None])])      # plain forms: nothing to lay out
    assert stage.layouts == [None, None]
