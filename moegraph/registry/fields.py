"""Field checks of the registries: each check returns the normalised value or raises.

A dataclass field declared with ``checked(check)`` is validated by ``validate_fields`` in the
class's ``__post_init__``; a failure becomes RegistryError("<field>: <detail>", field=<field>),
which the loader prefixes with the file (and entry). Numbers must be finite: YAML reads ``.nan``
and ``.inf`` as floats, and neither is a valid size, rate or factor.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import field
from typing import Any, Callable, Mapping

from moegraph.kinds import MEMORY_BOUND_OPS

__all__ = ["RegistryError", "Bad", "CURVE_NAMES", "IN_STEP_CLASSES", "Curve", "checked", "validate_fields",
           "text", "pos_int", "bounded_int", "opt_bounded_int", "count_or_zero", "flag", "one_of", "MAX_SIZE", "MAX_COUNT", "pos_float", "nonneg_float", "fraction",
           "fraction_or_zero", "stretch", "sm_budgets", "curves", "in_step", "measured", "gemm_tiles", "head_dim_effs",
           "sources", "SOURCED_FIELDS"]


class RegistryError(ValueError):
    """A bad registry entry or user YAML. ``field`` names the field when one field is at fault."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


# --- field checks: each returns the normalised value or raises Bad(detail) ---------------------

class Bad(Exception):
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
        raise Bad(f"expected {what}, got {_got(v)}")
    if isinstance(v, float) and not math.isfinite(v):      # YAML .nan / .inf
        raise Bad(f"expected {what}, got {v!r} (not a finite number)")
    return float(v)


def pos_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise Bad(f"expected a positive int, got {_got(v)}")
    return v


def pos_float(v: Any) -> float:
    if _number(v, "a positive number") <= 0:
        raise Bad(f"expected a positive number, got {v!r}")
    return float(v)


def nonneg_float(v: Any) -> float:
    if _number(v, "a number >= 0") < 0:
        raise Bad(f"expected a number >= 0, got {v!r}")
    return float(v)


def fraction(v: Any) -> float:
    if not 0 < _number(v, "a number in (0, 1]") <= 1:
        raise Bad(f"expected a number in (0, 1], got {v!r}")
    return float(v)


def fraction_or_zero(v: Any) -> float:
    if not 0 <= _number(v, "a number in [0, 1]") <= 1:
        raise Bad(f"expected a number in [0, 1], got {v!r}")
    return float(v)


def stretch(v: Any) -> float:
    if not 1 <= _number(v, "a number in [1, 10]") <= 10:
        raise Bad(f"expected a number in [1, 10], got {v!r}")
    return float(v)


def text(v: Any) -> str:
    if not isinstance(v, str):
        raise Bad(f"expected a string, got {_got(v)}")
    return v


def opt_text(v: Any) -> str | None:
    return None if v is None else text(v)


# Model sizes are bounded so that every tensor of one layer has a storage size torch can
# represent (a [hidden, hidden] tensor with hidden = 10**12 overflows int64 storage sizes) and
# stays far above any real model (the largest public ones: hidden 16384-25600, h_ffn <= 65536,
# experts <= 256, layers <= 128). ModelConfig also bounds one layer's parameter bytes.
MAX_SIZE = 2**20        # hidden, ffn_hidden, head_dim
MAX_COUNT = 2**16       # layers, heads, kv_heads, experts, top_k


def bounded_int(limit: int) -> Callable[[Any], int]:
    """A check: a positive int <= limit."""
    def check(v: Any) -> int:
        if pos_int(v) > limit:
            raise Bad(f"expected a positive int <= {limit:,}, got {v!r}")
        return v
    check.__name__ = f"bounded_int_{limit}"
    return check


def count_or_zero(limit: int) -> Callable[[Any], int]:
    """A check: an int in [0, limit] (a count that may be absent, such as shared experts)."""
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= limit:
            raise Bad(f"expected an int in [0, {limit:,}], got {_got(v)}")
        return v
    check.__name__ = f"count_or_zero_{limit}"
    return check


def flag(v: Any) -> bool:
    """A check: true or false (YAML booleans only: 1, 'yes' as a string, ... are errors)."""
    if not isinstance(v, bool):
        raise Bad(f"expected true or false, got {_got(v)}")
    return v


def one_of(*names: str) -> Callable[[Any], str]:
    """A check: one of the strings ``names``."""
    def check(v: Any) -> str:
        if v not in names:
            raise Bad(f"expected one of {', '.join(map(repr, names))}, got {_got(v)}")
        return v
    check.__name__ = f"one_of_{'_'.join(names)}"
    return check


