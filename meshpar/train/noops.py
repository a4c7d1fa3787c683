"""Settings a run would ignore without a word, found before it runs (one warning line each):

* a mesh axis of size > 1 that the strategy splits nothing over: its devices hold and compute the same
  (`strategy=fsdp` on a mesh with `tensor=2`);
* a sequence-parallel strategy (tp_sp, fsdp_tp_sp) on a model none of whose activation constraints
  it places otherwise than its twin without sequence parallelism (tp, fsdp_tp): the same program;
* a precision policy whose compute dtype no matmul of the model's forward uses (a model that fixes
  its own dtypes): `precision=bf16` would change nothing.

The last two read the loss's forward, traced once (`meshpar.train.flops.loss_forward`, no compile),
and only where the check applies; `matmul_dtypes` is also what the run's header reports.
"""

from __future__ import annotations

import dataclasses

import jax

from meshpar.core.rules import PRESETS, get_strategy, spec_axes
from meshpar.train.flops import loss_forward

SEQUENCE_PARALLEL = {"tp_sp": "tp", "fsdp_tp_sp": "fsdp_tp"}  # a strategy -> its twin without SP


def notices(trainer, strategy: str, seed: int) -> list[str]:
    """The warning lines for `trainer` (a `TrainSetup`) run with preset `strategy` (`cfg.strategy`), its
    forward traced with the dropout of `seed` (`cfg.train.seed`)."""
    out = idle_axes(trainer, strategy)
    out += sequence_parallel_unused(trainer, strategy, seed)
    dtype = jax.numpy.dtype(trainer.policy.compute_dtype).name
    used = matmul_dtypes(trainer.forward())
    if dtype != "float32" and used and dtype not in used:
        out.append(
            f"warning: precision={trainer.policy.name} changes nothing here: every matmul of the model's forward "
            f"runs in {' / '.join(sorted(used))} (it sets its own dtypes); give its layers "
            "dtype=meshpar.compute_dtype() (or get_policy(cfg.precision).compute_dtype in its factory), or "
            "set precision=fp32"
        )
    return out


def matmul_dtypes(forward) -> set[str]:
    """The dtypes the operands of a forward's matmuls (dot_general, convolutions) are in."""
    found = set()
    for eqn in _eqns(forward):
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            found.update(v.aval.dtype.name for v in eqn.invars[:2])
    return found


def idle_axes(trainer, strategy: str) -> list[str]:
    """One line per mesh axis of size > 1 (but `context`, which `context_unsplit` covers) that splits
    no parameter, variable, optimizer state, batch leaf or constrained activation."""
    layout = trainer.layout
    live = [a for a, n in layout.shape.items() if n > 1 and a != "context"]
    used = _state_axes(trainer)
    if not set(live) - used:
        return []
    used |= {a for spec in _constraints(trainer.forward()) for a in spec_axes(spec)}
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


def sequence_parallel_unused(trainer, strategy: str, seed: int = 0) -> list[str]:
    """One line when a sequence-parallel preset constrains every activation as its twin does."""
    twin = SEQUENCE_PARALLEL.get(strategy)
    if twin is None or trainer.layout.shape.get("tensor", 1) == 1:
        return []
    plain = dataclasses.replace(trainer.layout, strategy=get_strategy(twin))
    if _constraints(trainer.forward()) != _constraints(loss_forward(trainer, seed, plain)):
        return []
    return [
        f"warning: strategy={strategy} compiles the program of strategy={twin}: no activation of this model is "
        "constrained with a name sequence parallelism splits (the residual stream's 'length'); constrain it "
        f"with ('batch', 'length', 'embed') (meshpar.constrain) between blocks, or use strategy={twin}"
    ]


def _state_axes(trainer) -> set[str]:
    """The mesh axes the train state's and the batch's shardings split over (and the LM's tokens)."""
    shardings = jax.tree.leaves((trainer.state_shardings, trainer.batch_sharding))
    axes = {a for sh in shardings for a in spec_axes(getattr(sh, "spec", ()))}
    if trainer.is_lm:
        axes |= set(spec_axes(trainer.layout.spec(("batch", "length"))))
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
    from jax.extend.core import subjaxprs

    inner = getattr(jaxpr, "jaxpr", jaxpr)
    yield from inner.eqns
    for sub in subjaxprs(inner):
        yield from _eqns(sub)
