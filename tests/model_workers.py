"""Rank functions for the compiled-model tests (spawned by moegraph.runtime.launch.spawn).

Tiny causal LMs (h=32, vocab 64, s=16): moegraph.models.MoETransformer and, when transformers
is installed, its MixtralForCausalLM, with random weights. Each case trains the compiled model
and the eager one the same way and reports the errors (moegraph.runtime.check.train_against_eager).
"""

from __future__ import annotations

import dataclasses

import torch

import moegraph
from moegraph.models import MoETransformer
from moegraph.registry import load_model
from moegraph.runtime.check import eager_accumulate, rel_err, train_against_eager

B, S, VOCAB = 2, 16, 64


def reference_model(seed: int, layers: int) -> MoETransformer:
    cfg = dataclasses.replace(load_model("tiny"), hidden=32, heads=4, kv_heads=2, ffn_hidden=48, experts=4, top_k=2,
                              layers=layers)
    torch.manual_seed(seed)
    return MoETransformer.from_config(cfg, vocab=VOCAB)


def mixtral_model(seed: int, layers: int, **overrides):
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(**{"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                           "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2,
                           "num_hidden_layers": layers, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
                           "tie_word_embeddings": False, "attn_implementation": "sdpa"} | overrides)
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = MixtralForCausalLM(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


MODELS = {"ref": reference_model, "hf": mixtral_model,
          "qwen2_moe": lambda seed, layers: family_model("qwen2_moe", seed, layers)}


def batches(seed: int, steps: int, boundary_only: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random token ids and labels. boundary_only: every label ignored but the one at position
    S/2 (the first of rank 1's shard on 2 ranks), which position S/2 - 1 (the last of rank 0's
    shard) predicts: the loss is right only if labels shift across the shard boundary."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (B, S), generator=gen)
        labels = ids.clone()
        if boundary_only:
            labels[:, : S // 2] = -100
            labels[:, S // 2 + 1:] = -100
        out.append((ids, labels))
    return out


def train_cases(rank: int, n: int, cases: list[dict], seed: int) -> list[dict]:
    out = []
    for i, case in enumerate(cases):
        model = MODELS[case["model"]](seed + i, case["layers"])
        data = batches(seed + 1000 + i, case.get("steps", 3), case.get("boundary_only", False))
        compiled = moegraph.compile(model, data[0][0], hardware="cpu-gloo", attn=case["attn"], ffn=case["ffn"],
                                    dispatch=case.get("dispatch", "ag-rs"), passes=case["passes"],
                                    schedule="greedy", timeout_s=60.0, attn_nodes=case.get("attn_nodes", 1))
        res = train_against_eager(model, compiled, data)
        res["case"] = case
        res["shard_params"] = sum(p.numel() for p in compiled.parameters())
        res["full_params"] = sum(p.numel() for p in model.parameters())
        out.append(res)
    return out


def dp_batches(seed: int, steps: int, dp: int, b: int = B) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches [dp*b, S] of ``batches``, replica 0's rows with all labels but the last
    two ignored (2 scored tokens per row, all on its last rank's shard, none on rank 0's): the
    replicas hold different numbers of scored tokens, so training uses the global token count."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (dp * b, S), generator=gen)
        labels = ids.clone()
        labels[:b, :S - 2] = -100
        out.append((ids, labels))
    return out


def dp_cases(rank: int, world: int, cases: list[dict], seed: int, dp: int) -> list[dict]:
    """n x dp = ``world`` ranks: each case trains the compiled model on the global batch (AdamW,
    ``train_against_eager``), then checks the global logits and a load_state_dict round trip."""
    out = []
    for i, case in enumerate(cases):
        model = MODELS[case["model"]](seed + i, case["layers"])
        data = dp_batches(seed + 1000 + i, case.get("steps", 3), dp)
        compiled = moegraph.compile(model, data[0][0], hardware="cpu-gloo", attn=case["attn"], ffn=case["ffn"],
                                    dispatch=case.get("dispatch", "ag-rs"), passes=case["passes"],
                                    schedule="greedy", timeout_s=60.0, dp=dp)
        res = train_against_eager(model, compiled, data)
        res["case"] = case
        res["dp_nodes"] = sum(1 for nd in compiled.layers.graph.nodes if nd.attr("axis", "mp") == "dp")
        ids = data[-1][0]
        with torch.no_grad():                                   # eager holds the eager-trained weights
            labels = _far_apart_labels(model(input_ids=ids).logits, dp)
            got, ref = compiled(ids, labels=labels, output_logits=True), model(input_ids=ids, labels=labels)
        res["logits"] = rel_err(got.logits, ref.logits)
        res["mean_of_means"] = _mean_of_replica_means(ref.logits, labels, dp)
        res["eval_loss"], res["eval_loss_ref"] = got.loss.item(), ref.loss.item()
        compiled.load_state_dict(MODELS[case["model"]](seed + 77, case["layers"]).state_dict())
        fresh = MODELS[case["model"]](seed + 77, case["layers"]).state_dict()
        back = compiled.full_state_dict()
        res["reload_equal"] = list(back) == list(fresh) and all(torch.equal(back[k], fresh[k]) for k in fresh)
        out.append(res)
    return out


def _far_apart_labels(logits: torch.Tensor, dp: int) -> torch.Tensor:
    """Labels [dp*B, S] for ``logits`` [dp*B, S, V] whose replicas' mean losses lie far apart:
    replica 0 scores 2 tokens per row, each the least likely one (cross-entropy above log V),
    the others every position's most likely token (below log V). The global token mean then
    differs from the mean of the replicas' means by a wide margin, whatever the weights."""
    labels = torch.full(logits.shape[:2], -100, dtype=torch.long)
    labels[:, 1:] = logits[:, :-1].argmax(-1)               # position t predicts labels[t + 1]
    labels[:B, 1:] = logits[:B, :-1].argmin(-1)
    labels[:B, :S - 2] = -100
    return labels


def _mean_of_replica_means(logits: torch.Tensor, labels: torch.Tensor, dp: int) -> float:
    from moegraph.models import shift_labels
    shifted = shift_labels(labels)
    means = [torch.nn.functional.cross_entropy(lg.flatten(0, 1), lb.flatten(), ignore_index=-100)
             for lg, lb in zip(logits.chunk(dp), shifted.chunk(dp))]
    return torch.stack(means).mean().item()


def model_checks(rank: int, n: int, cases: list[dict], round_trips: list[str], seed: int) -> dict:
    """Both kinds of check on one process group (starting ranks costs seconds)."""
    return {"train": train_cases(rank, n, cases, seed),
            "round_trip": {kind: round_trip(rank, n, kind, seed + 500 + i) for i, kind in enumerate(round_trips)},
            "own_batches": own_batches(rank, seed + 900)}


def own_batches(rank: int, seed: int) -> dict:
    """Each rank calls the compiled model with a batch of its own (a data-parallel habit): the
    forward refuses it on every rank, where it once trained on rows spliced from both batches;
    the same batch on both ranks still runs."""
    model = reference_model(seed, 2)
    shared = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
    compiled = moegraph.compile(model, shared, hardware="cpu-gloo", schedule="greedy", passes="", timeout_s=60.0)
    own = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed + 1 + rank))
    try:
        compiled(own, labels=own)
        refused = None
    except ValueError as err:
        refused = str(err)
    return {"refused": refused, "shared_loss": float(compiled(shared, labels=shared).loss)}


def round_trip(rank: int, n: int, kind: str, seed: int) -> dict:
    """Train 2 steps compiled, load full_state_dict() into a fresh eager model (other weights):
    its loss and logits must equal the compiled model's; then load_state_dict of the original's
    names into a second compiled model gives the same loss again."""
    model = MODELS[kind](seed, 2)
    data = batches(seed + 1, 3)
    compiled = moegraph.compile(model, data[0][0], hardware="cpu-gloo", schedule="greedy", timeout_s=60.0)
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    for ids, labels in data[:2]:
        opt.zero_grad()
        compiled(ids, labels=labels).loss.backward()
        opt.step()
    ids, labels = data[2]
    with torch.no_grad():
        got = compiled(ids, labels=labels, output_logits=True)
    fresh = MODELS[kind](seed + 7, 2)
    state = compiled.full_state_dict()
    fresh.load_state_dict(state)
    with torch.no_grad():
        ref = fresh(input_ids=ids, labels=labels)
    other = moegraph.compile(MODELS[kind](seed + 9, 2), ids, hardware="cpu-gloo", schedule="greedy", timeout_s=60.0)
    other.load_state_dict(fresh.state_dict())
    with torch.no_grad():
        again = other(ids, labels=labels).loss
    first = next(iter(state))
    return {"loss": rel_err(got.loss, ref.loss), "logits": rel_err(got.logits, ref.logits),
            "reloaded": rel_err(again, ref.loss), "keys_equal": list(state) == list(fresh.state_dict()),
            "trained": rel_err(state[first], MODELS[kind](seed, 2).state_dict()[first])}


def family_model(family: str, seed: int, layers: int = 2):
    """A tiny transformers ForCausalLM of ``family`` (h=32, 4 heads, 4 experts top-2, vocab 64),
    random N(0, 0.2) weights (buffers too: DeepSeek-V3's score-correction bias)."""
    import transformers as tf
    common = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": layers,
              "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attn_implementation": "sdpa",
              "num_experts_per_tok": 2, "eos_token_id": None}
    cfg_cls, lm_cls, extra = {
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                      {"intermediate_size": 64, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
                       "num_experts": 4}),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM, {"intermediate_size": 24, "num_experts": 4}),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,
                        {"num_key_value_heads": 4, "intermediate_size": 48, "moe_intermediate_size": 24,
                         "n_routed_experts": 4, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
                         "routed_scaling_factor": 2.5, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                         "qk_rope_head_dim": 8, "v_head_dim": 8, "first_k_dense_replace": 0}),
    }[family]
    cfg = cfg_cls(**(common | extra))
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = lm_cls(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    for name, b in model.named_buffers():
        if "e_score_correction_bias" in name:
            torch.nn.init.normal_(b, std=0.2)
    return model


def mb_batches(seed: int, M: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """M micro-batches (input_ids, labels) [B, S] of ``batches``; micro-batch 1's first half of
    labels ignored, so the micro-batches score different numbers of tokens (a mean over their
    pooled tokens would differ from the mean of their means)."""
    out = batches(seed, M)
    if M > 1:
        out[1][1][:, : S // 2] = -100
    return out


def mb_train_cases(rank: int, n: int, cases: list[dict], seed: int) -> list[dict]:
    """Per case: a merged step of M micro-batches compiled (``micro_batches=M``) against eager
    gradient accumulation from the same weights: step 0's losses and every parameter gradient;
    the same step with micro-batch j's seed zeroed by its edge kernel (the check must fail); then
    ``steps`` AdamW steps of both, the losses and the final parameters."""
    from moegraph.edges import is_eager
    from moegraph.ir import Phase
    from moegraph.microbatch import micro_batch_of
    from moegraph.runtime import model as runtime_model
    from moegraph.runtime.check import grad_report
    out = []
    for i, case in enumerate(cases):
        M, steps = case["M"], case.get("steps", 1)
        model = MODELS[case["model"]](seed + i, case["layers"])
        data = [mb_batches(seed + 1000 + 10 * i + k, M) for k in range(steps)]
        compiled = moegraph.compile(model, data[0][0][0], hardware="cpu-gloo", attn=case["attn"], ffn=case["ffn"],
                                    passes=case["passes"], schedule=case["schedule"], time_limit_s=2.0,
                                    timeout_s=60.0, micro_batches=M)
        g, plan = compiled.layers.graph, compiled.layers.plan
        kinds = [(micro_batch_of(g.node[e.name]), g.node[e.name].phase is Phase.FORWARD) for e in plan.entries]
        first, last = kinds.index((0, False)), len(kinds) - 1 - kinds[::-1].index((0, False))
        res = {"case": case, "interleaved": kinds[first:last].count((1, True)),
               "eager_nodes": sum(1 for nd in g.nodes if is_eager(dict(nd.attrs)))}
        ids, labels = zip(*data[0])
        ref_losses, ref = _accumulated(model, data[0])
        _, first_only = _accumulated(model, data[0][:1])

        # sabotage: micro-batch M-1's seed zeroed by its edges.norm.dgrad kernel
        real = runtime_model.EdgeStep._norm_dgrad

        def zero_last(self, st, j, ins):
            dy = real(self, st, j, ins)
            return torch.zeros_like(dy) if j == M - 1 else dy
        runtime_model.EdgeStep._norm_dgrad = zero_last
        try:
            compiled.train_step(list(ids), list(labels))
        finally:
            runtime_model.EdgeStep._norm_dgrad = real
        bad = compiled.full_grads()
        res["zeroed_seed"] = max(rel_err(bad[k], r) for k, r in ref.items())
        compiled.zero_grad(set_to_none=True)

        losses = compiled.train_step(list(ids), list(labels))
        grads = compiled.full_grads()
        res["losses"], res["eager_losses"] = [x.item() for x in losses], ref_losses
        res["max_rel_err_loss"] = max(rel_err(a, torch.tensor(b)) for a, b in zip(losses, ref_losses))
        res["missing"] = sorted(set(ref) - set(grads))
        res |= grad_report({k: (grads[k], r) for k, r in ref.items()})
        res["edges_grads"] = {k: rel_err(grads[k], ref[k]) for k in ref if "layers." not in k}
        res["first_only"] = max(rel_err(first_only[k], r) for k, r in ref.items())
        # 2nd call adds to .grad, as backward does
        compiled.train_step(list(ids), list(labels))
        twice = compiled.full_grads()
        res["accumulates"] = max(rel_err(twice[k], 2 * r) for k, r in ref.items() if r.abs().max() > 0)

        # AdamW: step 0's gradients, then steps 1.. from scratch on both
        full0 = {k: v.clone() for k, v in model.state_dict().items()}
        opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-4)
        opt_e = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step_losses, step_eager = [], []
        for k, batch in enumerate(data):
            opt_c.zero_grad(set_to_none=True)
            step_losses.append([x.item() for x in compiled.train_step(*map(list, zip(*batch)))])
            opt_c.step()
            opt_e.zero_grad(set_to_none=True)
            step_eager.append(eager_accumulate(model, batch))
            opt_e.step()
        full = compiled.full_state_dict()
        res["adamw_loss"] = max(rel_err(torch.tensor(a), torch.tensor(b)) for a, b in zip(step_losses, step_eager))
        res["adamw_params"] = max(rel_err(full[k], t) for k, t in model.state_dict().items() if t.is_floating_point())
        res["moved"] = max(rel_err(model.state_dict()[k], t) for k, t in full0.items() if t.is_floating_point())
        out.append(res)
    return out


def _accumulated(model: torch.nn.Module, data) -> tuple[list[float], dict[str, torch.Tensor]]:
    """From zero: eager_accumulate's losses and the gradients it leaves."""
    model.zero_grad(set_to_none=True)
    losses = eager_accumulate(model, data)
    return losses, {k: p.grad.clone() for k, p in model.named_parameters()}


def mb_dp_case(rank: int, world: int, seed: int, dp: int, M: int, b: int = B) -> dict:
    """n x dp ranks: a model compiled with ``micro_batches=M`` trains 2 AdamW steps (each M
    micro-batches of the global batch [dp*b, S], ``dp_batches``: the replicas score different
    numbers of tokens) against eager gradient accumulation on the global batch. With the PARTIAL
    embedding gradient first one step with micro-batch M-1's ``mb{M-1}.edges.embed.scatter``
    scattering nothing (it passes micro-batch M-2's partial on): its gradients per parameter
    against eager's (``dropped``; the embedding's must be off, nothing else)."""
    from moegraph.edges import EmbedGrad, edge_values
    from moegraph.runtime import model as runtime_model
    from moegraph.runtime.check import train_microbatches_against_eager
    model = reference_model(seed, 2)
    steps = [dp_batches(seed + 10 * k, M, dp, b) for k in range(2)]
    compiled = moegraph.compile(model, steps[0][0][0], hardware="cpu-gloo", schedule="megatron-1f1b", timeout_s=60.0,
                                dp=dp, micro_batches=M)
    pattern = edge_values(compiled.layers.graph).embed_grad
    planned = [e.name for e in compiled.layers.plan.entries if e.name.endswith("edges.embed.scatter")]
    dropped = {}
    if pattern is EmbedGrad.PARTIAL:
        _, ref = _accumulated(model, steps[0])
        real = runtime_model.EdgeStep._scatter

        def drop_last(self, j, accumulate, ins):
            out = real(self, j, accumulate, ins)
            return [ins[1].clone()] if j == M - 1 else out
        runtime_model.EdgeStep._scatter = drop_last
        try:
            compiled.train_step(*map(list, zip(*steps[0])))
        finally:
            runtime_model.EdgeStep._scatter = real
        bad = compiled.full_grads()
        dropped = {k: rel_err(bad[k], r) for k, r in ref.items()}
        compiled.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    res = train_microbatches_against_eager(model, compiled, steps)
    return res | {"pattern": pattern.value, "planned_scatters": planned, "dropped": dropped}
