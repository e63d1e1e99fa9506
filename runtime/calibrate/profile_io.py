"""The files calibration writes and reads: the profile YAML, the raw samples JSON, and the
structured facts (what was measured, on what, how) a profile records.

A profile's ``measured`` mapping has three text keys (date, machine, notes: the registry's
schema). ``CalibrationFacts`` is the typed value behind them: calibration builds it, writes it
into ``notes`` as ``key=value`` items separated by "; " (then free-text remarks), and
``read_facts`` parses a profile file's notes back into it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from moegraph.atomic import write_atomic
from moegraph.registry import Hardware
from moegraph.runtime.calibrate.results import BenchResult, MachineInfo, OverlapMeasure, Sample
from moegraph.runtime.calibrate.options import CalibrationOptions

__all__ = ["CalibrationFacts", "Profile", "read_facts", "write_profile", "write_samples",
           "read_samples"]


def _num(x: float | None, fmt: str) -> str:
    return "?" if x is None else format(x, fmt)


def _opt_float(text: str) -> float | None:
    return None if text in ("?", "") else float(text)


def _items(text: str) -> tuple[str, ...]:
    inner = text.strip().removeprefix("[").removesuffix("]").strip()
    return tuple(x.strip() for x in inner.split(", ")) if inner else ()


@dataclass(frozen=True)
class CalibrationFacts:
    """How a profile was measured. ``remarks`` are the fit's free-text explanations."""

    dtype: str
    device: str
    backend: str
    n: int
    threads_per_rank: int
    torch: str
    host: str
    cpu: str
    time_budget_s: float
    wall_s: float
    load_avg_1m_before: float | None
    foreign_load_cores: float | None
    unmeasured: tuple[str, ...]
    skipped: tuple[str, ...]
    time: str                                  # ISO 8601, seconds, with the UTC offset
    machine: str = ""
    remarks: tuple[str, ...] = ()

    @classmethod
    def of_run(cls, opts: CalibrationOptions, info: MachineInfo, wall_s: float, unmeasured: Sequence[str],
               skipped: Sequence[str], remarks: Sequence[str]) -> "CalibrationFacts":
        now = datetime.datetime.now().astimezone()
        return cls(opts.dtype, opts.device, opts.backend, opts.n, opts.threads, info.torch, info.host, info.cpu,
                   opts.time_budget_s, round(wall_s, 1), info.load_avg_1m, info.foreign_load_cores,
                   tuple(unmeasured), tuple(skipped), now.isoformat(timespec="seconds"), info.line(),
                   tuple(remarks))

    def with_remark(self, text: str) -> "CalibrationFacts":
        return dataclasses.replace(self, remarks=self.remarks + (text,))

    def notes(self) -> str:
        items = [f"dtype={self.dtype} (peak_flops_bf16 holds the measured {self.dtype} peak)",
                 f"device={self.device}", f"backend={self.backend}", f"n={self.n}",
                 f"threads_per_rank={self.threads_per_rank}", f"torch={self.torch}", f"host={self.host}",
                 f"cpu={self.cpu}", f"time_budget_s={self.time_budget_s:g}", f"wall_s={self.wall_s:.1f}",
                 f"load_avg_1m_before={_num(self.load_avg_1m_before, '.2f')}",
                 f"foreign_load_cores={_num(self.foreign_load_cores, '.2f')}",
                 f"unmeasured=[{', '.join(self.unmeasured)}]", f"skipped=[{', '.join(self.skipped)}]",
                 f"time={self.time}"]
        return "; ".join(items + list(self.remarks))

    def measured(self) -> dict[str, str]:
        """The profile's ``measured`` mapping."""
        return {"date": self.time[:10], "machine": self.machine, "notes": self.notes()}

    @classmethod
    def from_measured(cls, measured: dict[str, str]) -> "CalibrationFacts":
        """Parse a ``measured`` mapping written by ``measured()``; ValueError naming what is missing."""
        notes = measured.get("notes", "")
        kv: dict[str, str] = {}
        rest = []
        for item in notes.split("; "):
            key, sep, value = item.partition("=")
            if sep and key in _FACT_KEYS and key not in kv and not rest:
                kv[key] = value
            else:
                rest.append(item)
        # remarks may contain "; " themselves: what follows the facts comes back as one remark
        remarks = ("; ".join(rest),) if rest else ()
        missing = [k for k in _FACT_KEYS if k not in kv]
        if missing:
            raise ValueError(f"measured.notes has no {', '.join(missing)} (not written by moegraph calibrate?)")
        return cls(kv["dtype"].split(" ")[0], kv["device"], kv["backend"], int(kv["n"]), int(kv["threads_per_rank"]),
                   kv["torch"], kv["host"], kv["cpu"], float(kv["time_budget_s"]), float(kv["wall_s"]),
                   _opt_float(kv["load_avg_1m_before"]), _opt_float(kv["foreign_load_cores"]),
                   _items(kv["unmeasured"]), _items(kv["skipped"]), kv["time"], measured.get("machine", ""),
                   tuple(remarks))


