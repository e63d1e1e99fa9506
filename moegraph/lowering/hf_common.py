"""transformers' causal LMs recognised by structure, and the attention settings every family shares.

A causal LM is ``<X>ForCausalLM`` with children ``model`` and ``lm_head``; its base model holds
``embed_tokens``, ``layers`` (the decoder layers), ``norm`` and ``rotary_emb`` (a family may name
the first four otherwise: its row's ``ModelNames``, DBRX's ``transformer`` of ``wte``, ``blocks``,
``norm_f``). The decoder
layers lower structurally (``moegraph.lowering.structural``); the parts around them run as the
model edges (embedding, final norm, LM head, loss): an RMSNorm or a bias-free LayerNorm
(Cohere's), and the logits times the model's own ``logit_scale`` where its forward multiplies
them by it (Cohere2-MoE: ``moegraph.edges.EdgeHead``). What the edges do not compute is refused by
name: the configuration fields a model's forward reads beyond the ones listed here as harmless
(e.g. Granite's embedding_multiplier or logits_scaling), and any other number it reads from itself.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import re
import sys
import textwrap

import torch
from torch import nn

from moegraph.edges import AuxLoss, EdgeHead
from moegraph.lowering import LoweringError, ModelOutput, ModelRule, ModelSpec, check_embedding, check_head
from moegraph.lowering.families import ModelNames, family_row
from moegraph.lowering.rope import rotary_frequencies
from moegraph.lowering.structural import classify, family_of, forward_reads, norm_spec


def check_attention(module: nn.Module, qualname: str, head_dim: int | None = None, structural: bool = False) -> None:
    """Raise naming the first attention setting the ATTENTION op does not compute: dropout in
    training mode, a non-causal module, an attention kernel whose math is not transformers' own."""
    if module.training and getattr(module, "attention_dropout", 0) > 0:
        raise LoweringError(f"{qualname}.attention_dropout={module.attention_dropout} in training mode: attention "
                            "dropout is not supported; set it to 0 or call .eval()")
    if not getattr(module, "is_causal", True):
        raise LoweringError(f"{qualname}.is_causal=False: only causal attention is supported")
    check_attention_kernel(module, qualname)


def check_attention_kernel(module: nn.Module, qualname: str) -> None:
    """The attention function the module's forward dispatches to (``config._attn_implementation``
    through transformers' AttentionInterface) must be one whose math the ATTENTION op reproduces:
    the family's own ``eager_attention_forward`` or transformers' ``sdpa_attention_forward``
    (checked by identity, so a kernel registered under either name is caught too)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    impl = module.config._attn_implementation
    own = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    fn = ALL_ATTENTION_FUNCTIONS.get(impl, own)     # as the forward's get_interface(impl, eager_attention_forward)
    eager = (getattr(fn, "__module__", None) == type(module).__module__
             and getattr(fn, "__qualname__", None) == "eager_attention_forward")
    if fn is not sdpa_attention_forward and not eager:
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        raise LoweringError(f"{qualname} ({type(module).__name__}): attn_implementation={impl!r} runs {name}, which "
                            "the compiler does not model; only 'eager' and 'sdpa' (transformers' own functions) are "
                            "supported: load the model with attn_implementation='sdpa' (or "
                            "model.set_attn_implementation('sdpa'))")


# -- models ----------------------------------------------------------------------------------------

# one rotary module per distinct non-zero theta of config.layer_rope_theta (GraniteMoeSWA)
THETA_ROTARIES = "rotary_embs"


def names_of(model: nn.Module) -> ModelNames:
    """The children's names of a causal LM or base model of its family (``families.ModelNames``)."""
    return family_row(family_of(type(model))).names


def base_children(model: nn.Module) -> tuple[str, ...]:
    """The children a base model's rule reads: its family's embedding, layers and norm, then
    ``rotary_emb`` (where it has one: Kimi Linear's has none, its layers rotate nothing), and
    ``rotary_embs`` where its config gives each layer its own RoPE theta (``config.layer_rope_theta``)."""
    cfg, names = getattr(model, "config", None), names_of(model)
    rotary = ("rotary_emb",) if isinstance(getattr(model, "rotary_emb", None), nn.Module) else ()
    return (names.embed, names.layers, names.norm, *rotary) + (
        (THETA_ROTARIES,) if getattr(cfg, "layer_rope_theta", None) is not None
        and isinstance(getattr(model, THETA_ROTARIES, None), nn.ModuleList) else ())

