"""Autograd glue: the scheduled forward and backward as one ``torch.autograd.Function``.

Forward runs the plan's forward entries and keeps, on ``ctx``, exactly the values the graph's
backward and recompute nodes read (the graph's saved activations, routing and index maps).
Backward runs the backward and recompute entries in plan order with the incoming gradient as
the graph's seed and returns the layer-input gradient and one gradient per parameter shard,
which autograd accumulates into the shards' ``.grad``. Replicated parameters arrive already
summed over ranks (the graph's ALL_REDUCE nodes). No double backward (``once_differentiable``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.autograd.function import once_differentiable


def once_only(state: Any) -> None:
    """Raise where a compiled step's backward runs again through one forward: its first backward
    freed the saved activations (``loss.backward(retain_graph=True)``, then a second backward)."""
    if state is None:
        raise RuntimeError("the compiled step frees its saved activations in its one backward: a second backward "
                           "through the same forward (retain_graph=True) is not supported; run the forward again")


class Runner(Protocol):
    def run_forward(self, x: torch.Tensor, params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, Any]: ...

    def run_backward(self, state: Any, dy: torch.Tensor,
                     params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, list[torch.Tensor]]: ...


class ScheduledLayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: Runner, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        y, state = runner.run_forward(x, params)
        ctx.runner, ctx.state = runner, state
        ctx.save_for_backward(*params)          # version-checked: an in-place update before backward is an error
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        params = ctx.saved_tensors
        once_only(ctx.state)
        state, ctx.state = ctx.state, None      # free the saved activations as backward starts
        dx, grads = ctx.runner.run_backward(state, dy, params)
        return (None, dx, *grads)
