"""The driver: one ``CompileConfig`` -> trace -> passes -> schedule, composed here and nowhere else.

    from moegraph.schedules.driver import build
    compiled = build(CompileConfig(model="mixtral-8x7b", strategy=Strategy("sp", "ep", "ag-rs", 8)))
    compiled.graph, compiled.schedule, compiled.report

``lower(config)`` traces the model source and runs the pass pipeline (the config's own passes,
and the model-level rewrites its fields ask for: the stack of ``layers``, the merge of
``micro_batches``, the causal LM's edges), in the pass manager's stage order. ``build(config)``
schedules what ``lower`` gives. Every front door calls them: each CLI command, ``tune`` per
candidate, calibration per measured layer, ``moegraph.compile``, and the runtime's layer and
model compilation (which then get an execution plan of ``compiled.schedule``, never options).

Why here: the driver reaches the tracer (``moegraph``), the passes and the scheduler, so this
stage (``schedules``) is the earliest that may import all three at module level without a
backward import (tests/test_layering.py); the runtime imports it forward, and the front doors in
``moegraph`` (the CLI, ``moegraph.compile``) import it lazily, as they import every later stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moegraph.config import RECORDED, CompileConfig, ModelEdges, is_module
from moegraph.cost import CostModel
from moegraph.ir import ConfigError, Graph
from moegraph.lowering import ModelSpec, has_model_rule
from moegraph.passes import AddEdges, MergeMicroBatches, StackLayers, rewrite_as, run_pipeline
from moegraph.passes.strategy import lowering_strategy
from moegraph.registry import Hardware, ModelConfig, load_hardware, load_model
from moegraph.schedules.api import CompileResult, compile_graph
from moegraph.schedules.problem import DEFAULT_COMM_STREAMS
from moegraph.schedules.schedule_file import Schedule
from moegraph.tracer import trace_causal_lm, trace_model, trace_module

__all__ = ["Compiled", "Lowered", "build", "comm_stream_names", "load_config_model", "lower"]

COMM_STREAMS = {1: DEFAULT_COMM_STREAMS, 2: ("comm.intra", "comm.inter")}
"""``CompileConfig.comm_streams`` -> the scheduler's stream names (docs/scheduler.md)."""


@dataclass(frozen=True)
class Lowered:
    """A config's graph after its passes: what ``lower`` returns and ``build`` schedules."""

    config: CompileConfig
    graph: Graph
    report: dict[str, Any]
    """What the user's passes chose and predicted (``moegraph.passes.run_pipeline``'s report)."""
    model: ModelConfig | None
    """The registry model (None for a module source)."""
    hardware: Hardware
    cost: CostModel
    spec: ModelSpec | None = None
    """A causal LM module's parts around its layers (embedding, final norm, head), else None."""


@dataclass(frozen=True)
class Compiled:
    """A config's compiled artefact: its graph, its schedule and what was decided on the way."""

    lowered: Lowered
    result: CompileResult = field(repr=False)

    @property
    def config(self) -> CompileConfig:
        return self.lowered.config

    @property
    def graph(self) -> Graph:
        return self.lowered.graph

    @property
    def schedule(self) -> Schedule:
        return self.result.schedule

    @property
    def report(self) -> dict[str, Any]:
        """The passes' report, and the schedule's source and status."""
        return {"passes": self.lowered.report, "source": self.result.source, "status": self.result.status}

    @property
    def cost(self) -> CostModel:
        return self.lowered.cost


SCHEDULING_FIELDS = ("schedule", "memory_budget", "solver", "comm_streams", "launch_order")
"""The CompileConfig fields ``build`` reads and ``lower`` does not."""


def _lowering_part(config: CompileConfig) -> CompileConfig:
    default = CompileConfig(model=config.model)
    return dataclasses.replace(config, **{f: getattr(default, f) for f in SCHEDULING_FIELDS})


def comm_stream_names(config: CompileConfig) -> tuple[str, ...]:
    return COMM_STREAMS[config.comm_streams]


def load_config_model(config: CompileConfig) -> tuple[ModelConfig, int]:
    """The registry model a config names (its top-k override applied) and its layer count
    ('all' resolved); ConfigError when either does not fit the model."""
    model = config.model if isinstance(config.model, ModelConfig) else load_model(config.model)
    if config.top_k is not None:
        if not 1 <= config.top_k <= model.experts:
            raise ConfigError(f"top_k={config.top_k} must be between 1 and the expert count {model.experts} "
                              f"of {model.name}")
        model = dataclasses.replace(model, top_k=config.top_k)
    layers = model.all_layers if config.layers == "all" else config.layers
    if not model.stackable(layers):
        raise ConfigError(f"layers={layers!r} must be between 1 and {model.layers_phrase()}")
    return model, layers


