"""``CompileConfig``: everything that decides a compiled step, as one frozen, validated value.

    from moegraph import CompileConfig, Strategy
    config = CompileConfig(model="mixtral-8x7b", strategy=Strategy("sp", "ep", "ag-rs", n=8),
                           hardware="h800", layers=2)
    compiled = moegraph.compile(config)          # graph, schedule, report

One driver reads it (``moegraph.schedules.driver.build``: trace -> passes -> schedule); every
front door builds one (the CLI from its flags, ``moegraph.compile`` from its keywords, tune per
candidate, calibration per measured layer, the runtime from a module and its example input).
Runtime-only settings (collective timeouts, CUDA graphs, ...) are not here: the runtime gets a
plan and its graph, and its own options (``moegraph.runtime.options.RuntimeOptions``).

Validation names every bad field at once, with its valid values (ConfigError, a ValueError).
Facts that need the model's sizes (n divides the heads, ``layers`` at most the model's, top-k at
most its experts) are checked by the driver when it loads the model.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from moegraph.ir import ConfigError, Strategy
from moegraph.pass_steps import DEFAULT_PASSES, PassError, PassStep, check_steps
from moegraph.registry import Hardware, ModelConfig

Method = Literal["cpsat", "sequential", "greedy", "megascale"]
"""How a graph is scheduled: CP-SAT, or one of the list-scheduling baselines (moegraph.schedules)."""
StepMethod = Literal["megatron-1f1b", "dualpipe"]
"""The paired baselines of a merged micro-batch step only (micro_batches >= 2)."""
METHODS: tuple[str, ...] = typing.get_args(Method)
STEP_METHODS: tuple[str, ...] = typing.get_args(StepMethod)
LaunchOrder = Literal["free", "program", "megatron-1f1b"]
"""How kernels reach the GPU (moegraph.schedules.launch): a hardware queue per stream ('free'), or
one queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``) fed in the graph's program order or in Megatron-Core's
combined-1F1B order (a merged micro-batch step only)."""
LAUNCH_ORDERS: tuple[str, ...] = typing.get_args(LaunchOrder)

RECORDED = "strategy"
"""``CompileConfig.passes`` value: apply what the strategy's own typed fields record (gate and
chunks lowered directly; compress, remat, fuse as passes) and keep its ``passes`` labels as the
record: how a schedule file's graph is rebuilt (``moegraph.passes.rewrite_as``)."""

ModelSource = Union[str, "os.PathLike[str]", ModelConfig, Any]
"""A registry name, a model YAML path (``moegraph.registry.load_model`` reads both: the extension
point for further file formats such as a Hugging Face ``config.json``), a ModelConfig, or an
``nn.Module`` to trace (a decoder layer, or a causal LM with a model rule)."""


@dataclass(frozen=True)
class SolverEffort:
    """How hard the scheduler searches. CP-SAT's limits are deterministic, so the same config
    gives the same schedule on an idle or a loaded machine."""

    time_limit_s: float = 10.0
    """CP-SAT search effort in deterministic seconds (a memory budget that binds costs two
    solves of it: without the budget first)."""
    workers: int = 1
    """CP-SAT search workers; 1 keeps the search deterministic."""

    def problems(self) -> list[str]:
        out = []
        t = self.time_limit_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            out.append(f"solver.time_limit_s={t!r} must be a positive number of seconds")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            out.append(f"solver.workers={self.workers!r} must be a positive integer")
        return out


@dataclass(frozen=True)
class ModelEdges:
    """A causal LM's edges added to the step graph (embedding, final norm, LM head and their
    gradient syncs: ``moegraph.passes.edges``) for a registry model, which names no vocabulary."""

    vocab: int | None
    """The LM head's vocabulary V; None: a base model without a head."""

    def problems(self) -> list[str]:
        v = self.vocab
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            return [f"edges.vocab={v!r} must be a positive integer or None (no LM head)"]
        return []


Edges = Union[Literal["auto", "none"], ModelEdges]


