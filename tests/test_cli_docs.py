"""The README's statements about CLI defaults agree with the parsers users actually get."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moegraph.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def _option_default(command: str, flag: str):
    sub = build_parser((command,))._subparsers._group_actions[0].choices[command]
    return next(a.default for a in sub._actions if flag in a.option_strings)


def test_readme_states_each_commands_link_default():
    text = " ".join(README.read_text().split())
    bullet = text[text.index("**`--link RATE`**"):]
    bullet = bullet[:bullet.index("- **")]
    stated = {"run": "none", "calibrate": "none", "demo": "auto"}
    assert {c: _option_default(c, "--link") or "none" for c in stated} == stated
    assert "default `none` for `run` and `calibrate`, `auto` for `demo`" in bullet


DOCS = README.parent / "docs"


def _options(command: str) -> list[tuple[str, ...]]:
    """Each option of ``command``'s parser as its option strings (any one may name it), --help aside."""
    sub = build_parser((command,))._subparsers._group_actions[0].choices[command]
    return [tuple(a.option_strings) for a in sub._actions if a.option_strings and "--help" not in a.option_strings]


def _named(option_strings: tuple[str, ...], text: str) -> bool:
    return any(re.search(re.escape(o) + r"(?![\w-])", text) for o in option_strings)


def _span(text: str, start: str, end: str) -> str:
    """The text from ``start`` to the next ``end`` after it."""
    i = text.index(start)
    return text[i:text.index(end, i + len(start))]


@pytest.mark.parametrize("command", ["trace", "compile", "verify", "gantt", "run", "calibrate", "tune", "demo"])
def test_every_option_is_documented(command):
    docs = README.read_text() + "".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    assert [o for o in _options(command) if not _named(o, docs)] == []


def test_synopses_list_every_option():
    """The full synopses (run's in docs/runtime.md, calibrate's in docs/calibration.md, compile's
    README row with the trace options it refers to) name every option their parser has."""
    readme = README.read_text()
    synopses = {
        "run": _span((DOCS / "runtime.md").read_text(), "moegraph run [", "```"),
        "calibrate": _span((DOCS / "calibration.md").read_text(), "moegraph calibrate [", "```"),
        "compile": _span(readme, "moegraph trace   --model", "```") + _span(readme, "| `moegraph compile [", "\n"),
    }
    missing = {c: [o[-1] for o in _options(c) if not _named(o, text)] for c, text in synopses.items()}
    assert missing == {c: [] for c in synopses}