# configuration fields a base model's or causal LM's forward may read without changing what the
# edges compute (masks, caches, output plumbing, the aux loss's sizes)
HARMLESS_CONFIG = frozenset({
    "layer_types", "sliding_window", "use_cache", "num_hidden_layers", "output_router_logits", "use_return_dict",
    "output_attentions", "output_hidden_states", "return_dict", "router_aux_loss_coef", "num_experts",
    "num_local_experts", "num_experts_per_tok", "vocab_size", "pad_token_id", "_attn_implementation",
    "attention_chunk_size", "tie_word_embeddings", "use_sliding_window", "max_window_layers", "n_routed_experts",
    "moe_num_experts", "moe_k", "moe_topk", "rope_parameters", "hidden_size",
})


@functools.lru_cache(maxsize=None)
def config_reads(cls: type) -> frozenset[str]:
    """Fields ``self.config.X`` that cls.forward reads (from its source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    found = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "config" and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "self"):
            found.add(node.attr)
    return frozenset(found)


def masks_by_position(model: nn.Module) -> bool | None:
    """Whether the transformers model's base model builds its attention masks from position_ids
    (``create_causal_mask(..., position_ids=...)``, directly or through a ``mask_kwargs`` dict), so
    that position_ids that restart keep packed documents apart (masking_utils); False when its
    mask builders do not take them (GPT-OSS: the documents then attend to each other and only RoPE
    restarts); None when its forward builds no mask the source shows."""
    base = getattr(model, names_of(model).base, model)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(base).forward))))
    except (OSError, TypeError, SyntaxError):
        return None
    # create_causal_mask(...), or a local naming one of the builders (mask_function = ... if ... else ...)
    calls = [nd for nd in ast.walk(tree) if isinstance(nd, ast.Call) and isinstance(nd.func, ast.Name)
             and "mask" in nd.func.id]
    if not calls:
        return None
    direct = any(kw.arg == "position_ids" for call in calls for kw in call.keywords)
    spread = any(isinstance(nd, ast.Assign) and isinstance(nd.value, ast.Dict)
                 and any(isinstance(t, ast.Name) and t.id.endswith("mask_kwargs") for t in nd.targets)
                 and any(isinstance(k, ast.Constant) and k.value == "position_ids" for k in nd.value.keys)
                 for nd in ast.walk(tree))
    return direct or spread


def _check_config_reads(model: nn.Module) -> None:
    cfg = model.config
    modelled = {"layer_rope_theta"} if THETA_ROTARIES in base_children(model) else set()   # each layer's RopeSpec
    if logit_softcap(model) is not None:                    # the edges' soft cap (EdgeHead.softcap)
        modelled.add(SOFTCAP)
    odd = sorted(name for name in config_reads(type(model)) - HARMLESS_CONFIG - modelled
                 if not _neutral(getattr(cfg, name, None)))
    if odd:
        values = ", ".join(f"config.{name}={getattr(cfg, name, None)!r}" for name in odd)
        raise LoweringError(f"{type(model).__name__}.forward reads {values}: the compiled model's embedding, final "
                            "norm and LM head do not model it")


# a ForCausalLM's own attributes its forward may read: the aux loss's (``aux_loss`` models them)
MODELLED_SELF = frozenset({"router_aux_loss_coef", "num_experts", "num_experts_per_tok", "vocab_size"})


def _check_self_reads(model: nn.Module) -> None:
    """A setting the causal LM's forward reads from itself rather than its config: refused by name
    unless it is neutral, as a config field, or modelled (``logit_scale``, read by ``logit_scale``)."""
    children = dict(model.named_children())
    odd = sorted(name for name in forward_reads(type(model)) - MODELLED_SELF - {"config", LOGIT_SCALE}
                 if name not in children and not callable(getattr(model, name, None))
                 and not _neutral(getattr(model, name, None)))
    if odd:
        values = ", ".join(f"self.{name}={getattr(model, name, None)!r}" for name in odd)
        raise LoweringError(f"{type(model).__name__}.forward reads {values}: the compiled model's embedding, final "
                            "norm and LM head do not model it")


LOGIT_SCALE = "logit_scale"


def logit_scale(model: nn.Module) -> float:
    """The constant a causal LM's forward multiplies its logits by (Cohere2-MoE's
    ``logits = logits * self.logit_scale`` right after ``logits = self.lm_head(...)``), 1.0 when
    it reads no ``self.logit_scale``; read in any other way, or not a finite number, it is refused
    by name (``EdgeHead``)."""
    if LOGIT_SCALE not in forward_reads(type(model)):
        return 1.0
    value = getattr(model, LOGIT_SCALE, None)
    where = f"{type(model).__name__}.forward reads self.{LOGIT_SCALE}={value!r}"
    if not _scales_the_head_logits(type(model)):
        raise LoweringError(f"{where} other than as the LM head's logits times it (logits = self.lm_head(...); "
                            f"logits = logits * self.{LOGIT_SCALE}): the compiled model's final norm and LM head do "
                            "not model it")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LoweringError(f"{where}: the compiled model's LM head multiplies its logits by a finite number only")
    return float(value)


def _forward_tree(cls: type) -> ast.FunctionDef | None:
    """cls.forward's syntax tree (its def), or None when its source cannot be read."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None


