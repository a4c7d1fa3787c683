"""What a batch is: a tree of `Leaf` (global shape, dtype, logical axes led by `batch`), the one
description that data sources, shardings, the train step and the KV cache share.

    lm_batch_spec(B, T)  ->  Leaf((B, T + 1), int32, ("batch", None))   # token rows: inputs + shifted targets
    lm_batch_spec(B, T, documents=True)  ->  {"tokens", "segment_ids", "positions"}, each such a Leaf

Packed documents (`BOS doc EOS BOS doc EOS ...` cut into rows): `segment_ids` numbers the documents
of a row 0, 1, 2, ... and `positions` counts tokens from each document's first token in the row, so
a token attends to its own document only and RoPE restarts at each document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from meshpar.core.errors import ConfigError


@dataclass(frozen=True)
class Leaf:
    """One leaf of a global batch: shape [B, ...], dtype and logical axes (the first is `batch`)."""

    shape: tuple
    dtype: Any
    axes: tuple


def is_leaf(x) -> bool:
    return isinstance(x, Leaf)


DOCUMENT_KEYS = ("tokens", "segment_ids", "positions")


def lm_batch_spec(global_size: int, length: int, documents: bool = False):
    """The language-model batch: token rows [B, T+1] (inputs and shifted targets); with `documents`,
    {"tokens", "segment_ids", "positions"}, each [B, T+1]."""
    leaf = Leaf((global_size, length + 1), np.int32, ("batch", None))
    return {k: leaf for k in DOCUMENT_KEYS} if documents else leaf


def check_batch_spec(batch_spec) -> None:
    """Every leaf is a `Leaf` whose axes match its rank and lead with `batch`; one line naming it otherwise."""
    import jax

    for path, leaf in jax.tree_util.tree_leaves_with_path(batch_spec, is_leaf=lambda x: is_leaf(x) or x is None):
        name = jax.tree_util.keystr(path) or "batch"
        if not is_leaf(leaf):
            raise ConfigError(
                f"batch leaf {name} has no declared logical axes; describe it as "
                "meshpar.Leaf(shape, dtype, axes) with axes like ('batch', None)"
            )
        if len(leaf.axes) != len(leaf.shape) or not leaf.axes or leaf.axes[0] != "batch":
            raise ConfigError(
                f"batch leaf {name}: axes {tuple(leaf.axes)} do not fit shape {tuple(leaf.shape)}; give "
                "one logical name (or None) per dimension, the first being 'batch'"
            )
