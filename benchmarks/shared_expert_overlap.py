"""Does the scheduler hide the MoE dispatch behind the shared expert? (cost model only, no device)

A Qwen2-57B-A14B-sized Qwen2MoeDecoderLayer (h=3584, 28 heads / 4 kv heads, 64 experts top-8,
h_ffn 2560, shared expert 20480 with its sigmoid gate) is built on the meta device (no weights),
lowered, rewritten by the default passes and scheduled sequentially and by CP-SAT. The shared
expert reads only the block input, so its GEMMs may run while the dispatch and combine
all-to-alls are in flight (Megatron-Core's shared-expert overlap); the script prints where
CP-SAT put them.

    .venv/bin/python benchmarks/shared_expert_overlap.py                     # h800, sp/ep/a2a, n=4, s=4096
    .venv/bin/python benchmarks/shared_expert_overlap.py --attn tp --n 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from moegraph.cost import CostModel  # noqa: E402
from moegraph.ir import Strategy  # noqa: E402
from moegraph.passes import run_pipeline  # noqa: E402
from moegraph.registry import load_hardware  # noqa: E402
from moegraph.schedules.api import compile_graph  # noqa: E402
from moegraph.tracer import trace_module  # noqa: E402

SHOWN = ("dispatch_a2a", "shared_fc1", "shared_fc3", "shared_gate_proj", "fc1", "combine_a2a", "shared_fc2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="h800")
    ap.add_argument("--attn", default="sp", choices=("sp", "tp"))
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--time-limit", type=float, default=20.0)
    args = ap.parse_args()
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer
    cfg = Qwen2MoeConfig(hidden_size=3584, intermediate_size=18944, moe_intermediate_size=2560,
                         shared_expert_intermediate_size=20480, num_attention_heads=28, num_key_value_heads=4,
                         num_experts=64, num_experts_per_tok=8, num_hidden_layers=1)
    with torch.device("meta"):
        layer = Qwen2MoeDecoderLayer(cfg, 0)
    cost = CostModel(load_hardware(args.hardware))
    graph = trace_module(layer, Strategy(args.attn, "ep", "a2a", args.n), batch=1, seq=args.seq, name="qwen2-57b-a14b")
    graph, _ = run_pipeline(graph, "gate-reorder,sar=paper", cost=cost)
    spans = {}
    for method in ("sequential", "cpsat"):
        result = compile_graph(graph, cost, method=method, time_limit_s=args.time_limit)
        spans[method] = result.schedule.makespan_us
        print(f"{method:<11} {result.status:<9} makespan {result.schedule.makespan_us:9.1f} us")
    print(f"cpsat / sequential: {spans['sequential'] / spans['cpsat']:.2f}x")
    print("forward nodes under cpsat (start .. end, us):")
    for node in result.schedule.nodes:
        if node.name in SHOWN:
            print(f"  {node.name:<17} {node.stream:<8} {node.start_us:8.1f} .. {node.end_us:8.1f}")


if __name__ == "__main__":
    main()
