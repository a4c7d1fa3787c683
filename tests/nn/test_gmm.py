"""Grouped matmul by row tiles (meshpar.nn.gmm) equals `jax.lax.ragged_dot`, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshpar.nn.gmm import grouped_matmul


def _case(n=203, i=24, o=40, sizes=(37, 0, 61, 5, 70)):
    kx, kw, kd = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (n, i), jnp.float32)
    w = jax.random.normal(kw, (len(sizes), i, o), jnp.float32)
    dy = jax.random.normal(kd, (n, o), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32), dy


def _value_and_grads(impl, x, w, sizes, dy, tile=16):
    f = lambda x, w: jnp.vdot(grouped_matmul(x, w, sizes, impl, tile), dy)
    y = grouped_matmul(x, w, sizes, impl, tile)
    return (y, *jax.grad(f, argnums=(0, 1))(x, w))


@pytest.mark.parametrize("tile", [8, 16, 64, 512])
def test_tiles_equal_ragged_dot(tile):
    """Groups that straddle tiles, an empty group, padding rows past sum(sizes), N not a multiple of
    the tile: the output (0 on padding rows), dx and dw all equal ragged_dot's."""
    x, w, sizes, dy = _case()
    want = _value_and_grads("ragged_dot", x, w, sizes, dy)
    got = jax.jit(lambda x, w: _value_and_grads("tiles", x, w, sizes, dy, tile))(x, w)
    for a, b, name in zip(got, want, ("y", "dx", "dw")):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    assert float(jnp.abs(got[0][int(sizes.sum()) :]).max()) == 0.0


def test_tiles_in_bf16_accumulate_weight_grads_in_fp32():
    x, w, sizes, dy = _case()
    want = _value_and_grads("ragged_dot", x, w, sizes, dy)
    got = _value_and_grads("tiles", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), sizes, dy.astype(jnp.bfloat16))
    assert got[2].dtype == jnp.bfloat16
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0.05, atol=0.3)


def test_tiles_inside_shard_map_sum_weight_grads_over_token_shards():
    """x split over `data`, w replicated over it: dw is the sum of the shards' parts (the psum that
    autodiff puts on the transpose of an invariant -> varying cast), as ragged_dot's autodiff gives."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x, w, _, dy = _case(n=64)
    sizes = jnp.asarray([10, 0, 7, 3, 12], jnp.int32)  # per shard: 32 rows, 32 routed

    def loss(impl, x, w):
        fn = jax.shard_map(
            lambda x, w, dy: jnp.vdot(grouped_matmul(x, w, sizes, impl, 8), dy)[None],
            mesh=mesh,
            in_specs=(P("data"), P(), P("data")),
            out_specs=P("data"),
        )
        return jnp.sum(fn(x, w, dy))

    want = jax.grad(lambda x, w: loss("ragged_dot", x, w), argnums=(0, 1))(x, w)
    got = jax.jit(jax.grad(lambda x, w: loss("tiles", x, w), argnums=(0, 1)))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_unknown_impl_is_one_line():
    x, w, sizes, _ = _case()
    with pytest.raises(ValueError, match="grouped matmul impl 'megablox': choose one of auto, ragged_dot, tiles"):
        grouped_matmul(x, w, sizes, "megablox")
