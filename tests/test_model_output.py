"""The compiled model's call and its output as transformers' (HF Trainer reads ``outputs["loss"]`` or
``outputs[0]``): ModelResult's ModelOutput access against the eager module's output for the same
calls (with aux loss and without, a base model), and the argument refusals that come before any
use of input_ids."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import model_workers as workers
import moegraph
from moegraph.runtime.check import rel_err

TOL = 1e-5
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed")


def _ids():
    return torch.randint(0, workers.VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def mixtral():
    model = workers.mixtral_model(5, 2)
    return model, moegraph.compile(model, _ids(), hardware="cpu-gloo", schedule="greedy", passes="")


def test_input_ids_none_is_refused_by_the_model_own_argument_check(mixtral):
    """input_ids=None with inputs_embeds once raised a bare AttributeError (the autocast check read
    input_ids.device before the arguments were checked)."""
    _, compiled = mixtral
    with pytest.raises(ValueError, match=r"^argument\(s\) inputs_embeds are not supported by the compiled model") as err:
        compiled(None, inputs_embeds=torch.randn(2, 16, 32))
    assert "\n" not in str(err.value)
    with pytest.raises(TypeError, match=r"^input_ids is NoneType: the compiled model takes token ids \[b, s\]$"):
        compiled(None)


def _same_access(got, ref, keys):
    """got (ModelResult) answers every ModelOutput access as ref (transformers' output) does."""
    assert list(got.keys()) == list(ref.keys()) == keys
    assert list(got) == list(ref) and len(got) == len(ref)
    for k in keys:
        assert k in got and rel_err(got[k], ref[k]) < TOL and got[k] is getattr(got, k)
        assert rel_err(got.get(k), ref.get(k)) < TOL
    for i in range(len(keys)):
        assert rel_err(got[i], ref[i]) < TOL
    assert len(got.to_tuple()) == len(ref.to_tuple()) == len(keys)
    assert all(rel_err(a, b) < TOL for a, b in zip(got.to_tuple(), ref.to_tuple()))
    assert all(rel_err(a, b) < TOL for a, b in zip(got[:2], ref[:2]))
    assert [k for k, _ in got.items()] == [k for k, _ in ref.items()]
    with pytest.raises(IndexError):
        got[len(keys)]
    assert "past_key_values" not in got and got.get("hidden_states") is None
    with pytest.raises(KeyError):
        got["hidden_states"]
    with pytest.raises(KeyError):
        ref["hidden_states"]


def test_causal_lm_output_reads_as_transformers(mixtral):
    model, compiled = mixtral
    ids = _ids()
    with torch.no_grad():
        ref, got = model(ids, labels=ids, use_cache=False), compiled(ids, labels=ids)
        _same_access(got, ref, ["loss", "logits"])
        ref, got = model(ids, use_cache=False), compiled(ids)       # no labels: no loss, logits first
        _same_access(got, ref, ["logits"])
    # HF Trainer's compute_loss: outputs["loss"] if a dict else outputs[0]; backward through it
    compiled(ids, labels=ids)["loss"].backward()
    model(ids, labels=ids)[0].backward()
    full = compiled.full_grads()
    assert max(rel_err(full[k], p.grad) for k, p in model.named_parameters()) < TOL


def test_aux_loss_and_base_model_outputs_read_as_transformers():
    model = workers.mixtral_model(7, 2, output_router_logits=True, router_aux_loss_coef=0.02)
    ids = _ids()
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", schedule="greedy", passes="")
    with torch.no_grad():
        ref, got = model(ids, labels=ids, use_cache=False), compiled(ids, labels=ids)
    # transformers' order: loss, aux_loss, logits (its router_logits, which the compiled model does not
    # return, come last)
    assert list(ref.keys()) == ["loss", "aux_loss", "logits", "router_logits"]
    assert list(got.keys()) == ["loss", "aux_loss", "logits"]
    for i, k in enumerate(got.keys()):
        assert rel_err(got[i], ref[i]) < TOL and rel_err(got[k], ref[k]) < TOL
    with pytest.raises(KeyError, match="does not return router_logits"):
        got["router_logits"]
    base = model.model
    compiled = moegraph.compile(base, ids, hardware="cpu-gloo", schedule="greedy", passes="")
    with torch.no_grad():
        ref, got = base(input_ids=ids, use_cache=False, output_router_logits=False), compiled(ids)
    _same_access(got, ref, ["last_hidden_state"])
