"""From an abstract model to shardings: the bridge between logical names and real arrays.

    spec = model_spec(cfg)                       # shapes + logical axes, no memory allocated
    shardings = param_shardings(spec, layout)    # pure dict of NamedSharding, divisibility checked

Parameters are handled as a *pure dict* of arrays (what optax and Orbax want); `ModelSpec.merge`
turns one back into the NNX module inside a jitted function.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from meshpar.errors import ShardingError
from meshpar.rules import Layout


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


@dataclass
class ModelSpec:
    graphdef: Any
    treedef: Any           # tree structure of the NNX state (Variables)
    shapes: dict           # pure dict path -> jax.ShapeDtypeStruct
    logical: dict          # pure dict path -> tuple of logical names
    cfg: Any               # the model's own config (e.g. DecoderConfig)

    def merge(self, params: dict) -> nnx.Module:
        """Pure param dict -> NNX module (inside jit: no copies)."""
        state = jax.tree.unflatten(self.treedef, jax.tree.leaves(params))
        return nnx.merge(self.graphdef, state)

    @property
    def num_params(self) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(self.shapes))


def model_spec(cfg, build=None) -> ModelSpec:
    """Trace the model's constructor abstractly (`nnx.eval_shape`): shapes and logical axes only."""
    from meshpar import models
    build = build or models.build
    abstract = nnx.eval_shape(lambda: build(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shapes = nnx.to_pure_dict(state)
    leaves = jax.tree.leaves(state, is_leaf=_is_var)
    missing = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_leaves_with_path(state, is_leaf=_is_var)
               if "logical_axes" not in v.get_metadata()]
    if missing:
        raise ShardingError(f"model parameter {missing[0]} has no logical_axes metadata; create it with "
                            "meshpar.layers.param(..., logical=(...))")
    logical = jax.tree.unflatten(jax.tree.structure(shapes), [tuple(v.get_metadata()["logical_axes"]) for v in leaves])
    return ModelSpec(graphdef, jax.tree.structure(state), shapes, logical, getattr(abstract, "cfg", None))


def path_name(path) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def _tree_shardings(shapes, logical, layout: Layout, kind: str, what: str):
    def one(path, shape, names):
        return layout.sharding(names, shape.shape, f"{what} '{path_name(path)}'", kind)
    return jax.tree_util.tree_map_with_path(one, shapes, logical, is_leaf=lambda x: isinstance(x, tuple))


def param_shardings(spec: ModelSpec, layout: Layout) -> dict:
    """At-rest layout of parameters (also of gradients unless the strategy is ZeRO-2)."""
    return _tree_shardings(spec.shapes, spec.logical, layout, "params", "parameter")


def state_shardings(spec: ModelSpec, layout: Layout) -> dict:
    """Layout of per-parameter optimizer state (ZeRO-1/2 shard it even when params are replicated)."""
    return _tree_shardings(spec.shapes, spec.logical, layout, "opt_state", "optimizer state of")


def opt_state_shardings(tx, spec: ModelSpec, layout: Layout):
    """Shardings for `tx.init(params)`: parameter-shaped leaves follow `state_shardings`, scalars replicate."""
    import optax
    from jax.sharding import NamedSharding, PartitionSpec
    abstract = jax.eval_shape(tx.init, spec.shapes)
    per_param = state_shardings(spec, layout)
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    return optax.tree_map_params(tx, lambda _, s: s, abstract, per_param,
                                 transform_non_params=lambda _: replicated,
                                 is_leaf=lambda x: isinstance(x, NamedSharding))


def split_microbatches(tokens, m: int, layout: Layout):
    """tokens [B, T+1] -> [M, B/M, T+1]. Row i*M + k goes to microbatch k, so every device keeps its
    own rows (no data movement); each microbatch keeps the batch layout."""
    b, t = tokens.shape
    mbs = tokens.reshape(b // m, m, t).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(mbs, layout.sharding((None, "batch", None), mbs.shape, "microbatches"))


def bytes_per_device(shape, dtype, sharding) -> int:
    shard = sharding.shard_shape(tuple(shape))
    return int(math.prod(shard) * np.dtype(dtype).itemsize)


def spec_str(spec) -> str:
    """P(None, ('data', 'fsdp'), 'tensor') -> '-, data+fsdp, tensor' ('replicated' if empty)."""
    parts = ["-" if p is None else p if isinstance(p, str) else "+".join(p) for p in spec]
    return ", ".join(parts) if any(p != "-" for p in parts) else "replicated"


def sharding_table(spec: ModelSpec, layout: Layout) -> list[dict]:
    """One row per parameter: name, shape, logical axes, PartitionSpec, bytes per device."""
    shards = param_shardings(spec, layout)
    rows = []
    for (path, shape), names, sh in zip(jax.tree_util.tree_leaves_with_path(spec.shapes),
                                        jax.tree.leaves(spec.logical, is_leaf=lambda x: isinstance(x, tuple)),
                                        jax.tree.leaves(shards)):
        rows.append({"name": path_name(path), "shape": list(shape.shape), "logical": list(names),
                     "spec": spec_str(sh.spec), "bytes_per_device": bytes_per_device(shape.shape, shape.dtype, sh),
                     "bytes": int(math.prod(shape.shape) * np.dtype(shape.dtype).itemsize)})
    return rows
