"""Settings that would change nothing get one warning line before the run (meshpar/train/noops.py):
a mesh axis the strategy splits nothing over, sequence parallelism on a model that constrains no
residual stream, a precision no matmul of the model uses; and the run's header says which dtypes its
matmuls really run in. No compile: the checks read the loss's traced forward."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

import meshpar
from meshpar.train.metrics import _matmuls
from meshpar.train.step import Trainer
from tests.conftest import devices, make_cfg


class Fixed(nnx.Module):
    """A model that sets its own dtypes (float32) and constrains no activation."""

    def __init__(self, rngs):
        self.w = meshpar.param(rngs, (16, 32), ("embed", "mlp"), std=0.1)

    def __call__(self, x):
        return x.astype(jnp.float32) @ self.w[...].astype(jnp.float32)


def _fixed(*overrides, mesh):
    cfg = make_cfg(*overrides, mesh=mesh)
    return Trainer(
        cfg,
        devices=devices(8),
        model=Fixed,
        loss=lambda m, b: ((m(b) ** 2).mean(), {}),
        batch_spec=meshpar.Leaf((16, 16), np.float32, ("batch", None)),
    )


def _lines(tr, word):
    return [w for w in tr.warnings() if word in w]


def test_a_mesh_axis_the_strategy_leaves_idle_gets_one_line():
    mesh = {"data": 2, "fsdp": 2, "tensor": 2}
    (line,) = _lines(Trainer(make_cfg("strategy=fsdp", mesh=mesh), devices=devices(8)), "splits nothing")
    assert "mesh axis tensor (size 2)" in line and "fsdp_tp" in line and "mesh.tensor=1" in line
    assert not _lines(Trainer(make_cfg("strategy=fsdp_tp", mesh=mesh), devices=devices(8)), "splits nothing")


def test_sequence_parallelism_on_a_model_that_constrains_no_residual_stream_gets_one_line():
    (line,) = _lines(_fixed("strategy=tp_sp", mesh={"data": 2, "tensor": 4}), "compiles the program")
    assert "strategy=tp_sp compiles the program of strategy=tp" in line and "('batch', 'length', 'embed')" in line
    # the reference decoder constrains its residual stream: tp_sp is more than tp there
    tr = Trainer(make_cfg("strategy=tp_sp", mesh={"data": 2, "tensor": 4}), devices=devices(8))
    assert not _lines(tr, "compiles the program")


def test_a_precision_no_matmul_uses_is_said_and_the_header_names_the_dtypes_used():
    tr = _fixed("precision=bf16", "strategy=fsdp_tp", mesh={"data": 2, "fsdp": 2, "tensor": 2})
    (line,) = _lines(tr, "changes nothing")
    assert "precision=bf16 changes nothing here" in line and "float32" in line
    facts = {**tr.describe(), "matmul_dtypes": tr.notices.matmul_dtypes()}  # the run's start record
    assert facts["matmul_dtypes"] == ["float32"] and _matmuls(facts) == " (matmuls in float32)"
    ref = Trainer(make_cfg("precision=bf16", "strategy=fsdp_tp"), devices=devices(8))
    assert not _lines(ref, "changes nothing") and ref.notices.matmul_dtypes() == ["bfloat16"]
    assert _matmuls({**ref.describe(), "matmul_dtypes": ref.notices.matmul_dtypes()}) == ""
