"""A model as the pipeline executors call it (`StageModel`: one part of the stage protocol at a time,
`meshpar.nn.stages`, on pure dicts of parameters and state), and the executors' tools on the values
that travel between stages inside the pipeline's `shard_map`: `vary` (a loop carry or branch output
varies over the manual axes), `merge_stage_vars` (the state after a step), a microbatch's share of
the step's objective and the sum of the replicas' over a manual `data`, microbatch indexing."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from meshpar.core import objective
from meshpar.core.errors import ConfigError
from meshpar.core.layout import active_layout, constrain, use_layout
from meshpar.core.precision import chunked_cross_entropy
from meshpar.core.scopes import manual_axes
from meshpar.nn.layers import check_keeps
from meshpar.nn.stages import SEQUENCE_AXES, apply_layers, check_activation, check_loss


def whole(tree):
    """Each leaf replicated over the automatic mesh axes (those of the active layout): what the last
    stage's loss reads inside a pipeline (see `StageModel.post_loss`)."""
    layout = active_layout()
    return tree if layout is None else jax.tree.map(lambda a: constrain(a, (None,) * jnp.ndim(a)), tree)


def vary(x):
    """Mark a value (each leaf of a pytree) as varying over the manual axes (`pipeline`, and `data`
    when the pipeline is manual over it): loop carries and branch outputs must agree."""

    def one(a):
        missing = tuple(n for n in manual_axes() if n not in jax.typeof(a).mat.varying)
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(one, x)


def zeros(spec):
    """Zeros of a pytree of shapes (`jax.eval_shape`'s ShapeDtypeStructs)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), spec)


@dataclass(frozen=True)
class StageModel:
    """A model as the pipeline executors call it: parameters as pure dicts {outer..., "layers": this
    stage's layers}, non-Param state `vars` as a pure dict, one microbatch `mb` (a batch pytree)."""

    spec: object
    policy: object
    lm: bool  # the reference LM's cut (embed/head + cross-entropy) or the protocol's
    embed_specs: object = None  # outer parameters' layouts with the batch axes dropped
    loss_chunks: int = 1  # the LM head + cross-entropy in this many token slices (train.loss_chunks)
    weight: objective.Weight = objective.rows  # a microbatch -> its weight (the LM: `lm_rows_weight`)

    def parts(self, mbs, total):
        """Each microbatch's share w_i / W of the step's objective, [M] (`meshpar.core.objective`; mbs:
        leaves [M, b, ...]; `total`: the step's whole batch's weight W): of this replica's rows when
        the pipeline is manual over `data`, of whole sequences split over a manual `context` (their
        shards' weights summed). Found once, before the ticks: no tick's branch holds a collective."""
        w = jax.vmap(self.weight)(mbs)
        over = tuple(a for a in manual_axes() if a in SEQUENCE_AXES)
        return objective.share(lax.psum(w, over) if over else w, total)

    def for_embed(self, outer):
        """The outer parameters as the first stage reads them: gathered over the batch axes
        (data/fsdp/expert), as FSDP gathers a weight at its use. (A gather whose table is split on
        E over `data` while its indices are split on B over `data` crashes XLA's SPMD partitioner
        inside a partially manual shard_map on JAX 0.10.)"""
        if self.embed_specs is None:
            return outer
        return jax.tree.map(lax.with_sharding_constraint, outer, self.embed_specs)

    def module(self, outer, layers, vars=None):
        """The module of these parameters; without `vars`, zeros stand for its state (the stacked
        layers read none of it, so the zeros are dead code)."""
        if vars is None and self.spec.var_treedef is not None:
            vars = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.spec.var_shapes)
        return self.spec.merge({**outer, "layers": layers}, vars)

    def pre(self, outer, layers, vars, mb):
        """First stage: mb -> (x [b, ...] in the compute dtype, or the user's pytree; vars after `pre`)."""
        m = self.module(outer, layers, vars)
        x = (
            m.embed(mb["inputs"], self.policy.compute_dtype)
            if self.lm
            else check_activation(m.pre(mb), f"{type(m).__name__}.pre")
        )
        return x, self.spec.vars_of(m)

    def stage(self, outer, layers, x, mb):
        """This stage's layers [Lc, ...], x, the microbatch (the LM reads its rows' positions and
        segment ids) -> (y, aux loss scalar, metrics {k: [Lc]})."""
        m = self.module(outer, layers)
        pos, seg = (mb["positions"], mb.get("segment_ids")) if self.lm else (None, None)
        y, loss, aux = apply_layers(m, vary(x), pos, seg)  # vary: the scan's carry
        check_keeps(x, y, f"a pipeline stage of {type(m.layers).__name__} layers")  # the ring's buffers are x's
        return y, vary(loss), aux  # varies over stages

    def post_loss(self, outer, layers, vars, y, mb):
        """Last stage: y -> (the microbatch's loss (fp32 scalar), its metrics, vars after `post`).

        A user's loss runs whole on every device of the last stage (of its replica, when the pipeline
        is manual over `data`): post's outputs, the microbatch and the parameters the loss reads are
        gathered over the automatic mesh axes first, and `constrain` splits nothing inside it. Inside
        the pipeline's partly manual shard_map XLA's SPMD partitioner (JAX 0.10) aborts the process
        on a gather along a dimension split over one automatic axis while the other operand is split
        over another (`take_along_axis` of logits split on `vocab` over `tensor` with targets split
        over `data`), and a loss mixing rows split over `data` (`jnp.roll`, `h @ h.T`) compiled to a
        collective-permute over all devices inside this stage's branch, which the other stages never
        join (a hang). A loss on whole arrays partitions nothing: the same loss as on one device.
        `post` keeps its layout (a head split over `tensor` stays so) unless it gathers (pooling a
        token with `take_along_axis`, say): then it runs whole too."""

        m = self.module(outer, layers, vars)
        if self.lm:  # a sequence split over a manual `context`: sums over its shards
            over = tuple(a for a in manual_axes() if a in SEQUENCE_AXES)
            loss = chunked_cross_entropy(
                lambda z: m.head(z, self.policy.compute_dtype),
                y,
                mb["targets"],
                mb.get("weights"),
                self.loss_chunks,
                over,
            )
            metrics = {}
        else:
            return self._post_loss(outer, layers, vars, y, mb)
        return (
            loss.astype(jnp.float32),
            {k: jnp.asarray(v, jnp.float32) for k, v in dict(metrics).items()},
            self.spec.vars_of(m),
        )

    def _post_loss(self, outer, layers, vars, y, mb):
        """`post_loss` of a user's model: post (whole if it gathers), then its loss whole."""
        layout = active_layout()
        nothing_split = layout and layout.hiding(layout.shape)  # `constrain` inside splits nothing
        gathers = _gathers(
            jax.make_jaxpr(lambda o, lay, vs, x: self.module(o, lay, vs).post(x))(outer, layers, vars, y).jaxpr
        )
        m = self.module(whole(outer), layers, vars) if gathers else self.module(outer, layers, vars)
        with use_layout(nothing_split if gathers else layout):
            outputs = whole(m.post(whole(y) if gathers else y))
        m = self.module(whole(outer), layers, self.spec.vars_of(m))
        with use_layout(nothing_split):
            loss, metrics = check_loss(m.loss(outputs, whole(mb)), f"{type(m).__name__}.loss")
        return (
            loss.astype(jnp.float32),
            {k: jnp.asarray(v, jnp.float32) for k, v in dict(metrics).items()},
            self.spec.vars_of(m),
        )


