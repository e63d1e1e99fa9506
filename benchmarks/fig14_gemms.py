"""Fig 14's GEMM-shape part, measured: every GEMM of one MegaScale-MoE layer under TP+TP and
under SP+EP, timed on one GPU and priced by the cost model (issue 29 items 1 and 5).

Notation (the paper's Table 1): b micro-batch, s sequence, h hidden, f FFN width, n ranks,
m experts, k top-k. Under TP every rank runs all m experts at width f/n over all b*s*k rows;
under EP it runs m/n experts at width f over the rows routed to them (b*s*k/n on average): the
same FLOPs in narrower or fewer, wider products. ``fidelity.py``'s Fig 14 row gives the gain this
costs TP as "GEMM shape"; this benchmark checks the cost model's shape factor on exactly those
products, held out (none of them is in ``benchmarks/data/h200-shapes-2026-11-27.txt``, the grid
the shape fields were fitted to).

Three steps, the middle one on the GPU (torch only, no moegraph):

    python benchmarks/fig14_gemms.py emit > benchmarks/data/fig14-gemm-shapes.txt
    python3 benchmarks/fig14_gemms.py time benchmarks/data/fig14-gemm-shapes.txt > OUT.txt   # on the GPU
    python benchmarks/fig14_gemms.py compare benchmarks/data/h200-fig14-gemms-2026-11-27.txt
    python benchmarks/fig14_gemms.py compare benchmarks/data/h100-fig14-gemms-2026-11-27-run1.txt \
        benchmarks/data/h100-fig14-gemms-2026-11-27-run2.txt --profiles h100,h800

Shape lines: ``E rows cols red`` (``moegraph.efficiency.gemm_shape``: E groups of
y[rows, cols] = x[rows, red] @ w[red, cols]) with ``dense`` or ``grouped``. Timed lines add
the microseconds (CUDA events, 20 calls after 5 warm-up calls). Dense products run as ``x @ w``;
grouped ones as ``torch._grouped_mm`` over E equal row groups where the group spans the rows, and
as ``torch.bmm`` of E uniform products for a weight gradient (its groups split the reduction,
which ``_grouped_mm`` takes as a 2-d by 2-d call; equal groups make the two the same product).
"""

from __future__ import annotations

import sys


