"""`moegraph trace`: JSON fields, and one-line exit-2 errors for bad input."""

import json
import subprocess
import sys

import pytest

from moegraph.cli import main


def run_cli(*args):
    proc = subprocess.run([sys.executable, "-m", "moegraph", *args], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def test_trace_json_has_the_documented_fields(capsys):
    assert main(["trace", "--model", "mixtral-8x7b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {k: out["strategy"][k] for k in ("attn", "ffn", "dispatch", "n")} == \
        {"attn": "sp", "ffn": "ep", "dispatch": "ag-rs", "n": 8}
    node = out["nodes"][0]
    assert set(node) >= {"name", "kind", "op", "phase", "flops", "bytes", "comm_bytes", "time_us"}
    assert {n["kind"] for n in out["nodes"]} == {"compute", "comm"}
    assert {n["phase"] for n in out["nodes"]} == {"forward", "backward", "recompute"}  # default passes: sar=paper
    assert set(out["forward_comm_bytes"]) == {"attention", "ffn"}
    assert isinstance(out["activation_bytes"], int) and out["activation_bytes"] > 0


def test_trace_table_prints_totals(capsys):
    assert main(["trace", "--model", "tiny", "--n", "2", "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "forward comm bytes per rank" in out and "activation bytes held for backward" in out


def test_trace_table_header_names_the_strategy_it_traced(capsys):
    assert main(["trace", "--model", "tiny", "--n", "2", "--seq", "64", "--attn", "tp", "--ffn", "tp",
                 "--dp", "2", "--passes", "none"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header == "tiny on h800: attn=tp ffn=tp dispatch=ag-rs n=2 dp=2 dtype=bf16"


@pytest.mark.parametrize("args,message", [
    (["--model", "nope"], "error: unknown model 'nope'; known: deepseek-moe, deepseek-v3, hunyuan-large, internal-352b"),
    (["--hardware", "h999"], "error: unknown hardware 'h999'; known:"),
    (["--n", "3"], "error: n=3 does not divide heads=32"),
    (["--model", "deepseek-moe", "--n", "32", "--attn", "sp"], "error: n=32 does not divide heads=16"),
    (["--model", "mixtral-8x7b", "--n", "16", "--attn", "tp"], "error: n=16 does not divide kv_heads=8"),
    (["--top-k", "9"], "error: --top-k=9 must be between 1 and the expert count 8 of mixtral-8x7b"),
    (["--ffn", "tp", "--dispatch", "a2a"], "error: dispatch='a2a' needs ffn='ep'"),
])
def test_bad_input_exits_2_with_one_line(args, message, capsys):
    assert main(["trace", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_experts_not_divisible(tmp_path, capsys):
    cfg = tmp_path / "odd.yaml"
    cfg.write_text("name: odd\nlayers: 1\nhidden: 64\nheads: 8\nkv_heads: 8\nffn_hidden: 64\nexperts: 6\ntop_k: 2\n")
    assert main(["trace", "--model", str(cfg), "--n", "4", "--seq", "64"]) == 2
    assert "error: n=4 does not divide experts=6" in capsys.readouterr().err


@pytest.mark.slow
def test_malformed_yaml_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    rc, _, err = run_cli("trace", "--model", str(bad))
    assert rc == 2 and "bad.yaml" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.slow
def test_console_entry_and_module_entry_agree():
    rc, out, _ = run_cli("trace", "--model", "tiny", "--n", "2", "--seq", "64", "--json")
    assert rc == 0 and json.loads(out)["model"] == "tiny"
