"""Shared test helpers: eager reference runs and relative errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moegraph.models import MoETransformerLayer
from moegraph.runtime.check import rel_err  # noqa: F401 - the tests' relative error is the runtime's
from seeding import fresh_seed  # noqa: F401 - seeds of cases built at import (tests/seeding.py)


def small_layer(n: int, seed: int = 0, **features) -> MoETransformerLayer:
    """A layer every n in {1, 2, 4} can split: 8 heads, 4 kv heads, 8 experts, top-3.
    ``features``: the layer's optional parts (qkv_bias, qk_norm, shared_ffn_hidden, ...)."""
    torch.manual_seed(seed)
    layer = MoETransformerLayer(hidden=64, heads=8, kv_heads=4, ffn_hidden=96, experts=8, top_k=3, **features)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def eager_step(module, x: torch.Tensor, dy: torch.Tensor, call=None):
    """Output, input gradient and parameter gradients of the eager module."""
    module.zero_grad()
    x = x.clone().requires_grad_(True)
    y = call(module, x) if call else module(x)
    y.backward(dy)
    grads = {k: p.grad.clone() for k, p in module.named_parameters()}
    return y.detach(), x.grad.clone(), grads


def max_grad_err(grads: dict, expected: dict) -> tuple[str, float]:
    errs = {k: rel_err(grads[k], expected[k]) for k in expected}
    worst = max(errs, key=errs.get)
    return worst, errs[worst]


def assert_interpreted_matches_eager(layer, strategy, x: torch.Tensor, dy: torch.Tensor, tol: float = 1e-5,
                                     passes: str = "", cost=None):
    """Trace ``layer`` for ``strategy`` (then run ``passes`` under ``cost``) and run it through the
    interpreter: output, input gradient and every parameter gradient within ``tol`` (relative) of the
    eager module's. Returns the graph."""
    from moegraph.interpreter import interpret
    from moegraph.passes import run_pipeline
    from moegraph.tracer import trace_module
    y_ref, dx_ref, grads_ref = eager_step(layer, x, dy)
    graph = trace_module(layer, strategy, batch=x.shape[0], seq=x.shape[1])
    graph = run_pipeline(graph, passes, cost=cost)[0] if passes else graph
    held = {k: t.detach() for k, t in [*layer.named_parameters(), *layer.named_buffers()]}
    res = interpret(graph, held, x, dy)
    assert rel_err(res.output, y_ref) < tol
    assert rel_err(res.input_grad, dx_ref) < tol
    assert set(res.param_grads) == set(grads_ref)
    name, err = max_grad_err(res.param_grads, grads_ref)
    assert err < tol, f"gradient of {name}: {err:.2e}"
    return graph


def held_for_backward(graph) -> int:
    """Bytes of the values the forward must leave for backward, counted from the graph alone:
    produced in forward (or the activation input) and read, directly or through a view, by a
    backward or recompute node. What any schedule holds at the barrier."""
    from moegraph.ir import Phase, ValueKind

    def base(v):
        while graph.value[v].alias_of is not None:
            v = graph.value[v].alias_of
        return v
    forward = {o for n in graph.nodes if n.phase is Phase.FORWARD for o in n.outputs}
    forward |= {v for v in graph.inputs if graph.value[v].kind is ValueKind.ACTIVATION}
    read = {base(v) for n in graph.nodes if n.phase is not Phase.FORWARD for v in n.inputs if v in forward}
    return sum(graph.value[v].nbytes for v in read if graph.value[v].kind is not ValueKind.PARAM)


# -- many tests' rank functions in one spawn --------------------------------------------------------

