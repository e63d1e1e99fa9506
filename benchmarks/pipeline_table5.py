"""MegaScale-MoE Table 5 as whole-iteration speed-ups: internal-352b, 240 H800 GPUs, batch 720.

    .venv/bin/python benchmarks/pipeline_table5.py [--schedule 1F1B] [--op-limit 2]

The paper's configuration (§6.1, Table 5): PP=15, n=8 inside a node, dp = 240 / (15 * 8) = 2,
s=8192, V=65,536, global batch 720 = dp x M x b with b=1: M=360 micro-batches per pipeline. Rows:

    baseline                          tp+tp, no comm/compute overlap (each unit's ops one after another)
    (1) with SP+EP                    sp+ep, no overlap
    (2) with inter-operator overlap   sp+ep, gate-reorder + sar=paper, the op-level CP-SAT schedule
    (3) with intra-operator overlap   (2) plus fuse=auto (tile-level fused comm+compute kernels)

Each row's layers are priced by its op-level schedule (moegraph.schedules.pipeline_price), cut
into 15 balanced stages, and the whole iteration is the pipeline step of torch's generated
schedule (--schedule; MegaScale runs interleaved 1F1B, which needs V=2: 30 stages of 2 layers)
with p2p transfers, the step-end gradient sync and the optimizer step
(moegraph.schedules.pipeline.simulate). Printed beside the paper's 1.00 / 1.13 / 1.22 / 1.28 and
the per-layer figure (forward + backward of one layer alone) moegraph predicted before stages.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moegraph.cost import CostModel  # noqa: E402
from moegraph.ir import Strategy  # noqa: E402
from moegraph.registry import load_hardware, load_model  # noqa: E402
from moegraph.schedules.pipeline import simulate  # noqa: E402
from moegraph.schedules.pipeline_model import model_layers, pipeline_problem  # noqa: E402
from moegraph.schedules.pipeline_torch import TORCH_SCHEDULES, torch_orders  # noqa: E402

PP, N, DP, SEQ, VOCAB, M = 15, 8, 2, 8192, 65536, 360
ROWS = (("baseline", ("tp", "tp"), "", "sequential", 1.00),
        ("(1) with SP+EP", ("sp", "ep"), "", "sequential", 1.13),
        ("(2) with inter-operator overlap", ("sp", "ep"), "gate-reorder,sar=paper", "cpsat", 1.22),
        ("(3) with intra-operator overlap", ("sp", "ep"), "gate-reorder,sar=paper,fuse=auto", "cpsat", 1.28))


def iteration_rows(cost: CostModel, schedule: str = "Interleaved1F1B", op_limit: float = 2.0):
    """Per row of ROWS: (label, paper, the pipeline timeline, one layer's forward + backward us,
    wall s): each row's layers priced by their op-level schedule, the iteration simulated."""
    placement, per_rank = TORCH_SCHEDULES[schedule]
    cfg = load_model("internal-352b")
    for label, (attn, ffn), passes, method, paper in ROWS:
        t0 = time.perf_counter()
        layers = model_layers(cfg, Strategy(attn, ffn, "ag-rs", N, dp=DP), batch=1, seq=SEQ, passes=passes,
                              cost=cost)
        built = pipeline_problem(layers, cost, pp=PP, vpp=per_rank or 2, placement=placement, micro_batches=M,
                                 vocab=VOCAB, method=method, time_limit_s=op_limit, tick_us=1.0)
        tl = simulate(built.problem, torch_orders(schedule, built.problem.layout, M))
        layer = built.layer_prices[0].f_us + built.layer_prices[0].b_us
        yield label, paper, tl, layer, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="Interleaved1F1B", choices=sorted(TORCH_SCHEDULES))
    ap.add_argument("--op-limit", type=float, default=2.0, help="op-level CP-SAT effort per unit (s)")
    ap.add_argument("--hardware", default="h800")
    args = ap.parse_args()
    vpp = TORCH_SCHEDULES[args.schedule][1] or 2
    cost = CostModel(load_hardware(args.hardware))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"Table 5, internal-352b on {args.hardware}: PP={PP} (V={vpp}, torch {args.schedule}), n={N}, dp={DP}, "
          f"s={SEQ}, M={M}; {stamp}, {platform.node()} ({os.cpu_count()} cores), "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| row | iteration s | speed-up | paper | per-layer speed-up | bubble | exposed p2p ms | exposed sync ms "
          "| peak GiB | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base_step = base_layer = None
    for label, paper, tl, layer, wall in iteration_rows(cost, args.schedule, args.op_limit):
        base_step = base_step or tl.makespan
        base_layer = base_layer or layer
        s = tl.summary()
        print(f"| {label} | {tl.makespan / 1e6:.3f} | {base_step / tl.makespan:.2f} | {paper:.2f} | "
              f"{base_layer / layer:.2f} | {s['bubble_fraction']:.3f} | {max(s['exposed_p2p_us']) / 1e3:,.1f} | "
              f"{s['exposed_sync_us'] / 1e3:,.1f} | {max(s['peak_bytes']) / 2**30:.1f} | {wall:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
