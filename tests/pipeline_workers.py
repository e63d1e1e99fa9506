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
    return {"losses": [float(x) for x in losses],
            "grads": {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}}
