"""CUDA graphs (runtime/cudagraph.py) on CPU: the capture semantics with an emulated backend,
the capturability check against the fake device's host-sync counter, and the refusals. GPU
tests at the end skip without CUDA.

``FakeGraphs`` is what a CUDA graph does to memory: "capture" runs the segment once and keeps
the callable and the output buffers it wrote; "replay" re-runs the callable on the SAME static
placeholders and writes the results into those SAME output buffers. A missing copy-in (a stale
placeholder) or a missing clone-out (the caller holding a buffer the next replay overwrites)
shows as a mismatch against the eager module. What it cannot show, host values baked in at
capture, is what ``host_reads`` excludes; ``test_cudagraph_captured_segments_never_sync`` checks
that exclusion against the fake device's counter of host-synchronising calls.
"""

from __future__ import annotations

import pytest
import torch

import fake_cuda as fc
import test_fake_device as tfd
from helpers import eager_step, rel_err, small_layer
from moegraph.pass_steps import DEFAULT_PASSES
from moegraph.interpreter import shard_param
from moegraph.ir import Strategy
from moegraph.passes import run_pipeline
from moegraph.runtime import RuntimeFailure
from moegraph.runtime.collectives import NoComm
from moegraph.runtime.cudagraph import GraphedExecutor, capture_refusal, first_host_read, segments
from moegraph.runtime.module import CompiledLayer, make_plan
from moegraph.runtime.plan import ExecutionPlan
from moegraph.tracer import trace_module

B, S, H = 2, 16, 64
TOL = 1e-5
STEPS = 3


class FakeGraphs:
    """The emulated capture backend (see the module doc); counts captures and replays."""

    def __init__(self):
        self.captures = self.replays = 0

    def capture(self, fn, fork):
        fork()
        out = fn()
        self.captures += 1
        return (fn, out), out

    def replay(self, handle):
        fn, out = handle
        for k, v in fn().items():
            if isinstance(v, torch.Tensor):
                out[k].copy_(v)
            else:                           # an index map: its tensors, in place
                for a, b in ((out[k].flat, v.flat), (out[k].counts, v.counts), (out[k].offsets, v.offsets),
                             (out[k].rows, v.rows)):
                    if a is not None:
                        a.copy_(b)
        self.replays += 1


def lowered(attn, ffn, dispatch, n, spec=DEFAULT_PASSES):
    layer = small_layer(n, seed=0)
    graph = trace_module(layer, Strategy(attn, ffn, dispatch, n, dtype="fp32"), batch=B, seq=S)
    if spec:
        graph, _ = run_pipeline(graph, spec, cost=tfd.COST)
    return layer, graph


def _captured_segments(graph, plan, mode):
    return sum(s.captured for entries in plan.split(graph) for s in segments(graph, entries, mode))


# -- numerics over steps: stale placeholders, aliased outputs -------------------------------------

CASES = [(1, "sp", "tp", "ag-rs", "layer", "exact"), (2, "tp", "tp", "ag-rs", "layer", "exact"),
         (2, "tp", "tp", "ag-rs", "attention", "exact"), (2, "sp", "ep", "ag-rs", "attention", "exact"),
         (2, "sp", "ep", "ag-rs", "layer", "padded"), (4, "sp", "ep", "ag-rs", "layer", "padded")]


