"""Sharded inference: prefill, insert and generate over a KV cache, with continuous batching.

    engine = Engine(cfg)                                   # mesh, serving layout, weights
    done = engine.run([Request([5, 6, 7], max_new_tokens=8, sampling=Sampling(temperature=0.7))])

The engine's compiled calls (the prefill/insert/generate split of JetStream and MaxText's engine):

    prefill_batch(prompts, samplings) -> (entry: n prompts' caches [.., n, P, ..] + requests, first tokens [n])
    extend(cache, tokens, start, ...) -> (entry: one prompt whose first `start` positions are cached, first token)
    insert(entry, state, slots)       -> state with entry row r in slot slots[r]
    generate(state)                   -> (state, next token per slot [B] (-1: none yet), logits [B, V])

(each takes `params=` to serve other weights than the engine's own; `prefill` is `prefill_batch`
of one prompt).

Prompts are padded to the bucket P = the smallest power of two >= max(longest, min_bucket), capped at
the cache length S, and batched prompts to a power of two rows: one compilation per (rows, bucket);
causal attention keeps the padding out of the real positions. `extend` runs only a prompt's tail
after a cached prefix (`meshpar.serve.prefix`): the tail's tokens at positions start.. attend to the
cached ones, one compilation per tail bucket. `generate` compiles once and donates the decode state
(updated in place). Sampling settings are per-row traced arrays (`meshpar.serve.sampling`): changing
them never recompiles. `run` is continuous batching (`meshpar.serve.scheduler`): a request enters a
free slot as soon as one frees (end of sequence, its token budget, or a full cache), while the
other slots keep decoding.

Placement and layout: `meshpar.serve.placement`; the request loop: `meshpar.serve.scheduler`.

The model protocol (any nnx.Module can implement it; see `meshpar.models.decoder`):
    model.cache_spec(B, S) -> tree of meshpar.Leaf, each with a `cache_batch` and a `cache_length` axis
    model.decode(tokens [B, T], positions [B, T], cache) -> (logits [B, T, V], cache): writes the
        tokens' keys and values at their positions, each token attending to every cached position
        <= its own (so a prompt may be prefilled in pieces)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from meshpar.core import precision as precision_lib
from meshpar.core.errors import ConfigError
from meshpar.core.registry import default_model
from meshpar.core.sharding import model_spec
from meshpar.io.tokenizer import ByteTokenizer
from meshpar.serve.placement import Placement, cache_length
from meshpar.serve.programs import DecodePrograms
from meshpar.serve.requests import Completion, Request
from meshpar.serve.sampling import Sampling
from meshpar.serve.scheduler import run_all


def _check_length(request: Request, length: int) -> None:
    n = len(request.tokens)
    if n == 0:
        raise ConfigError("empty prompt: give at least one token")
    if n > length:
        raise ConfigError(
            f"prompt of {n} tokens is longer than the KV cache (serve.cache_length={length}); "
            "raise serve.cache_length or shorten the prompt"
        )


def _check_ids(request: Request, vocab: int) -> None:
    bad = [t for t in request.tokens if not 0 <= int(t) < vocab]
    if bad:
        raise ConfigError(f"prompt token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")


def check_request(request: Request, length: int, vocab: int) -> None:
    """One line naming what is wrong with a request for a cache of `length` positions."""
    _check_length(request, length)
    _check_ids(request, vocab)
    if request.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
    request.sampling.check(vocab)


def _tails(prompts: list, starts: list, length: int) -> np.ndarray:
    """Each prompt's tokens from its start, zero-padded to `length` -> [n, length] int32."""
    tail = np.zeros((len(prompts), length), np.int32)
    for r, (t, st) in enumerate(zip(prompts, starts)):
        tail[r, : len(t) - st] = t[st:]
    return tail


def _tail_rows(caches: list, prompts: list, starts: list, width: int) -> tuple:
    """n prompts extended from `starts` -> (caches, tails [rows, width], starts [rows], ends [rows]),
    rows = n up to a power of two, repeating the first."""
    pick = [r if r < len(prompts) else 0 for r in range(_pow2(len(prompts)))]
    tail = _tails([prompts[i] for i in pick], [starts[i] for i in pick], width)
    return (
        tuple(caches[i] for i in pick),
        tail,
        np.asarray([starts[i] for i in pick], np.int32),
        np.asarray([len(prompts[i]) for i in pick], np.int32),
    )


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _padded(prompts: list, width: int) -> tuple[np.ndarray, np.ndarray]:
    """n prompts -> (tokens [rows, width] zero-padded, lengths [rows]), rows = n up to a power of two,
    the rows beyond n repeating the first prompt."""
    rows = _pow2(len(prompts))
    tokens, lengths = np.zeros((rows, width), np.int32), np.zeros((rows,), np.int32)
    for r in range(rows):
        t = prompts[r if r < len(prompts) else 0]
        tokens[r, : len(t)], lengths[r] = t, len(t)
    return tokens, lengths


