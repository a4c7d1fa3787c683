"""A model in its serving layout: the mesh, the layout, the KV cache's shape and shardings, and the
weights, loaded once into that layout and the compute dtype (what `Engine` decodes with).

Layout (`serve.strategy`, default `serve_tp` in `meshpar.core.rules.SERVING`): weights are placed once,
at load, in the serving layout: Megatron TP over `tensor`, nothing over data/fsdp, so a decoded
token moves activations only (an FSDP layout would all-gather every weight per token; the engine
warns). The KV cache [L, B, K, S, D] is an array with logical axes (`cache_batch`, `cache_length`,
`kv_heads`), placed by the same rule tables: K over `tensor`, slots B over data. When K is not a
multiple of the tensor size the cache's heads cannot be split: K is replicated (cache and QKV
weights) and the slots are split over data x tensor instead (Pope et al. 2022 make the same
trade for multi-query attention), or replicated over `tensor` if the slots do not divide.

Per decode step every weight byte and every cache byte is read once, so decode is bound by memory
bandwidth: bytes/s per device = (weight bytes + cache bytes per device) / step time.

Cache length S (`serve.cache_length`, else `cache_length`): the positions the model was made for
(`model.max_positions`, or `max_position_embeddings` of `model.init_from`'s config.json; 4096 for a
model that states none), capped so that the slots' caches and the prefix cache's entries
(`meshpar.serve.prefix`; an entry is one row, whole on every data shard) take at most half of what
a device has beside the weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar.core import precision as precision_lib
from meshpar.core.batch import is_leaf
from meshpar.core.errors import ConfigError
from meshpar.core.layout import Layout, for_rows
from meshpar.core.rules import BATCH_AXES, get_strategy, parse_user_rules, spec_axes, table
from meshpar.core.sharding import building, bytes_per_device, param_shardings, path_name, var_shardings
from meshpar.parallel import pipeline_decode
from meshpar.runtime.placed import PlacedModel
from meshpar.serve.sampling import ROW_KEYS


def buckets(cache_length: int, min_bucket: int) -> list[int]:
    """Prompt lengths compiled for: powers of two from min_bucket, capped at (and ending with) S."""
    out, p = [], 1 << max(0, math.ceil(math.log2(max(1, min_bucket))))
    while p < cache_length:
        out.append(p)
        p *= 2
    return out + [cache_length]


DEFAULT_POSITIONS = 4096  # a model that states no maximum (RoPE runs on; the cache is the limit)


def model_positions(init_from: str | None, abstract=None) -> int:
    """The most positions the model was made for: `abstract.max_positions` where the model states it,
    else model.init_from's config.json `max_position_embeddings`, else DEFAULT_POSITIONS."""
    n = getattr(abstract, "max_positions", None)
    if n is None and init_from:
        from meshpar.io.hf import read_config  # local: safetensors loads only for a run that reads or writes one

        n = read_config(init_from).get("max_position_embeddings")
    return int(n) if isinstance(n, int) and n > 0 else DEFAULT_POSITIONS


def device_bytes() -> int:
    """Memory of one local device: its allocator's limit, or on a host (CPU) platform the host's
    memory shared by its devices."""
    import os

    dev = jax.local_devices()[0]
    limit = (getattr(dev, "memory_stats", lambda: None)() or {}).get("bytes_limit")
    if limit:
        return int(limit)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, jax.local_device_count()))


