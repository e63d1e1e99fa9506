"""Synthetic layer graphs for the scheduler tests (and benchmarks/schedules.py without a tracer).

Shapes are per rank; n is the group size. ``moe_layer`` follows MegaScale-MoE Fig 8/9 (SP
attention with all-to-all, EP FFN with all-gather / reduce-scatter dispatch), with an explicit
backward (dgrad/wgrad split), optional recompute (Fig 8b: fc2_in and ffn_in re-made in
backward) and optional token chunks of the FFN (attr ``chunk``).
"""

from __future__ import annotations

from moegraph.ir import (Dims, Graph, Node, OpKind, Phase, Role, Strategy, Value, ValueKind,
                         freeze_attrs, verify)
from moegraph.registry import load_hardware

ACT, GRAD, PARAM, PGRAD, ROUTE = (ValueKind.ACTIVATION, ValueKind.GRAD, ValueKind.PARAM,
                                  ValueKind.PARAM_GRAD, ValueKind.ROUTING)
F, B, R = Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE


# The kernel attributes verify requires of each op (moegraph.node_attrs). These graphs are priced
# and scheduled, never run, so a stand-in only has to be well typed; a test's own value wins.
STAND_IN_ATTRS = {
    OpKind.RMSNORM: {"eps": 1e-5}, OpKind.ROPE: {"head_dim": 128, "theta": 1e4, "positions": "shard"},
    OpKind.ATTENTION: {"head_dim": 128}, OpKind.ROUTER: {"scoring": "softmax", "top_k": 2, "experts": 8},
    OpKind.INDEX_MAP: {"layout": "all", "experts_per_rank": 8, "top_k": 2}, OpKind.PERMUTE: {"index": "token"},
    OpKind.UNPERMUTE: {"weighted": True}, OpKind.SPLIT: {"mode": "split", "dim": 0, "sizes": ()},
    OpKind.CAST: {"to": "bf16"}, OpKind.ALL_GATHER: {"dim": 0}, OpKind.REDUCE_SCATTER: {"dim": 0},
    OpKind.ALL_TO_ALL: {"mode": "heads"},
}


def hardware(name: str = "h800"):
    return load_hardware(name)


def cost_model(name: str = "h800"):
    from moegraph.cost import CostModel
    return CostModel(hardware(name))


