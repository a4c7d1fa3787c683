"""1F1B (PipeDream-Flush, Narayanan et al. 2021): forward and backward run explicitly, tick by tick,
from the lockstep program of `meshpar.parallel.schedules` (at tick t stage s runs F(t - s), then
B(t - 2(P-1) + s)); nothing is rerun. A forward tick keeps the stage's `jax.vjp` residuals (what the
remat policy saves; `save_dots` is Megatron's selective recompute, Korthikanti et al. 2022) in a
stash of at most 2P - 1 microbatches (`meshpar.parallel.residuals`), the backward tick applies them.

Shapes: P stages, M microbatches, b sequences per microbatch, Lc layers per stage, Kr stash slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshpar.nn import dropout
from meshpar.parallel.residuals import Residuals, carried, pulled
from meshpar.parallel.schedules import (
    BRANCH_SHARE,
    ONE_F_ONE_B_BRANCHES,
    POSITIONS,
    branch_shares,
    one_f_one_b_branches,
    one_f_one_b_program,
)
from meshpar.parallel.stage_model import (
    AXIS,
    StageModel,
    merge_stage_vars,
    microbatch,
    reduce_batch,
    vary,
    vary_tree,
    zeros,
    zeros_like_varying,
)


class Carry(NamedTuple):
    """The tick loop's carry. Between ticks `res` is the stash: per residual leaf (then per leaf of
    the state `pre` read) [Kr + 1, ...], Kr <= 2P - 1 microbatches forwarded and not yet backwarded
    plus a spare slot for ticks without a forward. Inside a tick's branch `res` is one slot: the one
    the tick read, which a forward replaces with its own residuals (a buffer passed through a
    conditional is copied whole, so the stash never enters one)."""

    res: list
    send_f: Any  # [b, ...] to the next stage's forward (used the tick it arrives)
    send_b: Any  # [b, ...] to the previous stage's backward
    dx0: Any  # stage 0's input cotangent: the embedding's backward runs after the switch
    y_last: Any  # the last stage's output of this tick (the protocol's post weight gradient)
    d_layers: Any  # gradient accumulators: this stage's layers [Lc, ...]
    d_outer: Any  #   the outer parameters, through the LM head
    d_embed: Any  #   the outer parameters, through pre (and a protocol model's post)
    ce: Any  # sums of the loss, the layers' aux loss, their metrics, the loss's metrics
    aux_loss: Any
    metrics: Any
    lmet: Any
    vars: Any  # the model's non-Param state


class Inbox(NamedTuple):
    """What a tick's branch reads: the forward input and backward cotangent received this tick, and
    the stash slot of its backward's microbatch."""

    x: Any
    dy: Any
    res: list


@dataclass
class _StageOps:
    """What a tick's branch runs on this stage: the forward (F), the backward (B) from the stash, and
    the last stage's fused forward + post + loss + backward; over the step's loop invariants."""

    model: StageModel
    outer: Any
    outer_e: Any  # the outer parameters as pre reads them (`StageModel.for_embed`)
    layers: Any  # this stage's [Lc, ...]
    mbs: Any  # the batch pytree [M, b, ...]
    seed: Any  # the loss's cotangent
    parts: Any  # [M]: microbatch i's loss counts parts[i] of the step's objective (`StageModel.parts`)
    zero_x: Any
    residuals: Any = None  # `Residuals`, set once its structure is traced

    def stage_only(self, lp, x, mb):
        y, a_loss, met = self.model.stage(self.outer, lp, x, mb)
        return (y, a_loss), met

    def share(self, mi):
        """Microbatch mi's share of the step's objective."""
        return self.parts[mi]

    def fwd(self, first: bool, c: Carry, ins: Inbox, mi) -> Carry:
        """A stage before the last: microbatch mi's forward; its residuals (and the state `pre`
        read) replace the slot `c.res`."""
        before = c.vars
        if first:
            x, after = self.model.pre(self.outer_e, self.layers, before, microbatch(self.mbs, mi))
            c = c._replace(vars=after)
        else:
            x = ins.x
        (y, a_loss), pull, met = jax.vjp(
            partial(self.stage_only, mb=microbatch(self.mbs, mi)), self.layers, x, has_aux=True
        )
        part = self.share(mi)
        return c._replace(
            send_f=vary(y),
            res=self.residuals.split(pull, self.layers) + jax.tree.leaves(before),
            aux_loss=c.aux_loss + part * a_loss,
            metrics=jax.tree.map(lambda acc, x_: acc + part * x_, c.metrics, met),
        )

    def bwd(self, first: bool, c: Carry, ins: Inbox, mi) -> Carry:
        """A stage before the last: the backward of microbatch mi, whose residuals are `ins.res`."""
        n_res = len(self.residuals.shapes)
        d_lp, dx = carried(
            self.residuals.join(ins.res[:n_res], self.layers)((pulled(ins.dy), self.seed * self.share(mi))),
            (self.layers, self.zero_x),
        )
        # stage 0's dx is the embedding's cotangent: its backward runs after the switch (see the tick)
        c = c._replace(dx0=dx) if first else c._replace(send_b=vary(dx))
        return c._replace(d_layers=jax.tree.map(jnp.add, c.d_layers, d_lp))

    def last(self, c: Carry, ins: Inbox, mi) -> Carry:
        """The last stage: microbatch mi's forward, post, loss and backward in one go. Post reads the
        outer parameters gathered over the batch axes, as pre does (the LM head explicitly, here), and
        the protocol's post's weight gradient is taken after the switch (see the tick): XLA resharded
        them in this branch with a collective-permute over all devices, which the other stages never
        join (a hang, JAX 0.10 on CPU)."""
        model, mb, part = self.model, microbatch(self.mbs, mi), self.share(mi)
        o = self.outer if model.lm else self.outer_e

        def f(lp, o_, x_):
            y_, a_, met_ = model.stage(o_, lp, x_, mb)
            ce_, lm_, vars_ = model.post_loss(model.for_embed(o_), lp, c.vars, y_, mb)
            return (ce_ + a_) * part, (ce_, a_, met_, lm_, vars_, y_)

        if model.lm:
            _, vjp, (ce, a_loss, met, lm, vars_, y) = jax.vjp(f, self.layers, o, ins.x, has_aux=True)
            d_lp, d_o, send_b = vjp(self.seed)
            c = c._replace(d_outer=jax.tree.map(jnp.add, c.d_outer, d_o))
        else:
            _, vjp, (ce, a_loss, met, lm, vars_, y) = jax.vjp(
                lambda lp, x_: f(lp, o, x_), self.layers, ins.x, has_aux=True
            )
            d_lp, send_b = vjp(self.seed)
        return c._replace(
            send_b=vary(carried(send_b, self.zero_x)),
            y_last=vary(y),
            vars=vars_,
            d_layers=jax.tree.map(jnp.add, c.d_layers, d_lp),
            ce=c.ce + part * ce,
            aux_loss=c.aux_loss + part * a_loss,
            metrics=jax.tree.map(lambda acc, x_: acc + part * x_, c.metrics, met),
            lmet=jax.tree.map(lambda acc, x_: acc + part * x_, c.lmet, lm),
        )


