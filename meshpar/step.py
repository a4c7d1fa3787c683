"""The train step, pure: loss_fn(model, batch) -> grads -> optimizer update. No data, no logging.

    trainer = Trainer(cfg, model=lambda rngs: MyModel(rngs), loss=my_loss, batch_spec=spec)
    state = trainer.init()                 # every array born in its shard (jit with out_shardings)
    state, metrics = trainer.step(state, batch)

`model(rngs) -> nnx.Module` is any Flax NNX model; `loss(model, batch) -> (loss, metrics)` any
scalar loss of any batch pytree (`batch_spec`: a tree of `meshpar.data.Leaf` declaring each leaf's
logical axes). Defaults: the model named by `cfg.model.name` and next-token cross-entropy
(`lm_loss`) on token rows [B, T+1].

The train state is a dict of pure pytrees: `params` (nnx.Param, optimized), `vars` (all other NNX
state: RNG streams, counters, statistics; carried, never optimized), `opt`, `step`, `numerics`.

The step: microbatches (gradient accumulation, `lax.scan`) -> grads -> clip -> AdamW. Where the
gradients are reduced is the strategy (ZeRO, Rajbhandari et al. 2020):

* dp / fsdp / tp ...: gradients take the parameters' layout (all-reduce, or reduce-scatter when the
  parameters are sharded).
* zero1 / zero2: gradients are reduce-scattered into the sharded optimizer-state layout (Psi bytes),
  the update runs on 1/N of every tensor, and the updated parameters are all-gathered (Psi).
* zero1 under accumulation: each data-parallel replica accumulates its *own* gradients (a `vmap`
  over replicas whose mapped axis sits on the batch mesh axes, so nothing is communicated inside the
  loop) and they are reduce-scattered once per optimizer step. A model with non-Param state (dropout
  RNG streams, say) reduces per microbatch instead, so its masks stay independent of the mesh.
* zero2 under accumulation: each microbatch's gradients are reduce-scattered on arrival, so the
  accumulator holds 1/N per device (M x Psi bytes moved, 1/N of the memory).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from meshpar import precision as precision_lib
from meshpar.data import check_batch_spec, lm_batch_spec
from meshpar.errors import ConfigError, ShardingError
from meshpar.mesh import describe, make_mesh, mesh_shape
from meshpar.rules import Layout, check_rule_names, get_strategy, parse_user_rules, use_layout
from meshpar.sharding import (ModelSpec, batch_shardings, building, model_spec, opt_state_shardings,
                              param_shardings, sharding_table, split_microbatches, state_shardings,
                              unruled_batch_axes, var_shardings)


def make_optimizer(cfg, spec: ModelSpec) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019), linear warmup + cosine decay, global-norm clipping.
    Weight decay skips normalisation scales (logical axis `norm`) and vectors (biases; a stacked
    vector [layers, n] counts as a vector)."""
    t = cfg.train
    decay_mask = jax.tree.map(lambda names: "norm" not in names and len([n for n in names if n != "layers"]) > 1,
                              spec.logical,
                              is_leaf=lambda x: isinstance(x, tuple))
    return optax.chain(optax.clip_by_global_norm(t.clip_norm),
                       optax.adamw(lr_schedule(cfg), t.b1, t.b2, weight_decay=t.weight_decay, mask=decay_mask))


def lr_schedule(cfg):
    """Linear warmup to `train.lr` over `warmup_steps`, cosine decay to `lr * min_lr_ratio` at `steps`.
    Evaluated at count + 1, so the first update already moves (lr / warmup_steps)."""
    t = cfg.train
    sched = optax.warmup_cosine_decay_schedule(0.0, t.lr, t.warmup_steps, max(cfg.steps, t.warmup_steps + 1),
                                               end_value=t.lr * t.min_lr_ratio)
    return lambda count: sched(count + 1)


def applied_count(opt_state):
    """AdamW's own update count (the one its schedule reads): unlike `state["step"]` it does not move
    on a skipped (non-finite) step, so the logged lr is the rate the update really applies."""
    adam = lambda s: isinstance(s, optax.ScaleByAdamState)
    return next(s for s in jax.tree.leaves(opt_state, is_leaf=adam) if adam(s)).count


