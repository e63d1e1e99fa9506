"""The public entry points: ``moegraph.compile`` and ``moegraph.trace``.

``compile(config)`` is the compiler: a ``CompileConfig`` in, its graph, schedule and report out
(``moegraph.schedules.driver.build``, the one driver every front door calls).
``compile(module, example_inputs, ...)`` also runs it: the module compiled by the driver, then
sharded for this rank as an ``nn.Module`` (moegraph.runtime). ``trace(config)`` stops before the
schedule: the graph after the passes.

These are the pipeline's front door, so (like the CLI) they may reach the later stages, but only
lazily inside the functions: importing moegraph stays light and library imports flow forward.
"""

from __future__ import annotations

from typing import Any

from moegraph.config import CompileConfig, SolverEffort
from moegraph.ir import Strategy
from moegraph.pass_steps import DEFAULT_PASSES, PassStep, parse_passes

COMPILE_KEYWORDS = ("hardware", "attn", "ffn", "dispatch", "passes", "memory_budget", "schedule", "time_limit_s", "dp",
                    "micro_batches", "ep_nodes", "attn_nodes")
"""The keywords ``compile(module, ...)`` turns into its CompileConfig (the others run the module)."""


def trace(config: CompileConfig) -> Any:
    """The graph ``config`` describes after its passes (``moegraph.schedules.driver.lower``):
    ``.graph``, ``.report`` (what the passes chose), ``.model``, ``.hardware``, ``.cost``."""
    from moegraph.schedules.driver import lower
    return lower(_config(config))


