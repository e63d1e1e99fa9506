"""Where does all-gather/reduce-scatter dispatch beat all-to-all? (cost model only, no device)

For top-k 1..E (capped by --max-k) the layer is lowered both ways and priced with the same
estimate ``dispatch=auto`` uses: the serial sum of every node's cost-model time, forward +
backward (passes/estimate.py). The table also gives the FFN's forward bytes per rank and the
FFN collectives' own time, and the script names the smallest top-k from which ag-rs wins.
MegaScale-MoE Fig 7 measures the crossover for Mixtral-8x7B on its cluster at top-k > 6.

    .venv/bin/python benchmarks/dispatch_crossover.py                       # Mixtral-8x7B, h800, n=8
    .venv/bin/python benchmarks/dispatch_crossover.py --hardware a100 --n 4
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moegraph.cost import CostModel  # noqa: E402
from moegraph.ir import Phase, Strategy  # noqa: E402
from moegraph.registry import load_hardware, load_model  # noqa: E402
from moegraph.tracer import trace_model  # noqa: E402
from moegraph.passes.estimate import serial_time_us  # noqa: E402

MODES = ("a2a", "ag-rs")


def measure(model, hw_name: str, n: int, attn: str, batch: int, seq: int, max_k: int) -> list[dict]:
    cost = CostModel(load_hardware(hw_name))
    rows = []
    for k in range(1, min(max_k, model.experts) + 1):
        cfg = dataclasses.replace(model, top_k=k)
        row = {"k": k}
        for mode in MODES:
            g = trace_model(cfg, Strategy(attn, "ep", mode, n), batch=batch, seq=seq)
            ffn_comm = [nd for nd in g.nodes if nd.is_comm and nd.block == "ffn" and nd.attr("dp", False) is False]
            row[mode] = {"total_us": serial_time_us(g, cost),
                         "ffn_comm_us": sum(cost.node_time_us(nd) for nd in ffn_comm),
                         "ffn_fwd_bytes": sum(nd.comm_bytes for nd in ffn_comm if nd.phase is Phase.FORWARD)}
        row["winner"] = min(MODES, key=lambda m: row[m]["total_us"])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mixtral-8x7b")
    p.add_argument("--hardware", default="h800")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--attn", default="sp", choices=("sp", "tp"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--max-k", type=int, default=8)
    args = p.parse_args(argv)
    model = load_model(args.model)
    rows = measure(model, args.hardware, args.n, args.attn, args.batch, args.seq, args.max_k)
    print(f"{model.name} on {args.hardware}: attn={args.attn} ffn=ep n={args.n} b={args.batch} s={args.seq}; "
          "predicted forward+backward time of the layer (serial sum of node times, us)")
    print(f"{'top-k':>5} {'a2a us':>10} {'ag-rs us':>10} {'a2a-agrs':>9} {'a2a ffn comm':>13} "
          f"{'agrs ffn comm':>14} {'a2a MB fwd':>11} {'agrs MB fwd':>12}  winner")
    for r in rows:
        a, g = r["a2a"], r["ag-rs"]
        print(f"{r['k']:>5} {a['total_us']:>10.1f} {g['total_us']:>10.1f} {a['total_us'] - g['total_us']:>9.1f} "
              f"{a['ffn_comm_us']:>13.1f} {g['ffn_comm_us']:>14.1f} {a['ffn_fwd_bytes'] / 1e6:>11.1f} "
              f"{g['ffn_fwd_bytes'] / 1e6:>12.1f}  {r['winner']}")
    cross = next((r["k"] for r in rows if r["winner"] == "ag-rs"), None)
    if cross is None:
        print(f"a2a wins for every top-k up to {rows[-1]['k']}")
    else:
        print(f"crossover: ag-rs wins from top-k {cross} (a2a below it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
