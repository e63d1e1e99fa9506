"""Fidelity: every published figure moegraph can predict, beside its prediction (issue 29 item 5).

    .venv/bin/python benchmarks/fidelity.py              # all figures (Table 5's CP-SAT and pipeline: ~30 s)
    .venv/bin/python benchmarks/fidelity.py --fast       # without Table 5

Each row: the figure, its setting, the paper's number, moegraph's, whether the number was USED
IN A FIT of hardware.yaml ("fit") or is HELD OUT ("held"), and the reason for any difference.
Held-out and fitted rows are summarised apart, and per figure. Per layer (b = 1, s = 8192, n = 8)
unless the row says otherwise; Table 5 is an iteration-level figure: its rows are given per layer
(one layer's forward + backward) and at iteration level, by the pipeline step model
(benchmarks/pipeline_table5.py: PP=15 V=2 Interleaved1F1B, dp=2, M=360, the layers priced by
their op-level schedules under this cost model).

Predictions: ``serial`` = the serial sum of node times (passes/estimate.py, what dispatch=auto
uses, and MegaScale-MoE's "other optimizations disabled"); ``cpsat`` = the scheduled layer. The
launch-order rows schedule a merged 2-micro-batch step (s = 4096) with the megatron-1f1b baseline,
with a hardware queue per stream and with one queue (moegraph.schedules.launch).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moegraph.cost import CostModel  # noqa: E402
from moegraph.ir import Node, OpKind, Phase, Role, Strategy, ValueKind  # noqa: E402
from moegraph.passes.estimate import serial_time_us  # noqa: E402
from moegraph.registry import load_hardware, load_model  # noqa: E402
from moegraph.tracer import trace_model  # noqa: E402

MODELS = ("internal-352b", "mixtral-8x7b", "mixtral-8x22b", "hunyuan-large", "phi-3.5-moe", "deepseek-moe")
N, B, S = 8, 1, 8192
ROWS: list[dict] = []


def row(fig: str, setting: str, paper: str, ours: str, status: str, reason: str, ok: bool | None = None) -> None:
    ROWS.append(dict(fig=fig, setting=setting, paper=paper, ours=ours, status=status, reason=reason, ok=ok))


def no_shapes(hw):
    """``hw`` with the compute shape curves off (GEMMs at gemm_eff whatever their shape)."""
    return hw.without_gemm_shapes()


class ShapelessCost(CostModel):
    """GEMMs and grouped GEMMs at their class efficiency whatever their shape: on a ``no_shapes``
    profile (no tile or small-K factor) and without the memory floor, so a narrow GEMM that its
    arithmetic intensity makes memory-bound (TP's f/n-wide experts) is priced by its FLOPs too.
    The GEMM-shape part of Fig 14 is the gain on the real model minus the gain on this one."""

    def __init__(self, hw):
        super().__init__(no_shapes(hw))

    def node_time_us(self, node, sm_budget=None):
        if node.op in (OpKind.GEMM, OpKind.GROUPED_GEMM):
            node = dataclasses.replace(node, mem_bytes=0)
        return super().node_time_us(node, sm_budget)


def graph(model, attn, ffn, dispatch, *, seq=S, **over):
    cfg = dataclasses.replace(load_model(model), **over) if over else load_model(model)
    return trace_model(cfg, Strategy(attn, ffn, dispatch, N), batch=B, seq=seq)


def ffn_comm_us(g, cost, tokens_only: bool = False) -> float:
    """The FFN block's collectives, forward and backward; ``tokens_only``: without ag-rs's routing
    all-gather (its top-k weights and ids, ``routing_ag``) and its backward reduce-scatter."""
    routing = {nd.name for nd in g.nodes if nd.op is OpKind.ALL_GATHER
               and all(g.value[o].kind is ValueKind.ROUTING for o in nd.outputs)} if tokens_only else set()
    return sum(cost.node_time_us(nd) for nd in g.nodes if nd.is_comm and nd.block == "ffn"
               and nd.name not in routing and nd.forward_of not in routing)


# --- MegaScale-MoE Fig 7: AG/RS vs A2A token dispatch by top-k ------------------------------------

def fig7(models=("mixtral-8x7b", "phi-3.5-moe", "mixtral-8x22b"), hws=("h800", "a100", "h20")) -> None:
    for hw_name in hws:
        cost = CostModel(load_hardware(hw_name))
        for model in models:
            crosses, routing_us = [], 0.0
            for tokens_only in (True, False):
                diffs = []
                for k in range(1, 9):
                    a, g = (graph(model, "sp", "ep", d, top_k=k, experts=max(8, load_model(model).experts))
                            for d in ("a2a", "ag-rs"))
                    diffs.append(ffn_comm_us(a, cost, tokens_only) - ffn_comm_us(g, cost, tokens_only))
                    routing_us = ffn_comm_us(g, cost) - ffn_comm_us(g, cost, True)      # at k = 8 when done
                crosses.append(next((k - 1 + (-diffs[k - 2]) / (diffs[k - 1] - diffs[k - 2]) for k in range(2, 9)
                                     if diffs[k - 2] < 0 <= diffs[k - 1]), None))
            cross, with_routing = crosses
            ours = f"top-k {cross:.2f}" if cross else "a2a faster up to top-k 8"
            paper = "top-k > 6 (Mixtral-8x7B, H800)" if (model, hw_name) == ("mixtral-8x7b", "h800") else "-"
            ok = None if paper == "-" else (cross is not None and 6 <= cross <= 8)
            row("Fig 7", f"{model} {hw_name} comm-time crossover", paper, ours, "held",
                "the token collectives' time, as Fig 7 compares AG, RS and A2A for token dispatch; "
                "a2a_eff_intra from DeepEP (0.765) and ring_eff_intra from MoNTA (0.794): the bytes ratio k/n "
                "crosses their ratio near k = 7.7; the paper's NCCL all-to-all is slower than DeepEP's kernel, "
                "which moves its crossover below 7. With ag-rs's routing all-gather (its top-k weights and ids, "
                f"latency-bound: fwd + bwd {routing_us:.0f} us at top-k 8) counted: "
                + (f"top-k {with_routing:.2f}" if with_routing else "a2a faster up to top-k 8"), ok)


# --- MegaScale-MoE Fig 14: SP+EP vs TP+TP -----------------------------------------------------------

def _serial(model, hw, attn, ffn, dispatch) -> float:
    return serial_time_us(graph(model, attn, ffn, dispatch), CostModel(hw))


FIG14_MICRO_BATCHES = 32
"""MegaScale-MoE §6.1, Fig 14: global batch 32 on one node of 8 GPUs (dp = 1): the gradient
all-reduces of replicated weights run once per 32 micro-batches (b = 1), not once per layer pass."""


def _serial_sync_amortized(model, hw, attn, ffn, dispatch, micro_batches=FIG14_MICRO_BATCHES,
                           cost_model=CostModel) -> float:
    """The serial sum with each weight-gradient all-reduce (the step-end sync) charged 1/micro_batches."""
    cost, g = cost_model(hw), graph(model, attn, ffn, dispatch)
    sync = sum(cost.node_time_us(nd) for nd in g.nodes if nd.op is OpKind.ALL_REDUCE and nd.role is Role.WGRAD)
    return serial_time_us(g, cost) - sync * (1 - 1 / micro_batches)


def fig14(models=MODELS, hw_name="h800-megascale") -> None:
    """Fig 14 at iteration level: one layer's serial sum (the paper disables every overlap) with the
    step-end weight-gradient all-reduce charged once per FIG14_MICRO_BATCHES micro-batches; the
    per-pass charge (every layer pass syncs) and the GEMM-shape part are given beside it."""
    hw = load_hardware(hw_name)
    for model in models:
        tp = _serial_sync_amortized(model, hw, "tp", "tp", "ag-rs")
        a2a, agrs = (_serial_sync_amortized(model, hw, "sp", "ep", d) for d in ("a2a", "ag-rs"))
        g = tp / min(a2a, agrs) - 1
        flat_g = (_serial_sync_amortized(model, hw, "tp", "tp", "ag-rs", cost_model=ShapelessCost)
                  / min(_serial_sync_amortized(model, hw, "sp", "ep", d, cost_model=ShapelessCost)
                        for d in ("a2a", "ag-rs")) - 1)
        per_pass = _serial(model, hw, "tp", "tp", "ag-rs") / min(_serial(model, hw, "sp", "ep", d)
                                                                  for d in ("a2a", "ag-rs")) - 1
        row("Fig 14", f"{model} {hw_name} SP+EP over TP+TP, iteration level", "14.9-32.9% (range over 6 models)",
            f"{g:+.1%} (a2a {tp / a2a - 1:+.1%}, ag-rs {tp / agrs - 1:+.1%}; GEMM shape {g - flat_g:+.1%}; "
            f"sync every pass {per_pass:+.1%})", "held",
            "communication volume (eq 1-4) plus TP's narrower expert GEMMs (the shape part: tiles, small K, and "
            "the memory-bound regime a narrow GEMM's arithmetic intensity puts it in; ShapelessCost), the sync once per "
            f"{FIG14_MICRO_BATCHES} micro-batches (global batch 32, dp = 1), compute at h800-megascale's Table-3 "
            "factor; the head and optimizer, shared by both, are ~2% of an iteration at the layer counts that fit "
            "80 GB. Above the range where TP's activation collectives (fixed by h) weigh most: 34.5% of a TP+TP "
            "layer for phi-3.5-moe (h_ffn 6400), 29.5% for deepseek-moe (h 2048, whose TP experts also permute all "
            "b*s*k rows on every rank), 20-26% for the others; the paper publishes only the range over its 6 models, "
            "not each model's value, its layer counts or Fig 14's sequence length (s = 8192 assumed). The shape "
            "part, measured: these layers' GEMMs take 0.96-1.40x as long under TP as under EP on an H200 (h200's "
            "shape factors: 1.02-1.28x) and 1.01-1.49x on an H100 (h100: 1.02-1.44x; deepseek-moe 1.49 / 1.44, "
            "phi-3.5-moe 1.08 / 1.10; benchmarks/fig14_gemms.py, held out), so TP's narrow experts are as slow as "
            "priced and do not explain the excess",
            0.149 - 0.03 <= g <= 0.329 + 0.03)


# --- MegaScale-MoE Fig 16: fused vs unfused pairs ----------------------------------------------------

def pair_factors(cost: CostModel, models=MODELS) -> list[tuple[str, str, float]]:
    """(model, fused kind, unfused / fused time) of each model's first forward pair of each kind
    that fuse=auto's candidates offer, SP+EP ag-rs (Fig 16's four pairs)."""
    from moegraph.passes.fuse import candidates
    out = []
    for model in models:
        g = graph(model, "sp", "ep", "ag-rs")
        seen = set()
        for cand in candidates(g, cost):
            if g.node[cand.anchor].phase is not Phase.FORWARD or cand.group.kind in seen:
                continue
            seen.add(cand.group.kind)
            p = cost.fused_price(cand.group)
            out.append((model, str(cand.group.kind), p.unfused_us / p.time_us))
    return out


def fig16(models=MODELS, hw_name="h800") -> None:
    factors = []
    for model, kind, f in pair_factors(CostModel(load_hardware(hw_name)), models):
        factors.append(f)
        row("Fig 16", f"{model} {hw_name} {kind}", "1.2-4.7x (range)", f"{f:.2f}x", "held",
            "tile pipeline: max(comm, compute) + one tile, scatter/gather/rope folded into the GEMM "
            "tiles; the unfused baseline pays its collective at the NCCL-like default budget and "
            "every member as its own kernel")
    if factors:
        lo, hi = min(factors), max(factors)
        row("Fig 16", f"span over {len(factors)} pairs", "1.2-4.7x", f"{lo:.2f}-{hi:.2f}x", "held",
            "operators priced alone on h800 (Fig 16 times the operators, not a step). A fused kernel costs at least "
            "max(comm, compute) plus one tile, so a pair gains at most (comm + compute) / max(comm, compute) <= 2x "
            "plus its folded scatter/gather; above 2x the paper's baseline must pay more than its kernels' own times "
            "(NCCL all-to-all at small per-peer sizes, launch gaps): no published H800 all-to-all size sweep gives "
            "that size (the intra-node half point is transferred from MoNTA's all-gather), and pricing the fused "
            "transfers without a call's fixed cost moves the pairs to 1.50-2.10x (RESULTS.md, 11:35); "
            "AG+scatter+GroupedGEMM is fused as the paper's kernel needs it: each rank routes its own tokens and "
            "the routing is gathered first (a small collective before the kernel, not in its price), so every "
            "tile's rows are known before the tokens arrive",
            lo <= 1.2 + 0.05 and hi >= 3.0)
    fig16_eager_baseline(models, hw_name)


EAGER_PROFILE = "nvidia-h200-2026-11-27"
"""The calibrated profile whose measured traffic factors (eager torch kernels on Hopper) price
the unfused baseline's memory-bound members in ``fig16_eager_baseline``."""