@pytest.mark.parametrize("n,attn,ffn,dispatch,mode,expert_rows", CASES, ids=["-".join(map(str, c)) for c in CASES])
@pytest.mark.slow
def test_cudagraph_replay_matches_eager_over_steps(n, attn, ffn, dispatch, mode, expert_rows):
    """Three steps with different inputs and parameters changed between steps (in place, and at
    step 3 one parameter's storage replaced): every step's output, input gradient and parameter
    gradients equal the eager module's; step 1's returned output is unchanged after step 2.
    ffn=ep under ag-rs captures whole ('layer') with capacity-padded expert rows: the routing
    changes every step, the captured shapes do not."""
    module, graph = lowered(attn, ffn, dispatch, n)
    plan = make_plan(graph, tfd.COST, "greedy")
    gen = torch.Generator().manual_seed(7)
    full = [{k: p.detach().clone() for k, p in module.named_parameters()}]
    for _ in range(STEPS - 1):                                  # an optimizer-like update per step
        full.append({k: v - 0.05 * torch.randn(v.shape, generator=gen) for k, v in full[-1].items()})
    data = [(torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)) for _ in range(STEPS)]
    ref = []
    for params, (x, dy) in zip(full, data):
        with torch.no_grad():
            for k, p in module.named_parameters():
                p.copy_(params[k])
        ref.append(eager_step(module, x, dy))

    shared = tfd.ThreadComm(n) if n > 1 else None
    backends = [FakeGraphs() for _ in range(n)]
    got: dict[int, list] = {r: [] for r in range(n)}
    first_y: dict[int, tuple] = {}
    replaced = next(p for p, spec in graph.params if spec.shard_dim is not None)   # its storage is swapped at step 3

    def rank_main(rank):
        layer = CompiledLayer(graph, plan, full[0], rank=rank, n=n, comm=shared.for_rank(rank) if shared else NoComm(),
                              cuda_graphs=mode, graph_backend=backends[rank], expert_rows=expert_rows)
        for step, (x, dy) in enumerate(data):
            if step:
                with torch.no_grad():
                    for pname, spec in graph.params:
                        new = shard_param(spec, full[step], rank, n)
                        if step == STEPS - 1 and pname == replaced:
                            layer.shard(pname).data = new.clone()      # new storage: must be copied in
                        else:
                            layer.shard(pname).copy_(new)              # in place: the graph reads it
            for p in layer.parameters():
                p.grad = None
            xs = layer.shard_input(x).requires_grad_(True)
            y = layer(xs)
            y.backward(layer.shard_input(dy))
            if step == 0:
                first_y[rank] = (y, y.detach().clone())                # y itself stays held
            got[rank].append((y.detach().clone(), xs.grad.clone(),
                              {p: layer.shard(p).grad.clone() for p, _ in layer.named_shards()}))

    tfd.run_rank_threads(n, rank_main, shared)
    for step, (y_ref, dx_ref, g_ref) in enumerate(ref):
        y = torch.cat([got[r][step][0] for r in range(n)], dim=1)
        dx = torch.cat([got[r][step][1] for r in range(n)], dim=1)
        assert rel_err(y, y_ref) < TOL, f"step {step + 1}: output"
        assert rel_err(dx, dx_ref) < TOL, f"step {step + 1}: input gradient"
        for r in range(n):
            for pname, spec in graph.params:
                expected = shard_param(spec, g_ref, r, n)
                assert rel_err(got[r][step][2][pname], expected) < TOL, f"step {step + 1}: gradient of {pname}"
    for r, (held, copy) in first_y.items():
        assert torch.equal(held.detach(), copy), "step 1's output changed under a later replay (aliased buffer)"
    segs = _captured_segments(graph, plan, mode)
    assert segs >= 1
    for b in backends:                      # really captured once and replayed every step
        assert (b.captures, b.replays) == (segs, STEPS * segs)


# -- the capturability check against the sync counter ----------------------------------------------

SYNC_CASES = [("tp", "tp", "ag-rs", "layer", "exact"), ("tp", "tp", "ag-rs", "attention", "exact"),
              ("sp", "ep", "ag-rs", "attention", "exact"), ("sp", "ep", "a2a", "attention", "exact"),
              ("sp", "ep", "ag-rs", "layer", "padded")]


