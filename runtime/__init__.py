"""Runtime: execute a scheduled layer graph on real ranks (torch.distributed) and measure it.

Read in this order: ``plan`` (what runs where, in which order), ``collectives`` (the IR
collectives on gloo / NCCL), ``executor`` (streams, events, one node at a time), ``autograd``
(forward/backward glue), ``options`` (RuntimeOptions: how a plan runs), ``module`` (the
compiled nn.Module and ``compile_module``), ``model`` (a compiled causal LM), ``trace``
(measured Gantt, --trace files), ``launch`` (spawning ranks), ``timing`` (plans timed on ranks),
``device_memory`` (a run's measured memory), ``check`` (numerics against eager), ``training``
(--train-steps), ``commands`` (``moegraph run``'s flags) and ``report`` (its text). docs/runtime.md describes the execution model.

This file stays import-light (no torch): the CLI imports it to learn the expected errors.
"""

from __future__ import annotations

import typing
from typing import Literal

CudaGraphs = Literal["off", "attention", "layer"]
"""What a layer captures as CUDA graphs (``runtime.cudagraph``): nothing, the static prefix and
suffix of each phase (the attention block), or whole phases. Here, torch-free, for the CLI."""
CUDA_GRAPH_MODES: tuple[str, ...] = typing.get_args(CudaGraphs)


class RuntimeFailure(RuntimeError):
    """An expected runtime failure, reported by the CLI as one line and exit code 2."""


class ScheduleMismatch(RuntimeFailure):
    """Ranks were handed different execution plans; the message names the ranks that differ."""


class PlanError(RuntimeFailure):
    """An execution plan that does not fit its graph (missing node, broken dependency order)."""


class CollectiveTimeout(RuntimeFailure):
    """A collective did not complete within the timeout; the message names the node."""


class RankFailure(RuntimeFailure):
    """A spawned rank raised; carries the rank, the original error type name and its traceback."""

    def __init__(self, message: str, *, rank: int, error_type: str, traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type
        self.traceback = traceback


__all__ = ["CudaGraphs", "CUDA_GRAPH_MODES", "RuntimeFailure", "ScheduleMismatch", "PlanError", "CollectiveTimeout", "RankFailure"]
