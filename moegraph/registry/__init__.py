"""Model and hardware registries: frozen, validated dataclasses loaded from YAML.

    load_model("mixtral-8x7b")   # an entry of models.yaml (shipped in this package)
    load_model("my/model.yaml")  # or a user YAML file holding ONE mapping of the same fields

Notation (MegaScale-MoE Table 1): h hidden, m = heads/kv_heads, f = h_ffn/h, E experts, k top-k.

Every user-facing mistake raises RegistryError with one line naming the file, entry, field
and what is valid. Unknown fields are errors, so a typo never falls back to a default.
Units: bytes, bytes/s, FLOP/s, microseconds; GB means 1e9 bytes (datasheet convention).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

__all__ = ["ModelConfig", "Hardware", "RegistryError", "CURVE_NAMES", "IN_STEP_CLASSES", "Curve", "load_model", "load_hardware",
           "model_names", "hardware_names"]

_REGISTRY_DIR = Path(__file__).parent
_PROFILES_DIR = _REGISTRY_DIR / "profiles"     # calibrated profiles shipped with the package


class RegistryError(ValueError):
    """A bad registry entry or user YAML. ``field`` names the field when one field is at fault."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


# --- field checks: each returns the normalised value or raises _Bad(detail) ---------------------

class _Bad(Exception):
    pass


def _got(v: Any) -> str:
    if isinstance(v, str):
        try:
            float(v)
        except ValueError:
            return repr(v)
        # PyYAML (YAML 1.1) reads 1e12 and 1.0e12 as strings; only 1.0e+12 is a float.
        return f"{v!r} (a string: write exponents as 1.0e+12 so YAML reads a number)"
    return repr(v)


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Bad(f"expected {what}, got {_got(v)}")
    return float(v)


def _pos_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise _Bad(f"expected a positive int, got {_got(v)}")
    return v


def _pos_float(v: Any) -> float:
    if _number(v, "a positive number") <= 0:
        raise _Bad(f"expected a positive number, got {v!r}")
    return float(v)


def _nonneg_float(v: Any) -> float:
    if _number(v, "a number >= 0") < 0:
        raise _Bad(f"expected a number >= 0, got {v!r}")
    return float(v)


def _fraction(v: Any) -> float:
    if not 0 < _number(v, "a number in (0, 1]") <= 1:
        raise _Bad(f"expected a number in (0, 1], got {v!r}")
    return float(v)


def _fraction_or_zero(v: Any) -> float:
    if not 0 <= _number(v, "a number in [0, 1]") <= 1:
        raise _Bad(f"expected a number in [0, 1], got {v!r}")
    return float(v)


def _stretch(v: Any) -> float:
    if not 1 <= _number(v, "a number in [1, 10]") <= 10:
        raise _Bad(f"expected a number in [1, 10], got {v!r}")
    return float(v)


def _text(v: Any) -> str:
    if not isinstance(v, str):
        raise _Bad(f"expected a string, got {_got(v)}")
    return v


def _opt_pos_int(v: Any) -> int | None:
    return None if v is None else _pos_int(v)


