"""The train step, pure: loss_fn(model, batch) -> grads -> optimizer update. No data, no logging.

    trainer = Trainer(cfg, model=lambda rngs: MyModel(rngs), loss=my_loss, batch_spec=spec)
    state = trainer.init()                 # every array born in its shard (jit with out_shardings)
    state, metrics = trainer.step(state, batch)

`model(rngs) -> nnx.Module` is any Flax NNX model; `loss(model, batch) -> (loss, metrics)` any
scalar loss of any batch pytree (`batch_spec`: a tree of `meshpar.Leaf` declaring each leaf's
logical axes). Defaults: the model named by `cfg.model.name` and next-token cross-entropy
(`lm_loss`) on token rows [B, T+1].

The train state, its shardings and the sharded init: `meshpar.train.state.TrainSetup`, which
`Trainer` extends with the step; the optimizer: `meshpar.train.optimizer`; the losses: `meshpar.train.loss`.

The step: microbatches (gradient accumulation, `lax.scan`) -> grads -> clip -> AdamW. However the
batch is cut (microbatches, replicas, pipeline microbatches) the objective is one weighted mean over
the whole batch: each part counts by its share of the batch's weight (`meshpar.core.objective`), and
the parts' losses, metrics and gradients are summed. Where the gradients are reduced is the strategy
(ZeRO, Rajbhandari et al. 2020):

* dp / fsdp / tp ...: gradients take the parameters' layout (all-reduce, or reduce-scatter when the
  parameters are sharded).
* zero1 / zero2: gradients are reduce-scattered into the sharded optimizer-state layout (Psi bytes),
  the update runs on 1/N of every tensor, and the updated parameters are all-gathered (Psi).
* zero1 under accumulation: each data-parallel replica accumulates its *own* gradients (a `vmap`
  over replicas whose mapped axis sits on the batch mesh axes, so nothing is communicated inside the
  loop) and they are reduce-scattered once per optimizer step. A model with non-Param state (dropout
  RNG streams, say) or dropout in its stacked layers (`meshpar.nn.dropout`: keys per step,
  microbatch and layer) reduces per microbatch instead, so its masks stay independent of the mesh;
  so do sequences split over `context`.
* zero2 under accumulation: each microbatch's gradients are reduce-scattered on arrival, so the
  accumulator holds 1/N per device (M x Psi bytes moved, 1/N of the memory).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar.core import objective
from meshpar.core import precision as precision_lib
from meshpar.core.batch import is_leaf
from meshpar.core.errors import user_code
from meshpar.core.layout import use_layout
from meshpar.core.mesh import describe
from meshpar.core.platform import compiling_for, of_mesh
from meshpar.core.registry import import_object
from meshpar.core.sharding import split_microbatches
from meshpar.nn import dropout
from meshpar.parallel import lockstep, pipeline
from meshpar.train.loss import check_loss
from meshpar.train.optimizer import applied_count, lr_schedule
from meshpar.train.state import TrainSetup, batch_axes_of


class Trainer(TrainSetup):
    """Everything a run needs that is not an array: mesh, layout, shardings and init (`TrainSetup`),
    and the compiled step. `Trainer(cfg, model=, loss=, batch_spec=, devices=)`, as `TrainSetup`."""

    def __post_init__(self):
        super().__post_init__()
        replicated = NamedSharding(self.mesh, P())
        self._step = jax.jit(
            self._step_fn,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=(0,),
        )
        self._compiled = None

    # -- step ------------------------------------------------------------------------------------
    def _grads(self, params, batch, loss_scale=None, vars=None, layout=None, total=None):
        """((loss, aux), grads) of one (micro)batch; aux["vars"] is the model's non-Param state after
        the call. With `total` W, the step's whole batch's weight, each is this part's share of the
        step's objective: times w / W (`meshpar.core.objective`), for the caller to sum. With
        `loss_scale` S (fp16) the grads are those of loss * S, for the caller to unscale; loss and
        aux are never scaled by S."""
        vars = {} if vars is None else vars
        if self.pipelined:  # hand-written schedule (meshpar/parallel/pipeline.py)
            return pipeline.value_and_grad(
                self.spec,
                params,
                batch,
                self.cfg.pipeline,
                self.layout,
                self.policy,
                loss_scale,
                vars,
                self.is_lm,
                self.batch_spec,
                self.cfg.train.loss_chunks,
                (self.weight, total),
            )

        def loss_fn(p, b):
            model = self.spec.merge(p, vars)
            loss, metrics = objective.counted(check_loss(self.loss(model, b), self.loss_name), self.weight, b, total)
            return precision_lib.LossScale.scale(loss, loss_scale), (
                loss,
                {**metrics, "vars": self.spec.vars_of(model)},
            )

        with use_layout(layout or self.layout), precision_lib.use_policy(self.policy):
            (_, (loss, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        return (loss, aux), grads

    def _step_fn(self, state, batch):
        params = state["params"]
        scale = state["numerics"]["loss_scale"] if self.policy.loss_scaling else None
        with dropout.training(self.cfg.train.seed, state["step"]):  # keys of stacked layers' dropout
            if self.cfg.batch.microbatches == 1:
                (loss, aux), grads = self._grads(params, batch, scale, state["vars"])
                vars = aux.pop("vars")
            else:  # the parts' shares of the batch's weight, found once (meshpar.core.objective)
                (loss, aux, grads), vars = _accumulate(
                    self, params, batch, scale, state["vars"], self.cfg.batch.microbatches, self.weight(batch)
                )
        grads = jax.lax.with_sharding_constraint(precision_lib.LossScale.unscale(grads, scale), self.grad_shardings)
        # a non-finite loss or gradient (or an fp16 overflow) skips the update: params, optimizer
        # state and the model's other state stay bitwise as they were; `numerics` counts it and
        # adapts the fp16 loss scale
        apply, bad, numerics = precision_lib.LOSS_SCALE.update(self.policy, state["numerics"], loss, grads)
        lr = lr_schedule(self.cfg.train, self.cfg.steps)(applied_count(state["opt"]))  # the rate this update applies
        updates, opt = self.tx.update(grads, state["opt"], params)
        new_params = optax.apply_updates(params, updates)
        params, opt, vars = precision_lib.select(apply, (new_params, opt, vars), (params, state["opt"], state["vars"]))
        aux = dict(aux)
        metrics = {
            "loss": aux.pop("ce", loss),
            "total_loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "lr": jnp.where(apply, lr, 0.0),
            **aux,
            "nonfinite": bad.astype(jnp.int32),
            "skipped_steps": numerics["skipped_steps"],
        }
        if self.policy.loss_scaling:
            metrics.update(loss_scale=state["numerics"]["loss_scale"], overflows=numerics["overflows"])
        return {"step": state["step"] + 1, "params": params, "vars": vars, "opt": opt, "numerics": numerics}, metrics

    def abstract_batch(self):
        return jax.tree.map(
            lambda leaf, sh: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=sh),
            self.batch_spec,
            self.batch_sharding,
            is_leaf=is_leaf,
        )

    def lower(self):
        """The step traced for this mesh's platform (a deviceless target's GPU or TPU too); what the
        user's model raises in it comes out through `user_code` ("tracing the train step ...")."""
        with compiling_for(of_mesh(self.mesh)), user_code(f"tracing the train step ({self.runs})"):
            return self._step.lower(self.abstract_state(), self.abstract_batch())

    def compile(self, options: dict | None = None):
        """Compile the step ahead of time (once; `options`: XLA compiler options for that once); `step`
        then never retraces. A pipelined step whose stages would wait in different collectives is
        refused in one line (`meshpar.parallel.lockstep`)."""
        if self._compiled is None:
            compiled = self.lower().compile(options)
            if self.pipelined:
                lockstep.check(
                    compiled.as_text(),
                    self.mesh,
                    f"pipeline.schedule={self.cfg.pipeline.schedule} on "
                    f"mesh {describe(self.mesh)} with strategy={self.cfg.strategy}",
                    self.mesh.devices.flat[0].platform,
                    self.cfg.pipeline.schedule,
                )
            self._compiled = compiled
        return self._compiled

    def step(self, state, batch):
        return self.compile()(state, batch)


