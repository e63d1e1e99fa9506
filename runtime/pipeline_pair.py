"""A pipeline stage's overlapped F&B pair, run as moegraph's op-level merged schedule.

Notation: b (one micro-batch's rows), s, h, n as in moegraph.ir; a and m two micro-batches.

torch's pipelining runtime (``_PipelineScheduleRuntime``) runs an ``OVERLAP_F_B`` action (one
stage's forward of micro-batch a beside a backward of micro-batch m, on one rank) by the function
registered for it with ``register_custom_function`` (otherwise: its two parts one after the
other). ``overlap_f_b`` is that function for moegraph's compiled stages (runtime.pipeline): the
compiled layers of the stage run the pair's plan, the op-level schedule of
``moegraph.passes.microbatch.pair_graph`` (micro-batch a's forward as the pair's ``mb1``, m's
backward as its ``mb0``, the two interleaved as CP-SAT or the list schedule put them), while
the stage's eager edges (embedding, final norm, head, loss) and torch's own bookkeeping run as
torch runs them:

  1. wait for the pair's receives (a's activation, m's output gradient), as torch's F and B do;
  2. the stage's eager part before the layers for micro-batch a (the embedding on the first
     stage) runs now (``CompiledStage.prepare_pair``): the layers' input x_a [b, s/n, h];
  3. torch's backward of m (``backward_one_chunk``): autograd runs the head's backward, then
     the layers' backward node, whose runner (``PairRunner``) runs the pair plan on x_a, m's
     saved values and its incoming gradient instead of m's backward alone, returns m's input
     and parameter gradients to autograd and keeps a's output and saved values;
  4. torch's forward of a (``forward_one_chunk``): the layers' forward node takes the kept
     output and saved values (nothing runs twice), the head and loss run eagerly.

Only a stage's forward beside its own backward runs merged (the pair graph holds one stage's
parameters); ``check_merged_pairs`` refuses, naming it, an order that pairs two stages (a
V-shape's turn) before anything runs, as it refuses a compiled stage built without its pair
plan. Nothing falls back to running the parts one after the other.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from moegraph.ir import Graph
from moegraph.microbatch import mb_name
from moegraph.runtime import RuntimeFailure
from moegraph.runtime.executor import Executor
from moegraph.runtime.model_steps import step_layouts
from moegraph.runtime.module import CompiledLayer
from moegraph.runtime.plan import ExecutionPlan

__all__ = ["PairRunner", "overlap_f_b", "check_merged_pairs"]


class PairRunner:
    """The runner of a compiled stage's layers (``runtime.autograd.Runner``): the layer's own
    forward and backward, except the one backward after ``arm(x_a)``, which runs the pair plan
    (module docstring) and leaves micro-batch a's forward for the next ``run_forward(x_a)``."""

    def __init__(self, layer: CompiledLayer, pair: Graph, plan: ExecutionPlan):
        self.layer, self.pair = layer, pair
        ex = layer.executor
        self.executor = Executor(pair, plan, ex.comm, rank=layer.rank, n=layer.n, device=ex.device,
                                 timeout_s=layer.timeout_s, expert_rows=layer.expert_rows)
        self.params = {p for p, _ in layer.graph.params}
        # the layer graph's other inputs its backward reads (the aux seed: passes/stage_aux.py) come
        # with that backward, not from the forward
        self.supplied = set(layer.graph.inputs) - self.params - {ex.input_name, ex.seed_name}
        self.x, self.seed, self.y, self.dx = (mb_name(j, v) for j, v in zip((1, 0, 1, 0), (
            ex.input_name, ex.seed_name, ex.output_name, ex.input_grad_name)))
        self._armed: torch.Tensor | None = None
        self._armed_layout: Any = None
        self._made: tuple[torch.Tensor, torch.Tensor, dict[str, Any]] | None = None
        self.runs = 0

    def arm(self, x: torch.Tensor, tokens: Any = None) -> None:
        """Micro-batch a's layer input [b, s/n, h] and batch layout (``moegraph.tokens.Tokens``;
        None: plain): the next backward runs beside its forward."""
        if self._armed is not None or self._made is not None:
            raise RuntimeFailure(f"stage layers {self.layer.graph.name!r}: a merged F&B pair is already under way")
        self._armed, self._armed_layout = x, tokens

    def disarm(self) -> None:
        """After the pair's backward: it must have run the pair (module docstring, step 3)."""
        if self._armed is not None:
            self._armed = None
            raise RuntimeFailure(f"stage layers {self.layer.graph.name!r}: the pair's backward did not reach the "
                                 "compiled layers, so the merged F&B did not run")

    def run_forward(self, x: torch.Tensor, params: Sequence[torch.Tensor]):
        if self._made is None:
            return self.layer.run_forward(x, params)
        armed, y, saved = self._made
        self._made = None
        if x is not armed:
            raise RuntimeFailure(f"stage layers {self.layer.graph.name!r}: the forward after a merged F&B pair got "
                                 "another input than the pair's")
        return y, (saved, None)

    def run_backward(self, state, dy: torch.Tensor, params: Sequence[torch.Tensor]):
        if self._armed is None:
            return self.layer.run_backward(state, dy, params)
        x, self._armed = self._armed, None
        # m's layout: the one its backward runs with (runtime.pipeline.LayoutRunner sets it on the
        # layer's executor; None: plain); a's: armed with it. The pair graph's mb0 is m, mb1 a.
        layouts = [self.layer.executor.ctx.tokens, self._armed_layout]
        self._armed_layout = None
        saved, _ = state
        ex, layer_ex = self.executor, self.layer.executor
        given = dict(zip(layer_ex.param_names, params)) | {self.x: x.detach(), self.seed: dy.contiguous()}
        missing = []
        for v in self.pair.inputs:
            if v not in given:
                k = v[len(mb_name(0, "")):]
                if not v.startswith(mb_name(0, "")) or k not in saved:
                    missing.append(v)
                else:
                    given[v] = saved[k]
        if missing:
            raise RuntimeFailure(f"pair graph {self.pair.name!r} reads {missing[:3]}, which micro-batch's forward "
                                 "did not keep")
        with step_layouts(ex, layouts):
            env = ex.run_whole(given, set(self.pair.outputs))     # the pair plan as one phase
        mine = dict(given) | env
        self._made = (x, env[self.y], {k: mine[k if k in self.params else mb_name(1, k)] for k in layer_ex.saved
                                       if k not in self.supplied})
        self.runs += 1
        grads = [env[self.pair.grad_of[p]] if p in self.pair.grad_of else None for p in layer_ex.param_names]
        return env[self.dx], grads


