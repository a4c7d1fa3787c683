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

import collections
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from meshpar.core import precision as precision_lib
from meshpar.core.batch import is_leaf
from meshpar.core.errors import ConfigError
from meshpar.core.platform import compiling_for, of_mesh
from meshpar.core.rules import for_rows, use_layout
from meshpar.serve import in_flight
from meshpar.serve.batching import Completion, Request
from meshpar.serve.placement import Placement, zeros
from meshpar.serve.sampling import ROW_KEYS, Sampling, adjust, logprobs, position_key, sample


def _check_length(request: Request, length: int) -> None:
    n = len(request.tokens)
    if n == 0:
        raise ConfigError("empty prompt: give at least one token")
    if n > length:
        raise ConfigError(f"prompt of {n} tokens is longer than the KV cache (serve.cache_length={length}); "
                          "raise serve.cache_length or shorten the prompt")


def _check_ids(request: Request, vocab: int) -> None:
    bad = [t for t in request.tokens if not 0 <= int(t) < vocab]
    if bad:
        raise ConfigError(f"prompt token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")


def _tails(prompts: list, starts: list, length: int) -> np.ndarray:
    """Each prompt's tokens from its start, zero-padded to `length` -> [n, length] int32."""
    tail = np.zeros((len(prompts), length), np.int32)
    for r, (t, st) in enumerate(zip(prompts, starts)):
        tail[r, :len(t) - st] = t[st:]
    return tail