def cache_length(
    serve, init_from: str | None, abstract=None, position_bytes: int = 0, free_bytes: int | None = None
) -> int:
    """`serve.cache_length`, else the model's positions capped by memory: `position_bytes` per device
    for one position of every cached sequence, half of `free_bytes` for the caches."""
    if serve.cache_length:
        return serve.cache_length
    n = model_positions(init_from, abstract)
    if position_bytes and free_bytes is not None:
        n = min(n, max(serve.min_bucket, free_bytes // 2 // position_bytes))
    return n


def serving_layout(mesh, strategy: str, user_rules, cache_spec, slots: int) -> tuple[Layout, list[str]]:
    """The layout a model is served in, and notes (one line each) on what it had to give up."""
    layout = Layout(mesh, get_strategy(strategy), parse_user_rules(user_rules))
    shape, notes = layout.shape, []
    t = shape.get("tensor", 1)
    kv = {
        leaf.shape[leaf.axes.index("kv_heads")]
        for leaf in jax.tree.leaves(cache_spec, is_leaf=is_leaf)
        if "kv_heads" in leaf.axes
    }
    if t > 1 and any(k % t for k in kv):
        k = min(kv)
        data = math.prod(shape.get(a, 1) for a in BATCH_AXES)
        over = (*BATCH_AXES, "tensor") if slots % (data * t) == 0 else BATCH_AXES
        layout = _before(layout, table(kv_heads=None, cache_batch=[over]))
        where = "slots over data x tensor" if "tensor" in over else "replicated over tensor (serve.slots not divisible)"
        notes.append(f"note: kv_heads={k} cannot split over tensor={t}: K/V heads replicated, KV cache {where}")
    cp = shape.get("context", 1)
    if cp > 1:  # decoding feeds one token per step: `context` holds requests (KV-cache slots) instead
        data = math.prod(shape.get(a, 1) for a in BATCH_AXES)
        over = (*BATCH_AXES, "context") if slots % (data * cp) == 0 else BATCH_AXES
        layout = _before(layout, table(length=None, seq=None, batch=[over], cache_batch=[over]))
        notes.append(
            f"note: serving splits requests, not sequences, over context={cp}"
            + ("" if "context" in over else " (serve.slots not divisible: replicated over context)")
        )
    return layout, notes


def _before(layout: Layout, rules) -> Layout:
    """`layout` with `rules` tried before its strategy's parameter rules."""
    return dataclasses.replace(
        layout, strategy=dataclasses.replace(layout.strategy, params=rules + layout.strategy.params)
    )


def _gather_warning(strategy: str, param_shardings) -> list[str]:
    """One line when the serving layout splits weights over the batch axes (gathered per token)."""
    split = {a for s in jax.tree.leaves(param_shardings) for a in spec_axes(s.spec)} & set(BATCH_AXES)
    if not split:
        return []
    return [
        f"warning: serve.strategy={strategy} splits weights over {', '.join(sorted(split))}: "
        "every decoded token all-gathers them; serve.strategy=serve_tp keeps them in place"
    ]


def zeros(spec):
    """A tree of `Leaf` -> zero arrays of those shapes and dtypes (an empty cache)."""
    return jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), spec, is_leaf=is_leaf)


ABSTRACT = "abstract"  # Placement(weights=ABSTRACT): shapes and shardings, no arrays


