"""The train state and where it lives: mesh, layout, the shardings of every part of the state, and
the sharded init that writes each array straight into its shard.

The state is a dict of pure pytrees: `params` (nnx.Param, optimized), `vars` (all other NNX state:
RNG streams, counters, statistics; carried, never optimized), `opt`, `step`, `numerics`. The step
that updates it is `meshpar.train.step.Trainer`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar.core import precision as precision_lib
from meshpar.core.batch import Leaf, check_batch_spec, is_leaf, lm_batch_spec
from meshpar.core.config import BatchConfig, ModelConfig, top_k
from meshpar.core.config.checks import check_length
from meshpar.core.errors import ConfigError, ShardingError
from meshpar.core.layout import Layout
from meshpar.core.mesh import describe, mesh_shape
from meshpar.core.notices import config_warnings
from meshpar.core.objective import weight_of
from meshpar.core.platform import of_mesh
from meshpar.core.registry import loss_function
from meshpar.core.rules import check_rule_names, get_strategy, parse_user_rules
from meshpar.core.sharding import (
    batch_shardings,
    building,
    context_unsplit,
    opt_state_shardings,
    param_shardings,
    sharding_table,
    state_shardings,
    unruled_batch_axes,
    var_shardings,
)
from meshpar.nn.attention import AUTO_FLASH_FROM
from meshpar.nn.stages import check_protocol, check_state, protocol_weight, stage_loss
from meshpar.parallel import pipeline
from meshpar.runtime.placed import PlacedModel
from meshpar.train.data import packs_documents
from meshpar.train.flops import model_flops_per_step
from meshpar.train.loss import lm_loss
from meshpar.train.noops import Notices
from meshpar.train.optimizer import make_optimizer


def batch_axes_of(layout: Layout) -> tuple[str, ...]:
    """The mesh axes the `batch` dimension is split over (size > 1 only)."""
    spec = layout.spec(("batch",))
    axes = spec[0] if len(spec) else None
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def data_parallel_size(layout: Layout) -> tuple[int, str]:
    """Product (and description) of the mesh axes the `batch` dimension is split over."""
    axes, sizes = batch_axes_of(layout), layout.shape
    return math.prod(sizes[a] for a in axes), " x ".join(f"{a}={sizes[a]}" for a in axes) or "none"


def check_batch(batch: BatchConfig, layout: Layout) -> None:
    b, m = batch.global_size, batch.microbatches
    if b % m:
        raise ShardingError(f"batch.global_size={b} is not divisible by batch.microbatches={m}")
    dp, axes = data_parallel_size(layout)
    if (b // m) % dp:
        what = (
            f"batch.global_size={b}"
            if m == 1
            else f"the microbatch size {b // m} (batch.global_size={b} / batch.microbatches={m})"
        )
        raise ShardingError(
            f"{what} is not divisible by the data-parallel size {dp} ({axes}); "
            f"use a multiple of {dp * m} for batch.global_size"
        )


def check_platform(model: ModelConfig, backend: str) -> None:
    """Options that only some platforms have (`backend`: the mesh's, `meshpar.core.platform`)."""
    if model.attention == "cudnn" and backend != "gpu":
        raise ShardingError(
            f"model.attention=cudnn needs an NVIDIA GPU (this backend is {backend}); "
            "use model.attention=xla, or auto to let JAX choose"
        )
    if model.attention == "splash" and backend != "tpu":
        raise ShardingError(
            f"model.attention=splash needs a TPU (this backend is {backend}; elsewhere Pallas would "
            "interpret it, slowly); use model.attention=flash, or auto to let meshpar choose"
        )


@dataclass
class TrainSetup:
    """Everything a run needs that is not an array, but the step: mesh, layout, shardings, init.

    `model`: factory `rngs -> nnx.Module` (default: `cfg.model.name`). `loss`: `(model, batch) ->
    (scalar, metrics)` (default: `cfg.train.loss`, i.e. `lm_loss`). `batch_spec`: tree of
    `meshpar.Leaf` (default: token rows [B, T+1] from `cfg.batch`).
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
        self.placed = placed = PlacedModel.from_config(cfg, self.model, self.devices)
        self.mesh, self.policy, self.factory, self.spec = placed.mesh, placed.policy, placed.factory, placed.spec
        if (cp := mesh_shape(self.mesh)["context"]) > 1:  # (validate said it if the mesh was cfg.devices')
            check_length(cfg.batch.length, cp)
            precision_lib.check_loss_chunks(cfg.train.loss_chunks, cfg.batch.length, cp)
        self.layout = Layout(self.mesh, get_strategy(cfg.strategy), parse_user_rules(cfg.rules))
        check_platform(cfg.model, of_mesh(self.mesh))
        self.runs = _what_runs(cfg.model.name, cfg.train.loss, self.model, self.loss)
        self.loss = _loss_of(self.loss, cfg.train, cfg.batch.length)
        self.loss_name = getattr(self.loss, "__qualname__", repr(self.loss))
        # the loss's weight over a batch: its parts count by their shares of it (meshpar.core.objective)
        self.weight = protocol_weight(placed.abstract) if self.loss is stage_loss else weight_of(self.loss)
        check_batch(cfg.batch, self.layout)
        if self.batch_spec is None:
            self.batch_spec = lm_batch_spec(cfg.batch.global_size, cfg.batch.length, packs_documents(cfg.data))
        self.batch_warnings = _batch_warnings(self.batch_spec, self.layout, cfg.train.require_annotations, self.is_lm)
        self.idle_rules = check_rule_names(self.layout.user_rules, _names_used(self.spec, self.batch_spec))
        self.pipelined = self.layout.shape.get("pipeline", 1) > 1
        if self.pipelined:
            _check_pipeline(self, cfg.model, cfg.pipeline, cfg.batch)
        self.tx = make_optimizer(cfg.train, cfg.steps, self.spec)
        self.param_shardings = param_shardings(self.spec, self.layout)
        zero = self.layout.strategy.opt_state is not None
        self.grad_shardings = state_shardings(self.spec, self.layout) if zero else self.param_shardings
        self.state_shardings = _state_shardings(self, NamedSharding(self.mesh, P()))
        self.batch_sharding = batch_shardings(self.batch_spec, self.layout)
        self._init = jax.jit(self._init_fn, out_shardings=self.state_shardings)
        self.notices = Notices(self, cfg.strategy, cfg.train.seed, cfg.train.require_annotations)

    def warnings(self) -> list[str]:
        """The run's warning lines, one each (`_warnings` lists them)."""
        return _warnings(self.cfg, self.layout, self.pipelined, self.idle_rules, self.batch_warnings, self.notices)

    def sharding_table(self) -> list[dict]:
        """The sharding table of this run: parameters, other state, batch leaves, and with the
        built-in LM loss its tokens' activations [batch, length] (`length` over `context`)."""
        lm = _lm_activations(self.cfg.batch, self.policy.compute_dtype) if self.is_lm else None
        return sharding_table(self.spec, self.layout, self.batch_spec, lm)

    # -- init ------------------------------------------------------------------------------------
    def _init_fn(self, key):
        born = self.placed.init(key)
        return {
            "step": jnp.zeros((), jnp.int32),
            **born,
            "opt": self.tx.init(born["params"]),
            "numerics": precision_lib.LOSS_SCALE.init(self.policy),
        }

    def init(self, seed: int | None = None):
        """Sharded init: the jitted constructor writes each variable straight into its shard. With
        `model.init_from=hf:DIR` the parameters are read from DIR instead, each straight into its
        shard (`meshpar.io.hf`), and the rest of the state (optimizer, step 0) starts fresh."""
        key = jax.random.key(self.cfg.train.seed if seed is None else seed)
        if self.cfg.model.init_from:
            return _state_around(self, self.load_pretrained(), key)
        return self._init(key)

    def load_pretrained(self, shardings=None, shapes=None, info=None):
        """`model.init_from`'s parameters, in `shardings` (default: this run's) and `shapes`' dtypes."""
        return self.placed.pretrained(shardings or self.param_shardings, shapes or self.spec.shapes, info)

    def abstract_state(self):
        key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
        out = jax.eval_shape(self._init_fn, key)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), out, self.state_shardings)

    @property
    def batch_shape(self) -> tuple:
        """The global batch shape of a single-array batch ([B, T+1] tokens for the LM loss)."""
        if not is_leaf(self.batch_spec):
            raise AttributeError("batch_shape: this batch is a tree; see Trainer.batch_spec")
        return tuple(self.batch_spec.shape)

    # -- facts for logs --------------------------------------------------------------------------
    @property
    def is_lm(self) -> bool:
        return getattr(self.loss, "func", self.loss) is lm_loss  # (train.loss_chunks: a partial of it)

    def model_flops(self) -> tuple[float, str]:
        """Model FLOPs of one optimizer step and how they were counted (`meshpar.train.flops`)."""

        return model_flops_per_step(self, self.cfg.batch, self.cfg.train, top_k(self.cfg.moe))

    def run_facts(self) -> dict:
        """What a checkpoint keeps of the run that wrote it: its whole config, its seeds, its mesh,
        strategy and precision (`meshpar.io.checkpoint`)."""
        import dataclasses

        cfg = self.cfg
        return {
            "config": dataclasses.asdict(cfg),
            "rng": {"train.seed": cfg.train.seed, "data.seed": cfg.data.seed},
            "mesh": mesh_shape(self.mesh),
            "strategy": cfg.strategy,
            "precision": cfg.precision,
        }

    def describe(self) -> dict:
        """The run's facts for its logs: mesh, strategy, precision, devices, parameters, batch."""
        c = self.cfg
        return _describe(c.batch, c.strategy, c.precision, self.mesh, self.spec.num_params, self.is_lm)