def fig16_eager_baseline(models=MODELS, hw_name="h800") -> None:
    """Fig 16's span with the unfused baseline's scatter, gather and rope priced as eager torch
    kernels: h800's profile with the traffic factors measured on the H200 (per op and role). The
    fused kernels fold those members into their GEMM tiles, so only the baseline changes."""
    traffic = load_hardware(EAGER_PROFILE).mem_op_traffic
    cost = CostModel(dataclasses.replace(load_hardware(hw_name), mem_op_traffic=traffic))
    by_kind: dict[str, list[float]] = {}
    for _, kind, f in pair_factors(cost, models):
        by_kind.setdefault(kind, []).append(f)
    factors = [f for fs in by_kind.values() for f in fs]
    if not factors:
        return
    per_kind = "; ".join(f"{k} {min(fs):.2f}-{max(fs):.2f}x" for k, fs in by_kind.items())
    row("Fig 16", f"span over {len(factors)} pairs, the unfused baseline's memory-bound members as eager torch "
        f"kernels ({hw_name} with {EAGER_PROFILE}'s traffic factors)", "1.2-4.7x",
        f"{min(factors):.2f}-{max(factors):.2f}x ({per_kind})", "held",
        "a transfer, not a fit: the factors are measured on an H200 (moegraph calibrate's layer graph: the "
        "weighted combine 17.6x ADD's traffic forward, rope 13.9x, a forward permute 0.75x) and Megatron-LM, "
        "on which the paper's baseline is built, permutes with the same torch gather/scatter kernels (its "
        "allgather dispatcher; MindSpeed documents their random-address cost). The pairs whose baseline "
        "runs the combine (GroupedGEMM+gather+RS) or rope (GEMM+A2A) pass 2x; the dispatch pairs do not "
        "(a forward index_select streams), so the span's top is the combine pair's",
        min(factors) <= 1.2 + 0.05 and max(factors) >= 3.0)


