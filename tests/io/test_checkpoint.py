"""Checkpoints: exact resume after SIGKILL / SIGTERM, restore onto another mesh and strategy,
damaged checkpoints (fallback, or stop and delete nothing), and runs that do not fit a checkpoint.

The resume tests run `python -m meshpar.cli train` in subprocesses and compare the per-step losses
of their `--metrics-out` JSON Lines with an uninterrupted run, bit for bit.
"""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from meshpar.io.checkpoint import Checkpointer, CheckpointError
from meshpar.train.batches import Batches
from meshpar.train.data import make_source
from meshpar.train.step import Trainer
from tests.conftest import FAST, checkpoint_steps, devices, make_cfg, metrics_losses, metrics_records

REPO = Path(__file__).resolve().parents[2]


def _batches(cfg, tr):
    return Batches(
        make_source(cfg.data, cfg.batch, cfg.eval, tr.spec.model_config.vocab),
        tr.batch_sharding,
        cfg.batch.global_size,
        cfg.batch.length,
        cfg.data.seed,
    )


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """fsdp over 8 devices, fp32: checkpoints at steps 2 and 4, plus what step 5 gives from step 4."""
    d = tmp_path_factory.mktemp("ck") / "fsdp8"
    cfg = make_cfg("strategy=fsdp", "steps=8", f"checkpoint.dir={d}", mesh={"fsdp": 8})
    tr = Trainer(cfg, devices=devices(8))
    ck = Checkpointer(cfg.checkpoint, tr, info=lambda m: None)
    state, data = tr.init(), _batches(cfg, tr)
    states = {}
    for s in (1, 2, 3, 4):
        state, _ = tr.step(state, next(data))
        if s in (2, 4):
            ck.save(s, state, data.state())  # asynchronous; the next step donates `state`
            states[s] = _host(state)
    _, m = tr.step(state, next(data))
    ck.close()
    return {"dir": d, "states": states, "loss5": float(m["loss"]), "batch5": data.step - 1}


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _largest_array_file(step_dir: Path) -> Path:
    files = [f for f in (step_dir / "state").rglob("*") if f.is_file() and "ocdbt.process" in str(f)]
    return max(files, key=lambda f: f.stat().st_size)


def _tree_digest(root: Path) -> dict:
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


@pytest.mark.parametrize("strategy,mesh,n", [("tp", {"tensor": 4}, 4), ("dp", {"data": 2}, 2)])
def test_restore_onto_other_mesh_and_strategy(saved, strategy, mesh, n):
    """Saved with fsdp on 8 devices; restored straight into tp-on-4 / dp-on-2 shardings: every value
    equal, every array already in its target sharding, and the next step's loss as on the old mesh."""
    cfg = make_cfg(f"strategy={strategy}", "steps=8", f"checkpoint.dir={saved['dir']}", mesh=mesh)
    tr = Trainer(cfg, devices=devices(8)[:n])
    found = Checkpointer(cfg.checkpoint, tr, info=lambda m: None).restore_latest()
    assert found.step == 4 and found.data == {"step": 4} and found.damaged == []
    for got, want in zip(jax.tree.leaves(_host(found.state)), jax.tree.leaves(saved["states"][4])):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    for arr, target in zip(jax.tree.leaves(found.state), jax.tree.leaves(tr.state_shardings)):
        assert arr.sharding == target
        assert arr.addressable_shards[0].data.shape == target.shard_shape(arr.shape)  # born sharded
    if strategy == "tp":  # tensor-parallel weights really are split 4 ways, not gathered
        w = found.state["params"]["lm_head"]
        assert w.addressable_shards[0].data.shape[1] == w.shape[1] // 4
    data = _batches(cfg, tr)
    data.restore(found.data)
    _, m = tr.step(found.state, next(data))
    assert float(m["loss"]) == pytest.approx(saved["loss5"], rel=1e-5)


