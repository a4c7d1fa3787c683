"""Pipeline parallelism over the `pipeline` mesh axis: GPipe, 1F1B and interleaved (circular) schedules.

Pipelining is the one strategy GSPMD cannot infer, so it is written by hand: the stacked layers
[L, ...] are cut into P = mesh.pipeline stages (logical `stage`/`layers` -> mesh `pipeline`) and the
batch pytree [B, ...] into M microbatches [M, B/M, ...]; one `jax.shard_map` is *manual over
`pipeline`* (and over `data` when `data` leads the batch, splits no parameter and the model has no
non-Param state), so `fsdp`, `tensor` and `expert` stay automatic inside it and PP composes with
DP/FSDP/TP/EP. Manual over `data`, each replica accumulates its own gradients over the ticks and
they are reduced over `data` once per step; automatic, XLA all-reduced a stage's whole gradient on
every tick. With sequences split over `context` (the built-in LM loss), it is manual over `context`
as well: the LM's rows [B, T] (`meshpar.nn.stages.lm_rows`) are put in the balanced order before it,
each device's stage sees [b, T/cp, E], attention gathers K/V over `context` inside the stage
(`meshpar.parallel.context`) and the loss sums its tokens over `context`.
Activations [b, T, E] (b = B/M; or any pytree of arrays `pre` returns, an encoder-decoder's decoder
stream and encoder output, say) move between neighbouring stages with `lax.ppermute`.
The model's parts (meshpar.nn.stages: the LM's embed / head + cross-entropy, or a user model's pre /
post + loss) sit outside the pipelined stack: the first stage runs `pre`, the last `post` and the
loss, microbatch by microbatch, so no tensor with a full-batch or full-stack dimension crosses the
pipeline. Their parameters enter the shard_map replicated over `pipeline` (still split over the
other axes), their gradients psum'd over `pipeline` once per step; their non-Param state is carried
through the ticks and taken from the stage that changed it.

Shapes: L layers, P stages, v virtual stages (chunks) per device, Lc = L / (P v) layers per chunk,
M microbatches, b sequences per microbatch, T length, E embed. `F3` = forward of microbatch 3,
`B3` = its backward, `.` = idle (the bubble); interleaved ops carry their chunk, `F3.1`.

The schedules (tick tables) live in `meshpar.parallel.schedules`; this module executes them. GPipe and
interleaved are differentiated by autodiff of the forward tick loop, each stage rematerialised (its
forward rerun in the backward from its stashed input): a device stashes M stage inputs (interleaved
v M). 1F1B runs forward and backward explicitly and reruns nothing: a forward tick keeps the stage's
`jax.vjp` residuals (what the remat policy saves; `save_dots` is Megatron's selective recompute,
Korthikanti et al. 2022) for at most 2P - 1 microbatches, and the backward tick applies them
(`Residuals`; memory in bench/RESULTS.md, `## Pipeline`).

Stored layer order stays the model's order (so a checkpoint means the same model on any mesh, and the
pipelined loss equals the non-pipelined one); at rest device s holds layers [s L/P, (s+1) L/P). The
interleaved schedule needs chunks {r P + s}; the step moves them there with one all-to-all over
`pipeline` (and the gradients back), never an all-gather of the stack.

`batch.microbatches` (gradient accumulation, outside) and `pipeline.microbatches` (M, inside one
pipelined forward/backward) are independent: each accumulation step is pipelined into M microbatches.

Workarounds for XLA's SPMD partitioner (JAX 0.10, CPU): inside a partially manual shard_map it
crashes on the embedding's gather/scatter when the table is split on E over the batch axes (FSDP), so
the first stage reads the outer parameters gathered over data/fsdp/expert (`StageModel.for_embed`, what
FSDP does at a weight's use anyway) and 1F1B runs the embedding's scatter-add backward after its
per-device switch, on every stage, with a zero cotangent except on stage 0. A user's loss reads its
inputs whole (`StageModel.post_loss`: a gather over a vocab split over `tensor` aborted, a hang).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from meshpar.core.errors import ConfigError, ShardingError
from meshpar.core.rules import BATCH_AXES, spec_axes, without
from meshpar.nn import dropout, moe
from meshpar.parallel import context
from meshpar.parallel.residuals import Residuals, carried, pulled
from meshpar.parallel.schedules import BRANCH_SHARE, branch_shares, one_f_one_b_branches, one_f_one_b_program
from meshpar.nn.stages import StageModel, lm_rows, manual_axes as _manual_axes, merge_stage_vars, vary as _vary, zeros

AXIS = "pipeline"
# the axes FSDP splits weights over; 1F1B's stages gather a layer's weights over them at use, before
# the layer, explicitly (`meshpar.core.rules.at_use`): the reshards XLA chose inside a stage's branch
# joined the other stages' devices (a deadlock). Expert weights stay split over `expert`.
FSDP_AXES = ("data", "fsdp")


# ----------------------------------------------------------------------------------------------
# Config checks (one line each, naming the key and a fix).

def check(pc, batch, layout, shapes: dict, stack: str, loss: str | None = None) -> None:
    """Raise ConfigError/ShardingError for a pipelined run that cannot run: `pc` its `cfg.pipeline`,
    `batch` its `cfg.batch`, shapes the model's parameter shapes (pure dict, `ModelSpec.shapes`),
    `stack` what sets the number of stacked blocks, as the user wrote it (`model.layers=4`,
    `model.size=tiny`, a user model's `MyModel.layers`), `loss` the name of a loss other than the
    built-in LM's (None: the LM's)."""
    p = layout.shape.get(AXIS, 1)
    m, v = pc.microbatches, pc.virtual_stages
    if p <= 1:
        return
    cp = layout.shape.get(context.AXIS, 1)
    if loss is not None and cp > 1:
        raise ConfigError(f"mesh.context={cp} with mesh.pipeline > 1 needs the built-in LM loss (train.loss=lm): a "
                          f"pipeline stage splits the LM's rows over context, and knows nothing of {loss}'s batch; set "
                          "mesh.context=1 or mesh.pipeline=1")
    _split_params(shapes)
    num_layers = jax.tree.leaves(shapes["layers"])[0].shape[0]
    if v > 1 and pc.schedule != "interleaved":
        raise ConfigError(f"pipeline.virtual_stages={v} needs pipeline.schedule=interleaved "
                          f"(got {pc.schedule}); set pipeline.virtual_stages=1 or the interleaved schedule")
    if num_layers % (p * v):
        what = stack if stack == f"model.layers={num_layers}" else f"{stack} stacks {num_layers} blocks, which"
        raise ConfigError(f"{what} is not divisible by mesh.pipeline={p} x pipeline.virtual_stages={v} "
                          f"(= {p * v} chunks); use a multiple of {p * v} stacked layers")
    if pc.schedule == "interleaved" and v > 1 and m % p:
        raise ConfigError(f"pipeline.microbatches={m} is not a multiple of mesh.pipeline={p}, which the "
                          f"interleaved schedule needs (microbatches enter in groups of {p}); "
                          f"use {p * max(1, round(m / p))}")
    rows = batch.global_size // batch.microbatches
    what = (f"batch.global_size={batch.global_size}" if batch.microbatches == 1 else
            f"the accumulation step of {rows} sequences (batch.global_size={batch.global_size} / "
            f"batch.microbatches={batch.microbatches})")
    if rows % m:
        raise ConfigError(f"{what} does not split into pipeline.microbatches={m} microbatches; "
                          f"use a multiple of {m * batch.microbatches} for batch.global_size")
    dp = layout.ways("batch")
    if (rows // m) % dp:
        raise ShardingError(f"the pipeline microbatch of {rows // m} sequences ({what} / pipeline.microbatches={m})"
                            f" is not divisible by the data-parallel size {dp}; use a multiple of "
                            f"{dp * m * batch.microbatches} for batch.global_size")


# ----------------------------------------------------------------------------------------------
# Executors.

def _reduce_batch(x):
    """Mean over the manual batch axis (`data`), once per step; identity without one."""
    axes = tuple(a for a in _manual_axes() if a != AXIS)
    return lax.pmean(x, axes) if axes else x


def _vary_tree(tree):
    return jax.tree.map(_vary, tree)


def _zeros_like_varying(tree):
    return jax.tree.map(lambda a: _vary(jnp.zeros(a.shape, a.dtype)), tree)


def _split_params(params: dict):
    if "layers" not in params:
        raise ConfigError("pipelining needs a model with stacked layers under the parameter key 'layers' "
                          "(meshpar.nn.layers.stacked); set mesh.pipeline=1 for this model")
    outer = {k: v for k, v in params.items() if k != "layers"}
    return outer, params["layers"]


def _micro(mbs, i):
    """Microbatch i of a batch pytree whose leaves are [M, b, ...]."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), mbs)


