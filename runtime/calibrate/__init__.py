"""`moegraph calibrate`: measure this machine into a hardware profile the cost model reads.

Modules, in the order a calibration runs them: ``options`` (what a run is asked to do),
``benchmarks`` (what runs inside each rank: kernels through ``moegraph.kernels``, collectives
through the runtime's ``Comm``), ``fit`` (measurements -> profile fields, the self-check),
``steps`` (the in-step stage: real steps of the runtime), ``profile_io`` (the profile and
samples files, the structured facts a profile records), ``command`` (the CLI).
docs/calibration.md describes the method.
"""

from __future__ import annotations

from moegraph.runtime.calibrate.command import calibrate_command

__all__ = ["calibrate_command"]
