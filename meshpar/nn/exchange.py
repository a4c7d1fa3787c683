"""Ragged exchange: rows of uneven counts sent to every device of some mesh axes (dropless MoE's
dispatch and return), `jax.lax.ragged_all_to_all` where the backend has it.

Shapes: D devices on the axes, R rows a device holds, M row width. A device sends rows
operand[in_off[d] : in_off[d] + send[d]] to device d, where they land at rows
out_off[d] .. out_off[d] + send[d] - 1 of d's `output` [R', M]; it receives recv[s] rows from each
device s (recv = all_to_all(send)). JAX's documented semantics of `ragged_all_to_all`.

Implementations (`impl`):
    ragged  `jax.lax.ragged_all_to_all`: only the rows sent cross the wire (GPU, TPU)
    padded  every slice padded to R rows, `all_to_all` [D, R, M], then written at its offsets: the
            same result, D x R rows on the wire (XLA:CPU has no ragged all-to-all: UNIMPLEMENTED)
    auto    ragged on GPU and TPU, padded on CPU (`meshpar.core.platform`: a deviceless target's too)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshpar.core.platform import platform

IMPLS = ("auto", "ragged", "padded")


def exchange(operand, output, in_off, send, out_off, recv, axes, impl: str = "auto"):
    """operand [R, M] -> `output` [R', M] with the rows received written in (see the module docstring).
    in_off, send, out_off, recv: [D] int32; `axes`: the mesh axes (inside a shard_map manual over them),
    () for one device (the slices stay local)."""
    if impl not in IMPLS:
        raise ValueError(f"exchange impl {impl!r}: choose one of {', '.join(IMPLS)}")
    if impl == "auto":
        impl = "padded" if platform() == "cpu" or not axes else "ragged"
    if impl == "ragged":
        return jax.lax.ragged_all_to_all(operand, output, in_off, send, out_off, recv, axis_name=axes)
    return padded(operand, output, in_off, send, out_off, recv, axes)


def padded(operand, output, in_off, send, out_off, recv, axes):
    """The exchange as `all_to_all` of padded slices, written at the offsets the senders name."""
    r = operand.shape[0]
    j = jnp.arange(r)
    rows = jnp.minimum(in_off[:, None] + j[None, :], r - 1)                     # [D, R]
    keep = (j[None, :] < send[:, None]).reshape(rows.shape + (1,) * (operand.ndim - 1))
    slices = jnp.where(keep, operand[rows], 0)                                  # [D, R, M]
    swap = (lambda a: jax.lax.all_to_all(a, axes, 0, 0, tiled=True)) if axes else (lambda a: a)
    got, at = swap(slices), swap(out_off)                                       # [D (source), R, M], [D]
    pos = jnp.where(j[None, :] < recv[:, None], at[:, None] + j[None, :], output.shape[0])   # past the end: dropped
    return output.at[pos.reshape(-1)].set(got.reshape(-1, *got.shape[2:]).astype(output.dtype), mode="drop")
