"""The README's statements about CLI defaults agree with the parsers users actually get."""

from __future__ import annotations

from pathlib import Path

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
