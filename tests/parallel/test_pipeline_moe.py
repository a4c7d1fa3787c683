"""Pipelines of MoE models: MoE blocks with expert parallelism inside each stage (their losses feed
1F1B's explicit vjp; dropless experts) equal the plain model. (Every pipeline x MoE combination
trains or stops with one line: test_pipeline_combinations.py; a user's model through the stage
protocol: test_stages.py.)
"""

import jax
import numpy as np
import pytest

from meshpar.train.step import Trainer
from tests.conftest import devices, make_cfg, rel
from tests.parallel.pipelines import TINY


@pytest.mark.slow
def test_pipelined_moe_with_expert_parallelism_equals_the_plain_moe():
    """MoE blocks return their weighted losses under aux "loss": 1F1B must feed those cotangents
    through its explicit per-stage vjp; per-layer metrics come back stacked [layers]."""
    mesh = {"pipeline": 2, "expert": 2, "tensor": 2}
    cfg = make_cfg(
        *TINY, "model.layers=4", "model.name=moe", "pipeline.schedule=1f1b", "pipeline.microbatches=4", mesh=mesh
    )
    ref = make_cfg(*TINY, "model.layers=4", "model.name=moe", "strategy=dp", mesh={})
    tr0 = Trainer(ref, devices=devices(1))
    params = jax.device_get(tr0.init()["params"])
    tokens = np.asarray(jax.random.randint(jax.random.key(7), tr0.batch_shape, 0, 64))
    (loss0, aux0), grads0 = jax.jit(tr0._grads)(params, tokens)
    tr = Trainer(cfg, devices=devices(8))
    (loss, aux), grads = jax.jit(tr._grads)(
        jax.device_put(params, tr.param_shardings), jax.device_put(tokens, tr.batch_sharding)
    )
    assert abs(float(loss) - float(loss0)) / float(loss0) <= 1e-5
    assert float(loss) > float(aux["ce"])  # the MoE losses are part of the loss
    assert rel(grads, jax.device_get(grads0)) <= 1e-5
    assert set(aux) == set(aux0)
    # metrics are averaged over microbatches, as gradient accumulation does: exact for the means
    # (the losses, drop fraction); per-microbatch maxima/minima of the expert load are not batch maxima
    for k in ("aux_loss", "z_loss", "drop_fraction"):
        np.testing.assert_allclose(np.asarray(aux[k]), np.asarray(aux0[k]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_dropless_moe_equals_the_plain_model(schedule):
    """GPipe (or 1F1B, whose per-device branches route replicated) over 2 stages with dropless experts
    split over `expert` inside each stage: loss and gradients equal the unpipelined model on one
    device (fp32)."""
    extra = [
        *TINY,
        "model.name=moe",
        "model.layers=4",
        "moe.capacity_factor=null",
        "pipeline.microbatches=2",
        f"pipeline.schedule={schedule}",
    ]
    tr0 = Trainer(make_cfg(*extra, "strategy=dp", mesh={}), devices=devices(1))
    params = jax.device_get(tr0.init()["params"])
    tokens = np.asarray(jax.random.randint(jax.random.key(7), tr0.batch_shape, 0, 64))
    (loss0, _), grads0 = jax.jit(tr0._grads)(params, tokens)
    tr = Trainer(make_cfg(*extra, mesh={"pipeline": 2, "expert": 2, "tensor": 2}), devices=devices(8))
    (loss, _), grads = jax.jit(tr._grads)(
        jax.device_put(params, tr.param_shardings), jax.device_put(tokens, tr.batch_sharding)
    )
    assert abs(float(loss) - float(loss0)) / float(loss0) <= 1e-5
    assert rel(jax.device_get(grads), jax.device_get(grads0)) <= 1e-5