def sampling_rows(samplings: list, rows: int, vocab: int) -> dict:
    """Per row its sampling settings as host arrays, the rows beyond the given repeating the first
    (the same on every process of a multi-process server: host values, never one process's device arrays)."""
    arrays = [s.arrays(vocab) for s in samplings]
    arrays += [arrays[0]] * (rows - len(arrays))
    return {k: np.stack([np.asarray(a[k]) for a in arrays]) for k in arrays[0]}


def precheck(cfg, requests, model: Callable | None = None, byte_text: bool = False) -> int | None:
    """The checks that need no weights (run before loading any): prompt lengths, sampling ranges,
    and token ids against the vocabulary the model's config declares (`cfg.vocab` of the abstract
    model: `model.vocab`, the size preset, init_from's config.json); `byte_text`: some prompts are
    text as UTF-8 bytes: a byte the vocabulary lacks is said as bytes needing all 256, not as an id
    out of range (a missing checkpoint, which would set the vocabulary, is said first).
    -> that vocabulary (None: the model keeps no `cfg.vocab`; `check` has the logits' own once the
    model is placed)."""

    length = cache_length(cfg.serve, cfg.model.init_from)
    vocab = getattr(
        model_spec(model or default_model(cfg), precision_lib.get_policy(cfg.precision)).model_config, "vocab", None
    )
    vocab = vocab if isinstance(vocab, int) and vocab > 0 else None
    for r in requests:
        _check_length(r, length)
        if vocab:
            if byte_text and max(r.tokens, default=0) >= vocab:
                ByteTokenizer(vocab)  # a byte past a vocabulary under 256: say bytes need all 256
            _check_ids(r, vocab)
        r.sampling.check(vocab=None)
    return vocab


def _facts(part: str, names: str) -> tuple:
    """Properties reading each of `names` (space-separated) through the engine's attribute `part`."""
    return tuple(
        property(lambda self, n=n: getattr(getattr(self, part), n), doc=f"`{part}.{n}`") for n in names.split()
    )


