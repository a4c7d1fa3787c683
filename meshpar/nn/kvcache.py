"""A KV cache stacked over layers, read and written one layer at a time in place.

A decoder's cache holds every layer's keys and values in one array per leaf, [L, B, K, S, D] (L layers,
B sequences, K key/value heads, S positions, D head width). A decode step changes one position per
sequence and layer. `meshpar.nn.layers.scan_layers` hands a layer that sets `cache_views = True` a
`View` of each leaf (the stack and the layer's index) instead of its slice:
    read(c)              the layer's [B, K, S, D], sliced where it is read (a fusion reads it in place)
    write(c, at, v)      v written at index `at` of the layer's slice, in the stack itself (a scatter
                         XLA does in place on the loop's buffer)
    attend(q, ...)       decode attention over the cached positions
so a step moves the new entries and one read of the cache, where a slice handed out and returned whole
is copied out of the stack and written back every step (`bench/RESULTS.md`, serving on the H200).
Plain arrays pass through all three: a cache that is not stacked (a tail block's), or a layer that
returns its slice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshpar.core.platform import platform


@jax.tree_util.register_pytree_node_class
class View:
    """Layer `layer` (an int32 scalar) of a stacked cache leaf `stack` [L, ...]."""

    def __init__(self, stack, layer):
        self.stack, self.layer = stack, layer

    @property
    def shape(self) -> tuple:
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self):
        return self.stack.dtype

    def tree_flatten(self):
        return (self.stack, self.layer), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def is_view(c) -> bool:
    return isinstance(c, View)


def read(c):
    """The layer's cache [B, ...] (a View's slice of its stack, or the array itself)."""
    if is_view(c):
        return jax.lax.dynamic_index_in_dim(c.stack, c.layer, 0, keepdims=False)
    return c


def write(c, at: tuple, values):
    """`c` with `values` set at index `at` of the layer's cache (cast to the cache's dtype); a View
    stays a View, its stack updated in place."""
    if is_view(c):
        return View(c.stack.at[(c.layer, *at)].set(values.astype(c.dtype)), c.layer)
    return c.at[at].set(values.astype(c.dtype))


def restack(stack, new, layer):
    """The stack [L, ...] after layer `layer` ran: the View it returned (its stack), or a slice
    [B, ...] it returned instead, written back whole at its index."""
    if is_view(new):
        return new.stack
    return jax.lax.dynamic_update_index_in_dim(stack, new.astype(stack.dtype), layer, 0)


def attend(q, positions, k, v, dtype, window=None, softcap=None):
    """q [B, T, K, G, D] (G query heads per key/value head) to the cached k, v [B, K, S, D] (arrays or
    Views) at the positions s <= its own (and > its own - window), positions [B, T]:
    softmax_s(q . k_s / sqrt(D)) v_s in fp32, stale entries beyond a query's position masked.
    -> [B, T, K, G, D].

    One query per sequence on a GPU (a decode step) is a multiply and a sum, not a matmul: XLA:GPU's
    matmul kernels read a copy of the layer's slice, where its reductions read the stack itself. Every
    other call is two einsums (a TPU matmul reads the slice in place)."""
    b, t = positions.shape
    kc, vc = read(k), read(v)
    s_len, d = kc.shape[2], kc.shape[3]
    scale = jnp.sqrt(jnp.float32(d))
    by_sums = t == 1 and platform() == "gpu"
    if by_sums:
        q32, k32 = q[:, 0].astype(jnp.float32), kc.astype(jnp.float32)  # [B, K, G, D], [B, K, S, D]
        # G sums, one per query head of the group, fused into one reduction that reads k once (one sum
        # over [B, K, G, S, D] reads it G times: q.k 15.0 -> 6.7 ms of the 8B's 32-slot step, H200)
        sums = jax.lax.optimization_barrier(
            tuple(jnp.sum(q32[:, :, g, None, :] * k32, axis=-1) for g in range(q.shape[3]))
        )
        s = jnp.stack(sums, axis=2)
        s = s[:, :, :, None] / scale  # [B, K, G, 1, S]
    else:
        s = jnp.einsum("btkgd,bksd->bkgts", q.astype(dtype), kc.astype(dtype)).astype(jnp.float32) / scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    mask = jnp.arange(s_len)[None, None, :] <= positions[:, :, None]  # [B, T, S]
    if window is not None:
        mask &= positions[:, :, None] - jnp.arange(s_len)[None, None, :] < window
    s = jnp.where(mask[:, None, None], s, -jnp.inf)  # [B, K, G, T, S]
    if by_sums:  # normalised after the sum over s (a softmax fusion would copy v)
        e = jnp.exp(s[:, :, :, 0] - jnp.max(s[:, :, :, 0], axis=-1, keepdims=True))  # [B, K, G, S]
        o = jnp.sum(e[..., None] * vc[:, :, None].astype(jnp.float32), axis=-2) / jnp.sum(e, axis=-1)[..., None]
        return o[:, None].astype(q.dtype)  # [B, 1, K, G, D]
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bkgts,bksd->btkgd", p.astype(dtype), vc.astype(dtype)).astype(q.dtype)
