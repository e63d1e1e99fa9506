"""Device mixing, caught on a CPU machine: every kernel (forward and backward) and the executor's
step run on tensors of a fake CUDA device (tests/fake_cuda.py). A CPU tensor built inside a
kernel and meeting a CUDA one raises there, exactly where a real GPU would fail; the numbers
must equal the same run on CPU.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fake_cuda as fc
from helpers import eager_step, max_grad_err, rel_err, small_layer
from moegraph.cost import CostModel
from moegraph.interpreter import interpret, run_collective, shard_param
from moegraph.ir import Strategy
from moegraph.kernels import KERNELS
from moegraph.passes import run_pipeline
from moegraph.registry import load_hardware
from moegraph.runtime.collectives import NoComm, Pending
from moegraph.runtime.executor import Executor
from moegraph.runtime.module import make_plan
from moegraph.runtime.plan import ExecutionPlan
from moegraph.tracer import trace_module

B, S, H = 2, 16, 64
TOL = 1e-5
COST = CostModel(load_hardware("h800"))
# (attn, ffn, dispatch, dp), pipeline, layer: together they use every kernel in KERNELS (checked
# below). Layers other than "ref" (the project's reference layer) are transformers' families.
GRAPHS = [(("sp", "ep", "a2a", 1), "chunk=2,gate-reorder,sar=paper", "ref"),
          (("tp", "tp", "ag-rs", 1), "gate-reorder,sar=paper", "ref"),
          (("sp", "ep", "ag-rs", 1), "chunk=2,compress=tp-fp8", "ref"),
          (("sp", "ep", "a2a", 1), "chunk=2,compress=ep-fp8", "ref"),            # fp8 casts in backward too
          (("tp", "ep", "a2a", 2), "compress=dp-bf16", "ref"),
          (("tp", "ep", "a2a", 1), "gate-reorder,sar=paper", "qwen2_moe"),     # bias, sigmoid_gate
          (("tp", "tp", "ag-rs", 1), "", "olmoe"),             # q/k norm across ranks: square_sum, rmsnorm_sharded
          (("sp", "ep", "a2a", 1), "gate-reorder,sar=paper", "deepseek_v3"),   # mla_heads
          # structurally lowered families (tests/family_zoo.py): glu, grouped_bias (its row-weight
          # gradient under gate-reorder), the router's logit-bias gradient, attention sinks and
          # windows (gpt_oss); per-head and L2 norms (qwen3_moe, llama4); scale (granitemoe);
          # LayerNorm (mixtral with torch's nn.LayerNorm as its input norm); limit (dbrx's clip_qkv);
          # Gated DeltaNet's core (qwen3_next's linear-attention layer)
          (("sp", "ep", "a2a", 1), "gate-reorder", "zoo:gpt_oss"),
          (("tp", "tp", "ag-rs", 1), "", "zoo:qwen3_moe"),
          (("sp", "ep", "ag-rs", 1), "", "zoo:llama4"),
          (("tp", "ep", "ag-rs", 1), "", "zoo:granitemoe"),
          (("sp", "ep", "a2a", 1), "", "layernorm"),
          (("tp", "ep", "a2a", 1), "", "zoo:dbrx"),
          (("sp", "ep", "a2a", 1), "", "zoo:qwen3_next")]                     # gated_delta (its layer 0)


pytestmark = pytest.mark.usefixtures("one_thread")      # conftest: tiny tensors, one torch thread


def build(attn, ffn, dispatch, dp, spec, family="ref", n=2, seed=0):
    if family == "ref":
        layer = small_layer(n, seed=seed)
    elif family.startswith("zoo:") or family == "layernorm":
        pytest.importorskip("transformers")
        from family_zoo import moe_causal_lms, tiny_model
        name = "mixtral" if family == "layernorm" else family[4:]
        model = tiny_model(name, dict(moe_causal_lms())[name], seed=seed)
        layer = model.transformer.blocks[0] if name == "dbrx" else model.model.layers[0]
        if family == "layernorm":
            layer.input_layernorm = torch.nn.LayerNorm(H)
            torch.nn.init.normal_(layer.input_layernorm.weight, 1.0, 0.2)
            torch.nn.init.normal_(layer.input_layernorm.bias, 0.0, 0.2)
    else:
        pytest.importorskip("transformers")
        import runtime_workers
        layer, _ = runtime_workers.LAYERS[family](seed)
    graph = trace_module(layer, Strategy(attn, ffn, dispatch, n, dtype="fp32", dp=dp), batch=B, seq=S)
    if spec:
        graph, _ = run_pipeline(graph, spec, cost=COST)
    gen = torch.Generator().manual_seed(seed + 1)
    x, dy = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
    tensors = {k: p.detach() for k, p in [*layer.named_parameters(), *layer.named_buffers()]}
    return layer, graph, tensors, x, dy


def test_fake_device_catches_a_cpu_tensor_meeting_a_cuda_one():
    """The harness itself: a mix raises, CPU scalars pass, CUDA factories and reads are tracked."""
    with fc.FakeCuda() as mode:
        a = torch.ones(4, device=fc.CUDA)
        assert a.device == fc.CUDA and isinstance(a, fc.FakeCudaTensor)
        with pytest.raises(fc.DeviceMix):
            a + torch.ones(4)
        with pytest.raises(fc.DeviceMix):
            torch.arange(4)[a.long()]                      # a CPU tensor indexed by a CUDA order
        assert (a * torch.tensor(2.0)).tolist() == [2.0] * 4      # 0-dim CPU: a scalar, as on CUDA
        assert a.sum().item() == 4.0
        assert mode.syncs["tolist"] == 1 and mode.syncs["item"] == 1
        a.nonzero()
        assert mode.syncs["nonzero"] == 1
        b = torch.zeros(3, device=a.device)                 # a factory on the fake device stays on it
        assert isinstance(b, fc.FakeCudaTensor)


@pytest.mark.parametrize("config,spec,family", GRAPHS,
                         ids=[f"{fam}-{a}-{f}-{d}-dp{dp}" for (a, f, d, dp), _, fam in GRAPHS])
@pytest.mark.slow
def test_fake_device_every_kernel_forward_and_backward(config, spec, family):
    """The reference interpreter runs every compute node through ``run_compute`` on n=2 simulated
    ranks: on fake-CUDA tensors it must not mix devices and must give the CPU numbers."""
    layer, graph, params, x, dy = build(*config, spec, family)
    with sdpa_kernel(SDPBackend.MATH):        # the fake device runs SDPA's math backend: same sums
        ref = interpret(graph, params, x, dy)
    with fc.FakeCuda():
        fparams = {k: fc.to_fake(v) for k, v in params.items()}
        res = interpret(graph, fparams, fc.to_fake(x), fc.to_fake(dy))
        assert res.output.device == fc.CUDA
        out, dx = fc.real(res.output), fc.real(res.input_grad)
        grads = {k: fc.real(v) for k, v in res.param_grads.items()}
    assert rel_err(out, ref.output) < TOL and rel_err(dx, ref.input_grad) < TOL
    name, err = max_grad_err(grads, ref.param_grads)
    assert err < TOL, f"gradient of {name}: {err:.2e}"


def test_fake_device_graphs_cover_every_kernel():
    used = set()
    for (attn, ffn, dispatch, dp), spec, family in GRAPHS:
        _, graph, *_ = build(attn, ffn, dispatch, dp, spec, family)
        used |= {(nd.op, nd.role) for nd in graph.nodes if not nd.is_comm}
    missing = sorted(f"{op.value}/{role.value}" for op, role in set(KERNELS) - used)
    assert not missing, f"kernels no fake_device graph runs: {missing} (add a graph to GRAPHS)"


# -- the executor's step ----------------------------------------------------------------------------

class _DoneWork:
    """An emulated collective's work: complete when issued (the data moved on the host). Counts
    the host waits on it: a wait with a timeout, or a completion poll (GPU: ``work.wait()``
    without one only orders the current stream)."""

    def __init__(self, shared: "ThreadComm"):
        self.shared = shared

    def wait(self, timeout=None):
        if timeout is not None:
            self.shared.host_waits += 1
        return True

    def is_completed(self):
        self.shared.host_waits += 1
        return True


class ThreadComm:
    """n ranks in n threads of one process: each ``issue`` waits for every rank's inputs, then
    computes the outputs with the reference interpreter's collectives (real collectives; not
    ``moegraph.runtime.emulated.EmulatedComm``, whose copies only stand in for a collective's time)."""

    def __init__(self, n: int):
        self.n, self.backend, self.native_budgets = n, "emulated", False
        self.barrier = threading.Barrier(n, timeout=60)
        self.inputs: dict[str, list] = {}
        self.outputs: dict[str, list] = {}
        self.lock = threading.Lock()
        self.host_waits = 0

    def for_rank(self, rank: int) -> "_RankComm":
        return _RankComm(self, rank)


