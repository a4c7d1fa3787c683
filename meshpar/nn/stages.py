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
`meshpar.parallel.stage_model.StageModel` is what the pipeline executors call: one part at a time,
on pure dicts of parameters and state, returning the state a part changed.
x keeps its structure, shapes and dtypes through the layers; each leaf travels between stages.
`check_loss`, `check_activation` and `meshpar.nn.layers` put a part that breaks the protocol in one line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshpar.core.errors import ConfigError
from meshpar.core.objective import Weight, weight_of
from meshpar.nn.layers import scan_layers

PROTOCOL = ("pre", "post", "loss")
SEQUENCE_AXES = ("context",)  # mesh axes a pipeline splits the LM's rows [b, T] over (manually)


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
        rows.update(
            positions=batch["positions"][:, :-1],
            segment_ids=seg[:, :-1],
            weights=(seg[:, 1:] == seg[:, :-1]).astype(jnp.float32),
        )
    return rows


def lm_rows_weight(rows: dict) -> jax.Array:
    """The LM loss's weight over its rows (`lm_rows`): the targets it counts, sum(weights) for packed
    documents, else every target of [B, T] (`meshpar.core.objective`)."""
    if "weights" in rows:
        return jnp.sum(rows["weights"]).astype(jnp.float32)
    return jnp.asarray(rows["targets"].size, jnp.float32)


def lm_weight(batch) -> jax.Array:
    """The LM loss's weight over a batch of token rows [B, T+1] or packed documents."""
    return lm_rows_weight(lm_rows(batch))


def check_activation(x, what: str):
    """`pre`'s output: any pytree of arrays (one line naming the leaf otherwise) -> x."""
    leaves = jax.tree_util.tree_leaves_with_path(x)
    bad = [(k, a) for k, a in leaves if not isinstance(a, (jax.Array, np.ndarray))]
    if not leaves or bad:
        where = (
            f" at {jax.tree_util.keystr(bad[0][0]) or 'the top'}: {type(bad[0][1]).__name__}" if bad else ": no array"
        )
        raise ConfigError(
            f"{what} returned a non-array{where}; it must return the activation the stacked layers "
            "take, an array or any pytree (dict, tuple, list) of arrays, constrained with their "
            "logical axes"
        )
    return x


def stage_loss(model, batch):
    """`train.loss=stages`: model.loss(model.post(layers(model.pre(batch))), batch), plus the layers'
    aux loss. The loss a pipeline computes stage by stage, computed in one piece. Its weight is the
    one `model.loss` declares (`meshpar.weighted`; `protocol_weight`), else the batch's rows."""
    x, extra, aux = apply_layers(model, check_activation(model.pre(batch), f"{type(model).__name__}.pre"))
    loss, metrics = check_loss(model.loss(model.post(x), batch), f"{type(model).__name__}.loss")
    return loss + extra, {**dict(metrics), **aux}


def protocol_weight(module) -> Weight:
    """The weight of a protocol model's objective over a batch: what its `loss` method declares
    (`meshpar.core.objective.weighted`), else the batch's rows."""
    return weight_of(getattr(module, "loss", None))


def check_protocol(module, lm: bool) -> None:
    """One line naming what a model lacks to be pipelined with its loss."""
    name = type(module).__name__
    need = ("embed", "head") if lm else PROTOCOL
    missing = [m for m in need if not callable(getattr(module, m, None))]
    if missing or not hasattr(module, "layers"):
        what = (
            "the built-in LM loss needs .embed(tokens, dtype), .layers (meshpar.stacked) and .head(x, dtype)"
            if lm
            else "train.loss=stages needs .pre(batch), .layers (meshpar.stacked), .post(x) and "
            ".loss(outputs, batch) (meshpar.nn.stages)"
        )
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
        paths = [
            ".".join(str(getattr(p, "key", p)) for p in path)
            for path, _ in jax.tree_util.tree_leaves_with_path(spec.var_shapes["layers"])
        ]
        raise ConfigError(
            f"pipelining: the stacked layers hold non-Param state (layers.{paths[0]}, ...: a dropout RNG "
            "stream or statistics would have to travel between stages); build the stack with "
            "meshpar.stacked (its dropout holds no state), keep other state in pre/post "
            "(meshpar.nn.stages), or set mesh.pipeline=1"
        )


def check_loss(out, name: str):
    """A loss's output -> (loss, metrics): one line unless it is (a scalar, a dict of metrics)."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        got = (
            f"a bare array of shape {tuple(jnp.shape(out))}"
            if hasattr(out, "shape")
            else f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, tuple) else "")
        )
        raise ConfigError(
            f"loss function {name} must return (loss, metrics_dict), got {got}; return (loss, {{}}) "
            "for a loss without metrics"
        )
    loss, metrics = out
    if jnp.shape(loss) != ():
        raise ConfigError(
            f"loss function {name} returned a loss of shape {tuple(jnp.shape(loss))}; it must be a "
            "scalar (reduce it, e.g. with .mean())"
        )
    return loss, metrics
