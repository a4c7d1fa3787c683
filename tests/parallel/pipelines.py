"""Shared by the pipeline tests: a tiny decoder, its pipelined config, and the single-device
(non-pipelined) loss and gradients every schedule must reproduce (norm-wise, see test_equivalence.py)."""

import jax
import numpy as np

from meshpar.train.step import Trainer
from tests.conftest import devices, make_cfg, rel

TINY = [
    "model.embed=32",
    "model.mlp=64",
    "model.heads=4",
    "model.kv_heads=2",
    "model.head_dim=8",
    "model.vocab=64",
    "batch.global_size=16",
    "batch.length=8",
]


def pp_cfg(schedule, p, m, v=1, layers=4, mesh=None, *extra):
    return make_cfg(
        *TINY,
        f"model.layers={layers}",
        f"pipeline.schedule={schedule}",
        f"pipeline.microbatches={m}",
        f"pipeline.virtual_stages={v}",
        *extra,
        mesh=mesh or {"pipeline": p},
    )


_REF: dict = {}


def reference(layers: int):
    """Params, a batch, and the single-device (non-pipelined) loss and gradients for `layers`."""
    if layers not in _REF:
        cfg = make_cfg(*TINY, f"model.layers={layers}", "strategy=dp", mesh={})
        tr = Trainer(cfg, devices=devices(1))
        params = jax.device_get(tr.init()["params"])
        tokens = np.asarray(jax.random.randint(jax.random.key(7), tr.batch_shape, 0, 64))
        (loss, aux), grads = jax.jit(tr._grads)(params, tokens)
        _REF[layers] = (params, tokens, float(loss), jax.device_get(grads))
    return _REF[layers]


def pipelined(cfg, n):
    tr = Trainer(cfg, devices=devices(n))
    params, tokens, _, _ = reference(tr.spec.model_config.layers)
    params = jax.device_put(params, tr.param_shardings)
    tokens = jax.device_put(tokens, tr.batch_sharding)
    (loss, aux), grads = jax.jit(tr._grads)(params, tokens)
    return float(loss), aux, jax.device_get(grads)


def check_equal(cfg, n):
    _, _, loss0, grads0 = reference(cfg.model.layers)
    loss, aux, grads = pipelined(cfg, n)
    assert jax.tree.structure(grads) == jax.tree.structure(grads0)
    assert abs(loss - loss0) / loss0 <= 1e-5
    assert abs(float(aux["ce"]) - loss0) / loss0 <= 1e-5
    assert rel(grads, grads0) <= 1e-5


# (schedule, P, M, v, layers): every schedule, P in {2, 4}, M in {P, 2P, 4P}