@pytest.mark.parametrize("attn,ffn,dispatch,mode,expert_rows", SYNC_CASES, ids=["-".join(c) for c in SYNC_CASES])
@pytest.mark.slow
def test_cudagraph_captured_segments_never_sync(attn, ffn, dispatch, mode, expert_rows, monkeypatch):
    """On the fake CUDA device (streams, events, n=2 emulated collectives: the GPU code path), the
    segments the check lets capture make no host-synchronising call (.item/.tolist, device-to-host
    copies, data-dependent shapes, stream/event synchronize) and no host-to-device copy (a graph
    would replay it from a host buffer long freed): capture's precondition. The eager
    middle of an ffn=ep layer with exact expert rows does sync (so the counter sees syncs where
    they are); with padded ones the whole step makes none. The step's output equals the eager
    module's."""
    module, graph = lowered(attn, ffn, dispatch, 2)
    plan = make_plan(graph, tfd.COST, "greedy")
    params = {k: p.detach() for k, p in module.named_parameters()}
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
    inside: list = []                              # (syncs, stream syncs) while a captured segment ran
    state = None

    forked: list[bool] = []                        # every comm stream ordered after the capturing stream
    uploads: list[int] = []                        # host-to-device copies (a captured one reads freed host memory)

    class Counting(FakeGraphs):
        comm_streams: dict = {}

        def capture(self, fn, fork):
            def checked_fork():
                comm = list(self.comm_streams.values())
                waits = [len(s.waits) for s in comm]
                fork()
                forked.append(bool(comm) and all(len(s.waits) == w + 1 for s, w in zip(comm, waits)))
            mode_ = fc._ACTIVE.mode
            before, streams, h2d = +mode_.syncs, +state.syncs, mode_.h2d
            handle = super().capture(fn, checked_fork)
            inside.append((mode_.syncs - before, state.syncs - streams))
            uploads.append(mode_.h2d - h2d)
            return handle

    def executor(graph, plan, comm, *, rank, n, device, timeout_s, expert_rows):
        backend = Counting()
        ex = GraphedExecutor(graph, plan, comm, rank=rank, n=n, device=device, timeout_s=timeout_s, mode=mode,
                             backend=backend, expert_rows=expert_rows)
        backend.comm_streams = ex.comm_streams
        return ex

    monkeypatch.setattr(tfd, "Executor", executor)
    real_streams = fc.fake_streams

    def streams(mp):
        nonlocal state
        state = real_streams(mp)
        return state

    monkeypatch.setattr(fc, "fake_streams", streams)
    got, _, modes = tfd._run_fake(graph, plan, params, x, dy, 2, monkeypatch, expert_rows)
    assert len(inside) == 2 * _captured_segments(graph, plan, mode) > 0
    assert all(not +a and not +b for a, b in inside), f"a captured segment synchronised the host: {inside}"
    assert forked and all(forked), "a comm stream was not forked from the capturing stream"
    assert not any(uploads), f"a captured segment copied host memory to the device: {uploads}"
    total = sum((+m.syncs for m in modes), start=fc.collections.Counter())
    assert bool(total) == (ffn == "ep" and expert_rows == "exact"), total
    y_ref, _, _ = eager_step(module, x, dy)
    assert rel_err(torch.cat([got[r][0] for r in range(2)], dim=1), y_ref) < TOL


# -- refusals ---------------------------------------------------------------------------------------

def test_cudagraph_layer_refuses_a2a_by_name():
    module, graph = lowered("sp", "ep", "a2a", 2)
    plan = make_plan(graph, tfd.COST, "greedy")
    full = {k: p.detach() for k, p in module.named_parameters()}
    want = ("cuda_graphs: forward node 'dispatch_a2a' (ffn=ep, dispatch=a2a) sends data-dependent split sizes "
            "(copied to the host for the all-to-all); capture needs static shapes (ffn=tp with dispatch=ag-rs, "
            "or ffn=ep with dispatch=ag-rs and expert_rows='padded', captures whole, or use "
            "cuda_graphs='attention')")
    assert capture_refusal(graph, plan, "layer") == want
    with pytest.raises(RuntimeFailure) as err:
        CompiledLayer(graph, plan, full, rank=0, n=2, comm=NoComm(), cuda_graphs="layer", graph_backend=FakeGraphs())
    assert str(err.value) == want
    assert capture_refusal(graph, plan, "attention") is None


