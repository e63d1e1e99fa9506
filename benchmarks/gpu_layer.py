"""Compiled single-GPU layer vs eager (issue 17): Mixtral-8x7B layer sizes, bf16, forward+backward.

One process, one device, n=1 (no collectives): the eager ``MoETransformerLayer`` (moegraph.models,
seeded as ``moegraph run`` seeds it) against ``moegraph.compile`` of the same module under the
sequential, greedy and cpsat schedules, and on CUDA the last of them again with its forward and
backward captured as CUDA graphs (``--cuda-graphs``, default 'layer'; runtime/cudagraph.py).
Every compiled variant uses ffn=tp, dispatch=ag-rs: at n=1 tp and ep hold the same experts at
full f, and tp's index map has a static row count (ep's reads its row count on the host, which
'layer' capture refuses with exact expert rows). Steps are timed INTERLEAVED (eager, sequential, greedy,
cpsat, eager, ...) after a warm-up, so clock and thermal drift hit every variant alike; each step
is timed with CUDA events around forward+backward (CPU: the host clock). The table gives the
median step, the ratio compiled/eager (the issue's bar: <= 1.0), the executor's host time per
node (``runtime.executor.HostTime``, as ``moegraph run --json`` reports it: on GPU the Python and
launch cost of issuing a node) and the worst relative error against eager (output, input
gradient, every parameter gradient: ``runtime.check.check_against_eager``).

Sizes. ``--scale S`` divides h and f by S and keeps the head width (128): heads and kv heads are
divided too, so S must divide kv_heads = 8. The default is the smallest S whose rough memory
estimate (``memory_estimate``: eager + one copy per schedule of the weights and their gradients,
plus one step's activations) fits in 60 GiB; at b=2, s=4096 that is S=1, the real layer.

Tolerance. bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3); eager and compiled round
intermediates at different points and sum in different orders, and a token whose top-2 scores
nearly tie may pick another expert, so the worst gradient differs by up to a few percent:
BF16_TOL = 5e-2 (reported, flagged, not enforced). fp32 (``--tiny``, CPU): 1e-5.

    python benchmarks/gpu_layer.py                              # CUDA, bf16, Mixtral sizes
    python benchmarks/gpu_layer.py --scale 2 --steps 30 --json out.json
    python benchmarks/gpu_layer.py --device cpu --tiny          # smoke test: tiny layer, fp32, CPU

Notation: b batch, s sequence, h hidden, f expert ffn width, k top-k.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moegraph.cli import OneLineParser
from moegraph.options import UsageError, check_output, format_bytes, positive_int, positive_float
from moegraph.runtime.trace import write_json

# moegraph is imported as installed (editable here; on the GPU device a --target copy, which the
# repo root's folder moegraph/ would shadow: never put the root on sys.path, docs/gpu.md)
sys.path.insert(0, str(Path(__file__).resolve().parent))       # gpu_common, beside this file
from gpu_common import check_device, device_name, markdown_table  # noqa: E402

SCHEDULES = ("sequential", "greedy", "cpsat")
BF16_TOL, FP32_TOL = 5e-2, 1e-5
MEMORY_TARGET = 60 * 2**30
SCALES = (1, 2, 4, 8)                       # divisors of Mixtral's 8 kv heads
COLUMNS = ("variant", "median_ms", "ratio_vs_eager", "host_us_per_node", "max_rel_err")


@dataclass(frozen=True)
class Setup:
    device: str
    dtype: str                  # "bf16" | "fp32"
    model: Any                  # registry ModelConfig, already scaled
    scale: int
    b: int
    s: int
    steps: int
    warmup: int
    time_limit_s: float
    schedules: tuple[str, ...]
    cuda_graphs: str            # "off", "attention", "layer": the extra graphed variant's mode
    json_path: Path | None


def scaled(cfg: Any, scale: int) -> Any:
    """h, f, heads and kv heads divided by ``scale``; the head width kept."""
    if cfg.kv_heads % scale:
        raise UsageError(f"--scale {scale} must divide {cfg.name}'s kv_heads={cfg.kv_heads} (one of "
                         f"{', '.join(str(d) for d in SCALES if cfg.kv_heads % d == 0)})")
    head_dim = cfg.head_dim or cfg.hidden // cfg.heads
    return dataclasses.replace(cfg, hidden=cfg.hidden // scale, ffn_hidden=cfg.ffn_hidden // scale,
                               heads=cfg.heads // scale, kv_heads=cfg.kv_heads // scale, head_dim=head_dim)


def param_count(cfg: Any) -> int:
    import torch
    from moegraph.models import MoETransformerLayer
    with torch.device("meta"):
        return sum(p.numel() for p in MoETransformerLayer.from_config(cfg).parameters())


def memory_estimate(cfg: Any, b: int, s: int, variants: int, elem_bytes: int) -> int:
    """Rough bytes on the device: ``variants`` copies of weights and gradients (eager + one
    compiled layer per schedule), plus one step's saved activations, taken as 16 h-wide and
    4 k*f-wide tensors per token, doubled for the backward's transients."""
    weights = param_count(cfg) * elem_bytes * 2 * variants
    tokens = b * s
    acts = tokens * (16 * cfg.hidden + 4 * cfg.top_k * cfg.ffn_hidden) * elem_bytes * 2
    return weights + acts


