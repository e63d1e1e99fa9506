"""What the calibration benchmarks produce: measured samples, per-benchmark results, and the
machine they ran on (with the CPU accounting ``moegraph calibrate`` reads its load from).

Notation as in ``benchmarks``: M rows, K/N GEMM features, R expert rows, n ranks.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import socket
from dataclasses import dataclass
from typing import Any

import torch

MEMORY_BOUND_OPS = ("rmsnorm", "rope", "swiglu", "permute", "unpermute", "gate", "add", "cast", "index_map")


@dataclass(frozen=True)
class OverlapMeasure:
    """Compute beside a collective (bench_overlap): seconds of one GEMM alone, its slowdown while
    the collective is in flight, seconds of the collective alone and its stretch beside compute."""

    compute_alone: float
    compute_slowdown: float
    comm_alone: float
    comm_stretch: float
    runs: int


@dataclass(frozen=True)
class Sample:
    """One measured case: the median seconds of one call, and the sizes the cost model sees.

    op: an OpKind value (what the cost model prices it as), or "copy" (plain memcpy, for the
    bandwidth peak) or "overlap". flops / mem_bytes / comm_bytes follow the IR's conventions.
    shape: the measured node's pricing attributes (``moegraph.cost.shape_attrs``: its role, and
    mnk / groups / seq / head_dim as the lowering gives the same op), so the self-check prices the
    sample as the cost model prices that node in a graph.
    """

    bench: str
    op: str
    seconds: float
    flops: float = 0.0
    mem_bytes: float = 0.0
    comm_bytes: float = 0.0
    label: str = ""
    graph: str = ""                             # model_graphs: the layer graph the node belongs to
    overlap: OverlapMeasure | None = None       # the overlap benchmark's measurements
    shape: tuple[tuple[str, Any], ...] = ()     # compute: the node's shape_attrs (role included)


@dataclass(frozen=True)
class MachineInfo:
    """The machine a calibration ran on (``benchmarks.machine_info``), plus the load around it."""

    host: str
    cpu: str
    cores: int
    torch: str
    gpu: str | None = None
    sm_count: int | None = None
    memory_bytes: int | None = None
    load_avg_1m: float | None = None          # before the run
    foreign_load_cores: float | None = None   # cores other processes used during it

    def line(self) -> str:
        return f"{self.host}: {self.gpu or self.cpu}, {self.cores} cores"


@dataclass(frozen=True)
class BenchResult:
    name: str
    samples: tuple[Sample, ...]
    summary: str
    seconds: float
    skipped: str = ""             # why it did not run, or ran only partly ("" = complete)



def machine_info(device: torch.device) -> MachineInfo:
    """Host name, CPU or GPU model, core count, torch version (GPU: SM count and memory)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info = MachineInfo(socket.gethostname(), cpu, os.cpu_count() or 1, torch.__version__)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info = dataclasses.replace(info, gpu=torch.cuda.get_device_name(device), sm_count=props.multi_processor_count,
                                   memory_bytes=int(props.total_memory))
    return info


def cpu_seconds() -> float:
    """User + system CPU seconds this process has used."""
    import resource
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def machine_busy_seconds() -> float | None:
    """CPU seconds all processes of the machine have used since boot (/proc/stat), or None.

    user + nice + system + steal (the hypervisor giving our cores to other guests slows us as
    much as a local job); interrupt time is left out: loopback TCP of our own collectives is
    accounted there, not to our processes."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        user, nice, system, _idle, _iowait, _irq, _softirq, steal = (int(x) for x in fields[:8])
        return (user + nice + system + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None