def _state_around(setup, params, key):
    """The train state around given parameters: fresh optimizer state and variables, step 0."""

    def fn(params, key):
        state = setup._init_fn(key)  # its random parameters are dead code (XLA drops them)
        return {**state, "params": params, "opt": setup.tx.init(params)}

    return jax.jit(fn, out_shardings=setup.state_shardings, donate_argnums=(0,))(params, key)


def _warnings(cfg, layout: Layout, pipelined: bool, idle_rules: list, batch_warnings: list, notices) -> list[str]:
    """`TrainSetup.warnings`: the config's (`meshpar.core.notices`: keys it does not read, a warmup
    longer than the run), user rules that name no parameter, variable or batch leaf (they can only
    reach activations), the padded exchange of dropless expert parallelism, staged attention's
    kernel, the batch's (axes no rule maps, a `context` axis that splits no batch leaf of a user's
    loss), and settings that would change nothing (`notices`, `meshpar.train.noops.Notices`: names
    that are mesh axes, an idle mesh axis, sequence parallelism that splits nothing, a precision no
    matmul uses)."""

    out = config_warnings(cfg)
    if idle_rules:
        out.append(
            f"warning: {', '.join(idle_rules)} name no parameter, variable or batch leaf of this "
            "model: they apply only to activations constrained with those names"
        )
    return (
        out
        + _dropless_note(cfg.model.name, cfg.moe.capacity_factor, layout)
        + _staged_attention_note(pipelined, layout.mesh, cfg.model.attention)
        + [f"warning: {w}" for w in batch_warnings]
        + notices.lines()
    )


