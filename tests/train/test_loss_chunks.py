"""Vocabulary tiling (`train.loss_chunks`): the LM head and cross-entropy over strided token slices,
recomputed in the backward, equal the whole logits' loss and gradients, in the plain step (see
test_equivalence.py for the sharded one) and in a pipeline's last stage; what a model lacks, or a
config that cannot slice, is one line."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from meshpar.core.errors import ConfigError
from meshpar.core.precision import chunked_cross_entropy, cross_entropy
from meshpar.train.loss import lm_loss
from tests.parallel.pipelines import check_equal, pp_cfg


def test_slices_give_the_whole_logits_loss_and_gradients_with_weights():
    k = jax.random.split(jax.random.key(0), 4)
    x, w = jax.random.normal(k[0], (2, 16, 8)), jax.random.normal(k[1], (8, 50))
    targets = jax.random.randint(k[2], (2, 16), 0, 50)
    weights = (jax.random.uniform(k[3], (2, 16)) > 0.3).astype(jnp.float32)
    whole = jax.value_and_grad(lambda x, w: cross_entropy(x @ w, targets, weights), (0, 1))(x, w)
    for n in (2, 4, 16):
        sliced = jax.value_and_grad(
            lambda x, w, n=n: chunked_cross_entropy(lambda z: z @ w, x, targets, weights, n), (0, 1)
        )(x, w)
        assert float(jnp.abs(sliced[0] - whole[0])) <= 1e-6
        assert all(float(jnp.max(jnp.abs(a - b))) <= 1e-6 for a, b in zip(sliced[1], whole[1]))


def test_the_cross_entropy_backward_is_autodiffs_written_in_the_logits_dtype():
    """`cross_entropy`'s own backward (softmax - onehot from the saved log-sum-exp, one pass) equals
    autodiff of the fp32 log-softmax, with and without weights, and returns bf16 logits a bf16 gradient."""

    def autodiff(z, targets, weights):  # the formula, differentiated by JAX
        z = z.astype(jnp.float32)
        nll = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, targets[..., None], -1)[..., 0]
        w = jnp.ones(targets.shape) if weights is None else weights
        return jnp.sum(w * nll) / jnp.maximum(jnp.sum(w), 1.0)

    k = jax.random.split(jax.random.key(1), 3)
    z = 4 * jax.random.normal(k[0], (2, 16, 50))
    targets = jax.random.randint(k[1], (2, 16), 0, 50)
    for weights in (None, (jax.random.uniform(k[2], (2, 16)) > 0.3).astype(jnp.float32)):
        got = jax.value_and_grad(cross_entropy)(z, targets, weights)
        want = jax.value_and_grad(autodiff)(z, targets, weights)
        assert float(jnp.abs(got[0] - want[0])) <= 1e-5 and float(jnp.max(jnp.abs(got[1] - want[1]))) <= 1e-6
        if weights is not None:  # a token of weight 0 gets no gradient
            assert float(jnp.max(jnp.abs(got[1] * (1 - weights)[..., None]))) == 0.0
        g16 = jax.grad(cross_entropy)(z.astype(jnp.bfloat16), targets, weights)
        assert g16.dtype == jnp.bfloat16
        want16 = jax.grad(autodiff)(z.astype(jnp.bfloat16), targets, weights)
        assert float(jnp.max(jnp.abs(g16.astype(jnp.float32) - want16.astype(jnp.float32)))) <= 2e-3


def test_the_backward_recomputes_a_slice_instead_of_storing_the_logits():
    """The scan saves no [B, T / n, V] slice of logits for its backward: its residuals are the inputs."""
    x, w = jnp.ones((2, 16, 8)), jnp.ones((8, 1000))
    targets = jnp.zeros((2, 16), jnp.int32)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: chunked_cross_entropy(lambda z: z @ w, x, targets, None, 4)))(x))
    assert "f32[4,2,4,1000]" not in jaxpr and "f32[2,16,1000]" not in jaxpr


def test_a_pipeline_last_stage_slices_its_loss_too():
    check_equal(pp_cfg("1f1b", 2, 2, 1, 4, None, "train.loss_chunks=4"), 2)


def test_a_model_without_features_and_head_is_one_line():
    class Plain(nnx.Module):
        def __call__(self, tokens):
            return jnp.zeros(tokens.shape + (8,))

    with pytest.raises(
        ConfigError,
        match=r"train.loss_chunks > 1 .* model Plain has no .features or .head; .* "
        r"or set train.loss_chunks=1",
    ):
        lm_loss(Plain(), jnp.zeros((1, 9), jnp.int32), chunks=4)


def test_a_glu_projects_the_same_fused_or_split():
    """`meshpar.gated_inputs`: one GEMM into [B, T, 2, F] (GPU, CPU) or two into [B, T, F] (TPU, where
    libtpu packs the smaller buffers better) give the same gate and up projections."""
    from meshpar.core.platform import compiling_for
    from meshpar.nn.layers import gated_inputs

    k = jax.random.split(jax.random.key(1), 2)
    x, w = jax.random.normal(k[0], (2, 8, 16)), jax.random.normal(k[1], (16, 2, 32))
    fused = gated_inputs(x, w)
    assert "f32[2,8,2,32]" in str(jax.make_jaxpr(lambda *a: gated_inputs(*a))(x, w))  # one [B, T, 2, F] product
    with compiling_for("tpu"):
        split = gated_inputs(x, w)
        assert "f32[2,8,2,32]" not in str(
            jax.make_jaxpr(lambda *a: gated_inputs(*a))(x, w)
        )  # two [B, T, F] (traced anew)
    for a, b, i in zip(fused, split, (0, 1)):
        assert a.shape == (2, 8, 32) and float(jnp.max(jnp.abs(a - b))) <= 1e-5
        assert float(jnp.max(jnp.abs(a - x @ w[:, i]))) <= 1e-4


def test_the_planner_counts_one_slice_of_logits_and_the_head_once_more():
    """`meshpar plan` under train.loss_chunks=4: a quarter of the logits held, the head's forward run
    again (2 V E FLOPs per token), the rest of the step unchanged."""
    from meshpar.core.config import load_config
    from meshpar.plan.hardware import load_hardware
    from meshpar.plan.search import estimate

    base = [
        "model.size=125m",
        "batch.length=1024",
        "batch.global_size=8",
        "strategy=fsdp",
        "mesh.data=1",
        "mesh.fsdp=8",
        "mesh.tensor=1",
        "precision=bf16",
    ]
    out = {}
    for n in (1, 4):
        cfg = load_config(None, base + [f"train.loss_chunks={n}"])
        cfg.devices = 8
        out[n] = estimate(cfg, load_hardware("h100"))
    from meshpar.plan.costmodel import ModelFacts

    facts = ModelFacts.from_config(cfg)
    v, e = facts.dims["vocab"], facts.dims["embed"]
    tokens = 8 * 1024 / 8
    held = out[1]["memory"]["activations"] - out[4]["memory"]["activations"]
    assert held == pytest.approx(0.75 * 2 * tokens * v, rel=1e-6)  # one bf16 [b s, V] buffer, 3/4 of it gone
    assert out[4]["time"]["flops"] - out[1]["time"]["flops"] == pytest.approx(2 * v * e * tokens, rel=1e-6)


def test_a_trainer_given_a_loss_slices_the_built_in_one_and_refuses_any_other():
    """Trainer(cfg, loss=lm_loss) under train.loss_chunks=4 slices it, as the config's own loss does; a
    loss of the user's own is refused in one line, never run with the chunks silently ignored."""
    from meshpar.nn.stages import stage_loss
    from meshpar.train.step import Trainer
    from tests.conftest import devices, make_cfg

    cfg = make_cfg("train.loss_chunks=4", mesh={"data": 1, "fsdp": 1, "tensor": 1})
    assert getattr(Trainer(cfg, loss=lm_loss, devices=devices(1)).loss, "keywords", {}) == {"chunks": 4}
    with pytest.raises(
        ConfigError,
        match=r"train.loss_chunks=4 slices the built-in lm loss, and this Trainer's "
        r"loss is stage_loss; set train.loss_chunks=1",
    ):
        Trainer(cfg, loss=stage_loss, devices=devices(1))


def test_a_features_without_the_packing_arguments_is_one_line():
    class Split(nnx.Module):
        def features(self, tokens, dtype=None):
            return jnp.zeros(tokens.shape + (4,))

        def head(self, x, dtype):
            return jnp.zeros(x.shape[:2] + (8,))

    batch = {k: jnp.zeros((1, 9), jnp.int32) for k in ("tokens", "segment_ids", "positions")}
    with pytest.raises(ConfigError, match=r"model Split takes no positions=, segment_ids= argument.*to its features"):
        lm_loss(Split(), batch, chunks=2)
