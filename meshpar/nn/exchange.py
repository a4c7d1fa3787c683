"""Ragged exchange: rows of uneven counts sent to every device of some mesh axes (dropless MoE's
dispatch and return), `jax.lax.ragged_all_to_all` where the backend has it.

Shapes: D devices on the axes, R rows a device holds, M row width. A device sends rows
operand[in_off[d] : in_off[d] + send[d]] to device d, where they land at rows
out_off[d] .. out_off[d] + send[d] - 1 of d's `output` [R', M]; it receives recv[s] rows from each
device s (recv = all_to_all(send)). JAX's documented semantics of `ragged_all_to_all`.

Implementations (`impl`):
    ragged  `jax.lax.ragged_all_to_all`: only the rows sent cross the wire (GPU, TPU)
    padded  every slice padded to S rows, `all_to_all` [D, S, M] (`dense`), then written at its
            offsets: the same result, D x S rows on the wire (XLA:CPU has no ragged all-to-all)
    auto    ragged on GPU and TPU, padded on CPU (`meshpar.core.platform`: a deviceless target's too)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshpar.core.platform import platform
from meshpar.nn.flash import varying_like

IMPLS = ("auto", "ragged", "padded")


def resolve(impl: str, axes) -> str:
    """ "ragged" or "padded" for `impl` on the platform being compiled for."""
    if impl not in IMPLS:
        raise ValueError(f"exchange impl {impl!r}: choose one of {', '.join(IMPLS)}")
    if impl == "auto":
        return "padded" if platform() == "cpu" or not axes else "ragged"
    return impl


def swap(a, axes):
    """`all_to_all` of a's leading dimension [D, ...] over `axes` (row d to device d, row s from device
    s); `a` itself on one device (`axes` empty)."""
    return jax.lax.all_to_all(a, axes, 0, 0, tiled=True) if axes else a


def exchange(operand, output, in_off, send, out_off, recv, axes, impl: str = "auto", slice_rows: int | None = None):
    """operand [R, M] -> `output` [R', M] with the rows received written in (see the module docstring).
    in_off, send, out_off, recv: [D] int32; `axes`: the mesh axes (inside a shard_map manual over them),
    () for one device (the slices stay local); `slice_rows`: the most rows any one slice holds (static;
    default R), which sizes the padded form's buffers [D, slice_rows, M]."""
    if resolve(impl, axes) == "ragged":
        # JAX types the result as `output`: a fresh zeros buffer would type the rows received as the same
        # on every device of the other manual axes (`fsdp`, say), though they differ, and the backward
        # would sum their cotangents over those axes (psum_invariant: wrong gradients, and an all-reduce
        # of the buffer per layer). Typed as varying as the rows sent, it is what it holds.
        return jax.lax.ragged_all_to_all(
            operand, varying_like(output, operand), in_off, send, out_off, recv, axis_name=axes
        )
    got = dense(operand, in_off, send, axes, slice_rows)  # [D (source), S, M]
    at = swap(out_off, axes)
    j = jnp.arange(got.shape[1])
    pos = jnp.where(j[None, :] < recv[:, None], at[:, None] + j[None, :], output.shape[0])  # past the end: dropped
    return output.at[pos.reshape(-1)].set(got.reshape(-1, *got.shape[2:]).astype(output.dtype), mode="drop")


def dense(operand, in_off, send, axes, slice_rows: int | None = None):
    """The padded form's wire: operand [R, M] -> [D (source), S, M], slice d of every device padded
    with zeros to S = `slice_rows` (default R) rows, by `all_to_all` over `axes`."""
    r = operand.shape[0]
    j = jnp.arange(slice_rows or r)
    rows = jnp.minimum(in_off[:, None] + j[None, :], r - 1)  # [D, S]
    keep = (j[None, :] < send[:, None]).reshape(rows.shape + (1,) * (operand.ndim - 1))
    slices = jnp.where(keep, operand[rows], 0)  # [D, S, M]
    return swap(slices, axes)