def _circular_loss(model: StageModel, p: int, m: int, v: int, outer, layers, vars, mbs):
    """Body of the shard_map for GPipe (v = 1) and the circular schedule (v > 1); differentiated by
    autodiff. layers: this device's chunks [v, Lc, ...]; vars: the model's non-Param state; mbs: the
    batch pytree, leaves [M, b, ...] -> (loss, (loss of the parts, metrics [v, Lc], loss metrics, vars))."""
    # Invariant inputs become varying here, once: the transpose of this pcast (a psum of the outer
    # parameters' cotangent) then runs outside every per-device branch instead of inside one.
    outer, layers = _vary_tree(outer), _vary_tree(layers)   # (over `data` too: its psum, once)
    vars_in = vars
    outer_e = model.for_embed(outer)
    s = lax.axis_index(AXIS)
    n_items, ticks = v * m, v * m + p - 1
    perm = [(i, (i + 1) % p) for i in range(p)] if v > 1 else [(i, i + 1) for i in range(p - 1)]
    chunk0 = jax.tree.map(lambda a: a[0], layers)
    mb0 = _micro(mbs, 0)
    x_spec = jax.eval_shape(lambda: model.pre(outer_e, chunk0, vars, mb0)[0])
    zero_x = zeros(x_spec)
    _, _, met_spec = jax.eval_shape(model.stage, outer, chunk0, zero_x, mb0)
    _, lmet_spec, _ = jax.eval_shape(lambda: model.post_loss(outer, chunk0, vars, zero_x, mb0))

    # Per-stage remat: only (r, x) are saved per tick; the chunk is picked inside, so the local
    # layers stay one loop-invariant residual instead of a per-tick copy of the chunk's weights.
    @partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def run_stage(lay, r, x, mb, micro):
        chunk = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, r, 0, keepdims=False), lay)
        with dropout.at(micro, r * p + s, chunk):    # chunk r * P + s's dropout keys (meshpar.nn.dropout)
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
        zero = (jnp.zeros((), jnp.float32), _zeros_like_varying(lmet_spec), vs)
        return lax.cond(last, lambda: _vary_tree(model.post_loss(model.for_embed(o), chunk0, vs, y, mb)),
                        lambda: _vary_tree(zero))

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
        mb = _micro(mbs, micro)
        first = (s == 0) & (r == 0) & valid           # pre runs once per microbatch: it may update state
        x, vs = lax.cond(first, lambda: _vary_tree(model.pre(outer_e, chunk0, vs, mb)), lambda: (recv, vs))
        y, a_loss, met = run_stage(layers, r, x, mb, micro)
        last = (s == p - 1) & (r == v - 1) & valid
        ce, lm, vs = post_or_zero(outer if model.lm else outer_e, vs, y, mb, last)
        w = valid.astype(jnp.float32)
        metrics = jax.tree.map(lambda acc, x_: lax.dynamic_update_index_in_dim(
            acc, lax.dynamic_index_in_dim(acc, r, 0, False) + w * x_, r, 0), metrics, met)
        send = lax.ppermute(y, AXIS, perm)
        return (send, vs, loss + ce, aux_loss + w * a_loss, metrics, jax.tree.map(jnp.add, lmet, lm)), None

    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    init = (*_zeros_like_varying((x_spec,)), _vary_tree(vars), *_zeros_like_varying((
        f32, f32, jax.tree.map(lambda a: jax.ShapeDtypeStruct((v,) + a.shape, a.dtype), met_spec), lmet_spec)))
    (_, vs, ce, aux_loss, metrics, lmet), _ = lax.scan(tick, init, jnp.arange(ticks))
    ce, aux_loss = _reduce_batch(lax.psum(ce, AXIS) / m), _reduce_batch(lax.psum(aux_loss, AXIS) / m)
    metrics = jax.tree.map(lambda a: _reduce_batch(a / m), metrics)
    lmet = jax.tree.map(lambda a: _reduce_batch(lax.psum(a, AXIS) / m), lmet)
    return ce + aux_loss, (ce, metrics, lmet, merge_stage_vars(vars_in, vs, p, AXIS))


