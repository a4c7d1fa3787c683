"""meshpar.nn.layers' building blocks: `swiglu`'s hand-written backward against autodiff."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshpar.nn.layers import swiglu


def _reference(gate, up):
    return jax.nn.silu(gate) * up


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_equals_autodiff_of_silu_times_up(dtype):
    """Values as `silu(gate) * up`; gradients within fp32 rounding of autodiff's in fp32, and in bf16
    no further from the fp32 truth than autodiff's own (the backward runs in fp32, then casts)."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    gate, up, d = (s * jax.random.normal(k, (64, 96)) for s, k in ((3.0, k1), (1.0, k2), (1.0, k3)))
    cast = [t.astype(dtype) for t in (gate, up, d)]
    value, vjp = jax.vjp(swiglu, cast[0], cast[1])
    ref_value, ref_vjp = jax.vjp(_reference, cast[0], cast[1])
    np.testing.assert_array_equal(np.asarray(value, np.float32), np.asarray(ref_value, np.float32))
    truth = jax.vjp(_reference, gate, up)[1](d)  # fp32
    got, auto = vjp(cast[2]), ref_vjp(cast[2])
    for g, a, t in zip(got, auto, truth):
        assert g.dtype == dtype
        err, auto_err = (float(jnp.max(jnp.abs(x.astype(jnp.float32) - t))) for x in (g, a))
        if dtype == jnp.float32:
            assert err < 1e-5 * float(jnp.max(jnp.abs(t)))
        else:
            assert err <= auto_err


def _barriers(strategy: str, **mesh) -> list[str]:
    """The operand types of each optimization barrier in the lowered training step (no compile)."""
    from meshpar.train.step import trainer_for
    from tests.conftest import barrier_operands, make_cfg

    return barrier_operands(
        trainer_for(make_cfg("precision=bf16", "model.vocab=512", f"strategy={strategy}", mesh=mesh))
    )


def test_a_vocab_parallel_head_finishes_its_backward_before_the_layers_and_settles_the_logits_gradient():
    """`meshpar.nn.layers.after` and `settled_cotangent`: under a head split over the vocabulary (tp),
    the backward holds one barrier over the cotangents of the head's input [B, T, E] and weight [E, V]
    (the forward's barrier has the same types: two in all) and one over the logits' cotangent
    [B, T, V]; under fsdp (whole vocabulary) neither, only the forward's. What they buy is measured on
    the target's program (bench/RESULTS.md: Llama-3 8B on 64 v5p chips, 9.20 -> 8.08 GiB); at this size
    libtpu orders the head's backward first either way, so this checks the program meshpar writes."""
    b, t, e, v = 16, 16, 64, 512  # conftest's FAST batch and length, tiny's width, the vocab set above

    def count(barriers, *shapes):
        return sum(all(s in types for s in shapes) and types.count("tensor<") == len(shapes) for types in barriers)

    x, w, logits = f"tensor<{b}x{t}x{e}xbf16>", f"tensor<{e}x{v}xf32>", f"tensor<{b}x{t}x{v}xbf16>"
    tp, fsdp = _barriers("tp", data=2, tensor=4), _barriers("fsdp", fsdp=8)
    assert (count(tp, x, w), count(tp, logits)) == (2, 1), tp
    assert (count(fsdp, x, w), count(fsdp, logits)) == (1, 0), fsdp


@pytest.mark.parametrize("tied", [False, True])
def test_the_reference_decoder_starts_near_ln_v(tied):
    """A fresh decoder's first loss on uniform random tokens is near ln V (a uniform guess), tied
    embeddings included: the table that doubles as the LM head starts at the head's scale (std 1.0
    gave logits of std sqrt(E) and a first loss of 51.5 where ln V is 4.85)."""
    import math

    from flax import nnx

    from meshpar.core.config import load_config
    from meshpar.core.precision import get_policy, use_policy
    from meshpar.core.registry import default_model
    from meshpar.train.loss import lm_loss

    cfg = load_config(None, ["precision=fp32", f"model.tie_embeddings={str(tied).lower()}"])
    with use_policy(get_policy("fp32")):
        model = default_model(cfg)(nnx.Rngs(0))
        tokens = np.random.default_rng(0).integers(0, model.cfg.vocab, (4, 65))
        loss = float(lm_loss(model, tokens)[0])
    assert abs(loss - math.log(model.cfg.vocab)) < 1.0, loss