SOFTCAP = "final_logit_softcapping"


def logit_softcap(model: nn.Module) -> float | None:
    """The soft cap c a causal LM's forward puts on its logits (Beam's, as Gemma's: ``logits =
    logits / self.config.final_logit_softcapping; logits = torch.tanh(logits); logits = logits *
    self.config.final_logit_softcapping`` after ``logits = self.lm_head(...)``), None when its
    forward reads no such field or the field is None; read in any other way, or not a finite
    number > 0, it is refused by name (``EdgeHead.softcap``)."""
    if SOFTCAP not in config_reads(type(model)):
        return None
    value = getattr(model.config, SOFTCAP, None)
    if value is None:
        return None
    where = f"{type(model).__name__}.forward reads config.{SOFTCAP}={value!r}"
    if not _softcaps_the_head_logits(type(model)):
        raise LoweringError(f"{where} other than as the LM head's logits' soft cap (logits / c, tanh, * c): the "
                            "compiled model's LM head does not model it")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
        raise LoweringError(f"{where}: the compiled model's LM head soft-caps its logits by a finite number > 0 only")
    return float(value)


def _softcaps_the_head_logits(cls: type) -> bool:
    """Whether cls.forward's reads of ``self.config.final_logit_softcapping`` are ``is (not) None``
    tests and one soft cap of the LM head's logits, three statements in a row: ``X = X / c`` (X or
    ``X.float()``), ``X = torch.tanh(X)``, ``X = X * c``, X last assigned from ``self.lm_head(...)``."""
    fn = _forward_tree(cls)
    if fn is None:
        return False

    def is_cap(e) -> bool:
        return (isinstance(e, ast.Attribute) and e.attr == SOFTCAP and isinstance(e.value, ast.Attribute)
                and e.value.attr == "config" and isinstance(e.value.value, ast.Name) and e.value.value.id == "self")

    def assigns(st, x=None):
        ok = isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
        return ok and (x is None or st.targets[0].id == x)

    def operand(e, x) -> bool:                  # X or X.float()
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "float" and not e.args:
            e = e.func.value
        return isinstance(e, ast.Name) and e.id == x

    reads = [e for e in ast.walk(fn) if is_cap(e)]
    tests = sum(isinstance(n, ast.Compare) and is_cap(n.left) and len(n.ops) == 1
                and isinstance(n.ops[0], (ast.Is, ast.IsNot)) for n in ast.walk(fn))
    capped, head_names = 0, set()
    for body in (n.body for n in ast.walk(fn) if isinstance(getattr(n, "body", None), list)):
        for i, st in enumerate(body):
            if assigns(st) and isinstance(st.value, ast.Call) and ast.unparse(st.value.func) == "self.lm_head":
                head_names.add(st.targets[0].id)
            if not (assigns(st) and i + 2 < len(body)):
                continue
            x, a, b, c = st.targets[0].id, st.value, body[i + 1], body[i + 2]
            if (x in head_names and isinstance(a, ast.BinOp) and isinstance(a.op, ast.Div) and operand(a.left, x)
                    and is_cap(a.right) and assigns(b, x) and ast.unparse(b.value) == f"torch.tanh({x})"
                    and assigns(c, x) and isinstance(c.value, ast.BinOp) and isinstance(c.value.op, ast.Mult)
                    and operand(c.value.left, x) and is_cap(c.value.right)):
                capped += 1
    return capped == 1 and len(reads) == tests + 2