def test_damaged_latest_falls_back_to_previous(saved, tmp_path):
    """Step 4 truncated, as after a full disk: reported by step and path, step 2 restored exactly,
    step 4 moved aside (not deleted) so the run can write step 4 again."""
    d = _copy(saved["dir"], tmp_path / "ck")
    victim = _largest_array_file(d / "4")
    os.truncate(victim, victim.stat().st_size // 2)
    cfg = make_cfg("strategy=fsdp", "steps=8", f"checkpoint.dir={d}", mesh={"fsdp": 8})
    messages = []
    found = Checkpointer(cfg.checkpoint, Trainer(cfg, devices=devices(8)), info=messages.append).restore_latest()
    assert found.step == 2 and found.path == f"{d}/2"
    assert [x["step"] for x in found.damaged] == [4] and found.damaged[0]["path"] == f"{d}/4"
    assert any(f"checkpoint step 4 at {d}/4 is damaged" in m for m in messages)
    for got, want in zip(jax.tree.leaves(_host(found.state)), jax.tree.leaves(saved["states"][2])):
        assert np.array_equal(got, want)
    aside = [p.name for p in d.iterdir() if p.name.startswith("4.damaged-")]
    assert len(aside) == 1 and (d / aside[0] / "state").is_dir() and not (d / "4").exists()


def _rewrite_first_frame(path: Path) -> None:
    """Replace the first zstd frame of an OCDBT data file by a valid frame of the same length and
    decoded size holding other bytes (an RLE block then a raw block): it decodes without error."""
    blob = bytearray(path.read_bytes())
    i = blob.index(b"\x28\xb5\x2f\xfd")  # zstd frame magic (RFC 8878)
    fhd = blob[i + 4]
    single, did, fcs = (fhd >> 5) & 1, fhd & 3, fhd >> 6
    assert single and fcs == 1 and did == 0, f"unexpected zstd frame header {fhd:#x}"
    head, size = 7, int.from_bytes(blob[i + 5 : i + 7], "little") + 256
    end = i + head
    while True:  # walk the blocks to the frame's end
        h = int.from_bytes(blob[end : end + 3], "little")
        end += 3 + (1 if (h >> 1) & 3 == 1 else h >> 3)
        if h & 1:
            break
    raw = end - i - head - 3 - 1 - 3  # raw block bytes that keep the length
    rle = (0 | 1 << 1 | (size - raw) << 3).to_bytes(3, "little") + b"\x3f"
    blob[i + head : end] = rle + (1 | 0 << 1 | raw << 3).to_bytes(3, "little") + bytes(raw)
    path.write_bytes(bytes(blob))


def test_silent_corruption_is_caught_by_fingerprint(saved, tmp_path):
    """An array file whose bytes still decode cleanly to other values (a valid zstd frame of the same
    length) is caught by the saved fingerprint and named as such."""
    d = _copy(saved["dir"], tmp_path / "ck")
    _rewrite_first_frame(_largest_array_file(d / "4"))
    cfg = make_cfg("strategy=fsdp", "steps=8", f"checkpoint.dir={d}", mesh={"fsdp": 8})
    found = Checkpointer(cfg.checkpoint, Trainer(cfg, devices=devices(8)), info=lambda m: None).restore_latest()
    assert found.step == 2 and found.damaged[0]["step"] == 4
    reason = found.damaged[0]["reason"]
    assert reason.startswith("FingerprintMismatch: fingerprint mismatch: contents differ"), reason


def test_damaged_step_that_stays_in_place_is_replaced_by_the_next_save(saved, tmp_path, monkeypatch):
    """If the damaged step 4 cannot be moved aside (a read-only folder, a flaky bucket), it must not
    block the run: the next save of step 4 replaces it, and a restore then finds the new step 4."""
    import etils.epath

    d = _copy(saved["dir"], tmp_path / "ck")
    victim = _largest_array_file(d / "4")
    os.truncate(victim, victim.stat().st_size // 2)
    cfg = make_cfg("strategy=fsdp", "steps=8", f"checkpoint.dir={d}", mesh={"fsdp": 8})
    tr = Trainer(cfg, devices=devices(8))
    messages = []
    ck = Checkpointer(cfg.checkpoint, tr, info=messages.append)

    def refuse(self, target):
        raise PermissionError("read-only")

    monkeypatch.setattr(type(etils.epath.Path(str(d))), "rename", refuse)
    found = ck.restore_latest()
    assert found.step == 2 and (d / "4").exists() and ck.damaged_steps == {4}
    assert any("could not move damaged checkpoint" in m for m in messages)
    monkeypatch.undo()
    data = _batches(cfg, tr)
    data.restore(found.data)
    state = found.state
    for _ in (3, 4):
        state, _ = tr.step(state, next(data))
    want = _host(state)
    ck.save(4, state, data.state(), wait=True)
    ck.close()
    again = Checkpointer(cfg.checkpoint, Trainer(cfg, devices=devices(8)), info=lambda m: None).restore_latest()
    assert again.step == 4 and again.damaged == []
    for got, w in zip(jax.tree.leaves(_host(again.state)), jax.tree.leaves(want)):
        assert np.array_equal(got, w)


def test_remote_checkpoint_paths_keep_their_scheme():
    """`gs://b/r/4` set aside stays on the bucket (pathlib made it the local `gs:/b/r/4`)."""
    from meshpar.io.checkpoint import aside_path, local_or_remote

    root = local_or_remote("gs://b/r")
    assert str(root) == "gs://b/r"
    assert str(aside_path(root / "4", "T")) == "gs://b/r/4.damaged-T"
    assert str(local_or_remote("rel/dir")) == str(Path("rel/dir").absolute())


def test_resume_with_a_different_data_stream_is_said():
    from meshpar.train.loop import data_changes

    saved = {"data": {"seed": 0, "kind": "synthetic", "path": None}, "batch": {"global_size": 16, "length": 16}}
    cfg = make_cfg("batch.global_size=32", "data.seed=1")
    assert data_changes(saved, cfg) == ["data.seed=1 (checkpoint: 0)", "batch.global_size=32 (checkpoint: 16)"]
    assert (
        data_changes(
            {**saved, "data": {**saved["data"], "seed": cfg.data.seed}, "batch": {"global_size": 32, "length": 16}}, cfg
        )
        == []
    )


def test_no_usable_checkpoint_stops_and_deletes_nothing(saved, tmp_path):
    d = _copy(saved["dir"], tmp_path / "ck")
    for step in ("2", "4"):
        (d / step / "state" / "manifest.ocdbt").write_bytes(b"\0" * 16)
    before = _tree_digest(d)
    cfg = make_cfg("strategy=fsdp", "steps=8", f"checkpoint.dir={d}", mesh={"fsdp": 8})
    ck = Checkpointer(cfg.checkpoint, Trainer(cfg, devices=devices(8)), info=lambda m: None)
    with pytest.raises(CheckpointError) as e:
        ck.restore_latest()
    msg = str(e.value)
    assert f"step 4 at {d}/4" in msg and f"step 2 at {d}/2" in msg and "nothing was deleted" in msg
    assert "\n" not in msg
    assert _tree_digest(d) == before


def test_damaged_checkpoints_are_said_in_meshpars_lines_and_nothing_else(saved, tmp_path):
    """`meshpar train` over checkpoints whose array files were cut short: each damaged step in one line,
    then the error in one line on stderr, and nothing more. Orbax's other reads of a failed restore end later,
    each once printed a raw traceback ("Event loop is closed") or ~100 lines of asyncio's "Task exception
    was never retrieved" (`meshpar.io.failures`)."""
    d = _copy(saved["dir"], tmp_path / "ck")
    for step in ("2", "4"):
        os.truncate(_largest_array_file(d / step), 100)
    mesh = [f"mesh.{a}={8 if a == 'fsdp' else 1}" for a in ("data", "fsdp", "tensor", "pipeline", "expert", "context")]
    cmd = [sys.executable, "-m", "meshpar.cli", "train", "--devices", "8", *FAST, *mesh, "strategy=fsdp", "steps=8"]
    r = subprocess.run([*cmd, f"checkpoint.dir={d}"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr[-3000:]
    assert err[0].startswith(f"meshpar: error: no usable checkpoint in {d} (step 4 at {d}/4: Exception: ")
    said = [ln for ln in r.stdout.splitlines() if " is damaged " in ln]
    assert [ln.split(" is damaged ")[0] for ln in said] == [f"checkpoint step {s} at {d}/{s}" for s in (4, 2)]


def test_checkpoint_of_another_model_is_refused(saved):
    """Not damage: a different model is a user error naming the leaf, and nothing is moved."""
    cfg = make_cfg("strategy=fsdp", "model.layers=3", f"checkpoint.dir={saved['dir']}", mesh={"fsdp": 8})
    with pytest.raises(
        CheckpointError, match=r"does not fit this run: state\[.*\] is \[\[2, [^]]*\], 'float32'\] there and \[\[3, "
    ):
        Checkpointer(cfg.checkpoint, Trainer(cfg, devices=devices(8)), info=lambda m: None).restore_latest()
    assert sorted(p.name for p in Path(saved["dir"]).iterdir()) == ["2", "4"]


# ----------------------------------------------------------------------------------------------
# Exact resume of real runs (subprocesses).

STEPS = 60
RUN = [*FAST, f"steps={STEPS}", "train.log_every=1"]


def _launch(tmp: Path, name: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    out = tmp / f"{name}.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    p = subprocess.Popen(
        [sys.executable, "-m", "meshpar.cli", "train", "--metrics-out", str(out), *RUN, *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return p, out


def _wait(proc, cond, what: str, timeout: float = 120.0):
    t0 = time.monotonic()
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"run ended (status {proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.mark.slow
def test_exact_resume_after_sigkill_and_sigterm(tmp_path):
    """reference | killed (SIGKILL) after step >= 5 | resumed, then SIGTERM | resumed to the end:
    every logged loss equals the uninterrupted run's bit for bit, SIGTERM leaves a checkpoint at the
    step it stopped at, and each run starts right after the checkpoint it resumed from."""
    ck = tmp_path / "ck"
    ref, ref_out = _launch(tmp_path, "ref")
    run1, out1 = _launch(tmp_path, "run1", f"checkpoint.dir={ck}", "checkpoint.every=2")
    _wait(
        run1,
        lambda: max(metrics_losses(out1), default=0) >= 5 and any(s >= 4 for s in checkpoint_steps(ck)),
        "step 5 and a complete checkpoint",
    )
    run1.send_signal(signal.SIGKILL)
    run1.wait()
    assert run1.returncode == -signal.SIGKILL

    # logging every 7 steps, so the SIGTERM lands between logged steps
    run2, out2 = _launch(tmp_path, "run2", f"checkpoint.dir={ck}", "checkpoint.every=2", "train.log_every=7")
    _wait(run2, lambda: len(metrics_losses(out2)) >= 2, "two logged steps after resuming")
    run2.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    _, err = run2.communicate(timeout=60)
    assert run2.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert time.monotonic() - t0 < 30
    start2 = next(r for r in metrics_records(out2) if r["event"] == "start")
    end2 = next(r for r in metrics_records(out2) if r["event"] == "end")
    stopped = end2["stopped_at"]
    assert end2["preempted"] == "SIGTERM" and stopped >= max(metrics_losses(out2))
    assert stopped in checkpoint_steps(ck) and f"stopped by SIGTERM after step {stopped}" in err
    assert min(metrics_losses(out2)) == start2["resumed_from"] + 1 and start2["resumed_from"] >= 4

    # the same command again: it resumes and appends to run2's metrics, one file for the whole run
    run3, out3 = _launch(tmp_path, "run2", f"checkpoint.dir={ck}", "checkpoint.every=2")
    _, err = run3.communicate(timeout=300)
    assert run3.returncode == 0, err[-2000:]
    starts = [r for r in metrics_records(out3) if r["event"] == "start"]
    assert [r.get("resumed_from") for r in starts] == [start2["resumed_from"], stopped]
    assert min(metrics_losses(out3)) == start2["resumed_from"] + 1 and max(metrics_losses(out3)) == STEPS
    assert len(checkpoint_steps(ck)) <= 3 and STEPS in checkpoint_steps(ck)  # checkpoint.keep=3

    ref.communicate(timeout=300)
    want = metrics_losses(ref_out)
    assert sorted(want) == list(range(1, STEPS + 1))
    for out in (out1, out3):
        got = metrics_losses(out)
        assert got and all(got[s] == want[s] for s in got), (out.name, {s: (got[s], want[s]) for s in got})
    # the stopped run reports the loss of the step it reached and the whole run's first loss
    assert (end2["initial_loss"], end2["final_loss"]) == (want[1], want[stopped])
    end3 = [r for r in metrics_records(out3) if r["event"] == "end"][-1]
    assert (end3["initial_loss"], end3["final_loss"]) == (want[1], want[STEPS]) and end3["gap_closed"] > 0
