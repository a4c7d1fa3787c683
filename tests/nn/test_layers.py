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
