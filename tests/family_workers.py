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
    overrides (config fields over the zoo's: e.g. a mixed layer stack). Returns per case the
    relative errors (``||compiled - eager|| / ||eager||``), or the refusal line."""
    import moegraph
    from family_zoo import VOCAB, tiny_model
    from moegraph.lowering import LoweringError
    from moegraph.runtime.check import grad_report, rel_err
    warnings.filterwarnings("ignore")
    out = []
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        model = tiny_model(case["family"], case["cls"], seed=seed + i, **case.get("overrides", {}))
        gen = torch.Generator().manual_seed(seed + 1000 + i)
        ids = torch.randint(3, VOCAB, (B, S), generator=gen)
        labels = ids.clone()
        try:
            compiled = moegraph.compile(model, ids, hardware="cpu-gloo", attn=case["attn"], ffn=case["ffn"],
                                        dispatch=case["dispatch"], passes=case.get("passes", ""), schedule="greedy",
                                        timeout_s=120.0)
        except LoweringError as err:
            out.append({"case": case, "refused": str(err)})
            continue
        got = compiled(ids, labels=labels)                  # .logits with .loss, as transformers returns them
        got.loss.backward()
        ref = model(input_ids=ids, labels=labels)
        ref.loss.backward()
        grads = compiled.full_grads()
        pairs = {k: (grads[k], p.grad if p.grad is not None else torch.zeros_like(p))
                 for k, p in model.named_parameters() if p.requires_grad}
        report = grad_report(pairs)
        out.append({"case": case, "logits": rel_err(got.logits, ref.logits), "loss": rel_err(got.loss, ref.loss),
                    "grads": report["max_rel_err_grads"], "worst_grad": report["worst_grad"],
                    "params": len(pairs), "seconds": round(time.perf_counter() - t0, 2)})
    return out
