"""Training data. Batch `s` is a pure function of (seed, s, global row), so

* the iterator's checkpointable state is one integer (the next step), and resume is exact;
* each process builds only the rows its own devices hold (`jax.make_array_from_callback`), whatever
  the number of processes, and a 2-process run sees exactly the batches a 1-process run sees.

Sources:
* `MarkovLanguage`: a seeded sparse random Markov chain over the vocabulary (each token has
  `branching` successors with Dirichlet weights). Its entropy rate H = sum_s pi(s) H(P(s, .)) is the
  loss floor any model can reach, printed at start.
* `TokenFile`: a flat pre-tokenized `uint16`/`uint32` file, memory-mapped; random windows.
* `TextFiles`: plain text through a byte-level tokenizer (ids 0..255); random windows.
* Your own: any object with `batch_spec(global_size, length) -> tree of Leaf` and
  `rows(seed, step, rows, length) -> the same tree of numpy arrays [len(rows), ...]`, named on the
  command line as `data.kind=PKG.MODULE:FN` (`FN(cfg) -> source`). A batch is then any pytree; each
  leaf declares its logical axes, led by `batch` (e.g. images `("batch", None, None, None)`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshpar.errors import ConfigError


@dataclass(frozen=True)
class Leaf:
    """One leaf of a global batch: shape [B, ...], dtype and logical axes (the first is `batch`)."""
    shape: tuple
    dtype: Any
    axes: tuple


def is_leaf(x) -> bool:
    return isinstance(x, Leaf)


def lm_batch_spec(global_size: int, length: int) -> Leaf:
    """The language-model batch: token rows [B, T+1] (inputs and shifted targets)."""
    return Leaf((global_size, length + 1), np.int32, ("batch", None))


def check_batch_spec(batch_spec) -> None:
    """Every leaf is a `Leaf` whose axes match its rank and lead with `batch`; one line naming it otherwise."""
    import jax
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch_spec, is_leaf=lambda x: is_leaf(x) or x is None):
        name = jax.tree_util.keystr(path) or "batch"
        if not is_leaf(leaf):
            raise ConfigError(f"batch leaf {name} has no declared logical axes; describe it as "
                              "meshpar.data.Leaf(shape, dtype, axes) with axes like ('batch', None)")
        if len(leaf.axes) != len(leaf.shape) or not leaf.axes or leaf.axes[0] != "batch":
            raise ConfigError(f"batch leaf {name}: axes {tuple(leaf.axes)} do not fit shape {tuple(leaf.shape)}; give "
                              "one logical name (or None) per dimension, the first being 'batch'")


def _row_rng(seed: int, step: int, row: int) -> np.random.Generator:
    return np.random.default_rng([seed, step, row])


class MarkovLanguage:
    """A sparse random Markov chain: successors [V, b] and probabilities [V, b]."""

    def __init__(self, vocab: int, branching: int, seed: int):
        if branching > vocab:
            raise ConfigError(f"data.branching={branching} exceeds model.vocab={vocab}")
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.succ = np.stack([rng.choice(vocab, branching, replace=False) for _ in range(vocab)])
        self.probs = rng.dirichlet(np.ones(branching), size=vocab)
        self.cum = np.cumsum(self.probs, axis=1)
        self.cum[:, -1] = 1.0
        self.stationary = self._stationary()

    def _stationary(self, iters: int = 2000) -> np.ndarray:
        pi = np.full(self.vocab, 1.0 / self.vocab)
        for _ in range(iters):    # lazy chain 1/2 (I + P): same stationary law, no periodicity trouble
            nxt = np.zeros_like(pi)
            np.add.at(nxt, self.succ, pi[:, None] * self.probs)
            pi = 0.5 * pi + 0.5 * nxt
        return pi / pi.sum()

    @property
    def entropy_rate(self) -> float:
        """Nats per token: the cross-entropy floor of a perfect model (ignoring the first token)."""
        h = -np.sum(self.probs * np.log(np.maximum(self.probs, 1e-30)), axis=1)
        return float(np.sum(self.stationary * h))

    def rows(self, seed: int, step: int, rows: range, length: int) -> np.ndarray:
        """Token rows [len(rows), length]; row r of step s is the same on every process."""
        u = np.stack([_row_rng(seed, step, r).random(length) for r in rows])       # [R, L]
        out = np.empty((len(rows), length), np.int32)
        cdf_pi = np.cumsum(self.stationary)
        out[:, 0] = np.minimum(np.searchsorted(cdf_pi, u[:, 0]), self.vocab - 1)
        for t in range(1, length):
            prev = out[:, t - 1]
            k = (u[:, t, None] > self.cum[prev]).sum(axis=1)
            out[:, t] = self.succ[prev, np.minimum(k, self.succ.shape[1] - 1)]
        return out


class _Windows:
    """Random fixed-length windows of a flat token array."""
    tokens: np.ndarray
    entropy_rate = None

    def rows(self, seed: int, step: int, rows: range, length: int) -> np.ndarray:
        n = len(self.tokens)
        if n <= length:
            raise ConfigError(f"data.path holds {n} tokens, fewer than batch.length+1={length}")
        out = np.empty((len(rows), length), np.int32)
        for i, r in enumerate(rows):
            start = int(_row_rng(seed, step, r).integers(0, n - length))
            out[i] = self.tokens[start:start + length]
        return out


class TokenFile(_Windows):
    """A flat binary file of token ids (`data.dtype`), memory-mapped. The whole file is checked once
    against the vocabulary, in chunks of CHUNK tokens (one vectorised max per chunk), so a bad id
    anywhere stops the run at start, naming its position, instead of at some later step."""
    CHUNK = 1 << 24

    def __init__(self, path: str, dtype: str, vocab: int):
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"data.path '{path}' is not a file")
        dt = np.dtype(dtype)
        if p.stat().st_size % dt.itemsize:
            raise ConfigError(f"data.path '{path}' has {p.stat().st_size} bytes, not a whole number of "
                              f"{dtype} tokens; is data.dtype right?")
        self.tokens = np.memmap(p, dtype=dt, mode="r") if p.stat().st_size else np.zeros(0, dt)
        for start in range(0, len(self.tokens), self.CHUNK):
            chunk = self.tokens[start:start + self.CHUNK]
            if int(chunk.max()) >= vocab:
                at = start + int(np.argmax(chunk >= vocab))
                raise ConfigError(f"data.path '{path}' holds token id {int(self.tokens[at])} >= model.vocab={vocab} "
                                  f"at position {at}; raise model.vocab or fix the file")


class TextFiles(_Windows):
    def __init__(self, path: str, vocab: int):
        if vocab < 256:
            raise ConfigError(f"data.kind=text uses byte tokens 0..255 and needs model.vocab >= 256, got {vocab}")
        p = Path(path)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        if not files or not files[0].exists():
            raise ConfigError(f"data.path '{path}' has no text files")
        self.tokens = np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)


def make_source(cfg, vocab: int):
    d = cfg.data
    if d.kind == "synthetic":
        return MarkovLanguage(vocab, d.branching, d.seed)
    if d.kind == "tokens":
        return TokenFile(d.path, d.dtype, vocab)
    return TextFiles(d.path, vocab)


class Batches:
    """Iterator of global batches, sharded on arrival: a tree of arrays shaped like `batch_spec`
    (by default one [B, T+1] token array: inputs and shifted targets).

    Each process builds only the rows its devices hold, each row range once per step whatever the
    number of leaves. `state()` / `restore(state)` checkpoint the position; nothing else is needed
    for exact resume.
    """

    def __init__(self, source, sharding, global_size: int, length: int, seed: int, step: int = 0, batch_spec=None):
        self.source, self.sharding = source, sharding
        self.length = length
        self.spec = batch_spec if batch_spec is not None else lm_batch_spec(global_size, length)
        self.seed, self.step = seed, step

    def state(self) -> dict:
        return {"step": self.step}

    def restore(self, state: dict) -> None:
        self.step = int(state["step"])

    def __iter__(self):
        return self

    def __next__(self):
        import jax
        step, built = self.step, {}

        def rows_of(index, size):
            rows = range(*index[0].indices(size))
            key = (rows.start, rows.stop, rows.step)
            if key not in built:
                built[key] = self.source.rows(self.seed, step, rows, self.length + 1)
            return built[key]

        leaves, treedef = jax.tree.flatten(self.spec, is_leaf=is_leaf)
        shardings = jax.tree.leaves(self.sharding)
        out = []
        for i, (leaf, sh) in enumerate(zip(leaves, shardings)):
            def local(index, i=i, leaf=leaf):
                tree = rows_of(index, leaf.shape[0])
                part = jax.tree.leaves(tree)[i] if len(leaves) > 1 else tree
                return np.asarray(part, leaf.dtype)[(slice(None),) + tuple(index[1:])]
            out.append(jax.make_array_from_callback(tuple(leaf.shape), sh, local))
        self.step += 1
        return jax.tree.unflatten(treedef, out)


def floor_gap_closed(initial: float, final: float, floor: float) -> float:
    """Fraction of the gap between the initial loss and the entropy floor that training closed."""
    return (initial - final) / max(initial - floor, 1e-9) if math.isfinite(final) else float("nan")
