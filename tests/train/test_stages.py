"""The stage protocol (meshpar/nn/stages.py): a user's model with its own loss and non-Param state
(examples/vit.py: BatchNorm stem, dropout) pipelined with GPipe and 1F1B equals one device
accumulating the same microbatches; what the protocol cannot express is refused in one line, and so
is a part that breaks it, pipelined or not. (Pytree activations and gathering losses, pipelined:
tests/parallel/test_pipeline_user_stages.py.)
"""

import jax
import numpy as np
import pytest

from meshpar.cli import main
from meshpar.core.errors import ConfigError
from meshpar.train.step import Trainer
from tests.conftest import devices, make_cfg, rel, stacked_stages, tiered, train_steps
from tests.parallel.pipelines import TINY

# -- a user's model with its own loss: the stage protocol (meshpar.nn.stages) ----------------------


def _vit(mesh: dict, n: int, *extra, steps: int = 3):
    """examples/vit.py (BatchNorm stem and dropout in `pre`, its own loss) for `steps` steps ->
    (losses, params, non-Param state)."""
    import sys
    from pathlib import Path

    import meshpar

    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo))
    from examples import vision, vit

    cfg = meshpar.load_config(
        repo / "examples" / "vit.yaml",
        [
            "precision=fp32",
            "train.warmup_steps=1",
            "batch.global_size=16",
            *[f"mesh.{a}={mesh.get(a, 1)}" for a in ("data", "fsdp", "tensor", "pipeline", "expert")],
            *extra,
        ],
    )
    src = vision.source(cfg)
    tr = Trainer(
        cfg,
        devices=devices(n),
        model=lambda rngs: vit.vit(cfg, rngs),
        loss=meshpar.stage_loss,
        batch_spec=src.batch_spec(cfg.batch.global_size, cfg.batch.length),
    )
    state, losses = train_steps(tr, src, cfg, steps)
    return losses, jax.device_get(state["params"]), jax.device_get(state["vars"])


_VIT: dict = {}


@pytest.mark.parametrize("schedule", tiered(["gpipe", "1f1b"], {"gpipe"}))
def test_a_user_model_with_its_own_loss_and_a_batchnorm_stem_pipelines_like_one_device(schedule):
    """pipeline=2 x data=2 x tensor=2, 4 microbatches == 1 device accumulating the same 4 microbatches
    (BatchNorm normalises each microbatch either way), after 3 steps: losses, parameters and the
    BatchNorm running statistics (relative <= 1e-5), the dropout RNG stream exactly."""
    if "ref" not in _VIT:
        _VIT["ref"] = _vit({}, 1, "batch.microbatches=4")
    want_l, want_p, want_v = _VIT["ref"]
    got_l, got_p, got_v = _vit(
        {"pipeline": 2, "data": 2, "tensor": 2}, 8, f"pipeline.schedule={schedule}", "pipeline.microbatches=4"
    )
    assert rel(got_l, want_l) <= 1e-5 and rel(got_p, want_p) <= 1e-5, (got_l, want_l)
    stats = lambda v: {k: v["stem"][k] for k in ("mean", "var")}
    assert rel(stats(got_v), stats(want_v)) <= 1e-5
    assert not np.allclose(want_v["stem"]["mean"], 0.0)  # the statistics trained
    assert jax.tree.all(jax.tree.map(np.array_equal, got_v["drop"], want_v["drop"]))  # the RNG stream


def test_pipelining_refuses_what_the_stage_protocol_cannot_express_in_one_line():
    """A loss that is neither lm nor stages; a model without post; state inside the stacked layers."""
    cfg = make_cfg(*TINY, "model.layers=2", mesh={"pipeline": 2})
    with pytest.raises(ConfigError, match=r"cuts the loss into stages: train.loss=lm .* or train.loss=stages"):
        Trainer(cfg, devices=devices(2), loss=lambda model, tokens: (0.0, {}))
    from meshpar.nn.stages import stage_loss

    with pytest.raises(
        ConfigError,
        match=r"model Decoder cannot be pipelined: train.loss=stages needs .* it lacks "
        r"\.pre, \.post, \.loss",
    ):
        Trainer(cfg, devices=devices(2), loss=stage_loss)

    from flax import nnx

    # BatchNorm inside the repeated layers: state that would travel
    Counting = stacked_stages(lambda r: nnx.BatchNorm(4, rngs=r), 2, "Counting")
    with pytest.raises(ConfigError, match=r"the stacked layers hold non-Param state \(layers\.(mean|var)"):
        Trainer(cfg, devices=devices(2), model=lambda rngs: Counting(rngs), loss=stage_loss)

    # its own depth: the message names its stack, not model.layers
    Three = stacked_stages(lambda r: nnx.Linear(4, 4, rngs=r), 3, "Three")
    with pytest.raises(
        ConfigError,
        match=r"^Three\.layers stacks 3 blocks, which is not divisible by mesh\.pipeline=2 "
        r"x pipeline\.virtual_stages=1 \(= 2 chunks\); use a multiple of 2 stacked "
        r"layers$",
    ):
        Trainer(cfg, devices=devices(2), model=lambda rngs: Three(rngs), loss=stage_loss)
    # a reference model sized by model.size (model.layers unset) names model.size
    with pytest.raises(
        ConfigError,
        match=r"^model\.size=tiny stacks 2 blocks, which is not divisible by "
        r"mesh\.pipeline=4",
    ):
        Trainer(make_cfg(*TINY, mesh={"pipeline": 4}, fast=False), devices=devices(4))