def _describe(batch, strategy: str, precision: str, mesh, params: int, is_lm: bool) -> dict:
    rows = batch.global_size
    return {
        "mesh": mesh_shape(mesh),
        "mesh_str": describe(mesh),
        "strategy": strategy,
        "precision": precision,
        "devices": mesh.devices.size,
        "params": params,
        "examples_per_step": rows,
        "tokens_per_step": rows * batch.length if is_lm else None,
    }


def _batch_warnings(batch_spec, layout: Layout, strict: bool, is_lm: bool) -> list[str]:
    """A batch spec checked (one line per fault) -> its warnings: batch axes no rule maps (an error
    when `strict`), and for a loss of the user's a `context` axis that splits no leaf (the built-in
    LM's rows are split over it)."""
    check_batch_spec(batch_spec)
    found = unruled_batch_axes(batch_spec, layout)
    if found and strict:
        raise ShardingError(f"{found[0]} (train.require_annotations=true)")
    return found + ([] if is_lm else context_unsplit(batch_spec, layout))


def _names_used(spec, batch_spec) -> set[str]:
    """The logical names a model's parameters, variables and batch leaves use."""
    leaves = [
        *jax.tree.leaves(spec.logical, is_leaf=lambda x: isinstance(x, tuple)),
        *jax.tree.leaves(spec.var_logical or {}, is_leaf=lambda x: isinstance(x, tuple)),
        *(leaf.axes for leaf in jax.tree.leaves(batch_spec, is_leaf=is_leaf)),
    ]
    return {n for names in leaves if names for n in names if n}


def _what_runs(model_name: str, loss_name: str, model: Callable | None, loss: Callable | None) -> str:
    """'model.name=pkg.mod:fn, train.loss=lm': the model and loss of a run, as the config names them
    (`model.name`, `train.loss`) or as passed in Python (`model`, `loss`), for what `user_code` says
    meshpar was doing."""
    model_part = f"model.name={model_name}" if model is None else f"model {getattr(model, '__qualname__', model)}"
    loss_part = f"train.loss={loss_name}" if loss is None else f"loss {getattr(loss, '__qualname__', loss)}"
    return f"{model_part}, {loss_part}"


