"""`moegraph run`'s text report (``--json`` prints the dict itself)."""

from __future__ import annotations

from typing import Any

from moegraph.options import format_bytes
from moegraph.runtime.device_memory import format_memory
from moegraph.strategy import node_fields


def format_report(r: dict[str, Any]) -> str:
    if "train_steps" in r:
        return format_train_report(r)
    if "pp" in r:
        from moegraph.runtime.pipeline_run import format_pipeline_report
        return format_pipeline_report(r)
    st = r["strategy"]
    lines = [f"{r['model']} on {r['hardware']}: attn={st['attn']} ffn={st['ffn']} dispatch={st['dispatch']} "
             f"n={r['n']}" + node_fields(st)
             + (f" x dp={r['dp']}" if r.get("dp", 1) > 1 else "")
             + f" b={r['batch']} s={r['seq']} {st['dtype']} backend={r['backend']}"
             + (f" cuda_graphs={r['cuda_graphs']}" if r.get("cuda_graphs", "off") != "off" else "")
             + (f" layers={r['layers']}" if r.get("layers", 1) > 1 else "")
             + (f" link={r['link']}" if r.get("link", "none") != "none" else "")
             + (f" passes={','.join(st['passes'])}" if st["passes"] else ""),
             f"schedule {r['schedule']} (plan {r['plan_hash'][:12]}), {r['steps']} steps after {r['warmup']} warm-up"
             + (f", {r['micro_batches']} micro-batches per step" if r.get("micro_batches", 1) > 1 else ""),
             f"step time: median {r['step_us'] / 1e3:.3f} ms (min {r['step_us_min'] / 1e3:.3f}, "
             f"max {r['step_us_max'] / 1e3:.3f})"
             + (f", predicted {r['predicted_step_us'] / 1e3:.3f} ms" if r.get("predicted_step_us") else ""),
             format_memory(r)]
    if r.get("prediction_note"):
        lines.insert(3, f"note: {r['prediction_note']}")
    if r.get("fused_groups"):
        lines.append(f"{r['fused_groups']} {r['executed_as']}")
    if r.get("expert_rows", "exact") != "exact":
        lines.append(f"expert rows {r['expert_rows']}: {format_bytes(r['padded_rows_extra_bytes'])} of expert-row "
                     "buffers per step beyond the plan's memory accounting")
    if "max_rel_err_output" in r:
        lines.append(("check vs eager gradient accumulation" if r.get("micro_batches", 1) > 1 else "check vs eager")
                     + f": max rel err output {r['max_rel_err_output']:.2e}, "
                     f"grads {r['max_rel_err_grads']:.2e} (worst: {r['worst_grad']})")
        if r.get("near_zero_grads"):
            lines.append(f"  analytically zero gradients {', '.join(r['near_zero_grads'])}: error "
                         f"{r['max_err_near_zero_grads']:.1e} of the largest gradient norm")
    if "prediction" in r:
        pr = r["prediction"]
        lines += ["", f"{'node':<34} {'stream':<8} {'predicted us':>13} {'measured us':>12} {'error':>8}"]
        for row in pr["nodes"]:
            err = "" if row["rel_err"] is None else f"{row['rel_err'] * 100:+.0f}%"
            lines.append(f"{row['name']:<34} {row['stream']:<8} {row['predicted_us']:>13.1f} "
                         f"{row['measured_us']:>12.1f} {err:>8}")
        t = pr["total"]
        if t["predicted_us"] is not None:
            lines.append(f"{'total (makespan vs step)':<43} {t['predicted_us']:>13.1f} {t['measured_us']:>12.1f} "
                         f"{t['rel_err'] * 100:+7.0f}%")
        if pr["mean_abs_rel_err"] is not None:
            lines.append(f"mean |per-node error|: {pr['mean_abs_rel_err'] * 100:.0f}%")
    if "trace" in r:
        tr = r["trace"]
        which = (f"step {tr['step']} ({tr['step_us'] / 1e3:.3f} ms, "
                 + (f"the faster of the two middle steps of {tr['of_steps']}" if tr["of_steps"] % 2 == 0
                    else "the median step") + ")") if "step" in tr else "the median step"
        lines.append(f"trace of {which}: {tr['schedule']} (measured schedule)"
                     + (f", {tr['predicted']} (predicted)" if "predicted" in tr else "")
                     + f", {tr['chrome']} (Chrome trace)")
    return "\n".join(lines)


def format_train_report(r: dict[str, Any]) -> str:
    st = r["strategy"]
    lines = [f"{r['model']} ({r['layers']} layers, vocab {r['vocab']}) on {r['hardware']}: attn={st['attn']} "
             f"ffn={st['ffn']} dispatch={st['dispatch']} n={r['n']}"
             + node_fields(st)
             + (f" x dp={r['dp']}" if r.get("dp", 1) > 1 else "")
             + f" b={r['batch']} s={r['seq']} {st['dtype']}"
             + (f" passes={','.join(st['passes'])}" if st["passes"] else ""),
             f"schedule {r['schedule']} (plan {r['plan_hash'][:12]}), {r['train_steps']} AdamW steps"
             + (f" of {r['micro_batches']} micro-batches (one merged plan each)"
                if r.get("micro_batches", 1) > 1 else "")
             + f" in {r['seconds']:.2f} s",
             format_memory(r),
             "losses: " + ", ".join(f"{x:.5f}" if isinstance(x, float) else "[" + ", ".join(f"{y:.5f}" for y in x) + "]"
                                    for x in r["losses"])]
    if "max_rel_err_loss" in r:
        what = "training with gradient accumulation" if r.get("micro_batches", 1) > 1 else "training"
        lines.append(f"check vs eager {what}: max rel err loss {r['max_rel_err_loss']:.2e}, final params "
                     f"{r['max_rel_err_params']:.2e} (worst: {r['worst_param']}), first-step grads "
                     f"{r['max_rel_err_grads']:.2e} (worst: {r['worst_grad']})")
    return "\n".join(lines)


__all__ = ["format_report", "format_train_report"]