class Placement:
    """Mesh, serving layout, KV-cache spec and the weights in place (see the module docstring).

    `model`: factory rngs -> nnx.Module implementing the serving protocol (default: `cfg.model.name`).
    `weights`: {"params", "vars"} pure dicts to serve (default: `cfg.checkpoint.dir`'s newest
    checkpoint (a folder that is missing or empty is an error), else `model.init_from`, else a fresh
    init from train.seed); `ABSTRACT`: `ShapeDtypeStruct`s in their shardings, nothing allocated (to
    compile for a deviceless target, `meshpar inspect --serve --target`). `device_memory`: bytes per
    device the KV cache is sized against (default: the local device's)."""

    def __init__(
        self,
        cfg,
        *,
        model: Callable | None = None,
        devices=None,
        weights=None,
        info: Callable[[str], None] = print,
        device_memory: int | None = None,
    ):
        self.cfg, self.info, self.device_memory = cfg, info, device_memory
        self.placed = placed = PlacedModel.from_config(cfg, model, devices, strict=False)
        self.mesh, self.policy, self.factory, self.spec = placed.mesh, placed.policy, placed.factory, placed.spec
        self.stages = dict(zip(self.mesh.axis_names, self.mesh.devices.shape)).get("pipeline", 1)
        self.dtype = self.policy.compute_dtype
        self.abstract = abstract = placed.abstract
        name = type(abstract).__name__
        if not (callable(getattr(abstract, "decode", None)) and callable(getattr(abstract, "cache_spec", None))):
            raise ConfigError(
                f"model {name} cannot be served: it needs decode(tokens, positions, cache) and "
                "cache_spec(batch, length) (see meshpar.serve.engine)"
            )
        self.slots = cfg.serve.slots
        with precision_lib.use_policy(self.policy):
            one = abstract.cache_spec(self.slots, 1)
        for path, leaf in jax.tree_util.tree_leaves_with_path(one, is_leaf=is_leaf):
            if not is_leaf(leaf) or "cache_batch" not in leaf.axes or "cache_length" not in leaf.axes:
                raise ConfigError(
                    f"{name}.cache_spec: leaf {path_name(path) or 'cache'} must be a meshpar.Leaf "
                    "with a 'cache_batch' and a 'cache_length' axis"
                )
        if self.stages > 1:  # decode steps cut into microbatches that follow each other through the stages
            pipeline_decode.check(abstract, self.spec.var_shapes, one, self.slots, self.stages)
        self.vocab = _logits_vocab(self, abstract)
        self.layout, self.notes = serving_layout(self.mesh, cfg.serve.strategy, cfg.rules, one, self.slots)
        rep = NamedSharding(self.mesh, P())
        params = jax.tree.map(lambda s: s.update(dtype=self.serve_dtype(s.dtype)), self.spec.shapes)
        self.weight_shardings = {
            "params": param_shardings(self.spec, self.layout),
            "vars": var_shardings(self.spec, self.layout),
        }
        self.length = _sized_cache_length(self, cfg.serve, cfg.model.init_from, one, params)
        self.buckets = buckets(self.length, cfg.serve.min_bucket)
        with precision_lib.use_policy(self.policy):
            self.cache_spec = abstract.cache_spec(self.slots, self.length)
        self.notes += _gather_warning(cfg.serve.strategy, self.weight_shardings["params"])
        self.weight_shapes = {"params": params, "vars": self.spec.var_shapes}
        cache_sh = jax.tree.map(
            lambda leaf: self.layout.sharding(leaf.axes, leaf.shape, "KV cache"), self.cache_spec, is_leaf=is_leaf
        )
        self.state_shardings = {"cache": cache_sh, **{k: rep for k in ("pos", "token", *ROW_KEYS, "counts")}}
        self.weights, self.source = _load(self, weights, cfg.checkpoint.dir, cfg.model.init_from, cfg.train.seed)

    # -- set-up ----------------------------------------------------------------------------------

    def serve_dtype(self, dtype):
        """Floating weights are served in the compute dtype (bf16 halves the bytes every step reads)."""
        return self.dtype if jnp.issubdtype(dtype, jnp.floating) else dtype

    def cast(self, weights):
        """Weights as served: floating ones in the compute dtype."""
        return jax.tree.map(lambda x: x.astype(self.serve_dtype(x.dtype)), weights)

    def model(self, weights):
        """The nnx.Module of served `weights` ({"params", "vars"}), in eval mode."""
        model = self.placed.module(weights["params"], weights["vars"])
        if hasattr(model, "eval"):
            model.eval()  # dropout off, running statistics used
        return model

    def bucket(self, n: int) -> int:
        """The prompt length compiled for n tokens: the first bucket >= n."""
        return next(p for p in self.buckets if p >= n)

    def can_extend(self, n: int, start: int) -> bool:
        """Whether a prompt of n tokens can be prefilled from position `start` (its tail's bucket is
        shorter than the cache: a bucket as long as the cache is a prefill from position 0)."""
        return 0 < start < n and self.bucket(n - start) < self.length

    def check_extend(self, n: int, start: int) -> None:
        if not self.can_extend(n, start):
            raise ConfigError(f"cannot extend a prompt of {n} tokens from position {start}")

    def bytes_per_device(self) -> dict:
        """Weight and KV-cache bytes one device holds (what a decode step reads)."""

        w = sum(bytes_per_device(a.shape, a.dtype, a.sharding) for a in jax.tree.leaves(self.weights))
        c = sum(
            bytes_per_device(leaf.shape, leaf.dtype, sh)
            for leaf, sh in zip(
                jax.tree.leaves(self.cache_spec, is_leaf=is_leaf), jax.tree.leaves(self.state_shardings["cache"])
            )
        )
        return {"weights": int(w), "cache": int(c)}


