"""MegaScale-MoE Fig 17: whole-step memory per rank with and without selective rematerialization.

    .venv/bin/python benchmarks/pipeline_memory.py

Fig 17 trains Mixtral-8x7B and 8x22B on 128 H800 GPUs and reports, against no SAR, activations
-45.5% / -57.2% and total memory -21.3% / -35% (the paper does not give the pipeline split:
assumed here n=8 SP+EP ag-rs inside a node, Mixtral-8x7B PP=4 x dp=4, 8x22B PP=8 x dp=2, s=8192,
b=1, M=32, 1F1B's in-flight micro-batches, Adam under the distributed optimizer). Per model and
policy: the costliest rank's parameters, fp32 gradients, optimizer states, activations and
buffers (moegraph.memory; no solve), the reductions beside the paper's, and the op-level peak of
one layer's compiled schedule is not included (transients; see moegraph/memory.py).
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moegraph.cost import CostModel  # noqa: E402
from moegraph.passes.edges import add_edges  # noqa: E402
from moegraph.ir import Strategy  # noqa: E402
from moegraph.passes.stack import stack_layers  # noqa: E402
from moegraph.memory import COMPONENTS, edge_activation_bytes, one_f_one_b_in_flight, pipeline_memory  # noqa: E402
from moegraph.models import VOCAB  # noqa: E402
from moegraph.passes.stages import StageLayout  # noqa: E402
from moegraph.registry import load_hardware, load_model  # noqa: E402
from moegraph.schedules.pipeline_model import model_layers  # noqa: E402

MODELS = {"mixtral-8x7b": dict(pp=4, dp=4, paper=(45.5, 21.3)), "mixtral-8x22b": dict(pp=8, dp=2, paper=(57.2, 35.0))}
POLICIES = {"no SAR": "gate-reorder,sar=none", "SAR (paper)": "gate-reorder,sar=paper"}
GIB = 2**30


def rank_peak(model: str, pp: int, dp: int, passes: str, cost: CostModel) -> dict[str, int]:
    cfg = load_model(model)
    layers = model_layers(cfg, Strategy("sp", "ep", "ag-rs", 8, dp=dp), batch=1, seq=8192, passes=passes, cost=cost)
    layout = StageLayout.even(len(layers), pp)
    head = edge_activation_bytes(add_edges(stack_layers(layers[-1], 2), vocab=VOCAB))
    stages = pipeline_memory([[layers[i] for i in s] for s in layout.stages], vocab=VOCAB, tied=False, dp=dp,
                             in_flight=list(one_f_one_b_in_flight(pp, 32)), head_activation_bytes=head)
    worst = max(stages, key=lambda s: s.total)
    return {c: getattr(worst, c) for c in COMPONENTS} | {"total": worst.total, "stage": worst.stage}


def main() -> int:
    cost = CostModel(load_hardware("h800"))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"Fig 17 whole-step memory; {stamp}, {platform.node()} ({os.cpu_count()} cores), "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| model | policy | stage | params | grads | optimizer | activations | buffers | total GiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for model, c in MODELS.items():
        got = {}
        for label, passes in POLICIES.items():
            got[label] = m = rank_peak(model, c["pp"], c["dp"], passes, cost)
            print(f"| {model} | {label} | {m['stage']} | " + " | ".join(f"{m[k] / GIB:.2f}" for k in COMPONENTS)
                  + f" | {m['total'] / GIB:.2f} |")
        a = 1 - got["SAR (paper)"]["activations"] / got["no SAR"]["activations"]
        t = 1 - got["SAR (paper)"]["total"] / got["no SAR"]["total"]
        print(f"| {model} | reduction | | | | | {a:.1%} (paper {c['paper'][0]}%) | | {t:.1%} (paper {c['paper'][1]}%) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
