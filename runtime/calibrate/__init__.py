"""`moegraph calibrate`: measure this machine into a hardware profile the cost model reads.

Modules, in the order a calibration runs them: ``options`` (what a run is asked to do),
``benchmarks`` (what runs inside each rank, in priority order: ``compute_benches``, kernels
through ``moegraph.kernels``; ``comm_benches``, collectives through the runtime's ``Comm``;
``graph_benches``, whole layer graphs; on the ``harness`` of lockstep ranks and budgeted sweeps,
recording ``results``), ``fit`` (measurements -> profile fields, the self-check),
``steps`` (the in-step stage: real steps of the runtime), ``profile_io`` (the profile and
samples files, the structured facts a profile records), ``command`` (the CLI).
docs/calibration.md describes the method.
"""

from __future__ import annotations

from moegraph.runtime.calibrate.command import calibrate_command

__all__ = ["calibrate_command"]
