"""Training: optimizer, sharded init, the jitted step, and the loop (read top to bottom).

    trainer = Trainer(cfg)                 # mesh, layout, abstract model, shardings, compiled step
    state = trainer.init()                 # every array born in its shard (jit with out_shardings)
    state, metrics = trainer.step(state, batch)

The step: microbatches (gradient accumulation, `lax.scan`) -> grads -> clip -> AdamW. Gradients
take the parameters' layout, except under ZeRO-2, where each microbatch's gradients are pinned to
the sharded optimizer-state layout (a reduce-scatter) so the accumulator holds 1/N per device;
ZeRO-1 accumulates whole gradients and reduces them once.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from meshpar import precision as precision_lib
from meshpar.errors import ShardingError
from meshpar.mesh import describe, make_mesh, mesh_shape
from meshpar.rules import Layout, get_strategy, parse_user_rules, use_layout
from meshpar.sharding import (ModelSpec, model_spec, opt_state_shardings, param_shardings, split_microbatches,
                              state_shardings)


def make_optimizer(cfg, spec: ModelSpec) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019), linear warmup + cosine decay, global-norm clipping.
    Weight decay skips normalisation scales (logical axis `norm`)."""
    t = cfg.train
    schedule = lr_schedule(cfg)
    decay_mask = jax.tree.map(lambda names: "norm" not in names, spec.logical, is_leaf=lambda x: isinstance(x, tuple))
    return optax.chain(optax.clip_by_global_norm(t.clip_norm),
                       optax.adamw(schedule, t.b1, t.b2, weight_decay=t.weight_decay, mask=decay_mask))


def lr_schedule(cfg):
    """Linear warmup to `train.lr` over `warmup_steps`, cosine decay to `lr * min_lr_ratio` at `steps`.
    Evaluated at count + 1, so the first update already moves (lr / warmup_steps)."""
    t = cfg.train
    sched = optax.warmup_cosine_decay_schedule(0.0, t.lr, t.warmup_steps, max(cfg.steps, t.warmup_steps + 1),
                                               end_value=t.lr * t.min_lr_ratio)
    return lambda count: sched(count + 1)