def _one_f_one_b_grads(model: StageModel, p: int, m: int, outer, layers, vars, mbs, seed):
    """Body of the shard_map for 1F1B: forward and backward run explicitly from the lockstep program
    (`meshpar.parallel.schedules.one_f_one_b_program`: at tick t stage s runs F(t - s), then B(t - 2(P-1) + s)).

    layers [Lc, ...] (this stage), vars: the model's non-Param state, mbs: the batch pytree [M, b, ...],
    seed: the loss's cotangent (1, or the fp16 loss scale S) -> (loss, loss of the parts, metrics,
    loss metrics, d_outer, d_layers, vars), gradients of loss * seed.
    Carry: res [Kr + 1, ...] per residual leaf (`Residuals`, then the state `pre` read; Kr <= 2P - 1
    microbatches forwarded and not yet backwarded, plus a spare slot for ticks without a forward),
    the two outgoing payloads [b, ...] (each used the tick it arrives), the gradient accumulators.
    The last stage runs F(m) and B(m) in one tick, fused. The backward of `pre` runs after the switch
    (see the module docstring), from the state its forward read.
    """
    (f_micro, b_micro), k_res = one_f_one_b_program(p, m)
    n = f_micro.shape[0]
    branch = one_f_one_b_branches(f_micro, b_micro)          # [ticks, P] switch index
    shares = branch_shares(branch, 10)
    stashes = jnp.asarray((f_micro >= 0) & (np.arange(p) < p - 1)[None, :])   # a forward that keeps residuals
    branch, f_micro, b_micro = map(jnp.asarray, (branch, f_micro, b_micro))

    # per-stage (and, manual over `data`, per-replica) partial gradients; psum'd once at the end
    outer, layers = _vary_tree(outer), _vary_tree(layers)
    outer_e = model.for_embed(outer)
    s = lax.axis_index(AXIS)
    inv_m = 1.0 / m
    seed = _vary(seed.astype(jnp.float32))
    seed_m = seed * inv_m               # cotangent of each microbatch's aux loss (the loss is a mean)
    vars_in = vars
    mb0 = _micro(mbs, 0)
    x_spec = jax.eval_shape(lambda: model.pre(outer_e, layers, vars, mb0)[0])
    zero_x = zeros(x_spec)
    _, _, met_spec = jax.eval_shape(model.stage, outer, layers, zero_x, mb0)
    _, lmet_spec, _ = jax.eval_shape(lambda: model.post_loss(outer, layers, vars, zero_x, mb0))
    fwd_perm = [(i, i + 1) for i in range(p - 1)]
    bwd_perm = [(i + 1, i) for i in range(p - 1)]
    var_leaves, var_tree = jax.tree.flatten(vars)

    def stage_only(lp, x, mb):
        y, a_loss, met = model.stage(outer, lp, x, mb)
        return (y, a_loss), met

    # the microbatch's rows are residuals too; typed as in the loop (picked by a stage-dependent index),
    # and so are the dropout keys' microbatch and first layer (meshpar.nn.dropout)
    with dropout.at(f_micro[0, s], s, layers):
        residuals = Residuals(partial(stage_only, mb=_vary_tree(mb0)), layers, x_spec)
    n_res = len(residuals.shapes)

    # The branches read and write one slot of the stash (`ins["res"]`, `res_new`), never the stash
    # itself: a buffer passed through a conditional is copied whole.
    def fwd(position, c, ins, mi):
        """Stages before the last: microbatch mi's forward; its residuals (and the state `pre` read)
        go to `res_new`."""
        before, c = c["vars"], dict(c)
        if position == 0:
            x, c["vars"] = model.pre(outer_e, layers, before, _micro(mbs, mi))
        else:
            x = ins["x"]
        (y, a_loss), pull, met = jax.vjp(partial(stage_only, mb=_micro(mbs, mi)), layers, x, has_aux=True)
        return {**c, "send_f": _vary(y), "res_new": residuals.split(pull, layers) + jax.tree.leaves(before),
                "aux_loss": c["aux_loss"] + a_loss, "metrics": jax.tree.map(jnp.add, c["metrics"], met)}

    def bwd(position, c, ins, mi):
        """Stages before the last: microbatch mi's backward from its stashed residuals."""
        d_lp, dx = carried(residuals.join(ins["res"][:n_res], layers)((pulled(ins["dy"]), seed_m)), (layers, zero_x))
        # stage 0's dx is the embedding's cotangent: its backward runs after the switch (see tick)
        out = {**c, "dx0": dx} if position == 0 else {**c, "send_b": _vary(dx)}
        return {**out, "d_layers": jax.tree.map(jnp.add, c["d_layers"], d_lp)}

    def last(c, ins, mi):
        """The last stage: microbatch mi's forward, post, loss and backward in one go. Post reads the
        outer parameters gathered over the batch axes, as pre does (the LM head explicitly, here), and
        the protocol's post's weight gradient is taken after the switch (see tick): XLA resharded them
        in this branch with a collective-permute over all devices, which the other stages never join."""
        mb = _micro(mbs, mi)
        o = outer if model.lm else outer_e

        def f(lp, o_, x_):
            y_, a_, met_ = model.stage(o_, lp, x_, mb)
            ce_, lm_, vars_ = model.post_loss(model.for_embed(o_), lp, c["vars"], y_, mb)
            return (ce_ + a_) * inv_m, (ce_, a_, met_, lm_, vars_, y_)
        if model.lm:
            _, vjp, (ce, a_loss, met, lm, vars_, y) = jax.vjp(f, layers, o, ins["x"], has_aux=True)
            d_lp, d_o, send_b = vjp(seed)
            c = {**c, "d_outer": jax.tree.map(jnp.add, c["d_outer"], d_o)}
        else:
            _, vjp, (ce, a_loss, met, lm, vars_, y) = jax.vjp(lambda lp, x_: f(lp, o, x_), layers, ins["x"],
                                                              has_aux=True)
            d_lp, send_b = vjp(seed)
        return {**c, "send_b": _vary(carried(send_b, zero_x)), "y_last": _vary(y), "vars": vars_,
                "d_layers": jax.tree.map(jnp.add, c["d_layers"], d_lp), "ce": c["ce"] + ce,
                "aux_loss": c["aux_loss"] + a_loss, "metrics": jax.tree.map(jnp.add, c["metrics"], met),
                "lmet": jax.tree.map(jnp.add, c["lmet"], lm)}

    def branch_fn(i, position, ops):
        """Branch i: a position's ops ("F", "B", "FB", "" idle), scoped by tick share (`inspect`) and name."""
        def run(c, ins, mf, mb):
            what = f"{('first', 'middle', 'last')[position]}_{ops or 'idle'}"
            with jax.named_scope(f"{BRANCH_SHARE}{shares[i]:.6g}"), jax.named_scope(what), dropout.at(mf, s, layers):
                c = {**c, "send_f": _vary(zero_x), "send_b": _vary(zero_x)}
                if position == 2 and ops:
                    c = last(c, ins, mf)
                else:
                    c = fwd(position, c, ins, mf) if "F" in ops else c
                    c = bwd(position, c, ins, mb) if "B" in ops else c
                return _vary_tree(c)
        return run

    # in the order of `meshpar.parallel.schedules.one_f_one_b_branches`: idle, then F, B, F+B by position
    branches = [branch_fn(0, 0, "")] + [branch_fn(1 + 3 * q + k, q, ops) for q in range(3)
                                        for k, ops in enumerate(("F", "B", "FB"))]

    def tick(c, t):
        # 1. exchange what was sent at the end of the previous tick (every stage, every tick): this
        # tick's forward input and backward cotangent
        rf = lax.ppermute(c["send_f"], AXIS, fwd_perm)
        rb = lax.ppermute(c["send_b"], AXIS, bwd_perm)
        # 2. this stage's ops (a per-device conditional) on the slots of its microbatches
        mf, mb = f_micro[t, s], b_micro[t, s]
        stash, vars_read = c["res"], c["vars"]
        ins = {"x": rf, "dy": rb, "res": [lax.dynamic_index_in_dim(r, mb % k_res, 0, keepdims=False) for r in stash]}
        rest = {k: v for k, v in c.items() if k != "res"}
        rest["res_new"] = ins["res"]         # what a tick without a forward writes to the spare slot
        c = lax.switch(branch[t, s], branches, rest, ins, mf, mb)
        at = jnp.where(stashes[t, s], mf % k_res, k_res)
        c["res"] = [lax.dynamic_update_index_in_dim(r, new, at, 0) for r, new in zip(stash, c.pop("res_new"))]
        # 3. pre's backward (the embedding's scatter-add into its table) on every stage, with a zero
        # cotangent except on stage 0 after its backward: XLA's SPMD partitioner crashes on this
        # scatter inside a per-device branch when the table is FSDP-sharded (JAX 0.10). It reruns
        # pre from the state its forward read (the same dropout masks, the same statistics).
        mb_b = _micro(mbs, jnp.maximum(mb, 0))
        read = jax.tree.unflatten(var_tree, ins["res"][n_res:])
        _, embed_vjp = jax.vjp(lambda o: model.pre(model.for_embed(o), layers, read, mb_b)[0], outer_e)
        (d_e,) = embed_vjp(pulled(c["dx0"]))
        d_embed = jax.tree.map(jnp.add, c["d_embed"], d_e)
        if not model.lm:   # 4. post's weight gradient, the same way: nonzero on the last stage after its forward
            mb_f = _micro(mbs, jnp.maximum(mf, 0))
            _, post_vjp = jax.vjp(lambda o: model.post_loss(o, layers, vars_read, c["y_last"], mb_f)[0], outer_e)
            (d_p,) = post_vjp(jnp.where((s == p - 1) & (mf >= 0), seed_m, jnp.zeros_like(seed_m)))
            d_embed = jax.tree.map(jnp.add, d_embed, d_p)
        return {**c, "d_embed": model.for_embed(d_embed), "dx0": _vary(zero_x)}, None

    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    carry = _zeros_like_varying({
        "res": [jax.ShapeDtypeStruct((k_res + 1,) + r.shape, r.dtype) for r in [*residuals.shapes, *var_leaves]],
        "send_f": x_spec, "send_b": x_spec, "dx0": x_spec, "d_layers": layers, "d_outer": outer, "d_embed": outer,
        "ce": f32, "aux_loss": f32, "metrics": met_spec, "lmet": lmet_spec, "y_last": x_spec})   # res: + a spare slot
    carry["vars"] = _vary_tree(vars)
    carry["d_embed"] = model.for_embed(carry["d_embed"])
    c, _ = lax.scan(tick, carry, jnp.arange(n))
    return _reduce_1f1b(c, p, inv_m, vars_in)


