"""moegraph: operator-graph compiler and schedule autotuner for Mixture-of-Experts training."""

__version__ = "0.1.0"
