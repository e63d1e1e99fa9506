"""The SM budgets this runtime can really give a collective, per backend.

A schedule gives every collective an SM budget b (``moegraph.cost``: b SMs drive its transfers;
b = 0: copy engines, no SM). On NCCL the runtime pins a communicator's CTAs (one SM each) with
``ProcessGroupNCCL.Options().config.min_ctas = max_ctas`` (``nccl_ctas``). It has no copy-engine
path: NCCL >= 2.28 runs all-gather and all-to-all on copy engines only for a communicator with the
zero-CTA policy whose buffers live in registered symmetric-memory windows (docs/runtime.md, "SM
budgets"), which this runtime does not set up (checking it needs two GPUs). Budget 0 would run on
the one CTA ``min_ctas`` allows: one SM's share of a ring, not the copy-engine rate the schedule
priced it at (a ring saturates at comm_sm_saturation, 16 SMs on the GPU profiles). So a plan
compiled where it runs on NCCL leaves budget 0 out (``runnable_config``: the config's
``copy_engines=False``, which `moegraph compile --no-copy-engines` also sets for a plan made
elsewhere), and a plan that gives a NCCL collective budget 0 is refused (``check_native_budgets``),
never run at a rate nobody priced. gloo does not enforce budgets (its schedules record them): unchanged.
"""

from __future__ import annotations

from typing import Iterable

import torch.distributed as dist

from moegraph.config import CompileConfig
from moegraph.runtime import PlanError

NCCL_MAX_CTAS = 32          # NCCL caps CTAs per collective at its channel count (MAXCHANNELS: 32, or 64 on newer NCCL)


def nccl_ctas(budget: int) -> int:
    """The CTA count (= SMs) a NCCL communicator gets for an SM budget: pinned by ``min_ctas`` =
    ``max_ctas``; budgets above NCCL's channel limit become that limit. Budget 0 (copy engines)
    has no CTA count: this runtime does not run copy-engine collectives (module docstring)."""
    if budget < 1:
        raise PlanError(f"SM budget {budget}: a NCCL collective here runs on 1 to {NCCL_MAX_CTAS} SMs "
                        "(budget 0, copy engines, is not run by this runtime; docs/runtime.md, 'SM budgets')")
    return min(budget, NCCL_MAX_CTAS)


def world_backend() -> str | None:
    """The default process group's backend when several ranks run, else None."""
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return dist.get_backend() if several else None


def runnable_config(config: CompileConfig, backend: str | None) -> CompileConfig:
    """``config`` planned for what ``backend`` runs: on NCCL its collectives on SMs only
    (``copy_engines=False``: ``Hardware.without_copy_engines``); as is elsewhere. Every front door
    that compiles a plan to run on ranks calls it with the ranks' backend (None: one process)."""
    return config.replace(copy_engines=False) if backend == "nccl" and config.copy_engines else config


def check_native_budgets(keys: Iterable[tuple[str, int]], backend: str) -> None:
    """Refuse a plan whose collectives ``backend`` cannot run at their budget: on NCCL, budget 0
    (a schedule made for copy engines, e.g. a schedule file compiled for a GPU profile)."""
    if backend != "nccl":
        return
    streams = sorted({stream for stream, budget in keys if budget == 0})
    if streams:
        raise PlanError(f"the plan gives collectives on stream(s) {', '.join(streams)} SM budget 0 (copy engines), "
                        "which this runtime does not run on NCCL (docs/runtime.md, 'SM budgets'): compile it with "
                        "`moegraph compile --no-copy-engines` (CompileConfig(copy_engines=False)), or on these ranks "
                        "(moegraph.compile and `moegraph run --backend nccl` leave budget 0 out)")
