"""What benchmarks/gpu_layer.py and gpu_overlap.py share: the device check and the printed table.

(A module beside them, imported through their own folder: on the GPU device python runs with
PYTHONSAFEPATH=1, so the scripts put benchmarks/ on sys.path themselves, never the repo root.)
"""

from __future__ import annotations

from typing import Any, Sequence

from moegraph.options import UsageError


def check_device(device: str) -> None:
    """UsageError (one line) for --device cuda where torch sees no CUDA device."""
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch sees no CUDA device: run on a GPU machine, or pass "
                         "--device cpu (with --tiny for the smoke test)")


def device_name(device: str) -> str:
    import torch
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Rows as a markdown table of ``columns``: floats to 4 significant digits, None as '-'."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
