"""A user's code meets meshpar's contracts (the framework's layering: tests/test_layout.py): bad user
code as one clear line, the README's script as written, and a
user's encoder-decoder (examples/reverse.py): its data source's batch spec checked before compiling,
batch axes the rules do not cover, its FLOPs counted from its own loss, export saying what it lacks.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import meshpar
from meshpar.cli import main

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


# -- bad input: one line naming it -------------------------------------------------------------

USER_MODULE = """
import jax.numpy as jnp
import numpy as np
from flax import nnx
import meshpar

def not_a_module(cfg, rngs):
    return {"w": jnp.zeros(3)}

def vector_loss(model, tokens):
    return jnp.ones(tokens.shape[0]), {}

class BadSource:
    def batch_spec(self, global_size, length):
        return {"x": meshpar.Leaf((global_size, 4), np.float32, ("batch", None)), "y": (global_size,)}
    def rows(self, seed, step, rows, length):
        return {"x": np.zeros((len(rows), 4), np.float32), "y": np.zeros(len(rows), np.int32)}

def bad_source(cfg):
    return BadSource()
"""


@pytest.mark.parametrize(
    "args,message",
    [
        (["model.name=no_such_pkg.mod:factory"], "config key 'model.name': cannot import module 'no_such_pkg.mod'"),
        (["model.name=usermod_bad:factory"], "config key 'model.name': module 'usermod_bad' has no 'factory'"),
        (["model.name=usermod_bad:not_a_module"], "the model factory returned dict, not an nnx.Module"),
        (
            ["train.loss=usermod_bad:vector_loss"],
            "loss function vector_loss returned a loss of shape (16,); it must be a scalar",
        ),
        (["data.kind=usermod_bad:bad_source"], "batch leaf ['y']"),
    ],
)
def test_bad_user_code_is_one_clear_line(capsys, monkeypatch, tmp_path, args, message):
    (tmp_path / "usermod_bad.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["inspect", "batch.global_size=16", "batch.length=8", "model.layers=1", *args])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert message in err and ("no declared logical axes" in err or "batch leaf" not in message), err
    assert err.startswith("meshpar: error: ") and err.count("\n") == 1


@pytest.mark.slow
def test_readme_script_runs_as_written(tmp_path):
    """The README's "Writing a model" script, extracted verbatim and run with this interpreter."""
    text = (REPO / "README.md").read_text()
    start = text.index("```python\nimport os; os.environ")
    script = text[start + len("```python\n") : text.index("```", start + 10)]
    assert len(script.splitlines()) <= 40
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "step    30/30" in run.stdout and "ppl" in run.stdout


# -- an encoder-decoder of the user's (examples/reverse.py): the data contract, batch axes, FLOPs ---

from examples import reverse as reverse_example  # noqa: E402

SOURCES = """
import numpy as np
from examples.reverse import Reversals

class OffByOne(Reversals):            # the old convention: ask for batch.length + 1
    def rows(self, seed, step, rows, length):
        return super().rows(seed, step, rows, length + 1)

class NoTarget(Reversals):
    def rows(self, seed, step, rows, length):
        out = super().rows(seed, step, rows, length)
        del out["tgt_out"]
        return out

class FloatSource(Reversals):
    def rows(self, seed, step, rows, length):
        return {**super().rows(seed, step, rows, length), "src": np.zeros((len(rows), length), np.float32)}

def off_by_one(cfg): return OffByOne(12)
def no_target(cfg): return NoTarget(12)
def float_source(cfg): return FloatSource(12)
"""