def _loss_of(loss, train, length: int):
    """The loss a run trains: `loss` given, else `train.loss`; with `train.loss_chunks` > 1 the
    built-in LM loss over that many token slices (a loss passed in cannot be sliced: one line)."""
    if loss is None:
        return loss_function(train.loss, train.loss_chunks)
    if train.loss_chunks > 1:
        precision_lib.check_loss_chunks(
            train.loss_chunks,
            length,
            other_loss=None if loss is lm_loss else f"this Trainer's loss is {getattr(loss, '__qualname__', loss)}",
        )
        return loss_function("lm", train.loss_chunks)
    return loss


def _state_shardings(setup: TrainSetup, replicated) -> dict:
    """Where each part of the train state lives: step and numerics replicated, params as the layout
    puts them, the other variables, the optimizer state (sharded under ZeRO)."""
    return {
        "step": replicated,
        "params": setup.param_shardings,
        "vars": var_shardings(setup.spec, setup.layout),
        "opt": opt_state_shardings(setup.tx, setup.spec, setup.layout),
        "numerics": jax.tree.map(
            lambda _: replicated, jax.eval_shape(lambda: precision_lib.LOSS_SCALE.init(setup.policy))
        ),
    }


def _check_pipeline(setup: TrainSetup, m, pc, batch) -> None:
    """A pipeline cuts the loss into stages (meshpar.nn.stages): the built-in LM loss of a model
    with embed/layers/head, or `stage_loss` of one with pre/layers/post/loss. Errors name the stack
    as its user wrote it: `model.layers=4`, `model.size=tiny`, or a user model's `MyModel.layers`.
    m, pc, batch: the run's `cfg.model`, `cfg.pipeline` and `cfg.batch`."""

    if not setup.is_lm and setup.loss is not stage_loss:
        raise ConfigError(
            f"pipelining (mesh.pipeline > 1) cuts the loss into stages: train.loss=lm (a model with "
            f"embed/layers/head) or train.loss=stages (a model with pre/layers/post/loss, see "
            f"meshpar.nn.stages); {setup.loss_name} is neither. Set mesh.pipeline=1, or give the model "
            "those parts and train it with train.loss=stages"
        )
    abstract = setup.placed.abstract
    with building(setup.policy):
        check_protocol(abstract, lm=setup.is_lm)
    check_state(setup.spec)
    reference = setup.model is None and ":" not in m.name  # a meshpar.models model, sized by model.*
    stack = (
        f"{type(abstract).__name__}.layers"
        if not reference
        else f"model.layers={m.layers}"
        if m.layers
        else f"model.size={m.size}"
    )
    pipeline.check(pc, batch, setup.layout, setup.spec.shapes, stack, loss=None if setup.is_lm else setup.loss_name)


def _lm_activations(b, dtype) -> dict:
    """The built-in LM's token activations [batch, length] (`b`: the run's `cfg.batch`), a row of the sharding table."""
    return {"activations": Leaf((b.global_size, b.length), dtype, ("batch", "length"))}


def _staged_attention_note(pipelined: bool, mesh, attention: str) -> list[str]:
    """A pipeline on GPU or TPU with model.attention=auto: its stages attend with flash (one line why)."""

    where = of_mesh(mesh)
    if not pipelined or where == "cpu" or attention != "auto":
        return []
    kernel = "cuDNN" if where == "gpu" else "splash"
    return [
        f"note: model.attention=auto inside pipeline stages uses flash (xla below {AUTO_FLASH_FROM} keys), not "
        f"{kernel}: its backward loses the "
        "stage's varying axes under shard_map (meshpar.nn.attention)"
    ]


def _dropless_note(model_name: str, capacity_factor: float | None, layout) -> list[str]:
    """Dropless expert parallelism exchanges tokens with a padded all-to-all: one line saying so."""
    ep = layout.shape.get("expert", 1)
    if model_name != "moe" or capacity_factor is not None or ep == 1 or of_mesh(layout.mesh) != "cpu":
        return []
    return [
        f"note: dropless MoE over expert={ep} sends tokens with a padded all-to-all on CPU (each shard receives "
        f"{ep} x its routed rows; XLA:CPU has no ragged all-to-all, which GPUs and TPUs use: meshpar.nn.exchange)"
    ]