def _scales_the_head_logits(cls: type) -> bool:
    """Whether every read of ``self.logit_scale`` in cls.forward (and none in the methods it
    calls) is a statement ``X = X * self.logit_scale`` (either order) whose X the forward last
    assigned from ``self.lm_head(...)``."""
    fn = _forward_tree(cls)
    if fn is None:
        return False

    def is_scale(e) -> bool:
        return (isinstance(e, ast.Attribute) and e.attr == LOGIT_SCALE and isinstance(e.value, ast.Name)
                and e.value.id == "self")

    reads = sum(is_scale(e) for e in ast.walk(fn))
    last: dict[str, ast.expr] = {}                      # name -> the value it was last assigned
    scaled = 0
    for st in fn.body:
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)):
            continue
        x, v = st.targets[0].id, st.value
        if (isinstance(v, ast.BinOp) and isinstance(v.op, ast.Mult)
                and {type(v.left), type(v.right)} == {ast.Name, ast.Attribute}):
            name, attr = (v.left, v.right) if isinstance(v.left, ast.Name) else (v.right, v.left)
            src = last.get(x)
            if (is_scale(attr) and name.id == x and isinstance(src, ast.Call) and isinstance(src.func, ast.Attribute)
                    and src.func.attr == "lm_head" and isinstance(src.func.value, ast.Name)
                    and src.func.value.id == "self"):
                scaled += 1
        last[x] = v
    # the methods the forward calls on self (transitively) must not read it
    todo = [n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self" and n.attr != "forward"]
    seen, elsewhere = set(), False
    while todo and not elsewhere:
        name = todo.pop()
        method = getattr(cls, name, None)
        if name in seen or not callable(method) or isinstance(method, type):
            continue
        seen.add(name)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(method))))
        except (OSError, TypeError, SyntaxError):
            continue
        attrs = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                 and n.value.id == "self"]
        elsewhere = LOGIT_SCALE in attrs
        todo += attrs
    return reads == scaled == 1 and not elsewhere


def _neutral(value) -> bool:
    """A multiplier of 1 (or a setting that is off) changes nothing; True is a switch that is on, not
    a multiplier of 1 (AFMoE's mup_enabled)."""
    return value is None or value is False or \
        (isinstance(value, (int, float)) and not isinstance(value, bool) and value in (0, 1))


def is_base_model(model: nn.Module) -> bool:
    children, names = dict(model.named_children()), names_of(model)
    return (family_of(type(model)) is not None and set(children) == set(base_children(model))
            and isinstance(children[names.embed], nn.Embedding) and isinstance(children[names.layers], nn.ModuleList)
            and classify(children[names.norm]) == "norm")


def is_causal_lm(model: nn.Module) -> bool:
    children, base = dict(model.named_children()), names_of(model).base
    return (family_of(type(model)) is not None and set(children) == {base, "lm_head"}
            and isinstance(children["lm_head"], nn.Linear) and is_base_model(children[base]))