class _RankComm:
    def __init__(self, shared: ThreadComm, rank: int):
        self.shared, self.rank, self.n = shared, rank, shared.n
        self.backend, self.native_budgets, self.groups = "emulated", False, {}

    def issue(self, node, ins, stream, budget, shapes=()):
        sh = self.shared
        with sh.lock:
            sh.inputs.setdefault(node.name, [None] * sh.n)[self.rank] = list(ins)
        if sh.barrier.wait() == 0:
            sh.outputs[node.name] = run_collective(node, sh.inputs.pop(node.name), list(shapes))
        sh.barrier.wait()
        outs = sh.outputs[node.name][self.rank]
        return Pending(node, stream, [_DoneWork(sh)], lambda: outs)


def _executor_step(graph, plan, comm, rank, n, x, dy, params, device, results, expert_rows="exact"):
    ex = Executor(graph, plan, comm, rank=rank, n=n, device=device, timeout_s=60.0, expert_rows=expert_rows)
    ps = [shard_param(spec, params, rank, n) for _, spec in graph.params]
    y, saved = ex.forward(x.chunk(n, dim=1)[rank].contiguous(), ps)
    dx, grads = ex.backward(saved, dy.chunk(n, dim=1)[rank].contiguous(), ps)
    results[rank] = (y, dx, grads)