def emit() -> None:
    """One line per distinct product of fidelity.py's Fig 14 graphs (b = 1, s = 8192, n = 8)."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import fidelity as F
    from moegraph.efficiency import gemm_shape
    from moegraph.ir import OpKind, Role

    seen: set[tuple] = set()
    print(f"# fig14_gemms emit: fidelity.py's Fig 14 graphs, b={F.B} s={F.S} n={F.N}; E rows cols red kind")
    for model in F.MODELS:
        for attn, ffn, dispatch in (("tp", "tp", "ag-rs"), ("sp", "ep", "a2a")):
            for nd in F.graph(model, attn, ffn, dispatch).nodes:
                if nd.op not in (OpKind.GEMM, OpKind.GROUPED_GEMM) or nd.attr("mnk", None) is None:
                    continue
                kind = "dense" if nd.op is OpKind.GEMM else ("wgrad" if nd.role is Role.WGRAD else "grouped")
                key = (*gemm_shape(nd), kind)
                if key not in seen:
                    seen.add(key)
                    print(*key)


def read_timed(path: str) -> dict[tuple, float]:
    """(E, rows, cols, red, kind) -> microseconds of a ``time`` output file."""
    out = {}
    for line in open(path):
        f = line.split()
        if f and not f[0].startswith("#"):
            out[(int(f[0]), int(f[1]), int(f[2]), int(f[3]), f[4])] = float(f[5])
    return out


PROFILES = ("h200", "nvidia-h200-2026-11-27", "h800-megascale")
"""h200: the registry entry whose shape fields are fitted to the H200 grid; the calibrated H200
profile; h800-megascale, on which fidelity.py's Fig 14 row is priced (its shape fields, its own
peak and Table-3 factor: only its TP/EP ratio compares)."""


def compare(paths: list[str], profiles: tuple[str, ...] = PROFILES) -> None:
    """Per model: the layer's GEMM time under TP+TP over SP+EP, measured (median over the timed
    files) and predicted by each of ``profiles`` with and without its shape factor; then the
    per-product error of the first (a datasheet profile of the GPU that ran them)."""
    import statistics

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import fidelity as F
    from moegraph.cost import CostModel
    from moegraph.efficiency import gemm_shape
    from moegraph.ir import OpKind, Role
    from moegraph.registry import load_hardware

    runs = [read_timed(p) for p in paths]
    measured = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    costs = {name: CostModel(load_hardware(name)) for name in profiles}
    flat = {name: F.ShapelessCost(load_hardware(name)) for name in profiles}
    errors: dict[str, list[float]] = {name: [] for name in profiles} | {f"{n} shapeless": [] for n in profiles}
    print(f"# {len(paths)} timed file(s), each product at its median: {', '.join(paths)}")
    print("| model | TP/EP GEMM time, measured | " + " | ".join(f"{n} (shapeless)" for n in profiles) + " |")
    print("|---|---|" + "---|" * len(profiles))
    for model in F.MODELS:
        tot: dict[str, dict[str, float]] = {}
        for attn, ffn, dispatch in (("tp", "tp", "ag-rs"), ("sp", "ep", "a2a")):
            t = tot.setdefault(ffn, {"measured": 0.0} | {n: 0.0 for n in errors})
            for nd in F.graph(model, attn, ffn, dispatch).nodes:
                if nd.op not in (OpKind.GEMM, OpKind.GROUPED_GEMM) or nd.attr("mnk", None) is None:
                    continue
                kind = "dense" if nd.op is OpKind.GEMM else ("wgrad" if nd.role is Role.WGRAD else "grouped")
                us = measured[(*gemm_shape(nd), kind)]
                t["measured"] += us
                for n in profiles:
                    for label, cm in ((n, costs[n]), (f"{n} shapeless", flat[n])):
                        pred = cm.node_time_us(nd)
                        t[label] += pred
                        errors[label].append(pred / us - 1)
        ratio = {k: tot["tp"][k] / tot["ep"][k] for k in tot["tp"]}
        print(f"| {model} | {ratio['measured']:.3f} ({tot['tp']['measured'] / 1e3:.2f} / {tot['ep']['measured'] / 1e3:.2f} ms) | "
              + " | ".join(f"{ratio[n]:.3f} ({ratio[n + ' shapeless']:.3f})" for n in profiles) + " |")
    print()
    print(f"# per product, {profiles[0]} only: a calibrated profile's kernel_latency_us (~25 us) is the executor's")
    print("# host cost per node, which back-to-back kernels hide; h800-megascale carries Table 3's whole-step factor")
    print("| profile | median abs error per product (every node of both strategies) | max abs error |")
    print("|---|---|---|")
    for label in (profiles[0], f"{profiles[0]} shapeless"):
        e = [abs(x) for x in errors[label]]
        print(f"| {label} | {statistics.median(e):.1%} | {max(e):.1%} |")


def time_file(path: str) -> None:
    """Time every shape line of ``path`` on the current CUDA device (bf16)."""
    import torch

    bf16 = torch.bfloat16
    print("#", torch.__version__, torch.cuda.get_device_name(), "bf16, CUDA events, 20 calls after 5 warm-up")

    def timed_us(fn) -> float:
        for _ in range(5):
            fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) * 1e3 / 20

    for line in open(path):
        f = line.split()
        if not f or f[0].startswith("#"):
            continue
        e, rows, cols, red, kind = int(f[0]), int(f[1]), int(f[2]), int(f[3]), f[4]
        try:
            if kind == "dense":
                x = torch.randn(rows, red, device="cuda", dtype=bf16)
                w = torch.randn(red, cols, device="cuda", dtype=bf16)
                us = timed_us(lambda: x @ w)
            elif kind == "grouped":
                x = torch.randn(e * rows, red, device="cuda", dtype=bf16)
                w = torch.randn(e, cols, red, device="cuda", dtype=bf16).transpose(1, 2)
                offs = torch.arange(rows, e * rows + 1, rows, device="cuda", dtype=torch.int32)
                us = timed_us(lambda: torch._grouped_mm(x, w, offs=offs))
            elif kind == "wgrad":
                x = torch.randn(e, rows, red, device="cuda", dtype=bf16)
                w = torch.randn(e, red, cols, device="cuda", dtype=bf16)
                us = timed_us(lambda: torch.bmm(x, w))
            else:
                raise ValueError(f"unknown kind {kind!r}: dense, grouped or wgrad")
            print(e, rows, cols, red, kind, round(us, 2), flush=True)
        except Exception as exc:  # noqa: BLE001 - record the failure and go on to the next shape
            print("# err", e, rows, cols, red, kind, type(exc).__name__, str(exc).splitlines()[0][:120], flush=True)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "emit":
        emit()
    elif mode == "time" and len(sys.argv) == 3:
        time_file(sys.argv[2])
    elif mode == "compare" and len(sys.argv) >= 3:
        args = sys.argv[2:]
        if "--profiles" in args:             # compare FILES... --profiles a,b,c (first: the GPU's datasheet)
            i = args.index("--profiles")
            compare(args[:i], tuple(args[i + 1].split(",")))
        else:
            compare(args)
    else:
        print("usage: fig14_gemms.py emit | time SHAPES.txt | compare TIMED.txt... [--profiles A,B]", file=sys.stderr)
        sys.exit(2)
