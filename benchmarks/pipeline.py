"""Issue 28's predicted acceptance: CP-SAT's pipeline step against every torch-generated schedule.

    .venv/bin/python benchmarks/pipeline.py                       # both models, h800
    .venv/bin/python benchmarks/pipeline.py --model deepseek-v3 --time-limit 4

Per model (DeepSeek-V3: PP=16, M=32, n=8 a2a, dp=16, s=4096; internal-352b: PP=15, n=8 ag-rs,
dp=2, s=8192, M=360 = Table 5's batch 720 over dp=2 at b=1), per stage placement (V=1; V=2
loop; V=2 V-shape): the layers priced by the op-level schedule (CP-SAT, --op-limit), cut into
stages (``balance``), each torch schedule that fits the placement (``torch.distributed.
pipelining``'s own action tables) and CP-SAT's stage-level order warm-started from the best of
them, all under the same memory cap per rank (the GPU's capacity), all priced by the one
timeline (moegraph.schedules.pipeline.simulate). Prints one markdown table per model: step,
bubble, exposed p2p (max over ranks) and exposed step-end sync, peak memory, whether it fits,
and the wall time of each CP-SAT solve; then CP-SAT's best against the best torch schedule.
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
from moegraph.schedules.pipeline_cpsat import solve_pipeline  # noqa: E402
from moegraph.schedules.pipeline_model import model_layers, pipeline_problem, torch_warm_starts  # noqa: E402

CONFIGS = {
    "deepseek-v3": dict(pp=16, micro_batches=32, n=8, dispatch="a2a", dp=16, seq=4096, vocab=129280),
    "internal-352b": dict(pp=15, micro_batches=360, n=8, dispatch="ag-rs", dp=2, seq=8192, vocab=65536),
}
"""DeepSeek-V3: 2048 GPUs = PP 16 x n 8 x dp 16, its public vocabulary; internal-352b: MegaScale-MoE
§6.1 (PP 15, s 8192, V 65,536) at Table 5's 240 GPUs, batch 720."""
PLACEMENTS = ((1, "loop"), (2, "loop"), (2, "v"))
GIB = 2**30


def run(model: str, hw_name: str, op_limit: float, time_limit: float, passes: str, overlap: bool, windows: int,
        window: int, window_limit: float) -> float:
    c = CONFIGS[model]
    cost = CostModel(load_hardware(hw_name))
    cap = cost.hw.hbm_capacity_bytes
    cfg = load_model(model)
    t0 = time.perf_counter()
    layers = model_layers(cfg, Strategy("sp", "ep", c["dispatch"], c["n"], dp=c["dp"]), batch=1, seq=c["seq"],
                          passes=passes, cost=cost)
    print(f"\n### {model} on {hw_name}: PP={c['pp']}, M={c['micro_batches']}, n={c['n']} {c['dispatch']}, "
          f"dp={c['dp']}, s={c['seq']}, passes {passes}, cap {cap / GIB:.1f} GiB per rank, parameter gather "
          f"{'overlapped with the next step' if overlap else 'at the step end'}; CP-SAT {time_limit:g} s whole-step"
          + (f", then up to {windows} windows of {window} micro-batches x {window_limit:g} s" if windows else "") + "\n")
    print("| V | placement | schedule | step ms | bubble | exposed p2p ms | exposed gather ms | exposed sync ms "
          "| peak GiB | fits | solve s |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    best_torch, best_cpsat = None, None
    for vpp, placement in PLACEMENTS:
        if len(layers) < c["pp"] * vpp:
            continue
        built = pipeline_problem(layers, cost, pp=c["pp"], vpp=vpp, placement=placement,
                                 micro_batches=c["micro_batches"], vocab=c["vocab"], memory_cap_bytes=cap,
                                 method="cpsat", time_limit_s=op_limit, tick_us=1.0, overlap_param_gather=overlap)
        warm = torch_warm_starts(built.problem)
        t1 = time.perf_counter()
        res = solve_pipeline(built.problem, warm, time_limit_s=time_limit, windows=windows, window=window,
                             window_limit_s=window_limit)
        wall = time.perf_counter() - t1
        how = res.status + (f", windows {res.windows.kept}/{res.windows.windows} kept" if res.windows else "")
        rows = list(res.warm_starts.items()) + [(f"CP-SAT ({res.source}; {how})", res.timeline)]
        for name, tl in rows:
            s = tl.summary()
            print(f"| {vpp} | {placement} | {name} | {s['step_us'] / 1e3:,.1f} | {s['bubble_fraction']:.3f} | "
                  f"{max(s['exposed_p2p_us']) / 1e3:,.1f} | {max(s['exposed_gather_us']) / 1e3:,.1f} | "
                  f"{s['exposed_sync_us'] / 1e3:,.1f} | "
                  f"{max(s['peak_bytes']) / GIB:.1f} | {'yes' if s['fits'] else 'NO'} | "
                  f"{f'{wall:.0f}' if name.startswith('CP-SAT') else ''} |", flush=True)
        fitting = [tl.makespan for tl in res.warm_starts.values() if tl.fits]
        if fitting:
            best_torch = min(fitting + ([best_torch] if best_torch is not None else []))
        best_cpsat = min(res.timeline.makespan, best_cpsat if best_cpsat is not None else res.timeline.makespan)
    total = time.perf_counter() - t0
    verdict = "PASS" if best_cpsat <= best_torch else "FAIL"
    print(f"\nbest torch schedule {best_torch / 1e3:,.1f} ms, CP-SAT {best_cpsat / 1e3:,.1f} ms "
          f"({(best_torch - best_cpsat) / best_torch:+.2%} shorter): {verdict}; {total:.0f} s in all")
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(CONFIGS), nargs="+", default=sorted(CONFIGS))
    ap.add_argument("--hardware", default="h800")
    ap.add_argument("--op-limit", type=float, default=1.0, help="op-level CP-SAT effort per unit (s)")
    ap.add_argument("--time-limit", type=float, default=3.0, help="stage-level CP-SAT effort per placement (s)")
    ap.add_argument("--passes", default="gate-reorder,sar=paper")
    ap.add_argument("--overlap-param-gather", action="store_true",
                    help="the sync's all-gather half overlaps the next step's forward (Megatron's option)")
    ap.add_argument("--windows", type=int, default=0, help="window search: windows per sweep (0: none)")
    ap.add_argument("--window", type=int, default=4, help="micro-batches per window (default %(default)s)")
    ap.add_argument("--window-limit", type=float, default=1.0, help="CP-SAT effort per window (s)")
    args = ap.parse_args()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"pipeline acceptance; {stamp}, {platform.node()} ({os.cpu_count()} cores), "
          f"load average {os.getloadavg()[0]:.1f}")
    for model in args.model:
        run(model, args.hardware, args.op_limit, args.time_limit, args.passes, args.overlap_param_gather, args.windows,
            args.window, args.window_limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
