"""Settings a run would ignore without a word, found before it runs (one warning line each):

* variables named by mesh axes (`("data", "tensor")`, Flax's way when no logical rules are set) that
  no rule maps: meshpar reads names as logical ones, so those dimensions are replicated;
* a mesh axis of size > 1 that the strategy splits nothing over: its devices hold and compute the same
  (`strategy=fsdp` on a mesh with `tensor=2`);
* a sequence-parallel strategy (tp_sp, fsdp_tp_sp) on a model none of whose activation constraints
  it places otherwise than its twin without sequence parallelism (tp, fsdp_tp): the same program;
* a precision policy whose compute dtype no matmul of the model's forward uses (a model that fixes
  its own dtypes): `precision=bf16` would change nothing.

`Notices` holds them for one `meshpar.train.state.TrainSetup`. The last three read the loss's
forward, traced at most once (`meshpar.train.flops.loss_forward`, no compile) and only where a check
needs it; `Notices.matmul_dtypes` is also what the run's header reports.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.extend.core import subjaxprs

from meshpar.core.errors import ShardingError
from meshpar.core.mesh import MESH_AXES
from meshpar.core.rules import PRESETS, get_strategy, spec_axes, uncovered
from meshpar.core.sharding import path_name
from meshpar.train.flops import loss_forward

SEQUENCE_PARALLEL = {"tp_sp": "tp", "fsdp_tp_sp": "fsdp_tp"}  # a strategy -> its twin without SP


@dataclasses.dataclass
class Notices:
    """The notices of `setup` (a `TrainSetup`) run with preset `strategy` (`cfg.strategy`), its forward
    traced with the dropout of `seed` (`cfg.train.seed`); with `strict` (`train.require_annotations`)
    variables named by mesh axes are an error, at once."""

    setup: Any
    strategy: str
    seed: int
    strict: bool = False
    _forward: Any = None

    def __post_init__(self):
        self.named_by_mesh_axes = mesh_axis_names(self.setup.spec, self.setup.layout, self.strict)

    def forward(self):
        """The loss's forward on the whole batch as a jaxpr, traced once."""
        if self._forward is None:
            self._forward = loss_forward(self.setup, self.seed)
        return self._forward

    def lines(self) -> list[str]:
        """Their warning lines."""
        out = [f"warning: {line}" for line in self.named_by_mesh_axes] + idle_axes(
            self.setup, self.strategy, self.forward
        )
        out += sequence_parallel_unused(self.setup, self.strategy, self.seed, self.forward)
        policy = self.setup.policy
        dtype = jax.numpy.dtype(policy.compute_dtype).name
        used = set(self.matmul_dtypes()) if dtype != "float32" else set()
        if used and dtype not in used:
            out.append(
                f"warning: precision={policy.name} changes nothing here: every matmul of the model's forward runs "
                f"in {' / '.join(sorted(used))} (it sets its own dtypes); give its layers "
                "dtype=meshpar.compute_dtype() (or get_policy(cfg.precision).compute_dtype in its factory), or "
                "set precision=fp32"
            )
        return out

    def matmul_dtypes(self) -> list[str]:
        """The dtypes the operands of the forward's matmuls (dot_general, convolutions) are in."""
        found = set()
        for eqn in _eqns(self.forward()):
            if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                found.update(v.aval.dtype.name for v in eqn.invars[:2])
        return sorted(found)