# --- MegaScale-MoE Table 5: per layer ---------------------------------------------------------------

def table5(model="internal-352b", hw_name="h800-megascale", time_limit=5.0) -> None:
    from moegraph.passes import run_pipeline
    from moegraph.schedules.api import compile_graph
    cost = CostModel(load_hardware(hw_name))
    base = serial_time_us(graph(model, "tp", "tp", "ag-rs"), cost)
    spep = {d: graph(model, "sp", "ep", d) for d in ("a2a", "ag-rs")}
    d_best = min(spep, key=lambda d: serial_time_us(spep[d], cost))
    s2 = serial_time_us(spep[d_best], cost)
    s3 = compile_graph(spep[d_best], cost, time_limit_s=time_limit).schedule.makespan_us
    fused, _ = run_pipeline(spep[d_best], "fuse=auto", cost=cost)
    s4 = compile_graph(fused, cost, time_limit_s=time_limit).schedule.makespan_us
    why = ("per layer, forward + backward, with interference (compute on the SMs and HBM collectives leave); "
           "no target: the paper's figure is an iteration's throughput, checked by the iteration rows below "
           "(the per-layer sum charges the weight-gradient sync every pass)")
    gains = {2: base / s2, 3: base / s3, 4: base / s4}
    paper = {2: 1.13, 3: 1.22, 4: 1.28}
    label = {2: f"(2) SP+EP {d_best}", 3: "(3) + inter-op overlap", 4: "(4) + intra-op overlap"}
    for k in (2, 3, 4):
        row("Table 5", f"{model} {hw_name} per layer {label[k]}", f"{paper[k]:.2f}", f"{gains[k]:.3f}", "held", why)
    hand = base / compile_graph(spep[d_best], cost, method="megascale").schedule.summary["makespan_us"]
    row("Table 5", f"{model} {hw_name} per layer (3) with MegaScale-MoE's hand-made order (the megascale baseline)",
        "1.22", f"{hand:.3f}", "held", why + "; CP-SAT's order hides more per layer than the paper's hand-made one")
    table5_iteration(cost)