def compile(source: Any, example_inputs: Any = None, *, config: CompileConfig | None = None,  # noqa: A001
            hardware: Any = "h800", attn: str = "sp", ffn: str = "ep", dispatch: str = "ag-rs",
            passes: str | tuple[PassStep, ...] = DEFAULT_PASSES, memory_budget: int | None = None,
            schedule: Any = "cpsat", n: int | None = None, timeout_s: float = 300.0, time_limit_s: float = 10.0,
            record: bool = True, dp: int = 1, cuda_graphs: str = "off", expert_rows: str = "exact",
            micro_batches: int = 1, ep_nodes: int = 1, attn_nodes: int = 1) -> Any:
    """Compile a ``CompileConfig`` into its graph, schedule and report, or one MoE decoder layer
    or a whole causal LM into a sharded ``nn.Module`` for this rank.

    ``compile(config)``: returns ``moegraph.schedules.driver.Compiled`` (``.graph``, ``.schedule``,
    ``.report``); with ``config.pp`` > 1 a ``CompiledPipeline`` (``.timeline``, ``.memory()``,
    ``.hash``, ``.write_csv(path)``; docs/pipeline.md); nothing runs. The other arguments do not
    apply.

    ``compile(module, example_inputs, ...)``: the compile options as keywords (below) or as one
    ``config=CompileConfig(...)`` (its strategy, passes, schedule, memory budget, solver effort,
    hardware, micro-batches; its model, n, batch, seq and dtype come from the module, the world
    and the input), not both.

    module:          the eager layer (the project's MoETransformerLayer, or transformers'
                     MixtralDecoderLayer, ...), or a causal LM (moegraph.models.MoETransformer,
                     transformers' MixtralForCausalLM or MixtralModel); its parameters are read once
                     and sharded.
    example_inputs:  a layer: the *full* layer input [b, s, h] (or a tuple starting with it): gives
                     b, s and the dtype (fp32 or bf16); its values are not used. A model: the token
                     ids [b, s] (integer): returns a moegraph.runtime.model.CompiledModel, called
                     like the original on every rank (``model(input_ids, labels).loss``).
                     With dp > 1 the global input: [dp*b, s, h] for a layer, token ids [dp*b, s]
                     for a model (called with the global input_ids / labels on every rank): b rows
                     per replica.
    hardware:        registry name, YAML path or Hardware: the cost model the scheduler uses.
    attn/ffn/dispatch: the parallel strategy (``moegraph.Strategy``).
    passes:          the pass pipeline: typed steps (``moegraph.pass_steps``, default
                     ``DEFAULT_PASSES``: gate-reorder, sar=paper), () for none; or its text form
                     ("gate-reorder,sar=paper"; "" or "none" for none), as ``moegraph trace --passes``.
    memory_budget:   bytes of activation memory the schedule may use (None: unbounded).
    schedule:        'cpsat' | 'sequential' | 'greedy' | 'megascale' (moegraph.schedules methods),
                     or a Schedule / ExecutionPlan (the graph is lowered, the plan taken as given).
    n:               group size; default and only supported value: the world size of the default
                     process group (1 without torch.distributed).
    timeout_s:       how long any collective may take before a CollectiveTimeout names it.
    time_limit_s:    CP-SAT's search effort in deterministic seconds.
    ep_nodes:        nodes N the n ranks span for the expert all-to-all (dispatch='a2a'): N > 1
                     sends each token once per destination node and forwards it within the node
                     (Strategy.ep_nodes; rank r on node r // (n/N)).
    attn_nodes:      nodes N the attention is data-parallel over (dispatch='a2a'): N > 1 runs it TP/SP
                     on the n/N ranks of each node, on b/N of the batch (Strategy.attn_nodes); the
                     module then takes and returns rank r's tokens [b/N, s/(n/N), h]
                     (``.shard_input``, ``moegraph.token_layout``).
    dp:              data-parallel replicas D: the world holds n x D ranks, replica-major (rank
                     p*n + r is rank r of replica p); parameter gradients come back averaged over
                     the replicas (docs/runtime.md, "Data parallelism"); a whole model's come back
                     as eager's on the global batch (its loss is the global token mean).
    cuda_graphs:     'off' (default) | 'attention' | 'layer': replay CUDA graphs of a layer's
                     static-shape segments (moegraph.runtime.cudagraph; docs/runtime.md, "CUDA
                     graphs"): 'attention' the static prefix and suffix of each phase (the
                     attention block with its collectives), 'layer' whole phases (refused, naming
                     the node, where routing makes shapes data-dependent). CUDA devices only; a
                     layer only (ValueError otherwise); no per-node traces.
    expert_rows:     'exact' (default) | 'padded': rows of the local index map of ffn='ep' with
                     dispatch='ag-rs' (moegraph.kernels.build_index_map). 'exact' sizes the expert
                     buffers by this step's R routed rows (one host read per map); 'padded' by the
                     static worst case C = T * min(k, E/n) >= R, still dropless (same numerics), no
                     host read, so cuda_graphs='layer' captures ffn=ep under ag-rs; costs C/R x the
                     expert-row memory (``moegraph.kernels.padded_rows_extra_bytes``). A layer with a
                     local index map only (ValueError otherwise).
    micro_batches:   a whole causal LM only: M >= 2 compiles ONE merged step plan of M
                     micro-batches (gradient accumulation; example_inputs is one micro-batch's
                     token ids), run by ``compiled.train_step(input_ids_list, labels_list)``: the M
                     forwards and backwards in the schedule's order, with the edges (embedding,
                     final norm, head, loss) per micro-batch. It returns the M losses and adds the
                     gradient of their MEAN (eager's ``(loss / M).backward()`` per micro-batch) to
                     every ``.grad``. 1 (default): an ordinary compiled model or layer.

    Collective: every rank must call it with the same arguments; ranks compare plan hashes and
    raise ScheduleMismatch (naming the differing ranks) instead of hanging. The returned module
    takes and returns this rank's sequence shard [b, s/n, h]; see ``.shard_input``,
    ``.unshard_output`` and ``.full_grads``. ``loss.backward()`` runs the scheduled backward and
    leaves gradients in the shards' ``.grad``.
    """
    if isinstance(source, CompileConfig):
        if example_inputs is not None or config is not None:
            raise ValueError("compile(config) compiles the config alone: give no example_inputs or config=; to "
                             "compile a module, compile(module, example_inputs, config=...)")
        from moegraph.schedules.driver import build
        return build(source)
    return _compile_module(source, example_inputs, config, locals())


def _config(config: Any) -> CompileConfig:
    if not isinstance(config, CompileConfig):
        raise ValueError(f"{config!r} is not a moegraph.CompileConfig")
    return config


