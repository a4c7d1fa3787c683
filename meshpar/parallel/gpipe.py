"""GPipe (Huang et al. 2019) and the interleaved (circular) schedule (Narayanan et al. 2021): the
pipeline's forward tick loop, differentiated by autodiff, each stage rematerialised.

At tick t stage s runs item i = t - s: microbatch i (GPipe, v = 1), or chunk r and microbatch g P +
rem % P of item i (interleaved, v chunks per device, `meshpar.parallel.schedules`). A device stashes
the input of each of its v M stage runs and reruns the stage in the backward. Shapes: P stages, v
chunks per device, Lc layers per chunk, M microbatches, b sequences per microbatch.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from meshpar.nn import dropout
from meshpar.parallel.stage_model import (
    AXIS,
    StageModel,
    merge_stage_vars,
    microbatch,
    reduce_batch,
    vary_tree,
    zeros,
    zeros_like_varying,
)


def circular_loss(model: StageModel, p: int, m: int, v: int, outer, layers, vars, mbs, total):
    """Body of the shard_map for GPipe (v = 1) and the circular schedule (v > 1); differentiated by
    autodiff. layers: this device's chunks [v, Lc, ...]; vars: the model's non-Param state; mbs: the
    batch pytree, leaves [M, b, ...]; total: the step's batch's weight, of which each microbatch's
    loss and metrics count their share (`StageModel.parts`) -> (loss, (loss of the parts, metrics
    [v, Lc], loss metrics, vars))."""
    # Invariant inputs become varying here, once: the transpose of this pcast (a psum of the outer
    # parameters' cotangent) then runs outside every per-device branch instead of inside one.
    outer, layers = vary_tree(outer), vary_tree(layers)  # (over `data` too: its psum, once)
    vars_in = vars
    outer_e = model.for_embed(outer)  # pre reads the outer parameters gathered (see StageModel.for_embed)
    s = lax.axis_index(AXIS)
    parts = model.parts(mbs, total)  # [M]: each microbatch's share of the step's objective
    n_items, ticks = v * m, v * m + p - 1
    perm = [(i, (i + 1) % p) for i in range(p)] if v > 1 else [(i, i + 1) for i in range(p - 1)]
    chunk0 = jax.tree.map(lambda a: a[0], layers)
    mb0 = microbatch(mbs, 0)
    x_spec = jax.eval_shape(lambda: model.pre(outer_e, chunk0, vars, mb0)[0])
    zero_x = zeros(x_spec)
    _, _, met_spec = jax.eval_shape(model.stage, outer, chunk0, zero_x, mb0)
    _, lmet_spec, _ = jax.eval_shape(lambda: model.post_loss(outer, chunk0, vars, zero_x, mb0))

    # Per-stage remat: only (r, x) are saved per tick; the chunk is picked inside, so the local
    # layers stay one loop-invariant residual instead of a per-tick copy of the chunk's weights.
    @partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def run_stage(lay, r, x, mb, micro):
        chunk = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, r, 0, keepdims=False), lay)
        with dropout.at(micro, r * p + s, chunk):  # chunk r * P + s's dropout keys (meshpar.nn.dropout)
            return model.stage(outer, chunk, x, mb)

    # Remat around the `cond`, not inside it: the checkpoint's residuals are then its inputs, and the
    # loop-invariant outer parameters stay one residual, where a checkpoint inside the branch made
    # the branch's inputs (the LM head's weights) a per-tick residual: [ticks, embed, vocab]. Post
    # reads the outer parameters gathered over the batch axes, as pre does (the protocol's gathered
    # before the loop, the LM head in the branch, explicitly): a resharding XLA chose inside this
    # branch (a collective-permute over all 8 devices for a head split on `embed` over `data` under
    # data x tensor, or beside an idle `tensor` under fsdp) is a collective the other stages'
    # devices never join, a deadlock.
    @jax.checkpoint
    def post_or_zero(o, vs, y, mb, last):
        zero = (jnp.zeros((), jnp.float32), zeros_like_varying(lmet_spec), vs)
        return lax.cond(
            last, lambda: vary_tree(model.post_loss(model.for_embed(o), chunk0, vs, y, mb)), lambda: vary_tree(zero)
        )

    def tick(carry, t):
        recv, vs, loss, aux_loss, metrics, lmet = carry
        i = t - s
        valid = (i >= 0) & (i < n_items)
        ic = jnp.clip(i, 0, n_items - 1)
        if v == 1:
            r, micro = jnp.zeros((), jnp.int32), ic
        else:
            g, rem = ic // (p * v), ic % (p * v)
            r, micro = rem // p, g * p + rem % p
        mb = microbatch(mbs, micro)
        first = (s == 0) & (r == 0) & valid  # pre runs once per microbatch: it may update state
        x, vs = lax.cond(first, lambda: vary_tree(model.pre(outer_e, chunk0, vs, mb)), lambda: (recv, vs))
        y, a_loss, met = run_stage(layers, r, x, mb, micro)
        last = (s == p - 1) & (r == v - 1) & valid
        ce, lm, vs = post_or_zero(outer if model.lm else outer_e, vs, y, mb, last)
        part = parts[micro]  # ce and lm are zeros on ticks without a loss
        w = valid.astype(jnp.float32) * part
        metrics = jax.tree.map(
            lambda acc, x_: lax.dynamic_update_index_in_dim(
                acc, lax.dynamic_index_in_dim(acc, r, 0, False) + w * x_, r, 0
            ),
            metrics,
            met,
        )
        send = lax.ppermute(y, AXIS, perm)
        lmet = jax.tree.map(lambda acc, x_: acc + part * x_, lmet, lm)
        return (send, vs, loss + part * ce, aux_loss + w * a_loss, metrics, lmet), None

    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    init = (
        *zeros_like_varying((x_spec,)),
        vary_tree(vars),
        *zeros_like_varying(
            (f32, f32, jax.tree.map(lambda a: jax.ShapeDtypeStruct((v,) + a.shape, a.dtype), met_spec), lmet_spec)
        ),
    )
    (_, vs, ce, aux_loss, metrics, lmet), _ = lax.scan(tick, init, jnp.arange(ticks))
    ce, aux_loss = reduce_batch(ce, stages=True), reduce_batch(aux_loss, stages=True)
    metrics = jax.tree.map(reduce_batch, metrics)
    lmet = jax.tree.map(lambda a: reduce_batch(a, stages=True), lmet)
    return ce + aux_loss, (ce, metrics, lmet, merge_stage_vars(vars_in, vs, p, AXIS))
