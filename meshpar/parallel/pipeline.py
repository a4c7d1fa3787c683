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

The schedules (tick tables) live in `meshpar.parallel.schedules`; `meshpar.parallel.gpipe` executes
GPipe and interleaved (autodiff of the forward tick loop, each stage rematerialised from its stashed
input: a device stashes M stage inputs, interleaved v M) and `meshpar.parallel.one_f_one_b` executes
1F1B (forward and backward explicit, the stage's `jax.vjp` residuals stashed for at most 2P - 1
microbatches; memory in bench/RESULTS.md, `## Pipeline`). Both call the model through
`meshpar.parallel.stage_model.StageModel`, where the XLA workarounds each part needs are noted.

Stored layer order stays the model's order (so a checkpoint means the same model on any mesh, and the
pipelined loss equals the non-pipelined one); at rest device s holds layers [s L/P, (s+1) L/P). The
interleaved schedule needs chunks {r P + s}; the step moves them there with one all-to-all over
`pipeline` (and the gradients back), never an all-gather of the stack.

`batch.microbatches` (gradient accumulation, outside) and `pipeline.microbatches` (M, inside one
pipelined forward/backward) are independent: each accumulation step is pipelined into M microbatches.
"""

from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshpar.core import objective
from meshpar.core.batch import Leaf
from meshpar.core.errors import ConfigError, ShardingError
from meshpar.core.layout import use_layout, without
from meshpar.core.rules import BATCH_AXES, spec_axes
from meshpar.core.sharding import split_microbatches
from meshpar.nn import dropless, dropout
from meshpar.nn.stages import lm_rows, lm_rows_weight
from meshpar.parallel import context, gpipe, one_f_one_b
from meshpar.parallel.stage_model import AXIS, StageModel, split_params

# the axes FSDP splits weights over; 1F1B's stages gather a layer's weights over them at use, before
# the layer, explicitly (`meshpar.core.layout.at_use`): the reshards XLA chose inside a stage's branch
# joined the other stages' devices (a deadlock). Expert weights stay split over their `expert` axis.
FSDP_AXES = ("data", "fsdp", "expert")


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
        raise ConfigError(
            f"mesh.context={cp} with mesh.pipeline > 1 needs the built-in LM loss (train.loss=lm): a "
            f"pipeline stage splits the LM's rows over context, and knows nothing of {loss}'s batch; set "
            "mesh.context=1 or mesh.pipeline=1"
        )
    split_params(shapes)
    num_layers = jax.tree.leaves(shapes["layers"])[0].shape[0]
    if v > 1 and pc.schedule != "interleaved":
        raise ConfigError(
            f"pipeline.virtual_stages={v} needs pipeline.schedule=interleaved "
            f"(got {pc.schedule}); set pipeline.virtual_stages=1 or the interleaved schedule"
        )
    if num_layers % (p * v):
        what = stack if stack == f"model.layers={num_layers}" else f"{stack} stacks {num_layers} blocks, which"
        raise ConfigError(
            f"{what} is not divisible by mesh.pipeline={p} x pipeline.virtual_stages={v} "
            f"(= {p * v} chunks); use a multiple of {p * v} stacked layers"
        )
    if pc.schedule == "interleaved" and v > 1 and m % p:
        raise ConfigError(
            f"pipeline.microbatches={m} is not a multiple of mesh.pipeline={p}, which the "
            f"interleaved schedule needs (microbatches enter in groups of {p}); "
            f"use {p * max(1, round(m / p))}"
        )
    rows = batch.global_size // batch.microbatches
    what = (
        f"batch.global_size={batch.global_size}"
        if batch.microbatches == 1
        else f"the accumulation step of {rows} sequences (batch.global_size={batch.global_size} / "
        f"batch.microbatches={batch.microbatches})"
    )
    if rows % m:
        raise ConfigError(
            f"{what} does not split into pipeline.microbatches={m} microbatches; "
            f"use a multiple of {m * batch.microbatches} for batch.global_size"
        )
    dp = layout.ways("batch")
    if (rows // m) % dp:
        raise ShardingError(
            f"the pipeline microbatch of {rows // m} sequences ({what} / pipeline.microbatches={m})"
            f" is not divisible by the data-parallel size {dp}; use a multiple of "
            f"{dp * m * batch.microbatches} for batch.global_size"
        )


# ----------------------------------------------------------------------------------------------
# Entry point used by meshpar.train.step.Trainer._grads.


def value_and_grad(
    spec,
    params: dict,
    batch,
    pc,
    layout,
    policy,
    loss_scale=None,
    vars=None,
    lm: bool = True,
    batch_spec=None,
    loss_chunks: int = 1,
    weighting=None,
):
    """Pipelined ((loss, aux), grads), the structure of `jax.value_and_grad` of the loss the model's
    parts make (`meshpar.nn.stages`): next-token cross-entropy (`lm`; aux holds "ce") or `stage_loss` (aux holds the
    model loss's metrics), with the layers' metrics stacked [L] and "vars", the model's non-Param state after the
    step. params, vars: pure dicts; batch: the batch pytree [B, ...] (`batch_spec` its leaves' logical axes); `pc`:
    the run's `cfg.pipeline`; `loss_chunks`: the LM head's token slices (`train.loss_chunks`). `weighting`:
    (weight, W), the loss's weight over a batch (`meshpar.core.objective`; the LM's is counted on its rows) and the
    step's whole batch's: each microbatch's loss, metrics and gradients count w / W, summed (default: this batch
    is the step's, its microbatches counted by their rows). With `loss_scale` S (fp16) the grads are those of
    loss * S (the caller unscales); loss and aux are never scaled."""

    p = layout.shape[AXIS]
    m = pc.microbatches
    v = pc.virtual_stages if pc.schedule == "interleaved" else 1
    data = _manual_batch_axes(spec, layout)
    weight, total = weighting if weighting is not None else (objective.rows, None)
    weight = lm_rows_weight if lm else weight  # the LM's microbatches are its rows (`_lm_rows`)
    model = StageModel(spec, policy, lm, _embed_specs(spec, layout, data), loss_chunks, weight)
    vars = {} if vars is None else vars
    mesh = layout.mesh
    with use_layout(layout):
        seq = (context.AXIS,) if lm and context.context_size() > 1 else ()
    manual = (AXIS,) + data + seq

    def in_body(f):
        """Trace `f` with the manual batch (and sequence) axes hidden from `constrain`; under 1F1B
        the stages run in per-device branches (weights gathered at use, see FSDP_AXES; dropless MoE
        layers route replicated)."""

        def run(*args):
            inner = layout.hiding(data + seq).gathering(FSDP_AXES if pc.schedule == "1f1b" else ())
            with use_layout(inner), context.balanced(bool(seq)), dropless.in_device_branches(pc.schedule == "1f1b"):
                return f(*args)

        return run

    with use_layout(layout), _manual_in_constraints(data + seq):
        outer, layers = split_params(params)
        n_layers = jax.tree.leaves(layers)[0].shape[0]
        if lm:  # the LM's rows [B, T] (balanced over `context`), cut before the shard_map
            batch, batch_spec = _lm_rows(batch)
        total = weight(batch) if total is None else total
        mbs = split_microbatches(batch, m, layout, batch_spec)
        mb_specs = jax.tree.map(lambda a: P(None, data or None, *seq[: a.ndim - 2]), mbs)
        if pc.schedule == "1f1b":
            body = in_body(partial(one_f_one_b.grads, model, p, m))
            fn = jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P(), P(AXIS), P(), mb_specs, P(), P()),
                out_specs=(P(), P(), P(AXIS), P(), P(), P(AXIS), P()),
                axis_names=set(manual),
            )
            seed = jnp.ones((), jnp.float32) if loss_scale is None else jnp.asarray(loss_scale, jnp.float32)
            loss, ce, metrics, lmet, d_outer, d_layers, vars = fn(outer, layers, vars, mbs, seed, total)
            grads = {**d_outer, "layers": d_layers}
        else:

            def loss_fn(prm):
                o, lay = split_params(prm)
                chunks = _to_chunks(lay, p, v)  # [v, P*Lc, ...], device s holds chunks r*P + s
                body = in_body(partial(gpipe.circular_loss, model, p, m, v))
                fn = jax.shard_map(
                    body,
                    mesh=mesh,
                    in_specs=(P(), P(None, AXIS), P(), mb_specs, P()),
                    out_specs=(P(), (P(), P(None, AXIS), P(), P())),
                    axis_names=set(manual),
                )
                loss_, (ce_, met_, lmet_, vars_) = fn(o, chunks, vars, mbs, total)
                met_ = jax.tree.map(lambda a: a.reshape((n_layers,) + a.shape[2:]), met_)
                scaled = loss_ if loss_scale is None else loss_ * jnp.asarray(loss_scale).astype(loss_.dtype)
                return scaled, (loss_, ce_, met_, lmet_, vars_)

            (_, (loss, ce, metrics, lmet, vars)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return (loss, {**({"ce": ce} if lm else {}), **lmet, **metrics, "vars": vars}), grads


@contextlib.contextmanager
def _manual_in_constraints(manual: tuple):
    """One line for a model whose own sharding constraint (`jax.lax.with_sharding_constraint` with a
    PartitionSpec) names a batch axis this pipeline holds manual, which JAX refuses inside the
    shard_map (a ValueError naming "Auto axes")."""
    try:
        yield
    except ValueError as e:
        if not manual or "Auto axes" not in str(e):
            raise
        axes = " and ".join(f"'{a}'" for a in manual)
        raise ConfigError(
            f"the model constrains an activation over mesh axis {axes}, which this pipeline runs manual "
            f"(each replica pipelines its own rows: meshpar.parallel.pipeline); constrain it with logical "
            "names instead (meshpar.constrain, or flax.linen.with_logical_constraint: the rules place "
            "them), or split the batch over mesh.fsdp rather than mesh.data"
        ) from None


def _lm_rows(batch):
    """Token rows [B, T+1] (or packed documents) -> the LM's rows {inputs, targets, positions, ...}
    [B, T] in the balanced order when sequences are split over `context`, and their batch spec."""

    rows = context.balance_rows(lm_rows(batch), positions=True)
    return rows, {k: Leaf(a.shape, a.dtype, ("batch", "length")) for k, a in rows.items()}


def _manual_batch_axes(spec, layout) -> tuple:
    """("data",) when the pipeline can also be manual over `data` (the batch's leading axis, no
    parameter is split over it, and the model has no non-Param state: BatchNorm statistics and
    dropout masks of `pre`/`post` must see the whole microbatch), else (): see the module docstring."""
    batch = layout.spec(("batch",))
    if (
        layout.shape.get("data", 1) <= 1
        or not len(batch)
        or spec_axes(batch[:1])[:1] != ("data",)
        or spec.var_treedef is not None
        or dropout.draws(spec.graphdef)
    ):
        return ()
    specs = jax.tree.leaves(
        jax.tree.map(
            lambda sh, names: layout.spec(names, sh.shape),
            spec.shapes,
            spec.logical,
            is_leaf=lambda x: isinstance(x, tuple),
        ),
        is_leaf=lambda x: isinstance(x, P),
    )
    return () if any("data" in spec_axes(sp) for sp in specs) else ("data",)


# jaxlib 0.11's SPMD partitioner aborts the process (spmd_partitioner_util.cc: "Check failed:
# partition_group_list.num_replica_groups() * ...", in PartitionGatherTrivialSlicedOperandDimensions)
# on the first stage's embedding gather from a table split over `tensor` inside the pipeline's partly
# manual shard_map, when a batch axis (data, fsdp) is automatic there too (fsdp_tp on pipeline x data x
# tensor, gpipe and 1f1b; jaxlib 0.10 partitions it). There the outer parameters are read whole over
# `tensor` as well: V x E more per device than V x E / tensor, for the step.
_GATHER_OVER_TENSOR_ABORTS = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)


def _embed_specs(spec, layout, manual: tuple = ()):
    """At-rest PartitionSpecs of the outer (non-`layers`) parameters without the batch mesh axes (and
    without `tensor` where jaxlib aborts partitioning a gather split over it beside a batch axis that
    is automatic in the pipeline, one not in `manual`: `_GATHER_OVER_TENSOR_ABORTS`)."""
    beside = any(layout.shape.get(a, 1) > 1 for a in BATCH_AXES if a not in manual)
    whole = _GATHER_OVER_TENSOR_ABORTS and beside and layout.shape.get("tensor", 1) > 1
    drop = BATCH_AXES + (("tensor",) if whole else ())

    def one(shape, names):
        return without(layout.spec(names, shape.shape), drop)

    shapes, logical = split_params(spec.shapes)[0], split_params(spec.logical)[0]
    return jax.tree.map(one, shapes, logical, is_leaf=lambda x: isinstance(x, tuple))


def _to_chunks(layers, p: int, v: int):
    """[L, ...] -> [v, P*Lc, ...]: row block s of chunk-row r is global chunk r*P + s, which
    `P(None, 'pipeline')` places on device s. For v = 1 this is a free reshape of the at-rest layout."""

    def one(a):
        lc = a.shape[0] // (p * v)
        return a.reshape((v, p * lc) + a.shape[1:])

    return jax.tree.map(one, layers)
