"""Blockwise attention in O(S) memory, plain JAX (Rabe & Staats 2021; FlashAttention, Dao et al. 2022).

Shapes: B batch, T queries, S keys, K key/value heads, G query heads per key/value head (N = K G),
H head width, bq / bk the query / key block, P the number of score tiles walked.

The (T/bq) x (S/bk) grid of score tiles is walked as a list of P tiles (query block i, key block j,
live) built by `tiles` from the tokens' sequence indices, known before tracing: a tile the causal
or window mask removes entirely is never listed (causal attention walks about half the grid), and
a listed tile whose segment ranges cannot meet is skipped at run time (`lax.cond`). The forward
keeps, per query, the running max m, sum l and output a (the online softmax):

    m' = max(m, max_j s_j)    l' = e^(m - m') l + sum_j e^(s_j - m')    a' = e^(m - m') a + sum_j e^(s_j - m') v_j

and saves only o = a / l and lse = m + log l. The backward (a custom VJP) walks the same tiles and
recomputes p = e^(s - lse), never holding a [T, S] array:

    dv_j += p^T do    dp = do v_j^T    ds = p (dp - rowsum(do o))
    dq_i += ds k_j / sqrt(H)    dk_j += ds^T q_i / sqrt(H)

Mask (`Mask` of meshpar.nn.attention): query index a sees key index b iff (not causal or b <= a),
(no window or |a - b| < window) and (no segment ids or seg_q[a] == seg_k[b]); with a soft-cap c the
scores are c tanh(s / c) before masking (Gemma 2).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclass(frozen=True)
class Kernel:
    """What the kernel needs to know before tracing: the mask's kind and the block sizes."""

    causal: bool
    window: int | None
    softcap: float | None
    scale: float
    bq: int
    bk: int


def block_size(n: int, want: int) -> int:
    """The largest divisor of n that is at most `want` (n itself when n <= want)."""
    for b in range(min(n, want), 0, -1):
        if n % b == 0:
            return b
    return n


def tiles(q_index: np.ndarray, k_index: np.ndarray, bq: int, bk: int, causal: bool, window: int | None) -> np.ndarray:
    """The score tiles [P, 3] (query block, key block, live = 1) that the causal / window mask leaves
    something in, for sequence indices q_index [T] and k_index [S] known before tracing."""
    qi, kj = np.asarray(q_index).reshape(-1, bq), np.asarray(k_index).reshape(-1, bk)
    live = np.ones((len(qi), len(kj)), bool)
    if causal:
        live &= kj.min(1)[None, :] <= qi.max(1)[:, None]
    if window is not None:
        live &= kj.max(1)[None, :] > qi.min(1)[:, None] - window
        if not causal:  # |a - b| < window: keys after the query too
            live &= kj.min(1)[None, :] < qi.max(1)[:, None] + window
    ij = np.argwhere(live).astype(np.int32)
    return np.concatenate([ij, np.ones((len(ij), 1), np.int32)], axis=1)


def pad_tiles(tables: list[np.ndarray]) -> np.ndarray:
    """Tile lists of different lengths -> one [len(tables), P, 3] array, short ones padded with dead tiles."""
    p = max(len(t) for t in tables)
    return np.stack([np.concatenate([t, np.zeros((p - len(t), 3), np.int32)]) for t in tables])


