"""The docs' statements about the CLI agree with the parsers users actually get, every option is
documented, docs/README.md indexes every doc, and the README stays a front door."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moegraph.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CLI_DOC = DOCS / "cli.md"


def _option_default(command: str, flag: str):
    sub = build_parser((command,))._subparsers._group_actions[0].choices[command]
    return next(a.default for a in sub._actions if flag in a.option_strings)


def test_cli_doc_states_each_commands_link_default():
    text = " ".join(CLI_DOC.read_text().split())
    bullet = text[text.index("**`--link RATE`**"):]
    bullet = bullet[:bullet.index("- **")]
    stated = {"run": "none", "calibrate": "none", "demo": "auto"}
    assert {c: _option_default(c, "--link") or "none" for c in stated} == stated
    assert "default `none` for `run` and `calibrate`, `auto` for `demo`" in bullet



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


@pytest.mark.parametrize("command", ["trace", "compile", "verify", "gantt", "run", "calibrate", "tune", "demo", "netns"])
def test_every_option_is_documented(command):
    docs = README.read_text() + "".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    assert [o for o in _options(command) if not _named(o, docs)] == []


def test_synopses_list_every_option():
    """The full synopses (run's in docs/runtime.md, calibrate's in docs/calibration.md, compile's
    docs/cli.md row with the trace options it refers to) name every option their parser has."""
    cli = CLI_DOC.read_text()
    synopses = {
        "run": _span((DOCS / "runtime.md").read_text(), "moegraph run [", "```"),
        "calibrate": _span((DOCS / "calibration.md").read_text(), "moegraph calibrate [", "```"),
        "compile": _span(cli, "moegraph trace   --model", "```") + _span(cli, "| `moegraph compile [", "\n"),
        "tune": _span(cli, "| `moegraph tune --model", "\n") + _span(cli, "| `moegraph tune ... --pp", "\n"),
        "netns": _span(cli, "| `moegraph netns", "\n"),
    }
    missing = {c: [o[-1] for o in _options(c) if not _named(o, text)] for c, text in synopses.items()}
    assert missing == {c: [] for c in synopses}


def test_docs_index_lists_every_doc_once():
    """docs/README.md links each docs/*.md exactly once, and only files that exist."""
    index = (DOCS / "README.md").read_text()
    linked = re.findall(r"^- \[([\w.-]+\.md)\]\(\1\): \S", index, re.M)
    docs = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    assert sorted(linked) == docs


def test_readme_is_a_front_door():
    """At most 150 lines, and the two commands come before any other section."""
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    first = text.index("\n## ")
    assert text[first:].startswith("\n## Two commands\n")
    commands = _span(text, "```bash\n", "```").splitlines()[1:]
    assert [c.split("#")[0].strip() for c in commands] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
