"""Dropout inside `meshpar.stacked` layers (meshpar/nn/dropout.py): keys derived from (step,
microbatch, layer), never carried. A user's block with nnx.Dropout trains and its dropout changes the
loss; pipelined with GPipe and 1F1B it equals one device accumulating the same microbatches; the same
seed gives the same run, another step other masks; evaluation draws nothing; a draw with no key is
refused in one line naming the block.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshpar
from meshpar.core.batch import Leaf
from meshpar.core.errors import ConfigError
from meshpar.nn import dropout
from meshpar.train.evaluate import Evaluator
from tests.conftest import devices, make_cfg, rel

WIDTH, INPUTS, CLASSES, ROWS = 16, 8, 4, 16
normal, zeros = nnx.initializers.normal(0.3), nnx.initializers.zeros


def linear(a, b, names, rngs):
    return nnx.Linear(
        a,
        b,
        kernel_init=nnx.with_partitioning(normal, names),
        bias_init=nnx.with_partitioning(zeros, names[1:]),
        rngs=rngs,
    )


class Block(nnx.Module):
    """x [b, E] -> [b, E]; one Dropout called twice (two draws per layer call)."""

    def __init__(self, rate: float, rngs: nnx.Rngs):
        self.up = linear(WIDTH, 2 * WIDTH, ("embed", "mlp"), rngs)
        self.down = linear(2 * WIDTH, WIDTH, ("mlp", "embed"), rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.down(self.drop(nnx.gelu(self.up(x)))))


class Net(nnx.Module):
    """The stage protocol: pre {"x" [b, I]} -> [b, E]; 2 stacked Blocks; post -> logits [b, K]."""

    def __init__(self, rate: float, rngs: nnx.Rngs):
        self.embed = linear(INPUTS, WIDTH, (None, "embed"), rngs)
        self.layers = meshpar.stacked(lambda r: Block(rate, r), 2, rngs)
        self.head = linear(WIDTH, CLASSES, ("embed", None), rngs)

    def pre(self, batch):
        return self.embed(batch["x"])

    def post(self, x):
        return self.head(x)

    def loss(self, logits, batch):
        import optax

        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


SPEC = {"x": Leaf((ROWS, INPUTS), jnp.float32, ("batch", None)), "y": Leaf((ROWS,), jnp.int32, ("batch",))}


def _batches(steps: int):
    k = jax.random.key(3)
    return [
        {
            "x": jax.random.normal(jax.random.fold_in(k, 2 * s), (ROWS, INPUTS)),
            "y": jax.random.randint(jax.random.fold_in(k, 2 * s + 1), (ROWS,), 0, CLASSES),
        }
        for s in range(steps)
    ]


def _trainer(rate: float, mesh: dict, *extra):
    cfg = make_cfg("train.loss=stages", f"batch.global_size={ROWS}", "train.lr=0.01", *extra, mesh=mesh)
    n = int(np.prod(list(mesh.values()))) if mesh else 1
    return meshpar.Trainer(
        cfg, devices=devices(n), model=lambda rngs: Net(rate, rngs), loss=meshpar.stage_loss, batch_spec=SPEC
    )


def _run(tr, steps: int = 3):
    """`steps` steps from init -> (losses, params, the last state before its step)."""
    state, losses = tr.init(), []
    for b in _batches(steps):
        before = jax.tree.map(jnp.copy, state)  # the step donates its state
        state, m = tr.step(state, jax.device_put(b, tr.batch_sharding))
        losses.append(float(m["loss"]))
    return losses, jax.device_get(state["params"]), before


@pytest.fixture(scope="module")
def one_device():
    """One device accumulating 4 microbatches with dropout 0.5: (trainer, losses, params, a state)."""
    tr = _trainer(0.5, {}, "batch.microbatches=4", "strategy=dp")
    return (tr, *_run(tr))


@pytest.fixture(scope="module")
def no_dropout():
    """The same with dropout 0 (the same initial parameters)."""
    return _trainer(0.0, {}, "batch.microbatches=4", "strategy=dp")


def test_dropout_in_stacked_layers_trains_and_changes_the_loss(one_device, no_dropout):
    tr, losses, _, _ = one_device
    off, _, _ = _run(no_dropout)
    assert all(np.isfinite(losses)) and abs(losses[0] - off[0]) > 1e-3, (losses, off)
    assert not jax.tree.leaves(tr.spec.var_shapes), "the stacked layers' streams should not be carried state"
    assert tr.model_flops()[0] > 0  # the loop's MFU traces the loss as the step does


def test_same_seed_same_run_and_each_step_draws_new_masks(one_device):
    tr, losses, params, state = one_device
    again, params2, _ = _run(tr)
    assert again == losses and jax.tree.all(jax.tree.map(np.array_equal, params2, params))
    batch = jax.device_put(_batches(3)[2], tr.batch_sharding)
    copy = lambda s: jax.tree.map(jnp.copy, s)  # noqa: E731
    here = float(tr.step(copy(state), batch)[1]["loss"])
    later = float(tr.step({**copy(state), "step": state["step"] + 1}, batch)[1]["loss"])
    assert here == losses[2] and later != here


@pytest.mark.parametrize(
    "schedule,extra",
    [("gpipe", ["pipeline.microbatches=4"]), ("1f1b", ["pipeline.microbatches=2", "batch.microbatches=2"])],
)
def test_pipelined_dropout_equals_one_device_accumulating_the_same_microbatches(one_device, schedule, extra):
    """pipeline=2 x data=2: 4 pipeline microbatches (GPipe), or 2 accumulation steps of 2 (1F1B, the
    microbatch a + 2 i), equal 1 device accumulating the same 4 microbatches, masks and all."""
    _, want_l, want_p, _ = one_device
    got_l, got_p, _ = _run(
        _trainer(0.5, {"pipeline": 2, "data": 2}, "strategy=dp", f"pipeline.schedule={schedule}", *extra)
    )
    assert rel(got_l, want_l) <= 1e-5 and rel(got_p, want_p) <= 1e-5, (got_l, want_l)


def test_zero1_accumulation_draws_the_one_device_masks(one_device):
    """ZeRO-1 accumulates per replica under a vmap (meshpar.train.step), where every replica would draw
    one mask for its rows: a model whose stacked layers draw takes the per-microbatch path instead."""
    _, want_l, want_p, _ = one_device
    got_l, got_p, _ = _run(_trainer(0.5, {"data": 2}, "strategy=zero1", "batch.microbatches=4"))
    assert rel(got_l, want_l) <= 1e-5 and rel(got_p, want_p) <= 1e-5, (got_l, want_l)


def test_evaluation_draws_no_dropout_and_a_draw_without_a_key_is_refused(one_device, no_dropout):
    """The evaluator puts the model in eval mode: the loss of the dropout-0 model on the same parameters."""
    tr, off, state = one_device[0], no_dropout, one_device[3]
    batch = jax.device_put(_batches(1)[0], tr.batch_sharding)
    on_eval = Evaluator(tr, None, tr.cfg.eval, tr.cfg.batch, 0)._step(state["params"], state["vars"], batch)[0]
    off_eval = Evaluator(off, None, off.cfg.eval, off.cfg.batch, 0)._step(state["params"], state["vars"], batch)[0]
    assert float(on_eval) == pytest.approx(float(off_eval), rel=1e-6)
    model = tr.spec.merge(state["params"], state["vars"])
    with pytest.raises(
        ConfigError,
        match=r"^Block \(in meshpar.stacked\) draws its 'dropout' RNG stream outside a "
        r"train step .* call model.eval\(\)",
    ):
        meshpar.stage_loss(model, batch)


def test_keys_depend_on_the_layer_and_the_draw_and_a_stage_offset_names_the_same_layer():
    """Layer 1 of a stack equals layer 0 of the stack a pipeline stage starting at layer 1 runs."""

    class Probe(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.zeros(()))
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return x, {"a": self.drop(jnp.ones(64)), "b": self.drop(jnp.ones(64))}

    stack = meshpar.stacked(Probe, 2, nnx.Rngs(0))
    with dropout.training(0, jnp.int32(5)):
        _, aux = meshpar.scan_layers(stack, jnp.zeros(()), None, "none")
        with dropout.at(0, 1, jnp.zeros((1,))):  # chunk 1 of 1-layer chunks
            _, aux1 = meshpar.scan_layers(stack, jnp.zeros(()), None, "none")
    a, b = np.asarray(aux["a"]), np.asarray(aux["b"])
    assert not np.array_equal(a[0], a[1]) and not np.array_equal(a[0], b[0])
    assert np.array_equal(np.asarray(aux1["a"])[0], a[1])
