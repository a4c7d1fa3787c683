"""The stage protocol: a model cut into the parts a pipeline runs on different devices.

A model you want to pipeline names three parts and a loss, each taking one microbatch of a batch
pytree (leaves [b, ...]):

    model.pre(batch) -> x                          # first stage: inputs -> activations x [b, ...]
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
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from meshpar.core.errors import ConfigError
from meshpar.nn.layers import scan_layers

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
    x, extra, aux = apply_layers(model, model.pre(batch))
    loss, metrics = model.loss(model.post(x), batch)
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


def manual_axes() -> tuple[str, ...]:
    """The mesh axes the enclosing shard_map is manual over (`pipeline`, maybe `data`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual)


def vary(x):
    """Mark a value as varying over the manual axes (`pipeline`, and `data` when the pipeline is
    manual over it): loop carries and branch outputs must agree."""
    missing = tuple(a for a in manual_axes() if a not in jax.typeof(x).mat.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


@dataclass(frozen=True)
class StageModel:
    """A model as the pipeline executors call it: parameters as pure dicts {outer..., "layers": this
    stage's layers}, non-Param state `vars` as a pure dict, one microbatch `mb` (a batch pytree)."""
    spec: object
    policy: object
    lm: bool                        # the reference LM's cut (embed/head + cross-entropy) or the protocol's
    embed_specs: object = None      # outer parameters' layouts with the batch axes dropped

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
        """First stage: mb -> (x [b, ...] in the compute dtype, vars after `pre`)."""
        m = self.module(outer, layers, vars)
        x = m.embed(mb["inputs"], self.policy.compute_dtype) if self.lm else m.pre(mb)
        return x, self.spec.vars_of(m)

    def stage(self, outer, layers, x, mb):
        """This stage's layers [Lc, ...], x, the microbatch (the LM reads its rows' positions and
        segment ids) -> (y, aux loss scalar, metrics {k: [Lc]})."""
        m = self.module(outer, layers)
        pos, seg = (mb["positions"], mb.get("segment_ids")) if self.lm else (None, None)
        y, loss, aux = apply_layers(m, vary(x), pos, seg)     # vary: the scan's carry
        return y, vary(loss), aux                             # varies over stages

    def post_loss(self, outer, layers, vars, y, mb):
        """Last stage: y -> (the microbatch's loss (fp32 scalar), its metrics, vars after `post`)."""
        from meshpar.core.precision import cross_entropy
        m = self.module(outer, layers, vars)
        if self.lm:   # a sequence split over a manual `context`: sums over its shards
            over = tuple(a for a in manual_axes() if a in SEQUENCE_AXES)
            loss = cross_entropy(m.head(y, self.policy.compute_dtype), mb["targets"], mb.get("weights"), over)
            metrics = {}
        else:
            loss, metrics = m.loss(m.post(y), mb)
        if jnp.shape(loss) != ():
            raise ConfigError(f"{type(m).__name__}.loss returned a loss of shape {tuple(jnp.shape(loss))}; it must be "
                              "a scalar (reduce it, e.g. with .mean())")
        return loss.astype(jnp.float32), {k: jnp.asarray(v, jnp.float32) for k, v in dict(metrics).items()}, \
            self.spec.vars_of(m)


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
