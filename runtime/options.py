"""``RuntimeOptions``: how a compiled layer runs, apart from what was compiled.

The runtime gets an execution plan and its graph (``moegraph.schedules.driver`` built them from a
``CompileConfig``) and these: settings that change how the plan executes on this machine, never
what it computes or in which order. Torch-free, so the CLI and ``moegraph.compile`` can build
one before any rank starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moegraph.ir import EXPERT_ROWS, ExpertRows
from moegraph.runtime import CUDA_GRAPH_MODES, CudaGraphs


@dataclass(frozen=True)
class RuntimeOptions:
    """Runtime-only settings of a compiled layer or model; validated (ValueError naming each)."""

    timeout_s: float = 300.0
    """How long any collective may take before a CollectiveTimeout names it."""
    record: bool = True
    """Record per-node start/end events of each step (traces, ``run --trace``)."""
    cuda_graphs: CudaGraphs = "off"
    """Replay CUDA graphs of static-shape segments ('attention') or whole phases ('layer');
    CUDA devices and one-micro-batch layers only (moegraph.runtime.cudagraph)."""
    expert_rows: ExpertRows = "exact"
    """Rows of ffn='ep' ag-rs local index maps: this step's routed rows, or the static worst case
    ('padded', no host read; moegraph.kernels.build_index_map)."""
    emulate: frozenset[str] = field(default_factory=frozenset)
    """Collective kinds run by their emulation instead of the backend's (moegraph.runtime.collectives)."""

    def __post_init__(self):
        problems = []
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            problems.append(f"timeout_s={t!r} must be a positive number of seconds")
        if not isinstance(self.record, bool):
            problems.append(f"record={self.record!r} must be True or False")
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            problems.append(f"cuda_graphs={self.cuda_graphs!r} is not one of {', '.join(map(repr, CUDA_GRAPH_MODES))}")
        if self.expert_rows not in EXPERT_ROWS:
            problems.append(f"expert_rows={self.expert_rows!r} is not one of {', '.join(map(repr, EXPERT_ROWS))}")
        if not isinstance(self.emulate, frozenset):
            problems.append(f"emulate={self.emulate!r} must be a frozenset of collective kinds")
        if problems:
            raise ValueError("; ".join(problems))


__all__ = ["RuntimeOptions"]
