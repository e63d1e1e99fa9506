"""The node-spanning expert dispatch (``--ep-nodes``) against the flat all-to-all, per layer.

    .venv/bin/python benchmarks/node_dispatch.py                 # the table (CP-SAT 5 s per layer: ~2 min)
    .venv/bin/python benchmarks/node_dispatch.py --time-limit 2

For each model and expert-parallel group that spans nodes of 8 GPUs: the bytes one rank sends over
the NICs in the forward dispatch and combine, the serial sum of the layer's collectives and of all
its nodes (forward + backward, passes gate-reorder and sar=paper), and the CP-SAT layer makespan,
for the flat all-to-all, the node-spanning one (``ep_nodes`` = n / 8), and that with its dispatch
in FP8 (``compress=ep-fp8``). Cost model only (no run): the node-spanning dispatch's numerics are
checked against eager on gloo ranks in the tests (tests/test_runtime.py, tests/test_node_dispatch.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moegraph.cost import CostModel  # noqa: E402
from moegraph.ir import Strategy  # noqa: E402
from moegraph.passes import run_pipeline  # noqa: E402
from moegraph.passes.estimate import serial_time_us  # noqa: E402
from moegraph.registry import load_hardware, load_model  # noqa: E402
from moegraph.schedules.api import compile_graph  # noqa: E402
from moegraph.tracer import trace_model  # noqa: E402

# (model, hardware, n, sequences per micro-batch b, s): EP64 as Megatron-Core's DeepSeek-V3 runs it
# (2048 tokens per rank), Kimi-K2 at EP32 and DeepSeek-V2 at EP16 (the same 2048 tokens per rank).
# GQA models with 4 or 8 kv heads (Qwen3, GLM-4.5, GPT-OSS, Mixtral) cannot split attention over
# more than 8 ranks: moegraph's attention shares the experts' group (one n), so they have no row.
CASES = (("deepseek-v3", "h100", 64, 32, 4096), ("deepseek-v3", "h800", 64, 32, 4096),
         ("kimi-k2", "h100", 32, 16, 4096), ("deepseek-v2", "h800", 16, 8, 4096))
VARIANTS = (("flat a2a", 1, "gate-reorder,sar=paper"), ("ep_nodes", None, "gate-reorder,sar=paper"),
            ("ep_nodes + ep-fp8", None, "gate-reorder,compress=ep-fp8,sar=paper"))


def nic_bytes(graph, cost: CostModel) -> int:
    """Forward FFN bytes this rank sends over the NICs (collectives priced on the inter-node link)."""
    return sum(n.comm_bytes for n in graph.nodes if n.is_comm and n.block == "ffn" and n.phase.value == "forward"
               and cost.scope(n) == "inter")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--time-limit", type=float, default=5.0, help="CP-SAT seconds per layer (default %(default)s)")
    args = p.parse_args(argv)
    print("| model | hw | n (nodes) | dispatch | NIC MB fwd | comm serial ms | layer serial ms | CP-SAT ms | vs flat |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, hw_name, n, b, s in CASES:
        cost = CostModel(load_hardware(hw_name))
        nodes = n // cost.hw.gpus_per_node
        flat_span = None
        for label, ep_nodes, passes in VARIANTS:
            strategy = Strategy("sp", "ep", "a2a", n, ep_nodes=nodes if ep_nodes is None else ep_nodes)
            g = run_pipeline(trace_model(load_model(model), strategy, batch=b, seq=s), passes, cost=cost)[0]
            comm = sum(cost.node_time_us(x) for x in g.nodes if x.is_comm)
            span = compile_graph(g, cost, time_limit_s=args.time_limit).schedule.summary["makespan_us"]
            flat_span = span if flat_span is None else flat_span
            print(f"| {model} | {hw_name} | {n} ({nodes}) | {label} | {nic_bytes(g, cost) / 1e6:.1f} | "
                  f"{comm / 1e3:.2f} | {serial_time_us(g, cost) / 1e3:.2f} | {span / 1e3:.2f} | "
                  f"{flat_span / span:.3f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
