"""moegraph: operator-graph compiler and schedule autotuner for Mixture-of-Experts training."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # lazy: `import moegraph` stays light; `moegraph.compile` loads the pipeline on first use
    if name == "compile":
        from moegraph.api import compile
        return compile
    raise AttributeError(f"module 'moegraph' has no attribute {name!r}")
