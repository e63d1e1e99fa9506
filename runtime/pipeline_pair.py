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

A pair of two stages on this rank (a V-shape's turn: stage k's forward beside stage 2P-1-k's
backward) runs alike on ``cross_pair_graph`` (moegraph.passes.stage_pairs: each stage's
parameters its own), a plan the backward stage's runner holds per forward stage
(``PairRunner.add_cross``); the forward's output and saved values go to the forward stage's
runner. ``check_merged_pairs`` refuses, naming it, an order with a pair whose plan its stages
were not compiled with, before anything runs. Nothing falls back to running the parts one
after the other.
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
    (module docstring) and leaves micro-batch a's forward for the next ``run_forward(x_a)`` of
    the forward's stage: this one, or, for a pair of two stages (``add_cross``), another."""

    def __init__(self, layer: CompiledLayer, pair: Graph, plan: ExecutionPlan):
        self.layer = layer
        ex = layer.executor
        self.params = {p for p, _ in layer.graph.params}
        # the layer graph's other inputs its backward reads (the aux seed: passes/stage_aux.py) come
        # with that backward, not from the forward
        self.supplied = set(layer.graph.inputs) - self.params - {ex.input_name, ex.seed_name}
        self.plans: dict[PairRunner, tuple[Graph, Executor]] = {}
        """Per forward stage's runner, the pair plan of its forward beside this stage's backward."""
        self.add_cross(self, pair, plan)
        self._armed: torch.Tensor | None = None
        self._armed_layout: Any = None
        self._armed_forward: PairRunner | None = None
        self._made: tuple[torch.Tensor, torch.Tensor, dict[str, Any]] | None = None
        self.runs = 0

    def add_cross(self, forward: "PairRunner", pair: Graph, plan: ExecutionPlan) -> None:
        """The plan of ``forward``'s stage's forward beside this stage's backward: ``pair_graph``
        of the stage's graph (``forward`` is self), or ``cross_pair_graph`` (passes/stage_pairs.py)."""
        ex = self.layer.executor
        self.plans[forward] = (pair, Executor(pair, plan, ex.comm, rank=self.layer.rank, n=self.layer.n,
                                              device=ex.device, timeout_s=self.layer.timeout_s,
                                              expert_rows=self.layer.expert_rows))

    def arm(self, x: torch.Tensor, tokens: Any = None, forward: "PairRunner | None" = None) -> None:
        """Micro-batch a's layer input [b, s/n, h] and batch layout (``moegraph.tokens.Tokens``;
        None: plain) on ``forward``'s stage (None: this one): the next backward runs beside its
        forward."""
        forward = self if forward is None else forward
        if self._armed is not None or self._made is not None or forward._made is not None:
            raise RuntimeFailure(f"stage layers {self.layer.graph.name!r}: a merged F&B pair is already under way")
        if forward not in self.plans:
            raise RuntimeFailure(f"stage layers {self.layer.graph.name!r} have no pair plan beside the forward of "
                                 f"{forward.layer.graph.name!r} (compile_stages(cross_pairs=...))")
        self._armed, self._armed_layout, self._armed_forward = x, tokens, forward

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
        x, fwd, self._armed, self._armed_forward = self._armed, self._armed_forward, None, None
        # m's layout: the one its backward runs with (runtime.pipeline.LayoutRunner sets it on the
        # layer's executor; None: plain); a's: armed with it. The pair graph's mb0 is m, mb1 a.
        layouts = [self.layer.executor.ctx.tokens, self._armed_layout]
        self._armed_layout = None
        pair, ex = self.plans[fwd]
        mine_ex, fwd_ex = self.layer.executor, fwd.layer.executor
        # parameters: one stage's own pair shares them; two stages' name each side's (mb1., mb0.)
        own = fwd is self
        fwd_name = (lambda p: p) if own else (lambda p: mb_name(1, p))  # noqa: E731
        bwd_name = (lambda p: p) if own else (lambda p: mb_name(0, p))  # noqa: E731
        saved, _ = state
        given = ({fwd_name(p): t for p, t in zip(fwd_ex.param_names, fwd.layer.params())}
                 | {bwd_name(p): t for p, t in zip(mine_ex.param_names, params)}
                 | {mb_name(1, fwd_ex.input_name): x.detach(), mb_name(0, mine_ex.seed_name): dy.contiguous()})
        missing = []
        for v in pair.inputs:
            if v not in given:
                k = v[len(mb_name(0, "")):]
                if not v.startswith(mb_name(0, "")) or k not in saved:
                    missing.append(v)
                else:
                    given[v] = saved[k]
        if missing:
            raise RuntimeFailure(f"pair graph {pair.name!r} reads {missing[:3]}, which micro-batch's forward "
                                 "did not keep")
        with step_layouts(ex, layouts):
            env = ex.run_whole(given, set(pair.outputs))     # the pair plan as one phase
        made = dict(given) | env
        fwd._made = (x, env[mb_name(1, fwd_ex.output_name)],
                     {k: made[fwd_name(k) if k in fwd.params else mb_name(1, k)] for k in fwd_ex.saved
                      if k not in fwd.supplied})
        self.runs += 1
        grads = [env[pair.grad_of[bwd_name(p)]] if bwd_name(p) in pair.grad_of else None
                 for p in mine_ex.param_names]
        return env[mb_name(0, mine_ex.input_grad_name)], grads


