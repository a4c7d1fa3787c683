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

The contract is one thing: `rows` gets the `length` its `batch_spec` was given (`batch.length`), and
returns for every leaf exactly the spec's shape with `len(rows)` rows (the built-in language-model
sources declare [B, T+1], inputs and shifted targets, and ask themselves for T+1 tokens). What a
source returns is checked against its spec (keys, shapes, dtypes) before it reaches the devices,
first once before the step compiles: one line naming the leaf.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from meshpar.core.batch import Leaf, is_leaf, lm_batch_spec
from meshpar.core.config import BatchConfig, DataConfig, EvalConfig
from meshpar.core.errors import ConfigError


class LMSource:
    """A token source for the built-in LM loss: `rows(seed, step, rows, length)` -> tokens [R, length+1],
    the rows of `lm_batch_spec(global_size, length)`, from `sample(seed, step, rows, n)` -> [R, n]."""

    def batch_spec(self, global_size: int, length: int) -> Leaf:
        return lm_batch_spec(global_size, length)

    def rows(self, seed: int, step: int, rows: range, length: int) -> np.ndarray:
        return self.sample(seed, step, rows, length + 1)


def check_rows(spec, tree, n: int, length: int) -> None:
    """What a source's `rows(..., length)` returned for `n` rows against its batch spec: the same
    keys, each leaf [n, *spec.shape[1:]] and of the declared kind of dtype (ints for ints, floats for
    floats); one line naming the leaf otherwise."""
    import jax

    leaves, treedef = jax.tree.flatten(spec, is_leaf=is_leaf)
    try:
        got = treedef.flatten_up_to(tree)
    except (ValueError, TypeError):
        have = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
        want = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
        raise ConfigError(
            f"the data source's rows() returned {have}; its batch_spec declares {want}: return one "
            "numpy array per batch leaf"
        ) from None
    kinds = {"i": "int", "u": "int", "f": "float", "b": "bool", "c": "complex"}
    for (path, leaf), array in zip(jax.tree_util.tree_leaves_with_path(spec, is_leaf=is_leaf), got):
        name = jax.tree_util.keystr(path) or "batch"
        want, shape = (n, *leaf.shape[1:]), tuple(np.shape(array))
        if shape != want:
            raise ConfigError(
                f"batch leaf {name}: the data source's rows(rows={n}, length={length}) returned shape "
                f"{shape}, its batch_spec declares {want} (rows get the length batch_spec gets)"
            )
        have, declared = np.asarray(array).dtype, np.dtype(leaf.dtype)
        if kinds.get(have.kind) != kinds.get(declared.kind):
            raise ConfigError(
                f"batch leaf {name}: the data source's rows() returned {have}, its batch_spec declares {declared}"
            )


def _row_rng(seed: int, step: int, row: int) -> np.random.Generator:
    return np.random.default_rng([seed, step, row])


class MarkovLanguage(LMSource):
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
        for _ in range(iters):  # lazy chain 1/2 (I + P): same stationary law, no periodicity trouble
            nxt = np.zeros_like(pi)
            np.add.at(nxt, self.succ, pi[:, None] * self.probs)
            pi = 0.5 * pi + 0.5 * nxt
        return pi / pi.sum()

    @property
    def entropy_rate(self) -> float:
        """Nats per token: the cross-entropy floor of a perfect model (ignoring the first token)."""
        h = -np.sum(self.probs * np.log(np.maximum(self.probs, 1e-30)), axis=1)
        return float(np.sum(self.stationary * h))

    def sample(self, seed: int, step: int, rows: range, length: int) -> np.ndarray:
        """Token rows [len(rows), length]; row r of step s is the same on every process."""
        u = np.stack([_row_rng(seed, step, r).random(length) for r in rows])  # [R, L]
        out = np.empty((len(rows), length), np.int32)
        cdf_pi = np.cumsum(self.stationary)
        out[:, 0] = np.minimum(np.searchsorted(cdf_pi, u[:, 0]), self.vocab - 1)
        for t in range(1, length):
            prev = out[:, t - 1]
            k = (u[:, t, None] > self.cum[prev]).sum(axis=1)
            out[:, t] = self.succ[prev, np.minimum(k, self.succ.shape[1] - 1)]
        return out