def parse(argv: list[str] | None) -> Setup:
    p = OneLineParser(prog="gpu_layer.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="the registry's tiny layer (fp32): a smoke test")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="default: bf16 on cuda, fp32 on cpu or with --tiny")
    p.add_argument("--scale", type=positive_int, default=None,
                   help=f"divide h, f and the head counts (one of {SCALES}; default: fits 60 GiB)")
    p.add_argument("-b", "--batch", type=positive_int, default=None, help="default 2 (tiny: 2)")
    p.add_argument("-s", "--seq", type=positive_int, default=None, help="default 4096 (tiny: 16)")
    p.add_argument("--steps", type=positive_int, default=None, help="timed steps per variant (default 20, tiny 3)")
    p.add_argument("--warmup", type=positive_int, default=None, help="default 3 (tiny 1)")
    p.add_argument("--time-limit", type=positive_float, default=None, help="cpsat seconds (default 10, tiny 2)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of %(default)s")
    p.add_argument("--cuda-graphs", choices=("off", "attention", "layer"), default=None,
                   help="mode of the extra graphed variant of the last schedule (default: layer on cuda, off on cpu)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    try:
        check_device(args.device)
        schedules = tuple(m.strip() for m in args.schedules.split(",") if m.strip())
        bad = [m for m in schedules if m not in SCHEDULES]
        if bad or not schedules:
            raise UsageError(f"--schedules {args.schedules!r}: each must be one of {', '.join(SCHEDULES)}")
        json_path = check_output(args.json, suffixes=(".json",), flag="--json") if args.json else None
        from moegraph.registry import load_model
        tiny = args.tiny
        b = args.batch or 2
        s = args.seq or (16 if tiny else 4096)
        dtype = args.dtype or ("fp32" if tiny or args.device == "cpu" else "bf16")
        graphs = args.cuda_graphs or ("layer" if args.device == "cuda" else "off")
        if graphs != "off" and args.device != "cuda":
            raise UsageError(f"--cuda-graphs {graphs} needs --device cuda (CUDA graphs capture device work)")
        variants = 1 + len(schedules) + (graphs != "off")
        base = load_model("tiny" if tiny else "mixtral-8x7b")
        if args.scale is not None:
            scale = args.scale
            if scale not in SCALES:
                raise UsageError(f"--scale {scale} is not one of {', '.join(map(str, SCALES))}")
        elif tiny:
            scale = 1
        else:
            elem = 2 if dtype == "bf16" else 4
            fits = [d for d in SCALES if memory_estimate(scaled(base, d), b, s, variants, elem)
                    <= MEMORY_TARGET]
            if not fits:
                raise UsageError(f"b={b}, s={s} do not fit {format_bytes(MEMORY_TARGET)} at any --scale in {SCALES}: "
                                 "lower -b or -s")
            scale = fits[0]
        return Setup(args.device, dtype, scaled(base, scale), scale, b, s, args.steps or (3 if tiny else 20),
                     args.warmup or (1 if tiny else 3), args.time_limit or (2.0 if tiny else 10.0), schedules,
                     graphs, json_path)
    except UsageError as err:
        p.exit(2, f"gpu_layer.py: error: {err}\n")


class StepTimer:
    """Times one call on the device: CUDA events (read after the run), or the host clock (CPU)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def time(self, fn: Callable[[], None]) -> Any:
        import torch
        if not self.cuda:
            t0 = time.perf_counter_ns()
            fn()
            return (time.perf_counter_ns() - t0) / 1e6
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        return (start, end)

    @staticmethod
    def ms(t: Any) -> float:
        return t if isinstance(t, float) else t[0].elapsed_time(t[1])


def train_step(module: Any, x: Any, dy: Any) -> None:
    """Forward + backward of the full layer (n=1: the shard is the whole input)."""
    for q in module.parameters():
        q.grad = None
    xs = x.detach().requires_grad_(True)
    module(xs).backward(dy)


def run(setup: Setup) -> list[dict[str, Any]]:
    import torch
    import moegraph
    from moegraph.runtime.check import check_against_eager
    from moegraph.runtime.reference import seeded_layer
    z = setup
    cuda = z.device == "cuda"
    dev = torch.device(z.device)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[z.dtype]
    if cuda:
        # fp32 comparisons mean fp32: TF32 would make eager and compiled differ by 1e-3
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with dev:                   # built on the device: Mixtral's 1.45B parameters never touch the host
        eager = seeded_layer(z.model, 0, z.dtype).to(dev)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(z.b, z.s, z.model.hidden, generator=gen).to(dev, torch_dtype)       # [b, s, h]
    dy = torch.randn(z.b, z.s, z.model.hidden, generator=gen).to(dev, torch_dtype)
    variants: dict[str, Any] = {"eager": eager}
    # ffn=tp: the module docstring says why
    for m in z.schedules:
        variants[m] = moegraph.compile(eager, x, hardware="h100", ffn="tp", schedule=m,
                                       time_limit_s=z.time_limit_s, record=False)
    if z.cuda_graphs != "off":
        m = z.schedules[-1]
        try:
            variants[f"{m}+graphs:{z.cuda_graphs}"] = moegraph.compile(
                eager, x, hardware="h100", ffn="tp", schedule=m, time_limit_s=z.time_limit_s, record=False,
                cuda_graphs=z.cuda_graphs)
        except ValueError as err:           # a refusal names its node: print it, keep the other rows
            print(f"# cuda graphs ({z.cuda_graphs}) refused: {err}")
    timer = StepTimer(cuda)
    for _ in range(z.warmup):
        for mod in variants.values():
            train_step(mod, x, dy)
    for name, mod in variants.items():
        if name != "eager":
            mod.executor.host.reset()
    times: dict[str, list[Any]] = {k: [] for k in variants}
    for _ in range(z.steps):                              # interleaved: step i of every variant, then i+1
        for name, mod in variants.items():
            times[name].append(timer.time(lambda: train_step(mod, x, dy)))
    if cuda:
        torch.cuda.synchronize()
    med = {k: statistics.median(StepTimer.ms(t) for t in ts) for k, ts in times.items()}
    rows = []
    for name, mod in variants.items():
        row: dict[str, Any] = {"variant": name, "median_ms": med[name], "ratio_vs_eager": med[name] / med["eager"],
                               "host_us_per_node": None, "max_rel_err": None}
        if name != "eager":
            row["host_us_per_node"] = mod.executor.host.us_per_node()
            rep = check_against_eager(eager, mod, x, dy)
            row["max_rel_err"] = max(rep["max_rel_err_output"], rep["max_rel_err_grads"])
            row["nodes"] = len(mod.graph.nodes)
        rows.append(row)
    return rows




def main(argv: list[str] | None = None) -> int:
    setup = parse(argv)
    import torch
    cfg = setup.model
    tol = BF16_TOL if setup.dtype == "bf16" else FP32_TOL
    device = device_name(setup.device)
    elem = 2 if setup.dtype == "bf16" else 4
    est = memory_estimate(cfg, setup.b, setup.s, 1 + len(setup.schedules) + (setup.cuda_graphs != "off"), elem)
    print(f"# gpu_layer: {cfg.name} / scale {setup.scale}: h={cfg.hidden} heads={cfg.heads} kv_heads={cfg.kv_heads} "
          f"head_dim={cfg.head_dim} f={cfg.ffn_hidden} experts={cfg.experts} k={cfg.top_k}; b={setup.b} "
          f"s={setup.s} {setup.dtype}; {param_count(cfg) / 1e6:.1f}M params; estimate {format_bytes(est)}")
    print(f"# device {device}, torch {torch.__version__}; {setup.steps} steps interleaved after {setup.warmup} "
          f"warm-up; tolerance {tol:g}")
    rows = run(setup)
    print(markdown_table(rows, COLUMNS))
    worst = max((r["max_rel_err"] for r in rows if r["max_rel_err"] is not None), default=0.0)
    best = min(r["ratio_vs_eager"] for r in rows if r["variant"] != "eager")
    print(f"# best compiled/eager {best:.3f} (bar: <= 1.0); worst rel err {worst:.2e} "
          f"({'within' if worst <= tol else 'ABOVE'} tolerance {tol:g})")
    if setup.device == "cuda":
        print(f"# peak memory {format_bytes(torch.cuda.max_memory_allocated())}")
    if setup.json_path is not None:
        write_json(setup.json_path, {"device": device, "torch": torch.__version__, "dtype": setup.dtype,
                                     "scale": setup.scale, "b": setup.b, "s": setup.s,
                                     "model": cfg.to_dict(), "tolerance": tol, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
