"""Speed you can see (issue 13): the loop reads device values only at logging/eval steps, batches are
prefetched without changing a bit, held-out evaluation, TensorBoard scalars equal to the JSON Lines,
a profiler trace of exactly the window, and `meshpar plot`.

One instrumented 30-step run of the default tiny config (module fixture) serves the read-count,
eval, TensorBoard, profiler and plot tests.
"""

import gzip
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from meshpar.core.errors import ConfigError, MeshparError
from meshpar.train import loop as loop_lib
from meshpar.train.batches import Batches, Prefetch
from meshpar.train.data import EVAL_STEP, MarkovLanguage, make_eval_source, make_source
from meshpar.train.loop import run
from meshpar.train.step import Trainer
from tests.conftest import devices, evaluator, make_cfg, metrics_losses, metrics_records

REPO = Path(__file__).resolve().parents[2]
STEPS, LOG_EVERY, EVAL_EVERY, PROFILE = 30, 5, 10, (4, 3)


def _instrument(monkeypatch, trainer):
    """Count the steps dispatched and record, for every device->host read of any jax.Array
    (`ArrayImpl._value`: what np.asarray, float, int and jax.device_get all go through), how many
    steps had been dispatched when it happened."""
    from jax._src.array import ArrayImpl

    compiled = trainer.compile()
    steps, reads = {"n": 0}, []

    def counting(state, batch):
        steps["n"] += 1
        return compiled(state, batch)

    monkeypatch.setattr(trainer, "compile", lambda: counting)
    original = ArrayImpl._value

    def value(self):
        reads.append(steps["n"])
        return original.fget(self)

    monkeypatch.setattr(ArrayImpl, "_value", property(value))
    return reads


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    d = tmp_path_factory.mktemp("obs")
    cfg = make_cfg(
        f"steps={STEPS}",
        f"train.log_every={LOG_EVERY}",
        f"eval.every={EVAL_EVERY}",
        "eval.batches=2",
        f"metrics.tensorboard={d / 'tb'}",
        f"profile.dir={d / 'prof'}",
        f"profile.start_step={PROFILE[0]}",
        f"profile.steps={PROFILE[1]}",
        fast=False,
    )
    tr = Trainer(cfg, devices=devices(8))
    with pytest.MonkeyPatch.context() as mp:
        reads = _instrument(mp, tr)
        end = run(cfg, metrics_out=str(d / "run.jsonl"), trainer=tr)
    return {
        "dir": d,
        "cfg": cfg,
        "trainer": tr,
        "reads": reads,
        "end": end,
        "records": metrics_records(d / "run.jsonl"),
    }


