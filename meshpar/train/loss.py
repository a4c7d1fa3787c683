"""Losses a step can take: `lm_loss`, next-token cross-entropy (the default), and the contract every
loss keeps: `(model, batch) -> (scalar loss, metrics dict)`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from meshpar.core import precision as precision_lib
from meshpar.core.errors import ConfigError


def lm_loss(model, tokens) -> tuple[jax.Array, dict]:
    """Next-token cross-entropy of tokens [B, T+1] (the default loss). The model maps tokens [B, T]
    to logits [B, T, V], or to (logits, aux) where aux values under the key `loss` (already weighted,
    e.g. MoE load balancing) are added to the loss and the rest are reported as metrics."""
    out = model(tokens[:, :-1])
    logits, aux = out if isinstance(out, tuple) else (out, {})
    ce = precision_lib.cross_entropy(logits.astype(precision_lib.active_policy().output_dtype), tokens[:, 1:])
    aux = dict(aux)
    extra = jnp.sum(aux.pop("loss")) if "loss" in aux else 0.0
    return ce + extra, {"ce": ce, **aux}


def check_loss(out, name: str):
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise ConfigError(f"loss function {name} must return (loss, metrics_dict), got {type(out).__name__}")
    loss, metrics = out
    if jnp.shape(loss) != ():
        raise ConfigError(f"loss function {name} returned a loss of shape {tuple(jnp.shape(loss))}; it must be a "
                          "scalar (reduce it, e.g. with .mean())")
    return loss, metrics