def run_rank_threads(n, rank_main, shared) -> None:
    """``rank_main(rank)`` for every rank, each in its own thread; re-raises the first error (a
    failing rank aborts the emulated collectives' barrier, so the others do not wait for it)."""
    errors: list[BaseException] = []

    def guarded(rank):
        try:
            rank_main(rank)
        except BaseException as err:                       # noqa: BLE001 - re-raised in the test thread
            errors.append(err)
            if shared:
                shared.barrier.abort()

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]


def _run_fake(graph, plan, params, x, dy, n, monkeypatch, expert_rows="exact"):
    """Every rank's executor step on fake CUDA (one thread per rank); returns CPU results."""
    state = fc.fake_streams(monkeypatch)
    shared = ThreadComm(n) if n > 1 else None
    results: dict[int, tuple] = {}
    modes: list[fc.FakeCuda] = []
    state.comm = shared

    def rank_main(rank):
        with fc.FakeCuda() as mode:
            modes.append(mode)
            fparams = {k: fc.to_fake(v) for k, v in params.items()}
            comm = shared.for_rank(rank) if shared else NoComm()
            _executor_step(graph, plan, comm, rank, n, fc.to_fake(x), fc.to_fake(dy), fparams,
                           torch.device("cuda", 0), results, expert_rows)
            y, dx, grads = results[rank]
            assert y.device == fc.CUDA and all(g.device == fc.CUDA for g in grads)
            results[rank] = (fc.real(y), fc.real(dx), [fc.real(g) for g in grads])

    run_rank_threads(n, rank_main, shared)
    return results, state, modes


def _cpu_step(graph, plan, params, x, dy, n):
    shared = ThreadComm(n) if n > 1 else None
    results: dict[int, tuple] = {}
    run_rank_threads(n, lambda r: _executor_step(graph, plan, shared.for_rank(r) if shared else NoComm(), r, n, x,
                                                 dy, params, torch.device("cpu"), results), shared)
    return results


EXECUTOR_CASES = [(1, "sp", "ep", "ag-rs", "gate-reorder,sar=paper", "greedy"),
                  (2, "tp", "tp", "ag-rs", "gate-reorder,sar=paper", "greedy"),
                  (2, "sp", "ep", "a2a", "chunk=2,sar=paper", "greedy"),
                  (2, "sp", "ep", "ag-rs", "", "sequential")]


@pytest.mark.parametrize("n,attn,ffn,dispatch,spec,schedule", EXECUTOR_CASES,
                         ids=[f"n{c[0]}-{c[1]}-{c[2]}-{c[3]}-{c[5]}" for c in EXECUTOR_CASES])
@pytest.mark.slow
def test_fake_device_executor_step(n, attn, ffn, dispatch, spec, schedule, monkeypatch):
    """Forward + backward of the executor on fake CUDA (streams, events, fences: the GPU code path),
    n=2 with collectives emulated in-process; outputs and gradients equal the CPU executor's and
    the eager module's."""
    layer, graph, params, x, dy = build(attn, ffn, dispatch, 1, spec, n=n)
    plan = make_plan(graph, COST, "greedy") if schedule == "greedy" else ExecutionPlan.sequential(graph)
    got, state, _ = _run_fake(graph, plan, params, x, dy, n, monkeypatch)
    cpu = _cpu_step(graph, plan, params, x, dy, n)
    for r in range(n):
        assert rel_err(got[r][0], cpu[r][0]) < TOL and rel_err(got[r][1], cpu[r][1]) < TOL
        for g, c in zip(got[r][2], cpu[r][2]):
            assert rel_err(g, c) < TOL
    y_ref, dx_ref, _ = eager_step(layer, x, dy)
    assert rel_err(torch.cat([got[r][0] for r in range(n)], dim=1), y_ref) < TOL
    assert rel_err(torch.cat([got[r][1] for r in range(n)], dim=1), dx_ref) < TOL
    if n > 1:
        assert state.streams, "the GPU path made no comm stream"


def test_fake_device_eager_reference_layer():
    """The eager module itself (the ground truth of every GPU test) on the fake device."""
    layer, _, params, x, dy = build("sp", "ep", "ag-rs", 1, "", n=1)
    y_ref, dx_ref, g_ref = eager_step(layer, x, dy)
    with fc.FakeCuda():
        fparams = {k: fc.to_fake(v).requires_grad_() for k, v in params.items()}
        xs = fc.to_fake(x).requires_grad_()
        y = torch.func.functional_call(layer, fparams, (xs,))
        y.backward(fc.to_fake(dy))
        got = fc.real(y), fc.real(xs.grad), {k: fc.real(p.grad) for k, p in fparams.items()}
    assert rel_err(got[0], y_ref) < TOL and rel_err(got[1], dx_ref) < TOL
    name, err = max_grad_err(got[2], g_ref)
    assert err < TOL, f"gradient of {name}: {err:.2e}"


SYNC_CASES = [("tp", "tp", "ag-rs", "exact"), ("sp", "ep", "ag-rs", "exact"), ("sp", "ep", "ag-rs", "padded"),
              ("sp", "ep", "a2a", "exact")]


