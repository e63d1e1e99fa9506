"""Pipelined execution on torch.distributed.pipelining's runtime, from a moegraph stage-level order.

Notation: P pipeline ranks, V stages per rank, M micro-batches; b, s, h, V_ocab as in moegraph.ir.

The order a schedule gives (moegraph.schedules.pipeline: torch's generated tables or CP-SAT's) is
written as torch's compute-only action CSV (``moegraph.schedules.pipeline_torch.write_csv``); each
pipeline rank builds its stages' modules (``stage_modules``: stage 0 takes the embedding, the last
the final norm and LM head, every stage its layers as the layout says), wraps them in
``PipelineStage``, loads the CSV into ``_PipelineScheduleRuntime`` (which adds the sends and
receives and runs F, I, W, B and OVERLAP_F_B actions; the latter's parts one after the other
unless a function is registered for it) and steps. The loss of each micro-batch is the causal
LM loss of its rows (``moegraph.models.causal_lm_loss``); torch scales the accumulated gradients
by 1/M (``scale_grads``), so a step's gradients are those of the mean micro-batch loss.

Ranks: the process group given (default: the world) is the pipeline group, pipeline rank =
group rank; the moegraph world order (passes/stages.py) puts a stage's n x dp ranks together,
and eager stage modules here are whole (n = 1, dp = 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from moegraph.models import MoETransformer, causal_lm_loss
from moegraph.passes.stages import StageLayout

__all__ = ["StageModule", "stage_modules", "run_torch_schedule"]


class StageModule(nn.Module):
    """One pipeline stage of a MoETransformer: [embedding], its layers, [final norm, LM head].
    forward: input ids [b, s] (first stage) or hidden [b, s, h] -> hidden [b, s, h] or logits
    [b, s, V] (last stage)."""

    def __init__(self, model: MoETransformer, layers: Sequence[int], first: bool, last: bool):
        super().__init__()
        self.embed = model.embed if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)                      # [b, s] -> [b, s, h]
        for layer in self.layers:
            x = layer(x)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))         # [b, s, h] -> [b, s, V]
        return x


def stage_modules(model: MoETransformer, layout: StageLayout) -> tuple[StageModule, ...]:
    """Every stage's module, sharing ``model``'s parameters."""
    if layout.layers != len(model.layers):
        raise ValueError(f"layout holds {layout.layers} layers; the model has {len(model.layers)}")
    S = len(layout.stages)
    return tuple(StageModule(model, s, k == 0, k == S - 1) for k, s in enumerate(layout.stages))


def run_torch_schedule(modules: Sequence[StageModule], layout: StageLayout, csv_path: str | Path, *,
                       micro_batches: int, input_ids: torch.Tensor | None, labels: torch.Tensor | None,
                       group=None) -> list[torch.Tensor]:
    """One step of this rank's stages (``layout.stages_of(rank)``) in torch's runtime, the action
    table read from ``csv_path``. ``input_ids`` [M*b, s] on the rank of stage 0, ``labels`` on the
    rank of the last stage (None elsewhere). Returns the per-micro-batch losses on the last stage's
    rank ([] elsewhere); parameter gradients accumulate in the modules."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    rank = dist.get_rank(group)
    if dist.get_world_size(group) != layout.pp:
        raise ValueError(f"the pipeline group has {dist.get_world_size(group)} ranks; the layout pp={layout.pp}")
    S = len(layout.stages)
    mine = layout.stages_of(rank)
    stages = [PipelineStage(modules[k], k, S, torch.device("cpu"), group=group) for k in mine]
    schedule = _PipelineScheduleRuntime(stages, micro_batches, loss_fn=causal_lm_loss)
    schedule._load_csv(str(csv_path))
    losses: list[torch.Tensor] = []
    args = (input_ids,) if 0 in mine else ()
    target = labels if S - 1 in mine else None
    schedule.step(*args, target=target, losses=losses if S - 1 in mine else None)
    return losses