def _sm_budgets(v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not v:
        raise _Bad(f"expected a non-empty list of SM counts, got {_got(v)}")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise _Bad(f"expected SM counts >= 0, got {x!r}")
    if any(a >= b for a, b in zip(v, v[1:])):
        raise _Bad(f"expected strictly increasing SM counts, got {list(v)}")
    return tuple(v)


def _pairs(v: Any) -> list[tuple[Any, Any]] | None:
    """Items of a YAML mapping, or of the normalised tuple-of-pairs form; None if neither."""
    if isinstance(v, dict):
        return list(v.items())
    if isinstance(v, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in v):
        return list(v)
    return None


CURVE_NAMES = ("gemm_eff", "grouped_gemm_eff", "attention_eff", "mem_eff", "ring_eff", "a2a_eff",
               "all_reduce_eff")
Curve = tuple[tuple[float, float], ...]


def _curves(v: Any) -> tuple[tuple[str, Curve], ...]:
    items = _pairs(v)
    if items is None:
        raise _Bad(f"expected a mapping of curve name -> [[size, eff], ...], got {_got(v)}")
    out = []
    for name, points in items:
        if name not in CURVE_NAMES:
            raise _Bad(f"unknown curve {name!r}; valid: {', '.join(CURVE_NAMES)}")
        if not isinstance(points, (list, tuple)) or not points:
            raise _Bad(f"{name}: expected a non-empty list of [size, eff] points, got {_got(points)}")
        pts = []
        for p in points:
            if not isinstance(p, (list, tuple)) or len(p) != 2:
                raise _Bad(f"{name}: expected a [size, eff] pair, got {_got(p)}")
            try:
                pts.append((_pos_float(p[0]), _fraction(p[1])))
            except _Bad as err:
                raise _Bad(f"{name}: point {list(p)}: {err}") from None
        if any(a[0] >= b[0] for a, b in zip(pts, pts[1:])):
            raise _Bad(f"{name}: sizes must increase strictly, got {[s for s, _ in pts]}")
        out.append((name, tuple(pts)))
    return tuple(sorted(out))


IN_STEP_CLASSES = ("gemm", "grouped_gemm", "attention", "memory", "comm")


def _in_step(v: Any) -> tuple[tuple[str, float], ...]:
    items = _pairs(v)
    if items is None:
        raise _Bad(f"expected a mapping of op class -> factor, got {_got(v)}")
    out = []
    for name, x in items:
        if name not in IN_STEP_CLASSES:
            raise _Bad(f"unknown op class {name!r}; valid: {', '.join(IN_STEP_CLASSES)}")
        f = _pos_float(x)
        if not 0.1 <= f <= 100:
            raise _Bad(f"{name}: factor {f!r} is outside [0.1, 100]")
        out.append((name, f))
    return tuple(sorted(out))


_MEASURED_KEYS = ("date", "machine", "notes")


def _measured(v: Any) -> tuple[tuple[str, str], ...]:
    items = _pairs(v)
    if items is None:
        raise _Bad(f"expected a mapping with keys {', '.join(_MEASURED_KEYS)}, got {_got(v)}")
    out = []
    for k, x in items:
        if k not in _MEASURED_KEYS:
            raise _Bad(f"unknown key {k!r}; valid: {', '.join(_MEASURED_KEYS)}")
        if isinstance(x, datetime.date):  # YAML reads 2025-01-31 as a date
            x = x.isoformat()
        out.append((k, _text(x)))
    return tuple(sorted(out))


def _checked(check: Callable[[Any], Any], default: Any = dataclasses.MISSING) -> Any:
    return field(default=default, metadata={"check": check})


def _validate_fields(obj: Any) -> None:
    """Run every field's check, storing the normalised value (int -> float, list -> tuple)."""
    for f in dataclasses.fields(obj):
        try:
            value = f.metadata["check"](getattr(obj, f.name))
        except _Bad as err:
            raise RegistryError(f"{f.name}: {err}", field=f.name) from None
        object.__setattr__(obj, f.name, value)


def _as_plain(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_as_plain(x) for x in v]
    return v


class _Record:
    """to_dict / fingerprint shared by both registries."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML types; load_model/load_hardware accept it back unchanged."""
        return {f.name: _as_plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def fingerprint(self) -> str:
        """sha256 of canonical JSON (sorted keys, no whitespace): a cache key stable across runs."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


# --- models --------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ModelConfig(_Record):
    """One MoE transformer (MegaScale-MoE Table 2 columns). Shared experts are not modelled."""

    name: str = _checked(_text)
    """Registry name (or the file stem for a user YAML without a name)."""
    layers: int = _checked(_pos_int)
    """Number of transformer layers (#layers)."""
    hidden: int = _checked(_pos_int)
    """Hidden size h."""
    heads: int = _checked(_pos_int)
    """Query heads (#heads)."""
    kv_heads: int = _checked(_pos_int)
    """Key/value heads; heads/kv_heads = m (grouped-query attention)."""
    ffn_hidden: int = _checked(_pos_int)
    """Intermediate size h_ffn of ONE expert."""
    experts: int = _checked(_pos_int)
    """Routed experts E per MoE layer."""
    top_k: int = _checked(_pos_int)
    """Experts each token is routed to (k)."""
    head_dim: int | None = _checked(_opt_pos_int, None)
    """Per-head size; None means hidden // heads (then heads must divide hidden)."""
    rope_theta: float = _checked(_pos_float, 1e6)
    """RoPE base (1e6 for Mixtral-like models, 1e4 for most others)."""
    rms_eps: float = _checked(_pos_float, 1e-5)
    """RMSNorm epsilon."""

    def __post_init__(self):
        _validate_fields(self)
        if self.heads % self.kv_heads:
            raise RegistryError(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.top_k > self.experts:
            raise RegistryError(f"top_k={self.top_k} exceeds experts={self.experts}")
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise RegistryError(f"hidden={self.hidden} is not divisible by heads={self.heads}; "
                                    f"set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def m(self) -> float:
        """q/kv head ratio m (a float, as ``ir.Dims.m``; exact since kv_heads divides heads)."""
        return self.heads / self.kv_heads

    @property
    def f(self) -> float:
        """h_ffn / h."""
        return self.ffn_hidden / self.hidden


# --- hardware ------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Hardware(_Record):
    """One GPU (or CPU) type as the cost model sees it. Bandwidths are per GPU, per direction."""

    name: str = _checked(_text)
    """Registry name."""
    description: str = _checked(_text)
    """Free text: what the numbers describe and where they come from."""
    peak_flops_bf16: float = _checked(_pos_float)
    """Dense bf16 tensor-core peak, FLOP/s (no sparsity)."""
    hbm_bw_bytes_s: float = _checked(_pos_float)
    """Device-memory bandwidth, bytes/s."""
    hbm_capacity_bytes: int = _checked(_pos_int)
    """Device-memory capacity, bytes (1 GB = 1e9 B as datasheets quote it)."""
    sm_count: int = _checked(_pos_int)
    """Streaming multiprocessors; compute slows by sm_count/(sm_count - SMs held by comm)."""
    nvlink_bw_bytes_s: float = _checked(_pos_float)
    """Intra-node link bandwidth, UNIDIRECTIONAL, per GPU, bytes/s (MoNTA Table 5 convention;
    MegaScale-MoE Table 4 quotes bidirectional totals, twice these numbers)."""
    nic_bw_bytes_s: float = _checked(_pos_float)
    """Inter-node bandwidth per GPU, per direction, bytes/s."""
    gpus_per_node: int = _checked(_pos_int, 8)
    """GPUs sharing one NVLink domain; a collective with group <= this is intra-node by default."""
    intra_node_latency_us: float = _checked(_nonneg_float)
    """Per-step latency alpha of an intra-node collective (a ring of n pays (n-1) steps)."""
    inter_node_latency_us: float = _checked(_nonneg_float)
    """Per-step latency alpha of an inter-node collective."""
    kernel_latency_us: float = _checked(_nonneg_float)
    """Fixed launch/tail cost charged to every node (except views), so ever finer chunking
    eventually stops paying off."""
    copy_engine_latency_us: float = _checked(_nonneg_float)
    """Extra fixed cost of a collective driven by copy engines (SM budget 0): one DMA
    descriptor per peer plus a host-visible sync instead of one fused kernel."""
    gemm_eff: float = _checked(_fraction, 0.75)
    """Fraction of peak reached by dense GEMMs (also the router). Default: typical large bf16
    cuBLAS GEMMs on Hopper reach 70-80% of dense peak."""
    grouped_gemm_eff: float = _checked(_fraction, 0.65)
    """Fraction of peak reached by grouped (per-expert) GEMMs: smaller, ragged problems
    (MegaScale-MoE §7 on GroupedGEMM overheads); default 0.65."""
    attention_eff: float = _checked(_fraction, 0.55)
    """Fraction of peak reached by fused causal attention (FlashAttention-2-class kernels on
    Hopper reach roughly half of peak); default 0.55."""
    mem_eff: float = _checked(_fraction, 0.8)
    """Fraction of HBM bandwidth reached by memory-bound kernels; default 0.8 (MoNTA Table 8:
    D2D copy at 80%)."""
    ring_eff: float = _checked(_fraction, 0.726)
    """Bus-bandwidth fraction of ring all-gather/reduce-scatter; default 0.726 (MoNTA Table 8,
    per-chunk AllGather)."""
    a2a_eff: float = _checked(_fraction, 0.427)
    """Bandwidth fraction of all-to-all; default 0.427 (MoNTA Table 8, per-chunk AllToAll)."""
    copy_engine_eff: float = _checked(_fraction_or_zero, 0.6)
    """Link-bandwidth fraction a copy-engine collective reaches; 0 = no copy-engine path.
    Default 0.6: assumed below SM-driven rings, so that giving a collective copy engines trades
    bandwidth for leaving every SM to compute (the choice MegaScale-MoE §4.2 makes by hand)."""
    comm_sm_budgets: tuple[int, ...] = _checked(_sm_budgets)
    """SM counts a collective may be given, strictly increasing; 0 = copy engines (only if
    copy_engine_eff > 0). Each must leave SMs for compute (< sm_count)."""
    comm_sm_saturation: int = _checked(_pos_int)
    """SMs at which a ring collective reaches full bandwidth (about 16 on Hopper NVLink)."""
    a2a_sm_saturation: int = _checked(_pos_int)
    """SMs at which all-to-all reaches full bandwidth (more than a ring: n-1 peers at once)."""
    comm_overlap_stretch: float = _checked(_stretch, 1.0)
    """Factor (in [1, 10]) by which a collective runs longer while compute runs beside it
    (the two share memory bandwidth, and on CPU the cores). 1 = not modelled (the registry's
    GPU profiles: unmeasured); ``moegraph calibrate`` measures it where it can run collectives.
    The scheduler gives each collective two modes when it is > 1: alone (no compute may
    overlap it) at the plain time, or beside compute at this factor times it."""
    step_noise: float = _checked(_fraction_or_zero, 0.0)
    """Step-to-step noise of real steps on this machine: the relative median absolute deviation
    of measured step times (``moegraph calibrate``'s in-step stage); 0 = not measured. ``moegraph
    tune`` keeps the tp+tp sequential baseline unless a candidate's predicted gain exceeds it:
    smaller gains cannot be confirmed by measuring on this machine."""
    link_bit_s: float = _checked(_nonneg_float, 0.0)
    """Rate of the emulated link (``--link``, docs/runtime.md "Emulated link") the profile was
    calibrated under, bits/s; 0 = none (plain loopback, or real hardware). ``moegraph run`` warns
    when it differs from the run's ``--link``: collective prices describe the calibration's link."""
    link_latency_us: float = _checked(_nonneg_float, 0.0)
    """That link's added one-way delay (``--link-latency``), microseconds; 0 = none."""
    curves: tuple[tuple[str, Curve], ...] = _checked(_curves, ())
    """Optional measured efficiency curves, name -> ((size, eff), ...), size in FLOPs for compute
    curves and bytes for memory/comm curves; interpolated linearly in log(size), clamped at the
    ends; a present curve replaces the scalar factor. Names: CURVE_NAMES."""
    in_step_factors: tuple[tuple[str, float], ...] = _checked(_in_step, ())
    """Optional, op class (IN_STEP_CLASSES) -> factor: how much longer that class's nodes run
    inside a real training step than alone (caches shared with the rest of the step, host
    overhead, collectives absorbing rank skew), measured by ``moegraph calibrate`` from real steps.
    Multiplies a node's time above kernel_latency_us; a missing class counts 1."""
    measured: tuple[tuple[str, str], ...] = _checked(_measured, ())
    """Optional provenance of calibrated numbers: date, machine, notes."""

    def __post_init__(self):
        _validate_fields(self)
        budgets = self.comm_sm_budgets
        if 0 in budgets and self.copy_engine_eff == 0:
            raise RegistryError(f"comm_sm_budgets={list(budgets)} contains 0 (copy engines) "
                                f"but copy_engine_eff=0.0")
        if budgets[-1] >= self.sm_count:
            raise RegistryError(f"comm_sm_budgets max {budgets[-1]} leaves no SMs for compute "
                                f"(sm_count={self.sm_count})")
        for sat in ("comm_sm_saturation", "a2a_sm_saturation"):
            if getattr(self, sat) > self.sm_count:
                raise RegistryError(f"{sat}={getattr(self, sat)} exceeds sm_count={self.sm_count}")

    def curve(self, name: str) -> Curve | None:
        """The measured curve ``name`` (one of CURVE_NAMES), or None if not calibrated."""
        if name not in CURVE_NAMES:
            raise ValueError(f"unknown curve {name!r}; valid: {', '.join(CURVE_NAMES)}")
        return dict(self.curves).get(name)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["curves"] = {name: [list(p) for p in pts] for name, pts in self.curves}
        d["in_step_factors"] = dict(self.in_step_factors)
        d["measured"] = dict(self.measured)
        return d

    def in_step_factor(self, op_class: str) -> float:
        """The in-step factor of ``op_class`` (one of IN_STEP_CLASSES); 1 if not calibrated."""
        if op_class not in IN_STEP_CLASSES:
            raise ValueError(f"unknown op class {op_class!r}; valid: {', '.join(IN_STEP_CLASSES)}")
        return dict(self.in_step_factors).get(op_class, 1.0)


# --- loading -------------------------------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path, shown: str) -> Any:
    try:
        text = path.read_text()
    except OSError as err:
        raise RegistryError(f"{shown}: cannot read ({err.strerror})") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise RegistryError(f"{shown}: invalid YAML: {err.problem or err.context}{where}") from None
    except yaml.YAMLError as err:
        raise RegistryError(f"{shown}: invalid YAML: {' '.join(str(err).split())}") from None


def _build(cls: type, data: Any, source: str, entry: str | None, name: str) -> Any:
    """Construct cls from one YAML mapping; errors are prefixed 'source: entry.field: ...'."""
    where = f"{source}: {entry}" if entry else source
    if not isinstance(data, dict):
        raise RegistryError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = sorted(str(k) for k in data if k not in fields)
    if extra:
        raise RegistryError(f"{where}: unknown field {extra[0]!r}; valid: {', '.join(sorted(fields))}")
    missing = [n for n, f in fields.items()
               if n != "name" and f.default is dataclasses.MISSING and n not in data]
    if missing:
        plural = "s" if len(missing) > 1 else ""
        raise RegistryError(f"{where}: missing field{plural} {', '.join(map(repr, missing))}")
    if entry and data.get("name", entry) != entry:
        raise RegistryError(f"{where}.name: {data['name']!r} differs from its key {entry!r}")
    try:
        return cls(**{"name": name, **data})
    except RegistryError as err:
        sep = "." if entry and err.field else ": "
        raise RegistryError(f"{where}{sep}{err}", field=err.field) from None


@functools.lru_cache(maxsize=None)
def _registry(filename: str, kind: str, registry_dir: Path) -> dict[str, Any]:
    cls = ModelConfig if kind == "model" else Hardware
    data = _read_yaml(registry_dir / filename, filename)
    if not isinstance(data, dict):
        raise RegistryError(f"{filename}: expected a mapping of name -> entry, got {type(data).__name__}")
    return {str(k): _build(cls, v, filename, str(k), str(k)) for k, v in data.items()}


def _is_path(arg: str | os.PathLike) -> bool:
    if isinstance(arg, os.PathLike):
        return True
    return "/" in arg or os.sep in arg or arg.endswith((".yaml", ".yml"))


def _load(arg: str | os.PathLike, kind: str, filename: str) -> Any:
    if not isinstance(arg, (str, os.PathLike)):
        raise RegistryError(f"expected a {kind} name or a YAML path, got {arg!r}")
    if _is_path(arg):
        path = Path(arg)
        if not path.is_file():
            raise RegistryError(f"{kind} file '{arg}' does not exist")
        cls = ModelConfig if kind == "model" else Hardware
        return _build(cls, _read_yaml(path, str(arg)), str(arg), None, path.stem)
    entries = _registry(filename, kind, _REGISTRY_DIR)
    if arg in entries:
        return entries[arg]
    profile = _PROFILES_DIR / f"{arg}.yaml"
    if kind == "hardware" and profile.is_file():                 # a shipped calibrated profile
        return _build(Hardware, _read_yaml(profile, profile.name), profile.name, None, arg)
    known = sorted(entries) + (list(_profile_names()) if kind == "hardware" else [])
    raise RegistryError(f"unknown {kind} {arg!r}; known: {', '.join(known)}")


def _profile_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in _PROFILES_DIR.glob("*.yaml")))


def load_model(name_or_path: str | os.PathLike) -> ModelConfig:
    """A models.yaml entry by name, or a YAML file (path contains '/' or ends in .yaml/.yml)."""
    return _load(name_or_path, "model", "models.yaml")


def load_hardware(name_or_path: str | os.PathLike) -> Hardware:
    """A hardware.yaml entry by name, or a YAML file (path contains '/' or ends in .yaml/.yml)."""
    return _load(name_or_path, "hardware", "hardware.yaml")


def model_names() -> tuple[str, ...]:
    return tuple(sorted(_registry("models.yaml", "model", _REGISTRY_DIR)))


def hardware_names() -> tuple[str, ...]:
    """Registry entries and shipped calibrated profiles (registry/profiles/NAME.yaml)."""
    return tuple(sorted(_registry("hardware.yaml", "hardware", _REGISTRY_DIR))) + _profile_names()
