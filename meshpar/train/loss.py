"""Losses a step can take: `lm_loss`, next-token cross-entropy (the default), and the contract every
loss keeps: `(model, batch) -> (scalar loss, metrics dict)`, checked by `meshpar.nn.stages.check_loss`."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from meshpar.core import precision as precision_lib
from meshpar.core.errors import ConfigError
from meshpar.core.layout import at_use
from meshpar.core.objective import weighted
from meshpar.core.sharding import logical_axes
from meshpar.nn.layers import settled_cotangent
from meshpar.nn.stages import check_loss, lm_rows, lm_weight  # noqa: F401  (check_loss: the contract, which stage_loss keeps too)
from meshpar.parallel import context


@weighted(lm_weight)
def lm_loss(model, batch, chunks: int = 1) -> tuple[jax.Array, dict]:
    """Next-token cross-entropy of token rows [B, T+1] (the default loss), or of packed documents
    {"tokens", "segment_ids", "positions"} each [B, T+1]: the model gets `positions=` and
    `segment_ids=` of the inputs, and a target counts only inside its input's document. It is the
    mean over the targets it counts, and declares them its weight (`meshpar.core.objective`), so a
    step that cuts the batch into microbatches, replicas or pipeline microbatches still takes one
    mean over the whole batch's targets.

    What it calls on a model: `model(inputs [B, T])`, with `positions=` and `segment_ids=` [B, T]
    added for packed documents or sequences split over `context` (a model that cannot take them is
    refused in one line), or with `train.loss_chunks` > 1 `model.features` and `model.head` (below).

    The model maps tokens [B, T] to logits [B, T, V], or to (logits, aux) where aux values under the
    key `loss` (already weighted, e.g. MoE load balancing) are added to the loss and the rest are
    reported as metrics. With sequences split over `context`, rows are stored in the balanced order
    (`meshpar.parallel.context`) and the model must take `positions=`.

    `chunks` > 1 (`train.loss_chunks`): the logits are computed and dropped in that many strided
    token slices (`meshpar.core.precision.chunked_cross_entropy`); the model then splits its call
    into `features(tokens, ...) -> (x [B, T, E], aux)` and `head(x, dtype) -> logits`, as
    meshpar.models' decoders do."""
    rows = context.balance_rows(lm_rows(batch))
    cp = context.context_size()
    inputs, targets, weights = rows["inputs"], rows["targets"], rows.get("weights")
    positions, seg = rows.get("positions"), rows.get("segment_ids")
    kwargs = {k: v for k, v in (("positions", positions), ("segment_ids", seg)) if v is not None}
    if chunks > 1:
        _check_splits(model)
    _check_accepts(model, kwargs, cp, "features" if chunks > 1 else "__call__")
    out_dtype = precision_lib.active_policy().output_dtype
    if chunks > 1:
        dtype = precision_lib.compute_dtype()
        with context.balanced(cp > 1):
            out = model.features(inputs, dtype, **kwargs)
        x, aux = out if isinstance(out, tuple) else (out, {})
        ce = precision_lib.chunked_cross_entropy(_pinned_head(model, dtype, out_dtype), x, targets, weights, chunks)
    else:
        with context.balanced(cp > 1):
            out = model(inputs, **kwargs)
        logits, aux = out if isinstance(out, tuple) else (out, {})
        ce = precision_lib.cross_entropy(settled_cotangent(logits).astype(out_dtype), targets, weights)
    aux = dict(aux)
    extra = jnp.sum(aux.pop("loss")) if "loss" in aux else 0.0
    return ce + extra, {"ce": ce, **aux}


def _pinned_head(model, dtype, out_dtype):
    """`model.head` for one token slice, its parameters read through `meshpar.core.layout.at_use`: a scan
    accumulates the gradient of a weight it closes over in its carry, and left unpinned XLA held that
    sum whole on every device (Llama 3's [E, V] head, 1 GiB, all-reduced per slice); pinned, each slice's
    gradient is reduce-scattered into a sum split as the weight is."""
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731

    def pin(v):
        names = logical_axes(v)
        return v.replace(at_use(v[...], names, "parameter") if names else v[...])

    def head(z):
        pinned = nnx.merge(graphdef, jax.tree.map(pin, params, is_leaf=is_var), rest)
        return pinned.head(z, dtype).astype(out_dtype)

    return head


def _check_splits(model) -> None:
    """One line when a model cannot run its head chunk by chunk (`train.loss_chunks` > 1)."""
    missing = [m for m in ("features", "head") if not callable(getattr(model, m, None))]
    if missing:
        raise ConfigError(
            f"train.loss_chunks > 1 runs the LM head chunk by chunk, and model {type(model).__name__} "
            f"has no {' or '.join('.' + m for m in missing)}; give it features(tokens, dtype, **kw) -> "
            "(x [B, T, E], aux) and head(x, dtype) -> logits (see meshpar.models.decoder), "
            "or set train.loss_chunks=1"
        )


def _check_accepts(model, kwargs: dict, cp: int, method: str = "__call__") -> None:
    """One line when the model's `method` cannot take the keywords packed documents or context parallelism need."""
    try:
        params = inspect.signature(getattr(model, method)).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    missing = [k for k in kwargs if k not in params]
    if missing:
        why = (
            "mesh.context > 1 stores each row in the balanced order"
            if cp > 1 and "positions" in missing
            else "the data are packed documents"
        )
        raise ConfigError(
            f"model {type(model).__name__} takes no {', '.join(m + '=' for m in missing)} argument, and "
            f"{why}; add `{'=None, '.join(missing)}=None` to its {method} (see meshpar.models.decoder), "
            "or set data.documents=false"
        )
