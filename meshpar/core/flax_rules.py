"""Flax's own sharding API inside meshpar: the mesh context and the logical-rule table a trace runs
under, set from the active layout (`meshpar.core.layout.use_layout` enters them).

A Flax model constrains its activations in one of two ways, and both need a context:

    jax.lax.with_sharding_constraint(x, P("data", None, "tensor"))       # mesh axes: a mesh context
    flax.linen.with_logical_constraint(x, ("batch", "length", "embed"))   # logical names: rules too

meshpar enters the run's mesh as the abstract mesh of the trace (`jax.sharding.use_abstract_mesh`; a
`shard_map` body keeps its own, with its manual axes) and Flax's rule table (`nnx.logical_axis_rules`,
which Flax's Linen constraints read) built from the layout's rules by `flax_table`, so a logical
constraint written the Flax way lands where `meshpar.constrain` puts the same names.

The two resolve differently, and the table bridges them. meshpar walks a tensor's dimensions in order,
each taking its first candidate with live mesh axes (size > 1) not used by an earlier dimension, or
the part of it left free (`meshpar.core.rules.resolve`); Flax walks the table's rules in order and
takes a rule's axes whole if they are all free. The table lists, name by name, each candidate's live
axes and then every order-kept part of them, largest first: the first free entry Flax finds for a name
is then the part meshpar takes. Names come in the order their dimensions come in meshpar's tensors
(`NAME_ORDER`: layers before batch before experts before positions before features), so where two
dimensions of one tensor want the same axis the earlier dimension gets it, as in meshpar. A tensor
whose names run against that order ([expert, group, capacity, embed], MoE's tokens after their
all-to-all) gives the axis to the earlier *rule* under Flax; constrain such a tensor with
`meshpar.constrain`, which always gives it to the earlier dimension. Flax does not check that a
dimension divides its axes (`meshpar.constrain` does, in one line).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

from meshpar.core.rules import RuleTable

# the order logical names take in meshpar's tensors ([layers, expert, embed, expert_mlp], [batch,
# length, heads, kv], [vocab, embed]); names outside it follow in the order of the rules
NAME_ORDER = (
    "stage",
    "layers",
    "batch",
    "group",
    "cache_batch",
    "expert",
    "length",
    "seq",
    "cache_length",
    "capacity",
    "vocab",
    "embed",
    "heads",
    "kv_heads",
    "kv",
    "mlp",
    "expert_mlp",
    "norm",
)


FlaxRule = tuple[str, str | tuple[str, ...] | None]  # Flax's: (logical name, mesh axis | axes | None)


def flax_table(rules: RuleTable, mesh_shape: dict[str, int]) -> tuple[FlaxRule, ...]:
    """meshpar's rules on a mesh of `mesh_shape` (hidden axes at size 1) -> Flax's rule table: pairs
    (logical name, mesh axis | tuple of axes | None), in the order described in the module docstring."""
    by_name: dict[str, list[str | tuple[str, ...] | None]] = {}
    for name, cands in rules:
        entries = by_name.setdefault(name, [])
        if not cands:  # an explicit empty rule: replicate (Flax's (name, None) stops the name too)
            entries.append(None)
        for cand in cands:
            axes = (cand,) if isinstance(cand, str) else tuple(cand)
            live = tuple(a for a in axes if mesh_shape.get(a, 1) > 1)
            for k in range(len(live), 0, -1):
                entries += [part[0] if k == 1 else part for part in itertools.combinations(live, k)]
    order = [n for n in NAME_ORDER if n in by_name] + [n for n in by_name if n not in NAME_ORDER]
    return tuple((name, entry) for name in order for entry in by_name[name])


@contextlib.contextmanager
def flax_contexts(mesh, rules: RuleTable, mesh_shape: dict[str, int]) -> Iterator[None]:
    """Within it: `mesh` as the abstract mesh of the trace (unless one is set already, as inside a
    `shard_map`) and Flax's logical rules as `flax_table(rules, mesh_shape)`."""
    import jax
    from flax.core import spmd

    abstract = getattr(mesh, "abstract_mesh", mesh)
    with contextlib.ExitStack() as stack:
        if not jax.sharding.get_abstract_mesh().axis_names:
            stack.enter_context(jax.sharding.use_abstract_mesh(abstract))
        stack.enter_context(spmd.logical_axis_rules(flax_table(rules, mesh_shape)))
        yield
