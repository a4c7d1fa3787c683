"""The KV cache stacked over layers (meshpar/nn/kvcache.py): a layer's view writes its stack in place and
reads what its slice would hold; the GPU's one-query attention equals the matmul form; a stacked layer
that returns its slice (the older contract) and one that writes through views decode alike."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshpar
from meshpar.core.platform import compiling_for
from meshpar.nn import kvcache


def _cache(seed=0, shape=(3, 2, 2, 16, 4)):  # [L, B, K, S, D]
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_a_view_writes_its_layer_of_the_stack_and_nothing_else():
    stack, layer = _cache(), 1
    positions = jnp.array([[3], [9]])  # [B, T]
    new = jax.random.normal(jax.random.key(1), (2, 1, 2, 4))  # [B, T, K, D]
    at = (jnp.arange(2)[:, None, None], jnp.arange(2)[None, None, :], positions[:, :, None])
    view = kvcache.write(kvcache.View(stack, jnp.int32(layer)), at, new)
    sliced = kvcache.write(stack[layer], at, new)  # the array path: the slice itself
    assert isinstance(view, kvcache.View) and view.shape == sliced.shape
    np.testing.assert_array_equal(kvcache.read(view), sliced)
    np.testing.assert_array_equal(kvcache.restack(stack, view, layer), stack.at[layer].set(sliced))
    # a layer that returned its slice: written back whole, in its place
    np.testing.assert_array_equal(kvcache.restack(stack, sliced, jnp.int32(layer)), stack.at[layer].set(sliced))
    untouched = np.delete(np.asarray(view.stack), layer, axis=0)
    np.testing.assert_array_equal(untouched, np.delete(np.asarray(stack), layer, axis=0))


@pytest.mark.parametrize("groups, window, softcap", [(3, None, None), (1, None, None), (2, 5, 30.0)])
def test_the_gpus_one_query_attention_equals_the_matmul_form(groups, window, softcap):
    """XLA:GPU decodes with a multiply and a sum (its reductions read the stack in place, its matmuls a
    copy); the same math as the einsums every other call runs, traced here as the GPU target's."""
    k, v = _cache(2, (2, 2, 16, 8)), _cache(3, (2, 2, 16, 8))
    q = jax.random.normal(jax.random.key(4), (2, 1, 2, groups, 8))  # [B, 1, K, G, D]
    positions = jnp.array([[4], [15]])

    def run(name):
        with compiling_for(name):
            return jax.jit(lambda q, k, v: kvcache.attend(q, positions, k, v, jnp.float32, window, softcap))(q, k, v)

    gpu, cpu = run("gpu"), run("cpu")
    assert gpu.shape == cpu.shape == q.shape
    np.testing.assert_allclose(gpu, cpu, rtol=1e-5, atol=1e-5)
    view = kvcache.View(jnp.stack([k * 0, k]), jnp.int32(1))  # through a view of a stack: the same
    with compiling_for("gpu"):
        np.testing.assert_allclose(kvcache.attend(q, positions, view, v, jnp.float32, window, softcap), gpu, rtol=1e-6)


class _Writer(nnx.Module):
    """A stacked decoding layer: writes x at each row's position of its cache, returns x + the mean of
    what its cache holds at positions <= the row's. `views` picks the contract."""

    def __init__(self, rngs, views: bool):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (4,)))
        self.views = views

    def __call__(self, x, positions, cache=None):  # x [B, 1, D], cache {"c": [B, S, D]}
        at = (jnp.arange(x.shape[0])[:, None], positions)
        if self.views:
            c = kvcache.write(cache["c"], at, x * self.w[...])
            held = kvcache.read(c)
        else:
            c = held = cache["c"].at[at].set(x * self.w[...])
        seen = jnp.arange(held.shape[1])[None, :] <= positions  # [B, S]
        return x + jnp.sum(jnp.where(seen[..., None], held, 0.0), axis=1)[:, None], {}, {"c": c}


class _Views(_Writer):
    cache_views = True


def test_a_layer_returning_its_slice_and_one_writing_through_views_decode_alike():
    x = jax.random.normal(jax.random.key(5), (2, 1, 4))
    positions = jnp.array([[2], [6]])
    cache = {"c": _cache(6, (3, 2, 8, 4))}  # [L, B, S, D]
    out = {}
    for views, cls in ((False, _Writer), (True, _Views)):
        stack = meshpar.stacked(lambda r, cls=cls, views=views: cls(r, views), 3, nnx.Rngs(0))
        for scan in (True, False):
            y, _, c = meshpar.scan_layers(stack, x, positions, "none", scan, cache=cache)
            out[views, scan] = (y, c["c"])
    for key in out:
        np.testing.assert_allclose(out[key][0], out[False, True][0], rtol=1e-6)
        np.testing.assert_array_equal(out[key][1], out[False, True][1])
    assert not np.array_equal(out[True, True][1], cache["c"])  # every layer wrote its row
