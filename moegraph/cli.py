"""`moegraph` command line: trace, compile, verify, gantt, run, calibrate, tune, demo, netns.

The CLI is the front door of the whole pipeline, so it is the one place in ``moegraph`` that
reaches later stages (passes, schedules, runtime). It does so lazily: only the module of the
command being run is imported, inside ``main``; no library module of ``moegraph`` imports a
later stage.

Expected errors (bad model name, invalid strategy, malformed YAML, a bad option value, ...)
print one line on stderr and exit 2; unexpected ones keep their traceback, and so does a
malformed graph (``GraphError``), also when a pass's error wraps one: moegraph built that graph
itself, so it is moegraph's bug, not the user's input. A missing
third-party dependency is named in one line (exit 2), never hidden behind an argparse message.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import Callable, NoReturn

from moegraph import __version__
from moegraph.options import UsageError

__all__ = ["COMMANDS", "UsageError", "build_parser", "expected_errors", "internal_error", "main"]

# subcommand -> "module:function" that adds its arguments and returns the handler
COMMANDS: dict[str, str] = {
    "trace": "moegraph.commands:trace_command",
    "compile": "moegraph.schedules.commands:compile_command",
    "verify": "moegraph.schedules.commands:verify_command",
    "gantt": "moegraph.schedules.commands:gantt_command",
    "run": "moegraph.runtime.commands:run_command",
    "calibrate": "moegraph.runtime.calibrate:calibrate_command",
    "tune": "moegraph.schedules.commands:tune_command",
    "demo": "moegraph.runtime.demo:demo_command",
    "netns": "moegraph.runtime.netns:netns_command",
}

HELP = {
    "trace": "lower a layer to the operator graph and print its nodes, comm volumes and memory",
    "compile": "schedule a layer's graph (CP-SAT) and write the schedule file",
    "verify": "check a schedule file; exit 0 or name the first violation",
    "gantt": "draw a schedule file as png/svg/html or Chrome trace json",
    "run": "execute a compiled layer on N ranks and measure it",
    "calibrate": "measure this machine into a hardware profile",
    "tune": "search strategies for a model on a hardware profile",
    "demo": "the whole pipeline on a built-in default",
    "netns": "list the network namespaces of --link runs; --sweep deletes those a killed run left behind",
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem (and where help is), exit 2."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A value that starts like a negative number (-1GiB, -2ms, -1e3) is a value, so its own
        # type names it ("'-1GiB' is not a positive size"), not "expected one argument". Safe while
        # no option is spelled like a number (argparse then keeps the default behaviour).
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def expected_errors() -> tuple[type[BaseException], ...]:
    from moegraph.builder import ConfigError
    from moegraph.pass_steps import PassError
    from moegraph.registry import RegistryError
    # PassError: a bad --passes text is parsed at the CLI's boundary (moegraph.pass_steps), torch-free
    errs: list[type[BaseException]] = [UsageError, ConfigError, PassError, RegistryError, FileNotFoundError]
    # the lowering's and the later stages' error types, for whichever of them the running command
    # imported (importing the lowering loads torch, ~1 s: a refusal before any tracing need not)
    for mod, name in (("moegraph.lowering", "LoweringError"), ("moegraph.schedules", "ScheduleError"),
                      ("moegraph.runtime", "RuntimeFailure")):
        if mod in sys.modules:
            errs.append(getattr(sys.modules[mod], name))
    return tuple(errs)


def internal_error(err: BaseException) -> bool:
    """Whether ``err`` is, or was raised ``from``, a GraphError (module docstring: a bug, kept
    with its traceback even when an expected type such as PassError wraps it)."""
    from moegraph.ir import GraphError
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, GraphError):
            return True
        seen.add(id(err))
        err = err.__cause__
    return False


def _load(spec: str) -> Callable:
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)


def _chosen_command(argv: list[str]) -> str | None:
    """The subcommand argv names (its first word that is one), so only that module is imported."""
    for word in argv:
        if word in COMMANDS:
            return word
        if not word.startswith("-"):
            return None
    return None


def build_parser(commands: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    """The parser, with the options of ``commands`` (each imports its module; default: all of
    them, for tools that walk the whole CLI). The others are listed with their help only."""
    parser = OneLineParser(prog="moegraph", description="Operator-graph compiler and schedule autotuner "
                           "for Mixture-of-Experts training.")
    parser.add_argument("--version", action="version", version=f"moegraph {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, spec in COMMANDS.items():
        p = sub.add_parser(name, help=HELP[name], description=HELP[name])
        if commands is None or name in commands:
            p.set_defaults(handler=_load(spec)(p))
    return parser


def _missing_dependency(err: ImportError) -> str:
    return (f"needs the Python module {err.name!r}, which is not installed ({err}); "
            f"reinstall moegraph with its dependencies (bash scripts/setup.sh)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _chosen_command(argv)
    try:
        parser = build_parser((command,) if command else ())
    except ImportError as err:
        if not err.name or err.name.split(".")[0] == "moegraph":
            raise  # a bug in moegraph itself: keep the traceback
        print(f"moegraph {command}: error: {_missing_dependency(err)}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        rc = int(args.handler(args) or 0)
        sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at interpreter exit
        return rc
    except BrokenPipeError:
        # `moegraph trace --json | head`: the reader left; say nothing more, like any Unix filter
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except expected_errors() as err:
        if internal_error(err):
            raise
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"moegraph {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
