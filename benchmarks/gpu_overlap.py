"""Emulated-collective overlap on one GPU (issue 17): how much comm time the plans hide.

The n=2 rank graph of ``moegraph.runtime.emulated`` (attn=sp, ffn=tp, dispatch=ag-rs, chunk=4;
``GPU_SIZES``, fp32; the graph the single-GPU test runs) on ONE device, its collectives replaced by
``EmulatedComm``: a same-sized copy on the plan's comm stream after a ``torch.cuda._sleep`` of
``--comm-us`` (converted to cycles at the clock measured on the device). Per plan (sequential,
greedy, cpsat), steps interleaved after a warm-up: the median measured step (CUDA events from the
start of the forward to the last node's end); the predicted step (``EmulatedCost``, priced for what
runs: the measured H200 profile with fp32 at the FP32 rate, the masked grouped GEMMs at their E-fold
FLOPs, every collective at --comm-us; sequential: every node alone, one after another, which the
second GPU session's measured step checks held-out); the executor's host time per node; the median
hidden comm fraction (``runtime.trace.hidden_comm_fraction``: share of the emulated collectives'
time during which a compute node ran; the issue's bar: >= 0.80) and the plan's own predicted one
(the same measure on its predicted times); and whether the plan's outputs and gradients equal the
sequential plan's bit for bit, from one more step per plan under ``exact_numerics`` (attention by
SDPA's math backend; copies are a fixed function of their inputs, so any difference there is a
missed wait or a reused buffer). The timed steps run the default SDPA backend, whose backward is
not bit-reproducible: a last line gives their largest difference to sequential, for comparison.

One hardware queue (``--launch-order program``, run under ``CUDA_DEVICE_MAX_CONNECTIONS=1``): the
overlapped plans are scheduled for one queue fed in program order (moegraph.schedules.launch: a
kernel starts only after every kernel launched before it has started) and issue in that order, so
their predicted steps are the launch-order model's, checked against the GPU's own single queue
(issue 29). The header says which launch order and connection count ran.

    python benchmarks/gpu_overlap.py                            # CUDA
    python benchmarks/gpu_overlap.py --comm-us 1000 --json out.json
    CUDA_DEVICE_MAX_CONNECTIONS=1 python benchmarks/gpu_overlap.py --launch-order program
    python benchmarks/gpu_overlap.py --device cpu --tiny        # smoke test (no sleep, no overlap on CPU)
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moegraph.cli import OneLineParser
from moegraph.options import UsageError, check_output, positive_float, positive_int
from moegraph.runtime.emulated import DEFAULT_COMM_US
from moegraph.runtime.trace import write_json

# moegraph is imported as installed (editable here; on the GPU device a --target copy, which the
# repo root's folder moegraph/ would shadow: never put the root on sys.path, docs/gpu.md)
sys.path.insert(0, str(Path(__file__).resolve().parent))       # gpu_common, beside this file
from gpu_common import check_device, device_name, markdown_table  # noqa: E402

PLANS = ("sequential", "greedy", "cpsat")
BAR = 0.80
COLUMNS = ("plan", "median_step_ms", "predicted_ms", "host_us_per_node", "hidden_comm_fraction", "predicted_hidden",
           "equal_to_sequential")


@dataclass(frozen=True)
class Setup:
    device: str
    tiny: bool
    steps: int
    warmup: int
    comm_us: float
    time_limit_s: float
    json_path: Path | None
    launch_order: str = "free"


def parse(argv: list[str] | None) -> Setup:
    p = OneLineParser(prog="gpu_overlap.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny rank graph (runtime.emulated.TINY_SIZES): a smoke test")
    p.add_argument("--steps", type=positive_int, default=None, help="timed steps per plan (default 10, tiny 2)")
    p.add_argument("--warmup", type=positive_int, default=2)
    p.add_argument("--comm-us", type=positive_float, default=DEFAULT_COMM_US,
                   help="microseconds each emulated collective lasts (CUDA; default %(default)s)")
    p.add_argument("--time-limit", type=positive_float, default=None, help="cpsat seconds (default 10, tiny 2)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--launch-order", choices=("free", "program"), default="free",
                   help="free: a hardware queue per stream; program: one queue fed in program order, as "
                        "CUDA_DEVICE_MAX_CONNECTIONS=1 makes it (the overlapped plans are scheduled for it)")
    args = p.parse_args(argv)
    try:
        check_device(args.device)
        json_path = check_output(args.json, suffixes=(".json",), flag="--json") if args.json else None
    except UsageError as err:
        p.exit(2, f"gpu_overlap.py: error: {err}\n")
    return Setup(args.device, args.tiny, args.steps or (2 if args.tiny else 10), args.warmup, args.comm_us,
                 args.time_limit or (2.0 if args.tiny else 10.0), json_path, args.launch_order)


def run(setup: Setup) -> tuple[Any, list[dict[str, Any]], dict[str, float]]:
    import torch
    from moegraph.runtime.emulated import GPU_SIZES, TINY_SIZES, EmulatedRankGraph, exact_numerics
    from moegraph.runtime.trace import hidden_comm_fraction
    if setup.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rg = EmulatedRankGraph(TINY_SIZES if setup.tiny else GPU_SIZES, setup.device, comm_us=setup.comm_us)
    plans = {m: rg.plan(m, time_limit_s=setup.time_limit_s, launch_order=setup.launch_order) for m in PLANS}
    execs = {m: rg.executor(plan) for m, plan in plans.items()}
    last: dict[str, Any] = {}
    for _ in range(setup.warmup):
        for m, ex in execs.items():
            last[m] = rg.step(ex)
    for ex in execs.values():
        ex.host.reset()
    steps: dict[str, list[float]] = {m: [] for m in PLANS}
    hidden: dict[str, list[float]] = {m: [] for m in PLANS}
    for _ in range(setup.steps):                   # interleaved: step i of every plan, then i+1
        for m, ex in execs.items():
            st = rg.step(ex)
            steps[m].append(st.trace.step_us)
            hidden[m].append(hidden_comm_fraction(st.trace))
            last[m] = st
    with exact_numerics():                         # untimed: the bitwise comparison (module docstring)
        exact = {m: rg.step(ex, record=False) for m, ex in execs.items()}
    rows = []
    for m in PLANS:
        pred = rg.predicted_serial_us() if m == "sequential" else plans[m].predicted_makespan_us
        pred_hidden = rg.predicted_hidden_fraction(plans[m])
        rows.append({"plan": m, "median_step_ms": statistics.median(steps[m]) / 1e3,
                     "predicted_ms": None if pred is None else pred / 1e3,
                     "host_us_per_node": execs[m].host.us_per_node(),
                     "hidden_comm_fraction": statistics.median(hidden[m]),
                     "predicted_hidden": 0.0 if m == "sequential" else pred_hidden,
                     "equal_to_sequential": "yes" if _max_diff(exact[m], exact["sequential"]) == 0 else "NO"})
    default_diff = {m: _max_diff(last[m], last["sequential"]) for m in PLANS if m != "sequential"}
    return rg, rows, default_diff


def _max_diff(a: Any, b: Any) -> float:
    """The largest |difference| between two steps' output, input gradient and parameter gradients."""
    pairs = [(a.y, b.y), (a.dx, b.dx), *zip(a.grads, b.grads)]
    return max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in pairs)


