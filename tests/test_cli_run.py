"""The CLI contract end to end: `meshpar train` (default config) and `meshpar inspect --json`."""
import json
import os
import subprocess
import sys

import pytest

from meshpar.cli import main


@pytest.mark.slow
def test_default_train_closes_90_percent_of_the_gap_to_the_entropy_floor(tmp_path):
    out = tmp_path / "m.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "meshpar.cli", "train", "--metrics-out", str(out)],
                          capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    start, steps, end = recs[0], recs[1:-1], recs[-1]
    assert start["event"] == "start" and end["event"] == "end"
    assert sum(s > 1 for s in start["mesh"].values()) >= 3 and start["devices"] == 8
    assert start["strategy"] == "fsdp_tp" and start["entropy_floor"] > 0
    assert all(r["event"] == "step" for r in steps)
    for key in ("step", "loss", "step_time_s", "tokens_per_s", "mfu", "grad_norm", "lr"):
        assert key in steps[-1]
    assert steps[-1]["step"] == end["steps"]
    gap = (steps[0]["loss"] - steps[-1]["loss"]) / (steps[0]["loss"] - start["entropy_floor"])
    assert gap >= 0.9 and end["gap_closed"] == pytest.approx(gap)
    assert "parameter shardings" in proc.stdout and "MFU" in proc.stdout


def test_inspect_json_has_the_contracted_keys(capsys):
    code = main(["inspect", "--json", "precision=fp32", "model.layers=2", "batch.global_size=16", "batch.length=16"])
    assert code == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep) >= {"mesh", "params", "collectives", "memory", "flops"}
    assert rep["mesh"] == {"pipeline": 1, "data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    w = next(p for p in rep["params"] if p["name"] == "layers.ffn.w_in")
    assert w["logical"] == ["layers", "embed", None, "mlp"] and w["spec"] == "-, data+fsdp, -, tensor"
    assert w["bytes_per_device"] * 8 == w["bytes"]
    kinds = rep["collectives"]["summary"]
    assert kinds["all-gather"]["bytes"] > 0 and "tensor" in kinds["all-reduce"]["axes"]
    assert rep["memory"]["argument"] > 0 and rep["memory"]["temp"] > 0
    assert rep["flops"]["xla_per_device"] > 0 and rep["flops"]["model_per_step"] > 0