@pytest.mark.parametrize("attn,ffn,dispatch,expert_rows", SYNC_CASES, ids=["-".join(c) for c in SYNC_CASES])
@pytest.mark.slow
def test_fake_device_step_host_syncs(attn, ffn, dispatch, expert_rows, monkeypatch):
    """Everything that would block the host on a GPU during one step (n=2, the default passes,
    greedy), counted: value reads (.item/.tolist), device-to-host copies, data-dependent shapes
    (nonzero, bincount), cuda/event/stream synchronize, and host waits on collectives.

    ffn=tp ag-rs: none. ffn=ep ag-rs: one per local index map with exact expert rows, the row
    count R that sizes dropless routing's buffers; none with padded ones (C rows, R on the device),
    whose step still equals the eager module's. a2a: one copy of the split sizes per rank and index map, shared by
    every all-to-all that reads the map (so fewer than one per all-to-all)."""
    from moegraph.pass_steps import DEFAULT_PASSES
    from moegraph.ir import OpKind
    layer, graph, params, x, dy = build(attn, ffn, dispatch, 1, DEFAULT_PASSES, n=2)
    got, state, modes = _run_fake(graph, make_plan(graph, COST, "greedy"), params, x, dy, 2, monkeypatch,
                                  expert_rows)
    syncs = sum((m.syncs for m in modes), start=collections.Counter()) + state.syncs
    maps = [nd for nd in graph.nodes if nd.op is OpKind.INDEX_MAP]
    if ffn == "tp" or expert_rows == "padded":
        expected = {}
    elif dispatch == "ag-rs":
        expected = {"item": 2 * sum(nd.attr("layout") == "local" for nd in maps)}
    else:
        tokens_a2a = [nd for nd in graph.nodes if nd.op is OpKind.ALL_TO_ALL and nd.attr("mode") == "tokens"]
        assert len(tokens_a2a) > len(maps) and all(nd.attr("layout") == "by_dest" for nd in maps)
        expected = {"tolist": 2 * len(maps)}
    assert dict(+syncs) == expected
    assert state.comm.host_waits == 0, "the host waited for a collective inside the step"
    y_ref, dx_ref, _ = eager_step(layer, x, dy)
    assert rel_err(torch.cat([got[r][0] for r in range(2)], dim=1), y_ref) < TOL
    assert rel_err(torch.cat([got[r][1] for r in range(2)], dim=1), dx_ref) < TOL


def test_fake_device_counts_torch_grouped_mm_offset_copies():
    """The fake counts torch._grouped_mm's host copy of its offsets where CUDA's kernel makes one
    (any dtype but bf16, fake_cuda's docstring); the grouped GEMM kernel on fp32 makes none (its
    masked formulation) and equals the host loop on CPU, in both call shapes."""
    from moegraph import grouped_gemm
    from moegraph.index_map import build_index_map
    gen = torch.Generator().manual_seed(0)
    experts = torch.randint(0, 4, (6, 2), generator=gen)
    x, dy = torch.randn(12, 16, generator=gen), torch.randn(12, 8, generator=gen)     # [R, K], [R, N]
    w = torch.randn(4, 8, 16, generator=gen)                                        # [E, N, K]
    m = build_index_map(experts, "all", 4, 0, 1)
    want = grouped_gemm.grouped_rows(x, w, m), grouped_gemm.grouped_weight_grad(x, dy, m, w.shape)
    with fc.FakeCuda() as mode:
        fx, fw, fdy = fc.to_fake(x), fc.to_fake(w), fc.to_fake(dy)
        fm = build_index_map(fc.to_fake(experts), "all", 4, 0, 1)
        torch._grouped_mm(fx, fw.transpose(-2, -1), offs=fm.offsets)
        assert dict(mode.syncs) == {"grouped_mm_offsets": 1}
        torch._grouped_mm(fx.bfloat16(), fw.transpose(-2, -1).bfloat16(), offs=fm.offsets)    # the native kernel
        got = grouped_gemm.grouped_rows(fx, fw, fm), grouped_gemm.grouped_weight_grad(fx, fdy, fm, w.shape)
        assert dict(mode.syncs) == {"grouped_mm_offsets": 1}
    assert all(rel_err(fc.real(g), r) < TOL for g, r in zip(got, want))


def test_fake_device_step_host_syncs_catch_torch_grouped_mm_on_fp32(monkeypatch):
    """The step's sync count can fail: the kernel as it was before the first GPU session's fix
    (torch._grouped_mm for fp32 on the device) makes ffn=tp ag-rs count one offset copy per grouped
    GEMM call, two ranks, where test_fake_device_step_host_syncs expects none."""
    from moegraph import grouped_gemm
    from moegraph.pass_steps import DEFAULT_PASSES
    from moegraph.ir import OpKind
    monkeypatch.setattr(grouped_gemm, "native_grouped_mm", lambda device, dtype: True)
    _, graph, params, x, dy = build("tp", "tp", "ag-rs", 1, DEFAULT_PASSES, n=2)
    _, state, modes = _run_fake(graph, make_plan(graph, COST, "greedy"), params, x, dy, 2, monkeypatch)
    syncs = sum((m.syncs for m in modes), start=collections.Counter()) + state.syncs
    grouped = sum(nd.op is OpKind.GROUPED_GEMM for nd in graph.nodes)
    assert grouped and dict(+syncs) == {"grouped_mm_offsets": 2 * grouped}