def grads(model: StageModel, p: int, m: int, outer, layers, vars, mbs, seed, total):
    """Body of the pipeline's shard_map under 1F1B: layers [Lc, ...] (this stage), vars the model's
    non-Param state, mbs the batch pytree [M, b, ...], seed the loss's cotangent (1, or the fp16 loss
    scale S), total the step's batch's weight (each microbatch's loss counts its share of it,
    `StageModel.parts`) -> (loss, loss of the parts, metrics, loss metrics, d_outer, d_layers,
    vars), gradients of loss * seed. The last stage runs F(m) and B(m) in one tick, fused."""
    (f_micro, b_micro), k_res = one_f_one_b_program(p, m)
    n = f_micro.shape[0]
    # [ticks, P] switch index into the branches this schedule runs: XLA compiles every branch of a
    # switch, and at P = 2 half of `ONE_F_ONE_B_BRANCHES` never run (no middle stage; the last stage
    # always runs F and B together)
    table = one_f_one_b_branches(f_micro, b_micro)
    used = sorted(set(table.flat))
    branch = np.searchsorted(used, table)
    shares = branch_shares(branch, len(used))
    stashes = jnp.asarray((f_micro >= 0) & (np.arange(p) < p - 1)[None, :])  # a forward that keeps residuals
    branch, f_micro, b_micro = map(jnp.asarray, (branch, f_micro, b_micro))

    # per-stage (and, manual over `data`, per-replica) partial gradients; psum'd once at the end
    outer, layers = vary_tree(outer), vary_tree(layers)
    outer_e = model.for_embed(outer)
    s = lax.axis_index(AXIS)
    seed = vary(seed.astype(jnp.float32))
    vars_in = vars
    mb0 = microbatch(mbs, 0)
    x_spec = jax.eval_shape(lambda: model.pre(outer_e, layers, vars, mb0)[0])
    zero_x = zeros(x_spec)
    _, _, met_spec = jax.eval_shape(model.stage, outer, layers, zero_x, mb0)
    _, lmet_spec, _ = jax.eval_shape(lambda: model.post_loss(outer, layers, vars, zero_x, mb0))
    fwd_perm = [(i, i + 1) for i in range(p - 1)]
    bwd_perm = [(i + 1, i) for i in range(p - 1)]
    var_leaves, var_tree = jax.tree.flatten(vars)

    ops = _StageOps(model, outer, outer_e, layers, mbs, seed, model.parts(mbs, total), zero_x)
    # the microbatch's rows are residuals too; typed as in the loop (picked by a stage-dependent index),
    # and so are the dropout keys' microbatch and first layer (meshpar.nn.dropout)
    with dropout.at(f_micro[0, s], s, layers):
        ops.residuals = Residuals(partial(ops.stage_only, mb=vary_tree(mb0)), layers, x_spec)
    n_res = len(ops.residuals.shapes)

    def branch_fn(i: int):
        """Switch branch i: `ONE_F_ONE_B_BRANCHES[used[i]]`, a position's ops, scoped by its share of the
        ticks (`inspect`) and its name."""
        position, what = ONE_F_ONE_B_BRANCHES[used[i]]

        def run(c: Carry, ins: Inbox, mf, mb) -> Carry:
            with (
                jax.named_scope(f"{BRANCH_SHARE}{shares[i]:.6g}"),
                jax.named_scope(f"{position}_{what or 'idle'}"),
                dropout.at(mf, s, layers),
            ):
                c = c._replace(send_f=vary(zero_x), send_b=vary(zero_x))
                if position == POSITIONS[-1] and what:
                    c = ops.last(c, ins, mf)
                else:
                    c = ops.fwd(position == POSITIONS[0], c, ins, mf) if "F" in what else c
                    c = ops.bwd(position == POSITIONS[0], c, ins, mb) if "B" in what else c
                return vary_tree(c)

        return run

    branches = [branch_fn(i) for i in range(len(used))]

    def tick(c: Carry, t):
        # 1. exchange what was sent at the end of the previous tick (every stage, every tick): this
        # tick's forward input and backward cotangent
        rf = lax.ppermute(c.send_f, AXIS, fwd_perm)
        rb = lax.ppermute(c.send_b, AXIS, bwd_perm)
        # 2. this stage's ops (a per-device conditional) on the slots of its microbatches
        mf, mb = f_micro[t, s], b_micro[t, s]
        stash, vars_read = c.res, c.vars
        ins = Inbox(rf, rb, [lax.dynamic_index_in_dim(r, mb % k_res, 0, keepdims=False) for r in stash])
        c = lax.switch(branch[t, s], branches, c._replace(res=ins.res), ins, mf, mb)
        at = jnp.where(stashes[t, s], mf % k_res, k_res)  # a tick without a forward writes the spare slot
        c = c._replace(res=[lax.dynamic_update_index_in_dim(r, new, at, 0) for r, new in zip(stash, c.res)])
        # 3. pre's backward (the embedding's scatter-add into its table) on every stage, with a zero
        # cotangent except on stage 0 after its backward: XLA's SPMD partitioner crashed on this
        # scatter inside a per-device branch when the table is FSDP-sharded (JAX 0.10). It reruns
        # pre from the state its forward read (the same dropout masks, the same statistics).
        mb_b = microbatch(mbs, jnp.maximum(mb, 0))
        read = jax.tree.unflatten(var_tree, ins.res[n_res:])
        _, embed_vjp = jax.vjp(lambda o: model.pre(model.for_embed(o), layers, read, mb_b)[0], outer_e)
        (d_e,) = embed_vjp(pulled(c.dx0))
        d_embed = jax.tree.map(jnp.add, c.d_embed, d_e)
        if not model.lm:  # 4. post's weight gradient, the same way: nonzero on the last stage after its forward
            mb_f = microbatch(mbs, jnp.maximum(mf, 0))
            _, post_vjp = jax.vjp(lambda o: model.post_loss(o, layers, vars_read, c.y_last, mb_f)[0], outer_e)
            d_post = seed * ops.share(jnp.maximum(mf, 0))
            (d_p,) = post_vjp(jnp.where((s == p - 1) & (mf >= 0), d_post, jnp.zeros_like(d_post)))
            d_embed = jax.tree.map(jnp.add, d_embed, d_p)
        return c._replace(d_embed=model.for_embed(d_embed), dx0=vary(zero_x)), None

    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    carry = Carry(
        *zeros_like_varying(
            (
                [jax.ShapeDtypeStruct((k_res + 1,) + r.shape, r.dtype) for r in [*ops.residuals.shapes, *var_leaves]],
                x_spec,
                x_spec,
                x_spec,
                x_spec,
                layers,
                outer,
                outer,
                f32,
                f32,
                met_spec,
                lmet_spec,
            )
        ),
        vary_tree(vars),
    )
    carry = carry._replace(d_embed=model.for_embed(carry.d_embed))
    c, _ = lax.scan(tick, carry, jnp.arange(n))
    return reduce(c, p, vars_in)


def reduce(c: Carry, p: int, vars_in):
    """The carry after the last tick -> (loss, loss of the parts, metrics, loss metrics, d_outer,
    d_layers, vars): sums over stages (psum over `pipeline`) and over replicas (`reduce_batch`;
    each microbatch already counted its share of the step's objective)."""
    ce = reduce_batch(c.ce, stages=True)
    aux_loss = reduce_batch(c.aux_loss, stages=True)
    # embedding-path gradients live in the gathered layout inside the loop (StageModel.for_embed);
    # summed over stages and replicas once per step (one all-reduce over pipeline x data)
    d_outer = jax.tree.map(lambda g, e: reduce_batch(g + e, stages=True), c.d_outer, c.d_embed)
    d_layers = jax.tree.map(reduce_batch, c.d_layers)
    metrics = jax.tree.map(reduce_batch, c.metrics)
    lmet = jax.tree.map(lambda a: reduce_batch(a, stages=True), c.lmet)
    return ce + aux_loss, ce, metrics, lmet, d_outer, d_layers, merge_stage_vars(vars_in, c.vars, p, AXIS)
