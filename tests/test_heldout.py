"""benchmarks/heldout.py keeps held-out configurations outside the calibration set."""

import importlib.util
import sys
from pathlib import Path

import pytest

from moegraph.runtime.calibrate.steps import CALIBRATION_LAYERS, LayerConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def heldout():
    spec = importlib.util.spec_from_file_location("heldout_bench", ROOT / "benchmarks" / "heldout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_calibration_set_is_the_documented_one():
    doc = (ROOT / "docs" / "calibration.md").read_text()
    for layer in CALIBRATION_LAYERS:
        assert f"`{layer}`" in doc, f"{layer} missing from docs/calibration.md"


def test_every_calibration_layer_is_refused_also_under_another_name_or_module(heldout, tmp_path):
    for layer in CALIBRATION_LAYERS:
        for impl in ("reference", "hf-mixtral"):
            with pytest.raises(heldout.UsageError, match="in-sample"):
                heldout.check_held_out(heldout.Config(layer, impl))
    # a YAML copy of `small` under another name is still the calibration's layer
    copy = tmp_path / "renamed.yaml"
    copy.write_text("name: renamed\nlayers: 2\nhidden: 512\nheads: 8\nkv_heads: 4\nffn_hidden: 1024\n"
                    "experts: 8\ntop_k: 2\n")
    with pytest.raises(heldout.UsageError, match="calibration layer small s=512"):
        heldout.check_held_out(heldout.Config(LayerConfig(str(copy), 512, "sp", "ep", "ag-rs")))


def test_presets_are_held_out_and_cover_what_issue_13_asks(heldout):
    presets = list(heldout.HELD_OUT.values())
    for c in presets:
        heldout.check_held_out(c)                                     # raises if in-sample
    seen = {(c.layer.model, c.layer.seq, c.layer.attn, c.layer.ffn, c.layer.dispatch, c.layer.chunks, c.layer.attn_nodes)
            for c in presets}
    calib_models = {layer.model for layer in CALIBRATION_LAYERS}
    assert any(c.layer.model.endswith(".yaml") and heldout.sizes(c.layer.model) != heldout.sizes("small")
               for c in presets)                                        # a model size never seen
    assert any(c.layer.seq not in {layer.seq for layer in CALIBRATION_LAYERS} for c in presets)
    assert any((c.layer.attn, c.layer.ffn, c.layer.dispatch) not in
               {(layer.attn, layer.ffn, layer.dispatch) for layer in CALIBRATION_LAYERS} for c in presets)
    assert any(c.implementation == "hf-mixtral" for c in presets)
    assert any(c.layer.chunks > 1 for c in presets)                          # a chunked layer (item 4)
    assert any(c.layer.attn_nodes > 1 and c.layer.batch % c.layer.attn_nodes == 0 for c in presets)   # folded attention
    assert len(seen) == len(presets) and calib_models == {"small"}


@pytest.mark.parametrize("argv,message", [
    (["--configs", "small:512:sp/ep/ag-rs"], "is the calibration layer small s=512 sp/ep/ag-rs"),
    (["--configs", "mid,small:384:tp/tp/ag-rs"], "is the calibration layer small s=384 tp/tp/ag-rs"),
    (["--configs", "small:0:sp/ep/a2a"], "sequence length '0'"),
    (["--configs", "small:512:sp/xx/a2a"], "'xx' in 'small:512:sp/xx/a2a' is not one of tp, ep"),
    (["--configs", "bogus"], "'bogus' is not one of mid,"),
    (["--configs", "nosuch:512:sp/ep/a2a"], "unknown model 'nosuch'"),
    (["--steps", "0"], "'0' is not a positive integer"),
    (["--link", "1gb"], "'1gb' is not a link rate"),
    (["--hardware", "nosuch"], "unknown hardware 'nosuch'"),
])
def test_bad_values_are_one_line_and_exit_2(heldout, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        heldout.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1, err