STAGE_MODULE = """
import jax.numpy as jnp
import numpy as np
from flax import nnx
import meshpar

class Block(nnx.Module):
    def __init__(self, rngs, out):
        self.w = meshpar.param(rngs, (8, out), ("embed", "mlp"), 0.1)
    def __call__(self, x):
        return jnp.tanh((x["x"] if isinstance(x, dict) else x) @ self.w[...])

class Staged(nnx.Module):
    def __init__(self, rngs, width=8, bare=False, pre=lambda x: x):
        self.layers = meshpar.stacked(lambda r: Block(r, width), 2, rngs)
        self.bare, self.wrap = bare, pre
    def pre(self, batch):
        return self.wrap(batch["x"])
    def post(self, x):
        return x
    def loss(self, out, batch):
        mse = ((out - batch["y"]) ** 2).mean()
        return mse if self.bare else (mse, {})

def widening(cfg, rngs): return Staged(rngs, width=16)
def bare_loss(cfg, rngs): return Staged(rngs, bare=True)
def text_pre(cfg, rngs): return Staged(rngs, pre=lambda x: {"x": x, "name": "x"})
def dict_pre(cfg, rngs): return Staged(rngs, pre=lambda x: {"x": x})

class Source:
    def batch_spec(self, global_size, length):
        leaf = meshpar.Leaf((global_size, 4, 8), np.float32, ("batch", None, None))
        return {"x": leaf, "y": leaf}
    def rows(self, seed, step, rows, length):
        return {k: np.zeros((len(rows), 4, 8), np.float32) for k in ("x", "y")}

def source(cfg): return Source()
"""

MISUSE = {
    "bare_loss": "loss function Staged.loss must return (loss, metrics_dict), got a bare array of shape (); "
    "return (loss, {}) for a loss without metrics",
    "widening": "meshpar.stacked layer Block maps the activation float32[{b},4,8] to float32[{b},4,16]; the "
    "stacked layers must keep their input's shapes and dtypes",
    "text_pre": "Staged.pre returned a non-array at ['name']: str; it must return the activation the stacked "
    "layers take, an array or any pytree",
    "dict_pre": "meshpar.stacked layer Block returned float32[{b},4,8] for the activation "
    "{['x']: float32[{b},4,8]}; a stacked layer returns its input's structure, or (it, aux dict)",
}


@pytest.mark.parametrize("pipelined", [False, True], ids=["one-piece", "pipelined"])
@pytest.mark.parametrize("factory", list(MISUSE))
def test_a_part_that_breaks_the_stage_protocol_is_one_line(capsys, monkeypatch, tmp_path, factory, pipelined):
    """A bare scalar loss, a layer that widens the activation, a non-array in pre's output, a layer
    that returns another structure: exit 2 and one line (a ConfigError) before compiling, where they
    were a TypeError, a scan carry mismatch and an AttributeError deep in the pipeline."""
    (tmp_path / "stagemod.py").write_text(STAGE_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    mesh = ["mesh.pipeline=2", "mesh.fsdp=1", "pipeline.microbatches=4"] if pipelined else []
    code = main(
        [
            "inspect",
            f"model.name=stagemod:{factory}",
            "train.loss=stages",
            "data.kind=stagemod:source",
            "batch.global_size=16",
            "model.layers=2",
            *mesh,
        ]
    )
    err = capsys.readouterr().err
    message = MISUSE[factory].replace("{b}", "4" if pipelined else "16")
    assert code == 2 and err.startswith(f"meshpar: error: {message}") and err.count("\n") == 1, err[-3000:]