def _reduce_1f1b(c, p: int, inv_m: float, vars_in):
    """The 1F1B carry after the last tick -> (loss, loss of the parts, metrics, loss metrics, d_outer,
    d_layers, vars): sums over stages (psum over `pipeline`), means over microbatches and replicas."""
    ce = _reduce_batch(lax.psum(c["ce"], AXIS) * inv_m)
    aux_loss = _reduce_batch(lax.psum(c["aux_loss"], AXIS) * inv_m)
    # embedding-path gradients live in the gathered layout inside the loop (see _Model.for_embed);
    # a replica's gradients are of its own mean loss: averaged over `data`, once per step
    # (one all-reduce over pipeline x data: a sum over stages, a mean over replicas)
    d_outer = jax.tree.map(lambda g, e: lax.pmean(g + e, _manual_axes()) * p, c["d_outer"], c["d_embed"])
    d_layers = jax.tree.map(_reduce_batch, c["d_layers"])
    metrics = jax.tree.map(lambda a: _reduce_batch(a * inv_m), c["metrics"])
    lmet = jax.tree.map(lambda a: _reduce_batch(lax.psum(a, AXIS) * inv_m), c["lmet"])
    return ce + aux_loss, ce, metrics, lmet, d_outer, d_layers, merge_stage_vars(vars_in, c["vars"], p, AXIS)


