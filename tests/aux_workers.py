"""Rank functions for tests/test_aux_loss.py (spawned by moegraph.runtime.launch.spawn): one
training step of a tiny HF causal LM with output_router_logits=True (the router's auxiliary
load-balancing loss) compiled on gloo ranks, against the eager module on the global batch."""

from __future__ import annotations

import torch

import moegraph
from moegraph.ir import OpKind, Phase
from moegraph.runtime.check import eager_accumulate, rel_err
from moegraph.runtime import model as rt_model
from moegraph.runtime.collectives import Comm, Pending
from model_workers import VOCAB, mixtral_model

B, S = 2, 16
ZOO = {"gpt_oss": "GptOssForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",      # the family zoo's tiny models
       "ernie4_5_moe": "Ernie4_5_MoeForCausalLM"}


def aux_model(family: str, seed: int, layers: int, coef: float, skew: bool = False, **overrides):
    """A tiny causal LM of ``family`` (mixtral, qwen2_moe, olmoe; gpt_oss, qwen3_moe,
    ernie4_5_moe: the family zoo's) with
    output_router_logits=True. ``skew``: every router's weight gets a large bias towards expert 0 (most
    tokens pick it)."""
    if family in ZOO:
        from family_zoo import tiny_model
        model = tiny_model(family, ZOO[family], seed, num_hidden_layers=layers, output_router_logits=True,
                           router_aux_loss_coef=coef, **overrides)
    elif family == "mixtral":
        model = mixtral_model(seed, layers, output_router_logits=True, router_aux_loss_coef=coef, **overrides)
    else:
        from model_workers import family_model
        model = family_model(family, seed, layers)
        # what the config's fields set at construction (ForCausalLM keeps the coefficient)
        model.config.output_router_logits, model.config.router_aux_loss_coef = True, coef
        model.router_aux_loss_coef = coef
    if skew:
        # every token's hidden state gets a large shared component on dim 0 and every router
        # scores it for expert 0: most tokens route there (the aux loss far from balanced)
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] += 4.0
            for layer in model.model.layers:
                layer.post_attention_layernorm.weight[0] = 1.0
                layer.mlp.gate.weight[0, 0] = 0.4
    return model


def data(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, S), generator=gen)
    return ids, ids.clone()


def one_step(rank: int, world: int, case: dict) -> dict:
    """Loss, aux loss and every parameter gradient of one step, compiled vs eager (relative errors);
    ``case["break"]``: "zero_seed" makes the routers' aux seed 0 (the term's gradient dropped),
    "no_allreduce" turns the aux stats' all-reduces into local copies."""
    dp = case.get("dp", 1)
    model = aux_model(case.get("family", "mixtral"), case["seed"], case.get("layers", 2), case["coef"],
                      case.get("skew", False))
    ids, labels = data(case["seed"] + 1, dp * B)
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", attn=case["attn"], ffn=case["ffn"],
                                dispatch=case.get("dispatch", "ag-rs"), passes=case.get("passes", ""),
                                schedule="greedy", timeout_s=60.0, dp=dp)
    brk = case.get("break")
    saved = Comm.issue, rt_model.ScheduledStep.apply
    try:
        if brk == "no_allreduce":
            Comm.issue = _local_aux_collectives(Comm.issue)
        elif brk == "zero_seed":
            rt_model.ScheduledStep.apply = _zero_aux_seed(rt_model.ScheduledStep.apply)
        elif brk is not None:
            raise ValueError(f"break={brk!r}")
        return _compare(model, compiled, ids, labels)
    finally:
        Comm.issue, rt_model.ScheduledStep.apply = saved


def _local_aux_collectives(issue):
    """Comm.issue with the aux stats' all-reduces made local copies (no communication)."""
    def local(self, node, ins, stream, budget, shapes=None):
        if node.name.startswith("edges.aux."):
            outs = [ins[0].clone()]
            return Pending(node, stream, [], lambda: outs)
        return issue(self, node, ins, stream, budget, shapes)
    return local


class _ZeroGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, aux):
        return aux.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.zeros_like(g)


def _zero_aux_seed(apply):
    """_ScheduledStep.apply whose aux loss passes no gradient back: the plan's aux seed is 0."""
    def patched(*args):
        out, aux = apply(*args)
        return out, _ZeroGrad.apply(aux)
    return patched


def _compare(model, compiled, ids, labels) -> dict:
    model.zero_grad()
    ref = model(ids, labels=labels)
    ref.loss.backward()
    got = compiled(ids, labels=labels)
    got.loss.backward()
    full = compiled.full_grads()
    errs = {k: rel_err(full[k], p.grad) for k, p in model.named_parameters()}
    worst = max(errs, key=errs.get)
    return {"loss": rel_err(got.loss.detach(), ref.loss.detach()), "routers": _routers(compiled),
            "aux": rel_err(got.aux_loss.detach(), ref.aux_loss.detach()),
            "aux_value": float(ref.aux_loss.detach()),
            "grads": errs[worst], "worst": worst,
            "router_grads": max(e for k, e in errs.items() if ".gate." in k or ".router." in k),
            "edge_nodes": sorted(e.name for e in compiled.layers.plan.entries if e.name.startswith("edges.aux"))}


def merged_step(rank: int, world: int, case: dict) -> dict:
    """One train_step of M micro-batches (micro_batches=M) against eager accumulation
    ((loss / M).backward() per micro-batch): each micro-batch's loss and every gradient."""
    dp, M = case.get("dp", 1), case["micro_batches"]
    model = aux_model(case.get("family", "mixtral"), case["seed"], case.get("layers", 2), case["coef"],
                      case.get("skew", False))
    batch = [data(case["seed"] + 1 + j, dp * B) for j in range(M)]
    compiled = moegraph.compile(model, batch[0][0], hardware="cpu-gloo", attn=case["attn"], ffn=case["ffn"],
                                dispatch=case.get("dispatch", "ag-rs"), passes=case.get("passes", ""),
                                schedule="greedy", timeout_s=60.0, dp=dp, micro_batches=M)
    model.zero_grad()
    expected = eager_accumulate(model, batch)
    got = compiled.train_step([ids for ids, _ in batch], [lab for _, lab in batch])
    full = compiled.full_grads()
    errs = {k: rel_err(full[k], p.grad) for k, p in model.named_parameters()}
    worst = max(errs, key=errs.get)
    return {"loss": max(rel_err(torch.tensor(float(a)), torch.tensor(b)) for a, b in zip(got, expected)),
            # aux None: train_step returns each micro-batch's loss with coef*aux in it, checked as "loss"
            "aux": None, "grads": errs[worst], "worst": worst, "routers": _routers(compiled),
            "router_grads": max(e for k, e in errs.items() if ".gate." in k or ".router." in k),
            "edge_nodes": sorted({e.name.split(".", 1)[1] for e in compiled.layers.plan.entries
                                  if ".edges.aux" in e.name})}


def _routers(compiled) -> int:
    """Router forward nodes of the compiled graph (all layers, chunks and micro-batches)."""
    return sum(1 for nd in compiled.layers.graph.nodes if nd.op is OpKind.ROUTER and nd.phase is Phase.FORWARD)


def cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [merged_step(rank, world, c) if "micro_batches" in c else one_step(rank, world, c) for c in cases]
