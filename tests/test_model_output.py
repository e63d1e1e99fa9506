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