def lower(config: CompileConfig) -> Lowered:
    """Trace ``config.model`` for ``config.strategy`` and run the pipeline (module docstring).

    The pipeline: the stack of L layers first (the user's passes rewrite its layer once and
    restack it), the user's passes, the merge of M micro-batches, the edges last (per
    micro-batch, after compress=dp-bf16 chose their wire format): the pass manager's stage
    table (moegraph.passes.manager)."""
    hw = config.hardware if isinstance(config.hardware, Hardware) else load_hardware(config.hardware)
    cost = CostModel(hw)
    recorded = config.passes == RECORDED
    traced_for = lowering_strategy(config.strategy) if recorded else config.strategy
    model, spec, edges = None, None, None
    if is_module(config.model):
        if isinstance(config.edges, ModelEdges):
            raise ConfigError(f"edges={config.edges!r}: a module brings its own edges (a causal LM's head) or has "
                              "none (a layer); leave edges='auto'")
        name = type(config.model).__name__
        if has_model_rule(config.model):            # a causal LM: its layers, stacked, with its edges
            graph, spec = trace_causal_lm(config.model, traced_for, batch=config.batch, seq=config.seq, name=name)
            layers = len(config.model.get_submodule(spec.layers))
            vocab = config.model.get_parameter(spec.head).shape[0] if spec.head is not None else None
            if config.micro_batches > 1 and vocab is None:
                raise ConfigError(f"micro_batches={config.micro_batches}: {name} is a base model without an LM "
                                  "head; a merged step trains a causal LM (its loss seeds each micro-batch's backward)")
            edges = AddEdges(vocab, aux=spec.aux_loss) if config.edges == "auto" else None
        else:                                       # one decoder layer
            graph, layers = trace_module(config.model, traced_for, batch=config.batch, seq=config.seq, name=name), 1
    else:
        model, layers = load_config_model(config)
        graph = trace_model(model, traced_for, batch=config.batch, seq=config.seq, layers=layers)
        if isinstance(config.edges, ModelEdges):
            edges = AddEdges(config.edges.vocab)
        elif config.edges == "auto" and layers > 1:     # a model step at the registry's default vocabulary
            from moegraph.models import VOCAB           # torch-bearing module: only when a stack needs it
            edges = AddEdges(VOCAB)
    stack = (StackLayers(layers),) if layers > 1 else ()
    step = ((MergeMicroBatches(config.micro_batches),) if config.micro_batches > 1 else ()) + \
        ((edges,) if edges is not None else ())
    if recorded:        # the strategy's own rewrites, its labels kept as the record (rewrite_as)
        graph, _ = run_pipeline(graph, stack, cost=cost)
        graph, report = rewrite_as(graph, config.strategy, cost)
        graph, _ = run_pipeline(graph, step, cost=cost)
    else:
        graph, report = run_pipeline(graph, stack + config.passes + step, cost=cost)
    return Lowered(config, graph, report, model, hw, cost, spec)


def build(config: CompileConfig, *, lowered: Lowered | None = None) -> Compiled:
    """``config`` compiled: ``lower(config)``, scheduled by ``config.schedule`` under its memory
    budget, solver effort and launch order (``moegraph.schedules.api.compile_graph``). ``lowered``: the
    config's ``lower`` result when the caller already has it (tune keys its cache by the graph
    before it schedules): lowered from a config that differs from this one at most in how it is
    scheduled (``SCHEDULING_FIELDS``)."""
    if lowered is None:
        lowered = lower(config)
    elif _lowering_part(lowered.config) != _lowering_part(config):
        raise ValueError("build(config, lowered=...): the lowered graph was built from a config that lowers "
                         "differently (only schedule, memory_budget, solver, comm_streams and launch_order may differ)")
    lowered = dataclasses.replace(lowered, config=config)
    result = compile_graph(lowered.graph, lowered.cost, memory_budget_bytes=config.memory_budget,
                           time_limit_s=config.solver.time_limit_s, workers=config.solver.workers,
                           comm_streams=comm_stream_names(config), method=config.schedule,
                           launch_order=config.launch_order)
    return Compiled(lowered, result)