TABLE3_ITERATION_S = 21.61
"""MegaScale-MoE Table 3: internal-352b on 240 H800, global batch 720, MegaScale-MoE (every
optimisation on, Table 5's last row): 21.61 s per iteration (MFU 32.48 %, §6.1)."""
IN_STEP_COMPUTE = ("gemm", "grouped_gemm", "attention", "memory")
"""The op classes h800-megascale's in-step factor multiplies (hardware.yaml in_step_factors): compute only."""


def _iteration_rows(cost: CostModel):
    sys.path.insert(0, str(Path(__file__).resolve().parent))     # pipeline_table5, beside this file
    from pipeline_table5 import iteration_rows
    return list(iteration_rows(cost))


def with_compute_factor(hw, factor: float):
    """``hw`` with every compute class's in-step factor set to ``factor`` (collectives unchanged)."""
    return dataclasses.replace(hw, in_step_factors=tuple((c, factor) for c in IN_STEP_COMPUTE))


def fit_in_step_compute(hw, target_s: float = TABLE3_ITERATION_S) -> float:
    """h800-megascale's compute in-step factor, on ``hw``'s operator prices (h800), fitted to
    MegaScale-MoE Table 3: the factor F at which Table 5's last configuration (the pipeline step
    model, benchmarks/pipeline_table5.py) takes ``target_s`` per iteration. Secant on F (the
    iteration time is close to linear in it), to 0.01."""
    def step_s(f: float) -> float:
        return _iteration_rows(CostModel(with_compute_factor(hw, f)))[-1][2].makespan / 1e6
    f0, f1 = 1.0, 2.0
    t0, t1 = step_s(f0), step_s(f1)
    for _ in range(6):
        f0, f1, t0 = f1, f1 + (target_s - t1) * (f1 - f0) / (t1 - t0), t1
        t1 = step_s(f1)
        if abs(f1 - f0) < 0.005:
            break
    return round(f1, 2)


def table5_iteration(cost: CostModel) -> None:
    """Table 5 at iteration level: the pipeline step model (benchmarks/pipeline_table5.py), and
    Table 3's absolute iteration time of its last configuration (the one fit of the iteration)."""
    rows = _iteration_rows(cost)
    last = rows[-1][2].makespan / 1e6
    factors = dict(cost.hw.in_step_factors)
    row("Table 3", f"internal-352b {cost.hw.name} 240 GPUs, batch 720: MegaScale-MoE iteration time",
        f"{TABLE3_ITERATION_S:.2f} s", f"{last:.2f} s", "fit",
        f"the compute in-step factor ({', '.join(f'{k} {v:g}' for k, v in sorted(factors.items())) or 'none'}) is "
        "fitted here (fit_in_step_compute, --fit); h800's operators priced alone give 12.6 s "
        "(MFU 56 %, the paper's 32.5 %): "
        "the paper names MoE's memory-bound operators (routing, scatter, gather) and HBM-bound GEMM efficiency "
        "(§6.1); the factor does not say which, nor routing imbalance or SAR's recomputation",
        abs(last / TABLE3_ITERATION_S - 1) <= 0.03)
    base = None
    for k, (label, paper, tl, _, _) in enumerate(rows):
        base = base or tl.makespan
        if k == 0:
            continue
        gain = base / tl.makespan
        why = (f"whole iteration ({tl.makespan / 1e6:.2f} s; bubble {tl.summary()['bubble_fraction']:.3f}): "
               "the pipeline bubble, p2p and the step-end sync dilute the layers' gains as in the paper")
        if k == 1:
            why += ("; the tp+tp baseline's activations (118.5 GiB) exceed an 80 GB H800, so the paper's baseline "
                    "must have recomputed or run smaller micro-batches, which this prediction does not")
        else:
            why += ("; the overlap rows gain less than the paper's +8% / +5%: a layer's forward has no independent "
                    "work to hide its collectives behind (the paper, §4.2, says so too) and CP-SAT hides about 60% of "
                    "the backward's; the reordered routing weights scale SwiGLU's rows in its own kernel, as the "
                    "paper's (§4.1, §7: a separate GATE kernel cost 2.6% of a layer, row (4) 1.226)")
        row("Table 5", f"internal-352b {cost.hw.name} iteration ({k + 1}) {label.split(' ', 1)[1]}", f"{paper:.2f}",
            f"{gain:.3f}", "held", why, abs(gain - paper) <= 0.05)
    cut = 1 - rows[-1][2].makespan / rows[-2][2].makespan
    row("Table 5", f"internal-352b {cost.hw.name} iteration time cut by intra-operator overlap, rows (4) vs (3)",
        f"{1 - 1.22 / 1.28:.1%} (1 - 1.22 / 1.28)", f"{cut:.1%}", "held",
        "the rows above, as a cut: 240 GPUs, PP=15; §6.2's 7.1-12.9% is Fig 16's six models on one node "
        "(the rows below); no target of its own (rows (3) and (4) carry it)")


