"""Dropout (any RNG stream) inside `meshpar.stacked` layers: keys derived from where a draw happens,
never carried as state.

A block's `nnx.Dropout(rate, rngs=rngs)` (or `nnx.MultiHeadAttention(dropout_rate=...)`) keeps an
RNG stream: a key and a counter. Carried in the stacked layers they would be state [L, ...] that a
pipeline would have to send between stages with every microbatch, and whose values would depend on
how many times a layer ran. `meshpar.stacked` replaces each stored stream by a `LayerStream`, which
holds nothing: its n-th draw in a layer call is

    key = fold_in(key(train.seed), DROPOUT, step, microbatch, layer, stream, n)

step: the optimizer step (`state["step"]`); microbatch: the global index of the microbatch (the
accumulation step a of A = `batch.microbatches`, and the pipeline's microbatch i of it: a + A i, the
index one device accumulating A x `pipeline.microbatches` microbatches gives the same rows);
layer: the layer's index in the whole stack (a pipeline stage adds its first layer's); stream: the
stream's place in the block. So one device and any pipeline schedule draw the same masks, two runs
with the same seed draw the same masks, and every step draws new ones.

Who sets what (context variables, read while the model is traced):

    training(seed, step)        the train step (meshpar.train.step), once per step
    accumulating(a, A)          its gradient accumulation, per microbatch
    at(i, chunk, layers)        a pipeline stage (meshpar.parallel.pipeline), per microbatch
    layer(j)                    meshpar.nn.layers.scan_layers, per layer of its scan

In eval mode (`model.eval()`, which evaluation and serving call) Dropout draws nothing. A draw
anywhere else (the model called in train mode outside a train step, or the stack called without
`scan_layers`) is refused in one line naming the block.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx

from meshpar.core import scopes
from meshpar.core.errors import ConfigError

DROPOUT = 0x44524F50  # folded in first: the stacked layers' keys are not the init's


@dataclasses.dataclass(frozen=True)
class Draws:
    """Where the model is being traced: the step, the microbatch, the layer (see the module docstring)."""

    seed: int
    step: Any  # int32 scalar
    first: Any = 0  # global index of this call's (accumulation step's) microbatch 0
    every: int = 1  # stride between the microbatches a pipeline cuts this call into
    micro: Any = 0  # the pipeline microbatch being run
    first_layer: Any = 0  # index in the whole stack of the stack being run's layer 0
    layer: Any = None  # the layer being run (set by scan_layers)
    counts: dict | None = None  # draws so far per stream in this layer call


_DRAWS = scopes.DRAWS


@contextlib.contextmanager
def _replaced(**changes) -> Iterator[None]:
    """The active Draws with `changes` (nothing without one: the model then draws nothing, or is refused)."""
    current = _DRAWS.get()
    token = _DRAWS.set(dataclasses.replace(current, **changes) if current is not None else None)
    try:
        yield
    finally:
        _DRAWS.reset(token)


@contextlib.contextmanager
def training(seed: int, step) -> Iterator[None]:
    """The train step: step `step` (int32 scalar) of a run seeded with `seed` (`train.seed`)."""
    token = _DRAWS.set(Draws(int(seed), step))
    try:
        yield
    finally:
        _DRAWS.reset(token)


def accumulating(a, m: int):
    """Gradient accumulation: this is accumulation step `a` of `m` (`batch.microbatches`)."""
    return _replaced(first=a, every=m)


def at(micro, chunk, layers):
    """A pipeline stage: microbatch `micro` of this accumulation step through `layers` [Lc, ...], chunk
    `chunk` of the whole stack (its layer 0 is the stack's layer chunk * Lc)."""
    return _replaced(micro=micro, first_layer=chunk * jax.tree.leaves(layers)[0].shape[0])


def layer(j):
    """scan_layers: layer j of the stack being run (its draws counted afresh)."""
    current = _DRAWS.get()
    return _replaced(layer=None if current is None else current.first_layer + j, counts={})


class LayerStream(nnx.RngStream):
    """The RNG stream a block inside `meshpar.stacked` reads (Dropout's `rngs`): stateless, its keys
    derived from the active `Draws`. tag: the stream's name; slot: its place in the block; block:
    the block's class name (for the one-line refusal)."""

    def __init__(self, tag: str, slot: int, block: str):
        self.tag, self.slot, self.block = tag, slot, block

    def __call__(self) -> jax.Array:
        d = _DRAWS.get()
        if d is None or d.layer is None:
            where = (
                "outside a train step (model in train mode)"
                if d is None
                else "outside meshpar.scan_layers / apply_layers"
            )
            raise ConfigError(
                f"{self.block} (in meshpar.stacked) draws its '{self.tag}' RNG stream {where}, where "
                "no key is defined; call model.eval() (no dropout), or run it through the train step "
                "and the stack through meshpar.scan_layers / meshpar.apply_layers"
            )
        n = d.counts.get(self.slot, 0)
        d.counts[self.slot] = n + 1
        key = jax.random.key(d.seed)
        for x in (DROPOUT, d.step, d.first + d.every * d.micro, d.layer, self.slot, n):
            key = jax.random.fold_in(key, x)
        return key


def detach(module, block: str) -> int:
    """Replace every RNG stream inside the stacked `module` by a `LayerStream` (a stream shared by
    two modules stays shared); returns how many there were."""
    new: dict[int, LayerStream] = {}
    while True:
        found = next(
            (
                (p, n)
                for p, n in nnx.iter_graph(module)
                if isinstance(n, nnx.RngStream) and not isinstance(n, LayerStream)
            ),
            None,
        )
        if found is None:
            return len(new)
        path, old = found
        parent = module
        for k in path[:-1]:
            parent = getattr(parent, k) if isinstance(k, str) else parent[k]
        stream = new.setdefault(id(old), LayerStream(old.tag, len(new), block))
        if isinstance(path[-1], str):
            setattr(parent, path[-1], stream)
        else:
            parent[path[-1]] = stream


def draws(graphdef) -> bool:
    """Whether a model (its nnx graphdef) has stacked layers that draw keys (`LayerStream`s)."""
    return any(
        isinstance(t, type) and issubclass(t, LayerStream)
        for t in (getattr(node, "type", None) for node in getattr(graphdef, "nodes", ()))
    )
