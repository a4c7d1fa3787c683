"""The stage protocol: a model cut into the parts a pipeline runs on different devices.

A model you want to pipeline names three parts and a loss, each taking one microbatch of a batch
pytree (leaves [b, ...]):

    model.pre(batch) -> x                          # first stage: inputs -> activations x [b, ...]
                                                   #   (or any pytree of arrays: (y [b, T, E], enc [b, S, E]))
    model.layers                                   # a meshpar.stacked stack: layer(x) -> x or (x, aux)
    model.post(x) -> outputs                       # last stage
    model.loss(outputs, batch) -> (loss, metrics)  # last stage: a scalar and a dict of scalars

`stage_loss(model, batch)` is such a model's whole loss (`train.loss=stages`): the same function
trains it on any mesh, and with mesh.pipeline > 1 `meshpar.parallel.pipeline` runs `pre` on stage 0, the
layers across the stages and `post` + `loss` on the last, microbatch by microbatch. A layer's aux
value under the key `loss` (already weighted, MoE load balancing say) is added to the loss, the
rest are metrics stacked [layers]. Non-Param state (BatchNorm statistics, dropout RNG streams) may
live in `pre` and `post`: each runs on one stage, once per microbatch in order, as gradient
accumulation over `pipeline.microbatches` runs them on one device. The stacked layers hold
parameters only (a layer's state would have to travel between stages with every microbatch); their
dropout carries no state (`meshpar.nn.dropout`: keys derived from step, microbatch and layer).

The reference LM is the same cut: `embed` (the inputs [b, T] -> [b, T, E]), `layers` (called with
positions, and segment ids for packed documents), `head` + next-token cross-entropy against the
targets; `lm_rows` makes those rows from token rows [B, T+1] before the batch is cut into
microbatches (so a pipeline can also split them over `context`).
A model whose body is more than that cut (say layers after the stack) declares so with an optional
`model.pipeline_refusal() -> str | None` (the reason, one clause), and is refused in one line.
`StageModel` is what the pipeline executors call: one part at a time, on pure dicts of
parameters and state, returning the state a part changed.
x keeps its structure, shapes and dtypes through the layers; each leaf travels between stages.
`check_loss`, `check_activation` and `meshpar.nn.layers` put a part that breaks the protocol in one line.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshpar.core.errors import ConfigError
from meshpar.core.rules import active_layout, constrain, use_layout
from meshpar.nn.layers import check_keeps, scan_layers

PROTOCOL = ("pre", "post", "loss")
SEQUENCE_AXES = ("context",)     # mesh axes a pipeline splits the LM's rows [b, T] over (manually)


def layer_options(model) -> tuple[str, bool]:
    """(remat policy, lax.scan?) for the stacked layers: the model's own `cfg` if it keeps one."""
    cfg = getattr(model, "cfg", None)
    return getattr(cfg, "remat", "full"), getattr(cfg, "scan_layers", True)


def apply_layers(model, x, positions=None, segment_ids=None):
    """The stack `model.layers` on x -> (x, aux loss scalar, aux metrics {k: [layers]})."""
    remat, scan = layer_options(model)
    x, aux = scan_layers(model.layers, x, positions, remat, scan, segment_ids=segment_ids)
    aux = dict(aux)
    extra = jnp.sum(aux.pop("loss")).astype(jnp.float32) if "loss" in aux else jnp.zeros((), jnp.float32)
    return x, extra, aux


def lm_rows(batch) -> dict:
    """The LM's rows [B, T] from token rows [B, T+1] or packed documents {"tokens", "segment_ids",
    "positions"} [B, T+1]: inputs, targets (the next tokens) and, for documents, the inputs'
    positions and segment ids and the targets' weights (1 where a target stays in its input's
    document, else 0)."""
    docs = isinstance(batch, dict)
    tokens = batch["tokens"] if docs else batch
    rows = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if docs:
        seg = batch["segment_ids"]
        rows.update(positions=batch["positions"][:, :-1], segment_ids=seg[:, :-1],
                    weights=(seg[:, 1:] == seg[:, :-1]).astype(jnp.float32))
    return rows


def stage_loss(model, batch):
    """`train.loss=stages`: model.loss(model.post(layers(model.pre(batch))), batch), plus the layers'
    aux loss. The loss a pipeline computes stage by stage, computed in one piece."""
    x, extra, aux = apply_layers(model, check_activation(model.pre(batch), f"{type(model).__name__}.pre"))
    loss, metrics = check_loss(model.loss(model.post(x), batch), f"{type(model).__name__}.loss")
    return loss + extra, {**dict(metrics), **aux}


def check_protocol(module, lm: bool) -> None:
    """One line naming what a model lacks to be pipelined with its loss."""
    name = type(module).__name__
    need = ("embed", "head") if lm else PROTOCOL
    missing = [m for m in need if not callable(getattr(module, m, None))]
    if missing or not hasattr(module, "layers"):
        what = ("the built-in LM loss needs .embed(tokens, dtype), .layers (meshpar.stacked) and .head(x, dtype)"
                if lm else "train.loss=stages needs .pre(batch), .layers (meshpar.stacked), .post(x) and "
                           ".loss(outputs, batch) (meshpar.nn.stages)")
        lacks = ", ".join(f".{m}" for m in missing + ([] if hasattr(module, "layers") else ["layers"]))
        raise ConfigError(f"model {name} cannot be pipelined: {what}; it lacks {lacks}. Or set mesh.pipeline=1")
    refusal = getattr(module, "pipeline_refusal", None)
    why = refusal() if callable(refusal) else None
    if why:
        raise ConfigError(f"model {name} cannot be pipelined: {why}; set mesh.pipeline=1")