def test_cudagraph_layer_refuses_exact_local_index_map_and_points_to_padded():
    module, graph = lowered("sp", "ep", "ag-rs", 2)
    plan = ExecutionPlan.sequential(graph)
    hit = first_host_read(graph, plan)
    assert (hit.node, hit.phase) == ("index_map", "forward")
    want = ("cuda_graphs: forward node 'index_map' (ffn=ep, dispatch=ag-rs) builds a local index map whose row count "
            "R is read on the host (expert_rows='exact': dropless routing sizes the expert buffers by it; "
            "expert_rows='padded' fixes them at C = T * min(k, E/n) rows, still dropless, and captures); ")
    assert hit.refusal(graph).startswith(want)
    assert capture_refusal(graph, plan, "layer", "exact").startswith(want)
    assert first_host_read(graph, plan, "padded") is None and capture_refusal(graph, plan, "layer", "padded") is None
    full = {k: p.detach() for k, p in module.named_parameters()}
    with pytest.raises(RuntimeFailure, match="expert_rows='padded' fixes them"):
        CompiledLayer(graph, plan, full, rank=0, n=2, comm=NoComm(), cuda_graphs="layer", graph_backend=FakeGraphs())
    _, tp = lowered("tp", "tp", "ag-rs", 2)
    assert first_host_read(tp, ExecutionPlan.sequential(tp)) is None


@pytest.mark.parametrize("ffn,dispatch", [("ep", "a2a"), ("ep", "ag-rs")])
def test_cudagraph_host_reads_cover_both_phases_and_spare_attention(ffn, dispatch):
    """Every token all-to-all and every grouped GEMM (forward, backward, recompute) of an ffn=ep
    layer needs a host value; no node of the attention block does."""
    from moegraph.ir import OpKind
    from moegraph.runtime.cudagraph import host_reads
    _, graph = lowered("sp", ffn, dispatch, 2)
    reads = host_reads(graph)
    must = [nd.name for nd in graph.nodes if nd.op is OpKind.GROUPED_GEMM
            or (nd.op is OpKind.ALL_TO_ALL and nd.attr("mode") == "tokens")]
    assert must and any(graph.node[m].phase.value != "forward" for m in must)
    assert not sorted(set(must) - set(reads))
    attention = [nd.name for nd in graph.nodes if nd.block == "attention"]
    assert attention and not sorted(set(attention) & set(reads))


@pytest.mark.parametrize("config,spec,family", tfd.GRAPHS,
                         ids=[f"{fam}-{a}-{f}-{d}-dp{dp}" for (a, f, d, dp), _, fam in tfd.GRAPHS])
def test_cudagraph_host_reads_has_a_rule_for_every_kernel(config, spec, family):
    """The graphs that together use every kernel (test_fake_device.GRAPHS): ``host_reads`` decides
    every node (an op kind without a rule raises), and ffn=tp with ag-rs has no host read."""
    from moegraph.runtime.cudagraph import host_reads
    _, graph, *_ = tfd.build(*config, spec, family)
    reads = host_reads(graph)
    attn, ffn, dispatch, _ = config
    assert (not reads) == (ffn == "tp" and dispatch == "ag-rs"), sorted(reads)


def test_cudagraph_refuses_cpu_with_the_real_backend_and_bad_modes():
    module, graph = lowered("tp", "tp", "ag-rs", 1)
    plan = make_plan(graph, tfd.COST, "greedy")
    full = {k: p.detach() for k, p in module.named_parameters()}
    with pytest.raises(ValueError, match=r"cuda_graphs='layer' needs the layer on a CUDA device .* it is on cpu"):
        CompiledLayer(graph, plan, full, rank=0, n=1, comm=NoComm(), cuda_graphs="layer")
    with pytest.raises(ValueError, match=r"cuda_graphs='whole' is not one of 'off', 'attention', 'layer'"):
        CompiledLayer(graph, plan, full, rank=0, n=1, comm=NoComm(), cuda_graphs="whole")
    import moegraph
    x = torch.randn(B, S, H)
    with pytest.raises(ValueError, match=r"cuda_graphs='attention' needs the layer on a CUDA device"):
        moegraph.compile(module, x, cuda_graphs="attention", schedule="sequential")
    from moegraph.models import MoETransformer
    from moegraph.registry import load_model
    model = MoETransformer.from_config(load_model("tiny"), vocab=64)
    with pytest.raises(ValueError, match=r"cuda_graphs='layer' captures a compiled layer; a whole model "
                                         r"\(MoETransformer\) runs uncaptured"):
        moegraph.compile(model, torch.zeros(2, 16, dtype=torch.long), cuda_graphs="layer")
    # off is the plain executor: nothing changes
    layer = CompiledLayer(graph, plan, full, rank=0, n=1, comm=NoComm())
    assert type(layer.executor).__name__ == "Executor" and layer.record