def data_parallel_size(layout: Layout) -> tuple[int, str]:
    """Product (and description) of the mesh axes the `batch` dimension is split over."""
    spec = layout.spec(("batch",))
    axes = spec[0] if len(spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    sizes = layout.shape
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


def loss_and_aux(model, tokens, policy) -> tuple[jax.Array, dict]:
    """Next-token cross-entropy of tokens [B, T+1]; auxiliary losses that layers return under the key
    `loss` (already weighted, e.g. MoE load balancing) are added; the rest are metrics."""
    logits, aux = model(tokens[:, :-1], dtype=policy.compute_dtype)
    ce = precision_lib.cross_entropy(logits, tokens[:, 1:])
    aux = dict(aux)
    extra = jnp.sum(aux.pop("loss")) if "loss" in aux else 0.0
    return ce + extra, {"ce": ce, **aux}


@dataclass
class Trainer:
    """Everything a run needs that is not an array: mesh, layout, shardings, the compiled step."""
    cfg: Any
    devices: list | None = None
    mesh: Any = field(init=False)
    layout: Layout = field(init=False)

    def __post_init__(self):
        cfg = self.cfg
        self.mesh = make_mesh(cfg.mesh, self.devices)
        self.layout = Layout(self.mesh, get_strategy(cfg.strategy), parse_user_rules(cfg.rules))
        self.policy = precision_lib.get_policy(cfg.precision)
        check_platform(cfg)
        self.spec = model_spec(cfg)
        check_batch(cfg, self.layout)
        if self.layout.shape.get("pipeline", 1) > 1:
            from meshpar import pipeline
            pipeline.check(cfg, self.layout, self.spec.shapes)
        self.tx = make_optimizer(cfg, self.spec)
        replicated = NamedSharding(self.mesh, P())
        self.param_shardings = param_shardings(self.spec, self.layout)
        self.grad_shardings = (state_shardings(self.spec, self.layout) if self.layout.strategy.shard_grads
                               else self.param_shardings)
        self.state_shardings = {"step": replicated, "params": self.param_shardings,
                                "opt": opt_state_shardings(self.tx, self.spec, self.layout),
                                "numerics": jax.tree.map(lambda _: replicated, jax.eval_shape(
                                    lambda: precision_lib.LOSS_SCALE.init(self.policy)))}
        self.batch_shape = (cfg.batch.global_size, cfg.batch.length + 1)
        self.batch_sharding = self.layout.sharding(("batch", None), self.batch_shape, "batch")
        self._init = jax.jit(self._init_fn, out_shardings=self.state_shardings)
        self._step = jax.jit(self._step_fn, in_shardings=(self.state_shardings, self.batch_sharding),
                             out_shardings=(self.state_shardings, replicated), donate_argnums=(0,))
        self._compiled = None

    # -- init ------------------------------------------------------------------------------------
    def _init_fn(self, key):
        from flax import nnx
        from meshpar import models
        model = models.build(self.cfg, nnx.Rngs(params=key))
        params = nnx.to_pure_dict(nnx.split(model)[1])
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt": self.tx.init(params),
                "numerics": precision_lib.LOSS_SCALE.init(self.policy)}

    def init(self, seed: int | None = None):
        """Sharded init: the jitted constructor writes each parameter straight into its shard."""
        key = jax.random.key(self.cfg.train.seed if seed is None else seed)
        return self._init(key)

    def abstract_state(self):
        key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
        out = jax.eval_shape(self._init_fn, key)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), out, self.state_shardings)

    # -- step ------------------------------------------------------------------------------------
    def _grads(self, params, tokens, loss_scale=None):
        """((loss, aux), grads) of one (micro)batch. With `loss_scale` S (fp16) the grads are those of
        loss * S, for the caller to unscale; loss and aux are never scaled."""
        if self.layout.shape.get("pipeline", 1) > 1:   # hand-written schedule (meshpar/pipeline.py)
            from meshpar import pipeline
            return pipeline.value_and_grad(self.spec, params, tokens, self.cfg, self.layout, self.policy, loss_scale)

        def loss_fn(p, t):
            loss, aux = loss_and_aux(self.spec.merge(p), t, self.policy)
            return precision_lib.LossScale.scale(loss, loss_scale), (loss, aux)
        with use_layout(self.layout):   # forward and backward are traced with the layout active
            (_, (loss, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        return (loss, aux), grads

    def _step_fn(self, state, batch):
        m = self.cfg.batch.microbatches
        params = state["params"]
        scale = state["numerics"]["loss_scale"] if self.policy.loss_scaling else None
        if m == 1:
            (loss, aux), grads = self._grads(params, batch, scale)
        else:
            mbs = split_microbatches(batch, m, self.layout)

            def acc(carry, mb):
                (l, a), g = self._grads(params, mb, scale)
                if self.layout.strategy.shard_grads:   # ZeRO-2: reduce-scatter each microbatch's grads,
                    g = jax.lax.with_sharding_constraint(g, self.grad_shardings)   # accumulate 1/N shards
                return jax.tree.map(jnp.add, carry, (l, a, g)), None

            (l0, a0), g0 = jax.eval_shape(self._grads, params, mbs[0], scale)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (l0, a0, g0))
            zeros = (zeros[0], zeros[1], jax.lax.with_sharding_constraint(zeros[2], self.grad_shardings))
            (loss, aux, grads), _ = jax.lax.scan(acc, zeros, mbs)
            loss, aux, grads = jax.tree.map(lambda x: x / m, (loss, aux, grads))
        grads = jax.lax.with_sharding_constraint(precision_lib.LossScale.unscale(grads, scale), self.grad_shardings)
        # a non-finite loss or gradient (or an fp16 overflow) skips the update: params and optimizer
        # state stay bitwise as they were; `numerics` counts it and adapts the fp16 loss scale
        apply, bad, numerics = precision_lib.LOSS_SCALE.update(self.policy, state["numerics"], loss, grads)
        updates, opt = self.tx.update(grads, state["opt"], params)
        new_params = optax.apply_updates(params, updates)
        params, opt = precision_lib.select(apply, (new_params, opt), (params, state["opt"]))
        metrics = {"loss": aux.pop("ce"), "total_loss": loss, "grad_norm": optax.tree.norm(grads),
                   "lr": lr_schedule(self.cfg)(state["step"]), **aux,
                   "nonfinite": bad.astype(jnp.int32), "skipped_steps": numerics["skipped_steps"]}
        if self.policy.loss_scaling:
            metrics.update(loss_scale=state["numerics"]["loss_scale"], overflows=numerics["overflows"])
        return {"step": state["step"] + 1, "params": params, "opt": opt, "numerics": numerics}, metrics

    def lower(self):
        batch = jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=self.batch_sharding)
        return self._step.lower(self.abstract_state(), batch)

    def compile(self):
        """Compile the step ahead of time (once); `step` then never retraces."""
        if self._compiled is None:
            self._compiled = self.lower().compile()
        return self._compiled

    def step(self, state, batch):
        return self.compile()(state, batch)

    # -- facts for logs --------------------------------------------------------------------------
    def describe(self) -> dict:
        return {"mesh": mesh_shape(self.mesh), "mesh_str": describe(self.mesh), "strategy": self.cfg.strategy,
                "precision": self.cfg.precision, "devices": self.mesh.devices.size,
                "params": self.spec.num_params, "tokens_per_step": self.cfg.batch.global_size * self.cfg.batch.length}


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
    matrix (no causal halving), as PaLM does."""
    return 6.0 * n_active + 12.0 * model_cfg.layers * model_cfg.heads * model_cfg.head_dim * length


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


def run(cfg, metrics_out: str | None = None, console=None) -> dict:
    """Train to `cfg.steps` steps; returns the end record. The loop a newcomer reads in one sitting.

    With `checkpoint.dir`: resume from its newest usable checkpoint (saved on any mesh/strategy),
    save every `checkpoint.every` steps (asynchronously) and at the end; SIGTERM/SIGINT save at the
    step reached and raise `Preempted`. A non-finite step never reaches the state (the compiled step
    skips it); with `train.on_nan=stop` the loop raises naming the step before any later save.
    """
    from meshpar.checkpoint import Checkpointer
    from meshpar.data import Batches, make_source
    from meshpar.distributed import Preempted, PreemptionGuard, progress
    from meshpar.metrics import MetricsLogger

    trainer = Trainer(cfg)
    source = make_source(cfg, trainer.spec.cfg.vocab)
    facts = trainer.describe()
    log = MetricsLogger(metrics_out, cfg.steps, console=console)
    floor = getattr(source, "entropy_rate", None)
    ckpt = Checkpointer(cfg, trainer, info=log.info) if cfg.checkpoint.dir else None
    found = ckpt.restore_latest() if ckpt else None
    resumed = {} if found is None else {"resumed_from": found.step, "resumed_path": found.path,
                                        "damaged_checkpoints": found.damaged}
    log.start({**facts, "processes": jax.process_count(), "entropy_floor": floor, **resumed, "config": cfg}, trainer)
    if found:
        saved_mesh = " ".join(f"{a}={n}" for a, n in (found.meta.get("mesh") or {}).items() if n > 1) or "1 device"
        log.info(f"resumed from step {found.step} ({found.path}; saved with {found.meta.get('strategy')} on "
                 f"{saved_mesh}, {found.meta.get('processes')} process(es), precision {found.meta.get('precision')})")

    t0 = time.perf_counter()
    compiled = trainer.compile()
    compile_s = time.perf_counter() - t0
    state = found.state if found else trainer.init()
    if found and found.meta.get("precision") != cfg.precision:   # the loss scale belongs to the old policy
        state["numerics"] = jax.device_put(precision_lib.LOSS_SCALE.init(trainer.policy),
                                           trainer.state_shardings["numerics"])
    data = Batches(source, trainer.batch_sharding, cfg.batch.global_size, cfg.batch.length, cfg.data.seed)
    if found:
        data.restore(found.data)
    peak, peak_src = peak_flops_per_device(cfg)
    fpt = flops_per_token(trainer.spec.cfg, active_params(trainer.spec, cfg), cfg.batch.length)
    log.info(f"compiled train step in {compile_s:.1f}s; MFU against {peak / 1e12:.3g} TFLOP/s/device ({peak_src})")

    start = int(state["step"])
    first_loss, last, pending, stop = None, None, None, None
    window_start, window_steps = time.perf_counter(), 0
    try:
        with PreemptionGuard() as guard:
            for step in range(start, cfg.steps):
                state, metrics = compiled(state, next(data))
                window_steps += 1
                if pending is not None:          # the previous step's flag, read while this one runs
                    _check_finite(cfg, *pending)
                pending = (step + 1, metrics["nonfinite"], metrics["loss"])
                progress["step"] = step + 1
                if (step + 1) % cfg.train.log_every == 0 or step + 1 == cfg.steps or step == start:
                    metrics = jax.device_get(metrics)
                    dt = (time.perf_counter() - window_start) / window_steps
                    tps = facts["tokens_per_step"] / dt
                    rec = {"step": step + 1, **{k: _jsonable(v) for k, v in metrics.items()}, "step_time_s": dt,
                           "tokens_per_s": tps, "mfu": fpt * tps / (peak * facts["devices"])}
                    first_loss = rec["loss"] if first_loss is None else first_loss
                    last = rec
                    log.step(rec)
                    window_start, window_steps = time.perf_counter(), 0
                stop = guard.reached(step + 1)
                if ckpt and (ckpt.due(step + 1) or stop or step + 1 == cfg.steps):
                    _check_finite(cfg, *pending)  # never save past a step that must stop the run
                    path = ckpt.save(step + 1, state, data.state(), wait=bool(stop))
                    log.info(f"checkpoint step {step + 1} -> {path}" + (" (written)" if stop else " (writing)"))
                if stop:
                    break
            if pending is not None:
                _check_finite(cfg, *pending)
    except Exception as e:
        if jax.process_count() > 1:      # a collective failed: if a peer died, exit naming it
            from meshpar.distributed import await_peer_verdict
            await_peer_verdict(e)
        raise
    finally:
        if ckpt:
            ckpt.close()     # finish the writes in flight: they hold good states
    end = {"steps": cfg.steps, "initial_loss": first_loss, "final_loss": last and last["loss"],
           "entropy_floor": floor, "compile_s": compile_s, "wall_s": time.perf_counter() - t0, **resumed}
    if floor is not None and first_loss is not None:
        from meshpar.data import floor_gap_closed
        end["gap_closed"] = floor_gap_closed(first_loss, last["loss"], floor)
    if stop:
        import signal as signal_lib
        name = signal_lib.Signals(stop).name
        end.update(preempted=name, stopped_at=progress["step"],
                   checkpoint=ckpt.path(progress["step"]) if ckpt else None)
        log.end(end)
        where = (f"saved checkpoint {ckpt.path(progress['step'])}; rerun the same command to resume" if ckpt
                 else "no checkpoint.dir, nothing saved")
        raise Preempted(stop, f"stopped by {name} after step {progress['step']}; {where}")
    log.end(end)
    return end


def _check_finite(cfg, step: int, nonfinite, loss) -> None:
    """`train.on_nan=stop`: raise if `step` had a non-finite loss or gradients (its update was skipped)."""
    if cfg.train.on_nan == "stop" and int(nonfinite):
        from meshpar.errors import MeshparError
        raise MeshparError(f"non-finite loss or gradients at step {step} (loss {float(loss)}); its update was "
                           "not applied and no checkpoint was written after it (train.on_nan=stop). Lower "
                           "train.lr, check the data, or set train.on_nan=skip to skip such steps")


def _jsonable(v):
    a = np.asarray(v)
    return float(a) if a.ndim == 0 else a.tolist()