def intra_op_cut(models=MODELS, hw_name="h800-megascale", time_limit=1.0, micro_batches=FIG14_MICRO_BATCHES) -> None:
    """§6.2: the iteration time intra-operator overlap cuts, per model in Fig 14/16's setting (one node
    of 8 H800, SP+EP, global batch 32 at dp = 1): one layer's forward + backward by its op-level
    CP-SAT schedule (moegraph.schedules.pipeline_price.price_layer), gate-reorder + SAR with and
    without fuse=auto, under ag-rs token dispatch (Fig 16's pairs (iii) and (iv) are its kernels),
    and the weight-gradient sync once per ``micro_batches``."""
    from moegraph.schedules.pipeline_model import model_layers
    from moegraph.schedules.pipeline_price import price_layer
    cost = CostModel(load_hardware(hw_name))

    def per_micro_batch(cfg, passes):
        layer = model_layers(cfg, Strategy("sp", "ep", "ag-rs", N), batch=B, seq=S, passes=passes, cost=cost)[-1]
        p = price_layer(layer, cost, method="cpsat", time_limit_s=time_limit)
        return p.f_us + p.b_us + p.sync_us / micro_batches

    for model in models:
        cfg = load_model(model)
        t3, t4 = (per_micro_batch(cfg, p) for p in ("gate-reorder,sar=paper", "gate-reorder,sar=paper,fuse=auto"))
        cut = 1 - t4 / t3
        row("§6.2 (Fig 16 text)", f"{model} {hw_name} one node, iteration time cut by intra-operator overlap",
            "7.1-12.9% (range over 6 models)", f"{cut:.1%} ({t3 / 1e3:.2f} -> {t4 / 1e3:.2f} ms per layer and "
            "micro-batch)", "held",
            "one MoE layer's forward + backward, scheduled (CP-SAT) with and without the fused kernels, the sync "
            f"once per {micro_batches} micro-batches; the head and optimizer, shared by both (~2% of an iteration), "
            "are left out, which overstates the cut by ~2% of itself; the fused pairs are priced by their tile "
            "pipelines on h800's formulas (Fig 16). The paper gives the range over its six models, not each one's: "
            "a layer whose experts' compute dwarfs what its dispatch and combine leave exposed (hunyuan-large: "
            "top-1 of 16 experts beside a shared expert) has little left to cut", 0.071 - 0.01 <= cut <= 0.129 + 0.01)


# --- MoNTA: all-to-all operator (Fig 14 / eq 11-16) and end to end (Fig 17) ---------------------------

def _comm(op, nbytes, group, scope, cost, chunk: int | None = None) -> float:
    """One collective at its best budget; ``chunk`` marks it as one of a chunked decomposition
    (node attr "chunk", as blocks.py's chunked lowering writes it: it pays hw.chunk_stall_us)."""
    attrs = (("scope", scope),) + (() if chunk is None else (("chunk", chunk),))
    node = Node("c", op, Phase.FORWARD, (), ("y",), comm_bytes=int(nbytes), group=group, attrs=attrs)
    return cost.best_time_us(node)


def monta_times(seq: int, chunks: int, cost: CostModel, pipeline_copy: bool, stretch: float | None = None) -> float:
    """MoNTA's strategies priced by moegraph's collective curves: t = 8 (TP), e = 2 (EP), I = 256 MB
    at 8K (Table 8, scaled with s). chunks = 0: the baseline 16-GPU all-to-all (its IB half).
    chunks = 1 is O1 (drop + all-to-all + all-gather): one chunk keeps the original layout, so no
    reorder copy (MoNTA Fig 8 (1) vs (3)). Chunked, the pipeline's steady state runs collectives
    beside another stream's kernel: each such collective takes ``stretch`` (default the profile's
    comm_overlap_stretch); O3's copy beside an all-gather runs on the HBM bandwidth it leaves
    (cost.hbm_slowdown at the all-gather's SMs)."""
    t, e, vol = 8, 2, 256e6 * seq / 8192
    x = cost.comm_overlap_stretch() if stretch is None else stretch
    if chunks == 0:
        return _comm(OpKind.ALL_TO_ALL, vol / 2, 16, "inter", cost)
    part = None if chunks == 1 else 0
    aa = _comm(OpKind.ALL_TO_ALL, vol / (chunks * t) * (e - 1) / e, e, "inter", cost, part)
    ag = _comm(OpKind.ALL_GATHER, vol / chunks * (t - 1) / t, t, "intra", cost, part)
    if chunks == 1:
        return aa + ag
    d2d = cost.hw.kernel_latency_us + 2 * vol / chunks / (cost.hw.hbm_bw_bytes_s * cost.hw.mem_eff) * 1e6
    if pipeline_copy:                                       # O3 (Algorithm 2)
        d2d_beside = d2d * cost.hbm_slowdown(cost.hw.comm_sm_saturation)
        return aa + ag * x * chunks + d2d_beside if aa < ag else aa * x * chunks + ag + d2d
    return aa + (ag * x + d2d) * chunks if aa < ag + d2d else aa * x * chunks + ag + d2d     # O2 (Algorithm 1)


MONTA_CHUNKS = (2, 4, 8)


