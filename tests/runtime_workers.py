"""Rank functions for the runtime tests (spawned by moegraph.runtime.launch.spawn; importable by name).

Each call checks several cases on one process group, because starting ranks costs seconds.
A case is a dict: model ('ref' | 'hf' | 'qwen2_moe' | 'olmoe' | 'deepseek_v3' | 'deepseek_v3_dense'), attn, ffn, dispatch, and optionally passes, schedule, hardware,
emulate / native (collectives to emulate, or to run with the backend's own op), reference
('eager', default, or 'interpreter' for lossy passes), fault (a deliberate bug the check must
catch).
"""

from __future__ import annotations

import time
import warnings

import torch

import moegraph
from moegraph.models import MoETransformerLayer
from moegraph.ir import Phase
from moegraph.runtime.check import check_against_eager, check_against_interpreter

B, S, H = 2, 16, 64


def reference_layer(seed: int) -> MoETransformerLayer:
    """8 heads, 4 kv heads, 8 experts, top-3: every n in {1, 2, 4} can split it."""
    torch.manual_seed(seed)
    layer = MoETransformerLayer(hidden=H, heads=8, kv_heads=4, ffn_hidden=96, experts=8, top_k=3)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def _transformers_layer(config_cls, layer_cls, rotary_cls, seed: int, sizes: dict, overrides: dict):
    """A decoder layer from a tiny config, random N(0, 0.2) weights, and its eager call (RoPE from
    the family's own rotary module)."""
    cfg = config_cls(**{"hidden_size": H, "num_attention_heads": 8, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
                        "attn_implementation": "sdpa"} | sizes | overrides)
    cfg._experts_implementation = "eager"        # the plain expert loop (transformers warns when unset)
    torch.manual_seed(seed)
    layer = layer_cls(cfg, 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    rotary = rotary_cls(cfg)

    def call(module, x):
        cos_sin = rotary.to(x.device)(x, torch.arange(x.shape[1], device=x.device)[None])
        return module(x, position_embeddings=cos_sin, attention_mask=None)
    return layer, call


def hf_layer(seed: int, **overrides):
    """Mixtral: 8 experts, top-3."""
    from transformers import MixtralConfig
    from transformers.models.mixtral import modeling_mixtral as m
    return _transformers_layer(MixtralConfig, m.MixtralDecoderLayer, m.MixtralRotaryEmbedding, seed,
                               {"intermediate_size": 96, "num_local_experts": 8, "num_experts_per_tok": 3,
                                "rope_theta": 1e6}, overrides)


def qwen2_moe_layer(seed: int, **overrides):
    """Qwen2-MoE: q/k/v biases, 8 experts top-3 (unnormalised), a sigmoid-gated shared expert."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe import modeling_qwen2_moe as m
    return _transformers_layer(Qwen2MoeConfig, m.Qwen2MoeDecoderLayer, m.Qwen2MoeRotaryEmbedding, seed,
                               {"intermediate_size": 128, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 3,
                                "num_hidden_layers": 1}, overrides)


def olmoe_layer(seed: int, **overrides):
    """OLMoE: q/k RMSNorm over the full projection width, 8 experts top-3 (unnormalised)."""
    from transformers import OlmoeConfig
    from transformers.models.olmoe import modeling_olmoe as m
    return _transformers_layer(OlmoeConfig, m.OlmoeDecoderLayer, m.OlmoeRotaryEmbedding, seed,
                               {"intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 3,
                                "num_hidden_layers": 1}, overrides)


def deepseek_v3_layer(seed: int, layer_idx: int = 1, **overrides):
    """DeepSeek-V3: MLA (q rank 24, kv rank 16, q/k heads 12+8 wide, v heads 16), 8 experts in 4 groups,
    top-3 of the best 2 groups, sigmoid scores with a random score-correction bias, scaling 2.5,
    one shared expert. layer_idx < first_k_dense_replace (1) is a dense layer."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
    cfg = DeepseekV3Config(**{"hidden_size": H, "num_attention_heads": 8, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                              "attn_implementation": "sdpa", "intermediate_size": 48, "moe_intermediate_size": 32,
                              "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
                              "n_shared_experts": 1, "routed_scaling_factor": 2.5, "q_lora_rank": 24,
                              "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 16,
                              "first_k_dense_replace": 1, "num_hidden_layers": 2} | overrides)
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    layer = m.DeepseekV3DecoderLayer(cfg, layer_idx)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    for b in layer.buffers():               # the score-correction bias: random, so it changes the choice
        torch.nn.init.normal_(b, std=0.2)
    rotary = m.DeepseekV3RotaryEmbedding(cfg)

    def call(module, x):
        cos_sin = rotary.to(x.device)(x, torch.arange(x.shape[1], device=x.device)[None])
        return module(x, position_embeddings=cos_sin, attention_mask=None)
    return layer, call


# Every attn x ffn x dispatch each transformers family allows (DeepSeek-V3's dense layer has no
# router: ffn ep is a replicated MLP there, so only dispatch ag-rs is listed).
FAMILY_COMBOS = [(attn, ffn, dispatch) for attn in ("tp", "sp")
                 for ffn, dispatch in (("ep", "a2a"), ("ep", "ag-rs"), ("tp", "ag-rs"))]
FAMILY_CASES = [dict(attn=a, ffn=f, dispatch=d, model=m)
                for m in ("qwen2_moe", "olmoe", "deepseek_v3") for a, f, d in FAMILY_COMBOS] \
    + [dict(attn=a, ffn=f, dispatch="ag-rs", model="deepseek_v3_dense") for a in ("tp", "sp") for f in ("ep", "tp")]

LAYERS = {"ref": lambda seed: (reference_layer(seed), None), "hf": hf_layer, "qwen2_moe": qwen2_moe_layer,
          "olmoe": olmoe_layer, "deepseek_v3": deepseek_v3_layer,
          "deepseek_v3_dense": lambda seed: deepseek_v3_layer(seed, layer_idx=0),
          "deepseek_v3_skewed": lambda seed: _skewed(deepseek_v3_layer(seed))}


def _skewed(layer_call):
    """Score biases that send every token to experts 0-2: under ep on 2 ranks, rank 1's experts get no row."""
    layer, call = layer_call
    with torch.no_grad():
        layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([10.0, 10.0, 10.0, 0, 0, 0, 0, 0]))
    return layer, call


