"""`moegraph run --pp P`: the pipeline step compiled by the driver, trained on P x n x dp local ranks.

Notation: P pipeline ranks, V stages per rank, n ranks per stage group, dp replicas, M
micro-batches of b rows, s sequence, V_ocab the vocabulary.

The parent turns the flags into one ``CompileConfig`` (``config_from_args`` with pp, vpp,
placement and ``PipelineSearch(runnable=True)``: every backward whole, what compiled stages
run) and compiles it once with the driver (``moegraph.schedules.driver.build``: the stages
balanced, the order CP-SAT's or the best torch schedule's), writes the order as torch's action
CSV and spawns P x n x dp gloo ranks (``pipeline_rank``, moegraph.passes.stages' rank order).
Each rank builds the seeded ``MoETransformer`` (``--layers``, ``--vocab``; with the router's
aux loss when the model has one), compiles its stages with the config's strategy, passes,
hardware and schedule method (``runtime.pipeline.compile_stages``, with the merged F&B plans of
the order's pairs, of one stage or of two), and trains warm-up + K AdamW steps in torch's
``_PipelineScheduleRuntime`` (``TorchPipeline``), replica d on its M micro-batches of each
step's global batch, the gradients averaged over the replicas (``CompiledStage.sync_grads``). A
step's time is the slowest rank's; the report gives the median over the K steps beside the
driver's predicted step. ``--check``: the last rank trains the eager model alike (gradient
accumulation over the global batch's dp x M micro-batches) and compares every micro-batch loss.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moegraph.config import CompileConfig, ModelEdges
from moegraph.interpreter import axis_of
from moegraph.ir import ConfigError
from moegraph.strategy import node_fields

__all__ = ["PipelineRun", "pipeline_rank", "run_pipeline", "format_pipeline_report"]


@dataclass(frozen=True)
class PipelineRun:
    """What a pipeline rank needs (``pipeline_rank``); picklable."""

    model: Any                    # registry ModelConfig
    layers: int
    vocab: int
    config: CompileConfig
    stages: tuple[tuple[int, ...], ...]
    placement: str
    csv: str                      # the order, torch's action CSV
    steps: int
    warmup: int
    seed: int
    check: bool
    timeout_s: float


def pipeline_rank(rank: int, world: int, spec: PipelineRun) -> dict[str, Any]:
    """One of the P x n ranks (module docstring): this rank's step times, and on the last stage's
    ranks each measured step's micro-batch losses (and with ``check`` eager's)."""
    import torch
    import torch.distributed as dist

    from moegraph.models import MoETransformer
    from moegraph.passes.stages import StageLayout
    from moegraph.passes.stages import rank_coords
    from moegraph.runtime.pipeline import ShardLoss, TorchPipeline, compile_stages, pipeline_group
    from moegraph.schedules.pipeline import Pair
    from moegraph.schedules.pipeline_torch import read_csv
    cfg, st = spec.config, spec.config.strategy
    n, dp = st.n, st.dp
    layout = StageLayout(spec.stages, world // (n * dp), spec.placement)
    _, replica, member = rank_coords(rank, n=n, dp=dp)
    torch.manual_seed(spec.seed)
    model = MoETransformer.from_config(spec.model, layers=spec.layers, vocab=spec.vocab).to(
        {"fp32": torch.float32, "bf16": torch.bfloat16}[st.dtype])
    M, b = cfg.micro_batches, cfg.batch
    gen = torch.Generator().manual_seed(spec.seed + 1)
    # the global batch [dp*M*b, s] of each step; replica d trains rows d*M*b .. (d+1)*M*b - 1
    data = [torch.randint(0, spec.vocab, (dp * M * b, cfg.seq), generator=gen) for _ in range(spec.warmup + spec.steps)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "order.csv"
        path.write_text(spec.csv)
        paired = [i for row in read_csv(path) for i in row if isinstance(i, Pair)]
        cross = sorted({(i.forward.stage, i.backward.stage) for i in paired if i.forward.stage != i.backward.stage})
        mine = compile_stages(model, layout, data[0][:b], n=n, hardware=cfg.hardware, attn=st.attn, ffn=st.ffn,
                              dispatch=st.dispatch, passes=cfg.passes, schedule=cfg.schedule,
                              time_limit_s=cfg.solver.time_limit_s, timeout_s=spec.timeout_s, pairs=bool(paired), dp=dp,
                              cross_pairs=cross, ep_nodes=st.ep_nodes, attn_nodes=st.attn_nodes)
        aux = next(iter(mine.values())).aux_loss
        pipe = TorchPipeline(mine, layout, path, micro_batches=M, loss_fn=ShardLoss.for_stages(member, mine, aux),
                             group=pipeline_group(layout.pp, n, dp), static={k: m.io_examples() for k, m in mine.items()})
    last = len(spec.stages) - 1 in mine
    opt = torch.optim.AdamW([p for m in mine.values() for p in m.parameters()], lr=1e-4)
    seconds, losses = [], []
    for k, batch in enumerate(data):
        ids = batch[replica * M * b:(replica + 1) * M * b]
        t0 = time.perf_counter()
        opt.zero_grad()
        terms = pipe.step(ids if 0 in mine else None, ids if last else None)
        for m in mine.values():
            m.sync_grads()
        opt.step()
        seconds.append(time.perf_counter() - t0)
        if last and k >= spec.warmup:
            total = torch.stack([t.detach() for t in terms])
            if n > 1:                               # the n ranks' terms sum to each micro-batch's loss
                dist.all_reduce(total, group=next(iter(mine.values())).layers.executor.comm.mp_group)
            losses.append(total.tolist())
    out: dict[str, Any] = {"seconds": seconds[spec.warmup:], "losses": losses, "merged_pairs": pipe.merged_pairs,
                           "replica": replica, "axes": sorted({axis_of(nd) for m in mine.values()
                                                               for nd in m.layers.graph.nodes if nd.is_comm})}
    if spec.check and rank == world - 1:       # the eager model over the global batch, once
        from moegraph.runtime.check import eager_accumulate
        eager = torch.optim.AdamW(model.parameters(), lr=1e-4)   # compile_stages copied the weights: model is at init
        want = []
        for ids in data:
            eager.zero_grad()
            want.append(eager_accumulate(model, list(zip(ids.chunk(dp * M), ids.chunk(dp * M)))))
            eager.step()
        out["eager_losses"] = want[spec.warmup:]
    return out


def run_pipeline(config: CompileConfig, *, steps: int, warmup: int, seed: int, check: bool, timeout_s: float,
                 t0: float | None = None) -> dict[str, Any]:
    """``run --pp`` (module docstring) of a pipeline ``config`` (pp > 1, its pipeline search
    ``runnable``, its edges ``ModelEdges(vocab)``): compiled by the driver, the ranks spawned;
    the report."""
    from moegraph.runtime.device_memory import check_rank_memory
    from moegraph.runtime.launch import spawn
    from moegraph.runtime.timing import progress
    from moegraph.schedules.driver import build, load_config_model
    from moegraph.schedules.pipeline import Pair
    from moegraph.schedules.pipeline_torch import csv_text
    if config.pp < 2 or not config.pipeline.runnable or not isinstance(config.edges, ModelEdges):
        raise ConfigError(f"run_pipeline runs a pipeline config (pp={config.pp} >= 2) whose order compiled stages run "
                          "(pipeline=PipelineSearch(runnable=True)) and whose edges give the vocabulary (ModelEdges)")
    vocab, n, dp = config.edges.vocab, config.strategy.n, config.strategy.dp
    model, layers = load_config_model(config)
    world = config.pp * n * dp
    check_rank_memory(model, layers, world, what=f"--pp {config.pp} x --n {n} x --dp {dp} = {world} gloo ranks")
    compiled = build(config)
    layout = compiled.built.problem.layout
    orders = compiled.orders
    pairs = sum(isinstance(i, Pair) for row in orders for i in row)
    progress(t0, f"compiled: {compiled.result.source} order, stages {[list(s) for s in layout.stages]}, {pairs} F&B pairs; "
                 f"starting {world} gloo ranks (each compiles its stages)")
    spec = PipelineRun(model, layers, vocab, config, layout.stages, layout.placement, csv_text(orders), steps, warmup,
                       seed, check, timeout_s)
    results = spawn(pipeline_rank, world, args=(spec,), timeout_s=timeout_s * 4 + 300, pg_timeout_s=timeout_s)
    steps_s = [max(r["seconds"][k] for r in results) for k in range(steps)]
    tl = compiled.timeline
    # each replica's M losses per step (its last stage's ranks: the same after their all-reduce), replica-major
    lasts = [next(r for r in results if r["losses"] and r["replica"] == d) for d in range(dp)]
    losses = [[x for r in lasts for x in r["losses"][k]] for k in range(steps)]
    report: dict[str, Any] = {
        "model": model.name, "layers": layers, "vocab": vocab, "hardware": compiled.cost.hw.name,
        "pp": config.pp, "vpp": config.vpp, "placement": layout.placement, "n": n, "dp": dp, "world": world,
        "strategy": compiled.lowered.layers[-1].strategy.as_dict(),        # as lowered: its passes' labels
        "axes": sorted({a for r in results for a in r["axes"]}), "stages": [list(s) for s in layout.stages],
        "micro_batches": config.micro_batches, "batch": config.batch,
        "seq": config.seq, "schedule": config.schedule, "order": compiled.result.source, "order_hash": compiled.hash,
        "f_b_pairs": pairs, "pairs": [str(i) for row in orders for i in row if isinstance(i, Pair)], "merged_pairs": sum(r["merged_pairs"] for r in results) // (n * dp),
        "predicted_step_us": round(tl.makespan * compiled.built.problem.tick_us, 1),
        "steps": steps, "warmup": warmup, "step_us": round(statistics.median(steps_s) * 1e6, 1),
        "step_us_all": [round(x * 1e6, 1) for x in steps_s], "losses": losses}
    if check:
        want = results[-1]["eager_losses"]
        errs = [abs(g - w) / abs(w) for gs, ws in zip(losses, want, strict=True) for g, w in zip(gs, ws, strict=True)]
        report |= {"eager_losses": want, "max_rel_err_loss": max(errs)}
    return report


def format_pipeline_report(r: dict[str, Any]) -> str:
    """``run --pp``'s text report (``--json`` prints the dict itself)."""
    lines = [f"{r['model']} ({r['layers']} layers, vocab {r['vocab']}) on {r['hardware']}: pp={r['pp']} vpp={r['vpp']} "
             f"{r['placement']} x n={r['n']}{node_fields(r['strategy'])} x dp={r['dp']} = {r['world']} gloo ranks, "
             f"stages {r['stages']}, "
             f"M={r['micro_batches']} x b={r['batch']} s={r['seq']}",
             f"order {r['order']} ({r['order_hash'][:12]}), {r['f_b_pairs']} F&B pairs {' '.join(r['pairs'])} "
             f"({r['merged_pairs']} run as merged F&B plans), stage layers scheduled by {r['schedule']}",
             f"step time: median {r['step_us'] / 1e3:.3f} ms over {r['steps']} steps after {r['warmup']} warm-up, "
             f"predicted {r['predicted_step_us'] / 1e3:.3f} ms",
             "losses (mean over micro-batches): " + ", ".join(f"{sum(x) / len(x):.4f}" for x in r["losses"])]
    if "max_rel_err_loss" in r:
        lines.append(f"check vs eager gradient accumulation: max rel err loss {r['max_rel_err_loss']:.2e}")
    return "\n".join(lines)
