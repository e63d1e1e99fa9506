"""What one calibration run is asked to do (validated by ``command.options_from_args``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moegraph.runtime.netns import Link

# The least useful budget: rank start-up (torch imported in fresh processes) takes 2-8 s of it.
# Measured on the 2-core VM under load (start-up 5-8 s): 5 s measured 4 of the 12 benchmarks, 2
# cases each (link 0.14 GB/s from two sizes; 8 skipped); 10 s measured 9 of 12 with a few cases
# each, a profile that predicts a fresh GEMM within 3x (tests/test_calibrate.py); 30 s all 12.
MIN_BUDGET_S, MAX_BUDGET_S = 10.0, 3600.0
MAX_RANKS = 64
MIN_IN_STEP_BUDGET_S = 90.0  # below it the microbenchmarks get the whole budget (no in-step stage)


class CalibrationError(RuntimeError):
    """A rank crashed or hung (a bug, not a user error): carries the rank's traceback."""


@dataclass(frozen=True)
class CalibrationOptions:
    device: Literal["cpu", "cuda"] = "cpu"
    backend: Literal["gloo", "nccl"] = "gloo"
    n: int = 2
    time_budget_s: float = 180.0
    base: str = "cpu-gloo"
    dtype: Literal["fp32", "bf16"] = "fp32"
    output: Path = Path("profile.yaml")
    verbose: bool = True
    samples: Path | None = None
    link: Link | None = None          # the emulated link the ranks run on (--link); None: plain loopback

    @property
    def threads(self) -> int:
        """Threads per rank: what moegraph.runtime.launch.spawn gives each of n ranks."""
        return max(1, (os.cpu_count() or 1) // self.n) if self.device == "cpu" else 1


def in_step_enabled(opts: CalibrationOptions) -> bool:
    """Whether the in-step stage (moegraph.runtime.calibrate.steps) runs: CPU ranks, n >= 2 (it
    times real collectives), and a budget that leaves the microbenchmarks enough time."""
    return opts.device == "cpu" and opts.n >= 2 and opts.time_budget_s >= MIN_IN_STEP_BUDGET_S
