"""The family table (issue 27): every MoE causal-LM class of the installed transformers, compiled and
checked against eager, or its one refusal line.

For each class, the tiny model of tests/family_zoo.py (2 layers, h=64, 8 experts top-2, fp32) is
compiled whole with ``moegraph.compile`` under every attn x ffn x dispatch strategy, at n=1 in this
process and at n=2 on gloo ranks (ONE spawn for all), one forward and backward with labels each;
the table gives the largest relative error (||compiled - eager|| / ||eager||) over the strategies of
the logits and of every trainable parameter's gradient. A class the tiny config cannot be built for
from its own defaults says so. Prints a Markdown table (docs/families.md holds its latest output).

    .venv/bin/python benchmarks/families_table.py              # the full matrix (minutes on 2 cores)
    .venv/bin/python benchmarks/families_table.py --quick      # one strategy per family
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

from family_workers import family_cases  # noqa: E402
from family_zoo import moe_causal_lms, tiny_model  # noqa: E402

COMBOS = [("sp", "ep", "a2a"), ("sp", "ep", "ag-rs"), ("sp", "tp", "ag-rs"), ("tp", "ep", "a2a"), ("tp", "ep", "ag-rs"),
          ("tp", "tp", "ag-rs")]
TOL = 1e-5


def outcome_at_n1(family: str, cls: str) -> str | None:
    """The refusal line at n=1 (trace_causal_lm), or None when the family compiles."""
    from moegraph.ir import Strategy
    from moegraph.lowering import LoweringError
    from moegraph.tracer import trace_causal_lm
    try:
        model = tiny_model(family, cls)
    except Exception as err:  # noqa: BLE001 - the class's own config cannot be shrunk from its defaults
        return f"(no tiny config from its defaults: {type(err).__name__}: {' '.join(str(err).split())[:90]})"
    try:
        trace_causal_lm(model, Strategy("sp", "ep", "ag-rs", 1, dtype="fp32"), batch=2, seq=16)
    except LoweringError as err:
        return str(err)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one strategy per family (sp+ep a2a)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    combos = COMBOS[:1] if args.quick else COMBOS
    t0 = time.perf_counter()
    rows, compiled = [], []
    for family, cls in moe_causal_lms():
        refusal = outcome_at_n1(family, cls)
        rows.append((family, cls, refusal))
        if refusal is None:
            compiled.append((family, cls))
    cases = [dict(family=f, cls=c, attn=a, ffn=ff, dispatch=d) for f, c in compiled for a, ff, d in combos]
    n1 = family_cases(0, 1, cases, seed=5)
    from moegraph.runtime.launch import spawn
    n2 = spawn(family_cases, 2, args=(cases, 5), timeout_s=3600)[0]
    worst: dict[str, dict[str, float]] = {}
    for tag, results in (("1", n1), ("2", n2)):
        for res in results:
            w = worst.setdefault(res["case"]["family"], {})
            if "refused" in res:
                w[f"refused{tag}"] = res["refused"]
                continue
            w[f"logits{tag}"] = max(w.get(f"logits{tag}", 0.0), res["logits"], res["loss"])
            w[f"grads{tag}"] = max(w.get(f"grads{tag}", 0.0), res["grads"])
    print(f"| class | outcome | logits n=1 | grads n=1 | logits n=2 | grads n=2 |")
    print("|---|---|---|---|---|---|")
    bad = 0
    for family, cls, refusal in rows:
        if refusal is not None and refusal.startswith("(no tiny config"):
            print(f"| {cls} | not built: {refusal[1:-1]} | | | | |")     # the zoo's limit, not a refusal
            continue
        if refusal is not None:
            print(f"| {cls} | refused: {refusal.replace('|', '/')} | | | | |")
            continue
        w = worst[family]
        if any(k.startswith("refused") for k in w):
            bad += 1
            print(f"| {cls} | REFUSED ON RANKS: {w.get('refused1') or w.get('refused2')} | | | | |")
            continue
        errs = [w["logits1"], w["grads1"], w["logits2"], w["grads2"]]
        ok = all(e < TOL for e in errs)
        bad += not ok
        print(f"| {cls} | {'compiled, matches' if ok else 'MISMATCH'} | " + " | ".join(f"{e:.1e}" for e in errs) + " |")
    print(f"\n{len(compiled)} of {len(rows)} MoE causal LMs compile and match eager within {TOL:g} "
          f"({len(combos)} strategies each at n=1 and n=2); {time.perf_counter() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