# ----------------------------------------------------------------------------------------------
# Entry point used by meshpar.train.step.Trainer._grads.

def value_and_grad(spec, params: dict, batch, pc, layout, policy, loss_scale=None, vars=None, lm: bool = True,
                   batch_spec=None, loss_chunks: int = 1):
    """Pipelined ((loss, aux), grads), the structure of `jax.value_and_grad` of the loss the model's
    parts make (`meshpar.nn.stages`): next-token cross-entropy (`lm`; aux holds "ce") or `stage_loss`
    (aux holds the model loss's metrics), with the layers' metrics stacked [L] and "vars", the
    model's non-Param state after the step. params, vars: pure dicts; batch: the batch pytree [B, ...]
    (`batch_spec` its leaves' logical axes); `pc`: the run's `cfg.pipeline`; `loss_chunks`: the LM head's token slices (`train.loss_chunks`). With `loss_scale` S (fp16) the grads are those of
    loss * S (the caller unscales); loss and aux are never scaled."""
    from meshpar.core.rules import use_layout
    from meshpar.core.sharding import split_microbatches

    p = layout.shape[AXIS]
    m = pc.microbatches
    v = pc.virtual_stages if pc.schedule == "interleaved" else 1
    model = StageModel(spec, policy, lm, _embed_specs(spec, layout), loss_chunks)
    vars = {} if vars is None else vars
    mesh = layout.mesh
    data = _manual_batch_axes(spec, layout)
    with use_layout(layout):
        seq = (context.AXIS,) if lm and context.context_size() > 1 else ()
    manual = (AXIS,) + data + seq

    def in_body(f):
        """Trace `f` with the manual batch (and sequence) axes hidden from `constrain`; under 1F1B
        the stages run in per-device branches (weights gathered at use, see FSDP_AXES; dropless MoE
        layers route replicated)."""
        def run(*args):
            inner = layout.hiding(data + seq).gathering(FSDP_AXES if pc.schedule == "1f1b" else ())
            with use_layout(inner), context.balanced(bool(seq)), \
                    moe.in_device_branches(pc.schedule == "1f1b"):
                return f(*args)
        return run

    with use_layout(layout):
        outer, layers = _split_params(params)
        n_layers = jax.tree.leaves(layers)[0].shape[0]
        if lm:   # the LM's rows [B, T] (balanced over `context`), cut before the shard_map
            batch, batch_spec = _lm_rows(batch)
        mbs = split_microbatches(batch, m, layout, batch_spec)
        mb_specs = jax.tree.map(lambda a: P(None, data or None, *seq[:a.ndim - 2]), mbs)
        if pc.schedule == "1f1b":
            body = in_body(partial(_one_f_one_b_grads, model, p, m))
            fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS), P(), mb_specs, P()),
                               out_specs=(P(), P(), P(AXIS), P(), P(), P(AXIS), P()), axis_names=set(manual))
            seed = jnp.ones((), jnp.float32) if loss_scale is None else jnp.asarray(loss_scale, jnp.float32)
            loss, ce, metrics, lmet, d_outer, d_layers, vars = fn(outer, layers, vars, mbs, seed)
            grads = {**d_outer, "layers": d_layers}
        else:
            def loss_fn(prm):
                o, lay = _split_params(prm)
                chunks = _to_chunks(lay, p, v)          # [v, P*Lc, ...], device s holds chunks r*P + s
                body = in_body(partial(_circular_loss, model, p, m, v))
                fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, AXIS), P(), mb_specs),
                                   out_specs=(P(), (P(), P(None, AXIS), P(), P())), axis_names=set(manual))
                loss_, (ce_, met_, lmet_, vars_) = fn(o, chunks, vars, mbs)
                met_ = jax.tree.map(lambda a: a.reshape((n_layers,) + a.shape[2:]), met_)
                scaled = loss_ if loss_scale is None else loss_ * jnp.asarray(loss_scale).astype(loss_.dtype)
                return scaled, (loss_, ce_, met_, lmet_, vars_)
            (_, (loss, ce, metrics, lmet, vars)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return (loss, {**({"ce": ce} if lm else {}), **lmet, **metrics, "vars": vars}), grads


def _lm_rows(batch):
    """Token rows [B, T+1] (or packed documents) -> the LM's rows {inputs, targets, positions, ...}
    [B, T] in the balanced order when sequences are split over `context`, and their batch spec."""
    from meshpar.core.batch import Leaf
    rows = context.balance_rows(lm_rows(batch), positions=True)
    return rows, {k: Leaf(a.shape, a.dtype, ("batch", "length")) for k, a in rows.items()}


def _manual_batch_axes(spec, layout) -> tuple:
    """("data",) when the pipeline can also be manual over `data` (the batch's leading axis, no
    parameter is split over it, and the model has no non-Param state: BatchNorm statistics and
    dropout masks of `pre`/`post` must see the whole microbatch), else (): see the module docstring."""
    batch = layout.spec(("batch",))
    if layout.shape.get("data", 1) <= 1 or not len(batch) or spec_axes(batch[:1])[:1] != ("data",) or \
            spec.var_treedef is not None or dropout.draws(spec.graphdef):
        return ()
    specs = jax.tree.leaves(jax.tree.map(lambda sh, names: layout.spec(names, sh.shape), spec.shapes, spec.logical,
                                         is_leaf=lambda x: isinstance(x, tuple)), is_leaf=lambda x: isinstance(x, P))
    return () if any("data" in spec_axes(sp) for sp in specs) else ("data",)


def _embed_specs(spec, layout):
    """At-rest PartitionSpecs of the outer (non-`layers`) parameters without the batch mesh axes."""
    def one(shape, names):
        return without(layout.spec(names, shape.shape), BATCH_AXES)
    shapes, logical = _split_params(spec.shapes)[0], _split_params(spec.logical)[0]
    return jax.tree.map(one, shapes, logical, is_leaf=lambda x: isinstance(x, tuple))


def _to_chunks(layers, p: int, v: int):
    """[L, ...] -> [v, P*Lc, ...]: row block s of chunk-row r is global chunk r*P + s, which
    `P(None, 'pipeline')` places on device s. For v = 1 this is a free reshape of the at-rest layout."""
    def one(a):
        lc = a.shape[0] // (p * v)
        return a.reshape((v, p * lc) + a.shape[1:])
    return jax.tree.map(one, layers)