@pytest.mark.parametrize(
    "name,message",
    [
        (
            "off_by_one",
            "batch leaf ['src']: the data source's rows(rows=1, length=8) returned shape (1, 9), its "
            "batch_spec declares (1, 8)",
        ),
        (
            "no_target",
            "the data source's rows() returned ['src', 'tgt_in']; its batch_spec declares ['src', 'tgt_in', 'tgt_out']",
        ),
        (
            "float_source",
            "batch leaf ['src']: the data source's rows() returned float32, its batch_spec declares int32",
        ),
    ],
)
def test_a_source_that_breaks_its_batch_spec_is_one_line_before_compiling(capsys, monkeypatch, tmp_path, name, message):
    (tmp_path / "usersrc.py").write_text(SOURCES)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["train", "--config", str(REPO / "examples" / "reverse.yaml"), f"data.kind=usersrc:{name}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"meshpar: error: {message}") and err.count("\n") == 1, err[-2000:]


@pytest.mark.slow
def test_the_encoder_decoder_trains_from_a_source_that_uses_its_length_and_counts_its_flops(tmp_path):
    """rows() gets batch.length (the spec's length, 8): the model trains; its model FLOPs (3 x the
    forward's matmuls, not 6N per example) are within 0.5-1.5x of the compiled step's summed over
    the devices, and the training log's MFU uses the same count."""
    from meshpar.plan.inspect import report
    from tests.conftest import metrics_records

    cfg = meshpar.load_config(
        REPO / "examples" / "reverse.yaml", ["steps=30", "train.log_every=10", "train.peak_tflops=1"]
    )
    src = reverse_example.source(cfg)
    tr = meshpar.Trainer(
        cfg,
        model=lambda rngs: reverse_example.reverser(cfg, rngs),
        loss=reverse_example.loss,
        batch_spec=src.batch_spec(cfg.batch.global_size, cfg.batch.length),
    )
    flops = report(cfg, tr)["flops"]
    ratio = flops["model_per_step"] / (flops["xla_per_device"] * 8)
    assert 0.5 <= ratio <= 1.5 and flops["model_counted_as"] == "3 x the loss's forward matmuls", flops
    meshpar.run(cfg, metrics_out=str(tmp_path / "m.jsonl"), trainer=tr, source=src)
    steps = [r for r in metrics_records(tmp_path / "m.jsonl") if r["event"] == "step"]
    assert steps[-1]["loss"] < 0.95 * steps[0]["loss"]
    for rec in steps:  # MFU = model FLOPs per step / step time / (1 TFLOP/s x 8 devices)
        assert rec["mfu"] == pytest.approx(flops["model_per_step"] / rec["step_time_s"] / 8e12, rel=1e-9)
    declared = meshpar.load_config(REPO / "examples" / "reverse.yaml", ["train.flops_per_example=1e6"])
    tr = meshpar.Trainer(
        declared,
        model=lambda rngs: reverse_example.reverser(declared, rngs),
        loss=reverse_example.loss,
        batch_spec=src.batch_spec(declared.batch.global_size, declared.batch.length),
    )
    assert tr.model_flops() == (1e6 * 32, "train.flops_per_example")


def test_a_batch_axis_no_rule_covers_is_a_note_a_warning_with_a_suggestion_or_an_error(capsys):
    cfg = meshpar.load_config(REPO / "examples" / "reverse.yaml")
    leaf = meshpar.Leaf((32, 8), np.int32, ("batch", "lenght"))
    spec = {"src": leaf, "tgt_in": leaf, "tgt_out": meshpar.Leaf((32, 8), np.int32, ("batch", "length"))}
    tr = meshpar.Trainer(
        cfg, model=lambda rngs: reverse_example.reverser(cfg, rngs), loss=reverse_example.loss, batch_spec=spec
    )
    rows = {r["name"]: r for r in tr.sharding_table() if r["kind"] == "batch"}
    assert rows["batch.src"]["note"] == "no rule for 'lenght'" and rows["batch.tgt_out"]["note"] == ""
    assert (
        rows["batch.src"]["spec"] == "data+fsdp"
        and rows["batch.src"]["bytes_per_device"] * 4 == rows["batch.src"]["bytes"]
    )
    warning = (
        "warning: batch leaf 'src' names axis 'lenght', which no rule maps (did you mean 'length'?): that "
        "dimension is not split; fix the name or add a rule"
    )
    assert warning in tr.warnings() and sum("lenght" in w for w in tr.warnings()) == 2
    strict = meshpar.load_config(REPO / "examples" / "reverse.yaml", ["train.require_annotations=true"])
    with pytest.raises(meshpar.ShardingError, match=r"batch leaf 'src' names axis 'lenght'.*require_annotations"):
        meshpar.Trainer(
            strict,
            model=lambda rngs: reverse_example.reverser(strict, rngs),
            loss=reverse_example.loss,
            batch_spec=spec,
        )


def test_context_parallelism_that_splits_no_batch_leaf_is_one_warning():
    """mesh.context=2 with a user's batch that names no `length`: nothing is split over `context` and
    both context devices do the same work; one warning line names the leaves and the rules. A batch
    naming `length`, and the built-in LM loss (which splits its token rows itself), do not warn."""
    from flax import nnx

    from tests.conftest import devices, make_cfg

    class Regressor(nnx.Module):
        def __init__(self, rngs):
            self.proj = meshpar.param(rngs, (4, 4), ("embed", "mlp"), 0.1)

        def __call__(self, x):
            return x @ self.proj[...]

    def loss(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean(), {}

    cfg = make_cfg(mesh={"data": 4, "context": 2})
    leaves = lambda axes: {k: meshpar.Leaf((8, 16, 4), np.float32, axes) for k in ("x", "y")}  # noqa: E731
    trainer = lambda axes: meshpar.Trainer(
        cfg,
        devices=devices(8),
        model=Regressor,
        loss=loss,  # noqa: E731
        batch_spec=leaves(axes),
    )
    warning = (
        "warning: mesh.context=2 splits no batch leaf: 'x' ('batch', None, None), 'y' ('batch', None, None) "
        "name no axis the rules put on `context` (length -> context, seq -> context), so the 2 context devices "
        "repeat the same work; name the sequence dimension 'length' (meshpar.Leaf(shape, dtype, ('batch', "
        "'length', ...))) or set mesh.context=1"
    )
    lines = trainer(("batch", None, None)).warnings()
    assert warning in lines and sum("mesh.context" in w for w in lines) == 1, lines
    assert not [w for w in trainer(("batch", "length", None)).warnings() if "mesh.context" in w]
    assert not [w for w in meshpar.Trainer(cfg, devices=devices(8)).warnings() if "mesh.context" in w]


def test_export_of_a_model_without_the_hugging_face_protocol_says_what_it_lacks(capsys, tmp_path):
    code = main(["export", "--out", str(tmp_path / "hf"), "--config", str(REPO / "examples" / "vision.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and err == (
        "meshpar: error: model Mixer cannot be exported to Hugging Face format: it needs "
        "hf_tensors() and hf_config() (see meshpar.io.hf; meshpar.models.decoder implements "
        "them)\n"
    )