# -- on a real GPU ----------------------------------------------------------------------------------

def gpu(test):
    """A real-GPU test: marked ``gpu`` (``pytest -m gpu``, scripts/gpu_session.sh) and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


def _gpu_layer(mode, dtype, seed=0, ffn="tp", expert_rows="exact"):
    import moegraph
    module = small_layer(1, seed=seed).to("cuda", dtype)
    x0 = torch.randn(B, S, H, device="cuda", dtype=dtype)
    return module, moegraph.compile(module, x0, attn="sp", ffn=ffn, dispatch="ag-rs", schedule="greedy",
                                    cuda_graphs=mode, expert_rows=expert_rows)


def _gpu_steps(module, layer, dtype, tol, reference=None):
    """Three steps with new inputs and an in-place parameter update between them; output, input
    gradient and every parameter gradient against the eager module (or ``reference``, a layer
    compiled without graphs, stepped alongside)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    for step in range(STEPS):
        x = torch.randn(B, S, H, device="cuda", dtype=dtype, generator=gen)
        dy = torch.randn(B, S, H, device="cuda", dtype=dtype, generator=gen)
        if reference is None:
            y_ref, dx_ref, g_ref = eager_step(module, x, dy)
        else:
            y_ref, dx_ref, g_ref = _compiled_step(reference, x, dy)
        y, dx, grads = _compiled_step(layer, x, dy)
        assert rel_err(y.float(), y_ref.float()) < tol, f"step {step + 1}: output"
        assert rel_err(dx.float(), dx_ref.float()) < tol, f"step {step + 1}: input gradient"
        for k, g in g_ref.items():
            assert rel_err(grads[k].float(), g.float()) < tol, f"step {step + 1}: gradient of {k}"
        with torch.no_grad():                      # an in-place update, as an optimizer makes
            for p in module.parameters():
                p.mul_(0.99)
            for lay in (layer, reference):
                if lay is not None:
                    lay.load_full({k: p.detach() for k, p in module.named_parameters()})


def _compiled_step(layer, x, dy):
    for p in layer.parameters():
        p.grad = None
    xs = x.clone().requires_grad_(True)
    y = layer(xs)
    y.backward(dy)
    return y.detach(), xs.grad, layer.full_grads()


