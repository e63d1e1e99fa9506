"""GPU session probe (``bash scripts/gpu_session.sh env``; docs/gpu.md): where moegraph and ortools
are imported from, a tiny CP-SAT solve, the device, and whether each torch API the CUDA path
uses exists in the torch that runs here (the device has torch 2.11, this repo pins 2.13).

Prints one line per check, ``ok`` or ``MISSING``/``FAILED`` with the reason; exits 1 if any
check failed, so a session learns it in its first, cheapest call. Runs without torch too (then
only the install checks run): that is how scripts/gpu_session.sh's install is verified off-device.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Callable

FAILED: list[str] = []


def check(name: str, fn: Callable[[], object]) -> None:
    try:
        detail = fn()
        print(f"ok       {name}" + (f": {detail}" if detail not in (None, "") else ""))
    except Exception as err:                       # noqa: BLE001 - every failure is reported, then exit 1
        FAILED.append(name)
        print(f"FAILED   {name}: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err) else ''}")
        if "-v" in sys.argv:
            traceback.print_exc()


def installed() -> str:
    """MOEGRAPH_SITE (set by gpu_session.sh): the --target folder every module must come from; the
    repo's own folders would shadow it if the repo root were on sys.path (PYTHONSAFEPATH=1)."""
    mods = [importlib.import_module(m) for m in ("moegraph", "moegraph.schedules", "moegraph.runtime")]
    site = os.environ.get("MOEGRAPH_SITE")
    if site:
        wrong = [m.__name__ for m in mods if not os.path.realpath(m.__file__).startswith(os.path.realpath(site))]
        if wrong:
            raise ImportError(f"{', '.join(wrong)} not imported from {site}: {[m.__file__ for m in mods]}")
    return ", ".join(f"{m.__name__} from {m.__file__}" for m in mods)


def ortools_version() -> str:
    import ortools
    return f"ortools {ortools.__version__} from {ortools.__file__}"


def transformers_version() -> str:
    """The transformers the HF family tests lower (carried in .whl/, as CI's; docs/gpu.md)."""
    import transformers
    from moegraph.lowering.structural import require_supported_transformers, transformers_range
    require_supported_transformers()
    return f"transformers {transformers.__version__} from {transformers.__file__} (supported {transformers_range()})"


def tiny_cpsat() -> str:
    """A 3-task, one-machine CP-SAT model through moegraph's own OR-tools import path."""
    from moegraph.schedules import cpsat
    cp_model = cpsat.cp_model
    m = cp_model.CpModel()
    durations = (3, 2, 4)
    starts = [m.new_int_var(0, 20, f"start[t{i}]") for i in range(3)]
    ivs = [m.new_interval_var(s, d, s + d, f"iv[t{i}]") for i, (s, d) in enumerate(zip(starts, durations))]
    m.add_no_overlap(ivs)
    end = m.new_int_var(0, 20, "makespan")
    for s, d in zip(starts, durations):
        m.add(end >= s + d)
    m.minimize(end)
    solver = cp_model.CpSolver()
    status = solver.solve(m)
    if status != cp_model.OPTIMAL or solver.value(end) != sum(durations):
        raise RuntimeError(f"status {solver.status_name(status)}, makespan {solver.value(end)}")
    return f"optimal makespan {solver.value(end)}"


def main() -> int:
    check("moegraph importable", installed)
    check("ortools", ortools_version)
    check("transformers", transformers_version)
    check("tiny CP-SAT solve", tiny_cpsat)
    try:
        import torch
    except ImportError:
        print("skipped  torch checks: no torch in this Python")
        return 1 if FAILED else 0
    cuda = torch.cuda.is_available()
    check("torch", lambda: f"{torch.__version__}, CUDA {torch.version.cuda}, available {cuda}")
    if cuda:
        def device() -> str:
            p = torch.cuda.get_device_properties(0)
            return f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}"
        check("device", device)
        check("NCCL", lambda: ".".join(map(str, torch.cuda.nccl.version())))
    # the torch APIs the CUDA path uses (runtime/executor.py, runtime/collectives.py, moegraph/kernels.py,
    # runtime/emulated.py): present in torch 2.13 and, by reading, in 2.11; checked here where it runs
    check("torch._grouped_mm(a, b, offs=)", lambda: _grouped_mm(torch, cuda))
    check("ProcessGroupNCCL.Options().config.min_ctas/max_ctas, is_high_priority_stream", lambda: _nccl(torch))
    check("ProcessGroupNCCL zero-CTA policy (copy-engine all-gather/all-to-all, NCCL >= 2.28; not used yet)",
          lambda: _cta_policy(torch))
    check("torch.cuda._sleep", lambda: _call_if(cuda, torch.cuda._sleep, 1000))
    check("torch.cuda.set_sync_debug_mode", lambda: _sync_debug(torch, cuda))
    check("torch.cuda.Stream(priority=)", lambda: _stream(torch, cuda))
    if cuda:
        check("moegraph.compile on cuda (tiny, cpsat) matches eager", lambda: _compile_tiny(torch))
    return 1 if FAILED else 0


