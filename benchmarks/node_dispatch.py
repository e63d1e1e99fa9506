"""The node-spanning expert dispatch (``--ep-nodes``) and the attention in the node (``--attn-nodes``)
against the flat all-to-all, per layer.

    .venv/bin/python benchmarks/node_dispatch.py                 # the table (CP-SAT 5 s per layer: ~3 min)
    .venv/bin/python benchmarks/node_dispatch.py --time-limit 2

For each model and expert-parallel group that spans nodes of 8 GPUs: the bytes one rank sends over
the NICs in the forward dispatch and combine, the serial sum of the layer's collectives and of all
its nodes (forward + backward, passes gate-reorder and sar=paper), and the CP-SAT layer makespan,
for the flat all-to-all, the node-spanning one (``ep_nodes`` = n / 8), that with its dispatch
in FP8 (``compress=ep-fp8``), and that with the attention tensor-parallel within each node
(``attn_nodes`` = n / 8: per-module parallelism; every other row runs SP attention over all n
ranks, across the NICs). Cost model only (no run): the numerics are checked against eager on gloo
ranks in the tests (tests/test_runtime.py, tests/test_node_dispatch.py, tests/test_attn_nodes.py).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moegraph.cost import CostModel  # noqa: E402
from moegraph.ir import ConfigError, Strategy  # noqa: E402
from moegraph.passes import run_pipeline  # noqa: E402
from moegraph.passes.estimate import serial_time_us  # noqa: E402
from moegraph.registry import load_hardware, load_model  # noqa: E402
from moegraph.schedules.api import compile_graph  # noqa: E402
from moegraph.tracer import trace_model  # noqa: E402

# (model, hardware, n, sequences per micro-batch b, s): EP64 as Megatron-Core's DeepSeek-V3 runs it
# (2048 tokens per rank), Kimi-K2 at EP32 and DeepSeek-V2 at EP16 (the same 2048 tokens per rank).
# Qwen3-235B-A22B has 4 kv heads: its attention cannot span its EP32 group, so only the folded row runs.
CASES = (("deepseek-v3", "h100", 64, 32, 4096), ("deepseek-v3", "h800", 64, 32, 4096),
         ("kimi-k2", "h100", 32, 16, 4096), ("deepseek-v2", "h800", 16, 8, 4096),
         ("qwen3-235b-a22b", "h100", 32, 16, 4096))
FP8 = "gate-reorder,compress=ep-fp8,sar=paper"
# (label, attention, ep_nodes, attn_nodes, passes); None: ep_nodes, the group's nodes (n / 8); attn_nodes,
# n over the widest attention a node holds (the GPUs per node, or fewer: as many as divide the kv heads)
VARIANTS = (("flat a2a", "sp", 1, 1, "gate-reorder,sar=paper"), ("ep_nodes", "sp", None, 1, "gate-reorder,sar=paper"),
            ("ep_nodes + ep-fp8", "sp", None, 1, FP8),
            ("+ attention in the node", "tp", None, None, FP8))


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
        cfg = load_model(model)
        widest = math.gcd(cost.hw.gpus_per_node, cfg.heads, cfg.kv_heads)
        for label, attn, ep_nodes, attn_nodes, passes in VARIANTS:
            strategy = Strategy(attn, "ep", "a2a", n, ep_nodes=nodes if ep_nodes is None else ep_nodes,
                                attn_nodes=n // widest if attn_nodes is None else attn_nodes)
            label = label if attn_nodes is not None else f"{label} (TP{widest})"
            try:
                g = run_pipeline(trace_model(load_model(model), strategy, batch=b, seq=s), passes, cost=cost)[0]
            except ConfigError as err:               # the attention cannot span the group: no row but why
                print(f"| {model} | {hw_name} | {n} ({nodes}) | {label} | refused: {str(err).split(';')[0]} | | | | |",
                      flush=True)
                continue
            comm = sum(cost.node_time_us(x) for x in g.nodes if x.is_comm)
            span = compile_graph(g, cost, time_limit_s=args.time_limit).schedule.summary["makespan_us"]
            flat_span = span if label == "flat a2a" else flat_span     # None: the flat layer was refused
            print(f"| {model} | {hw_name} | {n} ({nodes}) | {label} | {nic_bytes(g, cost) / 1e6:.1f} | "
                  f"{comm / 1e3:.2f} | {serial_time_us(g, cost) / 1e3:.2f} | {span / 1e3:.2f} | "
                  + (f"{flat_span / span:.3f}x |" if flat_span else "- |"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
