"""Rank functions for tests/test_pipeline_runtime.py (spawned on P gloo ranks; importable by name)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from moegraph.models import MoETransformer, MoETransformerLayer
from moegraph.passes.stages import StageLayout
from moegraph.runtime.pipeline import run_torch_schedule, stage_modules

VOCAB, H, SEQ, B = 50, 32, 8, 2


def tiny_model(layers: int, seed: int) -> MoETransformer:
    """The same model on every rank and in the test (seeded), every weight drawn afresh."""
    torch.manual_seed(seed)
    model = MoETransformer(VOCAB, [MoETransformerLayer(hidden=H, heads=4, kv_heads=2, ffn_hidden=48, experts=4,
                                                       top_k=2) for _ in range(layers)], H)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model


def batch(micro_batches: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (micro_batches * B, SEQ), generator=gen)
    return ids, torch.randint(0, VOCAB, (micro_batches * B, SEQ), generator=gen)


def torch_runtime_step(rank: int, world: int, csv_text: str, stages: tuple, placement: str, micro_batches: int,
                       seed: int) -> dict:
    """One step of the CSV's order in torch's runtime: this rank's losses and parameter gradients."""
    layout = StageLayout(stages, world, placement)
    model = tiny_model(layout.layers, seed)
    ids, labels = batch(micro_batches, seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "order.csv"
        path.write_text(csv_text)
        losses = run_torch_schedule(stage_modules(model, layout), layout, path, micro_batches=micro_batches,
                                    input_ids=ids, labels=labels)
    return {"losses": [float(x.detach()) for x in losses],
            "grads": {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}}


STEPS = 3
OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.5),
              "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3)}