def check_state(spec) -> None:
    """The stacked layers hold parameters only (see the module docstring); one line otherwise."""
    inside = [k for k in (spec.var_shapes or {}) if k == "layers"]
    if inside:
        paths = [".".join(str(getattr(p, "key", p)) for p in path) for path, _ in
                 jax.tree_util.tree_leaves_with_path(spec.var_shapes["layers"])]
        raise ConfigError(f"pipelining: the stacked layers hold non-Param state (layers.{paths[0]}, ...: a dropout RNG "
                          "stream or statistics would have to travel between stages); build the stack with "
                          "meshpar.stacked (its dropout holds no state), keep other state in pre/post "
                          "(meshpar.nn.stages), or set mesh.pipeline=1")


def check_loss(out, name: str):
    """A loss's output -> (loss, metrics): one line unless it is (a scalar, a dict of metrics)."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        got = (f"a bare array of shape {tuple(jnp.shape(out))}" if hasattr(out, "shape") else
               f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, tuple) else ""))
        raise ConfigError(f"loss function {name} must return (loss, metrics_dict), got {got}; return (loss, {{}}) "
                          "for a loss without metrics")
    loss, metrics = out
    if jnp.shape(loss) != ():
        raise ConfigError(f"loss function {name} returned a loss of shape {tuple(jnp.shape(loss))}; it must be a "
                          "scalar (reduce it, e.g. with .mean())")
    return loss, metrics


def whole(tree):
    """Each leaf replicated over the automatic mesh axes (those of the active layout): what the last
    stage's loss reads inside a pipeline (see `StageModel.post_loss`)."""
    layout = active_layout()
    return tree if layout is None else jax.tree.map(lambda a: constrain(a, (None,) * jnp.ndim(a)), tree)


def manual_axes() -> tuple[str, ...]:
    """The mesh axes the enclosing shard_map is manual over (`pipeline`, maybe `data`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual)


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


def check_activation(x, what: str):
    """`pre`'s output: any pytree of arrays (one line naming the leaf otherwise) -> x."""
    leaves = jax.tree_util.tree_leaves_with_path(x)
    bad = [(k, a) for k, a in leaves if not isinstance(a, (jax.Array, np.ndarray))]
    if not leaves or bad:
        where = f" at {jax.tree_util.keystr(bad[0][0]) or 'the top'}: {type(bad[0][1]).__name__}" if bad else \
            ": no array"
        raise ConfigError(f"{what} returned a non-array{where}; it must return the activation the stacked layers "
                          "take, an array or any pytree (dict, tuple, list) of arrays, constrained with their "
                          "logical axes")
    return x


@dataclass(frozen=True)
class StageModel:
    """A model as the pipeline executors call it: parameters as pure dicts {outer..., "layers": this
    stage's layers}, non-Param state `vars` as a pure dict, one microbatch `mb` (a batch pytree)."""
    spec: object
    policy: object
    lm: bool                        # the reference LM's cut (embed/head + cross-entropy) or the protocol's
    embed_specs: object = None      # outer parameters' layouts with the batch axes dropped
    loss_chunks: int = 1            # the LM head + cross-entropy in this many token slices (train.loss_chunks)

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
        x = m.embed(mb["inputs"], self.policy.compute_dtype) if self.lm else \
            check_activation(m.pre(mb), f"{type(m).__name__}.pre")
        return x, self.spec.vars_of(m)

    def stage(self, outer, layers, x, mb):
        """This stage's layers [Lc, ...], x, the microbatch (the LM reads its rows' positions and
        segment ids) -> (y, aux loss scalar, metrics {k: [Lc]})."""
        m = self.module(outer, layers)
        pos, seg = (mb["positions"], mb.get("segment_ids")) if self.lm else (None, None)
        y, loss, aux = apply_layers(m, vary(x), pos, seg)     # vary: the scan's carry
        check_keeps(x, y, f"a pipeline stage of {type(m.layers).__name__} layers")   # the ring's buffers are x's
        return y, vary(loss), aux                             # varies over stages

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
        from meshpar.core.precision import chunked_cross_entropy
        m = self.module(outer, layers, vars)
        if self.lm:   # a sequence split over a manual `context`: sums over its shards
            over = tuple(a for a in manual_axes() if a in SEQUENCE_AXES)
            loss = chunked_cross_entropy(lambda z: m.head(z, self.policy.compute_dtype), y, mb["targets"],
                                         mb.get("weights"), self.loss_chunks, over)
            metrics = {}
        else:
            return self._post_loss(outer, layers, vars, y, mb)
        return loss.astype(jnp.float32), {k: jnp.asarray(v, jnp.float32) for k, v in dict(metrics).items()}, \
            self.spec.vars_of(m)

    def _post_loss(self, outer, layers, vars, y, mb):
        """`post_loss` of a user's model: post (whole if it gathers), then its loss whole."""
        layout = active_layout()
        nothing_split = layout and layout.hiding(layout.shape)      # `constrain` inside splits nothing
        gathers = _gathers(jax.make_jaxpr(lambda o, lay, vs, x: self.module(o, lay, vs).post(x))(
            outer, layers, vars, y).jaxpr)
        m = self.module(whole(outer), layers, vars) if gathers else self.module(outer, layers, vars)
        with use_layout(nothing_split if gathers else layout):
            outputs = whole(m.post(whole(y) if gathers else y))
        m = self.module(whole(outer), layers, self.spec.vars_of(m))
        with use_layout(nothing_split):
            loss, metrics = check_loss(m.loss(outputs, whole(mb)), f"{type(m).__name__}.loss")
        return loss.astype(jnp.float32), {k: jnp.asarray(v, jnp.float32) for k, v in dict(metrics).items()}, \
            self.spec.vars_of(m)


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
