"""Pallas splash attention (TPU): the masks of `meshpar.nn.attention` served by the block-sparse
kernel jax ships (`jax.experimental.pallas.ops.tpu.splash_attention`), `model.attention=splash`.

Shapes: B batch, T queries, S keys, N query heads, K key/value heads, G = N / K query heads per
key/value head, H head width.

Splash takes one sequence and the query heads of one key/value head ([G, T, H] against [S, H],
its MQA form), so grouped-query attention is two vmaps, over B and K. Its mask is static: causal
(`CausalMask`), a window (`LocalMask`, left W-1, right 0 causal or W-1 not) or none (`FullMask`),
and the blocks the mask removes are never computed; segment ids ride along at run time. It scales
no scores, so q is scaled by 1/sqrt(H) first; soft-capping is its `attn_logits_soft_cap`. A query
that sees no key would get the mean of V, so `serves` accepts only self-attention in natural order
(every query sees itself), with T and S multiples of 128 (the TPU's lane width).

Off TPU the kernel runs in Pallas's interpreter: correct and slow, for tests.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import jax
import numpy as np

from meshpar.core.platform import platform

LANE = 128


def available() -> bool:
    """Whether the installed jax ships the splash kernel."""
    try:
        return importlib.util.find_spec("jax.experimental.pallas.ops.tpu.splash_attention") is not None
    except ImportError:
        return False


def serves(q, k, q_seg, k_seg, natural: bool) -> bool:
    """Whether splash can serve q [B, T, N, H], k [B, S, K, H] (see the module docstring)."""
    t, s = q.shape[1], k.shape[1]
    return available() and natural and t == s and t % LANE == 0 and q_seg is k_seg


def block_size(n: int, block: int) -> int:
    """The largest multiple of 128 <= block that divides n (n is a multiple of 128)."""
    b = max(LANE, block - block % LANE)
    while n % b:
        b -= LANE
    return b


@functools.lru_cache(maxsize=64)
def _kernel(
    t: int, s: int, groups: int, causal: bool, window: int | None, softcap: float | None, block: int, interpret: bool
):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if window is not None:
        one = sm.LocalMask((t, s), window_size=(window - 1, 0 if causal else window - 1), offset=0)
    else:
        one = sm.CausalMask((t, s)) if causal else sm.FullMask((t, s))
    bq, bk = block_size(t, block), block_size(s, block)
    sizes = sk.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    with jax.ensure_compile_time_eval():  # its block tables are concrete arrays, shared by every trace
        return sk.make_splash_mha(
            sm.MultiHeadMask([one] * groups),
            block_sizes=sizes,
            is_mqa=True,
            attn_logits_soft_cap=softcap,
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )


def splash_attention(
    q, k, v, causal: bool, window: int | None, softcap: float | None, segment_ids=None, block: int = 512
):
    """q [B, T, N, H], k/v [B, S, K, H], segment_ids [B, T] (queries and keys alike) -> [B, T, N, H]."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b, t, n, h = q.shape
    nk, s = k.shape[2], k.shape[1]
    g = n // nk
    kern = _kernel(t, s, g, causal, window, softcap, block, platform() != "tpu")
    qg = (q * (1.0 / math.sqrt(h))).astype(q.dtype).reshape(b, t, nk, g, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H]
    if segment_ids is None:
        one = lambda q1, k1, v1, _: kern(q1, k1, v1)
        segment_ids = np.zeros((b, 1), np.int32)  # unused, for the vmap
    else:
        one = lambda q1, k1, v1, s1: kern(q1, k1, v1, segment_ids=sk.SegmentIds(s1, s1))
    o = jax.vmap(jax.vmap(one, (0, 0, 0, None)))(qg, kt, vt, segment_ids)  # [B, K, G, T, H]
    return o.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)