def main(argv: list[str] | None = None) -> int:
    setup = parse(argv)
    import torch
    device = device_name(setup.device)
    rg, rows, default_diff = run(setup)
    z = rg.sizes
    comm = sum(nd.is_comm for nd in rg.graph.nodes)
    print(f"# gpu_overlap: rank 0 of n={z.n}, attn=sp ffn=tp dispatch=ag-rs chunk={z.chunks}; b={z.b} s={z.s} "
          f"h={z.h} f={z.f} experts={z.experts} k={z.k} fp32; {len(rg.graph.nodes)} nodes, {comm} emulated collectives; "
          f"each {setup.comm_us:g} us ({rg.sleep_cycles()} sleep cycles; the CPU path does not sleep); plans priced "
          f"on {rg.cost.hw.name} at fp32, grouped GEMMs {'masked' if rg.masked else 'native'}")
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset (8)")
    print(f"# device {device}, torch {torch.__version__}; {setup.steps} steps interleaved after {setup.warmup} warm-up; "
          f"launch order {setup.launch_order}, CUDA_DEVICE_MAX_CONNECTIONS={connections}")
    print(markdown_table(rows, COLUMNS))
    best = max(r["hidden_comm_fraction"] for r in rows if r["plan"] != "sequential")
    print(f"# best hidden comm fraction {best:.2f} (bar: >= {BAR:.2f}); "
          f"all plans equal to sequential (exact numerics): "
          f"{'yes' if all(r['equal_to_sequential'] == 'yes' for r in rows) else 'NO'}")
    print("# timed steps (default SDPA backend) vs sequential, max |diff|: "
          + ", ".join(f"{m} {d:.3g}" for m, d in default_diff.items()))
    if setup.json_path is not None:
        write_json(setup.json_path, {"device": device, "torch": torch.__version__, "launch_order": setup.launch_order,
                                     "cuda_device_max_connections": connections,
                                     "comm_us": setup.comm_us, "sleep_cycles": rg.sleep_cycles(), "sizes": asdict(z),
                                     "rows": rows, "default_backend_max_diff": default_diff})
    return 0


if __name__ == "__main__":
    sys.exit(main())