def test_fake_device_gpu_timing_events_are_bounded(monkeypatch):
    """A recorded GPU layer keeps at most MAX_UNREAD_STEPS steps of unread CUDA events: older ones
    are read once a non-blocking query says they completed (no synchronize inside a step), or
    dropped while they have not."""
    import moegraph.runtime.module as module_mod
    from moegraph.runtime.module import CompiledLayer
    monkeypatch.setattr(module_mod, "MAX_UNREAD_STEPS", 2)
    layer, graph, params, x, dy = build("sp", "ep", "ag-rs", 1, "", n=1)
    plan = make_plan(graph, COST, "greedy")
    state = fc.fake_streams(monkeypatch)
    with fc.FakeCuda() as mode:
        compiled = CompiledLayer(graph, plan, {k: fc.to_fake(v) for k, v in params.items()}, rank=0, n=1,
                                 comm=NoComm(), record=True)
        compiled.executor.cuda = True          # the fake device reports meta; take the CUDA path anyway
        xs, dys = fc.to_fake(x), fc.to_fake(dy)
        for step in range(4):
            compiled(xs.clone().requires_grad_()).backward(dys)
            assert len(compiled._recorders) <= 2
        assert len(compiled._traces) == 2 and compiled.dropped_traces == 0
        assert not state.syncs and not mode.syncs["d2h"]
        monkeypatch.setattr(fc.FakeEvent, "query", lambda self: False)   # still running: dropped, not awaited
        compiled(xs.clone().requires_grad_()).backward(dys)
        assert compiled.dropped_traces == 1 and not state.syncs
        assert len(compiled.traces) == 4 and state.syncs["cuda_synchronize"] == 1   # reading: one sync


# -- the whole model: CompiledModel's eager edges and the plan's edge nodes --------------------------

MODEL_FAMILIES = ["ref", "hf-aux"]


def _tiny_lm(family: str, seed: int = 21):
    """A tiny causal LM: the project's MoETransformer, or HF Mixtral with the router's aux loss
    (output_router_logits=True, router_aux_loss_coef=0.5: moegraph.edges "aux loss")."""
    import model_workers
    if family == "ref":
        return model_workers.reference_model(seed, 2)
    pytest.importorskip("transformers")
    import aux_workers
    return aux_workers.aux_model("mixtral", seed, 2, 0.5)


def _lm_data(seed: int, steps: int = 1):
    """(ids, labels) [2, 16] per step, a few labels ignored (the global count is data-dependent)."""
    import model_workers
    out = []
    for ids, labels in model_workers.batches(seed, steps):
        labels[0, :3] = -100
        out.append((ids, labels))
    return out


def _compile_lm(model, ids, **kw):
    import moegraph
    return moegraph.compile(model, ids, hardware="cpu-gloo", passes="", schedule="greedy", **kw)


def _to_fake_model(compiled) -> None:
    """Move a compiled (n=1, CPU) model's parameters and buffers onto the fake device and take the
    executor's CUDA path (streams, events; the fake device reports meta, so force it as
    test_fake_device_gpu_timing_events_are_bounded does). Call under FakeCuda and fake_streams."""
    from torch import nn

    from moegraph.runtime.plan import COMPUTE
    for mod in compiled.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = nn.Parameter(fc.to_fake(p), requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = fc.to_fake(b)
    ex = compiled.layers.executor
    ex.device, ex.cuda = torch.device("cuda", 0), True
    ex.comm_streams = {s: torch.cuda.Stream(ex.device) for s in ex.plan.streams if s != COMPUTE}


def _fake_model_step(compiled, ids, labels):
    """forward + loss + backward of the compiled model on fake CUDA (the full logits gathered too);
    returns (loss, aux, logits, grads) on CPU."""
    with sdpa_kernel(SDPBackend.MATH):
        got = compiled(fc.to_fake(ids), labels=fc.to_fake(labels), output_logits=True)
        assert got.loss.device == fc.CUDA and got.logits.device == fc.CUDA
        got.loss.backward()
    grads = {k: fc.real(v) for k, v in compiled.full_grads().items()}
    aux = fc.real(got.aux_loss) if got.aux_loss is not None else None
    return fc.real(got.loss), aux, fc.real(got.logits), grads


def _assert_model_matches(model, loss, aux, logits, grads, ids, labels):
    ref = model(ids, labels=labels)
    ref.loss.backward()
    assert rel_err(loss, ref.loss.detach()) < TOL
    assert rel_err(logits, ref.logits.detach()) < TOL
    if getattr(ref, "aux_loss", None) is not None:
        assert aux is not None and rel_err(aux, ref.aux_loss.detach()) < TOL
    assert set(grads) == {k for k, _ in model.named_parameters()}
    name, err = max_grad_err(grads, {k: p.grad for k, p in model.named_parameters()})
    assert err < TOL, f"gradient of {name}: {err:.2e}"


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_fake_device_compiled_model_step(family, monkeypatch):
    """One rank (n=1, no process group): CompiledModel's forward (embedding, the plan, final norm,
    LM head, loss; Mixtral: the router aux loss's stats, edges.aux.sum and its seed) and backward
    (head and norm partials, the ROWS embedding scatter after the plan) on fake CUDA equal the
    eager CPU module's loss and every gradient. (PARTIAL needs dp >= 2, so two ranks: its kernel
    is checked alone in test_fake_device_partial_embed_scatter.)"""
    from moegraph.edges import EmbedGrad
    model = _tiny_lm(family)
    ((ids, labels),) = _lm_data(5)
    compiled = _compile_lm(model, ids)
    assert compiled.edges.embed_grad is EmbedGrad.ROWS
    assert bool(compiled.edges.aux_stats) == (family == "hf-aux")
    fc.fake_streams(monkeypatch)
    with fc.FakeCuda():
        _to_fake_model(compiled)
        loss, aux, logits, grads = _fake_model_step(compiled, ids, labels)
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):     # the no-grad path runs the same parts eagerly
            plain = compiled(fc.to_fake(ids), labels=fc.to_fake(labels), output_logits=True)
            assert plain.logits.device == fc.CUDA
            plain_loss = fc.real(plain.loss)
    _assert_model_matches(model, loss, aux, logits, grads, ids, labels)
    assert rel_err(plain_loss, loss) < TOL


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_fake_device_compiled_model_train_step(family, monkeypatch):
    """A merged step of 2 micro-batches (``train_step``: every eager edge node run by the plan,
    head and norm partials accumulated over micro-batches, Mixtral's per-micro-batch aux seeds)
    on fake CUDA: the losses and every gradient equal the eager module's mean over micro-batches."""
    model = _tiny_lm(family)
    data = _lm_data(7, steps=2)
    compiled = _compile_lm(model, data[0][0], micro_batches=2)
    fc.fake_streams(monkeypatch)
    with fc.FakeCuda(), sdpa_kernel(SDPBackend.MATH):
        _to_fake_model(compiled)
        losses = compiled.train_step([fc.to_fake(i) for i, _ in data], [fc.to_fake(lab) for _, lab in data])
        assert all(x.device == fc.CUDA for x in losses)
        losses = [fc.real(x) for x in losses]
        grads = {k: fc.real(v) for k, v in compiled.full_grads().items()}
    for (ids, labels), loss in zip(data, losses):
        ref = model(ids, labels=labels)
        assert rel_err(loss, ref.loss.detach()) < TOL
        (ref.loss / 2).backward()
    name, err = max_grad_err(grads, {k: p.grad for k, p in model.named_parameters()})
    assert err < TOL, f"gradient of {name}: {err:.2e}"