def mesh_axis_names(spec, layout, strict: bool = False) -> list[str]:
    """One line (else none) for the variables of `spec` (a `ModelSpec`) whose names are mesh axes no
    rule of `layout` maps, saying how to map them; an error when `strict` (`train.require_annotations`)."""
    rules = layout.rules()
    found: dict[str, tuple] = {}
    for logical in (spec.logical, spec.var_logical or {}):
        for path, names in jax.tree_util.tree_leaves_with_path(logical, is_leaf=lambda x: isinstance(x, tuple)):
            if any(n in MESH_AXES for n in uncovered(names, rules)):
                found[path_name(path)] = tuple(names)
    if not found:
        return []
    axes = sorted({n for names in found.values() for n in uncovered(names, rules) if n in MESH_AXES})
    shown = ", ".join(f"'{k}' {v}" for k, v in list(found.items())[:4]) + (" ..." if len(found) > 4 else "")
    line = (
        f"{len(found)} variable(s) name mesh axes where meshpar reads logical names, so those dimensions are "
        f"replicated: {shown}; map each to itself (rules=[{', '.join(f'[{a}, {a}]' for a in axes)}]) or name "
        "what each dimension means (embed, mlp, heads, vocab, ...: meshpar.LOGICAL_AXES) and let the strategy "
        "place it"
    )
    if strict:
        raise ShardingError(f"{line} (train.require_annotations=true)")
    return [line]


def idle_axes(setup, strategy: str, forward) -> list[str]:
    """One line per mesh axis of size > 1 (but `context`, which `context_unsplit` covers) that splits
    no parameter, variable, optimizer state, batch leaf or constrained activation (`forward()`: the
    loss's traced forward, read only when the state leaves an axis idle)."""
    layout = setup.layout
    live = [a for a, n in layout.shape.items() if n > 1 and a != "context"]
    used = _state_axes(setup)
    if not set(live) - used:
        return []
    used |= {a for spec in _constraints(forward()) for a in spec_axes(spec)}
    out = []
    for axis in (a for a in live if a not in used):
        users = [p for p, s in PRESETS.items() if any(axis in spec_axes((c,)) for _, cs in s.params for c in cs)]
        n = layout.shape[axis]
        out.append(
            f"warning: strategy={strategy} splits nothing over mesh axis {axis} (size {n}): its {n} devices hold "
            f"and compute the same; use a strategy that splits over it ({', '.join(users) or 'a rule of yours'}) "
            f"or set mesh.{axis}=1"
        )
    return out


def sequence_parallel_unused(setup, strategy: str, seed: int, forward) -> list[str]:
    """One line when a sequence-parallel preset constrains every activation as its twin does."""
    twin = SEQUENCE_PARALLEL.get(strategy)
    if twin is None or setup.layout.shape.get("tensor", 1) == 1:
        return []
    plain = dataclasses.replace(setup.layout, strategy=get_strategy(twin))
    if _constraints(forward()) != _constraints(loss_forward(setup, seed, plain)):
        return []
    return [
        f"warning: strategy={strategy} compiles the program of strategy={twin}: no activation of this model is "
        "constrained with a name sequence parallelism splits (the residual stream's 'length'); constrain it "
        f"with ('batch', 'length', 'embed') (meshpar.constrain) between blocks, or use strategy={twin}"
    ]


def _state_axes(setup) -> set[str]:
    """The mesh axes the train state's and the batch's shardings split over (and the LM's tokens)."""
    shardings = jax.tree.leaves((setup.state_shardings, setup.batch_sharding))
    axes = {a for sh in shardings for a in spec_axes(getattr(sh, "spec", ()))}
    if setup.is_lm:
        axes |= set(spec_axes(setup.layout.spec(("batch", "length"))))
    return axes


def _constraints(jaxpr) -> list[tuple]:
    """The PartitionSpecs of a jaxpr's sharding constraints, in order, trailing Nones dropped."""
    out = []
    for eqn in _eqns(jaxpr):
        if eqn.primitive.name == "sharding_constraint":
            spec = tuple(getattr(eqn.params["sharding"], "spec", ()))
            while spec and spec[-1] is None:
                spec = spec[:-1]
            out.append(spec)
    return out


def _eqns(jaxpr):
    """Every equation of a (closed) jaxpr and of the jaxprs inside it (scans, conds, custom rules)."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    yield from inner.eqns
    for sub in subjaxprs(inner):
        yield from _eqns(sub)