def explain_no_rule(model: nn.Module) -> None:
    """Raise one line naming why a transformers causal LM or base model is not recognised: its first
    decoder layer the structural lowering refuses, or the children its base model has beyond (or
    without) embed_tokens, layers, norm and rotary_emb. Returns for a model of another library."""
    from moegraph.tracer import extract_program
    if family_of(type(model)) is None:
        return
    names = names_of(model)
    base = getattr(model, names.base) if isinstance(getattr(model, names.base, None), nn.Module) else model
    layers = getattr(base, names.layers, None)
    if isinstance(layers, nn.ModuleList):
        for i, layer in enumerate(layers):
            try:
                extract_program(layer)
            except LoweringError as err:
                raise LoweringError(f"{type(model).__name__}: layer {i}: {err}") from None
    children = {name: type(child).__name__ for name, child in base.named_children()}
    extra = {k: v for k, v in children.items() if k not in base_children(base)}
    missing = [k for k in base_children(base) if k not in children]
    parts = ([f"holds {', '.join(f'{k!r} ({v})' for k, v in extra.items())}"] if extra else []) + \
        ([f"has no {', '.join(map(repr, missing))}"] if missing else [])
    raise LoweringError(f"{type(model).__name__}: its base model {type(base).__name__} "
                        f"{' and '.join(parts) or 'differs'}: the structural model rule reads "
                        f"{', '.join(base_children(base)[:3])} and rotary_emb around the decoder layers")


def structural_model_rule(model: nn.Module) -> ModelRule | None:
    """A ModelRule for a transformers causal LM or base model recognised by its children."""
    if is_causal_lm(model):
        base = names_of(model).base
        return ModelRule(type(model), causal_lm, {base: type(getattr(model, base)), "lm_head": nn.Linear})
    if is_base_model(model):
        return ModelRule(type(model), base_model, {name: type(getattr(model, name)) for name in base_children(model)})
    return None


def base_model(model: nn.Module) -> ModelSpec:
    """A family's base model (embed_tokens, layers, norm, rotary_emb): returns the final norm's output.
    Its layers compute RoPE from the config (the attention's RopeSpec comes from the family's rotary
    module built from it), so the model's rotary module must hold those frequencies."""
    cfg, names = model.config, names_of(model)
    _check_config_reads(model)
    embed, layers = getattr(model, names.embed), getattr(model, names.layers)
    check_embedding(embed, names.embed)
    count = layer_count_field(type(model), names.layers)
    if len(layers) != getattr(cfg, count):
        raise LoweringError(f"{names.layers}: {len(layers)} decoder layers but config.{count}={getattr(cfg, count)} "
                            f"(forward runs only the first {count})")
    rotaries = {"rotary_emb": model.rotary_emb} if "rotary_emb" in base_children(model) else {}
    for qn, rotary in rotaries.items():
        check_rotary(rotary, qn)
    if THETA_ROTARIES in base_children(model):
        rotaries.update(_theta_rotaries(model))
    norm = norm_spec(getattr(model, names.norm), names.norm)
    unused = {f"{qn}.{name}": "RoPE frequencies, recomputed from the config by each layer's attention "
              "(check_rotary compared them)" for qn, rotary in rotaries.items() for name, _ in rotary.named_buffers()}
    scale, scale_buffer = embed_scale(embed, names.embed)
    if scale_buffer is not None:
        unused[scale_buffer] = "the embedding's constant scale, read into the model edges (EdgeHead.embed_scale)"
    head = EdgeHead(norm.kind, norm.eps, bias=norm.bias is not None, offset=norm.offset, embed_scale=scale)
    return ModelSpec(embed=f"{names.embed}.weight", padding_idx=embed.padding_idx, layers=names.layers,
                     norm=norm.weight.qualname, norm_bias=norm.bias and norm.bias.qualname, edge_head=head, head=None, output=ModelOutput.HIDDEN, unused=unused)


EMBED_SCALE = "embed_scale"