def monta_options(seq: int, cost: CostModel) -> dict[tuple[str, int], float]:
    """MoNTA's strategies at ``seq`` tokens: O1 (one chunk) and O2/O3 with each of MONTA_CHUNKS chunks."""
    options = {("O1", 1): monta_times(seq, 1, cost, False)}
    for n in MONTA_CHUNKS:
        options[("O2", n)] = monta_times(seq, n, cost, False)
        options[("O3", n)] = monta_times(seq, n, cost, True)
    return options


def fit_chunk_stall(hw, seq: int = 8192) -> float:
    """hw.chunk_stall_us fitted to MoNTA Fig 14 at ``seq`` (8K: no chunking measured best): the
    smallest per-chunk stall, in whole us, at which O1 beats every chunked option. A lower bound,
    not a point: the figure gives the order of the options, not the chunked times."""
    def chunked_wins(stall: float) -> bool:
        opts = monta_options(seq, CostModel(dataclasses.replace(hw, chunk_stall_us=stall)))
        return min(v for k, v in opts.items() if k[1] > 1) <= opts[("O1", 1)]
    lo, hi = 0.0, 1.0
    while chunked_wins(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 0.5:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chunked_wins(mid) else (lo, mid)
    return float(math.ceil(hi))


def monta(hw_name="a800") -> None:
    # MoNTA's NCCL (2024) predates copy-engine collectives: its operator rows price them on SMs
    hw = load_hardware(hw_name).without_copy_engines()
    cost = CostModel(hw)
    why = ("moegraph prices each chunk's all-to-all, all-gather and copy from MoNTA Table 8's curves, and "
           f"each chunked collective's stall (chunk_stall_us {hw.chunk_stall_us:g} us, fitted at 8K)")
    regimes = ((8192, "O1, no chunking (O1/base 0.30)", "fit"), (32768, "O2 (32K-128K: 'MoNTA chooses O2')", "held"),
               (131072, "O2 (32K-128K)", "held"), (262144, "O3, 4 chunks (O3/base 0.253)", "fit"))
    for seq, paper_best, status in regimes:
        base = monta_times(seq, 0, cost, False)
        options = monta_options(seq, cost)
        # the figure measures O1 and O2, O3 with 4 chunks each ("all sequences are split into 4 chunks
        # for both O2 and O3"): the check picks among those; moegraph's own best chunk count beside it
        measured = {k: v for k, v in options.items() if k[1] in (1, 4)}
        (strat, n), t = min(measured.items(), key=lambda kv: kv[1])
        (own, own_n), own_t = min(options.items(), key=lambda kv: kv[1])
        want = paper_best.split(",")[0].split(" ")[0]
        o3_4 = options[("O3", 4)] / base
        note = why
        if seq == 262144:
            note = (f"comm_overlap_stretch fitted here: O3 with 4 chunks at x = 1 gives {o3_4:.3f}, at x = 1.1 "
                    f"{monta_times(seq, 4, cost, True, 1.1) / base:.3f}")
        elif seq == 8192:
            note = (f"chunk_stall_us fitted here (fit_chunk_stall: {fit_chunk_stall(hw):g} us, the profile "
                    f"{hw.chunk_stall_us:g}); O1 is predicted at {options[('O1', 1)] / base:.3f} of the baseline, "
                    "MoNTA measures 0.30 (its pairwise all-to-all is priced on the 16-card curve, as MoNTA's Table 8 does)")
        else:
            o2_4 = options[("O2", 4)] / base
            note = (f"{why}; chunked, as MoNTA, but O3 (its copy hidden under the next all-gather, at the HBM "
                    f"share priced) beats O2 ({o2_4:.3f} with 4 chunks). For O2 to win here and O3 at 256K, O3 "
                    "must pay a fixed per-chunk cost (a volume-proportional stretch of the all-gather beside the "
                    "copy would hurt 256K as much): MoNTA names it (all-gather and copy both use load/store "
                    "instructions and kernel scheduling, so its r_2, r_3 'differ' for O3) with no magnitude, and "
                    "neither fitted point (8K: O1 beats both; 256K: O3 wins) bounds it from below")
        row("MoNTA Fig 14", f"all-to-all operator, s={seq // 1024}K, {hw_name}, 2 nodes", paper_best,
            f"{strat}{'' if n == 1 else f', {n} chunks'} ({strat}/base {t / base:.3f}; O1/base "
            f"{options[('O1', 1)] / base:.3f}; O3 4 chunks {o3_4:.3f}; any chunk count: {own}, {own_n} "
            f"({own_t / base:.3f}))", status, note, strat == want)
    o1 = monta_times(8192, 1, cost, False) / monta_times(8192, 0, cost, False)
    e2e = 1 - 0.22 * (1 - o1)
    row("MoNTA Fig 17", "2x70B, 16 A800, 8K, end to end", "-13% latency (O1)", f"{e2e - 1:+.1%}", "held",
        "MoNTA's own 22% all-to-all share with moegraph's O1/base ratio; no 2x70B layer is lowered")
    monta_chunk_auto(CostModel(load_hardware(hw_name)))      # moegraph's own layer: the profile as is


def monta_layer(seq: int):
    """A MoE layer of MoNTA's sizes (Table 7: h = 8192; 2x70B with top-2) lowered sp+ep+a2a over
    n = 16 ranks, two 8-GPU nodes (the all-to-alls cross the NICs); 16 experts so that each rank
    holds one (n must divide the expert count), heads 64 / kv heads 16 so that n divides them."""
    cfg = dataclasses.replace(load_model("mixtral-8x7b"), hidden=8192, heads=64, kv_heads=16, experts=16, top_k=2,
                              ffn_hidden=28672)
    return trace_model(cfg, Strategy("sp", "ep", "a2a", 16), batch=B, seq=seq)


def monta_chunk_auto(cost: CostModel) -> None:
    """moegraph's own chunk=auto (passes.strategy.chunk: the MoE dispatch/experts/combine chain and
    attention's collectives in N token chunks) on a MoNTA-sized layer across two a800 nodes: MoNTA's
    regime says one call at small volumes (<16K), chunks from 32K."""
    from moegraph.passes import run_pipeline
    for seq, status in ((8192, "fit"), (32768, "held"), (131072, "held"), (262144, "fit")):
        rep = run_pipeline(monta_layer(seq), "chunk=auto", cost=cost)[1]["chunk"]
        chosen, pred = rep["chosen"], rep["predicted_us"]
        gain = pred[1] / pred[chosen] - 1
        want_chunks = seq >= 32768
        paper = "chunks (MoNTA: O2/O3 from 32K)" if want_chunks else "no chunking (MoNTA: O1 below 16K)"
        fitted = {8192: "chunk_stall_us is fitted to MoNTA's 8K operator figure", 262144:
                  "comm_overlap_stretch is fitted to MoNTA's 256K operator figure"}.get(seq, "no fit at this volume")
        row("MoNTA regime, chunk=auto", f"MoNTA-sized layer (h 8192, top-2), sp+ep a2a n=16 over 2 a800 nodes, "
            f"s={seq // 1024}K", paper, f"{chosen} chunk{'s' if chosen > 1 else ''} ({gain:+.1%} vs 1)", status,
            f"moegraph's own chunked layer (two-stream estimate), a different pipeline from MoNTA's; {fitted}",
            (chosen > 1) == want_chunks)


# --- Megatron-Core: EP overlap -----------------------------------------------------------------------

MEGATRON_PASSES = "gate-reorder,compress=ep-fp8,sar=paper"
"""Megatron-Core's EP overlap runs DeepEP's dispatch, which sends FP8 rows with their scales
(DeepSeek-V3 §3.3): moegraph's ``compress=ep-fp8``; its combine stays BF16, as there."""


def ep_exposure(cost: CostModel, seq: int, n: int, tp: int, methods) -> dict[str, tuple[float, float]]:
    """method -> (exposed EP communication / makespan, makespan us) of DeepSeek-V3's steady-state
    F&B pair at EP n (megatron_ep_overlap's docstring), scheduled by each method under ``cost``."""
    from moegraph.passes import run_pipeline
    from moegraph.schedules.api import compile_graph
    from moegraph.schedules.pipeline_price import steady_pair
    from moegraph.schedules.schedule_file import exposed_comm
    nodes = max(1, n // cost.hw.gpus_per_node)          # EP64 over 8-GPU nodes: DeepEP's node-spanning dispatch
    # Megatron's TP-tp attention, data-parallel over n/tp groups of tp ranks in a node (attn_nodes)
    strategy = Strategy("tp", "ep", "a2a", n, ep_nodes=nodes, attn_nodes=n // tp)
    layer, _ = run_pipeline(trace_model(load_model("deepseek-v3"), strategy, batch=n // tp, seq=seq), MEGATRON_PASSES,
                            cost=cost)
    pair = steady_pair(layer)
    share = {}
    for method in methods:
        sched = compile_graph(pair, cost, method=method, time_limit_s=5.0).schedule
        nodes = list(sched.nodes)
        ep = [x for x in nodes if x.kind == "comm" and pair.node[x.name].block == "ffn"]
        exposed = sum(e - b for b, e in exposed_comm([x for x in nodes if x.kind == "compute"] + ep))
        share[method] = (exposed / sched.summary["makespan_us"], sched.summary["makespan_us"])
    return share


def megatron_ep_overlap(cost: CostModel, seq: int, n: int = 64, tp: int = 2) -> None:
    """Megatron-Core's EP overlap (its §5: 1F1B forward-backward overlap with the backward MLP's W/D
    split): the share of a pipeline's steady-state step that expert-parallel communication leaves
    exposed, without overlap and with it. The steady-state unit is the F&B pair of one layer
    (moegraph.schedules.pipeline_price.steady_pair: micro-batch 1's forward beside micro-batch 0's
    backward, the W/D split being the graph's own wgrad/dgrad nodes), less the step-end sync, as
    the pipeline prices it; ``sequential`` runs it in program order, ``megatron-1f1b`` in
    Megatron's combined order, ``cpsat`` scheduled. DeepSeek-V3 at EP64 over 8 nodes, as
    Megatron-Core runs it: the experts' dispatch as DeepEP sends it (ep_nodes=8, FP8), the attention
    TP2 in the node and data-parallel over the 32 TP groups (attn_nodes=32), each on one of the
    n/tp sequences, so each rank routes s/tp tokens, as there."""
    share = ep_exposure(cost, seq, n, tp, ("sequential", "megatron-1f1b", "cpsat"))
    (seq_s, seq_t), (meg_s, meg_t), (cp_s, cp_t) = share.values()
    row("Megatron-Core §5", f"DeepSeek-V3 {cost.hw.name} EP{n} a2a, attention TP{tp}, s={seq // 1024}K, "
        f"{seq // tp} tokens per rank: exposed EP communication, no overlap -> 1F1B F&B overlap", "30-40% -> < 5%",
        f"{seq_s:.1%} -> {meg_s:.1%} (Megatron's order; CP-SAT {cp_s:.1%}); pair {seq_t / 1e3:.2f} -> "
        f"{meg_t / 1e3:.2f} ms ({cp_t / 1e3:.2f})", "held",
        "one layer's steady-state F&B pair (the pipeline's unit), bf16, compiled as Megatron-Core runs it: "
        "DeepEP's dispatch (each token once per destination node over the NICs, then NVLink: ep_nodes=8; in FP8: "
        "compress=ep-fp8) and TP2 attention in the node, data-parallel over the other ranks (attn_nodes=32). Both "
        "shares land in the paper's ranges. Until 2026-11-28 Megatron's order gave 17.9%: on this pair graph (micro-"
        "batch 0's backward without its forward) the baseline put that whole backward in the pair's last phase, so the "
        "NIC hops met too little compute; the backward's collectives are now told apart by the backward alone. Still "
        "different: bf16 here (Megatron FP8-blockwise), sar=paper's recompute set (Megatron's: mlp, mla_up_proj, "
        "moe_act, layernorm), and one layer's pair where Megatron's share is of a whole iteration",
        0.30 - 0.05 <= seq_s <= 0.40 + 0.05 and meg_s < 0.05)


def megatron(hw_name="h100", seq=4096) -> None:
    """The launch-order option (moegraph.schedules.launch) on a merged 2-micro-batch EP step: the
    overlap gain of Megatron-Core's combined-1F1B order over the sequential step, with a hardware
    queue per stream and with one queue fed in that order (CUDA_DEVICE_MAX_CONNECTIONS=1)."""
    from moegraph.passes.microbatch import merge_microbatches
    from moegraph.schedules.api import compile_graph
    # Megatron-LM's collectives run on SMs (NCCL before 2.28's copy-engine collectives, DeepEP's
    # kernels): the profile's SM budgets, without budget 0
    cost = CostModel(load_hardware(hw_name).without_copy_engines())
    megatron_ep_overlap(cost, seq)
    for model in ("deepseek-v3", "mixtral-8x7b"):
        g = merge_microbatches(graph(model, "sp", "ep", "a2a", seq=seq), 2)
        span = {k: compile_graph(g, cost, method=m, launch_order=lo).schedule.summary["makespan_us"]
                for k, m, lo in (("seq", "sequential", "free"), ("free", "megatron-1f1b", "free"),
                                 ("one", "megatron-1f1b", "megatron-1f1b"))}
        free, one = span["seq"] / span["free"] - 1, span["seq"] / span["one"] - 1
        paper = "0.5x gain (halved)" if model == "deepseek-v3" else "-"
        row("Megatron-LM PRs 2719/2730, 6311", f"{model} {hw_name} s={seq // 1024}K, M=2: one hardware queue vs one "
            f"per stream", paper, f"{one / free:.2f}x gain ({free:+.1%} -> {one:+.1%} over sequential)", "held",
            "launch order megatron-1f1b: each phase's collective is launched before its compute; one waiting on the "
            "previous phase's compute holds back the compute launched behind it. Collectives on SM budgets, as "
            "Megatron-LM runs them (NCCL before 2.28's copy-engine collectives, DeepEP); the 0.56x this row gave "
            "until 2026-11-27 came from copy-engine budgets Megatron never ran. n = 8 is one node, so no node-"
            "spanning dispatch applies (the what-if that scaled these bytes as one, 0.60x, was dropped on 2026-11-28). "
            "PR 6311 measured +3.7% vs +7.8% (EP16 over two nodes, s=2K, PP4, full recompute). Megatron's own phase-1 "
            "issue order (mlp_bwd before dispatch_fwd) is not modelled: it gives 0.24x here (docs/scheduler.md)",
            None if paper == "-" else 0.4 <= one / free <= 0.6)


def report() -> str:
    lines = ["| figure | setting | paper | moegraph | fit/held | within target | reason for a difference |",
             "|---|---|---|---|---|---|---|"]
    for r in ROWS:
        ok = "-" if r["ok"] is None else ("yes" if r["ok"] else "NO")
        lines.append(f"| {r['fig']} | {r['setting']} | {r['paper']} | {r['ours']} | {r['status']} | {ok} | {r['reason']} |")
    for status in ("held", "fit"):
        checked = [r for r in ROWS if r["status"] == status and r["ok"] is not None]
        n_rows = sum(r["status"] == status for r in ROWS)
        figs = dict.fromkeys(r["fig"] for r in checked)
        per_fig = ", ".join(f"{f} {sum(r['ok'] for r in checked if r['fig'] == f)}/"
                            f"{sum(r['fig'] == f for r in checked)}" for f in figs)
        lines.append(f"\n{status}: {n_rows} rows, {len(checked)} with a target, "
                     f"{sum(r['ok'] for r in checked)} within it ({per_fig})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fast", action="store_true", help="skip Table 5 (its CP-SAT solves)")
    p.add_argument("--time-limit", type=float, default=5.0)
    p.add_argument("--fit", action="store_true", help="print h800-megascale's compute in-step factor fitted to Table 3 and exit")
    args = p.parse_args(argv)
    if args.fit:
        print(f"h800-megascale's in_step_factors (compute classes), fitted to Table 3: "
              f"{fit_in_step_compute(load_hardware('h800')):.2f}")
        return 0
    fig7()
    fig14()
    fig16()
    if not args.fast:
        table5(time_limit=args.time_limit)
        intra_op_cut()
    monta()
    megatron()
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
