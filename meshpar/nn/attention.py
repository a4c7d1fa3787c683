"""Attention over the tokens one device holds: softmax(mask(q k^T / sqrt(H))) v, one mask, several kernels.

Shapes: B batch, T queries, S keys, N query heads, K key/value heads (grouped-query attention,
Ainslie et al. 2023: query head n reads key/value head n // (N / K)), H head width.

The mask is described once, as data, and every implementation serves it: query a sees key b iff

    (not causal or b <= a)  and  (window is None or |a - b| < window)  and  (no segment ids or seg[a] == seg[b])

where a, b are the tokens' sequence indices (0..T-1 unless context parallelism says otherwise);
with `softcap` c the scores become c tanh(s / c) before masking (Gemma 2). A query that sees no key
gets zeros, whichever kernel runs.

Implementations (`model.attention`):
    xla    the reference: scores [B, N, T, S] materialised (`jax.nn.dot_product_attention`, or one
           einsum when soft-capped)
    flash  blockwise with an online softmax and a recomputing backward, O(S) memory, skips the
           tiles the masks remove (meshpar.nn.flash; every backend)
    cudnn  `jax.nn.dot_product_attention(implementation="cudnn")` (GPU; bf16/fp16, no segment ids
           or soft-cap)
    splash Pallas splash attention (TPU; meshpar.nn.splash: self-attention, lengths a multiple of
           128; elsewhere Pallas's interpreter, for tests)
    auto   cudnn on GPU / splash on TPU where it can serve the call, else flash for S >
           AUTO_FLASH_FROM (when S has a block size >= MIN_AUTO_BLOCK: a prime length would mean
           1 x 1 tiles), else xla; never cudnn or splash inside a pipeline stage's shard_map, where
           their backward hands back cotangents that forget the axes the stage varies over (JAX 0.10:
           "Expected cotangent type bf16[...]{V:pipeline}") and the stage's autodiff refuses them

The public `meshpar.attention` is `meshpar.parallel.attention.attention`: these kernels on each
device's tokens, or across `context` shards when sequences are split (`meshpar.parallel.context`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from meshpar.core.config.schema import ATTENTION
from meshpar.core.errors import ConfigError, suggest
from meshpar.core.platform import platform
from meshpar.core.sequence import in_manual_region
from meshpar.nn import flash as flash_lib
from meshpar.nn import splash as splash_lib

IMPLEMENTATIONS = ATTENTION  # model.attention's options, typed once in meshpar.core.config.schema
AUTO_FLASH_FROM = 1024  # keys: below this the [T, S] scores are small and one fused product is fastest
DEFAULT_BLOCK = 512
MIN_AUTO_BLOCK = 64


@dataclass(frozen=True)
class Mask:
    """The mask's kind (static): causal, a sliding window of `window` keys, a soft-cap of the scores."""

    causal: bool = True
    window: int | None = None
    softcap: float | None = None

    def check(self) -> Mask:
        w, c = self.window, self.softcap
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w <= 0):
            raise ConfigError(
                f"attention window={w!r} must be a positive number of keys (a query at i "
                "sees keys i-window+1..i), or None for no window"
            )
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float, np.number)) or not c > 0):
            raise ConfigError(f"attention softcap={c!r} must be a positive number (scores become c*tanh(s/c)), or None")
        return self


