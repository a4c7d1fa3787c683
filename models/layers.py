"""Building blocks shared by the reference models. Every parameter carries `logical_axes` metadata
and every key activation is pinned with `meshpar.rules.constrain`; no mesh axis is named here.

Shapes use: B batch, T length, E embed (d_model), N query heads, K key/value heads, D head width,
F feed-forward width, V vocabulary.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar.precision import attention_dtype
from meshpar.rules import constrain


def param(rngs: nnx.Rngs, shape, logical, std: float | None = None, init: str = "normal") -> nnx.Param:
    """An fp32 parameter with logical axis names (`logical_axes` metadata, resolved by meshpar)."""
    if init == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
    return nnx.Param(value, logical_axes=tuple(logical))


class RMSNorm(nnx.Module):
    """x / rms(x) * scale (Zhang & Sennrich 2019), statistics in fp32. [B, T, E] -> [B, T, E]."""

    def __init__(self, dim: int, eps: float, rngs: nnx.Rngs):
        self.scale = param(rngs, (dim,), ("norm",), init="ones")
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)


def rope(x, positions, theta: float):
    """Rotary position embedding (Su et al. 2021), rotate-half form. x [B, T, N, D], positions [T]."""
    d = x.shape[-1]
    freqs = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))          # [D/2]
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]                # [T, D/2]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head attention with grouped KV heads (Ainslie et al. 2023), fused QKV.

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
        self.cfg = cfg

    def __call__(self, x, positions):
        """x [B, T, E] -> [B, T, E]."""
        cfg, dt = self.cfg, x.dtype
        b, t, _ = x.shape
        g = cfg.heads // cfg.kv_heads
        qkv = jnp.einsum("bte,ekgd->btkgd", x, self.wqkv[...].astype(dt))              # [B, T, K, G+2, D]
        qkv = constrain(qkv, ("batch", "seq", "kv_heads", None, "kv"))
        q = qkv[:, :, :, :g].reshape(b, t, cfg.heads, cfg.head_dim)                     # head n = k*G + j
        k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]                                     # [B, T, K, D]
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        impl = None if cfg.attention == "auto" else cfg.attention
        adt = attention_dtype(dt)   # = dt, except fp16 on CPU (see meshpar.precision.attention_dtype)
        o = jax.nn.dot_product_attention(q.astype(adt), k.astype(adt), v.astype(adt), is_causal=True,
                                         implementation=impl).astype(dt)                  # [B, T, N, D]
        o = constrain(o, ("batch", "seq", "heads", "kv"))
        return jnp.einsum("btnd,nde->bte", o, self.wo[...].astype(dt))


class MLP(nnx.Module):
    """SwiGLU feed-forward (Shazeer 2020): (silu(x Wg) * x Wu) Wd. [B, T, E] -> [B, T, E].

    Wg and Wu are one fused weight [E, 2, F] (column-parallel, split on F) and Wd [F, E] is
    row-parallel (Megatron §3): one all-reduce of [B, T, E] per direction under tensor parallelism.
    """

    def __init__(self, cfg, rngs: nnx.Rngs):
        e, f = cfg.embed, cfg.mlp
        self.w_in = param(rngs, (e, 2, f), ("embed", None, "mlp"), 1.0 / math.sqrt(e))
        self.w_down = param(rngs, (f, e), ("mlp", "embed"), 1.0 / math.sqrt(f * 2 * cfg.layers))

    def __call__(self, x):
        dt = x.dtype
        h = jnp.einsum("bte,ecf->btcf", x, self.w_in[...].astype(dt))                 # [B, T, 2, F]
        h = constrain(jax.nn.silu(h[:, :, 0]) * h[:, :, 1], ("batch", "seq", "mlp"))
        return jnp.einsum("btf,fe->bte", h, self.w_down[...].astype(dt))


RESIDUAL = ("batch", "length", "embed")


class Block(nnx.Module):
    """Pre-norm decoder block: x + Attn(norm(x)), then + FFN(norm(x)). Returns (x, aux) where aux is
    a dict of per-layer scalars (empty for a dense block; MoE blocks report their losses there)."""

    def __init__(self, cfg, rngs: nnx.Rngs, ffn=None):
        self.attn_norm = RMSNorm(cfg.embed, cfg.norm_eps, rngs)
        self.attn = Attention(cfg, rngs)
        self.ffn_norm = RMSNorm(cfg.embed, cfg.norm_eps, rngs)
        self.ffn = ffn if ffn is not None else MLP(cfg, rngs)

    def __call__(self, x, positions):
        h = constrain(self.attn_norm(x), RESIDUAL)
        x = constrain(x + self.attn(h, positions), RESIDUAL)
        h = constrain(self.ffn_norm(x), RESIDUAL)
        out = self.ffn(h)
        aux = {}
        if isinstance(out, tuple):
            out, aux = out
        return constrain(x + out, RESIDUAL), aux


def stacked(make, n: int, rngs: nnx.Rngs):
    """n copies of the module `make(rngs)` stacked on a leading `layers` axis (nnx.vmap)."""
    keys = jax.random.split(rngs.params(), n)

    @nnx.vmap(in_axes=0, out_axes=0)
    def create(key):
        return make(nnx.Rngs(params=key))

    mod = create(keys)
    for _, var in nnx.iter_graph(mod):
        if isinstance(var, nnx.Variable) and "logical_axes" in var.get_metadata():
            var.set_metadata("logical_axes", ("layers",) + tuple(var.get_metadata()["logical_axes"]))
    return mod


REMAT_POLICIES = {
    "none": None,
    "full": lambda: jax.checkpoint_policies.nothing_saveable,
    "save_dots": lambda: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload": lambda: jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


def scan_layers(layers_mod, x, positions, remat: str = "full", scan: bool = True):
    """Apply a stacked module [layers, ...] to x [B, T, E] layer by layer.

    `lax.scan` keeps one copy of the layer program (compile time independent of depth); the remat
    policy decides what the backward pass recomputes. Returns (x, aux) with aux stacked [layers].
    """
    graphdef, state = nnx.split(layers_mod)

    def pin(v):
        """One layer's weight slice, pinned to its at-rest layout (its logical axes minus `layers`).
        Under FSDP the weight stays sharded until use (an all-gather per layer) and, by
        transposition, its gradient is reduce-scattered per layer inside the backward loop instead
        of all-reduced whole and sliced after the loop."""
        names = v.get_metadata().get("logical_axes")
        return v.replace(constrain(v.get_value(), names[1:], what="parameter")) if names else v

    def body(carry, layer_state):
        layer_state = jax.tree.map(pin, layer_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        y, aux = nnx.merge(graphdef, layer_state)(carry, positions)
        return y, aux

    if REMAT_POLICIES[remat] is not None:
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat](), prevent_cse=not scan)
    if scan:
        return jax.lax.scan(body, x, state)
    n = jax.tree.leaves(state)[0].shape[0]
    auxes = []
    for i in range(n):
        x, aux = body(x, jax.tree.map(lambda a: a[i], state))
        auxes.append(aux)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *auxes) if auxes and auxes[0] else {}