def _stack(spec, caches: list):
    """Caches [.., 1, S, ..] (tree of `spec`'s leaves) -> one [.., n, S, ..] along each's cache_batch."""
    if len(caches) == 1:
        return caches[0]
    return jax.tree.map(lambda leaf, *c: jnp.concatenate(c, axis=leaf.axes.index("cache_batch")), spec, *caches,
                        is_leaf=is_leaf)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class Compiled(Placement):
    """The jitted bodies of prefill, extend, insert and generate over a placed model (`Engine` calls
    them with host inputs); `traces` counts their compilations per name."""

    def __init__(self, cfg, *, model: Callable | None = None, devices=None, weights=None,
                 info: Callable[[str], None] = print, flush: bool = False, ticks: int | None = None,
                 device_memory: int | None = None):
        super().__init__(cfg, model=model, devices=devices, weights=weights, info=info, device_memory=device_memory)
        rep = NamedSharding(self.mesh, P())
        # mesh.pipeline > 1: one group of slots per stage in flight across generate calls, `ticks` (1..P,
        # default P) ticks per call; `flush`: each call fills and drains the pipe instead (for comparison)
        # (`meshpar.serve.in_flight`)
        self.in_flight = self.stages > 1 and not flush
        self.ticks = ticks or self.stages
        if not 1 <= self.ticks <= self.stages:
            raise ConfigError(f"ticks={ticks}: a decode call runs 1 to mesh.pipeline={self.stages} ticks")
        if self.in_flight:
            self.state_shardings = {**self.state_shardings, **in_flight.shardings(self.mesh)}
        self.traces = collections.Counter()      # compilations: one trace per compiled shape
        self._empty = None
        self._specs = {}
        self._prefill = jax.jit(self._prefill_fn, out_shardings=(None, rep, rep))
        self._extend = jax.jit(self._extend_fn, out_shardings=(None, rep, rep))
        self._full = jax.jit(self._full_fn)
        self._logprobs = jax.jit(logprobs)
        self._insert = jax.jit(self._insert_fn, out_shardings=self.state_shardings, donate_argnums=(1,))
        self._generate = jax.jit(self._generate_fn, in_shardings=(self.weight_shardings, self.state_shardings),
                                 out_shardings=(self.state_shardings, rep, rep), donate_argnums=(1,))

    def state_shapes(self) -> dict:
        """The decode state: the cache [.., B, S, ..] and per slot its position (where its last token
        goes), last token and sampling settings; with a pipeline in flight also the activations in
        flight, the tick count and per slot the tick it was filled at (`meshpar.serve.in_flight`)."""
        b = self.slots
        sds = jax.ShapeDtypeStruct
        rows = jax.eval_shape(lambda: Sampling().arrays(self.vocab))               # one row's settings
        shapes = {"cache": jax.tree.map(lambda leaf: sds(leaf.shape, leaf.dtype), self.cache_spec, is_leaf=is_leaf),
                  "pos": sds((b,), jnp.int32), "token": sds((b,), jnp.int32),
                  **{k: sds((b, *rows[k].shape), rows[k].dtype) for k in ROW_KEYS},
                  "counts": sds((b, self.vocab), jnp.int32)}               # tokens generated so far (penalties)
        if self.in_flight:
            shapes.update(in_flight.state_shapes(self))
        return jax.tree.map(lambda a, sh: sds(a.shape, a.dtype, sharding=sh), shapes, self.state_shardings)

    def new_state(self) -> dict:
        """An empty decode state, born in its shardings (all slots free)."""
        if self._empty is None:
            fill = {"top_k": self.vocab, "top_p": 1}
            self._empty = jax.jit(lambda: {k: jax.tree.map(lambda a: jnp.full(a.shape, fill.get(k, 0), a.dtype), v)
                                           for k, v in self.state_shapes().items()},
                                  out_shardings=self.state_shardings)
        return self._empty()

    def entry_spec(self, rows: int, length: int):
        """The cache tree of `rows` prompts of `length` positions (tree of Leaf)."""
        if (rows, length) not in self._specs:
            with precision_lib.use_policy(self.policy):
                self._specs[rows, length] = self.abstract.cache_spec(rows, length)
        return self._specs[rows, length]

    def _decode(self, weights, tokens, positions, cache):
        """The model's decode (under the active layout), or with `mesh.pipeline` > 1 the same through
        the stages in `pipeline.microbatches` microbatches (`meshpar.parallel.pipeline_decode`)."""
        if self.stages == 1:
            return self._model(weights).decode(tokens, positions, cache)
        from meshpar.core.rules import active_layout
        from meshpar.parallel import pipeline_decode
        return pipeline_decode.decode(self.spec, active_layout(), self.policy, weights, tokens, positions, cache,
                                      self.cache_spec, self.cfg.pipeline.microbatches)

    def _first(self, weights, tokens, positions, cache, last_at, samp):
        """Decode `tokens` [n, T] at `positions` into `cache`; sample each row's token after index
        `last_at` [n] -> (entry, first tokens [n], their logits [n, V])."""
        with use_layout(for_rows(self.layout, tokens.shape[0])), precision_lib.use_policy(self.policy):
            logits, cache = self._decode(weights, tokens, positions, cache)
        last = jnp.take_along_axis(logits, last_at[:, None, None], axis=1)[:, 0].astype(jnp.float32)   # [n, V]
        at = jnp.take_along_axis(positions, last_at[:, None], axis=1)[:, 0]
        keys = jax.vmap(position_key)(samp["key"], at)
        tok = sample(adjust(last, samp), samp["temp"], samp["top_k"], samp["top_p"], keys)
        return {"cache": cache, "length": at + 1, "token": tok, **samp}, tok, last

    def _prefill_fn(self, weights, tokens, lengths, samp):
        """tokens [n, P] (row r's prompt in its first lengths[r] entries) -> `_first`'s triple."""
        self.traces["prefill"] += 1
        n, p = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (n, p))
        return self._first(weights, tokens, positions, zeros(self.entry_spec(n, p)), lengths - 1, samp)

    def _extend_fn(self, weights, caches, tokens, start, length, samp):
        """n caches [.., 1, S, ..], cache r holding a prompt's first start[r] positions, stacked here
        (inside the one program: no eager op of its own on the devices), the prompts' tails tokens
        [n, T] from there (their true ends: `length` [n]) -> `_first`'s triple."""
        self.traces["extend"] += 1
        cache = _stack(self.entry_spec(1, self.length), list(caches))
        positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        return self._first(weights, tokens, positions, cache, length - 1 - start, samp)

    def _full_fn(self, cache, row):
        """Row `row` of a prefill's cache [.., n, P, ..], padded to [.., 1, S, ..] (a prefix to keep)."""
        self.traces["full"] += 1

        def one(leaf, c):
            bd, ld = leaf.axes.index("cache_batch"), leaf.axes.index("cache_length")
            c = jax.lax.dynamic_index_in_dim(c, row, bd, keepdims=True)
            pad = [(0, 0)] * c.ndim
            pad[ld] = (0, self.length - c.shape[ld])
            return jnp.pad(c, pad)
        return jax.tree.map(one, self.entry_spec(1, self.length), cache, is_leaf=is_leaf)

    def _insert_fn(self, entry, state, slots):
        """Write entry row r into slot slots[r] (a slot of -1: a padding row, dropped): its cache rows
        (padded to S), position, token and sampling settings."""
        self.traces["insert"] += 1
        hit = slots[:, None] == jnp.arange(self.slots)[None, :]                          # [n, B]
        has, row = jnp.any(hit, axis=0), jnp.argmax(hit, axis=0)                         # [B] each

        def take(e, c, bd):
            """entry rows [n, ...] (batch at bd) -> per slot its row, where it has one, else c."""
            mask = has.reshape([-1 if d == bd else 1 for d in range(c.ndim)])
            return jnp.where(mask, jnp.take(e, row, axis=bd).astype(c.dtype), c)

        def put(leaf, e, c):
            bd, ld = leaf.axes.index("cache_batch"), leaf.axes.index("cache_length")
            pad = [(0, 0)] * e.ndim
            pad[ld] = (0, c.shape[ld] - e.shape[ld])
            return take(jnp.pad(e, pad), c, bd)

        new = {**state, "cache": jax.tree.map(put, self.cache_spec, entry["cache"], state["cache"], is_leaf=is_leaf),
               "pos": take(entry["length"], state["pos"], 0)}
        for k in ("token", *ROW_KEYS):
            new[k] = take(entry[k], state[k], 0)
        first = jax.nn.one_hot(entry["token"], self.vocab, dtype=jnp.int32)                  # the first token, counted
        new["counts"] = take(first, state["counts"], 0)
        if self.in_flight:          # the slot's tokens still in the pipe are the old request's: stale from now on
            new.update(in_flight.inserted(state, has))
        return new

    def _generate_fn(self, weights, state):
        """One token for every slot: each slot's last token at its position -> the next one."""
        self.traces["generate"] += 1
        if self.in_flight:
            return in_flight.generate(self, weights, state)
        pos = jnp.minimum(state["pos"], self.length - 1)     # a full slot is never read back (run frees it)
        with use_layout(self.layout), precision_lib.use_policy(self.policy):
            logits, cache = self._decode(weights, state["token"][:, None], pos[:, None], state["cache"])
        logits = logits[:, 0].astype(jnp.float32)                                       # [B, V]
        keys = jax.vmap(position_key)(state["key"], pos)
        nxt = sample(adjust(logits, state, state["counts"]), state["temp"], state["top_k"], state["top_p"], keys)
        counts = state["counts"].at[jnp.arange(self.slots), nxt].add(1)
        return {**state, "cache": cache, "token": nxt, "pos": state["pos"] + 1, "counts": counts}, nxt, logits


