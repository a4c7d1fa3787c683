"""fp16 dynamic loss scaling and non-finite steps (Micikevicius et al. 2018, "Mixed Precision Training").

Properties: an overflow skips the update (params and optimizer state bitwise unchanged), halves the
scale and is counted; 2000 finite steps double it; a non-finite loss under bf16/fp32 is skipped
(`train.on_nan=skip`) or stops the loop naming the step (`stop`) without writing a checkpoint after
it; and fp16 trains the default tiny model as well as bf16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshpar.core.errors import MeshparError
from meshpar.train.batches import Batches
from meshpar.train.data import make_source
from meshpar.train.loop import run
from meshpar.train.optimizer import lr_schedule
from meshpar.train.step import Trainer
from tests.conftest import devices, make_cfg


def _setup(*overrides):
    cfg = make_cfg(*overrides)
    tr = Trainer(cfg, devices=devices(8))
    return tr, lambda: Batches(
        make_source(cfg.data, cfg.batch, cfg.eval, tr.spec.model_config.vocab),
        tr.batch_sharding,
        cfg.batch.global_size,
        cfg.batch.length,
        cfg.data.seed,
    )


@pytest.fixture(scope="module")
def fp16():
    return _setup("precision=fp16")


@pytest.fixture(scope="module")
def fp32():
    return _setup("precision=fp32")  # train.on_nan acts in the loop, not in the compiled step


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _with_numerics(tr, state, **values):
    """The state with some loss-scale numerics replaced (placed like the originals)."""
    num = dict(state["numerics"])
    for k, v in values.items():
        num[k] = jax.device_put(jnp.asarray(v, num[k].dtype), tr.state_shardings["numerics"][k])
    return {**state, "numerics": num}


def _bitwise_equal(a, b) -> bool:
    """Bit for bit (NaN payloads included), leaf by leaf."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in zip(la, lb))


def test_fp16_overflow_skips_step_halves_scale_keeps_params(fp16):
    tr, batches = fp16
    state, data = tr.init(), batches()
    assert float(state["numerics"]["loss_scale"]) == 2.0**15
    # Inject an overflow the way it happens in practice: a scale so large that the float16 backward
    # pass overflows (the fp32 loss * 2^100 is still finite).
    state = _with_numerics(tr, state, loss_scale=2.0**100)
    before = _host({"params": state["params"], "opt": state["opt"]})
    state, m = tr.step(state, next(data))
    after = _host({"params": state["params"], "opt": state["opt"]})
    assert np.isfinite(float(m["loss"])) and not np.isfinite(float(m["grad_norm"]))
    assert _bitwise_equal(before, after), "an overflowing step changed params or optimizer state"
    num = _host(state["numerics"])
    assert num["loss_scale"] == 2.0**99 and num["overflows"] == 1 and num["skipped_steps"] == 1
    assert int(state["step"]) == 1 and int(m["nonfinite"]) == 0  # an overflow is not an on_nan event
    assert float(m["loss_scale"]) == 2.0**100 and int(m["overflows"]) == 1
    assert float(m["lr"]) == 0.0, "a skipped step applies no learning rate"

    # Back at a sane scale the next step applies and counts towards growth. The rate it logs is the
    # one optax applied: the first update's (its count did not move), not step 2's.
    state = _with_numerics(tr, state, loss_scale=2.0**15)
    state, m = tr.step(state, next(data))
    assert np.isfinite(float(m["grad_norm"]))
    assert float(m["lr"]) == pytest.approx(float(lr_schedule(tr.cfg.train, tr.cfg.steps)(0)), rel=1e-6)
    assert float(lr_schedule(tr.cfg.train, tr.cfg.steps)(0)) != pytest.approx(
        float(lr_schedule(tr.cfg.train, tr.cfg.steps)(1))
    )
    assert not _bitwise_equal(after["params"], _host(state["params"]))
    num = _host(state["numerics"])
    assert num["good_steps"] == 1 and num["skipped_steps"] == 1 and num["loss_scale"] == 2.0**15

    # The 2000th finite step in a row doubles the scale and restarts the count.
    state = _with_numerics(tr, state, good_steps=1999)
    state, _ = tr.step(state, next(data))
    num = _host(state["numerics"])
    assert num["loss_scale"] == 2.0**16 and num["good_steps"] == 0