def _logits_vocab(placement, abstract) -> int:
    """The logits' last dimension, from an abstract decode of one token (no memory, no compile)."""
    from flax import nnx

    def one(t):
        with building(placement.policy):
            m = placement.factory(nnx.Rngs(0))
        with precision_lib.use_policy(placement.policy):
            return m.decode(t, t, zeros(m.cache_spec(1, 1)))[0]

    return int(jax.eval_shape(one, jax.ShapeDtypeStruct((1, 1), jnp.int32)).shape[-1])


def _sized_cache_length(placement, serve, init_from: str | None, one, params) -> int:
    """S (see the module docstring): one position of every slot and prefix entry, per device."""

    if serve.cache_length:
        return serve.cache_length

    def position_bytes(spec, layout) -> float:
        return sum(
            bytes_per_device(leaf.shape, leaf.dtype, layout.sharding(leaf.axes, leaf.shape, "KV cache"))
            for leaf in jax.tree.leaves(spec, is_leaf=is_leaf)
        )

    with precision_lib.use_policy(placement.policy):
        entry = placement.abstract.cache_spec(1, 1)  # a prefix entry: one row, whole on every data shard
    position = (
        int(
            position_bytes(one, placement.layout)
            + serve.prefix_cache * position_bytes(entry, for_rows(placement.layout, 1))
        )
        + 1
    )
    weights = sum(
        bytes_per_device(s.shape, s.dtype, sh)
        for s, sh in zip(jax.tree.leaves(params), jax.tree.leaves(placement.weight_shardings["params"]))
    )
    n = cache_length(
        serve, init_from, placement.abstract, position, max(0, (placement.device_memory or device_bytes()) - weights)
    )
    if jax.process_count() > 1:  # every process of a server must agree (hosts may differ in memory)
        from jax.experimental import multihost_utils

        n = int(multihost_utils.broadcast_one_to_all(np.int32(n)))
    return n


def _load(placement: Placement, weights, checkpoint_dir: str | None, init_from: str | None, seed: int):
    """A placement's weights in the serving layout and dtype, and where they came from: `weights`
    given, else the newest checkpoint in `checkpoint_dir`, else `init_from`, else a fresh init from
    `seed` (see `Placement`)."""
    target = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        {"params": placement.spec.shapes, "vars": placement.spec.var_shapes},
        placement.weight_shardings,
    )
    if isinstance(weights, str) and weights == ABSTRACT:  # as served: floating weights in the compute dtype
        served = jax.tree.map(lambda s: s.update(dtype=placement.serve_dtype(s.dtype)), target)
        return served, "abstract: shapes and shardings only, nothing allocated"
    source, shardings, cast = "given", placement.weight_shardings, placement.cast
    if weights is None and checkpoint_dir:
        from meshpar.io.checkpoint import restore_weights  # local: Orbax loads only for a run with checkpoint.dir

        found = restore_weights(checkpoint_dir, target, placement.info)
        if found is not None:
            tree, step, _ = found
            weights, source = {"params": tree["params"], "vars": tree.get("vars", {})}, f"checkpoint step {step}"
        elif not init_from:
            raise ConfigError(
                f"checkpoint.dir '{checkpoint_dir}' holds no checkpoint to serve; train into it first, "
                "or leave checkpoint.dir unset to serve a fresh random init"
            )
    if weights is None and init_from:  # a Hugging Face model, read into the serving layout
        params = placement.placed.pretrained(shardings["params"], placement.weight_shapes["params"])
        vars = jax.jit(lambda key: placement.placed.init(key)["vars"], out_shardings=shardings["vars"])(
            jax.random.key(seed)
        )
        return {"params": params, "vars": vars}, init_from
    if weights is None:  # born in place, in the serving dtype: one compiled call
        init = jax.jit(lambda key: cast(placement.placed.init(key)), out_shardings=shardings)
        return init(jax.random.key(seed)), f"fresh init (train.seed={seed})"
    if all(jnp.dtype(x.dtype) == jnp.dtype(placement.serve_dtype(x.dtype)) for x in jax.tree.leaves(weights)):
        return jax.device_put(weights, shardings), source
    return jax.jit(cast, out_shardings=shardings)(weights), source
