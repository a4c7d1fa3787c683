"""The optimizer (`cfg.train`): AdamW (Loshchilov & Hutter 2019), global-norm clipping, linear warmup
then cosine decay to `lr * min_lr_ratio` at the last step."""

from __future__ import annotations

import jax
import optax

from meshpar.core.config import TrainConfig
from meshpar.core.sharding import ModelSpec


def make_optimizer(train: TrainConfig, steps: int, spec: ModelSpec) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019), linear warmup + cosine decay, global-norm clipping.
    Weight decay skips normalisation scales (logical axis `norm`) and vectors (biases; a stacked
    vector [layers, n] counts as a vector)."""
    t = train
    decay_mask = jax.tree.map(
        lambda names: "norm" not in names and len([n for n in names if n != "layers"]) > 1,
        spec.logical,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    return optax.chain(
        optax.clip_by_global_norm(t.clip_norm),
        optax.adamw(lr_schedule(train, steps), t.b1, t.b2, weight_decay=t.weight_decay, mask=decay_mask),
    )


def lr_schedule(train: TrainConfig, steps: int):
    """Linear warmup to `train.lr` over `warmup_steps`, cosine decay to `lr * min_lr_ratio` at `steps`.
    Evaluated at count + 1, so the first update already moves (lr / warmup_steps)."""
    t = train
    sched = optax.warmup_cosine_decay_schedule(
        0.0, t.lr, t.warmup_steps, max(steps, t.warmup_steps + 1), end_value=t.lr * t.min_lr_ratio
    )
    return lambda count: sched(count + 1)


def applied_count(opt_state):
    """AdamW's own update count (the one its schedule reads): unlike `state["step"]` it does not move
    on a skipped (non-finite) step, so the logged lr is the rate the update really applies."""
    adam = lambda s: isinstance(s, optax.ScaleByAdamState)
    return next(s for s in jax.tree.leaves(opt_state, is_leaf=adam) if adam(s)).count