def _call_if(cuda: bool, fn: Callable, *args) -> str:
    if not callable(fn):
        raise AttributeError(f"{fn!r} is not callable")
    if cuda:
        fn(*args)
        return "ran"
    return "present (not run: no CUDA)"


def _grouped_mm(torch, cuda: bool) -> str:
    fn = torch._grouped_mm
    if not cuda:
        return "present (not run: no CUDA)"
    a = torch.randn(48, 64, device="cuda", dtype=torch.bfloat16)          # [rows, in]
    w = torch.randn(3, 64, 32, device="cuda", dtype=torch.bfloat16)       # [groups, in, out]
    offs = torch.tensor([16, 32, 48], device="cuda", dtype=torch.int32)   # group ends
    out = fn(a, w, offs=offs)
    ref = torch.cat([a[i * 16:(i + 1) * 16].float() @ w[i].float() for i in range(3)])
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if err > 1e-2:
        raise RuntimeError(f"relative error {err:.2e} against per-group matmuls")
    return f"bf16 ran, rel err {err:.1e}"


def _nccl(torch) -> str:
    import torch.distributed as dist
    if not hasattr(dist, "ProcessGroupNCCL") and not torch.cuda.is_available():
        return "not in this build (CPU torch)"
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = True
    opts.config.min_ctas = opts.config.max_ctas = 4
    return f"min_ctas={opts.config.min_ctas} max_ctas={opts.config.max_ctas}"


def _cta_policy(torch) -> str:
    """Whether this torch can ask NCCL for copy-engine collectives (docs/runtime.md, "SM budgets"):
    information for the runtime's budget 0, not a requirement (absent: budget 0 runs on 1 CTA)."""
    import torch.distributed as dist
    if not hasattr(dist, "ProcessGroupNCCL"):
        return "not in this build (CPU torch)"
    zero = getattr(dist.ProcessGroupNCCL, "NCCL_CTA_POLICY_ZERO", None)
    if zero is None:
        return "absent in this torch (budget 0 runs on 1 CTA)"
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.cta_policy = zero
    return f"NCCL_CTA_POLICY_ZERO={zero} settable"


def _sync_debug(torch, cuda: bool) -> str:
    if not cuda:
        return _call_if(False, torch.cuda.set_sync_debug_mode)
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = torch.ones(4, device="cuda")
        try:
            x.sum().item()                         # a sync: must raise under "error"
        except RuntimeError:
            return "raises on .item() under 'error'"
        raise RuntimeError("set_sync_debug_mode('error') did not flag .item()")
    finally:
        torch.cuda.set_sync_debug_mode(old)


def _stream(torch, cuda: bool) -> str:
    if not cuda:
        return "not run: no CUDA"
    s = torch.cuda.Stream(priority=-100)
    lo, hi = s.priority_range()
    return f"priority {s.priority} (range {lo}..{hi})"


def _compile_tiny(torch) -> str:
    import moegraph
    from moegraph.registry import load_model
    from moegraph.runtime.check import check_against_eager
    from moegraph.runtime.reference import seeded_layer
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with torch.device("cuda"):
        layer = seeded_layer(load_model("tiny"), 0)
    x, dy = torch.randn(2, 32, 64, device="cuda"), torch.randn(2, 32, 64, device="cuda")
    compiled = moegraph.compile(layer, x, hardware="h100", schedule="cpsat", time_limit_s=5)
    rep = check_against_eager(layer, compiled, x, dy)
    err = max(rep["max_rel_err_output"], rep["max_rel_err_grads"])
    if err > 1e-4:
        raise RuntimeError(f"max rel err {err:.2e} (fp32, TF32 off: expected < 1e-4)")
    return f"{len(compiled.graph.nodes)} nodes, max rel err {err:.1e}"


if __name__ == "__main__":
    sys.exit(main())
