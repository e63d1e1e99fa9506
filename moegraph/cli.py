"""`moegraph` command line: trace, compile, verify, gantt, run, calibrate, tune, demo.

The CLI is the front door of the whole pipeline, so it is the one place in ``moegraph`` that
reaches later stages (passes, schedules, runtime). It does so lazily, inside the command
functions; no library module of ``moegraph`` imports a later stage.

Expected errors (bad model name, invalid strategy, malformed YAML, ...) print one line on
stderr and exit 2; unexpected ones keep their traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

# subcommand -> "module:function" that adds its arguments and returns the handler
COMMANDS: dict[str, str] = {
    "trace": "moegraph.commands:trace_command",
    "compile": "schedules.commands:compile_command",
    "verify": "schedules.commands:verify_command",
    "gantt": "schedules.commands:gantt_command",
    "run": "runtime.commands:run_command",
    "calibrate": "runtime.calibrate:calibrate_command",
    "tune": "schedules.tune:tune_command",
    "demo": "runtime.demo:demo_command",
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
}


class UsageError(ValueError):
    """A bad command-line value; reported as one line, exit code 2."""


def expected_errors() -> tuple[type[BaseException], ...]:
    from moegraph.builder import ConfigError
    from moegraph.ir import GraphError
    from moegraph.registry import RegistryError
    from moegraph.tracer import LoweringError
    errs: list[type[BaseException]] = [UsageError, ConfigError, RegistryError, LoweringError, GraphError,
                                       FileNotFoundError]
    for mod, name in (("passes", "PassError"), ("schedules", "ScheduleError"), ("runtime", "RuntimeFailure")):
        try:
            errs.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errs)


def _load(spec: str) -> Callable:
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moegraph", description="Operator-graph compiler and schedule "
                                     "autotuner for Mixture-of-Experts training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, spec in COMMANDS.items():
        p = sub.add_parser(name, help=HELP[name], description=HELP[name])
        try:
            handler = _load(spec)(p)
        except (ImportError, AttributeError):
            p.set_defaults(handler=_not_available(name))
            continue
        p.set_defaults(handler=handler)
    return parser


def _not_available(name: str) -> Callable:
    def handler(args):
        raise UsageError(f"'moegraph {name}' is not available in this build")
    return handler


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except expected_errors() as err:
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"moegraph {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