def check_merged_pairs(orders: Any, modules: Mapping[int, Any], mine: Sequence[int]) -> int:
    """The number of this rank's pairs (``orders``: moegraph's Orders of a CSV); refuses, in one
    line naming the first, a pair of two stages or of a stage compiled without its pair plan."""
    from moegraph.schedules.pipeline import Pair
    pairs = [i for row in orders for i in row if isinstance(i, Pair)]
    for item in pairs:
        f, b = item.forward, item.backward
        if f.stage != b.stage:
            raise RuntimeFailure(f"pair {item} overlaps stage {f.stage}'s forward with stage {b.stage}'s backward: "
                                 "a merged F&B runs one stage's forward beside its own backward (one pair graph, "
                                 "one stage's parameters); solve without pairs of two stages (pairs=False)")
    # every rank compiles its stages alike (compile_stages is collective): all refuse, or none
    bare = [k for k in mine if getattr(modules[k], "pair", None) is None]
    if pairs and bare:
        raise RuntimeFailure(f"the order overlaps pairs ({pairs[0]}, ...), but stage {bare[0]} was compiled without "
                             "its merged F&B plan (compile_stages(pairs=True))")
    return sum(i.forward.stage in mine for i in pairs)


def overlap_f_b(action: Any, ctx: Any) -> None:
    """torch's ``OVERLAP_F_B`` for a compiled stage's pair (module docstring; registered by
    ``TorchPipeline`` with ``register_custom_function``)."""
    from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, _wait_batch_p2p
    sched = ctx.schedule_ref
    f, b = action.sub_actions
    if (f.computation_type, b.computation_type) != (FORWARD, FULL_BACKWARD) or f.stage_index != b.stage_index:
        raise RuntimeFailure(f"OVERLAP_F_B {action}: a merged pair is one stage's F beside its own B")
    stages = {st.stage_index: st for st in sched._stages}
    k, a, m = f.stage_index, f.microbatch_index, b.microbatch_index
    stage = stages[k]
    module = stage.submod
    # 1. the receives, as torch's F and B wait for them (none from a neighbour on this rank)
    if not stage.is_first and k - 1 not in stages:
        _wait_batch_p2p(sched.fwd_recv_ops.pop((k, a)))
    if not stage.is_last and k + 1 not in stages:
        _wait_batch_p2p(sched.bwd_recv_ops.pop((k, m)))
    # 2. micro-batch a's layer input: the object torch's forward_one_chunk passes below
    x = ctx.arg_mbs[a][0] if stage.is_first else stage._retrieve_recv_activations(a)[0]
    module.prepare_pair(x, **ctx.kwarg_mbs[a])
    # 3. m's backward, by torch (its loss, the stage's backward counter, the V-shape's hand-over)
    sched.backward_counter[k] += 1
    stage.backward_one_chunk(m, loss=sched._maybe_get_loss(stage, m), full_backward=True,
                             last_backward=sched.backward_counter[k] == sched._n_microbatches)
    module.pair.disarm()
    if k - 1 in stages:
        stages[k - 1].set_local_bwd_input(stage.get_local_bwd_output(m), m)
    # 4. a's forward, by torch (the layers take the pair's output), its loss on the last stage
    output = stage.forward_one_chunk(a, ctx.arg_mbs[a], ctx.kwarg_mbs[a])
    sched._maybe_compute_loss(stage, output, ctx.target_mbs, a)
    if k + 1 in stages:
        stages[k + 1].set_local_fwd_input(output, a)
