"""Model FLOPs for MFU: what one token (or example) costs, and what a device can do.

MFU = model FLOPs per step / (step time x devices x peak), after PaLM (Chowdhery et al. 2022)
appendix B. Works for any model: the attention term needs `layers`, `heads` and `head_dim` on the
model's `cfg` (the reference decoders have them); without them it is 6N per token.
"""
from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp

from meshpar.sharding import ModelSpec


def active_params(spec: ModelSpec, cfg) -> float:
    """Parameters one token's forward pass multiplies with: all but the input embedding table (a
    gather, not a matmul), and of each expert weight (logical axis `expert`, size E) only the
    top_k / E share its token is routed to."""
    from meshpar.moe import TOP_K
    top_k = TOP_K[cfg.moe.routing]
    total = 0.0
    for shape, names in zip(jax.tree.leaves(spec.shapes),
                            jax.tree.leaves(spec.logical, is_leaf=lambda x: isinstance(x, tuple))):
        if names == ("vocab", "embed"):
            continue
        n = float(math.prod(shape.shape))
        if "expert" in names:
            n *= top_k / shape.shape[names.index("expert")]
        total += n
    return total


def flops_per_token(model_cfg, n_active: float, length: int) -> float:
    """PaLM (Chowdhery et al. 2022) appendix B: 6N + 12*L*H*Q*T per token, N the parameters a token
    passes through (`active_params`). Convention: the attention term counts the full T x T score
    matrix (no causal halving), as PaLM does; it is left out for a model whose `cfg` does not say
    `layers`, `heads` and `head_dim`."""
    attn = [getattr(model_cfg, k, None) for k in ("layers", "heads", "head_dim")]
    return 6.0 * n_active + (12.0 * math.prod(attn) * length if all(attn) else 0.0)


_PEAK_BF16 = [("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("B200", 2250e12), ("L4", 121e12),
              ("TPU v6", 918e12), ("TPU v5p", 459e12), ("TPU v5", 197e12), ("TPU v4", 275e12)]


def peak_flops_per_device(cfg) -> tuple[float, str]:
    """Dense bf16 peak per device: config, then a table of device kinds, else a measured CPU matmul rate."""
    if cfg.train.peak_tflops:
        return cfg.train.peak_tflops * 1e12, "train.peak_tflops"
    dev = jax.local_devices()[0]      # this process's own (jax.devices()[0] may be another process's)
    for key, peak in _PEAK_BF16:
        if key in dev.device_kind:
            return peak, f"{dev.device_kind} datasheet"
    n = 512
    a = jax.device_put(jnp.ones((n, n), jnp.float32), dev)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    reps, t0 = 20, time.perf_counter()
    for _ in range(reps):
        r = f(a)
    r.block_until_ready()
    host = 2 * n ** 3 * reps / (time.perf_counter() - t0)
    return host / jax.local_device_count(), "measured host matmul / fake devices"