def _apply_fault(layer, fault: str | None) -> None:
    if fault is None:
        return
    comm = layer.executor.comm
    if fault == "drop-partial-sums":
        # reduce-scatter keeps only this rank's partial: the summed contributions of others are lost
        def rs(node, x, pg, g, _orig=comm._reduce_scatter):
            works, _finish, keep = _orig(node, x, pg, g)
            mine = torch.stack(x.chunk(g, dim=node.attr("dim")))[comm.rank]
            return works, (lambda: [mine.clone()]), keep
        comm._reduce_scatter = rs
    else:
        raise ValueError(f"unknown fault {fault!r}")


def check_cases(rank: int, n: int, cases: list[dict], seed: int, device: str = "cpu") -> list[dict]:
    out = []
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    for i, case in enumerate(cases):
        module, call = LAYERS[case.get("model", "ref")](seed + i)
        module = module.to(device)
        gen = torch.Generator().manual_seed(seed + 1000 + i)
        x, dy = torch.randn(B, S, H, generator=gen).to(device), torch.randn(B, S, H, generator=gen).to(device)
        t0 = time.perf_counter()
        layer = moegraph.compile(module, x, hardware=case.get("hardware", "cpu-gloo" if device == "cpu" else "h800"),
                                 attn=case["attn"], ffn=case["ffn"],
                                 dispatch=case["dispatch"], passes=case.get("passes", ""),
                                 schedule=case.get("schedule", "greedy"), timeout_s=60.0,
                                 ep_nodes=case.get("ep_nodes", 1), attn_nodes=case.get("attn_nodes", 1))
        if case.get("emulate"):
            layer.executor.comm.emulate.update(case["emulate"])
        if case.get("native"):
            layer.executor.comm.emulate.difference_update(case["native"])
        _apply_fault(layer, case.get("fault"))
        if case.get("reference") == "interpreter":
            res = check_against_interpreter(layer, module, x, dy)
        else:
            res = check_against_eager(module, layer, x, dy, call=call)
        res.update(case=case, seconds=round(time.perf_counter() - t0, 3),
                   comm_nodes=sum(1 for nd in layer.graph.nodes if nd.is_comm),
                   recompute_nodes=sum(1 for nd in layer.graph.nodes if nd.phase is Phase.RECOMPUTE),
                   ops=sorted({nd.op.value for nd in layer.graph.nodes}))
        out.append(res)
    return out