def test_fp16_gradients_match_fp32_scale_is_removed(fp16, fp32):
    """Loss scaling changes nothing but the float16 range: grad norm and loss match fp32 closely
    (the scale is divided out; without it they would be off by 2^15)."""
    (tr16, b16), (tr32, b32) = fp16, fp32
    _, m16 = tr16.step(tr16.init(), next(b16()))
    _, m32 = tr32.step(tr32.init(), next(b32()))
    assert float(m16["grad_norm"]) == pytest.approx(float(m32["grad_norm"]), rel=2e-2)
    assert float(m16["loss"]) == pytest.approx(float(m32["loss"]), rel=1e-2)


def test_nonfinite_loss_is_skipped_under_fp32(fp32):
    tr, batches = fp32
    state, data = tr.init(), batches()
    poisoned = dict(state["params"])
    poisoned["lm_head"] = poisoned["lm_head"] * jnp.nan
    state = {**state, "params": poisoned}
    before = _host({"params": state["params"], "opt": state["opt"]})
    state, m = tr.step(state, next(data))
    assert not np.isfinite(float(m["loss"])) and int(m["nonfinite"]) == 1
    assert _bitwise_equal(before, _host({"params": state["params"], "opt": state["opt"]}))
    assert int(state["numerics"]["skipped_steps"]) == 1 and float(state["numerics"]["loss_scale"]) == 1.0


def test_on_nan_stop_names_step_and_writes_no_checkpoint_after_it(tmp_path):
    """A diverging run (lr 1e30 blows the weights up after one update, so step 2's loss is not
    finite) stops with an error naming step 2; the checkpoint of step 1 is the last one."""
    d = tmp_path / "ck"
    cfg = make_cfg(
        "precision=fp32",
        "train.lr=1e30",
        "train.on_nan=stop",
        "steps=4",
        f"checkpoint.dir={d}",
        "checkpoint.every=1",
        "model.layers=1",
    )
    with pytest.raises(MeshparError, match=r"non-finite loss or gradients at step 2\b.*train.on_nan=stop"):
        run(cfg, metrics_out=str(tmp_path / "m.jsonl"))
    assert sorted(p.name for p in d.iterdir()) == ["1"]


@pytest.mark.slow
def test_fp16_trains_like_bf16():
    """The default tiny config, 40 steps: fp16 (loss-scaled) ends within a few percent of bf16."""
    finals = {}
    for prec in ("bf16", "fp16"):
        cfg = make_cfg(f"precision={prec}", "steps=40", "train.log_every=40", fast=False)
        tr = Trainer(cfg, devices=devices(8))
        data = Batches(
            make_source(cfg.data, cfg.batch, cfg.eval, tr.spec.model_config.vocab),
            tr.batch_sharding,
            cfg.batch.global_size,
            cfg.batch.length,
            cfg.data.seed,
        )
        state, losses = tr.init(), []
        for _ in range(cfg.steps):
            state, m = tr.step(state, next(data))
            losses.append(m["loss"])
        finals[prec] = float(np.mean(jax.device_get(losses[-5:])))
        if prec == "fp16":
            assert int(state["numerics"]["skipped_steps"]) == 0 and float(state["numerics"]["loss_scale"]) == 2.0**15
    print(f"final loss (mean of the last 5 of 40 steps): {finals}")
    assert finals["fp16"] == pytest.approx(finals["bf16"], rel=0.03), finals
    assert finals["bf16"] < 3.0  # it did train (initial loss ~ ln 128 = 4.85)
