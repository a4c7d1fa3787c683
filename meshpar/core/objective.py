"""One objective per step, whatever cuts its batch: the whole batch's weighted mean loss.

A loss is a mean over what its batch holds: over the batch's rows by default, or a weighted mean
sum(w l) / sum(w) when it declares its weight with `@weighted(weight_fn)` (the built-in LM loss does:
the targets it counts, fewer than the tokens when documents are packed). A step cuts its batch into
parts k (accumulation microbatches, the data-parallel replicas that accumulate on their own under
ZeRO-1, a pipeline's microbatches), each of weight w_k, and the whole batch's mean is

    J = sum_k w_k L_k / W,    W = sum_k w_k,

which the equal mean (1/K) sum_k L_k matches only when every w_k is the same. A weight is data
(no gradient reaches it), so W is known before any part runs: the step computes it once from its
batch (`weight_of(loss)(batch)`), and each part's loss, metrics and gradients count by that part's
`share` w_k / W; the parts are then summed, never averaged. That is carrying (sum of w L, sum of w)
and dividing once, without a pass over the gradients at the end (Megatron-LM's per-token loss
normalisation makes the same move).

    @meshpar.weighted(lambda batch: batch["mask"].sum())
    def my_loss(model, batch):                      # the mask's weighted mean
        nll = ...                                   # [batch, length]
        return (batch["mask"] * nll).sum() / batch["mask"].sum(), {}

A pipeline's model (`meshpar.nn.stages`) declares it on its `loss` method the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Weight = Callable[[Any], jax.Array]  # a batch pytree -> its weight, a float32 scalar


def weighted(weight: Weight) -> Callable:
    """Decorator: the loss it wraps is a weighted mean whose weights sum to `weight(batch)` over a
    batch (a microbatch, a replica's share of one); the loss itself is unchanged."""

    def declare(loss):
        loss.weight = weight
        return loss

    return declare


def rows(batch) -> jax.Array:
    """The default weight: the examples a batch holds, its first leaf's leading dimension [B, ...]."""
    return jnp.asarray(jax.tree.leaves(batch)[0].shape[0], jnp.float32)


def weight_of(loss) -> Weight:
    """The weight a loss declared (`weighted`; a `functools.partial` of it keeps its function's),
    else `rows`: every example counts the same."""
    declared = getattr(getattr(loss, "func", loss), "weight", None)
    if declared is None:
        return rows
    return lambda batch: jnp.asarray(declared(batch), jnp.float32)


def share(weight: jax.Array, total: jax.Array) -> jax.Array:
    """w_k / W, a part's share of the step's objective (0 where the whole batch weighs nothing)."""
    return jnp.where(total > 0, weight / jnp.where(total > 0, total, 1.0), 0.0).astype(jnp.float32)


def scaled(tree, by: jax.Array):
    """Each leaf of a tree (a loss, its metrics, gradients) times a part's share `by` (float32)."""
    return jax.tree.map(lambda a: a * by, tree)


def counted(out: tuple, weight: Weight, batch, total: jax.Array | None) -> tuple:
    """A part's (loss, metrics) as its share of the step's objective: both times `share(weight(batch),
    total)`; unchanged without a `total` (the batch is the step's whole batch)."""
    if total is None:
        return out
    loss, metrics = out
    return scaled((loss, dict(metrics)), share(weight(batch), total))