def _gathers(jaxpr) -> bool:
    """Whether a jaxpr (or one inside it: a jit, a scan, a custom derivative) gathers."""
    from jax.extend.core import subjaxprs

    return any(e.primitive.name == "gather" for e in jaxpr.eqns) or any(map(_gathers, subjaxprs(jaxpr)))


def merge_stage_vars(vars_in, vars_out, stages: int, axis: str):
    """The state after a pipelined step: where the first stage changed a leaf (state of `pre`) its
    value there, else the last stage's (state of `post`, or the leaf unchanged). Selected with psums
    of masked values over the pipeline axis, so the result is exact and replicated."""
    s = lax.axis_index(axis)

    def one(a, b):
        mine = lambda k, x: lax.psum(jnp.where(s == k, x, jnp.zeros_like(x)), axis)
        changed = mine(0, jnp.any(a != b).astype(jnp.int32)) > 0
        return jnp.where(changed, mine(0, b), mine(stages - 1, b))

    return jax.tree.map(one, vars_in, vars_out)


# ----------------------------------------------------------------------------------------------
# The executors' tools on a stage's values (meshpar.parallel.gpipe, meshpar.parallel.one_f_one_b).

AXIS = "pipeline"


def reduce_batch(x, stages: bool = False):
    """Once per step, in one all-reduce: the sum over a manual `data` (each replica's values are
    already its share of the step's objective, `StageModel.parts`), the mean over a manual `context`
    (its devices hold parts of the same sequences), and with `stages` the sum over `pipeline`."""
    axes = tuple(a for a in manual_axes() if stages or a != AXIS)
    seq = math.prod(lax.axis_size(a) for a in axes if a in SEQUENCE_AXES)
    if not axes:
        return x
    return lax.psum(x, axes) / seq if seq > 1 else lax.psum(x, axes)


def vary_tree(tree):
    return jax.tree.map(vary, tree)


def zeros_like_varying(tree):
    return jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), tree)


def split_params(params: dict):
    """{outer..., "layers": stack} -> (outer, stack); one line for a model with no stacked layers."""
    if "layers" not in params:
        raise ConfigError(
            "pipelining needs a model with stacked layers under the parameter key 'layers' "
            "(meshpar.nn.layers.stacked); set mesh.pipeline=1 for this model"
        )
    outer = {k: v for k, v in params.items() if k != "layers"}
    return outer, params["layers"]


def microbatch(mbs, i):
    """Microbatch i of a batch pytree whose leaves are [M, b, ...]."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), mbs)