def varying_like(x, *refs):
    """x marked as varying over every manual mesh axis any of `refs` varies over (loop carries inside
    shard_map, the pipeline's or context parallelism's, must agree with what the body returns)."""
    want = set().union(*(set(jax.typeof(r).mat.varying) for r in refs if r is not None))
    missing = tuple(sorted(want - set(jax.typeof(x).mat.varying)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _zeros_from(x):
    """fp32 zeros shaped like x, computed from x (x * 0): a value partial evaluation sees as
    depending on x, never a constant to precompute and hand out of an enclosing shard_map."""
    return x.astype(jnp.float32) * 0.0


def visibility(causal: bool, window: int | None, qi, kj, qs=None, ks=None):
    """The mask as booleans [B or 1, Tq, Tk]: keys of sequence indices kj [Tk] (segments ks [B, Tk])
    a query of qi [Tq] (qs [B, Tq]) sees; every kernel's one definition of it."""
    m = (qi[:, None] >= 0)[None] & (kj[None, :] >= 0)[None]  # all true, made of the indices
    if causal:
        m &= (kj[None, :] <= qi[:, None])[None]
    if window is not None:
        m &= (jnp.abs(qi[:, None] - kj[None, :]) < window)[None]
    if qs is not None:
        m = m & (qs[:, :, None] == ks[:, None, :])
    return m


def _scores(kern: Kernel, qb, kb, mask):
    """Scores [B, bq, K, G, bk] in fp32 of qb [B, bq, K, G, H] against kb [B, bk, K, H], soft-capped,
    -inf where masked; also the soft-capped scores before masking (for the backward)."""
    s = jnp.einsum("bqkgh,bskh->bqkgs", qb, kb, preferred_element_type=jnp.float32) * kern.scale
    if kern.softcap is not None:
        s = kern.softcap * jnp.tanh(s / kern.softcap)
    return jnp.where(mask[:, :, None, None, :], s, -jnp.inf), s


class _Walk:
    """One tile's operands: q/do/stat rows of query block i, k/v rows of key block j, the mask."""

    def __init__(self, kern: Kernel, q_index, k_index, q_seg, k_seg):
        self.kern, self.q_index, self.k_index, self.q_seg, self.k_seg = kern, q_index, k_index, q_seg, k_seg

    def rows(self, x, i):
        return lax.dynamic_slice_in_dim(x, i * self.kern.bq, self.kern.bq, 1)

    def cols(self, x, j):
        return lax.dynamic_slice_in_dim(x, j * self.kern.bk, self.kern.bk, 1)

    def mask(self, i, j):
        qi = lax.dynamic_slice_in_dim(self.q_index, i * self.kern.bq, self.kern.bq)
        kj = lax.dynamic_slice_in_dim(self.k_index, j * self.kern.bk, self.kern.bk)
        qs = None if self.q_seg is None else self.rows(self.q_seg, i)
        ks = None if self.k_seg is None else self.cols(self.k_seg, j)
        return visibility(self.kern.causal, self.kern.window, qi, kj, qs, ks)

    def live(self, tile):
        """A listed tile, unless its query and key segment ranges cannot meet (in any row)."""
        i, j, live = tile[0], tile[1], tile[2] > 0
        if self.q_seg is None:
            return live
        qs, ks = self.rows(self.q_seg, i), self.cols(self.k_seg, j)
        meet = (qs.min(1) <= ks.max(1)) & (ks.min(1) <= qs.max(1))
        return live & jnp.any(meet)


def _forward(kern: Kernel, q, k, v, q_index, k_index, q_seg, k_seg, tile_list):
    """-> o [B, T, K, G, H] (q's dtype), lse [B, T, K, G] fp32 (-inf for a query that sees nothing)."""
    refs = (q, k, v, q_index, k_index, q_seg, k_seg, tile_list)
    acc = varying_like(_zeros_from(q), *refs)  # [B, T, K, G, H]
    l = varying_like(_zeros_from(q[..., 0]), *refs)  # [B, T, K, G]
    m = l - jnp.inf
    # One barrier over operands and carries: under differentiation (remat's or an enclosing
    # shard_map's partial evaluation) nothing inside counts as "known" (made of constants only),
    # so no tile mask is precomputed and saved as a [P, ...] residual.
    q, k, v, q_index, k_index, q_seg, k_seg, tile_list, acc, m, l = lax.optimization_barrier(
        (q, k, v, q_index, k_index, q_seg, k_seg, tile_list, acc, m, l)
    )
    walk = _Walk(kern, q_index, k_index, q_seg, k_seg)

    def step(carry, tile):
        def compute(carry):
            acc, m, l = carry
            i, j = tile[0], tile[1]
            s, _ = _scores(kern, walk.rows(q, i), walk.cols(k, j), walk.mask(i, j))
            mb, lb, ab = walk.rows(m, i), walk.rows(l, i), walk.rows(acc, i)
            m_new = jnp.maximum(mb, s.max(-1))
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(mb - m_safe)
            pv = jnp.einsum("bqkgs,bskh->bqkgh", p.astype(v.dtype), walk.cols(v, j), preferred_element_type=jnp.float32)
            put = lambda x, y: lax.dynamic_update_slice_in_dim(x, y, i * kern.bq, 1)
            return put(acc, alpha[..., None] * ab + pv), put(m, m_new), put(l, alpha * lb + p.sum(-1))

        return lax.cond(walk.live(tile), compute, lambda c: c, carry), None

    (acc, m, l), _ = lax.scan(step, (acc, m, l), tile_list)
    o = acc / jnp.where(l == 0, 1.0, l)[..., None]
    lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(jnp.where(l == 0, 1.0, l)))
    return o.astype(q.dtype), lse


def _backward(kern: Kernel, q, k, v, q_index, k_index, q_seg, k_seg, tile_list, o, lse, do):
    """-> dq [B, T, K, G, H], dk, dv [B, S, K, H] in their inputs' dtypes."""
    walk = _Walk(kern, q_index, k_index, q_seg, k_seg)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, T, K, G]
    lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    refs = (q, k, v, do, q_index, k_index, q_seg, k_seg, tile_list)
    dq, dk, dv = (varying_like(_zeros_from(x), *refs) for x in (q, k, v))

    def step(carry, tile):
        def compute(carry):
            dq, dk, dv = carry
            i, j = tile[0], tile[1]
            qb, kb, vb, dob = walk.rows(q, i), walk.cols(k, j), walk.cols(v, j), walk.rows(do, i)
            mask = walk.mask(i, j)
            _, capped = _scores(kern, qb, kb, mask)
            p = jnp.where(mask[:, :, None, None, :], jnp.exp(capped - walk.rows(lse_safe, i)[..., None]), 0.0)
            dvb = jnp.einsum("bqkgs,bqkgh->bskh", p.astype(do.dtype), dob, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgh,bskh->bqkgs", dob, vb, preferred_element_type=jnp.float32)
            ds = p * (dp - walk.rows(delta, i)[..., None])
            if kern.softcap is not None:
                ds = ds * (1.0 - jnp.square(capped / kern.softcap))
            ds = ds * kern.scale
            dqb = jnp.einsum("bqkgs,bskh->bqkgh", ds.astype(k.dtype), kb, preferred_element_type=jnp.float32)
            dkb = jnp.einsum("bqkgs,bqkgh->bskh", ds.astype(q.dtype), qb, preferred_element_type=jnp.float32)
            add_rows = lambda x, y: lax.dynamic_update_slice_in_dim(x, walk.rows(x, i) + y, i * kern.bq, 1)
            add_cols = lambda x, y: lax.dynamic_update_slice_in_dim(x, walk.cols(x, j) + y, j * kern.bk, 1)
            return add_rows(dq, dqb), add_cols(dk, dkb), add_cols(dv, dvb)

        return lax.cond(walk.live(tile), compute, lambda c: c, carry), None

    (dq, dk, dv), _ = lax.scan(step, (dq, dk, dv), tile_list)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(kern, q, k, v, q_index, k_index, q_seg, k_seg, tile_list):
    return _forward(kern, q, k, v, q_index, k_index, q_seg, k_seg, tile_list)[0]


def _flash_fwd(kern, q, k, v, q_index, k_index, q_seg, k_seg, tile_list):
    o, lse = _forward(kern, q, k, v, q_index, k_index, q_seg, k_seg, tile_list)
    return o, (q, k, v, q_index, k_index, q_seg, k_seg, tile_list, o, lse)


def _flash_bwd(kern, res, do):
    q, k, v, q_index, k_index, q_seg, k_seg, tile_list, o, lse = res
    dq, dk, dv = _backward(kern, q, k, v, q_index, k_index, q_seg, k_seg, tile_list, o, lse, do)
    return dq, dk, dv, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _grouped(q, nk: int):
    """q [B, T, N, H] -> [B, T, K, G, H] (query head n = k G + g, jax.nn's grouping)."""
    b, t, n, h = q.shape
    return q.reshape(b, t, nk, n // nk, h)


def forward(kern: Kernel, q, k, v, q_index, k_index, q_seg, k_seg, tile_list):
    """The forward alone, for a caller with its own VJP (context parallelism): q [B, T, N, H] ->
    (o [B, T, N, H], lse [B, T, K, G])."""
    o, lse = _forward(kern, _grouped(q, k.shape[2]), k, v, q_index, k_index, q_seg, k_seg, tile_list)
    return o.reshape(q.shape), lse


def backward(kern: Kernel, q, k, v, q_index, k_index, q_seg, k_seg, tile_list, o, lse, do):
    """The backward alone: (dq [B, T, N, H], dk, dv [B, S, K, H]) from `forward`'s o and lse."""
    g = lambda x: _grouped(x, k.shape[2])
    dq, dk, dv = _backward(kern, g(q), k, v, q_index, k_index, q_seg, k_seg, tile_list, g(o), lse, g(do))
    return dq.reshape(q.shape), dk, dv


def flash_attention(kern: Kernel, q, k, v, q_index, k_index, q_seg=None, k_seg=None):
    """q [B, T, N, H], k/v [B, S, K, H] -> [B, T, N, H]. q_index [T] / k_index [S]: the tokens'
    sequence indices, concrete (the causal and window masks compare them, `tiles` lists the tiles
    to walk from them); q_seg [B, T] / k_seg [B, S]: segment ids or None."""
    b, t, n, h = q.shape
    nk = k.shape[2]
    tile_list = tiles(np.asarray(q_index), np.asarray(k_index), kern.bq, kern.bk, kern.causal, kern.window)
    o = _flash(
        kern,
        _grouped(q, nk),
        k,
        v,
        jnp.asarray(q_index, jnp.int32),
        jnp.asarray(k_index, jnp.int32),
        q_seg,
        k_seg,
        jnp.asarray(tile_list, jnp.int32),
    )
    return o.reshape(b, t, n, h)