def _compile_module(module: Any, example_inputs: Any, config: CompileConfig | None, given: dict[str, Any]) -> Any:
    """``compile(module, example_inputs, ...)``: the checks that need the module and its input,
    then the runtime's compilation of a layer or a causal LM."""
    import inspect

    import torch

    from moegraph.lowering import has_model_rule
    from moegraph.runtime.options import RuntimeOptions
    defaults = {k: p.default for k, p in inspect.signature(compile).parameters.items()}
    changed = [k for k in COMPILE_KEYWORDS if given[k] is not defaults[k] and given[k] != defaults[k]
               and not (k == "schedule" and not isinstance(given[k], str))]    # a given plan goes with a config
    if config is not None and changed:
        raise ValueError(f"compile(module, ..., config=...) takes the compile options from the config; "
                         f"{', '.join(changed)} given as well")
    if config is not None and not isinstance(config, CompileConfig):
        raise ValueError(f"config={config!r} must be a moegraph.CompileConfig")
    n = given["n"]
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n={n!r} must be a positive integer (one replica's ranks; default the world size / dp)")
    if config is not None:      # what the module brings itself: a config's own value would be dropped
        own = {k: v for k, v, default in (("top_k", config.top_k, None), ("layers", config.layers, 1),
                                          ("edges", config.edges, "auto")) if v != default}
        if own:
            raise ValueError(f"compile(module, ..., config=...): the config sets "
                             f"{', '.join(f'{k}={v!r}' for k, v in own.items())}, which a module brings itself (its "
                             "layers, top-k and head): leave them at their defaults")
    options = RuntimeOptions(timeout_s=given["timeout_s"], record=given["record"], cuda_graphs=given["cuda_graphs"],
                             expert_rows=given["expert_rows"])
    schedule = given["schedule"]
    plan_given = None if isinstance(schedule, str) else schedule
    if config is None:
        passes = given["passes"]
        # n is the world's (compile_module sets it); a node-spanning dispatch is checked against it now
        nodes, attn_nodes = given["ep_nodes"], given["attn_nodes"]
        n = 1 if nodes == attn_nodes == 1 else (given["n"] or _world_size() // max(given["dp"], 1))
        config = CompileConfig(
            model=module, strategy=Strategy(given["attn"], given["ffn"], given["dispatch"], n, dp=given["dp"],
                                            ep_nodes=nodes, attn_nodes=attn_nodes),
            passes=parse_passes(passes) if isinstance(passes, str) else passes,
            schedule=schedule if plan_given is None else "cpsat", memory_budget=given["memory_budget"],
            micro_batches=given["micro_batches"], hardware=given["hardware"],
            solver=SolverEffort(given["time_limit_s"]))
    from moegraph.schedules.schedule_file import Schedule
    if isinstance(plan_given, Schedule):   # as `run --schedule FILE` takes a file: it verifies and fits the budget
        from moegraph.runtime.schedule_check import check_schedule_file   # (compiled_plan: the same graph)
        check_schedule_file(plan_given, "<the given schedule>", config.memory_budget)
    if isinstance(getattr(module, "_orig_mod", None), torch.nn.Module):   # torch.compile's OptimizedModule
        raise ValueError(f"{type(module).__name__} wraps {type(module._orig_mod).__name__} (torch.compile): "
                         "moegraph compiles the original module; pass it (compiled._orig_mod, or the module you "
                         "gave torch.compile)")
    x = example_inputs[0] if isinstance(example_inputs, (tuple, list)) else example_inputs
    if has_model_rule(module) and not (isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point()):
        raise ValueError(f"{type(module).__name__} is a whole model: example_inputs must be its token ids [b, s] "
                         f"(an integer tensor), got {getattr(x, 'dtype', type(x).__name__)} "
                         f"{list(getattr(x, 'shape', []))}")
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dim() != 2:
        raise ValueError(f"example_inputs is an integer tensor {x.dtype} {list(x.shape)}: a layer "
                         f"({type(module).__name__}) takes its floating input [b, s, h] (fp32 or bf16), a whole "
                         "model its integer token ids [b, s]")
    if isinstance(x, torch.Tensor) and not x.is_floating_point():
        if options.cuda_graphs != "off":
            raise ValueError(f"cuda_graphs={options.cuda_graphs!r} captures a compiled layer; a whole model "
                             f"({type(module).__name__}) runs uncaptured: use cuda_graphs='off'")
        if options.expert_rows != "exact":
            raise ValueError(f"expert_rows={options.expert_rows!r} applies to a compiled layer; a whole model "
                             f"({type(module).__name__}) runs with expert_rows='exact'")
        from moegraph.runtime.model import compile_model       # token ids: a whole causal LM
        return compile_model(module, x, config, options, n=given["n"], given=plan_given)
    if config.micro_batches != 1:
        raise ValueError(f"micro_batches={config.micro_batches!r} applies to a whole causal LM (token ids as "
                         f"example_inputs); a layer ({type(module).__name__}) compiles one micro-batch (its merged "
                         "step: the CLI's --micro-batches, moegraph.passes.microbatch.merge_microbatches)")
    from moegraph.runtime.module import compile_module
    return compile_module(module, example_inputs, config, options, n=given["n"], given=plan_given)


def _world_size() -> int:
    """The default process group's size (1 without torch.distributed)."""
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