def documents_of(starts: np.ndarray, offsets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions [R, n] of the windows at `offsets` [R] of a stream whose documents
    begin at `starts` (sorted, starting with 0): documents numbered from 0 in each window, positions
    counted from each document's first token in the window."""
    at = offsets[:, None] + np.arange(n)[None, :]  # [R, n]
    doc = np.searchsorted(starts, at, side="right") - 1
    first = np.maximum(starts[doc], offsets[:, None])
    return (doc - doc[:, :1]).astype(np.int32), (at - first).astype(np.int32)


def eos_starts(tokens: np.ndarray, eos_id: int, chunk: int = 1 << 24) -> np.ndarray:
    """Document starts of a stream: 0 and every position after an `eos_id` (in chunks of `chunk`)."""
    ends = [np.flatnonzero(tokens[i : i + chunk] == eos_id) + i + 1 for i in range(0, len(tokens), chunk)]
    after = np.concatenate([np.zeros(1, np.int64), *ends]) if ends else np.zeros(1, np.int64)
    return np.unique(after[after < max(len(tokens), 1)])


class _Windows(LMSource):
    """Random fixed-length windows of a flat token array; with document `starts` (sorted offsets, 0
    first), rows are packed documents: {"tokens", "segment_ids", "positions"}."""

    tokens: np.ndarray
    starts: np.ndarray | None = None
    entropy_rate = None
    what = "data.path"

    def batch_spec(self, global_size: int, length: int):
        return lm_batch_spec(global_size, length, documents=self.starts is not None)

    def rows(self, seed: int, step: int, rows: range, length: int):
        offsets = self._offsets(seed, step, rows, length + 1)
        tokens = self._windows(offsets, length + 1)
        if self.starts is None:
            return tokens
        seg, pos = documents_of(self.starts, offsets, length + 1)
        return {"tokens": tokens, "segment_ids": seg, "positions": pos}

    def _offsets(self, seed: int, step: int, rows: range, length: int) -> np.ndarray:
        n = len(self.tokens)
        if n <= length:
            raise ConfigError(f"{self.what} holds {n} tokens, fewer than batch.length+1={length}")
        return np.array([int(_row_rng(seed, step, r).integers(0, n - length)) for r in rows], np.int64)

    def _windows(self, offsets: np.ndarray, length: int) -> np.ndarray:
        out = np.empty((len(offsets), length), np.int32)
        for i, start in enumerate(offsets):
            out[i] = self.tokens[start : start + length]
        return out

    def sample(self, seed: int, step: int, rows: range, length: int) -> np.ndarray:
        """Windows [len(rows), length] at random starts."""
        return self._windows(self._offsets(seed, step, rows, length), length)

    def part(self, lo: int, hi: int, what: str) -> Span:
        """Tokens lo..hi-1 as a source of their own (document starts kept, shifted)."""
        starts = None
        if self.starts is not None:
            inside = self.starts[(self.starts >= lo) & (self.starts < hi)] - lo
            starts = np.unique(np.concatenate([np.zeros(1, np.int64), inside]))
        return Span(self.tokens[lo:hi], what, starts)


class TokenFile(_Windows):
    """A flat binary file of token ids (`data.dtype`), memory-mapped. The whole file is checked once
    against the vocabulary, in chunks of CHUNK tokens (one vectorised max per chunk), so a bad id
    anywhere stops the run at start, naming its position, instead of at some later step."""

    CHUNK = 1 << 24

    def __init__(self, path: str, dtype: str, vocab: int, eos_id: int | None = None):
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"data.path '{path}' is not a file")
        dt = np.dtype(dtype)
        if p.stat().st_size % dt.itemsize:
            raise ConfigError(
                f"data.path '{path}' has {p.stat().st_size} bytes, not a whole number of "
                f"{dtype} tokens; is data.dtype right?"
            )
        self.tokens = np.memmap(p, dtype=dt, mode="r") if p.stat().st_size else np.zeros(0, dt)
        for start in range(0, len(self.tokens), self.CHUNK):
            chunk = self.tokens[start : start + self.CHUNK]
            if int(chunk.max()) >= vocab:
                at = start + int(np.argmax(chunk >= vocab))
                raise ConfigError(
                    f"data.path '{path}' holds token id {int(self.tokens[at])} >= model.vocab={vocab} "
                    f"at position {at}; raise model.vocab or fix the file"
                )
        if eos_id is not None:
            if not 0 <= eos_id < vocab:
                raise ConfigError(f"data.eos_id={eos_id} is not a token id of model.vocab={vocab}")
            self.starts = eos_starts(self.tokens, eos_id, self.CHUNK)