@dataclass(frozen=True)
class CompileConfig:
    """One compilation: the model, how it is parallelised and rewritten, how it is scheduled."""

    model: ModelSource
    """What to compile: a registry name or model YAML path, a ModelConfig (the reference
    layer sized from it, traced without weights), or an ``nn.Module`` (a decoder layer, or a
    causal LM recognised by its model rule: its decoder layers, stacked, with its edges)."""
    strategy: Strategy = Strategy("sp", "ep", "ag-rs", 8)
    """The parallel strategy the layer is lowered for: attn, ffn, dispatch, n, dtype and dp
    (``moegraph.ir.Strategy``). The passes record what they choose in the graph's copy of it."""
    passes: tuple[PassStep, ...] | Literal["strategy"] = DEFAULT_PASSES
    """The pass pipeline, typed steps (``moegraph.pass_steps``; run in the pass manager's stage
    order), () for none; or RECORDED ("strategy"): the rewrites ``strategy`` itself records."""
    schedule: Method | StepMethod = "cpsat"
    """How to schedule: 'cpsat' or a baseline; 'megatron-1f1b' and 'dualpipe' need
    micro_batches >= 2."""
    memory_budget: int | None = None
    """Bytes of activation memory the schedule may hold at its peak; None: unbounded."""
    layers: int | Literal["all"] = 1
    """Decoder layers in the graph (a registry model): at most the model's MoE layers, 'all' for
    all of them. A module brings its own (1 here)."""
    micro_batches: int = 1
    """M >= 2: one step graph of M micro-batches (gradient accumulation) is scheduled whole."""
    batch: int = 1
    """Micro-batch b (rows per replica)."""
    seq: int = 8192
    """Sequence length s."""
    top_k: int | None = None
    """Override the registry model's top-k (None: the model's own)."""
    edges: Edges = "auto"
    """The model's edges in the step graph: 'auto' (a causal LM module: its own; a registry
    model: at ``moegraph.models.VOCAB`` for a stack of two or more layers, what compile and tune
    schedule; one layer: none), 'none', or ModelEdges(vocab) for any layer count."""
    solver: SolverEffort = field(default_factory=SolverEffort)
    """The scheduler's search effort."""
    hardware: str | os.PathLike | Hardware = "h800"
    """The cost model's hardware: a registry name, a profile YAML path, or a Hardware."""
    comm_streams: Literal[1, 2] = 1
    """Communication streams: 1 ('comm'), or 2 (intra- and inter-node: 'comm.intra', 'comm.inter')."""
    launch_order: LaunchOrder = "free"
    """'free': the scheduler orders kernels across streams; 'program' or 'megatron-1f1b': one hardware
    queue fed in that order, so a kernel starts only after every kernel launched before it
    ('megatron-1f1b' needs micro_batches >= 2)."""
    # pipeline stages (pp, vpp: issue 28) extend this config here

    def __post_init__(self):
        problems: list[str] = []
        if not (isinstance(self.model, (str, os.PathLike, ModelConfig)) or is_module(self.model)):
            problems.append(f"model={self.model!r} must be a registry name, a model YAML path, a ModelConfig or an "
                            "nn.Module")
        if not isinstance(self.strategy, Strategy):
            problems.append(f"strategy={self.strategy!r} must be a moegraph.Strategy")
        if self.passes != RECORDED:
            try:
                check_steps(self.passes)
            except PassError as err:
                problems.append(str(err))
        if self.schedule not in METHODS + STEP_METHODS:
            problems.append(f"schedule={self.schedule!r} is not one of {', '.join(METHODS + STEP_METHODS)}")
        elif self.schedule in STEP_METHODS and _positive(self.micro_batches) and self.micro_batches < 2:
            problems.append(f"schedule={self.schedule!r} pairs one micro-batch's forward with another's backward: "
                            f"it needs micro_batches >= 2 (got {self.micro_batches})")
        if self.memory_budget is not None and not _positive(self.memory_budget):
            problems.append(f"memory_budget={self.memory_budget!r} must be a positive byte count or None")
        if self.layers != "all" and not _positive(self.layers):
            problems.append(f"layers={self.layers!r} must be a positive integer or 'all'")
        elif is_module(self.model) and self.layers != 1:
            problems.append(f"layers={self.layers!r}: a module brings its own layers (leave layers=1)")
        for name in ("micro_batches", "batch", "seq"):
            if not _positive(getattr(self, name)):
                problems.append(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.top_k is not None and not _positive(self.top_k):
            problems.append(f"top_k={self.top_k!r} must be a positive integer or None (the model's own)")
        if self.edges not in ("auto", "none") and not isinstance(self.edges, ModelEdges):
            problems.append(f"edges={self.edges!r} must be 'auto', 'none' or a ModelEdges")
        elif isinstance(self.edges, ModelEdges):
            problems += self.edges.problems()
        if isinstance(self.solver, SolverEffort):
            problems += self.solver.problems()
        else:
            problems.append(f"solver={self.solver!r} must be a SolverEffort")
        if not isinstance(self.hardware, (str, os.PathLike, Hardware)):
            problems.append(f"hardware={self.hardware!r} must be a registry name, a profile YAML path or a Hardware")
        if self.comm_streams not in (1, 2) or isinstance(self.comm_streams, bool):
            problems.append(f"comm_streams={self.comm_streams!r} is not one of 1, 2")
        if self.launch_order not in LAUNCH_ORDERS:
            problems.append(f"launch_order={self.launch_order!r} is not one of {', '.join(LAUNCH_ORDERS)}")
        elif self.launch_order == "megatron-1f1b" and _positive(self.micro_batches) and self.micro_batches < 2:
            problems.append("launch_order='megatron-1f1b' launches one micro-batch's forward beside another's "
                            f"backward: it needs micro_batches >= 2 (got {self.micro_batches})")
        if problems:
            raise ConfigError("CompileConfig: " + "; ".join(problems))

    def replace(self, **changes: Any) -> "CompileConfig":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def is_module(value: Any) -> bool:
    """Whether ``value`` is a torch ``nn.Module`` (without importing torch: a module exists only
    once torch is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.nn.Module)


__all__ = ["CompileConfig", "Edges", "LAUNCH_ORDERS", "LaunchOrder", "METHODS", "Method", "ModelEdges", "ModelSource", "RECORDED", "STEP_METHODS",
           "SolverEffort", "StepMethod", "is_module"]
