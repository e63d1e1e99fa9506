"""moegraph: operator-graph compiler and schedule autotuner for Mixture-of-Experts training.

The public API (docs/api.md), loaded on first use so that ``import moegraph`` stays light:

    moegraph.CompileConfig    one compilation, a frozen validated value (moegraph.config)
    moegraph.Strategy         the parallel strategy (moegraph.ir)
    moegraph.compile          a config -> graph, schedule, report; or a module -> a sharded nn.Module
    moegraph.trace            a config -> its graph after the passes
    moegraph.load_schedule    a schedule file (written by compile, tune or run --trace) -> Schedule
"""

__version__ = "0.1.0"

_EXPORTS = {
    "compile": ("moegraph.api", "compile"),
    "trace": ("moegraph.api", "trace"),
    "CompileConfig": ("moegraph.config", "CompileConfig"),
    "Strategy": ("moegraph.ir", "Strategy"),
    "load_schedule": ("moegraph.schedules.schedule_file", "load_schedule"),
}

__all__ = ["CompileConfig", "Strategy", "compile", "load_schedule", "trace"]


def __getattr__(name: str):
    # lazy: each export loads its module (a later stage's, for load_schedule) on first use
    if name in _EXPORTS:
        import importlib
        module, attr = _EXPORTS[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'moegraph' has no attribute {name!r}")