def test_fake_device_partial_embed_scatter():
    """PARTIAL's ``edges.embed.scatter`` kernel (``CompiledModel._embed_scatter``: rows index_add-ed
    into a fresh [V, h] partial, then into a copy of the previous micro-batch's, padding row
    zeroed) on fake CUDA equals the same kernel on CPU. Alone: the pattern needs dp >= 2 replicas,
    i.e. a process group, which the one-rank fake device has not."""
    model = _tiny_lm("ref")
    ((ids, _),) = _lm_data(9)
    compiled = _compile_lm(model, ids)
    compiled.spec = dataclasses.replace(compiled.spec, padding_idx=int(ids[0, 0]))
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(*ids.shape, compiled.embed.shape[1], generator=gen)
    prev = torch.randn(*compiled.embed.shape, generator=gen)
    want = [compiled._embed_scatter(ids, [rows])[0], compiled._embed_scatter(ids, [rows, prev], accumulate=True)[0]]
    with fc.FakeCuda():
        compiled.embed = torch.nn.Parameter(fc.to_fake(compiled.embed))
        fids, frows = fc.to_fake(ids), fc.to_fake(rows)
        got = [compiled._embed_scatter(fids, [frows])[0],
               compiled._embed_scatter(fids, [frows, fc.to_fake(prev)], accumulate=True)[0]]
        assert all(g.device == fc.CUDA for g in got)
        got = [fc.real(g) for g in got]
    assert all(rel_err(g, w) < TOL for g, w in zip(got, want))
    assert float(want[0][int(ids[0, 0])].abs().sum()) == 0.0


@pytest.mark.parametrize("family,micro_batches", [("ref", 1), ("hf-aux", 1), ("hf-aux", 2)])
def test_fake_device_compiled_model_host_syncs(family, micro_batches, monkeypatch):
    """Everything that would block the host on a GPU during one model step (forward + loss +
    backward, or one merged train_step), counted as test_fake_device_step_host_syncs does.

    Expected: exactly the layers' known syncs, one ``item`` per local index map and micro-batch
    (sp/ep/ag-rs with exact expert rows: the row count R that sizes dropless routing's buffers,
    moegraph.index_map.build_index_map), and nothing from the model's own parts: the label shift and
    the global label count stay on the device (the count divides the loss term as a tensor), the
    aux loss's stats, sum and seeds are tensors on the device, the embedding scatter is an
    index_add by device ids, and the recorder's CUDA events are read lazily (no synchronize).
    (n=1: the edges have no collectives here, so no host waits on them to count.)"""
    from moegraph.ir import OpKind
    model = _tiny_lm(family)
    data = _lm_data(5, steps=micro_batches)
    compiled = _compile_lm(model, data[0][0], micro_batches=micro_batches)
    maps = [nd for nd in compiled.layers.graph.nodes if nd.op is OpKind.INDEX_MAP]
    assert maps and all(nd.attr("layout") == "local" for nd in maps)     # micro-batches: one per copy
    state = fc.fake_streams(monkeypatch)
    with fc.FakeCuda() as mode, sdpa_kernel(SDPBackend.MATH):
        _to_fake_model(compiled)
        ids, labels = [fc.to_fake(i) for i, _ in data], [fc.to_fake(lab) for _, lab in data]
        if micro_batches == 1:
            compiled(ids[0], labels=labels[0]).loss.backward()
        else:
            compiled.train_step(ids, labels)
    syncs = mode.syncs + state.syncs
    assert dict(+syncs) == {"item": len(maps)}, dict(syncs)
    assert mode.h2d == 0, "a host tensor was copied to the device inside the step"