class TextFiles(_Windows):
    """Byte tokens of a text file, or of a folder's files end to end; with `documents`, each file is
    one document."""

    def __init__(self, path: str, vocab: int, documents: bool = False):
        if vocab < 256:
            raise ConfigError(f"data.kind=text uses byte tokens 0..255 and needs model.vocab >= 256, got {vocab}")
        p = Path(path)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        if not files or not files[0].exists():
            raise ConfigError(f"data.path '{path}' has no text files")
        blobs = [f.read_bytes() for f in files]
        self.tokens = np.frombuffer(b"".join(blobs), dtype=np.uint8)
        if documents:
            sizes = np.cumsum([0] + [len(b) for b in blobs[:-1]])
            self.starts = np.unique(sizes[sizes < max(len(self.tokens), 1)])


class Span(_Windows):
    """Windows of one part of another window source's tokens (a train / held-out split)."""

    def __init__(self, tokens: np.ndarray, what: str, starts: np.ndarray | None = None):
        self.tokens, self.what, self.starts = tokens, what, starts


# Evaluation batches are those of steps EVAL_STEP, EVAL_STEP + 1, ...: batch s is a pure function of
# (seed, s, row), and no training run reaches step 2**62, so a source keyed by the step (the
# synthetic language, a user source) gives an evaluation stream disjoint from every training batch.
EVAL_STEP = 1 << 62


def _file_source(kind: str, path: str, data: DataConfig, vocab: int):
    if kind == "text" and data.tokenizer:  # documents tokenized, packed with EOS between
        from meshpar.io.tokenizer import packed_text  # local: the tokenizers library loads only for text

        tokens, starts = packed_text(path, data.tokenizer, vocab)
        return Span(tokens, f"data.path '{path}' (tokenized)", starts if data.documents else None)
    if kind == "tokens":
        return TokenFile(path, data.dtype, vocab, data.eos_id if data.documents else None)
    return TextFiles(path, vocab, documents=data.documents)


def packs_documents(d: DataConfig) -> bool:
    """Whether `cfg.data`'s built-in source yields packed documents (`lm_batch_spec(documents=True)`)."""
    return d.documents and (d.kind == "text" or (d.kind == "tokens" and d.eos_id is not None))


def _split(source, holdout: float, length: int):
    """Token/text data without `eval.path`: the last `eval.holdout` of the tokens is held out."""
    n = len(source.tokens)
    cut = int(round(n * (1.0 - holdout)))
    need = length + 2
    if cut < need or n - cut < need:
        raise ConfigError(
            f"eval.holdout={holdout} splits data.path ({n} tokens) into {cut} training "
            f"and {n - cut} held-out tokens; each part needs more than batch.length+1="
            f"{length + 1}: change eval.holdout or give eval.path"
        )
    return (
        source.part(0, cut, f"the training part of data.path (1 - eval.holdout={holdout})"),
        source.part(cut, n, f"the held-out part of data.path (eval.holdout={holdout})"),
    )


def make_source(d: DataConfig, batch: BatchConfig, evaluation: EvalConfig, vocab: int):
    """The training source of `cfg.data`. With evaluation on (`cfg.eval.every` > 0), token/text data
    without `eval.path` trains on the first 1 - `eval.holdout` of its tokens only (each part holding
    more than `cfg.batch.length` + 1 tokens)."""
    if d.kind == "synthetic":
        return MarkovLanguage(vocab, d.branching, d.seed)
    source = _file_source(d.kind, d.path, d, vocab)
    if evaluation.every and not evaluation.path:
        return _split(source, evaluation.holdout, batch.length)[0]
    return source


def make_eval_source(d: DataConfig, batch: BatchConfig, evaluation: EvalConfig, vocab: int | None, train_source):
    """The held-out source: `eval.path` (same kind as `data.kind`), the held-out tail of token/text
    data, or for the synthetic language and user sources the training source itself, read at steps
    from EVAL_STEP on (disjoint from training)."""
    if d.kind in ("tokens", "text"):
        if evaluation.path:
            return _file_source(d.kind, evaluation.path, d, vocab)
        return _split(_file_source(d.kind, d.path, d, vocab), evaluation.holdout, batch.length)[1]
    return train_source


def floor_gap_closed(initial: float, final: float, floor: float) -> float:
    """Fraction of the gap between the initial loss and the entropy floor that training closed."""
    return (initial - final) / max(initial - floor, 1e-9) if math.isfinite(final) else float("nan")