def hf_batches(seed: int, micro_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS steps of (input_ids, labels) [M*b, s] for the tiny Mixtral (tests/model_workers.py)."""
    from model_workers import B as HF_B, S as HF_S, VOCAB as HF_VOCAB
    gen = torch.Generator().manual_seed(seed + 7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, HF_VOCAB, (micro_batches * HF_B, HF_S), generator=gen)
        labels = ids.clone()
        labels[:, :2] = -100                        # some ignored labels: the loss counts scored tokens
        out.append((ids, labels))
    return out


def compiled_training(rank: int, world: int, csv_text: str, stages: tuple, n: int, micro_batches: int,
                      seed: int, pairs: bool = False, optimizers: tuple = tuple(OPTIMIZERS),
                      placement: str = "loop") -> dict:
    """The tiny Mixtral as moegraph's compiled stages (P = world / n, n ranks each) in torch's
    runtime, the CSV's order: STEPS steps with each of ``optimizers`` from the same weights.
    Returns, per optimizer, each step's M losses (on the last stage's ranks) and the final
    parameters of this rank's stages under the model's names; the pairs run merged per step
    (``merged``) and the merged F&B plans' runs (``pair_runs``). ``pairs``: stages compiled with
    their merged F&B, and the plans of the CSV's pairs of two stages."""
    import torch.distributed as dist

    from model_workers import mixtral_model
    from moegraph.runtime.pipeline import ShardLoss, TorchPipeline, compile_stages, pipeline_group
    from moegraph.schedules.pipeline import Pair
    from moegraph.schedules.pipeline_torch import read_csv
    layout = StageLayout(stages, world // n, placement)
    model = mixtral_model(seed, layout.layers)
    init = {k: t.detach().clone() for k, t in model.named_parameters()}
    data = hf_batches(seed, micro_batches)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "order.csv"
        path.write_text(csv_text)
        cross = sorted({(i.forward.stage, i.backward.stage) for row in read_csv(path) for i in row
                        if isinstance(i, Pair) and i.forward.stage != i.backward.stage})
    mine = compile_stages(model, layout, data[0][0][: data[0][0].shape[0] // micro_batches], n=n,
                          hardware="cpu-gloo", passes="", schedule="greedy", timeout_s=60.0, pairs=pairs,
                          cross_pairs=cross)
    group = pipeline_group(layout.pp, n)
    last = len(stages) - 1 in mine
    out: dict = {"kinds": sorted({type(m.layers).__name__ for m in mine.values()})}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "order.csv"
        path.write_text(csv_text)
        pipe = TorchPipeline(mine, layout, path, micro_batches=micro_batches, loss_fn=ShardLoss.for_stages(rank % n, mine),
                             group=group, static={k: m.io_examples() for k, m in mine.items()})
        out["merged"] = pipe.merged_pairs
        for name in optimizers:
            make = OPTIMIZERS[name]
            for m in mine.values():
                m.load_full(init)
            opt = make([p for m in mine.values() for p in m.parameters()])
            losses = []
            for ids, labels in data:
                opt.zero_grad()
                terms = pipe.step(ids if 0 in mine else None, labels if last else None)
                for m in mine.values():
                    m.sync_edge_grads()
                opt.step()
                if last:
                    total = torch.stack([t.detach() for t in terms])
                    if n > 1:                       # the n ranks' terms sum to each micro-batch's loss
                        dist.all_reduce(total, group=next(iter(mine.values())).layers.executor.comm.mp_group)
                    losses.append(total.tolist())
            out[name] = {"losses": losses, "params": {k: v for m in mine.values() for k, v in m.full_state().items()}}
    out["pair_runs"] = sum(m.pair.runs for m in mine.values() if m.pair is not None)
    return out


def batch_forms(micro_batches: int) -> tuple[list, list, int]:
    """The step's per-micro-batch forms (tests/family_workers.real_batches): even micro-batches
    right-padded, odd ones packed: (attention_mask, position_ids) lists of M entries (None where
    the other form is given)."""
    from family_workers import real_batches
    forms = real_batches()
    mask, positions = forms["padded"]["attention_mask"], forms["packed"]["position_ids"]
    masks = [mask if j % 2 == 0 else None for j in range(micro_batches)]
    return masks, [None if j % 2 == 0 else positions for j in range(micro_batches)]


def batch_step_data(seed: int, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor, list, list, int]:
    """One step's (input_ids, labels [M*b, s], masks, position_ids, N): labels -100 where the
    mask is 0 in micro-batch 0 (as SFT collators do), kept in the other padded ones (the pads'
    losses then read the mask: without them, a right-padded batch's loss is the plain one's), N the
    step's scored tokens (num_items_in_batch)."""
    from model_workers import B as HF_B, S as HF_S, VOCAB as HF_VOCAB
    masks, positions = batch_forms(micro_batches)
    ids = torch.randint(3, HF_VOCAB, (micro_batches * HF_B, HF_S), generator=torch.Generator().manual_seed(seed + 11))
    keep = torch.cat([m if j == 0 else torch.ones(HF_B, HF_S, dtype=torch.long) for j, m in enumerate(masks)])
    labels = ids.masked_fill(keep == 0, -100)
    return ids, labels, masks, positions, int((labels[:, 1:] != -100).sum())


REDUCTIONS = ("mean", "items")


def compiled_batch_step(rank: int, world: int, csv_text: str, stages: tuple, n: int, micro_batches: int,
                        seed: int, pairs: bool, overrides: dict) -> dict:
    """The tiny Mixtral (``overrides`` to its config) as compiled stages in torch's runtime, the
    CSV's order, one step of padded and packed micro-batches (``batch_step_data``) under each loss
    reduction (``REDUCTIONS``): per reduction the M losses (the last stage's ranks) and this rank's
    stages' full gradients under the model's names; the pairs run merged (``merged``)."""
    import torch.distributed as dist

    from model_workers import mixtral_model
    from moegraph.runtime.pipeline import ShardLoss, TorchPipeline, compile_stages, pipeline_group
    layout = StageLayout(stages, world // n)
    model = mixtral_model(seed, layout.layers, **overrides)
    ids, labels, masks, positions, items = batch_step_data(seed, micro_batches)
    mine = compile_stages(model, layout, ids[: ids.shape[0] // micro_batches], n=n, hardware="cpu-gloo", passes="",
                          schedule="greedy", timeout_s=60.0, pairs=pairs)
    last = len(stages) - 1 in mine
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "order.csv"
        path.write_text(csv_text)
        aux = next(iter(mine.values())).aux_loss
        pipe = TorchPipeline(mine, layout, path, micro_batches=micro_batches, loss_fn=ShardLoss.for_stages(rank % n, mine, aux),
                             group=pipeline_group(layout.pp, n), static={k: m.io_examples() for k, m in mine.items()})
        out["merged"] = pipe.merged_pairs
        for reduction in REDUCTIONS:
            for m in mine.values():
                m.zero_grad(set_to_none=True)
            terms = pipe.step(ids if 0 in mine else None, labels if last else None, attention_mask=masks,
                              position_ids=positions, num_items_in_batch=items if reduction == "items" else None)
            for m in mine.values():
                m.sync_edge_grads()
            losses = None
            if last:
                losses = torch.stack([t.detach() for t in terms])
                if n > 1:                           # the n ranks' terms sum to each micro-batch's loss
                    dist.all_reduce(losses, group=next(iter(mine.values())).layers.executor.comm.mp_group)
            out[reduction] = {"losses": losses, "grads": {k: g for m in mine.values() for k, g in m.full_grads().items()}}
    return out


def eager_batch_step(seed: int, micro_batches: int, layers: int, overrides: dict) -> dict:
    """``compiled_batch_step``'s step by the eager transformers model (use_cache=False, as training
    runs), gradient accumulation: per reduction the M losses and every parameter's gradient
    (``mean``: ``(loss_j / M).backward()``; ``items``: ``model(..., num_items_in_batch=N).loss.backward()``)."""
    from model_workers import mixtral_model
    model = mixtral_model(seed, layers, **overrides)
    ids, labels, masks, positions, items = batch_step_data(seed, micro_batches)
    out = {}
    for reduction in REDUCTIONS:
        model.zero_grad(set_to_none=True)
        kw, scale = ({}, 1 / micro_batches) if reduction == "mean" else ({"num_items_in_batch": items}, 1.0)
        losses = []
        for j, (x, y) in enumerate(zip(ids.chunk(micro_batches), labels.chunk(micro_batches))):
            form = {"attention_mask": masks[j]} if masks[j] is not None else {"position_ids": positions[j]}
            loss = model(input_ids=x, labels=y, use_cache=False, **form, **kw).loss
            (loss * scale).backward()
            losses.append(loss.detach())
        out[reduction] = {"losses": torch.stack(losses),
                          "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}
    return out
