"""Whole causal LMs compiled (moegraph.runtime.model.CompiledModel): training matches eager,
checkpoints round-trip under the original names, and what the compiler does not model raises
naming it. The multi-rank checks run on 2 spawned gloo ranks (one process group for all of them);
each case is reported as its own test. Fresh random weights and data every run.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util

import pytest
import torch
from torch import nn

import model_workers as workers
from helpers import RANK_BATCH, fresh_seed, max_grad_err, rel_err, small_layer
import moegraph
from moegraph.lowering import LoweringError
from moegraph.runtime import RuntimeFailure
from moegraph.models import MoETransformer
from moegraph.tracer import trace_causal_lm
from moegraph.ir import Strategy

TOL = 1e-5
HAS_HF = importlib.util.find_spec("transformers") is not None
DEFAULT = "gate-reorder,sar=paper"
CASES = [dict(model="ref", layers=4, attn="sp", ffn="ep", passes=DEFAULT),
         dict(model="ref", layers=2, attn="tp", ffn="tp", passes=""),
         dict(model="ref", layers=2, attn="sp", ffn="ep", passes="", boundary_only=True, steps=1)]
HF_CASES = [dict(model="hf", layers=4, attn="sp", ffn="ep", passes=DEFAULT),
            dict(model="hf", layers=2, attn="tp", ffn="tp", passes=DEFAULT),
            dict(model="qwen2_moe", layers=2, attn="sp", ffn="ep", passes=DEFAULT)]
ALL = CASES + HF_CASES
SP = Strategy("sp", "ep", "ag-rs", 1, dtype="fp32")



def _id(case: dict) -> str:
    return "-".join([case["model"], f"L{case['layers']}", case["attn"], case["ffn"], case["passes"] or "nopasses",
                     *(["boundary"] if case.get("boundary_only") else [])])


# Both rank functions run in the suite's shared 2- and 4-rank spawns (helpers.RankBatch).
N2 = RANK_BATCH.add(2, "model.model_checks", workers.model_checks, CASES + (HF_CASES if HAS_HF else []),
                    ["ref", "hf"] if HAS_HF else ["ref"], fresh_seed(), timeout_s=600)


@pytest.fixture(scope="module")
def n2(rank_results):
    res = rank_results(2, N2)
    for r in res[1:]:      # every rank measures the same numbers (same weights, batches, reductions)
        assert [t["losses"] for t in r["train"]] == [t["losses"] for t in res[0]["train"]]
    return {"train": {_id(t["case"]): t for t in res[0]["train"]}, "round_trip": res[0]["round_trip"]}


@pytest.mark.parametrize("case", ALL, ids=[_id(c) for c in ALL])
def test_training_matches_eager_n2(n2, case):
    if case["model"] != "ref" and not HAS_HF:
        pytest.skip("transformers is not installed")
    res = n2["train"][_id(case)]
    assert res["max_rel_err_loss"] < TOL, res
    assert res["max_rel_err_grads"] < TOL, res
    if not case.get("boundary_only"):
        # AdamW amplifies round-off in near-zero gradients; the boundary case has few nonzero ones
        assert res["max_rel_err_params"] < TOL, res
        assert res["losses"][0] != res["losses"][-1]
    assert res["shard_params"] < res["full_params"]            # the experts are sharded


def test_a_batch_of_each_ranks_own_is_refused(rank_results):
    results = [r["own_batches"] for r in rank_results(2, N2)]
    for r in results:
        assert r["refused"] is not None and r["refused"].startswith("input_ids, labels and masks differ between "
                                                                    "ranks: every rank passes the same global batch")
    assert results[0]["shared_loss"] == results[1]["shared_loss"]


def test_loss_shifts_labels_across_shard_boundary(n2):
    """Only position s/2 carries a label: rank 0's last position predicts it, so a shift taken
    per shard would score nothing there; the loss (and its gradient) still equal eager's."""
    res = n2["train"][_id(CASES[2])]
    assert res["max_rel_err_loss"] < TOL and res["max_rel_err_grads"] < TOL, res


@pytest.mark.parametrize("kind", ["ref", "hf"])
def test_checkpoint_round_trip(n2, kind):
    if kind == "hf" and not HAS_HF:
        pytest.skip("transformers is not installed")
    res = n2["round_trip"][kind]
    assert res["keys_equal"]
    assert res["trained"] > 1e-4                  # the two steps changed the weights
    assert res["loss"] < TOL and res["logits"] < TOL and res["reloaded"] < TOL, res


