"""Grouped matmul: rows sorted by group, each group times its own matrix (dropless MoE's experts).

Letters: N rows, G groups, I input width, O output width, b rows per tile.

    x [N, I] (group g's rows contiguous, groups in order, rows past sum(sizes) are padding),
    w [G, I, O], sizes [G] -> y [N, O] with y[r] = x[r] @ w[group of r], 0 on padding rows.

Two implementations of the same numbers (`grouped_matmul(..., impl=...)`):
- `ragged_dot`: `jax.lax.ragged_dot`, the backend's own lowering (GPU, TPU).
- `tiles`: the rows are cut in tiles of b; each (group, tile) pair a group's rows touch is one work
  item, y[tile] += mask_g(x[tile]) @ w[g], run by a loop whose trip count is the number of items
  (at most N/b + G - 1, and only tiles that hold rows: the padding of an expert-parallel receive
  buffer costs nothing). The backward is two more such loops (dx with w transposed; dw[g] +=
  x[tile]^T dy[tile], accumulated in fp32), as in Megablox's gmm/tgmm (Gale et al. 2023,
  MegaBlocks), written in XLA ops. XLA:CPU lowers `ragged_dot` as one dense matmul per group over
  all N rows (G times the FLOPs: 50 ms vs 13 ms for N=2048, G=4, I=256, O=512, forward and
  backward), so `auto` takes `tiles` on CPU and `ragged_dot` elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from meshpar.core.platform import platform
from meshpar.nn.flash import varying_like

TILE = 128
IMPLS = ("auto", "ragged_dot", "tiles")


def grouped_matmul(x, w, sizes, impl: str = "auto", tile: int = TILE):
    """x [N, I], w [G, I, O], sizes [G] (int) -> [N, O] in x's dtype; rows past sum(sizes) give 0."""
    if impl not in IMPLS:
        raise ValueError(f"grouped matmul impl {impl!r}: choose one of {', '.join(IMPLS)}")
    if impl == "auto":
        impl = "tiles" if platform() == "cpu" else "ragged_dot"
    if impl == "ragged_dot":
        return lax.ragged_dot(x, w, sizes.astype(jnp.int32), preferred_element_type=x.dtype)
    n = x.shape[0]
    tile = min(tile, -(-n // 8) * 8)
    pad = -n % tile
    xp = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
    return _tiles(xp, w, sizes.astype(jnp.int32), tile)[:n]


def _items(sizes, n_rows: int, tile: int):
    """Work items of one grouped matmul: (group [W], tile [W], count, group starts [G], ends [G]),
    W = n_rows / tile + G static; items past `count` are never run."""
    g = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first, last = starts // tile, (ends - 1) // tile
    per_group = jnp.where(sizes > 0, last - first + 1, 0)
    cum = jnp.cumsum(per_group)
    i = jnp.arange(n_rows // tile + g)
    group = jnp.minimum(jnp.sum(cum[None, :] <= i[:, None], axis=1), g - 1)  # searchsorted, right
    tiles = first[group] + i - (cum[group] - per_group[group])
    return group.astype(jnp.int32), tiles.astype(jnp.int32), cum[-1].astype(jnp.int32), starts, ends


def _rows(x, t, tile: int, lo, hi):
    """Tile t of x [tile, I], rows outside [lo, hi) zeroed."""
    rows = lax.dynamic_slice_in_dim(x, t * tile, tile, 0)
    ids = t * tile + jnp.arange(tile)
    return jnp.where(((ids >= lo) & (ids < hi))[:, None], rows, jnp.zeros((), x.dtype))


def _apply(x, w, items, tile: int, transpose: bool):
    """y [N, O] = x @ w[g] per item (w [G, O, I] used as its transpose when `transpose`)."""
    group, tiles, count, starts, ends = items
    dims = (((1,), (1,)), ((), ())) if transpose else (((1,), (0,)), ((), ()))
    out = varying_like(jnp.zeros((x.shape[0], w.shape[1] if transpose else w.shape[2]), x.dtype), x, w)

    def body(i, out):
        g, t = group[i], tiles[i]
        wg = lax.dynamic_index_in_dim(w, g, 0, keepdims=False)
        prod = lax.dot_general(_rows(x, t, tile, starts[g], ends[g]), wg, dims, preferred_element_type=x.dtype)
        cur = lax.dynamic_slice_in_dim(out, t * tile, tile, 0)
        return lax.dynamic_update_slice_in_dim(out, cur + prod, t * tile, 0)

    return lax.fori_loop(0, count, body, out)


def _weight_grad(x, dy, items, tile: int, shape):
    """dw [G, I, O] = sum over items of x[tile]^T dy[tile] (fp32 accumulation)."""
    group, tiles, count, starts, ends = items
    dw = varying_like(jnp.zeros(shape, jnp.float32), x, dy)

    def body(i, dw):
        g, t = group[i], tiles[i]
        xs = _rows(x, t, tile, starts[g], ends[g])
        ds = lax.dynamic_slice_in_dim(dy, t * tile, tile, 0)
        part = lax.dot_general(xs, ds, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        cur = lax.dynamic_index_in_dim(dw, g, 0, keepdims=False)
        return lax.dynamic_update_index_in_dim(dw, cur + part, g, 0)

    return lax.fori_loop(0, count, body, dw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiles(x, w, sizes, tile):
    return _apply(x, w, _items(sizes, x.shape[0], tile), tile, False)


def _tiles_fwd(x, w, sizes, tile):
    return _tiles(x, w, sizes, tile), (x, w, sizes)


def _tiles_bwd(tile, res, dy):
    x, w, sizes = res
    items = _items(sizes, x.shape[0], tile)
    dx = _apply(dy, w, items, tile, True)
    dw = _weight_grad(x, dy, items, tile, w.shape).astype(w.dtype)
    return _summed_like(dx, x), _summed_like(dw, w), None


def _summed_like(grad, primal):
    """Inside shard_map: a gradient varying over mesh axes its primal is invariant over is summed
    over them (the transpose of the implicit invariant -> varying cast that autodiff would insert)."""
    extra = tuple(sorted(set(jax.typeof(grad).mat.varying) - set(jax.typeof(primal).mat.varying)))
    return lax.psum(grad, extra) if extra else grad


_tiles.defvjp(_tiles_fwd, _tiles_bwd)