def test_device_values_are_read_only_at_logging_and_eval_steps(observed):
    logged = {1} | set(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    evals = set(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    at = sorted(set(observed["reads"]))
    # 0: before the first step (the restored step counter); then only logging and eval steps
    assert set(at) == {0} | logged | evals, at
    assert [r["step"] for r in observed["records"] if r["event"] == "step"] == sorted(logged)


def test_the_start_record_holds_the_peak_mfu_divides_by(observed):
    """On CPU: the host's matmul rate (measured once per machine) over the fake devices, said in the
    start record and used by every step's MFU."""
    start = observed["records"][0]
    peak = start["peak_flops_per_device"]
    assert peak > 0 and start["peak_source"].startswith("host matmul ") and "8 fake devices" in start["peak_source"]
    flops = observed["trainer"].model_flops()[0]
    for rec in [r for r in observed["records"] if r["event"] == "step"]:
        assert rec["mfu"] == pytest.approx(flops / rec["step_time_s"] / (peak * 8), rel=1e-9)


def test_the_host_peak_is_measured_once_per_machine(monkeypatch, tmp_path):
    """Two runs on one machine divide by the same peak: the measurement is kept under the user's
    cache folder, keyed by CPU model, cores and jax version (one measured 19% and 59% MFU before)."""
    from meshpar.train import hostpeak
    from meshpar.train.flops import peak_flops_per_device

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rates = iter([8e11, 1e11])
    monkeypatch.setattr(hostpeak, "measure", lambda *a, **k: next(rates))
    first, second = peak_flops_per_device(), peak_flops_per_device()
    n = jax.local_device_count()
    path = tmp_path / "meshpar" / "host_peak.json"
    assert first == (8e11 / n, f"host matmul 0.8 TFLOP/s / {n} fake devices, measured now, kept in {path}")
    assert second == (8e11 / n, f"host matmul 0.8 TFLOP/s / {n} fake devices, measured once on this machine, {path}")
    assert json.loads(path.read_text())[hostpeak.machine_key()]["flops"] == 8e11
    assert peak_flops_per_device(2.0) == (2e12, "train.peak_tflops")


def test_on_nan_stop_names_the_first_bad_step_and_skip_stops_after_too_many_in_a_row(monkeypatch, tmp_path):
    """lr 1e30: step 2 is the first non-finite step, and every step after it (the parameters are no
    longer finite). Read only at logging steps (1 and 5), the run still stops naming step 2 (after
    logging step 5); with on_nan=skip it finishes, counting the skipped steps, unless
    train.max_consecutive_skips of them come in a row: then it stops naming them (it exited 0 with
    "nan% of the gap closed"), still reading only at logging steps."""
    cfg = make_cfg(
        "precision=fp32", "train.lr=1e30", "train.on_nan=stop", "steps=8", "train.log_every=5", "model.layers=1"
    )
    tr = Trainer(cfg, devices=devices(8))
    reads = _instrument(monkeypatch, tr)
    with pytest.raises(MeshparError, match=r"non-finite loss or gradients at step 2\b.*train.on_nan=stop"):
        run(cfg, metrics_out=str(tmp_path / "m.jsonl"), trainer=tr)
    assert set(reads) == {0, 1, 5} and sorted(metrics_losses(tmp_path / "m.jsonl")) == [1, 5]
    cfg.train.on_nan = "skip"  # read by the loop only: the same compiled step serves
    end = run(cfg, metrics_out=str(tmp_path / "skip.jsonl"), trainer=tr)
    last = [r for r in metrics_records(tmp_path / "skip.jsonl") if r["event"] == "step"][-1]
    assert end["steps"] == 8 and last["skipped_steps"] >= 1
    cfg.train.max_consecutive_skips = 3  # steps 2, 3, 4 in a row
    reads.clear()
    bound = r"^steps 2\.\.4: 3 steps in a row had a non-finite loss or gradients \(the last loss [^)]+\) and were "
    with pytest.raises(MeshparError, match=bound + r"skipped \(train.on_nan=skip, train.max_consecutive_skips=3\)"):
        run(cfg, metrics_out=str(tmp_path / "bound.jsonl"), trainer=tr)
    assert {n - reads[0] for n in reads} == {0, 1, 5}  # steps dispatched in this run when each read came
    assert sorted(metrics_losses(tmp_path / "bound.jsonl")) == [1, 5]


def test_prefetch_gives_the_same_bits_and_resumes_where_training_stopped(monkeypatch, tmp_path):
    cfg = make_cfg("steps=5", "model.layers=1")
    tr = Trainer(cfg, devices=devices(8))
    with_prefetch = run(cfg, metrics_out=str(tmp_path / "a.jsonl"), trainer=tr)
    monkeypatch.setattr(loop_lib, "PREFETCH", 0)
    without = run(cfg, metrics_out=str(tmp_path / "b.jsonl"), trainer=tr)
    a, b = metrics_losses(tmp_path / "a.jsonl"), metrics_losses(tmp_path / "b.jsonl")
    assert sorted(a) == [1, 2, 3, 4, 5] and a == b and with_prefetch["final_loss"] == without["final_loss"]

    # the iterator: state() is what was consumed, not what was built ahead; restore drops the rest
    src = make_source(cfg.data, cfg.batch, cfg.eval, tr.spec.model_config.vocab)
    plain = Batches(src, tr.batch_sharding, cfg.batch.global_size, cfg.batch.length, cfg.data.seed)
    want = [np.asarray(next(plain)) for _ in range(6)]
    it = Prefetch(Batches(src, tr.batch_sharding, cfg.batch.global_size, cfg.batch.length, cfg.data.seed), depth=3)
    got = [np.asarray(next(it)) for _ in range(2)]
    assert it.state() == {"step": 2}
    saved = it.state()
    got.append(np.asarray(next(it)))
    resumed = Prefetch(Batches(src, tr.batch_sharding, cfg.batch.global_size, cfg.batch.length, cfg.data.seed))
    resumed.restore(saved)
    tail = [np.asarray(next(resumed)) for _ in range(4)]
    it.close()
    resumed.close()
    for x, y in zip(got + tail[1:], want[:3] + want[3:6]):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(tail[0], want[2])


def test_prefetch_raises_a_source_error_at_the_step_that_needs_it():
    class Breaks:
        def rows(self, seed, step, rows, length):
            if step == 2:
                raise ConfigError("the source broke at step 2")
            return np.full((len(rows), length + 1), step, np.int32)  # the LM batch: [B, T+1]

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(devices(8)), ("data",))
    it = Prefetch(Batches(Breaks(), NamedSharding(mesh, P("data")), 8, 3, 0))
    assert int(np.asarray(next(it))[0, 0]) == 0 and int(np.asarray(next(it))[0, 0]) == 1
    with pytest.raises(ConfigError, match="broke at step 2"):
        next(it)
    assert it.state() == {"step": 2}


def test_each_row_is_built_once_per_process_whatever_the_local_devices():
    """Batch split 4 ways and replicated 2 ways (8 local devices): one `rows` call per step covering
    every row exactly once."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    lang = MarkovLanguage(vocab=32, branching=3, seed=0)
    calls = []

    class Counting:
        def rows(self, seed, step, rows, length):
            calls.append((step, list(rows)))
            return lang.rows(seed, step, rows, length)

    mesh = jax.sharding.Mesh(np.array(devices(8)).reshape(4, 2), ("data", "tensor"))
    it = Batches(Counting(), NamedSharding(mesh, P("data")), global_size=16, length=8, seed=1)
    first = np.asarray(next(it))
    assert calls == [(0, list(range(16)))]
    np.testing.assert_array_equal(first, lang.rows(1, 0, range(16), 8))


def test_eval_records_every_n_steps_close_to_the_training_loss(observed):
    evals = [r for r in observed["records"] if r["event"] == "eval"]
    assert [r["step"] for r in evals] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    assert all(math.isfinite(r["loss"]) and r["perplexity"] == pytest.approx(math.exp(r["loss"])) for r in evals)
    train = metrics_losses(observed["dir"] / "run.jsonl")
    assert evals[-1]["loss"] == pytest.approx(train[STEPS], rel=0.05), (evals[-1], train[STEPS])
    assert evals[-1]["loss"] < evals[0]["loss"]  # it measures the model, which trained


def test_eval_stream_is_disjoint_from_training(observed, tmp_path):
    cfg, tr = observed["cfg"], observed["trainer"]
    ev = evaluator(cfg, tr)
    held = np.concatenate([np.asarray(b) for b in ev._held_out()])
    vocab, b, t = tr.spec.model_config.vocab, cfg.batch.global_size, cfg.batch.length
    data = Batches(make_source(cfg.data, cfg.batch, cfg.eval, vocab), tr.batch_sharding, b, t, cfg.data.seed)
    trained = np.concatenate([np.asarray(next(data)) for _ in range(STEPS)])
    assert not {r.tobytes() for r in held} & {r.tobytes() for r in trained}
    lang = MarkovLanguage(vocab, cfg.data.branching, cfg.data.seed)
    np.testing.assert_array_equal(held[:b], lang.rows(cfg.data.seed, EVAL_STEP, range(b), t))

    # token data: training windows never reach the held-out tail; eval windows never leave it
    np.arange(2000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    tcfg = make_cfg(
        "data.kind=tokens", f"data.path={tmp_path / 't.bin'}", "data.dtype=uint16", "eval.every=5", "eval.holdout=0.25"
    )
    train_src = make_source(tcfg.data, tcfg.batch, tcfg.eval, 4096)
    eval_src = make_eval_source(tcfg.data, tcfg.batch, tcfg.eval, 4096, train_src)
    for step in range(20):
        t = train_src.rows(0, step, range(16), 16)
        e = eval_src.rows(0, EVAL_STEP + step, range(16), 16)
        assert t.max() < 1500 <= e.min()
    with pytest.raises(ConfigError, match="eval.holdout=0.995 splits data.path"):
        held = make_cfg("data.kind=tokens", f"data.path={tmp_path / 't.bin'}", "eval.every=5", "eval.holdout=0.995")
        make_source(held.data, held.batch, held.eval, 4096)


def test_tensorboard_scalars_equal_the_json_lines(observed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(observed["dir"] / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    steps = [r for r in observed["records"] if r["event"] == "step"]
    evals = [r for r in observed["records"] if r["event"] == "eval"]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s"):
        got = {e.step: e.value for e in acc.Scalars(f"train/{key}")}
        want = {r["step"]: r[key] for r in steps}
        assert got.keys() == want.keys() and all(got[s] == pytest.approx(want[s], rel=1e-6) for s in want), key
    for key in ("loss", "perplexity"):
        got = {e.step: e.value for e in acc.Scalars(f"eval/{key}")}
        assert got == pytest.approx({r["step"]: r[key] for r in evals}, rel=1e-6)
    assert "train/step" not in tags


def test_tensorboard_holds_moe_and_loss_scale_scalars(tmp_path):
    """MoE load/drops per layer and the fp16 loss scale reach TensorBoard like every other number."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from meshpar.train.metrics import MetricsLogger

    log = MetricsLogger(None, 2, tensorboard=str(tmp_path / "tb"))
    log.step(
        {
            "step": 2,
            "loss": 1.5,
            "loss_scale": 32768.0,
            "drop_fraction": [0.01, 0.03],
            "load_max": [0.3, 0.4],
            "tokens_per_s": None,
            "examples_per_s": 3.0,
            "mfu": 0.1,
        }
    )
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert acc.Scalars("train/loss_scale")[0].value == 32768.0
    assert [acc.Scalars(f"train/drop_fraction/{i}")[0].value for i in (0, 1)] == pytest.approx([0.01, 0.03])
    assert "train/tokens_per_s" not in acc.Tags()["scalars"]


def test_profiler_traces_exactly_the_window(observed):
    runs = list((observed["dir"] / "prof" / "plugins" / "profile").iterdir())
    assert len(runs) == 1 and list(runs[0].glob("*.xplane.pb"))  # TensorBoard's profile plugin
    trace = json.load(gzip.open(runs[0] / "perfetto_trace.json.gz"))  # Perfetto
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    traced = sorted({int(e["args"]["step_num"]) for e in events if e.get("name") == "train"})
    assert traced == list(range(PROFILE[0], PROFILE[0] + PROFILE[1]))


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_plot_writes_a_png_of_the_requested_size(observed, tmp_path):
    run_file = observed["dir"] / "run.jsonl"
    other = tmp_path / "other.jsonl"
    other.write_text(run_file.read_text())
    out = tmp_path / "runs.png"
    cmd = [sys.executable, "-m", "meshpar.cli", "plot", str(run_file), str(other), "-o", str(out), "--size", "900x600"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 10_000 and _png_size(out) == (900, 600)
    bad = subprocess.run(
        cmd[:4] + [str(tmp_path / "missing.jsonl")], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "does not exist" in bad.stderr


@pytest.mark.parametrize(
    "override, match",
    [
        ("eval.holdout=1.5", "'eval.holdout' must be between 0 and 1"),
        ("profile.steps=0", "'profile.steps' must be >= 1"),
        ("eval.every=-1", "'eval.every' must be >= 0"),
        ("eval.path=x.bin", "'eval.path' is read for data.kind=tokens or text"),
        ("metrics.tensorbord=d", "did you mean 'metrics.tensorboard'"),
    ],
)
def test_bad_settings_are_one_line(override, match):
    with pytest.raises(ConfigError, match=match):
        make_cfg(override)


def test_resume_names_a_changed_training_split_of_token_data():
    from meshpar.train.loop import _holdout_change

    tokens = ["data.kind=tokens", "data.path=t.bin"]
    saved = {"eval": {"every": 0, "batches": 4, "path": None, "holdout": 0.1}}

    def change(cfg):
        return _holdout_change(saved, cfg.data, cfg.eval)

    assert change(make_cfg(*tokens)) == []
    assert change(make_cfg(*tokens, "eval.every=10", "eval.path=v.bin")) == []  # no split
    changed = change(make_cfg(*tokens, "eval.every=10"))
    assert changed and "eval.holdout=0.1 (checkpoint: None" in changed[0]
    assert change(make_cfg("eval.every=10")) == []  # synthetic: the stream is the same


def test_a_resumed_run_appends_its_metrics_and_plots_as_one_run(tmp_path):
    """A resume appends to --metrics-out (a new start record), warns when the lr schedule changed,
    reports the gap over the whole run, and `meshpar plot` draws one continuous run: log-scale loss,
    each segment's first step out of the throughput, labelled by strategy and mesh."""
    from io import StringIO

    from rich.console import Console

    from meshpar.train.data import floor_gap_closed
    from meshpar.train.plot import draw, read_run

    out, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    run(make_cfg("steps=3", f"checkpoint.dir={ck}"), metrics_out=str(out))
    text = StringIO()
    end = run(make_cfg("steps=5", f"checkpoint.dir={ck}"), metrics_out=str(out), console=Console(file=text, width=300))
    recs = metrics_records(out)
    assert [(r["event"], r.get("step"), r.get("resumed_from")) for r in recs] == [
        ("start", None, None),
        ("step", 1, None),
        ("step", 2, None),
        ("step", 3, None),
        ("end", None, None),
        ("start", None, 3),
        ("step", 4, None),
        ("step", 5, None),
        ("end", None, 3),
    ]
    assert "warning: resuming with a different learning-rate schedule: steps=5 (checkpoint: 3)" in text.getvalue()
    loss = {r["step"]: r["loss"] for r in recs if r["event"] == "step"}
    assert end["initial_loss"] == loss[1] and end["final_loss"] == pytest.approx(loss[5])
    assert end["gap_closed"] > 0
    assert end["gap_closed"] == pytest.approx(floor_gap_closed(loss[1], loss[5], end["entropy_floor"]))
    assert f"done: loss {loss[1]:.4f} -> {loss[5]:.4f}" in text.getvalue()

    whole = read_run(str(out))
    assert [r["step"] for r in whole["steps"]] == [1, 2, 3, 4, 5] and whole["warmup"] == [1, 4]
    # a run that got further than its last checkpoint: the steps it redoes replace the old ones
    lines = out.read_text().splitlines()
    redo = tmp_path / "redo.jsonl"
    redo.write_text(
        "\n".join(
            lines[:5]
            + [
                lines[5].replace('"resumed_from": 3', '"resumed_from": 1'),
                lines[2].replace('"loss": ', '"loss": 1'),
                *lines[6:],
            ]
        )
        + "\n"
    )
    again = read_run(str(redo))
    assert [r["step"] for r in again["steps"]] == [1, 2, 4, 5] and again["steps"][1]["loss"] > 10
    fig = draw([whole])
    loss_ax, rate_ax, _ = fig.axes
    assert loss_ax.get_yscale() == "log"
    assert list(rate_ax.lines[0].get_xdata()) == [2, 3, 5]  # steps 1 and 4 waited for warm-up
    assert "m fsdp_tp (data=2 fsdp=2 tensor=2) train" in [t.get_text() for t in loss_ax.get_legend().get_texts()]


def test_logged_steps_are_lines_that_stay_above_the_bar_and_pipes_do_not_wrap(capsys):
    """On a terminal each logged step prints a line that stays (the bar lives below); in a pipe
    nothing wraps at 80 columns (rich did: `PartitionSpe c`)."""
    import io
    import re

    from rich.console import Console

    from meshpar.core.sharding import render_sharding_table, sharding_table
    from meshpar.train.metrics import MetricsLogger, make_console

    buf = io.StringIO()
    log = MetricsLogger(None, 20, console=Console(file=buf, force_terminal=True, width=100))
    log.start({"strategy": "dp", "mesh_str": "data=8", "devices": 8, "params": 1e6, "precision": "fp32"})
    assert log.progress is not None
    for n in (1, 10, 20):
        log.step(
            {
                "step": n,
                "loss": 2.0 / n,
                "lr": 1e-3,
                "grad_norm": 0.5,
                "tokens_per_s": 1000.0,
                "examples_per_s": 10.0,
                "mfu": 0.1,
            }
        )
    log.end({"steps": 20, "initial_loss": 2.0, "final_loss": 0.1, "wall_s": 1.0})
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", buf.getvalue())
    for n in (1, 10, 20):
        assert text.count(f"step {n:>5}/20 | loss {2.0 / n:.4f} | lr 0.001 | grad norm 0.5 | 1,000 tok/s") == 1
    piped = make_console()  # pytest captures stdout: not a terminal
    tr = Trainer(make_cfg(), devices=devices(8))
    piped.print(render_sharding_table(sharding_table(tr.spec, tr.layout)))
    lines = capsys.readouterr().out.splitlines()
    assert not piped.is_terminal and max(len(ln) for ln in lines) > 80
    assert any("PartitionSpec" in ln for ln in lines) and any("layers.ffn.w_in" in ln for ln in lines)