# -- n=2 x dp=2: four gloo ranks, the global batch split over two replicas ----------------------

DP_CASES = [dict(model="ref", layers=2, attn="sp", ffn="ep", passes=DEFAULT),
            dict(model="hf", layers=2, attn="sp", ffn="ep", passes=DEFAULT),
            dict(model="ref", layers=2, attn="tp", ffn="tp", passes="")]


# a node's attention (attn_nodes=2): 2 nodes of 2 ranks, the attention on each node's batch row
FOLDED_CASES = [dict(model="ref", layers=2, attn="tp", ffn="ep", dispatch="a2a", attn_nodes=2, passes=DEFAULT),
                dict(model="hf", layers=2, attn="sp", ffn="ep", dispatch="a2a", attn_nodes=2, passes="")]
N4_FOLDED = RANK_BATCH.add(4, "model.train_cases", workers.train_cases,
                           [c for c in FOLDED_CASES if c["model"] == "ref" or HAS_HF], fresh_seed(), timeout_s=600)


@pytest.mark.parametrize("case", FOLDED_CASES, ids=[_id(c) for c in FOLDED_CASES])
def test_training_with_the_attention_on_each_node_matches_eager(rank_results, case):
    """3 AdamW steps on 4 ranks: loss, gradients and final parameters (each node's copy of a TP
    attention shard counted once) equal eager training."""
    if case["model"] == "hf" and not HAS_HF:
        pytest.skip("transformers is not installed")
    res = {_id(t["case"]): t for t in rank_results(4, N4_FOLDED)[0]}[_id(case)]
    assert res["max_rel_err_loss"] < TOL and res["max_rel_err_grads"] < TOL, res
    assert res["max_rel_err_params"] < TOL, res
    assert res["shard_params"] < res["full_params"]


N2DP2 = RANK_BATCH.add(4, "model.dp_cases", workers.dp_cases, [c for c in DP_CASES if c["model"] == "ref" or HAS_HF],
                       fresh_seed(), 2, timeout_s=600)


@pytest.fixture(scope="module")
def n2dp2(rank_results):
    res = rank_results(4, N2DP2)
    for r in res[1:]:      # every rank of both replicas reports the same loss
        assert [t["losses"] for t in r] == [t["losses"] for t in res[0]]
    return {_id(t["case"]): t for t in res[0]}


@pytest.mark.parametrize("case", DP_CASES, ids=[_id(c) for c in DP_CASES])
def test_training_matches_eager_on_the_global_batch_dp2(n2dp2, case):
    """3 AdamW steps, n=2 x dp=2: loss, first-step gradients and final parameters equal eager
    training on the global batch (not divided by dp), with replicas scoring different numbers of
    tokens; then the global logits, a loss eager's global token mean (with labels chosen so the
    mean of the replicas' means is far from it), and load_state_dict -> full_state_dict exactly."""
    if case["model"] == "hf" and not HAS_HF:
        pytest.skip("transformers is not installed")
    res = n2dp2[_id(case)]
    assert res["dp_nodes"] > 0, "the stacked layers have no data-parallel sync"
    assert res["max_rel_err_loss"] < TOL and res["max_rel_err_grads"] < TOL, res
    assert res["max_rel_err_params"] < TOL, res
    assert res["losses"][0] != res["losses"][-1]
    assert res["logits"] < TOL and abs(res["eval_loss"] - res["eval_loss_ref"]) < TOL * res["eval_loss_ref"], res
    # the mean of the replicas' means would fail the loss check above by far
    assert abs(res["mean_of_means"] - res["eval_loss_ref"]) > 1e3 * TOL * res["eval_loss_ref"], res
    assert res["reload_equal"]


# -- one rank ------------------------------------------------------------------------------------

