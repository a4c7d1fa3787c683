"""From an abstract model to shardings: the bridge between logical names and real arrays.

    spec = model_spec(factory)                   # shapes + logical axes, no memory allocated
    shardings = param_shardings(spec, layout)    # pure dict of NamedSharding, divisibility checked

Any `nnx.Module` works. A variable's logical axes come from meshpar's `logical_axes` metadata
(`meshpar.nn.layers.param`) or from Flax's own (`nnx.with_partitioning(init, names)`,
`nnx.Param(v, sharding_names=names)`, `kernel_metadata=` on `nnx.Linear` / `nnx.Embed` /
`nnx.LayerNorm`; Flax keeps them as `out_sharding`). A variable without names is replicated and
marked so in the sharding table (an error with `require_annotations`).

The model's state is split in two pure dicts (what optax and Orbax want): `params` (`nnx.Param`,
optimized) and `vars` (everything else: RNG streams, dropout counters, batch statistics), carried
in the train state, sharded by their own names and checkpointed. `ModelSpec.merge` turns them back
into the module inside a jitted function, `ModelSpec.vars_of` reads the vars back out after a call.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from flax import nnx

from meshpar.core.batch import is_leaf
from meshpar.core.errors import ConfigError, ShardingError
from meshpar.core.layout import Layout
from meshpar.core.precision import POLICIES, use_policy
from meshpar.core.rules import LOGICAL_AXES, spec_axes, uncovered


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _is_names(x) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def logical_axes(var: nnx.Variable) -> tuple | None:
    """A variable's logical axis names: meshpar's `logical_axes`, else Flax's `out_sharding` /
    `sharding_names`; None when it has none."""
    meta = var.get_metadata()
    for key in ("logical_axes", "out_sharding", "sharding_names"):
        names = meta.get(key)
        if names is not None:
            return tuple(
                n if n is None or isinstance(n, str) else tuple(n)[0] if len(tuple(n)) == 1 else None for n in names
            )
    return None


@contextlib.contextmanager
def building(policy=None):
    """The context meshpar builds models in: Flax's eager sharding off (meshpar places arrays
    itself, by its rules) and the precision policy active (`meshpar.core.precision.param_dtype`)."""

    with nnx.use_eager_sharding(False), use_policy(policy or POLICIES["fp32"]):
        yield


@dataclass
class ModelSpec:
    graphdef: Any
    treedef: Any  # tree structure of the NNX Param state
    shapes: dict  # params: pure dict path -> jax.ShapeDtypeStruct
    logical: dict  # params: pure dict path -> tuple of logical names (None: replicated)
    model_config: Any  # the model's own config, if it keeps one as `.cfg` (e.g. DecoderConfig); not the run config
    var_treedef: Any = None
    var_shapes: dict = field(default_factory=dict)  # non-Param variables, same layout as above
    var_logical: dict = field(default_factory=dict)
    unannotated: list = field(default_factory=list)  # paths of variables with no logical names

    var_key_impls: list = field(default_factory=list)  # per var leaf: the PRNG impl of a key, else None
    abstract: Any = None  # the model as traced (`nnx.eval_shape`): its methods and config, no arrays

    def merge(self, params: dict, vars: dict | None = None) -> nnx.Module:
        """Pure dicts -> NNX module (inside jit: no copies). `vars` defaults to none (a model without
        non-Param state); its PRNG keys travel as raw key data and are wrapped back here."""
        state = jax.tree.unflatten(self.treedef, jax.tree.leaves(params))
        if self.var_treedef is None:
            return nnx.merge(self.graphdef, state)
        leaves = [
            x if impl is None else jax.random.wrap_key_data(x, impl=impl)
            for x, impl in zip(jax.tree.leaves(vars), self.var_key_impls)
        ]
        return nnx.merge(self.graphdef, state, jax.tree.unflatten(self.var_treedef, leaves))

    def vars_of(self, module: nnx.Module) -> dict:
        """The non-Param state of `module` (after a call advanced an RNG counter, say) as a pure dict
        of plain arrays (keys as `jax.random.key_data`: checkpointable, selectable with `jnp.where`)."""
        if self.var_treedef is None:
            return {}
        return _keys_to_data(nnx.to_pure_dict(nnx.state(module, nnx.Not(nnx.Param))))

    @property
    def num_params(self) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(self.shapes))


def model_spec(factory: Callable[[nnx.Rngs], nnx.Module], policy=None, require_annotations: bool = False) -> ModelSpec:
    """Trace `factory(rngs)` abstractly (`nnx.eval_shape`): shapes and logical axes, no memory."""
    with building(policy):
        abstract = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
    if not isinstance(abstract, nnx.Module):
        raise ConfigError(
            f"the model factory returned {type(abstract).__name__}, not an nnx.Module; "
            "return the model instance (e.g. `return MyModel(cfg, rngs)`)"
        )
    # two filters give three parts (nnx.split's annotation says only "a tuple of any length")
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)  # type: ignore[misc]
    unannotated: list[str] = []

    def names_of(state, prefix):
        def one(path, v):
            names = logical_axes(v)
            if names is None:
                rank = len(np.shape(v.get_value()))
                if rank and not isinstance(v, nnx.RngState):  # scalars and RNG streams replicate by nature
                    unannotated.append(prefix + path_name(path))
                names = (None,) * rank
            return names

        return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_var)

    logical = nnx.to_pure_dict(names_of(params, ""))
    var_logical = nnx.to_pure_dict(names_of(rest, "")) if jax.tree.leaves(rest) else {}
    var_pure = nnx.to_pure_dict(rest)
    impls = [x.dtype._impl if _is_key(x) else None for x in jax.tree.leaves(var_pure)]
    var_logical = (
        jax.tree.unflatten(
            jax.tree.structure(var_pure),
            [
                names + (None,) if impl is not None else names
                for names, impl in zip(jax.tree.leaves(var_logical, is_leaf=_is_names), impls)
            ],
        )
        if impls
        else {}
    )
    if require_annotations and unannotated:
        raise ShardingError(
            f"{len(unannotated)} model variable(s) have no logical axis names: "
            f"{', '.join(unannotated[:8])}{' ...' if len(unannotated) > 8 else ''}; annotate them "
            "(nnx.with_partitioning / meshpar.nn.layers.param) or set train.require_annotations=false"
        )
    has_vars = bool(jax.tree.leaves(rest))
    return ModelSpec(
        graphdef,
        jax.tree.structure(params),
        nnx.to_pure_dict(params),
        logical,
        getattr(abstract, "cfg", None),
        jax.tree.structure(rest) if has_vars else None,
        jax.eval_shape(_keys_to_data, var_pure) if has_vars else {},
        var_logical,
        unannotated,
        impls,
        abstract,
    )


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_to_data(tree):
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def path_name(path) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def _tree_shardings(shapes, logical, layout: Layout, kind: str, what: str):
    def one(path, shape, names):
        return layout.sharding(names, shape.shape, f"{what} '{path_name(path)}'", kind)

    return jax.tree_util.tree_map_with_path(one, shapes, logical, is_leaf=_is_names)


def param_shardings(spec: ModelSpec, layout: Layout) -> dict:
    """At-rest layout of parameters (also of gradients unless the strategy is ZeRO-1/2)."""
    return _tree_shardings(spec.shapes, spec.logical, layout, "rest", "parameter")


def var_shardings(spec: ModelSpec, layout: Layout) -> dict:
    """Layout of the non-Param variables (RNG keys, counters, statistics) by their own names."""
    return _tree_shardings(spec.var_shapes, spec.var_logical, layout, "params", "variable")


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
    return optax.tree_map_params(
        tx,
        lambda _, s: s,
        abstract,
        per_param,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def batch_shardings(batch_spec, layout: Layout):
    """A tree of `meshpar.Leaf` (global shape, dtype, logical axes) -> NamedShardings."""

    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: layout.sharding(leaf.axes, leaf.shape, f"batch leaf '{path_name(path) or 'batch'}'"),
        batch_spec,
        is_leaf=is_leaf,
    )


def split_microbatches(batch, m: int, layout: Layout, batch_spec=None):
    """Every leaf [B, ...] -> [M, B/M, ...]. Row i*M + k goes to microbatch k, so every device keeps its
    own rows (no data movement); each microbatch keeps the batch layout (`batch_spec`'s axes; by
    default `batch` on the leading dimension only)."""

    def one(x, axes):
        mbs = x.reshape((x.shape[0] // m, m) + x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(mbs, layout.sharding((None, *axes), mbs.shape, "microbatches"))

    if batch_spec is None:
        return jax.tree.map(lambda x: one(x, ("batch",) + (None,) * (x.ndim - 1)), batch)
    axes = [leaf.axes for leaf in jax.tree.leaves(batch_spec, is_leaf=is_leaf)]
    return jax.tree.unflatten(jax.tree.structure(batch), [one(x, a) for x, a in zip(jax.tree.leaves(batch), axes)])


def bytes_per_device(shape, dtype, sharding) -> int:
    shard = sharding.shard_shape(tuple(shape))
    return int(math.prod(shard) * np.dtype(dtype).itemsize)


def spec_str(spec) -> str:
    """P(None, ('data', 'fsdp'), 'tensor') -> '-, data+fsdp, tensor' ('replicated' if empty)."""
    parts = ["-" if p is None else p if isinstance(p, str) else "+".join(p) for p in spec]
    return ", ".join(parts) if any(p != "-" for p in parts) else "replicated"


def unruled_batch_axes(batch_spec, layout: Layout) -> list[str]:
    """One line per batch-leaf axis name that is neither meshpar's nor any rule's (its dimension is
    not split: a typo, often), with the closest known name."""
    import difflib

    rules = layout.rules()
    known = sorted({n for n, _ in rules} | set(LOGICAL_AXES))
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch_spec, is_leaf=is_leaf):
        for name in uncovered(leaf.axes, rules):
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            out.append(
                f"batch leaf '{path_name(path) or 'batch'}' names axis '{name}', which no rule maps{hint}: "
                "that dimension is not split; fix the name or add a rule"
            )
    return out


def context_unsplit(batch_spec, layout: Layout) -> list[str]:
    """One line (else none) when the `context` mesh axis (size > 1) splits no dimension of any batch leaf: a batch
    whose sequence dimension is not named `length` (nor another name a rule puts on `context`) is
    repeated whole on every context device. Names the leaves and the rules that would split them."""

    cp = layout.shape.get("context", 1)
    leaves = jax.tree_util.tree_leaves_with_path(batch_spec, is_leaf=is_leaf)
    if cp == 1 or any("context" in spec_axes(layout.spec(leaf.axes)) for _, leaf in leaves):
        return []
    names = ", ".join(f"'{path_name(path) or 'batch'}' {tuple(leaf.axes)}" for path, leaf in leaves)
    rules = sorted(
        {n for n, cands in layout.rules() for c in cands if "context" in ((c,) if isinstance(c, str) else c)}
    )
    return [
        f"mesh.context={cp} splits no batch leaf: {names} name{'s' if len(leaves) == 1 else ''} no axis the "
        f"rules put on `context` "
        f"({', '.join(f'{n} -> context' for n in rules)}), so the {cp} context devices repeat the same work; name "
        f"the sequence dimension 'length' (meshpar.Leaf(shape, dtype, ('batch', 'length', ...))) or set mesh.context=1"
    ]


def sharding_table(spec: ModelSpec, layout: Layout, batch_spec=None, activations: dict | None = None) -> list[dict]:
    """One row per model variable (parameters, then other state, then the batch leaves of
    `batch_spec`, kind `batch`, then `activations` {name: Leaf}, kind `activation`: how the model's
    [batch, length] tokens are laid out, e.g. `length` over `context`): name, shape, logical axes,
    PartitionSpec, bytes per device, and a `note` where a variable is replicated for want of an
    annotation or of a rule for one of its names."""
    rows = []
    rules = layout.rules()
    unannotated = set(spec.unannotated)
    for kind, shapes, logical, shards in (
        ("param", spec.shapes, spec.logical, param_shardings(spec, layout)),
        ("var", spec.var_shapes, spec.var_logical, var_shardings(spec, layout)),
    ):
        for (path, shape), names, sh in zip(
            jax.tree_util.tree_leaves_with_path(shapes),
            jax.tree.leaves(logical, is_leaf=_is_names),
            jax.tree.leaves(shards),
        ):
            name = path_name(path)
            note = (
                "no annotation: replicated"
                if name in unannotated
                else "no rule for " + ", ".join(repr(n) for n in uncovered(names, rules))
                if uncovered(names, rules)
                else ""
            )
            rows.append(
                {
                    "name": name,
                    "kind": kind,
                    "shape": list(shape.shape),
                    "logical": list(names),
                    "spec": spec_str(sh.spec),
                    "bytes_per_device": bytes_per_device(shape.shape, shape.dtype, sh),
                    "bytes": int(math.prod(shape.shape) * np.dtype(shape.dtype).itemsize),
                    "note": note,
                }
            )
    if batch_spec is not None:
        for (path, leaf), sh in zip(
            jax.tree_util.tree_leaves_with_path(batch_spec, is_leaf=is_leaf),
            jax.tree.leaves(batch_shardings(batch_spec, layout)),
        ):
            lost = uncovered(leaf.axes, rules)
            rows.append(
                {
                    "name": "batch" + (f".{path_name(path)}" if path else ""),
                    "kind": "batch",
                    "shape": list(leaf.shape),
                    "logical": list(leaf.axes),
                    "spec": spec_str(sh.spec),
                    "bytes_per_device": bytes_per_device(leaf.shape, leaf.dtype, sh),
                    "bytes": int(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize),
                    "note": "no rule for " + ", ".join(repr(n) for n in lost) if lost else "",
                }
            )
    for name, leaf in (activations or {}).items():
        sh = layout.sharding(leaf.axes, leaf.shape, f"activation '{name}'")
        rows.append(
            {
                "name": name,
                "kind": "activation",
                "shape": list(leaf.shape),
                "logical": list(leaf.axes),
                "spec": spec_str(sh.spec),
                "bytes_per_device": bytes_per_device(leaf.shape, leaf.dtype, sh),
                "bytes": int(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize),
                "note": "per feature",
            }
        )
    return rows


def render_sharding_table(rows: list[dict]):
    """The sharding table as a rich Table (what `meshpar train` and `inspect` print)."""
    from rich.table import Table

    t = Table(title="parameter shardings")  # non-Param variables are rows too (kind var)
    for col in ("variable", "shape", "logical axes", "PartitionSpec", "bytes/device", "note"):
        t.add_column(col, justify="right" if col == "bytes/device" else "left", overflow="fold")
    for r in rows:
        t.add_row(
            r["name"],
            "x".join(map(str, r["shape"])),
            ", ".join(n or "-" for n in r["logical"]),
            r["spec"],
            f"{r['bytes_per_device']:,}",
            r["note"],
        )
    total = sum(r["bytes_per_device"] for r in rows if r["kind"] not in ("batch", "activation"))
    t.add_row("total (model state)", "", "", "", f"{total:,}", "", style="bold")
    return t