def precheck(cfg, requests, model: Callable | None = None) -> int | None:
    """The checks that need no weights (run before loading any): prompt lengths, sampling ranges,
    and token ids against the vocabulary the model's config declares (`cfg.vocab` of the abstract
    model: `model.vocab`, the size preset, init_from's config.json). -> that vocabulary (None: the
    model keeps no `cfg.vocab`; `check` has the logits' own once the model is placed)."""
    from meshpar.core.registry import default_model
    from meshpar.core.sharding import model_spec
    from meshpar.serve.placement import cache_length
    length = cache_length(cfg)
    vocab = getattr(model_spec(model or default_model(cfg), precision_lib.get_policy(cfg.precision)).cfg, "vocab", None)
    vocab = vocab if isinstance(vocab, int) and vocab > 0 else None
    for r in requests:
        _check_length(r, length)
        if vocab:
            _check_ids(r, vocab)
        r.sampling.check(vocab=None)
    return vocab


class Engine(Compiled):
    """Serve a model on a mesh: the weights placed (`Placement`), then prefill / extend / insert /
    generate, each compiled once per shape (`Compiled`), and `run`: continuous batching over them.

    `model`, `weights`: as `Placement` (default: `cfg.model.name`; the newest checkpoint of
    `cfg.checkpoint.dir`, else `model.init_from`, else a fresh init)."""

    def bytes_per_device(self) -> dict:
        """`Placement.bytes_per_device`, and the slots' own state beside the cache (positions, tokens,
        sampling settings, the penalties' token counts)."""
        from meshpar.core.sharding import bytes_per_device
        rest = [a for k, v in self.state_shapes().items() if k != "cache" for a in jax.tree.leaves(v)]
        return {**super().bytes_per_device(),
                "slots": int(sum(bytes_per_device(a.shape, a.dtype, a.sharding) for a in rest))}

    precheck = staticmethod(precheck)          # the checks that need no weights (`precheck`)

    def check(self, request: Request) -> None:
        """One line naming what is wrong with a request."""
        _check_length(request, self.length)
        _check_ids(request, self.vocab)
        if request.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        request.sampling.check(self.vocab)

    def bucket(self, n: int) -> int:
        return next(p for p in self.buckets if p >= n)

    def _weights(self, params):
        return self.weights if params is None else params

    def _samplings(self, samplings, rows: int) -> dict:
        """Per row its sampling settings as host arrays (the same on every process of a multi-process
        server: host values, never one process's device arrays)."""
        arrays = [s.arrays(self.vocab) for s in samplings]
        arrays += [arrays[0]] * (rows - len(arrays))
        return {k: np.stack([np.asarray(a[k]) for a in arrays]) for k in arrays[0]}

    def prefill_batch(self, prompts: list, samplings: list | None = None, params=None, length: int = 0):
        """n prompts (lists of ids) prefilled in one call, padded to the bucket of the longest (or of
        `length`) -> (entry of rows padded to a power of two, first tokens [n] (device), their logits
        [n, V]). Rows beyond n repeat the first prompt."""
        samplings = samplings or [Sampling()] * len(prompts)
        for t, s in zip(prompts, samplings):
            self.check(Request(list(t), 1, s))
        rows = _pow2(len(prompts))
        tokens = np.zeros((rows, self.bucket(max(length, *map(len, prompts)))), np.int32)
        lengths = np.full((rows,), len(prompts[0]), np.int32)
        for r in range(rows):
            t = prompts[r if r < len(prompts) else 0]
            tokens[r, :len(t)], lengths[r] = t, len(t)
        entry, tok, last = self._prefill(self._weights(params), tokens, lengths,
                                         self._samplings(samplings, rows))
        return entry, tok[:len(prompts)], last[:len(prompts)]

    def prefill(self, tokens, true_length: int | None = None, sampling: Sampling | None = None, params=None):
        """One prompt -> (entry, its first token (a device scalar), the logits that chose it [V]).

        `tokens`: the prompt's ids, or ids already padded with `true_length` the real count."""
        tokens = list(np.asarray(tokens).reshape(-1))
        n = len(tokens) if true_length is None else int(true_length)
        entry, tok, last = self.prefill_batch([tokens[:n]], [sampling or Sampling()], params, length=len(tokens))
        return entry, tok[0], last[0]

    def can_extend(self, n: int, start: int) -> bool:
        """Whether a prompt of n tokens can be prefilled from position `start` (its tail's bucket is
        shorter than the cache: a bucket as long as the cache is a prefill from position 0)."""
        return 0 < start < n and self.bucket(n - start) < self.length

    def extend(self, cache, tokens, start: int, sampling: Sampling | None = None, params=None):
        """A prompt whose first `start` positions `cache` ([.., 1, S, ..], e.g. `full(entry, r)` of a
        prompt with the same prefix) already holds -> (entry, first token, its logits [V]); only
        tokens[start:] are computed."""
        tokens = list(tokens)
        request = Request(tokens, 1, sampling or Sampling())
        self.check(request)
        if not self.can_extend(len(tokens), start):
            raise ConfigError(f"cannot extend a prompt of {len(tokens)} tokens from position {start}")
        entry, tok, last = self.extend_batch([cache], [tokens], [start], [request.sampling], params)
        return entry, tok[0], last[0]

    def extend_batch(self, caches: list, prompts: list, starts: list, samplings: list | None = None, params=None):
        """n prompts extended in one call: prompt r's first starts[r] positions are in caches[r]
        ([.., 1, S, ..]); their tails are padded to the bucket of the longest, the rows to a power of
        two (repeating the first) -> (entry [.., rows, S, ..], first tokens [n], their logits [n, V])."""
        samplings = samplings or [Sampling()] * len(prompts)
        for t, st, smp in zip(prompts, starts, samplings):
            self.check(Request(list(t), 1, smp))
            if not self.can_extend(len(t), st):
                raise ConfigError(f"cannot extend a prompt of {len(t)} tokens from position {st}")
        n = len(prompts)
        pick = [r if r < n else 0 for r in range(_pow2(n))]
        tail = _tails([prompts[i] for i in pick], [starts[i] for i in pick],
                      self.bucket(max(len(t) - st for t, st in zip(prompts, starts))))
        entry, tok, last = self._extend(self._weights(params), tuple(caches[i] for i in pick), tail, np.asarray([starts[i] for i in pick], np.int32),
                                        np.asarray([len(prompts[i]) for i in pick], np.int32),
                                        self._samplings([samplings[i] for i in pick], len(pick)))
        return entry, tok[:n], last[:n]

    def full(self, entry, row: int = 0):
        """Row `row` of an entry's cache as a whole-length cache [.., 1, S, ..] (for `extend`), waited
        for: taking a row of a cache split over the devices moves it by collectives, and on XLA:CPU's
        fake devices several such programs in flight at once, under load, deadlocked in their
        rendezvous (a chunked prefill takes one per prompt of a tick)."""
        return jax.block_until_ready(self._full(entry["cache"], np.int32(row)))

    def insert(self, entry, state, slot):
        """-> `state` with entry row r in slot `slot[r]` (an int: row 0; -1 drops a row); `state` is
        donated (updated in place)."""
        slots = np.atleast_1d(np.asarray(slot, np.int32))
        rows = entry["length"].shape[0]
        slots = np.concatenate([slots, np.full((rows - len(slots),), -1, np.int32)])
        return self._insert(entry, state, slots)

    def generate(self, state, params=None):
        """-> (state, next token per slot [B], logits [B, V]); `state` is donated. With a pipeline in
        flight a slot whose token is still in the pipe gets -1: while the pipe fills, after a refill,
        and (with fewer than P ticks per call) the groups that did not leave the last stage."""
        return self._generate(self._weights(params), state)

    def logprobs(self, logits, tokens) -> tuple:
        """logits [n, V] (as prefill, extend or generate returned them), tokens [n] -> host arrays: each
        token's log probability [n], the most likely ids [n, K] and theirs [n, K] (`sampling.logprobs`)."""
        logits = logits.reshape(-1, logits.shape[-1])
        return tuple(np.asarray(a) for a in self._logprobs(logits, np.asarray(tokens, np.int32).reshape(-1)))

    def warmup(self, requests=()) -> None:
        """Compile prefill/insert for the buckets of `requests` and generate, outside any timing."""
        state = self.new_state()
        for p in sorted({self.bucket(len(r.tokens)) for r in requests if r.tokens}):
            entry, _, _ = self.prefill([0] * p)
            state = self.insert(entry, state, 0)
        jax.block_until_ready(self.generate(state))

    def run(self, requests: list[Request], on_token: Callable[[int, int], None] | None = None) -> list[Completion]:
        """Continuous batching: every request decoded to its end; `on_token(request index, token)`
        streams (`meshpar.serve.scheduler`)."""
        from meshpar.serve.scheduler import run_all
        return run_all(self, requests, on_token)

    def compiled_generate(self):
        """The compiled decode step (HLO text, memory_analysis) without running it, for this mesh's
        platform (a deviceless target's GPU or TPU too)."""
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.weights)
        with compiling_for(of_mesh(self.mesh)):
            return self._generate.lower(shapes, self.state_shapes()).compile()