class Engine:
    """Serve a model: its weights placed (`placement`, `Placement`: the keywords `model`, `weights`,
    `devices`, `info`, `device_memory` as there), the compiled calls over them (`programs`,
    `DecodePrograms`: `flush`, `ticks` as there) and their state (`decode_state`), and the host side here:
    padding to buckets, sampling rows, request checks, `run` (continuous batching, reading `cfg.serve`)."""

    def __init__(self, cfg, *, flush: bool = False, ticks: int | None = None, **placement):
        self.placement = Placement(cfg, **placement)  # model=, devices=, weights=, info=, device_memory=
        self.programs = DecodePrograms(
            self.placement, flush=flush, ticks=ticks, microbatches=cfg.pipeline.microbatches, loop=cfg.serve.decode_loop
        )
        self.decode_state = self.programs.state
        self.serve = cfg.serve
        self.decode_steps, self.decode_s = 0, 0.0  # set by `run` (meshpar.serve.scheduler)

    # facts of the placement, of the programs and of the decode state (`DecodeState`: its shapes, an empty
    # one, a cache tree of (rows, length), bytes per device), read through
    mesh, layout, policy, dtype, spec, stages, slots, vocab, length = _facts(
        "placement", "mesh layout policy dtype spec stages slots vocab length"
    )
    buckets, bucket, can_extend, cache_spec, weight_shapes, weights, source, notes = _facts(
        "placement", "buckets bucket can_extend cache_spec weight_shapes weights source notes"
    )
    state_shardings, traces, in_flight, ticks = _facts("programs", "state_shardings traces in_flight ticks")
    state_shapes, new_state, entry_spec, bytes_per_device = _facts(
        "decode_state", "shapes new entry_spec bytes_per_device"
    )

    precheck = staticmethod(precheck)  # the checks that need no weights (`precheck`)

    def check(self, request: Request) -> None:
        """One line naming what is wrong with a request."""
        check_request(request, self.length, self.vocab)

    def _weights(self, params):
        return self.weights if params is None else params

    def prefill_batch(self, prompts: list, samplings: list | None = None, params=None, length: int = 0):
        """n prompts (lists of ids) prefilled in one call, padded to the bucket of the longest (or of `length`)
        -> (entry of rows padded to a power of two, repeating the first, first tokens [n], their logits [n, V])."""
        samplings = samplings or [Sampling()] * len(prompts)
        for t, s in zip(prompts, samplings):
            self.check(Request(list(t), 1, s))
        tokens, lengths = _padded(prompts, self.bucket(max(length, *map(len, prompts))))
        entry, tok, last = self.programs.prefill(
            self._weights(params), tokens, lengths, sampling_rows(samplings, len(tokens), self.vocab)
        )
        return entry, tok[: len(prompts)], last[: len(prompts)]

    def prefill(self, tokens, true_length: int | None = None, sampling: Sampling | None = None, params=None):
        """One prompt (its ids, or ids padded with `true_length` the real count) -> (entry, its first
        token (a device scalar), the logits that chose it [V])."""
        tokens = list(np.asarray(tokens).reshape(-1))
        n = len(tokens) if true_length is None else int(true_length)
        entry, tok, last = self.prefill_batch([tokens[:n]], [sampling or Sampling()], params, length=len(tokens))
        return entry, tok[0], last[0]

    def extend(self, cache, tokens, start: int, sampling: Sampling | None = None, params=None):
        """A prompt whose first `start` positions `cache` ([.., 1, S, ..], e.g. `full(entry, r)` of a
        prompt with the same prefix) already holds -> (entry, first token, its logits [V]); only
        tokens[start:] are computed."""
        entry, tok, last = self.extend_batch([cache], [list(tokens)], [start], [sampling or Sampling()], params)
        return entry, tok[0], last[0]

    def extend_batch(self, caches: list, prompts: list, starts: list, samplings: list | None = None, params=None):
        """n prompts extended in one call: prompt r's first starts[r] positions are in caches[r]
        ([.., 1, S, ..]); their tails are padded to the bucket of the longest, the rows to a power of
        two (repeating the first) -> (entry [.., rows, S, ..], first tokens [n], their logits [n, V])."""
        samplings = samplings or [Sampling()] * len(prompts)
        for t, st, smp in zip(prompts, starts, samplings):
            self.check(Request(list(t), 1, smp))
            self.placement.check_extend(len(t), st)
        n, width = len(prompts), self.bucket(max(len(t) - st for t, st in zip(prompts, starts)))
        rows = _tail_rows(caches, prompts, starts, width)
        entry, tok, last = self.programs.extend(
            self._weights(params), *rows, sampling_rows(samplings[:n], len(rows[1]), self.vocab)
        )
        return entry, tok[:n], last[:n]

    def full(self, entry, row: int = 0):
        """Row `row` of an entry's cache as a whole-length cache [.., 1, S, ..] (for `extend`), waited
        for: several such programs in flight at once (they move rows by collectives) deadlocked in
        their rendezvous on XLA:CPU's fake devices under load (a chunked prefill takes one per prompt)."""
        return jax.block_until_ready(self.programs.full(entry["cache"], np.int32(row)))

    def insert(self, entry, state, slot):
        """-> `state` with entry row r in slot `slot[r]` (an int: row 0; -1 drops a row); `state` is
        donated (updated in place)."""
        slots = np.atleast_1d(np.asarray(slot, np.int32))
        rows = entry["length"].shape[0]
        slots = np.concatenate([slots, np.full((rows - len(slots),), -1, np.int32)])
        return self.programs.insert(entry, state, slots)

    def generate(self, state, params=None):
        """-> (state, next token per slot [B], logits [B, V]); `state` is donated. With a pipeline in
        flight a slot whose token is still in the pipe gets -1 (`meshpar.serve.in_flight`)."""
        return self.programs.generate(self._weights(params), state)

    def logprobs(self, logits, tokens) -> tuple:
        """logits [n, V] (as prefill, extend or generate returned them), tokens [n] -> host arrays: each
        token's log probability [n], the most likely ids [n, K] and theirs [n, K] (`sampling.logprobs`)."""
        logits = logits.reshape(-1, logits.shape[-1])
        return tuple(np.asarray(a) for a in self.programs.logprobs(logits, np.asarray(tokens, np.int32).reshape(-1)))

    def warmup(self, requests=()) -> None:
        """Compile prefill/insert for the buckets of `requests` and generate, outside any timing."""
        state = self.new_state()
        for p in sorted({self.bucket(len(r.tokens)) for r in requests if r.tokens}):
            entry, _, _ = self.prefill([0] * p)
            state = self.insert(entry, state, 0)
        jax.block_until_ready(self.generate(state))

    def run(self, requests: list[Request], on_token: Callable[[int, int], None] | None = None) -> list[Completion]:
        """Continuous batching to each request's end; `on_token(request index, token)` streams (`scheduler`)."""
        return run_all(self, requests, on_token)

    def compiled_generate(self, options: dict | None = None):
        """The compiled decode step (HLO text, memory_analysis) without running it (`DecodePrograms`),
        with XLA compiler `options`."""
        return self.programs.compiled_generate(options)
