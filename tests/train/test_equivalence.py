"""Every strategy computes the same step as one device: loss, gradients and updated parameters.

Errors are norm-wise, ||a - b|| / ||b||: Adam's first update is ~lr * sign(g), so an element whose
gradient is ~0 can flip sign under a different (equally valid) reduction order; a max-norm would
measure that flip, not the partitioning.
"""

import jax
import pytest

from meshpar.train.batches import Batches
from meshpar.train.data import make_source
from meshpar.train.step import Trainer
from tests.conftest import devices, make_cfg, rel, tiered

CASES = {
    "dp": {"data": 8},
    "zero1": {"data": 8},
    "zero2": {"data": 4, "fsdp": 2},
    "fsdp": {"data": 2, "fsdp": 4},
    "hsdp": {"data": 2, "fsdp": 4},
    "tp": {"data": 2, "tensor": 4},
    "tp_sp": {"data": 2, "tensor": 4},
    "fsdp_tp": {"data": 2, "fsdp": 2, "tensor": 2},
    "fsdp_tp_sp": {"fsdp": 4, "tensor": 2},
}


def one_step(cfg, devs):
    tr = Trainer(cfg, devices=devs)
    state = tr.init()
    batch = next(
        Batches(
            make_source(cfg.data, cfg.batch, cfg.eval, tr.spec.model_config.vocab),
            tr.batch_sharding,
            cfg.batch.global_size,
            cfg.batch.length,
            seed=0,
        )
    )
    (loss, _), grads = jax.jit(tr._grads)(state["params"], batch)
    grads = jax.device_get(grads)
    state, metrics = tr.step(state, batch)
    return float(loss), grads, jax.device_get(state["params"]), jax.device_get(metrics)


@pytest.fixture(scope="module")
def reference():
    return one_step(make_cfg("strategy=dp", mesh={}), devices(1))


@pytest.mark.parametrize("strategy", tiered(sorted(CASES), {"dp", "zero2", "tp_sp", "fsdp_tp"}))
def test_sharded_step_equals_single_device(strategy, reference):
    loss1, grads1, params1, _ = reference
    loss, grads, params, metrics = one_step(make_cfg(f"strategy={strategy}", mesh=CASES[strategy]), devices(8))
    assert abs(loss - loss1) / loss1 <= 1e-5
    assert rel(grads, grads1) <= 1e-5
    assert rel(params, params1) <= 1e-5
    assert abs(float(metrics["loss"]) - loss1) / loss1 <= 1e-5


@pytest.mark.parametrize("strategy", ["fsdp_tp_sp", "dp"])
def test_loss_chunks_equal_the_whole_logits(strategy, reference):
    """train.loss_chunks=4: the head and cross-entropy over four strided token slices, recomputed in the
    backward (vocabulary tiling), give the step of the whole [B, T, V] logits, with the sequence and
    the vocabulary split over `tensor` (fsdp_tp_sp) or not at all (dp, one device's layout)."""
    loss1, grads1, params1, _ = reference
    mesh = CASES[strategy]
    loss, grads, params, metrics = one_step(
        make_cfg(f"strategy={strategy}", "train.loss_chunks=4", mesh=mesh), devices(8)
    )
    assert abs(loss - loss1) / loss1 <= 1e-5
    assert rel(grads, grads1) <= 1e-5
    assert rel(params, params1) <= 1e-5