def test_one_rank_logits_and_base_model_match_eager(rng):
    model = workers.reference_model(int(torch.randint(0, 2**30, (1,), generator=rng)), 2)
    ids = torch.randint(0, workers.VOCAB, (2, 16), generator=rng)
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", schedule="greedy")
    with torch.no_grad():
        got, ref = compiled(ids).logits, model(ids).logits
    assert got is not None and rel_err(got, ref) < TOL
    # an all-zero row is an empty sequence (not left padding), said so
    with pytest.raises(ValueError, match=r"^attention_mask row 0 is all zeros: it masks every token \(an empty "):
        compiled(ids, attention_mask=torch.zeros_like(ids))
    with pytest.raises(ValueError, match=r"attention_mask row 1 starts with a 0 \(left padding\)"):
        compiled(ids, attention_mask=torch.ones_like(ids).index_fill(1, torch.tensor([0]), 0).index_fill(0, torch.tensor([0]), 1))
    with pytest.raises(ValueError, match="^position_ids: the original forward takes no position_ids"):
        compiled(ids, position_ids=torch.arange(16)[None] % 8)          # two packed documents
    with torch.no_grad():                   # position_ids 0..s-1 change nothing: accepted
        assert rel_err(compiled(ids, position_ids=torch.arange(16)[None]).logits, ref) < TOL
    with torch.no_grad():                   # the original's switches, as compiled: accepted
        got = compiled(ids, use_cache=False, output_attentions=False, output_router_logits=False).logits
    assert rel_err(got, ref) < TOL
    with pytest.raises(ValueError, match=r"^output_hidden_states=True: the model was compiled to run as "
                                         r"output_hidden_states=False"):
        compiled(ids, output_hidden_states=True)
    with pytest.raises(ValueError, match=r"input_ids has shape \(2, 8\)"):
        compiled(ids[:, :8])
    with pytest.raises(ValueError, match=r"MoETransformer is a whole model: example_inputs must be its token ids"):
        moegraph.compile(model, torch.randn(2, 16, 32))


def test_call_under_autocast_is_refused():
    # the compiled forward ran partly autocast (a loss matching neither eager's), then the backward
    # failed inside a kernel with a dtype clash
    model = workers.reference_model(0, 2)
    ids = torch.randint(0, workers.VOCAB, (2, 16))
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", schedule="greedy", passes="")
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(RuntimeFailure, match=r"^the compiled model was called under torch.autocast\('cpu', "
                                                r"dtype=torch.bfloat16\): .*compile a bf16 module instead"):
        compiled(ids, labels=ids)
    assert compiled(ids, labels=ids).loss.dtype == torch.float32      # outside autocast it runs


def test_misuse_of_a_compiled_model_is_refused_not_computed():
    """Found by a bug bash (2026-11-28), each was silently wrong or a stray traceback: a state dict
    whose tensor broadcasts into a shard, a cast to a dtype the plan was not compiled for, a second
    backward through one forward, a gradient hook the compiled model would not run, config fields
    a module brings itself, a bad n or config, and a schedule made for another graph."""
    from moegraph import CompileConfig
    from moegraph.runtime import PlanError
    model = workers.reference_model(0, 2)
    ids = torch.randint(0, workers.VOCAB, (2, 16))
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", schedule="greedy", passes="")
    state = model.state_dict()
    key = next(k for k in state if k.endswith("moe.w1"))
    with pytest.raises(ValueError, match=rf"^state_dict: size mismatch for {key}: a tensor of shape "
                                         rf"\[{state[key].shape[-1]}\], where the original model's is "):
        compiled.load_state_dict(state | {key: state[key][0, 0]})         # [h] would broadcast into [E, f, h]
    compiled.load_state_dict(state)                                      # the right shapes load
    with pytest.raises(ValueError, match=r"^CompiledModel was compiled for torch.float32; casting it to "
                                         r"torch.float16 is not supported"):
        compiled.half()
    assert compiled.float() is compiled                                  # its own dtype: a no-op
    loss = compiled(ids, labels=ids).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"frees its saved activations in its one backward: a second backward "
                                           r"through the same forward \(retain_graph=True\) is not supported"):
        loss.backward()
    hooked = copy.deepcopy(model)
    handle = next(hooked.parameters()).register_hook(lambda g: g * 0)
    with pytest.raises(LoweringError, match=r"^parameter '.+' has a gradient hook \(.*<lambda>\): the compiled "
                                            r"model computes the gradients of its own shards"):
        moegraph.compile(hooked, ids, hardware="cpu-gloo", schedule="greedy")
    handle.remove()
    for config, fields in ((CompileConfig("small", top_k=1), "top_k=1"), (CompileConfig("small", layers=3), "layers=3"),
                           (CompileConfig("small", edges="none"), "edges='none'")):
        with pytest.raises(ValueError, match=rf"the config sets {fields}, which a module brings itself"):
            moegraph.compile(model, ids, config=config)
    with pytest.raises(ValueError, match=r"^n=0 must be a positive integer"):
        moegraph.compile(model, ids, n=0)
    with pytest.raises(ValueError, match=r"^config='tiny' must be a moegraph.CompileConfig"):
        moegraph.compile(model, ids, config="tiny")
    with pytest.raises(ValueError, match=r"^example_inputs has hidden size 32 but MoETransformerLayer's layer has "
                                         r"h=64: the layer input is \[b, s, 64\]"):
        moegraph.compile(small_layer(1), torch.randn(2, 16, 32), hardware="cpu-gloo", schedule="greedy")
    with torch.device("meta"):
        unloaded = workers.reference_model(0, 2)
    with pytest.raises(ValueError, match=r"is on the meta device \(no values\): materialise the model"):
        moegraph.compile(unloaded, ids, hardware="cpu-gloo", schedule="greedy")
    shorter = moegraph.compile(CompileConfig(model=model, batch=2, seq=8, strategy=SP, hardware="cpu-gloo", passes=(),
                                             schedule="greedy")).schedule           # s = 8, not 16
    with pytest.raises(PlanError, match=r"gives a different graph than the file schedules"):
        moegraph.compile(model, ids, hardware="cpu-gloo", passes="", schedule=shorter)
    edited = dataclasses.replace(shorter, summary={**shorter.summary, "makespan_us": 1.0})    # its hash now stale
    with pytest.raises(ValueError, match=r"its content does not hash to the hash it records"):
        moegraph.compile(model, ids[:, :8], hardware="cpu-gloo", passes="", schedule=edited)


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_one_rank_mixtral_base_model_matches_eager(rng):
    base = workers.mixtral_model(int(torch.randint(0, 2**30, (1,), generator=rng)), 2).model
    ids = torch.randint(0, workers.VOCAB, (2, 16), generator=rng)
    compiled = moegraph.compile(base, ids, hardware="cpu-gloo", schedule="greedy", passes="")
    with torch.no_grad():
        got, ref = compiled(ids).last_hidden_state, base(input_ids=ids).last_hidden_state
    assert rel_err(got, ref) < TOL
    assert list(compiled.full_state_dict()) == list(base.state_dict())
    assert compiled.positional[:2] == ("attention_mask", "position_ids")
    with pytest.raises(ValueError, match="row 0 is all zeros: it masks every token"):   # HF's second argument
        compiled(ids, torch.zeros_like(ids))


