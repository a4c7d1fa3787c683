"""The active layout: a mesh plus the rule tables in force (`meshpar.core.rules`), and what model code
calls while a model is traced under it: `constrain` (an activation's layout) and `at_use` (a weight
gathered at its use). `use_layout` makes a layout active (`meshpar.core.scopes.LAYOUT`), and with it
the contexts Flax's own sharding API reads (`meshpar.core.flax_rules`)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from meshpar.core import scopes
from meshpar.core.flax_rules import flax_contexts
from meshpar.core.rules import RuleTable, Strategy, resolve_kind, spec_axes, table


@dataclass(frozen=True)
class Layout:
    """A mesh plus the rule tables in force. `for_params`/`for_opt_state` pick the table.

    `hidden` mesh axes count as size 1 during resolution: inside a `vmap` whose mapped dimension
    already takes them (ZeRO-1's per-replica gradients, `meshpar.train.step`) nothing else may use them.
    `gathered` mesh axes are those a weight is gathered over at its use (`at_use`; 1F1B's per-device
    branches, `meshpar.parallel.pipeline`).
    """

    mesh: Any  # a jax.sharding.Mesh (or an abstract one)
    strategy: Strategy
    user_rules: RuleTable = ()
    hidden: frozenset = frozenset()
    gathered: frozenset = frozenset()

    @property
    def shape(self) -> dict[str, int]:
        return {a: (1 if a in self.hidden else n) for a, n in zip(self.mesh.axis_names, self.mesh.devices.shape)}

    def rules(self, kind: str = "params") -> RuleTable:
        """The rules in force for `kind` (`Strategy.rules`), the user's first."""
        return self.user_rules + self.strategy.rules(kind)

    def spec(self, logical, shape=None, what="tensor", kind="params"):
        return resolve_kind(logical, self.strategy, self.user_rules, kind, self.shape, shape, what)

    def sharding(self, logical, shape=None, what="tensor", kind="params"):
        from jax.sharding import NamedSharding

        return NamedSharding(self.mesh, self.spec(logical, shape, what, kind))

    def hiding(self, axes) -> Layout:
        return dataclasses.replace(self, hidden=self.hidden | frozenset(axes))

    def gathering(self, axes) -> Layout:
        return dataclasses.replace(self, gathered=self.gathered | frozenset(axes))

    def ways(self, name: str) -> int:
        """Over how many devices a dimension with the logical name `name` is split."""
        return math.prod(self.shape[a] for a in spec_axes(self.spec((name,))[:1]))


def for_rows(layout: Layout, rows: int) -> Layout:
    """`layout` for a batch of `rows` rows (a prefill, a pipeline's microbatch of KV-cache slots): as it
    is when the mesh axes of `batch` and `cache_batch` divide the rows, else with those (and `group`)
    replicated: every row on every device."""
    if all(rows % layout.ways(name) == 0 for name in ("batch", "cache_batch")):
        return layout
    return dataclasses.replace(layout, user_rules=table(batch=None, cache_batch=None, group=None) + layout.user_rules)


_ACTIVE = scopes.LAYOUT


@contextlib.contextmanager
def use_layout(layout: Layout | None) -> Iterator[Layout | None]:
    """Make `layout` the one `constrain` uses (while tracing a jitted function), and the one Flax's own
    sharding API reads: its mesh as the trace's mesh context, its rules as Flax's logical rules
    (`meshpar.core.flax_rules`)."""
    token = _ACTIVE.set(layout)
    try:
        if layout is None:
            yield layout
        else:
            with flax_contexts(layout.mesh, layout.rules(), layout.shape):
                yield layout
    finally:
        _ACTIVE.reset(token)


def active_layout() -> Layout | None:
    return _ACTIVE.get()


def constrain(x, logical: Sequence[str | None], what: str = "activation"):
    """Pin `x` (an activation, or a weight inside a layer loop) to the layout its logical axes
    resolve to; no-op outside a layout. The only sharding call model code makes: it names logical
    axes, never mesh axes.
    """
    layout = _ACTIVE.get()
    if layout is None:
        return x
    import jax

    return jax.lax.with_sharding_constraint(x, _sharding_for(layout, layout.spec(logical, x.shape, what)))


def at_use(w, logical: Sequence[str | None], what: str = "parameter"):
    """Pin a weight `w` (one layer's slice inside a layer loop) to its at-rest layout; where the active
    layout gathers weights at use (`Layout.gathering`), then to that layout without those axes: the
    gather FSDP makes at a weight's use, made explicit (its transpose reduce-scatters the gradient).

    Left implicit inside a per-device branch (1F1B's `lax.switch` on the stage), XLA's partitioner
    reached the gathered weight over a mesh axis that splits nothing (`tensor` under strategy=fsdp)
    by a collective-permute over all devices, which XLA:CPU's devices of the other stages never join:
    a deadlock, then a process abort. No-op outside a layout."""
    layout = _ACTIVE.get()
    if layout is None:
        return w
    import jax

    spec = layout.spec(logical, w.shape, what)
    w = jax.lax.with_sharding_constraint(w, _sharding_for(layout, spec))
    # an expert weight keeps its experts split: only the axes of its other dimensions are gathered
    experts = set(spec_axes(tuple(part for part, name in zip(spec, logical) if name == "expert")))
    gathered = layout.gathered - experts
    if gathered & set(spec_axes(spec)):
        w = jax.lax.with_sharding_constraint(w, _sharding_for(layout, without(spec, gathered)))
    return w


def without(spec, axes):
    """A PartitionSpec with the mesh axes `axes` dropped (those dimensions split over the rest, or whole)."""
    from jax.sharding import PartitionSpec

    def drop(part):
        kept = tuple(a for a in spec_axes((part,)) if a not in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return PartitionSpec(*(drop(part) for part in spec))


def _sharding_for(layout: Layout, spec):
    """A bare spec under an active (abstract) mesh context, else a NamedSharding on the layout's mesh."""
    import jax

    if jax.sharding.get_abstract_mesh().axis_names:
        return spec
    from jax.sharding import NamedSharding

    return NamedSharding(layout.mesh, spec)
