"""The order a sequence's tokens are stored in along [B, T, ...] activations, and over how many
`context` devices they are split: what context parallelism (`meshpar.parallel.context`) decides and
what every layer whose result depends on the order of the tokens (MoE capacity, `meshpar.nn.moe`)
must know.

Shapes: B batch, T sequence length, M width; cp devices on `context`.

    natural   storage position p holds sequence index p
    balanced  T cut into 2cp chunks of C = T / (2cp); device d holds chunks d and 2cp-1-d (zig-zag):
              storage position p holds sequence index order(T, cp)[p]

The built-in LM loss stores its rows balanced and says so with `balanced()` while the model is
traced; everything else is in natural order.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from meshpar.core import scopes
from meshpar.core.layout import active_layout

AXIS = "context"

_BALANCED = scopes.BALANCED


@contextlib.contextmanager
def balanced(on: bool = True):
    """Declare that [B, T, ...] activations traced inside are stored in the balanced order."""
    token = _BALANCED.set(on)
    try:
        yield
    finally:
        _BALANCED.reset(token)


def is_balanced() -> bool:
    """True while tracing under `balanced()`."""
    return _BALANCED.get()


def in_manual_region() -> bool:
    """Inside a shard_map manual over any mesh axis (a pipeline stage's: `pipeline`, maybe `data`)."""
    return bool(scopes.manual_axes())


def manual() -> bool:
    """Inside a shard_map manual over `context` (a pipeline stage): activations are local in length."""
    return AXIS in scopes.manual_axes()


def context_size() -> int:
    """cp: the size of the `context` axis when the active rules split sequence positions over it (or a
    shard_map is manual over it), else 1."""
    if manual():
        return jax.sharding.get_abstract_mesh().shape[AXIS]
    layout = active_layout()
    if layout is None or layout.shape.get(AXIS, 1) == 1:
        return 1
    spec = layout.spec(("batch", "seq"))
    return layout.shape[AXIS] if len(spec) > 1 and spec[1] == AXIS else 1


def order(t: int, cp: int) -> np.ndarray:
    """The balanced order: storage position p holds sequence index order[p] ([T], chunks 0, 2cp-1, 1, 2cp-2, ...)."""
    c = t // (2 * cp)
    chunks = [i for d in range(cp) for i in (d, 2 * cp - 1 - d)]
    return np.concatenate([np.arange(i * c, (i + 1) * c) for i in chunks])


def stored_order(t: int) -> np.ndarray | None:
    """The sequence index of each storage position [T] of the [B, T, ...] activations traced here
    (whole in length, not inside a shard_map manual over `context`), or None when they are in the
    natural order."""
    cp = context_size()
    return order(t, cp) if cp > 1 and is_balanced() else None


def permute(x, index: np.ndarray, axis: int = 1):
    """x with `axis` gathered by the permutation `index` (out[..., p, ...] = x[..., index[p], ...]);
    its gradient is the inverse gather (never a scatter-add)."""
    inverse = np.argsort(index)

    @jax.custom_vjp
    def gather(x):
        return jnp.take(x, index, axis=axis)

    gather.defvjp(lambda x: (gather(x), None), lambda _, d: (jnp.take(d, inverse, axis=axis),))
    return gather(x)
