"""1F1B's stash: a stage's `jax.vjp` pullback kept as arrays between its forward tick and its
backward tick, without a copy of the stage's weights per stashed microbatch.

    forward tick:   (y, aux), pull = vjp(stage, weights, x);  stash[slot] = residuals.split(pull, weights)
    backward tick:  d_weights, dx = residuals.join(stash[slot], weights)(dy)

An activation may be any pytree, integer or boolean leaves included: its cotangents travel between
stages typed as the activation (`carried`) and enter a pullback as float0 there (`pulled`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshpar.core.errors import ShardingError
from meshpar.parallel.stage_model import vary, zeros


class Residuals:
    """A stage's pullback kept between its forward and backward ticks (1F1B): the residual leaves
    of `jax.vjp` (what the model's remat policy saves: every layer's input under `full`, the
    projections under `save_dots`, everything under `none`), minus the stage's own weights, which
    the pullback reads back from `layers` instead of a copy per slot. One abstract trace fixes the
    pullback's structure, which leaves are weights, and the stashed leaves' shapes [...]."""

    def __init__(self, fn, weights, x_spec):
        info = {}

        def probe(w, x):
            w, x = vary(w), vary(x)  # typed as in the loop (else the pullback holds a psum)
            _, pull, _ = jax.vjp(fn, w, x, has_aux=True)
            leaves, info["treedef"] = jax.tree.flatten(pull)
            info["weight_of"] = self._weight_of(leaves, w)
            return [a for a, j in zip(leaves, info["weight_of"]) if j is None]

        self.shapes = jax.eval_shape(probe, weights, zeros(x_spec))
        self.treedef, self.weight_of = info["treedef"], info["weight_of"]

    @staticmethod
    def _weight_of(leaves, weights) -> tuple:
        """Per residual leaf: the index of the weight leaf it is, or None (an activation to stash)."""
        ids = {id(a): j for j, a in enumerate(jax.tree.leaves(weights))}
        return tuple(ids.get(id(a)) for a in leaves)

    def split(self, pull, weights) -> list:
        """The pullback -> the leaves to stash (the rest are `weights`)."""
        leaves = jax.tree.leaves(pull)
        if self._weight_of(leaves, weights) != self.weight_of:
            raise ShardingError(
                "1F1B: the stage's residuals differ between two traces of the same stage; "
                "set pipeline.schedule=gpipe for this model"
            )
        return [a for a, j in zip(leaves, self.weight_of) if j is None]

    def join(self, stashed, weights):
        """Stashed leaves + the stage's weights -> the pullback."""
        w, it = jax.tree.leaves(weights), iter(stashed)
        return jax.tree.unflatten(self.treedef, [next(it) if j is None else w[j] for j in self.weight_of])


def pulled(ct):
    """A carried activation cotangent (typed as the activation) -> what a pullback takes: float0 for
    an integer or boolean leaf (a mask `pre` passes on, say)."""
    return jax.tree.map(
        lambda a: a if jnp.issubdtype(a.dtype, jnp.inexact) else np.zeros(a.shape, jax.dtypes.float0), ct
    )


def carried(ct, like):
    """A pullback's activation cotangent -> the carried one, typed as the activation `like` (zeros
    for the float0 of an integer or boolean leaf)."""
    return jax.tree.map(lambda g, a: jnp.zeros(a.shape, a.dtype) if g.dtype == jax.dtypes.float0 else g, ct, like)