def _trace(model):
    return trace_causal_lm(model, SP, batch=1, seq=16)


def test_unknown_parts_raise_naming_them():
    model = workers.reference_model(0, 2)
    model.dropout = nn.Dropout(0.1)
    with pytest.raises(LoweringError, match=r"'dropout' \(torch.nn.modules.dropout.Dropout\) in MoETransformer"):
        _trace(model)
    model = workers.reference_model(0, 2)
    model.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(LoweringError, match="scale belong to no decoder layer"):
        _trace(model)

    class MyLM(MoETransformer):
        pass
    with pytest.raises(LoweringError, match=r"MyLM\) has no model rule"):
        _trace(MyLM(64, [], 32))
    model = workers.reference_model(0, 2)
    model.layers[1] = nn.Linear(32, 32)
    with pytest.raises(LoweringError, match="Linear"):
        _trace(model)


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
@pytest.mark.parametrize("overrides, message", [
    (dict(attention_dropout=0.1), "attention_dropout=0.1 in training mode"),
    (dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
])
def test_unmodelled_mixtral_settings_raise(overrides, message):
    with pytest.raises(LoweringError, match=message):
        _trace(workers.mixtral_model(0, 2, **overrides))


def _tied_models():
    ref = workers.reference_model(3, 2)
    ref.lm_head.weight = ref.embed.weight
    return [ref] + ([workers.mixtral_model(3, 2, tie_word_embeddings=True)] if HAS_HF else [])


@pytest.mark.parametrize("which", [0, 1], ids=["reference", "mixtral"])
@pytest.mark.slow
def test_tied_embeddings_are_one_parameter_with_the_summed_gradient(which):
    """tie_word_embeddings: the head IS the embedding; its gradient is the head's plus the
    embedding's (autograd sums them in the original), and an AdamW step keeps them one tensor,
    as eager. The head's gradient alone is far from it (the check can fail)."""
    models = _tied_models()
    if which >= len(models):
        pytest.skip("transformers is not installed")
    model = models[which]
    embedding = model.embed if which == 0 else model.get_input_embeddings()
    head = model.lm_head.weight
    assert head is embedding.weight
    ids = torch.randint(0, workers.VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", schedule="greedy", passes="")
    assert compiled.lm_head is compiled.embed and len(list(compiled.parameters())) < len(list(
        compiled.layers.parameters())) + 3
    ref = model(ids, labels=ids)
    ref.loss.backward()
    got = compiled(ids, labels=ids)
    got.loss.backward()
    assert rel_err(got.loss.detach(), ref.loss.detach()) < TOL
    full = compiled.full_grads()
    assert max(rel_err(full[k], p.grad) for k, p in model.named_parameters()) < TOL
    # an untied copy's two gradients: the tied one is their sum, and far from the head's alone
    untied = copy.deepcopy(model)
    untied.lm_head.weight = nn.Parameter(head.detach().clone())
    untied.zero_grad()
    untied(ids, labels=ids).loss.backward()
    tied_grad = compiled.lm_head.grad
    parts = untied.lm_head.weight.grad, (untied.embed if which == 0 else untied.get_input_embeddings()).weight.grad
    assert rel_err(tied_grad, parts[0] + parts[1]) < TOL and rel_err(tied_grad, parts[0]) > 1e-3
    for opt in (torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(compiled.parameters(), lr=1e-3)):
        opt.step()
    state, ref_state = compiled.full_state_dict(), model.state_dict()
    assert set(state) == set(ref_state) and max(rel_err(state[k], v) for k, v in ref_state.items()) < TOL


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_a_config_asking_for_tied_weights_that_are_not_is_refused():
    model = workers.mixtral_model(0, 2, tie_word_embeddings=True)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())      # untied by hand
    with pytest.raises(LoweringError, match=r"^lm_head: config.tie_word_embeddings=True but lm_head.weight is not "
                                            r"the embedding's weight: call model.tie_weights\(\)"):
        _trace(model)


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_mixtral_changed_rope_and_layer_count_raise():
    model = workers.mixtral_model(0, 2)
    model.model.rotary_emb.inv_freq.mul_(2)
    with pytest.raises(LoweringError, match="rotary_emb.inv_freq differs"):
        _trace(model)
    model = workers.mixtral_model(0, 2)
    model.config.num_hidden_layers = 1
    with pytest.raises(LoweringError, match="num_hidden_layers=1"):
        _trace(model)


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_mixtral_bf16_cast_rope_buffer_is_named_and_the_named_fix_matches_eager():
    # model.to(torch.bfloat16) casts the RoPE buffer: eager then rotates with rounded frequencies;
    # the refusal named rope_theta, never the dtype
    model = workers.mixtral_model(0, 2).to(torch.bfloat16)
    ids = torch.randint(0, workers.VOCAB, (2, 16))
    with pytest.raises(LoweringError, match=r"rotary_emb.inv_freq is torch.bfloat16, not torch.float32 \(a cast "
                                            r"such as model.to\(torch.bfloat16\).*recompute them after the cast"):
        _trace(model)
    r = model.model.rotary_emb                       # the fix the message names
    r.inv_freq = r.compute_default_rope_parameters(r.config)[0]
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", schedule="greedy", passes="")
    with torch.no_grad():
        assert rel_err(compiled(ids, labels=ids).loss.float(), model(ids, labels=ids).loss.float()) < 1e-2


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "deepseek_v3"])
@pytest.mark.slow
def test_one_rank_family_causal_lm_loss_and_grads_match_eager(family, rng):
    model = workers.family_model(family, int(torch.randint(0, 2**30, (1,), generator=rng)))
    ids = torch.randint(0, workers.VOCAB, (2, 16), generator=rng)
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", schedule="greedy")
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    assert abs(loss.item() - ref.item()) / ref.item() < TOL
    grads = compiled.full_grads()
    expected = {k: p.grad for k, p in model.named_parameters()}
    assert set(grads) == set(expected)
    name, err = max_grad_err(grads, expected)
    assert err < TOL, (name, err)


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_frozen_parameters_stay_frozen_and_the_rest_trains_as_eager(rng):
    """requires_grad=False before compile (the embedding, a router) survives: one AdamW step leaves
    the frozen parameters unchanged and moves the others as eager's step does."""
    model = workers.mixtral_model(int(torch.randint(0, 2**30, (1,), generator=rng)), 2)
    ids = torch.randint(0, workers.VOCAB, (2, 16), generator=rng)
    frozen = {"model.embed_tokens.weight", "model.layers.1.mlp.gate.weight"}
    for k in frozen:
        model.get_parameter(k).requires_grad_(False)
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", schedule="greedy", passes="")
    assert sum(not p.requires_grad for p in compiled.parameters()) == len(frozen)
    for m in (model, compiled):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        m(ids, labels=ids).loss.backward()
        opt.step()
    got, ref = compiled.full_state_dict(), model.state_dict()
    for k in frozen:
        assert torch.equal(got[k], model.get_parameter(k)), k
    name, err = max_grad_err(got, {k: v for k, v in ref.items() if k in dict(model.named_parameters())})
    assert err < TOL, (name, err)


