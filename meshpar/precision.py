"""Mixed precision policies (Micikevicius et al. 2018): fp32 master weights and optimizer state,
low-precision compute, fp32 logits / softmax / loss.

A policy is a small frozen object; model code asks it for dtypes, never hard-codes them.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Policy:
    name: str
    param_dtype: jnp.dtype      # at rest: parameters and optimizer state
    compute_dtype: jnp.dtype    # matmuls and activations
    output_dtype: jnp.dtype     # logits, softmax and loss

    def cast_to_compute(self, tree):
        """Cast floating leaves of `tree` (e.g. parameters) to the compute dtype."""
        return jax.tree.map(lambda x: x.astype(self.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                            tree)


POLICIES: dict[str, Policy] = {
    "bf16": Policy("bf16", jnp.float32, jnp.bfloat16, jnp.float32),
    "fp32": Policy("fp32", jnp.float32, jnp.float32, jnp.float32),
}


def get_policy(name: str) -> Policy:
    from meshpar.errors import ConfigError, suggest
    if name not in POLICIES:
        raise ConfigError(f"unknown precision policy '{name}'" + suggest(name, POLICIES))
    return POLICIES[name]


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy, computed in fp32 with a max-shifted log-softmax.

    logits [batch, length, vocab] (any float dtype), targets [batch, length] int -> scalar fp32.
    The target logit is picked with a one-hot contraction so a vocab-sharded `logits` needs only
    the small all-reduces of the max, the sum of exponentials and the picked logit.
    """
    logits = logits.astype(jnp.float32)
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    log_z = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    picked = jnp.sum(shifted * jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32), axis=-1)
    nll = log_z - picked
    if weights is None:
        return jnp.mean(nll)
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)
