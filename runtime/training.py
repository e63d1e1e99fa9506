"""Training checks: the whole model compiled on every rank and trained, against eager.

``run --train-steps K`` (``moegraph.runtime.commands``) compiles the model step once in the
parent and spawns ``train_rank`` on n x dp ranks: each builds the seeded MoETransformer, compiles
it with the parent's config and plan (``moegraph.runtime.model.compile_model``), and trains K
AdamW steps; with ``check`` the eager model trained alike is compared (moegraph.runtime.check).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from moegraph.config import CompileConfig
from moegraph.runtime.options import RuntimeOptions
from moegraph.runtime.timing import progress


@dataclass(frozen=True)
class TrainSpec:
    """What a training rank needs (``train_rank``); picklable."""

    model: Any                    # registry ModelConfig: each rank builds the seeded MoETransformer
    layers: int
    vocab: int
    config: CompileConfig         # what the parent compiled; each rank lowers it for its module
    plan: Any                     # ExecutionPlan of the model step (the parent's)
    steps: int
    seed: int
    check: bool
    options: RuntimeOptions
    micro_batches: int = 1        # M >= 2: each step one merged plan of M micro-batches (train_step)
    progress_t0: float | None = None   # rank 0 reports progress (``progress``); None: silent


def train_rank(rank: int, world: int, spec: TrainSpec) -> dict[str, Any]:
    """One rank (of ``world`` = n x dp) of ``run --train-steps``: seeded MoETransformer, compiled
    with the parent's plan, trained ``spec.steps`` AdamW steps on seeded random tokens (labels =
    the tokens: next-token prediction; the global batch [dp*b, s], replica p its rows p*b ..);
    with ``check``, the eager model trained alike on the global batch is compared (every rank)."""
    import torch
    from moegraph.models import MoETransformer
    from moegraph.runtime.check import train_against_eager, train_microbatches_against_eager
    from moegraph.runtime.model import compile_model
    torch.manual_seed(spec.seed)
    # in the plan's dtype: compile_model lowers the model in its parameters' dtype
    model = MoETransformer.from_config(spec.model, layers=spec.layers, vocab=spec.vocab).to(
        {"fp32": torch.float32, "bf16": torch.bfloat16}[spec.config.strategy.dtype])
    gen = torch.Generator().manual_seed(spec.seed + 1)
    M = spec.micro_batches
    dp, config = spec.config.strategy.dp, spec.config
    batches = [(ids, ids) for ids in (torch.randint(0, spec.vocab, (dp * config.batch, config.seq), generator=gen)
                                      for _ in range(spec.steps * M))]
    compiled = compile_model(model, batches[0][0], config, spec.options, n=world // dp, given=spec.plan)
    t0 = time.perf_counter()
    shown = spec.progress_t0 if rank == 0 else None
    steps = [batches[k * M:(k + 1) * M] for k in range(spec.steps)]
    if spec.check:
        progress(shown, f"training {spec.steps} steps compiled, then eager alike (--check)")
    if M > 1 and spec.check:
        res = train_microbatches_against_eager(model, compiled, steps)
    elif M > 1:
        opt = torch.optim.AdamW(compiled.parameters(), lr=1e-4)
        losses = []
        for step in steps:
            opt.zero_grad()
            losses.append([x.item() for x in compiled.train_step(*map(list, zip(*step)))])
            opt.step()
            progress(shown, f"step {len(losses)}/{spec.steps}: losses {', '.join(f'{x:.4f}' for x in losses[-1])}")
        res = {"losses": losses}
    elif spec.check:
        res = train_against_eager(model, compiled, batches)
    else:
        opt = torch.optim.AdamW(compiled.parameters(), lr=1e-4)
        losses = []
        for ids, labels in batches:
            opt.zero_grad()
            loss = compiled(ids, labels=labels).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
            progress(shown, f"step {len(losses)}/{spec.steps}: loss {losses[-1]:.4f}")
        res = {"losses": losses}
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


__all__ = ["TrainSpec", "train_rank"]