def opt_bounded_int(limit: int) -> Callable[[Any], int | None]:
    """A check: None or a positive int <= limit."""
    inner = bounded_int(limit)
    return lambda v: None if v is None else inner(v)


def sm_budgets(v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not v:
        raise Bad(f"expected a non-empty list of SM counts, got {_got(v)}")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise Bad(f"expected SM counts >= 0, got {x!r}")
    if any(a >= b for a, b in zip(v, v[1:])):
        raise Bad(f"expected strictly increasing SM counts, got {list(v)}")
    return tuple(v)


def _pairs(v: Any) -> list[tuple[Any, Any]] | None:
    """Items of a YAML mapping, or of the normalised tuple-of-pairs form; None if neither."""
    if isinstance(v, dict):
        return list(v.items())
    if isinstance(v, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in v):
        return list(v)
    return None


def _keyed(v: Any, names: tuple[str, ...], expected: str, what: str) -> list[tuple[Any, Any]]:
    """The items of mapping ``v``, every key one of ``names``."""
    items = _pairs(v)
    if items is None:
        raise Bad(f"expected {expected}, got {_got(v)}")
    for key, _ in items:
        if key not in names:
            raise Bad(f"unknown {what} {key!r}; valid: {', '.join(names)}")
    return items


CURVE_NAMES = ("gemm_eff", "grouped_gemm_eff", "attention_eff", "mem_eff", "ring_eff", "a2a_eff",
               "all_reduce_eff")
Curve = tuple[tuple[float, float], ...]


SHAPE_DIVIDED_CURVES = ("gemm_eff", "grouped_gemm_eff")
"""Curves the cost model multiplies by a GEMM's shape factor (calibration divides the samples
by theirs), so a point is relative to the factor and exceeds 1 where the factor over-penalises
the bin's shapes (runtime.calibrate.fit.shape_caps keeps each product <= 1)."""


def _curve_point(name: str, v: Any) -> float:
    if name not in SHAPE_DIVIDED_CURVES:
        return fraction(v)
    if not 0 < _number(v, "a number in (0, 1e4]") <= 1e4:
        raise Bad(f"expected a number in (0, 1e4] (a shape-divided GEMM curve), got {v!r}")
    return float(v)


def curves(v: Any) -> tuple[tuple[str, Curve], ...]:
    out = []
    for name, points in _keyed(v, CURVE_NAMES, "a mapping of curve name -> [[size, eff], ...]", "curve"):
        if not isinstance(points, (list, tuple)) or not points:
            raise Bad(f"{name}: expected a non-empty list of [size, eff] points, got {_got(points)}")
        pts = []
        for p in points:
            if not isinstance(p, (list, tuple)) or len(p) != 2:
                raise Bad(f"{name}: expected a [size, eff] pair, got {_got(p)}")
            try:
                pts.append((pos_float(p[0]), _curve_point(name, p[1])))
            except Bad as err:
                raise Bad(f"{name}: point {list(p)}: {err}") from None
        if any(a[0] >= b[0] for a, b in zip(pts, pts[1:])):
            raise Bad(f"{name}: sizes must increase strictly, got {[s for s, _ in pts]}")
        out.append((name, tuple(pts)))
    return tuple(sorted(out))


IN_STEP_CLASSES = ("gemm", "grouped_gemm", "attention", "memory", "comm")


def _factors(v: Any, names: tuple[str, ...], expected: str, what: str, kind: str) -> tuple[tuple[str, float], ...]:
    """A mapping of ``names`` -> factor, each within [0.1, 100], as sorted pairs."""
    out = []
    for name, x in _keyed(v, names, expected, what):
        f = pos_float(x)
        if not 0.1 <= f <= 100:
            raise Bad(f"{name}: {kind} {f!r} is outside [0.1, 100]")
        out.append((name, f))
    return tuple(sorted(out))


def in_step(v: Any) -> tuple[tuple[str, float], ...]:
    return _factors(v, IN_STEP_CLASSES, "a mapping of op class -> factor", "op class", "factor")


# keys of Hardware.mem_op_traffic: a memory-bound op kind ("permute", every role of it), one role of
# it ("permute.dgrad": eager torch runs an op's backward as other kernels than its forward), and
# "other": such an op the calibration did not measure (a GEMM's memory floor is one fused pass)
TRAFFIC_OPS = tuple(sorted(k.value for k in MEMORY_BOUND_OPS))
TRAFFIC_KEYS = TRAFFIC_OPS + tuple(f"{op}.{role}" for op in TRAFFIC_OPS for role in ("forward", "dgrad", "wgrad")) + (
    "other",)


def traffic_factor(factors: Mapping[str, float], op: str, role: str) -> float:
    """The traffic factor of ``op`` in ``role`` (Hardware.mem_op_traffic as a dict): its role's
    entry, else the op's, else "other", else 1."""
    return factors.get(f"{op}.{role}", factors.get(op, factors.get("other", 1.0)))


def mem_traffic(v: Any) -> tuple[tuple[str, float], ...]:
    return _factors(v, TRAFFIC_KEYS, "a mapping of op kind[.role] -> traffic factor", "op kind", "traffic factor")


_MEASURED_KEYS = ("date", "machine", "notes")


def measured(v: Any) -> tuple[tuple[str, str], ...]:
    out = []
    for k, x in _keyed(v, _MEASURED_KEYS, f"a mapping with keys {', '.join(_MEASURED_KEYS)}", "key"):
        if isinstance(x, datetime.date):  # YAML reads 2025-01-31 as a date
            x = x.isoformat()
        out.append((k, text(x)))
    return tuple(sorted(out))


def gemm_tiles(v: Any) -> tuple[tuple[int, int, float], ...]:
    """[[tile_m, tile_n, relative efficiency], ...]: the GEMM tiles the library picks from."""
    if not isinstance(v, (list, tuple)):
        raise Bad(f"expected a list of [tile_m, tile_n, relative efficiency], got {_got(v)}")
    out = []
    for t in v:
        if not isinstance(t, (list, tuple)) or len(t) != 3:
            raise Bad(f"expected a [tile_m, tile_n, relative efficiency] triple, got {_got(t)}")
        try:
            out.append((pos_int(t[0]), pos_int(t[1]), fraction(t[2])))
        except Bad as err:
            raise Bad(f"tile {list(t)}: {err}") from None
    return tuple(out)


def head_dim_effs(v: Any) -> tuple[tuple[int, float], ...]:
    """[[head dim, relative efficiency], ...], head dims strictly increasing."""
    if not isinstance(v, (list, tuple)):
        raise Bad(f"expected a list of [head dim, relative efficiency] pairs, got {_got(v)}")
    out = []
    for p in v:
        if not isinstance(p, (list, tuple)) or len(p) != 2:
            raise Bad(f"expected a [head dim, relative efficiency] pair, got {_got(p)}")
        try:
            out.append((pos_int(p[0]), fraction(p[1])))
        except Bad as err:
            raise Bad(f"point {list(p)}: {err}") from None
    if any(a[0] >= b[0] for a, b in zip(out, out[1:])):
        raise Bad(f"head dims must increase strictly, got {[d for d, _ in out]}")
    return tuple(out)


# Hardware fields that are efficiencies, curve parameters or stretches: every hardware.yaml entry
# names the source of each (its ``sources`` mapping; tests/test_registry.py checks).
SOURCED_FIELDS = ("gemm_eff", "grouped_gemm_eff", "attention_eff", "mem_eff", "ring_eff_intra", "ring_eff_inter",
                  "a2a_eff_intra", "a2a_eff_inter", "copy_engine_eff", "fused_tile_overhead_us", "gemm_tiles",
                  "gemm_wave_exponent", "gemm_k_half", "attention_seq_half", "attention_head_dim_eff",
                  "attention_bwd_factor", "ring_half_bytes_intra", "ring_half_bytes_inter", "a2a_half_bytes_intra",
                  "a2a_half_bytes_inter", "comm_overlap_stretch", "comm_hbm_traffic", "comm_sm_saturation",
                  "a2a_sm_saturation", "chunk_stall_us", "in_step_factors")


def sources(v: Any) -> tuple[tuple[str, str], ...]:
    """field -> where its value comes from (a paper, a public benchmark, or "fitted to X")."""
    items = _pairs(v)
    if items is None:
        raise Bad(f"expected a mapping of field -> source text, got {_got(v)}")
    out = []
    for key, x in items:
        if key not in SOURCED_FIELDS:
            raise Bad(f"unknown sourced field {key!r}; valid: {', '.join(SOURCED_FIELDS)}")
        if not isinstance(x, str) or not x.strip():
            raise Bad(f"{key}: expected a non-empty source text, got {_got(x)}")
        out.append((key, x))
    return tuple(sorted(out))


def checked(check: Callable[[Any], Any], default: Any = dataclasses.MISSING) -> Any:
    return field(default=default, metadata={"check": check})


def validate_fields(obj: Any) -> None:
    """Run every field's check, storing the normalised value (int -> float, list -> tuple)."""
    for f in dataclasses.fields(obj):
        try:
            value = f.metadata["check"](getattr(obj, f.name))
        except Bad as err:
            raise RegistryError(f"{f.name}: {err}", field=f.name) from None
        object.__setattr__(obj, f.name, value)