class MiniBuilder:
    """Just enough of a graph builder for tests: names are explicit, costs derived from shapes."""

    def __init__(self, name: str, n: int = 8, dims: Dims | None = None, chunks: int = 1):
        self.name, self.n = name, n
        self.dims = dims or Dims(b=1, s=8192, h=4096, n=n, k=2, heads=32, kv_heads=8, head_dim=128,
                                 ffn=14336, experts=8)
        self.strategy = Strategy(attn="sp", ffn="ep", dispatch="ag-rs", n=n, chunks=chunks)
        self.values: dict[str, Value] = {}
        self.nodes: list[Node] = []
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.saved: set[str] = set()

    def val(self, name, shape, kind=ACT, dtype="bf16", alias_of=None):
        self.values[name] = Value(name, tuple(shape), dtype, kind, alias_of=alias_of)
        return name

    def inp(self, name, shape, kind=ACT):
        self.inputs.append(self.val(name, shape, kind))
        return name

    def nbytes(self, name):
        return self.values[name].nbytes

    def node(self, name, op, ins, outs, phase=F, role=Role.FORWARD, flops=0, comm_bytes=0, **attrs):
        mem = sum(self.nbytes(v) for v in dict.fromkeys(ins)) + sum(self.nbytes(v) for v in outs)
        self.nodes.append(Node(name=name, op=op, phase=phase, role=role, inputs=tuple(ins), outputs=tuple(outs),
                               flops=int(flops), mem_bytes=0 if op is OpKind.SPLIT else mem,
                               comm_bytes=int(comm_bytes), group=self.n if op.is_comm else 0,
                               attrs=freeze_attrs(STAND_IN_ATTRS.get(op, {}) | attrs)))
        return outs[0] if len(outs) == 1 else outs

    def gemm(self, name, x, w, out, m, k, n, phase=F, role=Role.FORWARD, op=OpKind.GEMM, **attrs):
        return self.node(name, op, (x, w), (out,), phase, role, flops=2 * m * k * n, **attrs)

    def comm(self, name, op, x, out, phase=F, role=Role.FORWARD, **attrs):
        n = self.n
        full = self.nbytes(out) if op is OpKind.ALL_GATHER else self.nbytes(x)
        return self.node(name, op, (x,), (out,), phase, role, comm_bytes=full * (n - 1) // n, **attrs)

    def build(self) -> Graph:
        return verify(Graph(name=self.name, dims=self.dims, strategy=self.strategy,
                            values=tuple(self.values.values()), nodes=tuple(self.nodes),
                            inputs=tuple(self.inputs), outputs=tuple(self.outputs),
                            saved=frozenset(self.saved)))


def tiny_chain(n: int = 8, tokens: int = 1024, h: int = 2048) -> Graph:
    """gemm -> all_gather -> gemm forward; dgrad -> reduce_scatter -> dgrad backward with
    wgrads beside them: 9 nodes, the smallest graph where overlap matters."""
    g = MiniBuilder("tiny_chain", n)
    T = tokens
    x = g.inp("x", (T, h))
    w1 = g.inp("w1", (h, h), PARAM)
    w2 = g.inp("w2", (h, h), PARAM)
    y = g.gemm("fc1", x, w1, g.val("y", (T, h)), T, h, h)
    y_ag = g.comm("ag", OpKind.ALL_GATHER, y, g.val("y_ag", (T * n, h)))
    z = g.gemm("fc2", y_ag, w2, g.val("z", (T * n, h)), T * n, h, h)
    g.outputs.append(z)
    dz = g.inp("dz", (T * n, h), GRAD)
    dy_ag = g.gemm("fc2.dgrad", dz, w2, g.val("dy_ag", (T * n, h), GRAD), T * n, h, h, B, Role.DGRAD)
    dw2 = g.gemm("fc2.wgrad", y_ag, dz, g.val("dw2", (h, h), PGRAD), h, T * n, h, B, Role.WGRAD)
    dy = g.comm("rs", OpKind.REDUCE_SCATTER, dy_ag, g.val("dy", (T, h), GRAD), B, Role.DGRAD)
    dx = g.gemm("fc1.dgrad", dy, w1, g.val("dx", (T, h), GRAD), T, h, h, B, Role.DGRAD)
    dw1 = g.gemm("fc1.wgrad", x, dy, g.val("dw1", (h, h), PGRAD), h, T, h, B, Role.WGRAD)
    g.outputs += [dx, dw1, dw2]
    g.saved |= {x, y_ag}
    return g.build()


def barrier_graph(n: int = 8) -> Graph:
    """A backward node that needs nothing from forward (it reads only the seed gradient and a
    parameter): only the barrier keeps it after the forward pass."""
    g = MiniBuilder("barrier", n)
    T, h = 1024, 2048
    x = g.inp("x", (T, h))
    w = g.inp("w", (h, h), PARAM)
    y = g.gemm("fwd", x, w, g.val("y", (T, h)), T, h, h)
    y2 = g.gemm("fwd2", y, w, g.val("y2", (T, h)), T, h, h)
    g.outputs.append(y2)
    dy = g.inp("dy", (T, h), GRAD)
    dx = g.gemm("early.dgrad", dy, w, g.val("dx", (T, h), GRAD), T, h, h, B, Role.DGRAD)
    dw = g.gemm("late.wgrad", y, dy, g.val("dw", (h, h), PGRAD), h, T, h, B, Role.WGRAD)
    g.outputs += [dx, dw]
    g.saved.add(y)
    return g.build()


def moe_layer(n: int = 8, chunks: int = 1, recompute: bool = False, tokens: int = 1024, h: int = 4096,
              ffn: int = 14336, k: int = 2, experts: int = 8, scope: str | None = None) -> Graph:
    """One MoE layer (Fig 8/9), forward + backward. ``tokens``: s/n per rank. The FFN (its
    all-gather, expert GEMMs, reduce-scatter and their backward) is split into ``chunks`` token
    chunks. ``recompute`` re-makes ffn_in and fc2_in in backward (MegaScale-MoE Fig 8b)."""
    g = MiniBuilder(f"moe_c{chunks}{'_re' if recompute else ''}", n, chunks=chunks)
    extra = {} if scope is None else {"scope": scope}
    T, d = tokens, 128
    H, G = 32, 8
    qkv_w = (H + 2 * G) * d
    hid = g.inp("hidden", (T, h))
    w_qkv = g.inp("w_qkv", (h, qkv_w), PARAM)
    w_o = g.inp("w_o", (H * d, h), PARAM)
    w_r = g.inp("w_router", (h, experts), PARAM)
    ln_w = g.inp("ln_w", (h,), PARAM)
    el = experts // n
    w13 = g.inp("w13", (el, h, 2 * ffn), PARAM)
    w2 = g.inp("w2", (el, ffn, h), PARAM)

    # attention (SP): [T, h] -> qkv [T, h(1+2/m)] -> a2a [T*n, h(1+2/m)/n] -> attn [T*n, h/n]
    ln1 = g.node("ln1", OpKind.RMSNORM, (hid, ln_w), (g.val("ln1_out", (T, h)),), flops=4 * T * h)
    qkv = g.gemm("qkv", ln1, w_qkv, g.val("qkv", (T, qkv_w)), T, h, qkv_w)
    q, kk, v = (g.val(nm, (T, w), alias_of="qkv") for nm, w in (("q", H * d), ("k", G * d), ("v", G * d)))
    g.node("split_qkv", OpKind.SPLIT, (qkv,), (q, kk, v), mode="split")
    qr, kr = g.node("rope", OpKind.ROPE, (q, kk), (g.val("q_rope", (T, H * d)), g.val("k_rope", (T, G * d))),
                    flops=6 * T * (H + G) * d)
    qkv_a2a = g.node("a2a_qkv", OpKind.ALL_TO_ALL, (qr, kr, v), (g.val("qkv_a2a", (T * n, qkv_w // n)),),
                     comm_bytes=T * qkv_w * 2 * (n - 1) // n, **extra)
    attn = g.node("attn", OpKind.ATTENTION, (qkv_a2a,), (g.val("attn", (T * n, H * d // n)),),
                  flops=2 * 2 * (T * n) ** 2 * (H * d // n) // 2, head_dim=d, seq=T * n)
    attn_a2a = g.comm("a2a_attn", OpKind.ALL_TO_ALL, attn, g.val("attn_a2a", (T, H * d)), **extra)
    attn_out = g.gemm("o_proj", attn_a2a, w_o, g.val("attn_out", (T, h)), T, H * d, h)
    ln2_in = g.node("add_attn", OpKind.ADD, (hid, attn_out), (g.val("ln2_in", (T, h)),), flops=T * h)
    ln2 = g.node("ln2", OpKind.RMSNORM, (ln2_in, ln_w), (g.val("ln2_out", (T, h)),), flops=4 * T * h)

    # FFN (EP, ag-rs dispatch) in token chunks: [T/C, h] -ag-> [T*n/C, h] -> rows R/C = T*k/C
    C = chunks
    Tc, Rc = T // C, T * k // C
    if C > 1:
        parts = tuple(g.val(f"ln2_out.c{c}", (Tc, h), alias_of="ln2_out") for c in range(C))
        g.node("split_ffn", OpKind.SPLIT, (ln2,), parts, mode="split")
    else:
        parts = (ln2,)
    ffn_outs, saved_chunk = [], []
    for c in range(C):
        sfx = f".c{c}" if C > 1 else ""
        ca = {"chunk": c} if C > 1 else {}
        ag = g.comm(f"ag{sfx}", OpKind.ALL_GATHER, parts[c], g.val(f"ln2_out_ag{sfx}", (Tc * n, h)), **extra, **ca)
        route = g.node(f"router{sfx}", OpKind.ROUTER, (ag, w_r), (g.val(f"routing{sfx}", (Tc * n, k), ROUTE, "int64"),),
                       flops=2 * Tc * n * h * experts, scoring="softmax", **ca)
        ffn_in = g.node(f"permute{sfx}", OpKind.PERMUTE, (ag, route), (g.val(f"ffn_in{sfx}", (Rc, h)),),
                        index="token", **ca)
        fc13 = g.gemm(f"fc13{sfx}", ffn_in, w13, g.val(f"fc13_out{sfx}", (Rc, 2 * ffn)), Rc, h, 2 * ffn,
                      op=OpKind.GROUPED_GEMM, **ca)
        fc2_in = g.node(f"swiglu{sfx}", OpKind.SWIGLU, (fc13,), (g.val(f"fc2_in{sfx}", (Rc, ffn)),),
                        flops=4 * Rc * ffn, **ca)
        fc2 = g.gemm(f"fc2{sfx}", fc2_in, w2, g.val(f"fc2_out{sfx}", (Rc, h)), Rc, ffn, h,
                     op=OpKind.GROUPED_GEMM, **ca)
        unp = g.node(f"unpermute{sfx}", OpKind.UNPERMUTE, (fc2, route), (g.val(f"fc2_out_rs{sfx}", (Tc * n, h)),),
                     flops=2 * Rc * h, **ca)
        ffn_outs.append(g.comm(f"rs{sfx}", OpKind.REDUCE_SCATTER, unp, g.val(f"ffn_out{sfx}", (Tc, h)), **extra, **ca))
        saved_chunk.append((ag, route, ffn_in, fc13, fc2_in))
    out = g.node("add_ffn", OpKind.ADD, (ln2_in, *ffn_outs), (g.val("hidden_next", (T, h)),), flops=C * T * h)
    g.outputs.append(out)

    # backward
    seed = g.inp("d_hidden_next", (T, h), GRAD)
    d_ln2_parts = []
    dw13s, dw2s = [], []
    if C > 1:
        dparts = tuple(g.val(f"d_ffn_out.c{c}", (Tc, h), GRAD, alias_of="d_hidden_next") for c in range(C))
        g.node("split_dffn", OpKind.SPLIT, (seed,), dparts, B, Role.DGRAD, mode="concat")
    else:
        dparts = (seed,)
    for c in range(C):
        sfx = f".c{c}" if C > 1 else ""
        ca = {"chunk": c} if C > 1 else {}
        ag, route, ffn_in, fc13, fc2_in = saved_chunk[c]
        if recompute:
            # Fig 8b: ffn_in from re-run RMSNorm + all-gather; fc2_in from re-run SwiGLU.
            ln2_re = g.node(f"ln2.re{sfx}", OpKind.RMSNORM, (parts[c] if C == 1 else ln2_in, ln_w),
                            (g.val(f"ln2_out.re{sfx}", (Tc, h)),), R, flops=4 * Tc * h, **ca)
            ag_re = g.comm(f"ag.re{sfx}", OpKind.ALL_GATHER, ln2_re, g.val(f"ln2_out_ag.re{sfx}", (Tc * n, h)), R,
                           **extra, **ca)
            ffn_in = g.node(f"permute.re{sfx}", OpKind.PERMUTE, (ag_re, route), (g.val(f"ffn_in.re{sfx}", (Rc, h)),),
                            R, index="token", **ca)
            fc2_in = g.node(f"swiglu.re{sfx}", OpKind.SWIGLU, (fc13,), (g.val(f"fc2_in.re{sfx}", (Rc, ffn)),), R,
                            flops=4 * Rc * ffn, **ca)
        g.saved |= {route, fc13} | ({ffn_in, fc2_in} if not recompute else set())
        d_rs = g.comm(f"rs.bwd{sfx}", OpKind.ALL_GATHER, dparts[c], g.val(f"d_fc2_out_rs{sfx}", (Tc * n, h), GRAD),
                      B, Role.DGRAD, **extra, **ca)
        d_fc2 = g.node(f"unpermute.bwd{sfx}", OpKind.PERMUTE, (d_rs, route), (g.val(f"d_fc2_out{sfx}", (Rc, h), GRAD),),
                       B, Role.DGRAD, index="token", **ca)
        d_fc2_in = g.gemm(f"fc2.dgrad{sfx}", d_fc2, w2, g.val(f"d_fc2_in{sfx}", (Rc, ffn), GRAD), Rc, h, ffn,
                          B, Role.DGRAD, op=OpKind.GROUPED_GEMM, **ca)
        dw2s.append(g.gemm(f"fc2.wgrad{sfx}", fc2_in, d_fc2, g.val(f"d_w2{sfx}", (el, ffn, h), PGRAD), ffn, Rc, h,
                           B, Role.WGRAD, op=OpKind.GROUPED_GEMM, **ca))
        d_fc13 = g.node(f"swiglu.bwd{sfx}", OpKind.SWIGLU, (fc13, d_fc2_in),
                        (g.val(f"d_fc13{sfx}", (Rc, 2 * ffn), GRAD),), B, Role.DGRAD, flops=8 * Rc * ffn, **ca)
        d_ffn_in = g.gemm(f"fc13.dgrad{sfx}", d_fc13, w13, g.val(f"d_ffn_in{sfx}", (Rc, h), GRAD), Rc, 2 * ffn, h,
                          B, Role.DGRAD, op=OpKind.GROUPED_GEMM, **ca)
        dw13s.append(g.gemm(f"fc13.wgrad{sfx}", ffn_in, d_fc13, g.val(f"d_w13{sfx}", (el, h, 2 * ffn), PGRAD),
                            h, Rc, 2 * ffn, B, Role.WGRAD, op=OpKind.GROUPED_GEMM, **ca))
        d_ag = g.node(f"permute.bwd{sfx}", OpKind.UNPERMUTE, (d_ffn_in, route),
                      (g.val(f"d_ln2_out_ag{sfx}", (Tc * n, h), GRAD),), B, Role.DGRAD, flops=2 * Rc * h, **ca)
        d_ln2_parts.append(g.comm(f"ag.bwd{sfx}", OpKind.REDUCE_SCATTER, d_ag, g.val(f"d_ln2_out{sfx}", (Tc, h), GRAD),
                                  B, Role.DGRAD, **extra, **ca))
    g.saved |= {ln2_in, attn_a2a, qkv_a2a, attn, ln1, hid}
    d_ln2_in = g.node("ln2.bwd", OpKind.RMSNORM, (ln2_in, *d_ln2_parts), (g.val("d_ln2_in_part", (T, h), GRAD),),
                      B, Role.DGRAD, flops=8 * T * h)
    d_ln2_in = g.node("add_attn.bwd", OpKind.ADD, (seed, d_ln2_in), (g.val("d_ln2_in", (T, h), GRAD),), B,
                      Role.DGRAD, flops=T * h)
    d_attn_a2a = g.gemm("o_proj.dgrad", d_ln2_in, w_o, g.val("d_attn_a2a", (T, H * d), GRAD), T, h, H * d,
                        B, Role.DGRAD)
    dwo = g.gemm("o_proj.wgrad", attn_a2a, d_ln2_in, g.val("d_w_o", (H * d, h), PGRAD), H * d, T, h, B, Role.WGRAD)
    d_attn = g.comm("a2a_attn.bwd", OpKind.ALL_TO_ALL, d_attn_a2a, g.val("d_attn", (T * n, H * d // n), GRAD),
                    B, Role.DGRAD, **extra)
    d_qkv_a2a = g.node("attn.bwd", OpKind.ATTENTION, (qkv_a2a, attn, d_attn),
                       (g.val("d_qkv_a2a", (T * n, qkv_w // n), GRAD),), B, Role.DGRAD,
                       flops=int(2.5 * 2 * (T * n) ** 2 * (H * d // n)), head_dim=d, seq=T * n)
    d_qkv = g.comm("a2a_qkv.bwd", OpKind.ALL_TO_ALL, d_qkv_a2a, g.val("d_qkv", (T, qkv_w), GRAD), B, Role.DGRAD,
                   **extra)
    d_ln1 = g.gemm("qkv.dgrad", d_qkv, w_qkv, g.val("d_ln1_out", (T, h), GRAD), T, qkv_w, h, B, Role.DGRAD)
    dwqkv = g.gemm("qkv.wgrad", ln1, d_qkv, g.val("d_w_qkv", (h, qkv_w), PGRAD), h, T, qkv_w, B, Role.WGRAD)
    d_hid = g.node("ln1.bwd", OpKind.RMSNORM, (hid, d_ln1, d_ln2_in), (g.val("d_hidden", (T, h), GRAD),), B,
                   Role.DGRAD, flops=8 * T * h)
    g.outputs += [d_hid, dwo, dwqkv, *dw13s, *dw2s]
    return g.build()


def crossing_graph(big: int = 64 << 20, small: int = 1 << 20) -> Graph:
    """Two producers whose big outputs are each read by the *other* branch's consumer too late
    to free early: whichever consumer runs first, both big values are live then. The task-wise
    memory lower bound sees only one of them, so the least peak (2 big) needs a proof by search."""
    g = MiniBuilder("crossing", 8)
    rows = big // (2 * 1024)
    srows = small // (2 * 1024)
    x = g.inp("x", (srows, 1024))
    w = g.inp("w", (1024, 1024), PARAM)
    fl = 2 * rows * 1024 * 1024
    g.node("p1", OpKind.GEMM, (x, w), (g.val("a", (rows, 1024)), g.val("p", (srows, 1024))), flops=fl)
    g.node("q1", OpKind.GEMM, (x, w), (g.val("b", (rows, 1024)), g.val("q", (srows, 1024))), flops=fl)
    g.node("p2", OpKind.GEMM, ("a", "q"), (g.val("pa", (srows, 1024)),), flops=fl)
    g.node("q2", OpKind.GEMM, ("b", "p"), (g.val("qb", (srows, 1024)),), flops=fl)
    g.outputs += ["pa", "qb"]
    return g.build()