def check_shapes(q, k, v, mask: Mask, segment_ids, kv_segment_ids) -> None:
    """One line naming the operand whose shape does not fit q [B, T, N, H], k/v [B, S, K, H]."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ConfigError(
            f"attention takes q [B, T, N, H] and k, v [B, S, K, H]; got ranks {q.ndim}, {k.ndim}, {v.ndim}"
        )
    b, t, n, h = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != h:
        raise ConfigError(
            f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must both be [B={b}, S, K, H={h}] "
            f"for q {tuple(q.shape)}"
        )
    if n % k.shape[2]:
        raise ConfigError(f"attention: {n} query heads are not a multiple of {k.shape[2]} key/value heads")
    if (mask.causal or mask.window is not None) and t != k.shape[1]:
        raise ConfigError(
            f"attention: a causal or windowed mask needs as many queries as keys, got T={t}, S={k.shape[1]}"
        )
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ConfigError("attention: kv_segment_ids needs segment_ids (the queries' segments) too")
    for name, seg, want, dims in (
        ("segment_ids", segment_ids, (b, t), "[B, T]"),
        ("kv_segment_ids", kv_segment_ids, (b, k.shape[1]), "[B, S]"),
    ):
        if seg is not None and tuple(seg.shape) != want:
            raise ConfigError(
                f"attention: {name} has shape {tuple(seg.shape)}, expected {dims} = {list(want)} "
                "(one segment id per token)"
            )


def cudnn_serves(dtype, head_dim: int, has_segments: bool, softcap) -> bool:
    """Whether cuDNN's fused attention can serve a call on a GPU: bf16/fp16 inputs, a head width that
    is a multiple of 8 and at most 128, no segment ids, no soft-cap."""
    return (
        jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
        and head_dim % 8 == 0
        and 0 < head_dim <= 128
        and not has_segments
        and softcap is None
    )


def choose(implementation: str, q, k, mask: Mask, has_segments: bool, splash_ok: bool = False) -> str:
    """The kernel that serves this call: `implementation`, with `auto` resolved; one line when the
    named kernel cannot do the requested masks on this backend. `splash_ok`: `splash.serves` said yes."""
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(
            f"unknown attention implementation '{implementation}'" + suggest(implementation, IMPLEMENTATIONS)
        )
    cudnn_ok = platform() == "gpu" and cudnn_serves(q.dtype, q.shape[-1], has_segments, mask.softcap)
    if implementation == "cudnn" and not cudnn_ok:
        why = (
            "it runs on GPU only"
            if platform() != "gpu"
            else "it needs bf16/fp16 inputs, a head width that is a multiple of 8 and at most 128, no segment ids "
            "and no soft-cap"
        )
        raise ConfigError(f"model.attention=cudnn cannot serve this call ({why}); use model.attention=flash or auto")
    if implementation == "splash" and not splash_ok:
        raise ConfigError(
            "model.attention=splash cannot serve this call (it needs the splash kernel in the installed "
            "jax, self-attention in natural order with one segment-id array, and a length that is a "
            f"multiple of {splash_lib.LANE}); use model.attention=flash or auto"
        )
    if implementation == "auto":
        staged = in_manual_region()  # a pipeline stage: cuDNN's and splash's backward lose its varying axes
        if splash_ok and platform() == "tpu" and not staged:
            return "splash"
        long = k.shape[1] > AUTO_FLASH_FROM and flash_lib.block_size(k.shape[1], DEFAULT_BLOCK) >= MIN_AUTO_BLOCK
        return "cudnn" if cudnn_ok and not staged else "flash" if long else "xla"
    return implementation


def reference(q, k, v, mask: Mask, q_index, k_index, q_seg=None, k_seg=None):
    """The materialised reference: [B, T, N, H] from fp32 scores [B, K, G, T, S] (a query that sees
    no key gets zeros); the mask of `flash.visibility` from sequence indices q_index [T], k_index [S]."""
    b, t, n, h = q.shape
    nk = k.shape[2]
    q5 = q.reshape(b, t, nk, n // nk, h)
    s = jnp.einsum("btkgh,bskh->bkgts", q5, k, preferred_element_type=jnp.float32) / math.sqrt(h)
    if mask.softcap is not None:
        s = mask.softcap * jnp.tanh(s / mask.softcap)
    vis = flash_lib.visibility(mask.causal, mask.window, q_index, k_index, q_seg, k_seg)[:, None, None]  # [B|1,1,1,T,S]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isneginf(m), 0.0, m))
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    o = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, n, h).astype(q.dtype)


def _jax_nn(q, k, v, mask: Mask, q_seg, k_seg, implementation):
    """`jax.nn.dot_product_attention` for indices 0..T-1 (its causal and local-window flags; segment
    ids as a boolean mask)."""
    m = None if q_seg is None else (q_seg[:, :, None] == k_seg[:, None, :])[:, None]  # [B, 1, T, S]
    window = None if mask.window is None else (mask.window - 1, 0 if mask.causal else mask.window - 1)
    return jax.nn.dot_product_attention(
        q, k, v, mask=m, is_causal=mask.causal, local_window_size=window, implementation=implementation
    )


def local_attention(
    q,
    k,
    v,
    mask: Mask,
    *,
    q_index=None,
    k_index=None,
    q_seg=None,
    k_seg=None,
    implementation: str = "auto",
    block: int = DEFAULT_BLOCK,
):
    """Attention of q [B, T, N, H] to k, v [B, S, K, H] held on this device -> [B, T, N, H].

    q_index [T] / k_index [S]: concrete sequence indices (default 0..T-1, 0..S-1)."""
    natural = q_index is None and k_index is None
    impl = choose(implementation, q, k, mask, q_seg is not None, splash_lib.serves(q, k, q_seg, k_seg, natural))
    if impl == "splash":
        return splash_lib.splash_attention(q, k, v, mask.causal, mask.window, mask.softcap, q_seg, block)
    # jax.nn gives a query that sees no key the mean of V, not zeros: use it only where every query
    # sees itself (queries are keys, one segment array for both)
    sees_itself = q.shape[1] == k.shape[1] and (q_seg is None or q_seg is k_seg)
    if impl in ("xla", "cudnn") and natural and sees_itself and mask.softcap is None:
        return _jax_nn(q, k, v, mask, q_seg, k_seg, impl)
    q_index = np.arange(q.shape[1]) if q_index is None else q_index
    k_index = np.arange(k.shape[1]) if k_index is None else k_index
    if impl == "flash":
        kern = flash_lib.Kernel(
            mask.causal,
            mask.window,
            mask.softcap,
            1.0 / math.sqrt(q.shape[-1]),
            flash_lib.block_size(q.shape[1], block),
            flash_lib.block_size(k.shape[1], block),
        )
        return flash_lib.flash_attention(kern, q, k, v, q_index, k_index, q_seg, k_seg)
    return reference(q, k, v, mask, jnp.asarray(q_index), jnp.asarray(k_index), q_seg, k_seg)
