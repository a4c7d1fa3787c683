"""Building blocks shared by the reference models. Every parameter carries `logical_axes` metadata
and every key activation is pinned with `meshpar.core.layout.constrain`; no mesh axis is named here.

Shapes use: B batch, T length, E embed (d_model), N query heads, K key/value heads, D head width,
F feed-forward width, V vocabulary, S positions held by a KV cache.

Decoding with a KV cache (`meshpar.serve.engine`): a block called with `cache` (per layer {"k", "v"}, each
[B, K, S, D], logical axes `CACHE_AXES` minus `layers`; under `scan_layers`, `meshpar.nn.kvcache` views
of the stacked cache) writes this call's keys and values at their positions [B, T] and attends to every
cached position <= its own; it returns the cache too.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar.core.layout import constrain
from meshpar.core.precision import attention_dtype
from meshpar.nn import kvcache
from meshpar.nn.layers import gated_inputs, param, swiglu
from meshpar.parallel.attention import attention


class RMSNorm(nnx.Module):
    """x / rms(x) * (offset + scale) (Zhang & Sennrich 2019), statistics in fp32. [..., E] -> [..., E].
    offset 0 (scale starts at 1), or 1 (Gemma: scale starts at 0)."""

    def __init__(self, dim: int, eps: float, rngs: nnx.Rngs, offset: float = 0.0):
        self.scale = param(rngs, (dim,), ("norm",), init="zeros" if offset else "ones")
        self.eps, self.offset = eps, offset

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (self.offset + self.scale[...])).astype(x.dtype)


# Stacked K or V cache [L, B, K, S, D]: heads before positions, so the decode attention's batch
# dimensions (B, K) lead in both operands and no layout transposes the cache every step.
CACHE_AXES = ("layers", "cache_batch", "kv_heads", "cache_length", "kv")


def rope_frequencies(d: int, theta: float, scaling: tuple | None = None):
    """The D/2 inverse frequencies theta^(-2i/D) in fp32, rescaled by `scaling`:
    ("linear", factor): every frequency divided by factor (position interpolation, Chen et al. 2023;
    Gemma 3's global layers); ("llama3", factor, low_freq_factor, high_freq_factor, original_max_positions):
    Llama 3.1's rescaling, wavelengths longer than original/low_freq_factor divided by `factor`, shorter
    than original/high_freq_factor kept, and those between interpolated smoothly (the formulas of HF's
    `_compute_llama3_parameters`)."""
    freqs = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    if scaling is None:
        return freqs
    if scaling[0] == "linear":
        return freqs / scaling[1]
    _, factor, low, high, original = scaling
    wavelen = 2 * math.pi / freqs
    scaled = jnp.where(wavelen > original / low, freqs / factor, freqs)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return jnp.where(medium, smoothed, scaled)


def rope(x, positions, theta: float, scaling: tuple | None = None):
    """Rotary position embedding (Su et al. 2021), rotate-half form: the first D/2 features of a
    head pair with the last D/2 (the layout of HF Llama's `rotate_half`, not Meta's interleaved
    pairs). x [B, T, N, D], positions [T] (shared by every row) or [B, T] (each row its own, as
    in decoding). `scaling`: see `rope_frequencies`."""
    d = x.shape[-1]
    freqs = rope_frequencies(d, theta, scaling)  # [D/2]
    pos = positions.astype(jnp.float32)
    pos = pos[None] if pos.ndim == 1 else pos  # [B or 1, T]
    angles = pos[..., None] * freqs  # [B or 1, T, D/2]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head attention with grouped KV heads (Ainslie et al. 2023), fused QKV; options
    `qkv_bias` (a bias [K, G + 2, D] on the fused projection, Qwen2) and `qk_norm` (RMSNorm of each
    query and key head over D before RoPE, Qwen3).

    The QKV weight [E, K, G + 2, D] holds, for each of the K KV groups, its G = N / K query heads
    followed by its key and value head; splitting `kv_heads` over `tensor` keeps a group on one
    device. Megatron §3: QKV is column-parallel and wo [N, D, E] row-parallel, so a tensor-parallel
    layer needs exactly one all-reduce of [B, T, E] forward and one backward (one fused matmul
    gives one partial input gradient).
    """

    def __init__(self, cfg, rngs: nnx.Rngs):
        e, n, k, d = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wqkv = param(rngs, (e, k, n // k + 2, d), ("embed", "kv_heads", None, "kv"), 1.0 / math.sqrt(e))
        self.wo = param(rngs, (n, d, e), ("heads", "kv", "embed"), 1.0 / math.sqrt(n * d * 2 * cfg.layers))
        if getattr(cfg, "qkv_bias", False):  # Qwen2: biases on q, k and v (not on wo)
            self.bqkv = param(rngs, (k, n // k + 2, d), ("kv_heads", None, "kv"), init="zeros")
        if getattr(cfg, "qk_norm", False):  # Qwen3: RMSNorm over D of each q and k head, before RoPE
            self.q_norm = RMSNorm(d, cfg.norm_eps, rngs, getattr(cfg, "norm_offset", 0.0))
            self.k_norm = RMSNorm(d, cfg.norm_eps, rngs, getattr(cfg, "norm_offset", 0.0))
        self.cfg = cfg

    def __call__(self, x, positions, cache=None, segment_ids=None):
        """x [B, T, E], positions [T] or [B, T] (RoPE), segment_ids [B, T] (packed documents: a token
        sees its own document only) -> [B, T, E]; with `cache` ({"k", "v"} [B, K, S, D], positions
        [B, T]) -> ([B, T, E], the cache with this call's keys and values written at their positions)."""
        cfg, dt = self.cfg, x.dtype
        b, t, _ = x.shape
        g = cfg.heads // cfg.kv_heads
        qkv = jnp.einsum("bte,ekgd->btkgd", x, self.wqkv[...].astype(dt))  # [B, T, K, G+2, D]
        if getattr(cfg, "qkv_bias", False):
            qkv = qkv + self.bqkv[...].astype(dt)
        qkv = constrain(qkv, ("batch", "seq", "kv_heads", None, "kv"))
        q = qkv[:, :, :, :g].reshape(b, t, cfg.heads, cfg.head_dim)  # head n = k*G + j
        k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]  # [B, T, K, D]
        if getattr(cfg, "qk_norm", False):
            q, k = self.q_norm(q), self.k_norm(k)
        scaling = getattr(cfg, "rope_scaling", None)
        q, k = rope(q, positions, cfg.rope_theta, scaling), rope(k, positions, cfg.rope_theta, scaling)
        if getattr(cfg, "query_scale", None):  # scores q.k / sqrt(query_scale), not / sqrt(D) (Gemma 2)
            q = (q.astype(jnp.float32) * math.sqrt(cfg.head_dim / cfg.query_scale)).astype(q.dtype)
        adt = attention_dtype(dt)  # = dt, except fp16 on CPU (see meshpar.core.precision.attention_dtype)
        masks = dict(window=cfg.window, softcap=cfg.softcap)
        if cache is not None:
            cache = self._write(k, v, positions, cache)
        if cache is None or t == cache["k"].shape[2] > 1:  # training, or a prefill that fills its whole cache
            o = attention(
                q.astype(adt),
                k.astype(adt),
                v.astype(adt),
                causal=True,
                segment_ids=segment_ids,
                implementation=cfg.attention,
                context_strategy=cfg.context_strategy,
                **masks,
            ).astype(dt)  # [B, T, N, D]
        else:
            o = self._attend_cache(q, positions, cache, adt, **masks)
        o = constrain(o, ("batch", "seq", "heads", "kv"))
        out = jnp.einsum("btnd,nde->bte", o, self.wo[...].astype(dt))
        return out if cache is None else (out, cache)

    @staticmethod
    def _write(k, v, positions, cache):
        """k, v [B, T, K, D] written at positions [B, T] of the cache {"k", "v"} [B, K, S, D] (arrays, or
        `meshpar.nn.kvcache.View`s of the stacked cache, written in place). A call whose T fills the
        whole cache is a prefill from position 0: it attends over the prompt itself (`attention`, flash
        for long prompts), not over the cache."""
        b, t = positions.shape
        kv = cache["k"].shape[1]
        at = (jnp.arange(b)[:, None, None], jnp.arange(kv)[None, None, :], positions[:, :, None])  # [B, T, K] each
        names = CACHE_AXES[1:]

        def put(c, new):
            c = kvcache.write(c, at, new)
            if kvcache.is_view(c):  # the stack's `layers` is the pipeline's to split, or nobody's
                return kvcache.View(constrain(c.stack, (None, *names)), c.layer)
            return constrain(c, names)

        return {"k": put(cache["k"], k), "v": put(cache["v"], v)}

    @staticmethod
    def _attend_cache(q, positions, cache, adt, window=None, softcap=None):
        """q [B, T, N, D] (query head n = k * G + j, as in the fused QKV) to the cached positions s <=
        its own (and > its own - window): `meshpar.nn.kvcache.attend`."""
        b, t = positions.shape
        kv, d = cache["k"].shape[1], cache["k"].shape[3]
        qg = q.reshape(b, t, kv, -1, d)  # [B, T, K, G, D]
        o = kvcache.attend(qg, positions, cache["k"], cache["v"], adt, window=window, softcap=softcap)
        return o.reshape(b, t, -1, d).astype(q.dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward (Shazeer 2020): (silu(x Wg) * x Wu) Wd. [B, T, E] -> [B, T, E].

    Wg and Wu are one fused weight [E, 2, F] (column-parallel, split on F) and Wd [F, E] is
    row-parallel (Megatron §3): one all-reduce of [B, T, E] per direction under tensor parallelism.
    """

    def __init__(self, cfg, rngs: nnx.Rngs):
        e, f = cfg.embed, cfg.mlp
        self.w_in = param(rngs, (e, 2, f), ("embed", None, "mlp"), 1.0 / math.sqrt(e))
        self.w_down = param(rngs, (f, e), ("mlp", "embed"), 1.0 / math.sqrt(f * 2 * cfg.layers))
        self.act = getattr(cfg, "mlp_act", "silu")  # silu (SwiGLU) | gelu_tanh (GeGLU, Gemma)

    def __call__(self, x):
        dt = x.dtype
        g, u = gated_inputs(x, self.w_in[...].astype(dt))  # [B, T, F] each, pinned (or SP may gather Wg|Wu instead)
        h = swiglu(g, u) if self.act == "silu" else jax.nn.gelu(g, approximate=True) * u
        h = constrain(h, ("batch", "seq", "mlp"))
        return jnp.einsum("btf,fe->bte", h, self.w_down[...].astype(dt))


RESIDUAL = ("batch", "length", "embed")


class Block(nnx.Module):
    """Pre-norm decoder block: x + Attn(norm(x)), then + FFN(norm(x)); with `post_norms` (Gemma 2/3)
    each branch's output is normed too before it is added: x + norm(Attn(norm(x))). Returns (x, aux)
    where aux is a dict of per-layer scalars (empty for a dense block; MoE blocks report losses there)."""

    cache_views = True  # decodes through meshpar.nn.kvcache: a stacked cache is updated in place

    def __init__(self, cfg, rngs: nnx.Rngs, ffn=None):
        off = getattr(cfg, "norm_offset", 0.0)
        self.attn_norm = RMSNorm(cfg.embed, cfg.norm_eps, rngs, off)
        self.attn = Attention(cfg, rngs)
        self.ffn_norm = RMSNorm(cfg.embed, cfg.norm_eps, rngs, off)
        self.ffn = ffn if ffn is not None else MLP(cfg, rngs)
        if getattr(cfg, "post_norms", False):
            self.post_attn_norm = RMSNorm(cfg.embed, cfg.norm_eps, rngs, off)
            self.post_ffn_norm = RMSNorm(cfg.embed, cfg.norm_eps, rngs, off)
        self.post_norms = getattr(cfg, "post_norms", False)

    def __call__(self, x, positions, cache=None, segment_ids=None):
        """-> (x, aux); with a KV `cache` (decoding) -> (x, aux, cache)."""
        h = constrain(self.attn_norm(x), RESIDUAL)
        a = self.attn(h, positions, cache, segment_ids)
        if cache is not None:
            a, cache = a
        x = constrain(x + (self.post_attn_norm(a) if self.post_norms else a), RESIDUAL)
        h = constrain(self.ffn_norm(x), RESIDUAL)
        out = self.ffn(h)
        aux = {}
        if isinstance(out, tuple):
            out, aux = out
        x = constrain(x + (self.post_ffn_norm(out) if self.post_norms else out), RESIDUAL)
        return (x, aux) if cache is None else (x, aux, cache)


class Pattern(nnx.Module):
    """p consecutive blocks whose attention differs by position (Gemma 2: local then global; Gemma 3:
    five local, one global): blocks 0..p-2 see a window of `cfg.window` keys (with RoPE base and
    scaling `cfg.local_rope` where it is set), block p-1 sees every key before it. The stack scans
    over these groups, so each block keeps a static mask. `count` < p: the first `count` blocks only
    (the local tail of a stack whose layers are not a multiple of p). x [B, T, E] -> (x, {})."""

    cache_views = True  # its blocks decode through meshpar.nn.kvcache

    def __init__(self, cfg, rngs: nnx.Rngs, count: int | None = None):
        p = cfg.local_global
        local = cfg.replace(rope_theta=cfg.local_rope[0], rope_scaling=cfg.local_rope[1]) if cfg.local_rope else cfg
        self.blocks = nnx.List(
            [
                Block(local if i < p - 1 else cfg.replace(window=None), rngs)
                for i in range(p if count is None else count)
            ]
        )

    def __call__(self, x, positions, cache=None, segment_ids=None):
        """-> (x, {}); with `cache` (a list: one {"k", "v"} per block, decoding) -> (x, {}, cache)."""
        return in_order(list(self.blocks), x, positions, cache, segment_ids)


def in_order(blocks, x, positions, cache=None, segment_ids=None):
    """Blocks one after another, as one scanned group (`Pattern`, MoE super-blocks) -> (x, aux of the
    last block); with `cache` (a list: one {"k", "v"} per block, decoding) -> (x, aux, cache)."""
    if cache is None:
        for block in blocks[:-1]:
            x, _ = block(x, positions, segment_ids=segment_ids)
        return blocks[-1](x, positions, segment_ids=segment_ids)
    new = []
    for block, c in zip(blocks, cache):
        x, aux, c = block(x, positions, c)
        new.append(c)
    return x, aux, new