class RankBatch:
    """Rank functions of many tests run in ONE spawn per number of ranks.

    Starting ranks costs seconds (each imports torch; 4 ranks share 2 cores), more than most
    checks take, so test modules register their rank functions at import (``add``) and the first
    test asking for a result (``get``) starts one spawn that runs every registered case of that
    size not run yet, in registration order; each test still checks its own case's results. A
    case runs as it would in a spawn of its own: same ``fn(rank, n, *args)``, same process group,
    torch's global generator reset to a fresh process's seed. Each case's per-rank result is
    written to a folder as soon as it returns, so a crash, or a hang past the batch's timeout (the
    sum of its cases' ``timeout_s``: a hang is noticed only then, not after the hanging case's own
    share), fails the case that caused it with its own traceback and the cases after it with a
    message naming why. ``pytest -k`` selecting one of them still runs the whole batch."""

    def __init__(self) -> None:
        self._pending: dict[int, dict[str, tuple]] = {}       # n -> {name: (fn, make_args, timeout_s)}
        self._ran: dict[tuple[int, str], tuple[Path, str]] = {}  # (n, name) -> (folder, why it stopped)

    def add(self, n: int, name: str, fn, *args, timeout_s: float = 300.0, make_args=None) -> str:
        """Register ``fn(rank, n, *args)`` (a module-level function) as case ``name``; returns it.
        ``make_args``: a callable giving the arguments instead, called when the batch starts (for
        arguments that take work to build, such as solved plans)."""
        pending = self._pending.setdefault(n, {})
        if name in pending or (n, name) in self._ran:
            raise ValueError(f"rank batch case {name!r} is registered twice")
        pending[name] = (fn, (lambda: tuple(args)) if make_args is None else make_args, timeout_s)
        return name

    def get(self, n: int, name: str, tmp_root: Path) -> list:
        """Per rank, case ``name``'s result; runs the n-rank batch on first use."""
        import pickle
        if name in self._pending.get(n, {}):
            self._run(n, tmp_root)
        if (n, name) not in self._ran:
            raise KeyError(f"no {n}-rank case {name!r} is registered")
        folder, stopped = self._ran[(n, name)]
        files = [folder / f"{name}.rank{r}.pkl" for r in range(n)]
        if all(f.exists() for f in files):
            return [pickle.loads(f.read_bytes()) for f in files]
        errors = sorted((e.stat().st_mtime_ns, r, e) for r in range(n)
                        if (e := folder / f"{name}.rank{r}.err").exists())
        if errors:                                    # the first to fail is the cause, the others its symptoms
            _, r, first = errors[0]
            pytest.fail(f"{name} raised on rank {r} first:\n{first.read_text()}\n(the {n}-rank batch: {stopped})",
                        pytrace=False)
        if (folder / f"{name}.started").exists():
            pytest.fail(f"{name} was running when the {n}-rank batch stopped: {stopped}", pytrace=False)
        pytest.fail(f"{name} did not run: the {n}-rank batch stopped before it: {stopped}", pytrace=False)

    def _run(self, n: int, tmp_root: Path) -> None:
        from moegraph.runtime.launch import spawn
        pending = self._pending.pop(n)
        folder = tmp_root / f"rank-batch-{n}-{len(self._ran)}"
        folder.mkdir(parents=True)
        stopped = "finished"
        try:
            cases = [(name, fn, tuple(make_args())) for name, (fn, make_args, _) in pending.items()]
            spawn(run_batch, n, args=(cases, str(folder)), timeout_s=sum(t for _, _, t in pending.values()))
        except Exception as err:  # noqa: BLE001 - reported by each case that did not finish
            stopped = f"{type(err).__name__}: {err}"
        for name in pending:
            self._ran[(n, name)] = (folder, stopped)


def run_batch(rank: int, n: int, cases: list[tuple], folder: str) -> None:
    """Rank function of a RankBatch: each case in order, its result pickled as soon as it returns."""
    import pickle
    import traceback
    out = Path(folder)
    fresh = torch.initial_seed()                   # what every fresh rank process starts from
    for name, fn, args in cases:
        if rank == 0:
            (out / f"{name}.started").touch()
        torch.manual_seed(fresh)
        try:
            result = fn(rank, n, *args)
        except BaseException:
            (out / f"{name}.rank{rank}.err").write_text(traceback.format_exc())
            raise
        (out / f"{name}.rank{rank}.pkl").write_bytes(pickle.dumps(result))


RANK_BATCH = RankBatch()


# h800 as the cost model priced it before the shape and size curves (issue 29): constant
# efficiencies, no curve, so tests can check the base formulas by hand (tests/test_cost.py).
FLAT = dict(gemm_eff=0.75, grouped_gemm_eff=0.65, attention_eff=0.55, ring_eff_intra=0.726, ring_eff_inter=0.726,
            a2a_eff_intra=0.55, a2a_eff_inter=0.427, gemm_tiles=(), gemm_k_half=0.0, attention_seq_half=0.0,
            attention_head_dim_eff=(), attention_bwd_factor=1.0, ring_half_bytes_intra=0.0,
            ring_half_bytes_inter=0.0, a2a_half_bytes_intra=0.0, a2a_half_bytes_inter=0.0,
            comm_hbm_traffic=0.0,   # compute beside collectives slowed as a whole by S/(S-b), as before issue 29
            copy_engine_eff=0.6)    # below the flat rings: budget 0 only pays where SMs are scarce


def flat_h800():
    """h800 with the constant efficiencies of the module docstring and no shape or size curve."""
    import dataclasses

    from moegraph.registry import load_hardware
    return dataclasses.replace(load_hardware("h800"), **FLAT)


def routing_gather_bytes(b: int, s: int, k: int, n: int):
    """Bytes one rank sends in ag-rs dispatch's routing all-gather (each rank routes its own b*s/n
    tokens, then the top-k weights, fp32, and expert ids, int64, of all b*s are gathered): a ring
    all-gather of b*s*k*(4 + 8) bytes sends (n-1)/n of it. Outside the paper's eq (4), which
    counts the tokens' gather and reduce-scatter only. A Fraction."""
    from fractions import Fraction
    return Fraction(b * s * k * (4 + 8) * (n - 1), n)
