"""Memory of a run: the plan's predicted peak against the CUDA allocator's measured one, and
whether this machine can hold the ranks a run would start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class DeviceMemory:
    """The CUDA allocator over one plan's measured steps on one rank (``measure`` each block):
    the peak (``torch.cuda.max_memory_allocated``, its statistic reset as each block begins) and
    what was already allocated then (resident: the seeded eager module, the layer's shards, the
    inputs), each the largest over the blocks. None until measured (CPU ranks never are: the CPU
    allocator keeps no such statistic)."""

    peak_bytes: int | None = None
    resident_bytes: int | None = None

    def measure(self, steps: Any) -> Any:
        """Run ``steps()`` (a block of timed steps), recording the allocator's peak across it."""
        import torch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        result = steps()
        torch.cuda.synchronize()
        self.peak_bytes = max(self.peak_bytes or 0, torch.cuda.max_memory_allocated())
        self.resident_bytes = max(self.resident_bytes or 0, resident)
        return result

def memory_report(plan: Any, results: list[dict[str, Any]] | None, device: str,
                  checked_budget: int | None = None, plan_index: int = 0) -> dict[str, Any]:
    """The memory fields of run's report: the plan's predicted peak (activations, the cost
    model's accounting) and the budget it was made under, ``checked_budget`` (--memory-budget
    checked against a schedule file's peak), and on CUDA the measured peak and resident bytes
    (``DeviceMemory``), each the largest over the ranks; on the CPU None (not measured)."""
    out: dict[str, Any] = {"predicted_peak_bytes": plan.peak_memory_bytes,
                           "memory_budget_bytes": plan.memory_budget_bytes}
    if checked_budget is not None:
        out["checked_memory_budget_bytes"] = checked_budget
    measured = [r["plans"][plan_index] for r in results or ()] if device == "cuda" else []
    peaks = [m["device_peak_bytes"] for m in measured if m.get("device_peak_bytes") is not None]
    resident = [m["device_resident_bytes"] for m in measured if m.get("device_resident_bytes") is not None]
    out.update({"measured_peak_bytes": max(peaks) if peaks else None,
                "measured_resident_bytes": max(resident) if resident else None, "memory_device": device})
    return out

def format_memory(r: dict[str, Any]) -> str:
    """The report's memory line (``memory_report``'s fields)."""
    from moegraph.options import format_bytes
    made = ("no budget" if r.get("memory_budget_bytes") is None
            else f"a budget of {format_bytes(r['memory_budget_bytes'])}")
    peak = r.get("predicted_peak_bytes")
    line = (f"memory: predicted peak {format_bytes(peak)} of live values, parameters and their gradients not counted"
            if peak is not None
            else "memory: no predicted peak (the plan has no schedule)") + f" (made under {made}"
    if r.get("checked_memory_budget_bytes") is not None:
        line += f"; within --memory-budget {format_bytes(r['checked_memory_budget_bytes'])}"
    line += "); "
    if r.get("measured_peak_bytes") is None:
        return line + f"measured peak: not available on {r.get('memory_device', 'cpu').upper()}"
    return line + (f"measured peak {format_bytes(r['measured_peak_bytes'])} (torch.cuda.max_memory_allocated, largest "
                   f"rank; {format_bytes(r['measured_resident_bytes'])} of it allocated before the steps: weights, "
                   "the eager module, inputs)")

def available_memory_bytes() -> int | None:
    """MemAvailable of this machine (Linux /proc/meminfo), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None

def check_rank_memory(model: Any, layers: int, world: int, *, what: str, available: int | None = None) -> None:
    """UsageError (before any work) when ``world`` local ranks cannot fit in this machine's memory.

    A lower bound, not an estimate: every rank builds the whole seeded module in fp32 before
    sharding it (``seeded_stack``; ``MoETransformer.from_config`` for --train-steps), so it holds
    at least ``layers`` x ``ModelConfig.layer_param_bytes`` at once; activations, gradients and
    shards come on top. Past the machine's available memory the kernel kills a rank minutes in
    (a GPU-sized layer such as mixtral-8x7b on 8 CPU ranks needs ~46 GiB of weights alone)."""
    from moegraph.options import UsageError, format_bytes
    available = available_memory_bytes() if available is None else available
    per_rank = layers * model.layer_param_bytes
    if available is None or world * per_rank <= available:
        return
    stack = f"{layers} layers of {model.name}" if layers > 1 else f"a {model.name} layer"
    raise UsageError(f"{what} on this machine's CPU would hold at least {format_bytes(world * per_rank)}: each rank "
                     f"builds {stack} in fp32 ({format_bytes(per_rank)}) before sharding it, and only "
                     f"{format_bytes(available)} is available; run it on GPUs (--backend nccl) or with a smaller "
                     "--model, --layers or --n")


__all__ = ["DeviceMemory", "available_memory_bytes", "check_rank_memory", "format_memory", "memory_report"]