_FACT_KEYS = ("dtype", "device", "backend", "n", "threads_per_rank", "torch", "host", "cpu", "time_budget_s",
              "wall_s", "load_avg_1m_before", "foreign_load_cores", "unmeasured", "skipped", "time")


def read_facts(hw: Hardware) -> CalibrationFacts:
    """The facts of a calibrated profile (``load_hardware(path)``); ValueError if it has none."""
    return CalibrationFacts.from_measured(dict(hw.measured))


@dataclass(frozen=True)
class Profile:
    """A fitted profile: the Hardware fields (plain types, as load_hardware reads them) and the facts."""

    fields: dict[str, Any]
    facts: CalibrationFacts
    description: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {**self.fields, "description": self.description, "measured": self.facts.measured()}

    def hardware(self) -> Hardware:
        """Validated exactly as load_hardware will (same checks, same errors)."""
        data = {k: v for k, v in self.as_dict().items() if k != "name"}
        return Hardware(name=self.fields["name"], **data)

    def with_fields(self, **changes: Any) -> "Profile":
        return dataclasses.replace(self, fields={**self.fields, **changes})

    def with_remark(self, text: str) -> "Profile":
        return dataclasses.replace(self, facts=self.facts.with_remark(text))


# --- output ------------------------------------------------------------------------------------

def write_profile(path: Path, profile: Profile, results: Sequence[BenchResult], checks: Sequence[Any]) -> None:
    """The YAML profile with a comment header: benchmarks run and the self-check (``checks``: objects
    with ``line()``)."""
    doc = profile.as_dict()
    head = [f"# Hardware profile written by `moegraph calibrate` on {doc['measured']['date']}.",
            f"# {doc['description']}",
            "# Load it with moegraph.registry.load_hardware(path) or --hardware PATH. Fields:",
            "# moegraph.registry.Hardware; how each number is fitted: docs/calibration.md. Benchmarks:"]
    head += [f"#   {r.name:<18} {r.seconds:5.1f}s  {r.summary}" + (f" [{r.skipped}]" if r.skipped else "")
             for r in results]
    head += ["# Self-check (cost model vs the measurements it was fitted on):"] + [f"#   {c.line()}" for c in checks]
    body = yaml.dump(_flow_pairs(doc), Dumper=_ProfileDumper, sort_keys=False, default_flow_style=False,
                     width=100, allow_unicode=False)
    write_atomic(path, "\n".join(head) + "\n" + body)       # a kill leaves the old profile or this one


class _FlowList(list):
    """A short list written on one line: [size, eff] points, SM budgets."""


class _ProfileDumper(yaml.SafeDumper):
    pass


_ProfileDumper.add_representer(
    _FlowList, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))


def _flow_pairs(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _flow_pairs(x) for k, x in v.items()}
    if isinstance(v, list):
        if all(isinstance(x, (int, float)) for x in v):
            return _FlowList(v)
        return [_flow_pairs(x) for x in v]
    return v


def write_samples(path: Path, results: Sequence[BenchResult], opts: CalibrationOptions, info: MachineInfo) -> None:
    """Every raw sample as JSON: {"options": ..., "machine": ..., "benchmarks": [{name, summary,
    seconds, skipped, samples: [{bench, op, seconds, flops, mem_bytes, comm_bytes, label, graph,
    overlap, shape}]}]}."""
    doc = {"options": {k: str(v) for k, v in dataclasses.asdict(opts).items()}, "machine": dataclasses.asdict(info),
           "benchmarks": [{"name": r.name, "summary": r.summary, "seconds": r.seconds, "skipped": r.skipped,
                           "samples": [dataclasses.asdict(s) for s in r.samples]} for r in results]}
    write_atomic(path, json.dumps(doc, indent=1))


def read_samples(path: Path) -> list[BenchResult]:
    """The BenchResults of a --samples file (to refit without measuring again)."""
    doc = json.loads(Path(path).read_text())

    def sample(s: dict[str, Any]) -> Sample:
        overlap = s.get("overlap")
        shape = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in s.get("shape", ()))   # JSON lists
        return Sample(**{**s, "overlap": OverlapMeasure(**overlap) if overlap is not None else None, "shape": shape})
    return [BenchResult(b["name"], tuple(sample(s) for s in b["samples"]), b["summary"], b["seconds"], b["skipped"])
            for b in doc["benchmarks"]]