def _host_all_reduce(shared: ThreadComm):
    """torch.distributed.all_reduce (sum, in place) over the rank threads of ``shared``: what the
    model's eager parts call (the loss's SumOverRanks, full_grads); ``group`` ignored (dp=1)."""
    slots: dict[int, torch.Tensor] = {}

    def all_reduce(t, op=None, group=None, async_op=False):
        rank = _RANK.rank
        slots[rank] = t.clone()
        shared.barrier.wait()
        total = sum(slots[r] for r in range(shared.n))
        shared.barrier.wait()
        t.copy_(total)
    return all_reduce


def _host_all_gather(shared: ThreadComm):
    """torch.distributed.all_gather over the rank threads (the logits' GatherSequence)."""
    slots: dict[int, torch.Tensor] = {}

    def all_gather(parts, t, group=None, async_op=False):
        slots[_RANK.rank] = t.clone()
        shared.barrier.wait()
        for r, part in enumerate(parts):
            part.copy_(slots[r])
        shared.barrier.wait()
    return all_gather


_RANK = threading.local()


# (family, attn, ffn, dispatch, n, dp, embed gradient, micro-batches): the edges' collectives at n=2
# (head / norm all-reduce, the rows' gather; a2a: the aux stats' all-reduce), and with dp=2 replicas
# (n=1: every collective spans both ranks) the DP sync of the edges and PARTIAL's plan-run scatter
THREADED_CASES = [("ref", "sp", "ep", "ag-rs", 2, 1, "rows", 1), ("hf-aux", "sp", "ep", "a2a", 2, 1, "rows", 1),
                  ("hf-aux", "tp", "tp", "ag-rs", 2, 1, "rows", 1), ("hf-aux", "sp", "ep", "a2a", 2, 1, "rows", 2),
                  ("hf-aux", "sp", "ep", "ag-rs", 1, 2, "partial", 1), ("ref", "sp", "ep", "ag-rs", 1, 2, "rows", 1),
                  ("hf-aux", "sp", "ep", "ag-rs", 1, 2, "partial", 2)]


