"""Canonical JSON: one text per value (sorted keys, no whitespace, ASCII, no NaN), so that its
sha256 is a stable identity across runs and machines (registry fingerprints, schedule hashes,
tune cache keys)."""

from __future__ import annotations

import json
from typing import Any


def canonical_json(obj: Any) -> str:
    """``obj`` as canonical JSON; raises ValueError on NaN or infinity (no canonical text)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