def mismatched_plans(rank: int, n: int, seed: int) -> None:
    """Rank 1 compiles another schedule than the others: compile must fail on every rank."""
    module = reference_layer(seed)
    x = torch.randn(B, S, H)
    moegraph.compile(module, x, hardware="cpu-gloo", schedule="sequential" if rank == 1 else "greedy",
                     timeout_s=10.0)


def stalled_rank(rank: int, n: int, seed: int, node_name: str, timeout_s: float) -> None:
    """Rank 1 never issues ``node_name``: rank 0's wait on it must time out naming the node.
    The short timeout starts after compiling: the ranks' plan-hash check may take longer than
    ``timeout_s`` on a loaded machine, and its timeout would name the check instead."""
    module = reference_layer(seed)
    gen = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
    layer = moegraph.compile(module, x, hardware="cpu-gloo", schedule="sequential", timeout_s=120.0)
    layer.executor.timeout_s = timeout_s
    if rank == 1:
        comm = layer.executor.comm
        orig = comm.issue

        def issue(node, *args):
            if node.name == node_name:
                time.sleep(10 * timeout_s)
            return orig(node, *args)
        comm.issue = issue
    xs = layer.shard_input(x).requires_grad_(True)
    layer(xs).backward(layer.shard_input(dy))


def live_tensor_bytes_over_steps(rank: int, n: int, seed: int, checkpoints: tuple[int, ...]) -> list[int]:
    """Bytes of every live tensor storage (deduplicated) after each checkpoint's step count of a
    recorded sp+ep step: a steady-state layer must not grow."""
    import gc
    module = reference_layer(seed)
    gen = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
    layer = moegraph.compile(module, x, hardware="cpu-gloo", attn="sp", ffn="ep", dispatch="a2a",
                             schedule="greedy", timeout_s=60.0)
    assert layer.record
    xs, dys = layer.shard_input(x).requires_grad_(True), layer.shard_input(dy)
    out, done = [], 0
    for target in checkpoints:
        while done < target:
            for p in layer.parameters():
                p.grad = None
            layer(xs).backward(dys)
            done += 1
        gc.collect()
        with warnings.catch_warnings():                  # isinstance on torch's deprecated module attrs
            warnings.simplefilter("ignore")
            tensors = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        out.append(sum(storages.values()))
    assert len(layer.traces) == done
    return out


class SlowWork:
    """A collective's work whose completion shows ``delay_s`` after it was issued: the collective
    is in flight for at least that long, whatever the machine's load."""

    def __init__(self, work, delay_s: float):
        self.work, self.ready = work, time.perf_counter() + delay_s

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.ready and self.work.is_completed()

    def wait(self, timeout=None):
        time.sleep(max(0.0, self.ready - time.perf_counter()))
        return self.work.wait(timeout=timeout) if timeout is not None else self.work.wait()


def overlappable_collective(graph, plan) -> str:
    """The first collective after which, before any consumer of its outputs, the plan issues a
    compute node that takes time: a collective the executor may run compute beside."""
    from moegraph.ir import OpKind
    names = [e.name for e in plan.entries]
    for i, name in enumerate(names):
        node = graph.node[name]
        if not node.is_comm:
            continue
        for later in names[i + 1:]:
            other = graph.node[later]
            if set(other.inputs) & set(node.outputs):
                break
            if not other.is_comm and other.op is not OpKind.SPLIT:
                return name
    raise AssertionError(f"plan {plan.method!r} issues no compute between a collective and its consumers")