def embed_scale(embed: nn.Embedding, qualname: str) -> tuple[float, str | None]:
    """(scale, buffer name) of an embedding whose forward multiplies nn.Embedding's rows by a scalar
    buffer ``embed_scale`` (Gemma 4's scaled word embedding: its forward reads only that buffer and
    calls nn.Embedding's); (1.0, None) for nn.Embedding itself. Any other subclass is refused by name."""
    if type(embed) is nn.Embedding:
        return 1.0, None
    where = f"{qualname} ({type(embed).__name__})"
    reads = forward_reads(type(embed)) - {"forward", "weight"}
    buf = embed._buffers.get(EMBED_SCALE)
    if reads != {EMBED_SCALE} or buf is None or buf.numel() != 1:
        raise LoweringError(f"{where}: an embedding whose forward reads {', '.join(sorted(reads)) or 'nothing of its own'} "
                            "is not modelled (nn.Embedding, or its rows times a scalar buffer embed_scale, are)")
    value = float(getattr(embed, "scalar_embed_scale", 1.0)) if buf.is_meta else float(buf)
    if not math.isfinite(value):
        raise LoweringError(f"{where}: embed_scale={value} is not finite")
    return value, f"{qualname}.{EMBED_SCALE}"


@functools.lru_cache(maxsize=None)
def layer_count_field(cls: type, layers: str) -> str:
    """The config field a base model's forward runs that many of its decoder layers by
    (``self.<layers>[: self.config.<field>]``): ``num_hidden_layers`` in most families, LongCat-Flash's
    ``num_layers`` (its num_hidden_layers counts the two attention sublayers of each)."""
    try:
        src = inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return "num_hidden_layers"
    found = set(re.findall(rf"self\.{re.escape(layers)}\[\s*:\s*self\.config\.(\w+)\s*\]", src))
    return found.pop() if len(found) == 1 else "num_hidden_layers"


def _theta_rotaries(model: nn.Module) -> dict[str, nn.Module]:
    """``rotary_embs``: one rotary module per distinct non-zero theta of config.layer_rope_theta, each
    holding the frequencies its config gives (the layers' RopeSpecs are read from that config)."""
    wanted = sorted({float(t) for t in model.config.layer_rope_theta if t})
    rotaries = {f"{THETA_ROTARIES}.{i}": r for i, r in enumerate(getattr(model, THETA_ROTARIES))}
    held = sorted(float((getattr(r, "config", None) and r.config.rope_parameters or {}).get("rope_theta", 0.0))
                  for r in rotaries.values())
    if held != wanted:
        raise LoweringError(f"{THETA_ROTARIES}: rotary modules of theta {held}, not the distinct non-zero "
                            f"config.layer_rope_theta {wanted}")
    for qn, rotary in rotaries.items():
        check_rotary(rotary, qn)
    return rotaries


def check_rotary(rotary: nn.Module, qualname: str) -> None:
    """The model's rotary module holds the frequencies a freshly built one has (what the layers'
    RopeSpecs were read from), in fp32: its ``inv_freq``, or each layer type's ``<type>_inv_freq``
    where config.rope_parameters is keyed by layer type."""
    fresh = type(rotary)(rotary.config)
    params = getattr(rotary.config, "rope_parameters", None)
    nope = {t for t, p in params.items() if p is None} if isinstance(params, dict) else set()   # Beam's NoPE type
    layer_types = set(getattr(rotary.config, "layer_types", None) or ())
    if rotary_frequencies(rotary, None) is None and layer_types and layer_types <= nope:
        return                                              # every layer NoPE: no frequencies to hold
    types = sorted(layer_types - nope) if rotary_frequencies(rotary, None) is None else [None]
    for layer_type in types or [None]:
        here, there = rotary_frequencies(rotary, layer_type), rotary_frequencies(fresh, layer_type)
        name = f"{qualname}.{'inv_freq' if layer_type is None else layer_type + '_inv_freq'}"
        if here is None or there is None:
            held = sorted(n for n, _ in rotary.named_buffers())
            raise LoweringError(f"{qualname} ({type(rotary).__name__}) holds no {name.split('.')[-1]} (its buffers: "
                                f"{', '.join(held) or 'none'}): its RoPE is not modelled")
        _check_frequencies(name, here, there, rotary.config, qualname)