def _accumulate(trainer: Trainer, params, batch, scale, vars, m: int, total):
    """Gradient accumulation over m = `batch.microbatches` (see the module docstring for the layouts):
    the sums of each microbatch's (and under ZeRO-1 each replica's) share of the objective, the
    shares of the batch's weight `total` (`meshpar.core.objective`)."""
    mbs = split_microbatches(batch, m, trainer.layout, trainer.batch_spec)
    strategy = trainer.layout.strategy
    replicas = batch_axes_of(trainer.layout)
    local = _per_replica(trainer, replicas, vars)
    if local:  # ZeRO-1: per-replica gradients [R, ...], reduced once after the loop
        r = math.prod(trainer.layout.shape[a] for a in replicas)
        inner = trainer.layout.hiding(replicas)
        mbs = jax.tree.map(lambda x: x.reshape((m, r, x.shape[1] // r) + x.shape[2:]), mbs)
        grads_fn = jax.vmap(
            lambda p, b, v: trainer._grads(p, b, scale, v, inner, total),
            in_axes=(None, 0, None),
            spmd_axis_name=replicas[0] if len(replicas) == 1 else replicas,
        )

        def pin(g):
            return g
    else:

        def grads_fn(p, b, v):
            return trainer._grads(p, b, scale, v, total=total)

        def pin(g):  # ZeRO-2: reduce-scatter each microbatch's grads, accumulate 1/N shards
            return jax.lax.with_sharding_constraint(g, trainer.grad_shardings) if strategy.shard_grads else g

    def acc(carry, xs):
        (total, v), (mb, k) = carry, xs
        with dropout.accumulating(k, m):  # microbatch k's dropout keys (meshpar.nn.dropout)
            (l, a), g = grads_fn(params, mb, v)
        v = a.pop("vars")
        return (jax.tree.map(jnp.add, total, (l, a, pin(g))), v), None

    zeros = _zero_sums(grads_fn, params, jax.tree.map(lambda x: x[0], mbs), vars, pin)
    ((loss, aux, grads), vars), _ = jax.lax.scan(acc, (zeros, vars), (mbs, jnp.arange(m)))
    if local:  # sum the replicas' partial sums: one reduce(-scatter) per optimizer step
        loss, aux, grads = jax.tree.map(lambda x: jnp.sum(x, axis=0), (loss, aux, grads))
    return (loss, aux, grads), vars


def _per_replica(trainer: Trainer, replicas: tuple, vars) -> bool:
    """Whether ZeRO-1 accumulates per data-parallel replica (a `vmap` over the replicas, reduced once
    per step). It needs a model without non-Param state: under the vmap every replica would draw the
    same dropout masks (and keep its own counters), so such a model takes the general path
    (gradients reduced per microbatch), which matches any mesh; so do sequences split over
    `context`: their attention's shard_map (manual over `context`) cannot sit under the replicas'
    vmap, whose spmd axes JAX would make varying inside it (a ValueError)."""
    strategy = trainer.layout.strategy
    return bool(
        strategy.opt_state is not None
        and not strategy.shard_grads
        and replicas
        and not trainer.pipelined
        and not jax.tree.leaves(vars)
        and not dropout.draws(trainer.spec.graphdef)
        and trainer.layout.shape["context"] == 1
    )


def _zero_sums(grads_fn, params, mb, vars, pin):
    """Zeros shaped as (loss, aux without "vars", grads) of one microbatch: the accumulation's start."""
    (l0, a0), g0 = jax.eval_shape(grads_fn, params, mb, vars)
    a0 = {k: v for k, v in dict(a0).items() if k != "vars"}
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (l0, a0, g0))
    return zeros[0], zeros[1], pin(zeros[2])


def user_source(cfg):
    """`data.kind=PKG.MODULE:FN` -> FN(cfg), else None (a built-in token source)."""
    if ":" not in cfg.data.kind:
        return None
    fn = import_object(cfg.data.kind, "data.kind", "FN (FN(cfg) -> a data source)")
    with user_code(f"building data.kind={cfg.data.kind}"):
        return fn(cfg)


def trainer_for(cfg, devices=None, source=None) -> Trainer:
    """The Trainer a config names: its model, its loss, and its data source's batch layout."""
    source = source if source is not None else user_source(cfg)
    spec = None
    if hasattr(source, "batch_spec"):
        with user_code(f"asking the data source {type(source).__qualname__} for its batch_spec"):
            spec = source.batch_spec(cfg.batch.global_size, cfg.batch.length)
    return Trainer(cfg, devices=devices, batch_spec=spec)