def compute_beside_collectives(rank: int, n: int, seed: int, steps: int = 2, delay_s: float = 0.05) -> dict:
    """The greedy plan with no collective alone, and with every collective alone (fenced). In both
    one collective, chosen so that the plan issues compute while it is in flight, completes no
    earlier than ``delay_s`` after its issue. Per plan: how many (collective, compute node) pairs
    overlapped in the last recorded step; the fenced plan's errors against the eager module."""
    import dataclasses
    module = reference_layer(seed)
    gen = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
    kw = dict(hardware="cpu-gloo", attn="sp", ffn="ep", dispatch="a2a", timeout_s=60.0)
    base = moegraph.compile(module, x, schedule="greedy", **kw)
    graph = base.graph
    plans = {name: base.plan.with_entries([dataclasses.replace(e, alone=alone and graph.node[e.name].is_comm)
                                           for e in base.plan.entries], method=f"greedy-{name}")
             for name, alone in (("unfenced", False), ("fenced", True))}
    slow = overlappable_collective(graph, plans["unfenced"])
    out = {"slow": slow}
    for name, plan in plans.items():
        layer = moegraph.compile(module, x, schedule=plan, **kw)
        comm, issue = layer.executor.comm, layer.executor.comm.issue

        def slowed(node, *args, _issue=issue):
            p = _issue(node, *args)
            if node.name == slow:
                p.works = [SlowWork(w, delay_s) for w in p.works]
            return p
        comm.issue = slowed
        xs, dys = layer.shard_input(x).requires_grad_(True), layer.shard_input(dy)
        for _ in range(steps):
            layer(xs).backward(dys)
        trace = layer.traces[-1]
        comms = [t for t in trace.nodes if graph.node[t.name].is_comm]
        work = [t for t in trace.nodes if not graph.node[t.name].is_comm and t.end_us > t.start_us]
        out[name] = sum(1 for c in comms for k in work if k.start_us < c.end_us and c.start_us < k.end_us)
        out[name + "_slow"] = sum(1 for c in comms if c.name == slow for k in work
                                  if k.start_us < c.end_us and c.start_us < k.end_us)
        if name == "fenced":
            out["check"] = check_against_eager(module, layer, x, dy)
    return out


def compile_unlowerable(rank: int, n: int, seed: int) -> None:
    """A q_proj with a bias (the rule does not model it): compile must fail with one LoweringError line."""
    layer, _ = hf_layer(seed)
    layer.self_attn.q_proj = torch.nn.Linear(H, H, bias=True)
    moegraph.compile(layer, torch.randn(B, S, H), hardware="cpu-gloo", schedule="sequential", timeout_s=10.0)


def die_at_startup(rank: int, n: int, seed: int) -> None:
    """Never called: spawn's args carry a StartupKiller that kills one rank while it unpickles them."""


class StartupKiller:
    """Unpickling it in a spawned rank (before the process group exists) kills the first rank to
    claim ``flag``: a rank dying during start-up while the others wait for it in the rendezvous."""

    def __init__(self, flag: str):
        self.flag = flag

    def __setstate__(self, state):
        import os
        import signal
        self.__dict__.update(state)
        try:
            fd = os.open(self.flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)


def die_mid_run(rank: int, n: int, victim: int) -> None:
    """Every rank joins a barrier; then ``victim`` kills itself while the others wait in an all_reduce."""
    import os
    import signal
    import torch.distributed as dist
    dist.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(4)
    dist.all_reduce(t)


def sleep_forever(rank: int, n: int, pid_dir: str) -> None:
    """Write this rank's pid to ``pid_dir``/rank<r>.pid, then sleep (the launcher gets killed)."""
    import os
    import pathlib
    path = pathlib.Path(pid_dir) / f"rank{rank}.pid"
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    path.with_suffix(".tmp").rename(path)
    while True:
        time.sleep(1)
