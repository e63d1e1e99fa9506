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
from moegraph.limits import MAX_TOKENS, check_graph_size
from moegraph.pass_steps import DEFAULT_PASSES, PassError, PassStep, check_steps
from moegraph.registry import Hardware, ModelConfig

Method = Literal["cpsat", "sequential", "greedy", "megascale"]
"""How a graph is scheduled: CP-SAT, or one of the list-scheduling baselines (moegraph.schedules)."""
StepMethod = Literal["megatron-1f1b", "dualpipe"]
"""The paired baselines of a merged micro-batch step only (micro_batches >= 2)."""
Placement = Literal["loop", "v"]
"""Where a pipeline rank's V stages sit (``moegraph.passes.stages.StageLayout``): 'loop' puts
stage s on rank s mod P (Megatron's interleaved schedule), 'v' puts stages s and 2P-1-s on rank s
(V = 2: the V-shape of torch's ZBVZeroBubble and DualPipeV)."""
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
class PipelineSearch:
    """The stage-level step's pricing and search (``CompileConfig.pp`` > 1): the op-level
    schedule prices each stage's units (moegraph.schedules.pipeline_price) with ``schedule``'s
    method and ``unit_time_limit_s`` of CP-SAT effort; CP-SAT then orders the units with
    ``solver.time_limit_s`` of effort, warm-started from torch.distributed.pipelining's
    generated schedules, and the window search refines the result (``windows`` > 0)."""

    unit_time_limit_s: float = 1.0
    """CP-SAT effort (deterministic seconds) per op-level unit price (F, I, W, B, the F&B pair)."""
    windows: int = 0
    """Windows per sweep of the window search after the whole-step one (0: none)."""
    window: int = 4
    """Micro-batches free in each window."""
    window_limit_s: float = 1.0
    """CP-SAT effort per window (deterministic seconds)."""
    overlap_param_gather: bool = False
    """The gradient sync's all-gather half runs at the next step's start, beside the forward
    (Megatron's ``--overlap-param-gather``); False: the whole sync at the step's end."""
    runnable: bool = False
    """The order runs on moegraph's compiled stages (moegraph.runtime.pipeline, ``run --pp``):
    each backward whole (B, no I/W split; F&B pairs of one stage or, on a V-shape, of two, each
    one merged pair plan); False: any order torch's runtime takes."""

    def problems(self) -> list[str]:
        out = []
        for name in ("unit_time_limit_s", "window_limit_s"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
                out.append(f"pipeline.{name}={t!r} must be a positive number of seconds")
        if isinstance(self.windows, bool) or not isinstance(self.windows, int) or self.windows < 0:
            out.append(f"pipeline.windows={self.windows!r} must be an integer >= 0")
        if not _positive(self.window):
            out.append(f"pipeline.window={self.window!r} must be a positive integer")
        for name in ("overlap_param_gather", "runnable"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"pipeline.{name}={getattr(self, name)!r} must be True or False")
        return out


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
    """A cap on the schedule's peak, in bytes; None: unbounded. Without a pipeline (pp = 1) it
    caps what the op-level schedule holds (activations and comm buffers; the parameters,
    gradients and optimizer states are not counted). With pp > 1 it caps the whole memory of each
    pipeline rank: parameters, fp32 main gradients, optimizer states, the activations of its
    in-flight micro-batches and the p2p buffers (``moegraph.memory``)."""
    layers: int | Literal["all"] = 1
    """Decoder layers in the graph (a registry model): at most the model's MoE layers, 'all' for
    all of them. With pp > 1: the model's first L layers, its dense first layers included (at
    most all of its layers; 'all' for the whole model). A module brings its own (1 here)."""
    micro_batches: int = 1
    """M >= 2: one step graph of M micro-batches (gradient accumulation) is scheduled whole.
    With pp > 1: the pipeline's M micro-batches per step, which the stage-level schedule orders
    (each stage's graph stays one micro-batch)."""
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
    copy_engines: bool = True
    """Whether collectives may run on copy engines (SM budget 0) where the hardware allows it.
    False schedules them on SMs only (``Hardware.without_copy_engines``): what moegraph's runtime
    runs on NCCL, which sets it for the plans it compiles (docs/runtime.md, "SM budgets")."""
    launch_order: LaunchOrder = "free"
    """'free': the scheduler orders kernels across streams; 'program' or 'megatron-1f1b': one hardware
    queue fed in that order, so a kernel starts only after every kernel launched before it
    ('megatron-1f1b' needs micro_batches >= 2)."""
    # -- pipeline stages (issue 28; docs/pipeline.md): read by the driver when pp > 1 ------------
    pp: int = 1
    """P, the pipeline ranks: the model's layers are cut into P x vpp stages, balanced by the
    predicted cost (embedding and head priced with their stages), each stage an n-rank group with
    dp replicas (world = P x n x dp). 1: no pipeline, the graph is scheduled at the op level."""
    vpp: int = 1
    """V, the virtual stages per pipeline rank (S = P x V stages); V > 1 needs pp > 1."""
    placement: Placement = "loop"
    """Where a rank's V stages sit: 'loop' or 'v' (V = 2); see ``Placement``."""
    pipeline: PipelineSearch = field(default_factory=PipelineSearch)
    """How the stage-level step is priced and searched (pp > 1 only)."""

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
        if _positive(self.batch) and _positive(self.seq) and self.batch * self.seq > MAX_TOKENS:
            problems.append(f"batch x seq = {self.batch:,} x {self.seq:,} tokens per micro-batch is over the limit of "
                            f"{MAX_TOKENS:,} (moegraph.limits; docs/rules.md)")
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
        if not isinstance(self.copy_engines, bool):
            problems.append(f"copy_engines={self.copy_engines!r} must be True or False")
        if self.comm_streams not in (1, 2) or isinstance(self.comm_streams, bool):
            problems.append(f"comm_streams={self.comm_streams!r} is not one of 1, 2")
        if self.launch_order not in LAUNCH_ORDERS:
            problems.append(f"launch_order={self.launch_order!r} is not one of {', '.join(LAUNCH_ORDERS)}")
        elif self.launch_order == "megatron-1f1b" and _positive(self.micro_batches) and self.micro_batches < 2:
            problems.append("launch_order='megatron-1f1b' launches one micro-batch's forward beside another's "
                            f"backward: it needs micro_batches >= 2 (got {self.micro_batches})")
        problems += self._pipeline_problems()
        if problems:
            raise ConfigError("CompileConfig: " + "; ".join(problems))

    def _pipeline_problems(self) -> list[str]:
        """The pipeline fields' problems (pp, vpp, placement, pipeline) and what they rule out."""
        out: list[str] = []
        for name in ("pp", "vpp"):
            if not _positive(getattr(self, name)):
                out.append(f"{name}={getattr(self, name)!r} must be a positive integer")
        if out:
            return out
        if self.placement not in typing.get_args(Placement):
            out.append(f"placement={self.placement!r} is not one of {', '.join(typing.get_args(Placement))}")
        if isinstance(self.pipeline, PipelineSearch):
            out += self.pipeline.problems()
        else:
            out.append(f"pipeline={self.pipeline!r} must be a PipelineSearch")
        if self.pp == 1:
            if self.vpp > 1:
                out.append(f"vpp={self.vpp} needs pp >= 2: virtual stages are a pipeline's (give pp)")
            elif self.placement != "loop":
                out.append(f"placement={self.placement!r} needs pp >= 2 and vpp=2")
            elif isinstance(self.pipeline, PipelineSearch) and self.pipeline != PipelineSearch():
                out.append(f"pipeline={self.pipeline!r} searches a pipeline's order: it needs pp >= 2")
            return out
        stages = self.pp * self.vpp
        try:
            check_graph_size(stages=stages)
        except ConfigError as err:
            out.append(str(err))
        if self.placement == "v" and self.vpp != 2:
            out.append(f"placement='v' puts two stages on each rank: it needs vpp=2 (got vpp={self.vpp})")
        if isinstance(self.layers, int) and _positive(self.layers) and stages > self.layers:
            out.append(f"pp={self.pp} x vpp={self.vpp} = {stages} stages exceed layers={self.layers}: each stage "
                       f"holds at least one layer (pp x vpp <= layers)")
        if is_module(self.model):
            out.append(f"pp={self.pp} needs a registry model or ModelConfig (a module's pipeline runs through "
                       "moegraph.runtime.pipeline.compile_stages)")
        if self.schedule in STEP_METHODS:
            out.append(f"schedule={self.schedule!r} is a merged step's baseline; with pp={self.pp} the stage-level "
                       f"baselines are torch's generated schedules (schedule prices each unit: {', '.join(METHODS)})")
        if self.edges == "none" or isinstance(self.edges, ModelEdges) and self.edges.vocab is None:
            out.append(f"edges={self.edges!r}: with pp={self.pp} the embedding and head are priced with their stages; "
                       "give edges='auto' or ModelEdges(vocab)")
        if self.comm_streams != 1:
            out.append(f"comm_streams={self.comm_streams!r}: with pp={self.pp} each unit is priced on one comm "
                       "stream (comm_streams=1)")
        if self.launch_order != "free":
            out.append(f"launch_order={self.launch_order!r}: with pp={self.pp} each unit is priced with a hardware "
                       "queue per stream (launch_order='free')")
        return out

    def replace(self, **changes: Any) -> "CompileConfig":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


def config_layers(config: CompileConfig, model: ModelConfig) -> int:
    """The decoder layers ``config`` compiles of ``model`` ('all' resolved), ConfigError when they
    do not fit it: at most its MoE layers (a stack of identical layers; 'all' = all of them; a
    Hugging Face config's 'all' is every layer, its kinds mixed: ``ModelConfig.all_layers``); with
    pp > 1 at most all of its layers, its dense first layers included ('all' = the whole model),
    and at least one per stage. ``model`` is the loaded ModelConfig ``config.model`` names."""
    if config.pp > 1:
        layers = model.layers if config.layers == "all" else config.layers
        stages = config.pp * config.vpp
        if layers > model.layers:
            raise ConfigError(f"layers={layers} must be at most {model.name}'s {model.layers} layers (with pp, its "
                              "dense first layers included), or 'all'")
        if stages > layers:
            raise ConfigError(f"pp={config.pp} x vpp={config.vpp} = {stages} stages exceed the {layers} layers of "
                              f"{model.name}'s pipeline: each stage holds at least one layer (pp x vpp <= layers)")
        return layers
    layers = model.all_layers if config.layers == "all" else config.layers
    if not model.stackable(layers):
        raise ConfigError(f"layers={layers!r} must be between 1 and {model.layers_phrase()}")
    return layers


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def is_module(value: Any) -> bool:
    """Whether ``value`` is a torch ``nn.Module`` (without importing torch: a module exists only
    once torch is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.nn.Module)


__all__ = ["CompileConfig", "Edges", "LAUNCH_ORDERS", "LaunchOrder", "METHODS", "Method", "ModelEdges", "ModelSource",
           "PipelineSearch", "Placement", "RECORDED", "STEP_METHODS", "SolverEffort", "StepMethod", "config_layers",
           "is_module"]