def test_frozen_layer_router_stays_frozen_and_a_half_frozen_fused_parameter_is_refused():
    layer = small_layer(1)
    layer.moe.router.weight.requires_grad_(False)
    x = torch.randn(2, 8, 64)
    compiled = moegraph.compile(layer, x, hardware="cpu-gloo", schedule="greedy", passes="")
    assert [k for k, p in compiled.named_shards() if not p.requires_grad] == ["router.weight"]
    compiled(compiled.shard_input(x)).sum().backward()
    assert compiled.shard("router.weight").grad is None and compiled.shard("w1").grad is not None
    layer.attn.q_proj.weight.requires_grad_(False)       # q, k, v fuse into one qkv shard
    with pytest.raises(ValueError, match=r"'qkv.weight' is fused from attn.q_proj.weight, .* only "
                                         r"attn.q_proj.weight has requires_grad=False"):
        moegraph.compile(layer, x, hardware="cpu-gloo", schedule="greedy", passes="")


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_a_hook_or_patched_forward_outside_the_layers_is_named():
    model = workers.mixtral_model(0, 2)
    # transformers' own output-capturing hooks (installed by this forward, kept) only observe: accepted
    model(torch.randint(0, workers.VOCAB, (1, 16)), output_hidden_states=True, output_router_logits=True)
    handle = model.lm_head.register_forward_hook(lambda mod, inp, out: out * 5)   # a logit temperature hook
    with pytest.raises(LoweringError, match=r"'lm_head' \(Linear\) has a forward hook"):
        _trace(model)
    handle.remove()
    model.model.embed_tokens.forward = lambda ids: 2 * nn.Embedding.forward(model.model.embed_tokens, ids)
    with pytest.raises(LoweringError, match=r"'model.embed_tokens' \(Embedding\).forward is replaced on the instance"):
        _trace(model)
    del model.model.embed_tokens.forward
    _trace(model)


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
@pytest.mark.slow
def test_gradient_checkpointing_enabled_model_compiles_and_matches_eager():
    """gradient_checkpointing_enable() installs transformers' make_inputs_require_grads forward
    hook on the input embedding (it only marks the embedding output as requiring grad): the hook
    guard must accept it, and the compiled model must match the eager checkpointed one."""
    model = workers.mixtral_model(0, 2)
    model.gradient_checkpointing_enable()
    assert model.model.embed_tokens._forward_hooks           # the hook the guard must let through
    ids = torch.randint(0, workers.VOCAB, (2, 16))
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", schedule="greedy", passes="")
    ref = model(ids, labels=ids)
    ref.loss.backward()
    got = compiled(ids, labels=ids)
    got.loss.backward()
    assert rel_err(got.loss.detach(), ref.loss.detach()) < 1e-5
    full = compiled.full_grads()
    assert max(rel_err(full[k], p.grad) for k, p in model.named_parameters()) < 1e-5


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_compiled_in_eval_with_dropout_refuses_train_mode():
    """Compiled in eval() with attention_dropout > 0 (accepted: no dropout there), the compiled
    module keeps eval mode and refuses .train(), as compiling in train mode does; without dropout
    .train() is fine."""
    ids = torch.randint(0, workers.VOCAB, (2, 16))
    model = workers.mixtral_model(0, 2, attention_dropout=0.5).eval()
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", schedule="greedy", passes="")
    assert not compiled.training
    with pytest.raises(LoweringError, match=r"model.layers.0.self_attn.attention_dropout=0.5, .*only in "
                                            r"training mode.*compiled in eval mode"):
        compiled.train()
    compiled.eval()
    layer = model.model.layers[0]
    compiled_layer = moegraph.compile(layer, torch.randn(2, 16, 32), hardware="cpu-gloo", schedule="greedy", passes="")
    with pytest.raises(LoweringError, match=r"self_attn.attention_dropout=0.5"):
        compiled_layer.train()
    plain = moegraph.compile(workers.mixtral_model(0, 2), ids, hardware="cpu-gloo", schedule="greedy", passes="")
    assert plain.training and plain.eval().train().training
