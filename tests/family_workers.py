"""Rank function of the family tests and benchmarks/families_table.py: a tiny causal LM of each case's
family (tests/family_zoo.py) compiled with moegraph.compile on the ranks, one forward and backward
with labels, compared with the eager model: logits, loss and every trainable parameter's gradient.
n = 1 runs in the calling process (no process group)."""

from __future__ import annotations

import time
import warnings

import torch

B, S = 2, 16


def family_cases(rank: int, n: int, cases: list[dict], seed: int) -> list[dict]:
    """Each case: family, cls (the ForCausalLM class name), attn, ffn, dispatch, and optionally
    overrides (config fields over the zoo's: e.g. a mixed layer stack), passes, dp, seq (the token
    sequence's length, default S). Returns per case
    the relative errors (``step_errors``), or the refusal line."""
    warnings.filterwarnings("ignore")
    out = []
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        model, ids, compiled = compile_case(case, seed + i)
        if isinstance(compiled, str):
            out.append({"case": case, "refused": compiled})
            continue
        out.append({"case": case, **step_errors(compiled, model, ids, ids.clone()),
                    "seconds": round(time.perf_counter() - t0, 2)})
    return out


def compile_case(case: dict, seed: int):
    """(the case's tiny model, token ids [B, S], the model compiled with moegraph.compile for them
    on these ranks, or its refusal line)."""
    import moegraph
    from family_zoo import VOCAB, tiny_model, with_edge_head
    from moegraph.lowering import LoweringError
    model = with_edge_head(tiny_model(case["family"], case["cls"], seed=seed, **case.get("overrides", {})),
                           **case.get("edges", {}))
    ids = torch.randint(3, VOCAB, (B, case.get("seq", S)), generator=torch.Generator().manual_seed(seed + 1000))
    try:
        compiled = moegraph.compile(model, ids, hardware="cpu-gloo", attn=case["attn"], ffn=case["ffn"],
                                    dispatch=case["dispatch"], passes=case.get("passes", ""), schedule="greedy",
                                    dp=case.get("dp", 1), micro_batches=case.get("micro_batches", 1),
                                    attn_nodes=case.get("attn_nodes", 1), timeout_s=120.0)
    except LoweringError as err:
        return model, ids, str(err)
    return model, ids, compiled


FP32_RESOLVES = 1e-5
"""The tests' fp32 tolerance: a gradient within it of eager's matches outright (``step_errors``)."""


def step_errors(compiled, model, ids: torch.Tensor, labels: torch.Tensor, **kwargs) -> dict:
    """One forward and backward with labels through the compiled and the eager model (``kwargs``
    to both), from zeroed gradients: relative errors of logits, loss and every trainable parameter's
    gradient (``||compiled - eager|| / ||eager||``), the worst one named.

    A gradient further than FP32_RESOLVES from eager's is arbitrated by the eager model run in
    float64: a small gradient summed from large cancelling terms (a router bias's, whose softmax
    terms sum to zero per token) is not resolved to 1e-5 by fp32 in *either* implementation (seen:
    eager fp32 6.6e-6 and compiled 6.9e-6 from the fp64 result, 1.3e-5 from each other). Its error is
    then ``||compiled - fp64|| / ||fp64||`` scaled by FP32_RESOLVES / (2 x eager fp32's own error
    from fp64), so it stays under FP32_RESOLVES only while the compiled gradient is no further from
    the true one than twice eager fp32's; each arbitrated gradient is listed in ``arbitrated``."""
    from moegraph.runtime.check import rel_err
    model.zero_grad(set_to_none=True)
    compiled.zero_grad(set_to_none=True)
    got = compiled(ids, labels=labels, **kwargs)        # .logits with .loss, as transformers returns them
    got.loss.backward()
    ref = model(input_ids=ids, labels=labels, **kwargs)
    ref.loss.backward()
    grads = compiled.full_grads()
    pairs = {k: (grads[k], p.grad if p.grad is not None else torch.zeros_like(p))
             for k, p in model.named_parameters() if p.requires_grad}
    worst, worst_name, arbitrated = arbitrate(model, pairs, lambda exact: exact(
        input_ids=ids, labels=labels, **kwargs).loss.backward())
    return {"logits": rel_err(got.logits, ref.logits), "loss": rel_err(got.loss, ref.loss),
            "grads": worst, "worst_grad": worst_name, "params": len(pairs), "arbitrated": arbitrated}


def arbitrate(model, pairs: dict, run_exact) -> tuple[float, str, dict]:
    """(worst gradient error, its parameter, the arbitrated ones) of ``pairs`` (name -> (compiled,
    eager fp32 gradient)), as ``step_errors`` describes: gradients further than FP32_RESOLVES from
    eager's are judged against ``run_exact(model in float64)``'s, which runs the same backward."""
    import copy

    from moegraph.runtime.check import grad_report, rel_err
    report = grad_report(pairs)
    near_zero = set(report.get("near_zero_grads", ()))
    if report["max_rel_err_grads"] < FP32_RESOLVES:
        return report["max_rel_err_grads"], report["worst_grad"], {}
    exact = copy.deepcopy(model).double()            # the same weights (a step does not change them)
    exact.zero_grad(set_to_none=True)
    run_exact(exact)
    truth = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in exact.named_parameters()}
    errors, arbitrated = {}, {}
    for k, (c, e) in pairs.items():
        if k in near_zero:
            continue
        err = rel_err(c, e)
        if err >= FP32_RESOLVES:
            c64, e64 = rel_err(c.double(), truth[k]), rel_err(e.double(), truth[k])
            arbitrated[k] = {"vs_eager": err, "compiled_vs_fp64": c64, "eager_vs_fp64": e64}
            err = c64 * FP32_RESOLVES / max(FP32_RESOLVES, 2 * e64)
        errors[k] = err
    worst = max(errors, key=errors.get)
    return errors[worst], worst, arbitrated