def batch_axes_of(layout: Layout) -> tuple[str, ...]:
    """The mesh axes the `batch` dimension is split over (size > 1 only)."""
    spec = layout.spec(("batch",))
    axes = spec[0] if len(spec) else None
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def data_parallel_size(layout: Layout) -> tuple[int, str]:
    """Product (and description) of the mesh axes the `batch` dimension is split over."""
    axes, sizes = batch_axes_of(layout), layout.shape
    return math.prod(sizes[a] for a in axes), " x ".join(f"{a}={sizes[a]}" for a in axes) or "none"


def check_batch(cfg, layout: Layout) -> None:
    b, m = cfg.batch.global_size, cfg.batch.microbatches
    if b % m:
        raise ShardingError(f"batch.global_size={b} is not divisible by batch.microbatches={m}")
    dp, axes = data_parallel_size(layout)
    if (b // m) % dp:
        what = f"batch.global_size={b}" if m == 1 else f"the microbatch size {b // m} (batch.global_size={b} / batch.microbatches={m})"
        raise ShardingError(f"{what} is not divisible by the data-parallel size {dp} ({axes}); "
                            f"use a multiple of {dp * m} for batch.global_size")


def check_platform(cfg) -> None:
    """Options that only some backends have."""
    backend = jax.default_backend()
    if cfg.model.attention == "cudnn" and backend != "gpu":
        raise ShardingError(f"model.attention=cudnn needs an NVIDIA GPU (this backend is {backend}); "
                            "use model.attention=xla, or auto to let JAX choose")


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


def _check_loss(out, name: str):
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise ConfigError(f"loss function {name} must return (loss, metrics_dict), got {type(out).__name__}")
    loss, metrics = out
    if jnp.shape(loss) != ():
        raise ConfigError(f"loss function {name} returned a loss of shape {tuple(jnp.shape(loss))}; it must be a "
                          "scalar (reduce it, e.g. with .mean())")
    return loss, metrics


def default_model(cfg) -> Callable:
    """`cfg.model.name` as a factory `rngs -> nnx.Module` (`PKG.MODULE:FN` or a reference model)."""
    from meshpar.config import model_factory
    fn = model_factory(cfg)
    return lambda rngs: fn(cfg, rngs)


def user_source(cfg):
    """`data.kind=PKG.MODULE:FN` -> FN(cfg), else None (a built-in token source)."""
    if ":" not in cfg.data.kind:
        return None
    from meshpar.config import import_object
    return import_object(cfg.data.kind, "data.kind")(cfg)


def trainer_for(cfg, devices=None, source=None) -> "Trainer":
    """The Trainer a config names: its model, its loss, and its data source's batch layout."""
    source = source if source is not None else user_source(cfg)
    spec = source.batch_spec(cfg.batch.global_size, cfg.batch.length) if hasattr(source, "batch_spec") else None
    return Trainer(cfg, devices=devices, batch_spec=spec)


@dataclass
class Trainer:
    """Everything a run needs that is not an array: mesh, layout, shardings, the compiled step.

    `model`: factory `rngs -> nnx.Module` (default: `cfg.model.name`). `loss`: `(model, batch) ->
    (scalar, metrics)` (default: `cfg.train.loss`, i.e. `lm_loss`). `batch_spec`: tree of
    `meshpar.data.Leaf` (default: token rows [B, T+1] from `cfg.batch`).
    """
    cfg: Any
    devices: list | None = None
    model: Callable | None = None
    loss: Callable | None = None
    batch_spec: Any = None
    mesh: Any = field(init=False)
    layout: Layout = field(init=False)

    def __post_init__(self):
        cfg = self.cfg
        self.mesh = make_mesh(cfg.mesh, self.devices)
        self.layout = Layout(self.mesh, get_strategy(cfg.strategy), parse_user_rules(cfg.rules))
        self.policy = precision_lib.get_policy(cfg.precision)
        check_platform(cfg)
        self.factory = self.model or default_model(cfg)
        if self.loss is None:
            from meshpar.config import loss_function
            self.loss = loss_function(cfg)
        self.loss_name = getattr(self.loss, "__qualname__", repr(self.loss))
        self.spec = model_spec(self.factory, self.policy, cfg.train.require_annotations)
        check_batch(cfg, self.layout)
        self.batch_spec = (self.batch_spec if self.batch_spec is not None
                           else lm_batch_spec(cfg.batch.global_size, cfg.batch.length))
        check_batch_spec(self.batch_spec)
        self.batch_warnings = unruled_batch_axes(self.batch_spec, self.layout)
        if self.batch_warnings and cfg.train.require_annotations:
            raise ShardingError(f"{self.batch_warnings[0]} (train.require_annotations=true)")
        self.idle_rules = check_rule_names(self.layout.user_rules, self._names_used())
        self.pipelined = self.layout.shape.get("pipeline", 1) > 1
        if self.pipelined:
            self._check_pipeline()
        self.tx = make_optimizer(cfg, self.spec)
        replicated = NamedSharding(self.mesh, P())
        self.param_shardings = param_shardings(self.spec, self.layout)
        zero = self.layout.strategy.opt_state is not None
        self.grad_shardings = state_shardings(self.spec, self.layout) if zero else self.param_shardings
        self.state_shardings = {"step": replicated, "params": self.param_shardings,
                                "vars": var_shardings(self.spec, self.layout),
                                "opt": opt_state_shardings(self.tx, self.spec, self.layout),
                                "numerics": jax.tree.map(lambda _: replicated, jax.eval_shape(
                                    lambda: precision_lib.LOSS_SCALE.init(self.policy)))}
        self.batch_sharding = batch_shardings(self.batch_spec, self.layout)
        self._init = jax.jit(self._init_fn, out_shardings=self.state_shardings)
        self._step = jax.jit(self._step_fn, in_shardings=(self.state_shardings, self.batch_sharding),
                             out_shardings=(self.state_shardings, replicated), donate_argnums=(0,))
        self._compiled = None

    def _check_pipeline(self) -> None:
        """A pipeline cuts the loss into stages (meshpar.stages): the built-in LM loss of a model
        with embed/layers/head, or `stage_loss` of one with pre/layers/post/loss."""
        from flax import nnx

        from meshpar import pipeline
        from meshpar.stages import check_protocol, check_state, stage_loss
        if self.loss not in (lm_loss, stage_loss):
            raise ConfigError(f"pipelining (mesh.pipeline > 1) cuts the loss into stages: train.loss=lm (a model with "
                              f"embed/layers/head) or train.loss=stages (a model with pre/layers/post/loss, see "
                              f"meshpar.stages); {self.loss_name} is neither. Set mesh.pipeline=1, or give the model "
                              "those parts and train it with train.loss=stages")
        with building(self.policy):
            check_protocol(nnx.eval_shape(lambda: self.factory(nnx.Rngs(0))), lm=self.is_lm)
        check_state(self.spec)
        pipeline.check(self.cfg, self.layout, self.spec.shapes)

    def warnings(self) -> list[str]:
        """One line each for what this run will ignore: config keys it does not read, user rules
        that name no parameter, variable or batch leaf (they can only reach activations)."""
        from meshpar.config import ignored_warning
        out = [w for w in [ignored_warning(self.cfg)] if w]
        if self.idle_rules:
            out.append(f"warning: {', '.join(self.idle_rules)} name no parameter, variable or batch leaf of this "
                       "model: they apply only to activations constrained with those names")
        return out + [f"warning: {w}" for w in self.batch_warnings]

    def sharding_table(self) -> list[dict]:
        """The sharding table of this run: parameters, other state, batch leaves."""
        return sharding_table(self.spec, self.layout, self.batch_spec)

    def _names_used(self) -> set[str]:
        from meshpar.data import is_leaf
        leaves = [*jax.tree.leaves(self.spec.logical, is_leaf=lambda x: isinstance(x, tuple)),
                  *jax.tree.leaves(self.spec.var_logical or {}, is_leaf=lambda x: isinstance(x, tuple)),
                  *(leaf.axes for leaf in jax.tree.leaves(self.batch_spec, is_leaf=is_leaf))]
        return {n for names in leaves if names for n in names if n}

    # -- init ------------------------------------------------------------------------------------
    def _init_fn(self, key):
        from flax import nnx
        with building(self.policy):
            model = self.factory(nnx.Rngs(key))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return {"step": jnp.zeros((), jnp.int32), "params": params, "vars": self.spec.vars_of(model),
                "opt": self.tx.init(params), "numerics": precision_lib.LOSS_SCALE.init(self.policy)}

    def init(self, seed: int | None = None):
        """Sharded init: the jitted constructor writes each variable straight into its shard. With
        `model.init_from=hf:DIR` the parameters are read from DIR instead, each straight into its
        shard (`meshpar.hf`), and the rest of the state (optimizer, step 0) starts fresh."""
        key = jax.random.key(self.cfg.train.seed if seed is None else seed)
        if self.cfg.model.init_from:
            return self._init_from(self.load_pretrained(), key)
        return self._init(key)

    def load_pretrained(self, shardings=None, shapes=None, info=None):
        """`model.init_from`'s parameters, in `shardings` (default: this run's) and `shapes`' dtypes."""
        from flax import nnx
        from meshpar import hf
        with building(self.policy):
            abstract = nnx.eval_shape(lambda: self.factory(nnx.Rngs(0)))
        return hf.load(self.cfg.model.init_from, abstract, shardings or self.param_shardings,
                       shapes or self.spec.shapes, info)

    def _init_from(self, params, key):
        """The train state around given parameters: fresh optimizer state and variables, step 0."""
        def fn(params, key):
            state = self._init_fn(key)   # its random parameters are dead code (XLA drops them)
            return {**state, "params": params, "opt": self.tx.init(params)}
        return jax.jit(fn, out_shardings=self.state_shardings, donate_argnums=(0,))(params, key)

    def abstract_state(self):
        key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
        out = jax.eval_shape(self._init_fn, key)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), out, self.state_shardings)

    # -- step ------------------------------------------------------------------------------------
    def _grads(self, params, batch, loss_scale=None, vars=None, layout=None):
        """((loss, aux), grads) of one (micro)batch; aux["vars"] is the model's non-Param state after
        the call. With `loss_scale` S (fp16) the grads are those of loss * S, for the caller to
        unscale; loss and aux are never scaled."""
        vars = {} if vars is None else vars
        if self.pipelined:   # hand-written schedule (meshpar/pipeline.py)
            from meshpar import pipeline
            return pipeline.value_and_grad(self.spec, params, batch, self.cfg, self.layout, self.policy, loss_scale,
                                           vars, self.is_lm, self.batch_spec)

        def loss_fn(p, b):
            model = self.spec.merge(p, vars)
            loss, metrics = _check_loss(self.loss(model, b), self.loss_name)
            return precision_lib.LossScale.scale(loss, loss_scale), (loss, {**metrics, "vars": self.spec.vars_of(model)})
        with use_layout(layout or self.layout), precision_lib.use_policy(self.policy):
            (_, (loss, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        return (loss, aux), grads

    def _accumulate(self, params, batch, scale, vars):
        """Gradient accumulation over `batch.microbatches` (see the module docstring for the layouts)."""
        m = self.cfg.batch.microbatches
        mbs = split_microbatches(batch, m, self.layout, self.batch_spec)
        strategy = self.layout.strategy
        replicas = batch_axes_of(self.layout)
        # ZeRO-1's per-replica accumulation needs a model without non-Param state: under the vmap every
        # replica would draw the same dropout masks (and keep its own counters), so such a model
        # takes the general path (gradients reduced per microbatch), which matches any mesh
        local = (strategy.opt_state is not None and not strategy.shard_grads and replicas and not self.pipelined
                 and not jax.tree.leaves(vars))
        if local:   # ZeRO-1: per-replica gradients [R, ...], reduced once after the loop
            r = math.prod(self.layout.shape[a] for a in replicas)
            inner = self.layout.hiding(replicas)
            mbs = jax.tree.map(lambda x: x.reshape((m, r, x.shape[1] // r) + x.shape[2:]), mbs)
            grads_fn = jax.vmap(lambda p, b, v: self._grads(p, b, scale, v, inner), in_axes=(None, 0, None),
                                spmd_axis_name=replicas[0] if len(replicas) == 1 else replicas)

            def pin(g):
                return g
        else:
            def grads_fn(p, b, v):
                return self._grads(p, b, scale, v)

            def pin(g):   # ZeRO-2: reduce-scatter each microbatch's grads, accumulate 1/N shards
                return jax.lax.with_sharding_constraint(g, self.grad_shardings) if strategy.shard_grads else g

        def acc(carry, mb):
            total, v = carry
            (l, a), g = grads_fn(params, mb, v)
            v = a.pop("vars")
            return (jax.tree.map(jnp.add, total, (l, a, pin(g))), v), None

        first = jax.tree.map(lambda x: x[0], mbs)
        (l0, a0), g0 = jax.eval_shape(grads_fn, params, first, vars)
        a0 = dict(a0)
        a0.pop("vars")
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (l0, a0, g0))
        zeros = (zeros[0], zeros[1], pin(zeros[2]))
        ((loss, aux, grads), vars), _ = jax.lax.scan(acc, (zeros, vars), mbs)
        if local:   # sum the replicas' partial sums: one reduce(-scatter) per optimizer step
            loss, aux, grads = jax.tree.map(lambda x: jnp.sum(x, axis=0) / r, (loss, aux, grads))
        return jax.tree.map(lambda x: x / m, (loss, aux, grads)), vars

    def _step_fn(self, state, batch):
        params = state["params"]
        scale = state["numerics"]["loss_scale"] if self.policy.loss_scaling else None
        if self.cfg.batch.microbatches == 1:
            (loss, aux), grads = self._grads(params, batch, scale, state["vars"])
            vars = aux.pop("vars")
        else:
            (loss, aux, grads), vars = self._accumulate(params, batch, scale, state["vars"])
        grads = jax.lax.with_sharding_constraint(precision_lib.LossScale.unscale(grads, scale), self.grad_shardings)
        # a non-finite loss or gradient (or an fp16 overflow) skips the update: params, optimizer
        # state and the model's other state stay bitwise as they were; `numerics` counts it and
        # adapts the fp16 loss scale
        apply, bad, numerics = precision_lib.LOSS_SCALE.update(self.policy, state["numerics"], loss, grads)
        lr = lr_schedule(self.cfg)(applied_count(state["opt"]))   # the rate this update applies
        updates, opt = self.tx.update(grads, state["opt"], params)
        new_params = optax.apply_updates(params, updates)
        params, opt, vars = precision_lib.select(apply, (new_params, opt, vars), (params, state["opt"], state["vars"]))
        aux = dict(aux)
        metrics = {"loss": aux.pop("ce", loss), "total_loss": loss, "grad_norm": optax.tree.norm(grads),
                   "lr": jnp.where(apply, lr, 0.0), **aux,
                   "nonfinite": bad.astype(jnp.int32), "skipped_steps": numerics["skipped_steps"]}
        if self.policy.loss_scaling:
            metrics.update(loss_scale=state["numerics"]["loss_scale"], overflows=numerics["overflows"])
        return {"step": state["step"] + 1, "params": params, "vars": vars, "opt": opt, "numerics": numerics}, metrics

    @property
    def batch_shape(self) -> tuple:
        """The global batch shape of a single-array batch ([B, T+1] tokens for the LM loss)."""
        from meshpar.data import is_leaf
        if not is_leaf(self.batch_spec):
            raise AttributeError("batch_shape: this batch is a tree; see Trainer.batch_spec")
        return tuple(self.batch_spec.shape)

    def abstract_batch(self):
        from meshpar.data import is_leaf
        return jax.tree.map(lambda leaf, sh: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=sh),
                            self.batch_spec, self.batch_sharding, is_leaf=is_leaf)

    def lower(self):
        return self._step.lower(self.abstract_state(), self.abstract_batch())

    def compile(self):
        """Compile the step ahead of time (once); `step` then never retraces."""
        if self._compiled is None:
            self._compiled = self.lower().compile()
        return self._compiled

    def step(self, state, batch):
        return self.compile()(state, batch)

    # -- facts for logs --------------------------------------------------------------------------
    @property
    def is_lm(self) -> bool:
        return self.loss is lm_loss

    def describe(self) -> dict:
        rows = self.cfg.batch.global_size
        return {"mesh": mesh_shape(self.mesh), "mesh_str": describe(self.mesh), "strategy": self.cfg.strategy,
                "precision": self.cfg.precision, "devices": self.mesh.devices.size,
                "params": self.spec.num_params, "examples_per_step": rows,
                "tokens_per_step": rows * self.cfg.batch.length if self.is_lm else None}