@pytest.mark.parametrize("family,attn,ffn,dispatch,n,dp,embed_grad,micro_batches", THREADED_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-n{c[4]}-dp{c[5]}-{c[6]}-mb{c[7]}" for c in THREADED_CASES])
@pytest.mark.slow
def test_fake_device_compiled_model_threaded_ranks(family, attn, ffn, dispatch, n, dp, embed_grad, micro_batches,
                                                   monkeypatch):
    """n x dp = 2 ranks in threads, the plan's collectives emulated in-process (ThreadComm): the
    model's edge collectives (edges.lm_head / edges.norm grad sync, edges.embed.grad_gather; a2a:
    edges.aux.allreduce; dp=2: the edges' DP sync and PARTIAL's edges.embed.scatter) run on fake
    CUDA in a model step, or a merged train_step of 2 micro-batches; the loss(es), the gathered
    logits and every full gradient equal the eager CPU module's on the global batch, on every rank;
    the host syncs are the layers' known ones (below). The host's own collectives
    (torch.distributed.all_reduce: the loss term, train_step's terms, full_grads' regions;
    all_gather: the full logits) are thread-barrier stand-ins here (no process group in one
    process; with n=1 the layers' full_grads reduce nothing); no host wait on a plan collective.
    The plan's collectives are the reference interpreter's (as test_fake_device_executor_step),
    not runtime.collectives' NCCL calls."""
    import moegraph.passes.edges as edges_mod
    import moegraph.runtime.model as model_mod
    from moegraph.edges import EmbedGrad
    from moegraph.passes.edges import add_edges
    from moegraph.runtime.layout import Layout
    from moegraph.runtime.module import CompiledLayer
    model = _tiny_lm(family)
    data = _lm_data(11, steps=micro_batches)
    shared = ThreadComm(n * dp)
    monkeypatch.setattr(model_mod, "replica_batch", lambda rows, n_, dp_, what: (_RANK.rank, n, rows // dp))
    # the driver's edges pass, with the pattern forced
    monkeypatch.setattr(edges_mod, "add_edges", lambda graph, **kw: add_edges(graph, **{**kw, "embed_grad":
                                                                                         EmbedGrad(embed_grad)}))

    def build_layer(graph, plan, full, *, rank, n, options, frozen=frozenset()):
        comm = shared.for_rank(rank)
        comm.mp_group = None
        layout = Layout(n, dp, rank)
        return CompiledLayer(graph, plan, full, rank=layout.mp_rank, n=n, comm=comm, timeout_s=options.timeout_s,
                             record=options.record, layout=layout, frozen=frozen)
    monkeypatch.setattr(model_mod, "build_layer", build_layer)
    compiled = []
    for r in range(n * dp):
        _RANK.rank = r
        compiled.append(_compile_lm(model, data[0][0], attn=attn, ffn=ffn, dispatch=dispatch, n=n, dp=dp,
                                    micro_batches=micro_batches))
    graph = compiled[0].layers.graph
    edge_comm = {nd.name.split(".", 1)[1] if nd.name.startswith("mb") else nd.name
                 for nd in graph.nodes if nd.is_comm and ".edges." in f".{nd.name}"}
    assert compiled[0].edges.embed_grad is EmbedGrad(embed_grad)
    if n > 1:
        assert {"edges.lm_head.grad_allreduce", "edges.norm.grad_allreduce", "edges.embed.grad_gather"} <= edge_comm
    else:
        assert edge_comm and all(nd.group == dp for nd in graph.nodes if nd.is_comm)   # every one spans the world
    if dispatch == "a2a":
        assert "edges.aux.allreduce" in edge_comm
    fc.fake_streams(monkeypatch)
    monkeypatch.setattr(torch.distributed, "all_reduce", _host_all_reduce(shared))
    monkeypatch.setattr(torch.distributed, "all_gather", _host_all_gather(shared))
    results: dict[int, tuple] = {}

    modes: list[fc.FakeCuda] = []

    def rank_main(rank):
        _RANK.rank = rank
        with fc.FakeCuda() as mode:
            modes.append(mode)
            _to_fake_model(compiled[rank])
            if micro_batches == 1:
                ((ids, labels),) = data
                results[rank] = _fake_model_step(compiled[rank], ids, labels)
            else:
                with sdpa_kernel(SDPBackend.MATH):
                    losses = compiled[rank].train_step([fc.to_fake(i) for i, _ in data],
                                                       [fc.to_fake(lab) for _, lab in data])
                grads = {k: fc.real(v) for k, v in compiled[rank].full_grads().items()}
                results[rank] = ([fc.real(x) for x in losses], grads)

    run_rank_threads(n * dp, rank_main, shared)
    assert shared.host_waits == 0, "the host waited for a collective inside the step"
    from moegraph.ir import OpKind
    syncs = sum((m.syncs for m in modes), start=collections.Counter())
    maps = [nd.attr("layout") for nd in graph.nodes if nd.op is OpKind.INDEX_MAP]
    # the layers' known syncs only (test_fake_device_step_host_syncs): per rank one item per local
    # index map (exact rows), one tolist of the split sizes per by_dest map (a2a), none for "all"
    # (tp); the model's own parts, the edge collectives and the aux stats add none
    expected = {"item": n * dp * maps.count("local"), "tolist": n * dp * maps.count("by_dest")}
    assert dict(+syncs) == {k: v for k, v in expected.items() if v}
    assert sum(m.h2d for m in modes) == 0, "a host tensor was copied to the device inside the step"
    if micro_batches == 1:
        ((ids, labels),) = data
        _assert_model_matches(model, *results[0], ids, labels)
    else:
        for (ids, labels), loss in zip(data, results[0][0]):
            ref = model(ids, labels=labels)
            assert rel_err(loss, ref.loss.detach()) < TOL
            (ref.loss / micro_batches).backward()
        name, err = max_grad_err(results[0][1], {k: p.grad for k, p in model.named_parameters()})
        assert err < TOL, f"gradient of {name}: {err:.2e}"
    for r in range(1, n * dp):                              # every rank holds the same loss and full gradients
        name, err = max_grad_err(results[r][-1], results[0][-1])
        assert err < TOL, f"rank {r}'s gradient of {name}: {err:.2e}"


def test_fake_device_compiled_base_model_step(monkeypatch):
    """A base model (no LM head: ``last_hidden_state``, the final norm's output) on one rank, on
    fake CUDA: the hidden state and every gradient of a weighted sum of it equal the eager CPU
    module's (the norm's partial without a head's; the ROWS embedding scatter)."""
    pytest.importorskip("transformers")
    import aux_workers
    base = aux_workers.aux_model("mixtral", 23, 2, 0.5).model        # the aux loss belongs to the LM: none here
    ((ids, _),) = _lm_data(13)
    compiled = _compile_lm(base, ids)
    w = torch.randn(*ids.shape, base.config.hidden_size, generator=torch.Generator().manual_seed(4))
    fc.fake_streams(monkeypatch)
    with fc.FakeCuda(), sdpa_kernel(SDPBackend.MATH):
        _to_fake_model(compiled)
        hidden = compiled(fc.to_fake(ids)).last_hidden_state
        assert hidden.device == fc.CUDA
        (hidden * fc.to_fake(w)).sum().backward()
        got = fc.real(hidden)
        grads = {k: fc.real(v) for k, v in compiled.full_grads().items()}
    ref = base(input_ids=ids).last_hidden_state
    (ref * w).sum().backward()
    assert rel_err(got, ref.detach()) < TOL
    name, err = max_grad_err(grads, {k: p.grad for k, p in base.named_parameters()})
    assert err < TOL, f"gradient of {name}: {err:.2e}"