def real_batches(rows: int = B, seq: int = S) -> dict[str, dict]:
    """The batch forms training feeds (moegraph.tokens), as transformers' keyword arguments: right
    padding (row 1 holds 11 tokens, then padding) and packed documents (position_ids restarting:
    row 0 holds documents of 7 and 9 tokens, row 1 of 5, 4 and 7). Labels are masked (-100) where
    the mask is 0, as SFT collators do."""
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[1, 11:] = 0
    docs = [[7, 9], [5, 4, 7]]
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in docs[r % 2]]) for r in range(rows)])
    return {"padded": {"attention_mask": mask}, "packed": {"position_ids": position_ids}}


def batch_cases(rank: int, n: int, cases: list[dict], seed: int) -> list[dict]:
    """``family_cases`` for the batch forms of ``real_batches``: each case's tiny model compiled once
    (for a plain batch), then each form run through it and through the eager model (use_cache=False,
    as training runs): per form the relative errors (``step_errors``), or the refusal line."""
    warnings.filterwarnings("ignore")
    out = []
    for i, case in enumerate(cases):
        model, ids, compiled = compile_case(case, seed + i)
        if isinstance(compiled, str):
            out.append({"case": case, "refused": compiled})
            continue
        res: dict = {"case": case}
        for form, kwargs in real_batches().items():
            labels = ids.masked_fill(kwargs["attention_mask"] == 0, -100) if "attention_mask" in kwargs else ids
            res[form] = step_errors(compiled, model, ids, labels, use_cache=False, **kwargs)
        out.append(res)
    return out


def accumulation_case(rank: int, n: int, case: dict, seed: int) -> dict:
    """``case`` compiled for a step of 2 micro-batches (``CompiledModel.train_step``): micro-batch 0
    right-padded, 1 packed (``real_batches``), against eager gradient accumulation (use_cache=False)
    under both reductions: per reduction the relative errors of the two losses and of every
    trainable parameter's gradient (``mean``: ``(loss_j / 2).backward()``; ``items``: transformers'
    Trainer's ``model(..., num_items_in_batch=N).loss.backward()``, N the step's scored tokens), and
    the refusal line of a left-padded micro-batch 1."""
    from family_zoo import VOCAB
    from moegraph.runtime.check import rel_err
    warnings.filterwarnings("ignore")
    model, ids0, compiled = compile_case(dict(case, micro_batches=2), seed)
    if isinstance(compiled, str):
        return {"refused": compiled}
    forms = real_batches()
    mask, positions = forms["padded"]["attention_mask"], forms["packed"]["position_ids"]
    ids = [ids0, torch.randint(3, VOCAB, ids0.shape, generator=torch.Generator().manual_seed(seed))]
    labels = [ids[0].masked_fill(mask == 0, -100), ids[1].clone()]
    items = sum(int((y[:, 1:] != -100).sum()) for y in labels)
    out = {}
    for reduction, kw, scale in (("mean", {}, 0.5), ("items", {"num_items_in_batch": items}, 1.0)):
        model.zero_grad(set_to_none=True)
        compiled.zero_grad(set_to_none=True)
        losses = compiled.train_step(ids, labels, attention_mask=[mask, None], position_ids=[None, positions], **kw)
        ref = []
        for x, y, form in zip(ids, labels, ({"attention_mask": mask}, {"position_ids": positions})):
            loss = model(input_ids=x, labels=y, use_cache=False, **form, **kw).loss
            (loss * scale).backward()
            ref.append(loss.detach())
        grads = compiled.full_grads()
        pairs = {k: (grads[k], p.grad if p.grad is not None else torch.zeros_like(p))
                 for k, p in model.named_parameters() if p.requires_grad}

        def exact_steps(exact, kw=kw, scale=scale):
            for x, y, form in zip(ids, labels, ({"attention_mask": mask}, {"position_ids": positions})):
                (exact(input_ids=x, labels=y, use_cache=False, **form, **kw).loss * scale).backward()
        worst, worst_name, arbitrated = arbitrate(model, pairs, exact_steps)
        out[reduction] = {"loss": rel_err(torch.stack(losses), torch.stack(ref)),
                          "grads": worst, "worst_grad": worst_name, "arbitrated": arbitrated}
    try:
        compiled.train_step(ids, labels, attention_mask=[None, mask.flip(-1)])
        out["refusal"] = None
    except ValueError as err:
        out["refusal"] = str(err)
    return out