def check_merged_pairs(orders: Any, modules: Mapping[int, Any], mine: Sequence[int]) -> int:
    """The number of this rank's pairs (``orders``: moegraph's Orders of a CSV); refuses, in one
    line naming the first, a pair whose stages were compiled without its plan (a stage's own pair:
    ``compile_stages(pairs=True)``; two stages': ``cross_pairs``)."""
    from moegraph.schedules.pipeline import Pair
    pairs = [i for row in orders for i in row if isinstance(i, Pair)]
    # every rank compiles its stages alike (compile_stages is collective): all refuse, or none
    bare = [k for k in mine if getattr(modules[k], "pair", None) is None]
    if pairs and bare:
        raise RuntimeFailure(f"the order overlaps pairs ({pairs[0]}, ...), but stage {bare[0]} was compiled without "
                             "its merged F&B plan (compile_stages(pairs=True))")
    for item in pairs:
        f, b = item.forward.stage, item.backward.stage
        if f != b and b in mine and modules[f].pair not in modules[b].pair.plans:
            raise RuntimeFailure(f"pair {item} overlaps stage {f}'s forward with stage {b}'s backward, but the stages "
                                 f"were compiled without that pair's plan (compile_stages(cross_pairs=[({f}, {b})]))")
    return sum(i.forward.stage in mine for i in pairs)


def overlap_f_b(action: Any, ctx: Any) -> None:
    """torch's ``OVERLAP_F_B`` for a compiled stage's pair, of one stage or of two on this rank
    (module docstring; registered by ``TorchPipeline`` with ``register_custom_function``)."""
    from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, _wait_batch_p2p
    sched = ctx.schedule_ref
    f, b = action.sub_actions
    if (f.computation_type, b.computation_type) != (FORWARD, FULL_BACKWARD):
        raise RuntimeFailure(f"OVERLAP_F_B {action}: a merged pair is a stage's F beside a stage's B")
    stages = {st.stage_index: st for st in sched._stages}
    kf, kb, a, m = f.stage_index, b.stage_index, f.microbatch_index, b.microbatch_index
    fwd, bwd = stages[kf], stages[kb]
    # 1. the receives, as torch's F and B wait for them (none from a neighbour on this rank)
    if not fwd.is_first and kf - 1 not in stages:
        _wait_batch_p2p(sched.fwd_recv_ops.pop((kf, a)))
    if not bwd.is_last and kb + 1 not in stages:
        _wait_batch_p2p(sched.bwd_recv_ops.pop((kb, m)))
    # 2. micro-batch a's layer input: the object torch's forward_one_chunk passes below
    x = ctx.arg_mbs[a][0] if fwd.is_first else fwd._retrieve_recv_activations(a)[0]
    fwd.submod.prepare_pair(x, backward=bwd.submod, **ctx.kwarg_mbs[a])
    # 3. m's backward, by torch (its loss, the stage's backward counter, the V-shape's hand-over)
    sched.backward_counter[kb] += 1
    last = sched.backward_counter[kb] == sched._n_microbatches
    bwd.backward_one_chunk(m, loss=sched._maybe_get_loss(bwd, m), full_backward=True, last_backward=last)
    if last:                                   # as torch's FULL_BACKWARD action
        bwd.scale_grads(sched._n_microbatches if sched.scale_grads else 1)
    bwd.submod.pair.disarm()
    if kb - 1 in stages:
        stages[kb - 1].set_local_bwd_input(bwd.get_local_bwd_output(m), m)
    # 4. a's forward, by torch (the layers take the pair's output), its loss on the last stage
    output = fwd.forward_one_chunk(a, ctx.arg_mbs[a], ctx.kwarg_mbs[a])
    sched._maybe_compute_loss(fwd, output, ctx.target_mbs, a)
    if kf + 1 in stages:
        stages[kf + 1].set_local_fwd_input(output, a)