@gpu
def test_cudagraph_gpu_attention_matches_eager_fp32(monkeypatch):
    """Real capture on one GPU (n=1, ffn=tp), 'attention' mode, fp32, against the eager module."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)     # fp32 means fp32 on both sides
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    module, layer = _gpu_layer("attention", torch.float32)
    assert type(layer.executor).__name__ == "GraphedExecutor"
    _gpu_steps(module, layer, torch.float32, 1e-4)


@gpu
def test_cudagraph_gpu_layer_fp32_matches_eager(monkeypatch):
    """'layer' in fp32: the grouped GEMM reads no host value on any GPU (moegraph.grouped_gemm: the
    masked formulation where torch._grouped_mm's kernel does not take fp32), so the whole forward
    and backward capture, and the captured layer matches eager."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    module, layer = _gpu_layer("layer", torch.float32)
    assert type(layer.executor).__name__ == "GraphedExecutor"
    _gpu_steps(module, layer, torch.float32, 1e-4)


@gpu
def test_cudagraph_gpu_layer_bf16_matches_the_uncaptured_layer():
    """'layer' in bf16 (whole forward and backward captured) against the same plan run without
    graphs (same kernels: only atomics' order may differ) and, loosely, against eager bf16."""
    module, layer = _gpu_layer("layer", torch.bfloat16)
    _, plain = _gpu_layer("off", torch.bfloat16)
    _gpu_steps(module, layer, torch.bfloat16, 1e-2, reference=plain)
    module, layer = _gpu_layer("layer", torch.bfloat16, seed=1)
    _gpu_steps(module, layer, torch.bfloat16, 5e-2)


@gpu
def test_cudagraph_gpu_layer_bf16_ep_padded_matches_the_uncaptured_layer():
    """ffn=ep under ag-rs with padded expert rows, 'layer' in bf16 (n=1: the whole layer, its index
    map included, in one graph per phase) against the same plan run without graphs, and loosely
    against eager bf16; the routing changes with every step's input."""
    module, layer = _gpu_layer("layer", torch.bfloat16, ffn="ep", expert_rows="padded")
    _, plain = _gpu_layer("off", torch.bfloat16, ffn="ep", expert_rows="padded")
    assert type(layer.executor).__name__ == "GraphedExecutor"
    _gpu_steps(module, layer, torch.bfloat16, 1e-2, reference=plain)
    module, layer = _gpu_layer("layer", torch.bfloat16, seed=1, ffn="ep", expert_rows="padded")
    _gpu_steps(module, layer, torch.bfloat16, 5e-2)


@gpu
def test_cudagraph_gpu_padded_expert_rows_replay_new_routing_bf16():
    """Real padding under real capture (n=1 has none: C = R there): rank 0 of n=2 (El=4 of E=8,
    k=3) builds its padded index map, dispatches, runs the grouped GEMM and combines, all in one
    CUDA graph; replayed on three new routings (one sending rank 0 every row, one none) it equals
    the same kernels run eagerly with the exact map."""
    from moegraph.ir import Node, OpKind, Phase, Role
    from moegraph.grouped_gemm import grouped_rows
    from moegraph.index_map import build_index_map
    from moegraph.kernels import KERNELS, RankContext
    T, k, El, f = 64, 3, 4, 32
    gen = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(El, f, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = torch.zeros(T, H, device="cuda", dtype=torch.bfloat16)
    experts = torch.zeros(T, k, device="cuda", dtype=torch.int64)
    ctx = RankContext(0, 2, T)
    combine = Node(name="combine", op=OpKind.UNPERMUTE, phase=Phase.FORWARD, inputs=(), outputs=(),
                   role=Role.FORWARD, attrs=(("weighted", False),))

    def moe(rows_mode):
        imap = build_index_map(experts, "local", El, 0, 2, rows_mode)
        y = grouped_rows(x[imap.tokens], w, imap)                                        # [C, f]
        return KERNELS[(OpKind.UNPERMUTE, Role.FORWARD)](ctx, combine, [y, imap], [(T, f)])[0]

    def routing(step):
        if step == 1:                                                                  # every row here
            return torch.stack([torch.randperm(El, device="cuda", generator=gen)[:k] for _ in range(T)])
        if step == 2:                                                                  # none here
            return El + torch.stack([torch.randperm(El, device="cuda", generator=gen)[:k] for _ in range(T)])
        return torch.stack([torch.randperm(2 * El, device="cuda", generator=gen)[:k] for _ in range(T)])

    experts.copy_(routing(0))
    x.copy_(torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda.set_sync_debug_mode("error")          # padded: nothing reads the host
        try:
            moe("padded")
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe("padded")
    for step in range(3):
        experts.copy_(routing(step))
        x.copy_(torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen))
        graph.replay()
        want = moe("exact")
        assert torch.isfinite(out).all(), f"step {step + 1}: padding leaked"
        assert rel_err(out.float(), want.float()) < 1e-2 if want.abs().max() > 0 else torch.equal(out, want), \
            f"step {step + 1}"
