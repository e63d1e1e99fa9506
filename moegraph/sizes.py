"""Byte sizes as people write them: '1.5GiB', '800MiB', '4096' -> bytes, and back.

The one unit of memory in moegraph's inputs (the CLI's ``--memory-budget``, the sar pass's
``budget:<bytes>``, ``CompileConfig.memory_budget`` given as text): binary prefixes or plain
bytes. A parse error is a ValueError naming the text and the valid forms; the CLI's argparse
type (``moegraph.options.byte_size``) turns it into a usage error.
"""

from __future__ import annotations

import math
import re

BYTE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
SIZE_FORMS = "a positive size such as 1.5GiB, 800MiB, 64KiB or a plain number of bytes"


def parse_byte_size(text: str) -> int:
    """'1.5GiB' / '800MiB' / '4096' -> bytes (an int > 0). Decimal prefixes (GB) are refused:
    memory is counted in binary units here, and a silent 7% difference is worse than an error. A
    unit's fraction rounds to the nearest byte (1.1GiB); plain bytes must be whole ('4096.5' is
    refused, not cut to 4096)."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in BYTE_UNITS:
        raise ValueError(f"{text!r} is not {SIZE_FORMS}")
    value = float(m.group(1)) * BYTE_UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{text!r} is not {SIZE_FORMS}")
    if BYTE_UNITS[unit] == 1 and value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes ({SIZE_FORMS})")
    return round(value)


def exact_byte_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it exactly, as ``parse_byte_size``
    reads it back: 3221225472 -> '3GiB', 149946368 -> '143MiB', 40000 -> '40000'."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n and n % BYTE_UNITS[unit.lower()] == 0:
            return f"{n // BYTE_UNITS[unit.lower()]}{unit}"
    return str(n)


def format_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: 1610612736 -> '1.50GiB'."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n >= BYTE_UNITS[unit.lower()]:
            return f"{n / BYTE_UNITS[unit.lower()]:.2f}{unit}"
    return f"{n}B"


def format_bytes_apart(*sizes: int) -> tuple[str, ...]:
    """format_bytes of each size, with the exact byte count added to every size that would read
    like a different one ("436.00KiB (446,463 bytes) is below 436.00KiB (446,464 bytes)")."""
    text = [format_bytes(n) for n in sizes]
    return tuple(t + (f" ({n:,} bytes)" if any(t == u and n != m for u, m in zip(text, sizes)) else "")
                 for t, n in zip(text, sizes))


__all__ = ["BYTE_UNITS", "SIZE_FORMS", "exact_byte_size", "format_bytes", "format_bytes_apart", "parse_byte_size"]