def _check_frequencies(name: str, here: tuple[torch.Tensor, float], there: tuple[torch.Tensor, float], cfg,
                       qualname: str) -> None:
    (inv, scaling), (fresh, fresh_scaling) = here, there
    if inv.dtype != fresh.dtype:
        # model.to(torch.bfloat16) casts the buffer too: eager then rotates with the rounded
        # frequencies, the compiled layers with the config's exact ones
        raise LoweringError(f"{name} is {inv.dtype}, not {fresh.dtype} (a cast such as "
                            "model.to(torch.bfloat16) casts the RoPE buffers too, and eager then rotates with rounded "
                            "frequencies the compiled layers do not use): build the model in that dtype instead "
                            "(from_pretrained(..., dtype=...), or construct it under torch.set_default_dtype), which "
                            f"keeps them {fresh.dtype}, or recompute them after the cast: r.inv_freq = "
                            f"r.compute_default_rope_parameters(r.config)[0] for r the {qualname} module "
                            f"(model.model.{qualname} of a ForCausalLM)")
    if not torch.equal(inv.detach().cpu().float(), fresh.float()):
        raise LoweringError(f"{name} differs from the frequencies its config gives (rope_parameters="
                            f"{cfg.rope_parameters}): the layers would compute other rotations")
    if scaling != fresh_scaling:
        raise LoweringError(f"{name.removesuffix('inv_freq')}attention_scaling={scaling} differs from its config's")


def causal_lm(model: nn.Module) -> ModelSpec:
    """A family's ForCausalLM: ``model`` (its base model) and an ``lm_head`` (tied to the embedding
    or not); the loss is transformers' mean next-token cross-entropy, plus the router's auxiliary
    load-balancing loss where it adds one (``aux_loss``)."""
    _check_config_reads(model)
    _check_self_reads(model)
    names = names_of(model)
    base_module = getattr(model, names.base)
    tied = check_head(model, model.lm_head, getattr(base_module, names.embed), "lm_head")
    base = prefixed(base_model(base_module), f"{names.base}.")
    head = dataclasses.replace(base.edge_head, logit_scale=logit_scale(model), softcap=logit_softcap(model))
    return dataclasses.replace(base, head="lm_head.weight", output=ModelOutput.CAUSAL_LM, aux_loss=aux_loss(model),
                               tied=tied, edge_head=head)


def aux_loss(model: nn.Module) -> AuxLoss | None:
    """The auxiliary load-balancing loss a ForCausalLM adds with config.output_router_logits=True:
    Mixtral, Qwen2-MoE and OLMoE call their module's ``load_balancing_loss_func`` (the same
    function in each: softmax of every layer's router logits, top-k counts, no z-loss; their
    norm_topk_prob renormalises the routing weights only, not this loss) with the model's
    num_experts and num_experts_per_tok, and add router_aux_loss_coef times it when labels are
    given. A family without that function (DeepSeek-V3) never reads the flag: its loss is
    unchanged, as is the base model's output. A zero coefficient still returns the term as
    ``.aux_loss`` (transformers computes it whenever the flag is set; a caller may weight it)."""
    if not getattr(model.config, "output_router_logits", False):
        return None
    if getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None) is None:
        return None
    for attr in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok"):
        if not hasattr(model, attr):
            raise LoweringError(f"{type(model).__name__} has no {attr}: its auxiliary load-balancing loss "
                                "(output_router_logits=True) is not the one modelled; set output_router_logits=False")
    coef = model.router_aux_loss_coef
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise LoweringError(f"{type(model).__name__}.router_aux_loss_coef={coef!r}: only a coefficient >= 0 is "
                            "supported")
    return AuxLoss(float(coef), model.num_experts, model.num_experts_per_tok)


def prefixed(spec: ModelSpec, prefix: str) -> ModelSpec:
    """``spec`` of a submodule, its names as seen from the parent (``prefix`` ends in a dot)."""
    return dataclasses.replace(spec, embed=prefix + spec.embed, layers=prefix + spec.layers, norm=prefix + spec.norm,
                               norm_bias=spec.norm_bias and prefix + spec.norm_bias,
                               head=None if spec.head is None else prefix + spec.head,
                               unused={prefix + k: v for k, v in spec.unused.items()})
