"""Sharded inference: prefill, insert and generate over a KV cache, with continuous batching.

    engine = Engine(cfg)                                   # mesh, serving layout, weights
    done = engine.run([Request([5, 6, 7], max_new_tokens=8, sampling=Sampling(temperature=0.7))])

The engine's three calls (the prefill/insert/generate split of JetStream and MaxText's engine):

    prefill(tokens, true length, sampling)  -> (entry: a cache of P positions + the request, first token)
    insert(entry, state, slot)              -> state with the request in `slot`
    generate(state)                         -> (state, next token per slot [B], logits [B, V])

(each takes `params=` to serve other weights than the engine's own).

A prompt of n tokens is padded to the bucket P = the smallest power of two >= max(n, min_bucket),
capped at the cache length S: one compilation per bucket; causal attention makes the padding
invisible to the n real positions. `generate` compiles once and donates the decode state (updated
in place). Sampling settings are per-slot traced arrays (`meshpar.serve.sampling`): changing them never
recompiles. `run` is continuous batching: a request enters a free slot as soon as one frees (end
of sequence, its token budget, or a full cache), while the other slots keep decoding.

Placement and layout: `meshpar.serve.placement`; the request loop: `meshpar.serve.batching`.

The model protocol (any nnx.Module can implement it; see `meshpar.models.decoder`):
    model.cache_spec(B, S) -> tree of meshpar.Leaf, each with a `cache_batch` and a `cache_length` axis
    model.decode(tokens [B, T], positions [B, T], cache) -> (logits [B, T, V], cache)
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from meshpar.core import precision as precision_lib
from meshpar.core.batch import is_leaf
from meshpar.core.errors import ConfigError
from meshpar.core.rules import Layout, table, use_layout
from meshpar.serve.batching import Completion, Request, continuous_batching
from meshpar.serve.placement import Placement, zeros
from meshpar.serve.sampling import Sampling, position_key, sample


def _check_length(request: Request, length: int) -> None:
    n = len(request.tokens)
    if n == 0:
        raise ConfigError("empty prompt: give at least one token")
    if n > length:
        raise ConfigError(f"prompt of {n} tokens is longer than the KV cache (serve.cache_length={length}); "
                          "raise serve.cache_length or shorten the prompt")


def _single(layout: Layout) -> Layout:
    """One request (batch 1, prefill): its batch, cache-slot and group dimensions are not split."""
    return dataclasses.replace(layout, user_rules=table(batch=None, cache_batch=None, group=None) + layout.user_rules)


class Engine(Placement):
    """Serve a model on a mesh: the weights placed (`Placement`), then prefill / insert / generate,
    each compiled once per shape, and `run`: continuous batching over them.

    `model`, `weights`: as `Placement` (default: `cfg.model.name`; the newest checkpoint of
    `cfg.checkpoint.dir`, else `model.init_from`, else a fresh init)."""

    def __init__(self, cfg, *, model: Callable | None = None, devices=None, weights=None,
                 info: Callable[[str], None] = print):
        super().__init__(cfg, model=model, devices=devices, weights=weights, info=info)
        rep = NamedSharding(self.mesh, P())
        self.traces = collections.Counter()      # compilations: one trace per compiled shape
        self._empty = None
        self._prefill = jax.jit(self._prefill_fn, out_shardings=(None, rep, rep))
        self._insert = jax.jit(self._insert_fn, out_shardings=self.state_shardings, donate_argnums=(1,))
        self._generate = jax.jit(self._generate_fn, in_shardings=(self.weight_shardings, self.state_shardings),
                                 out_shardings=(self.state_shardings, rep, rep), donate_argnums=(1,))

    def state_shapes(self) -> dict:
        """The decode state: the cache [.., B, S, ..] and per slot its position (where its last token
        goes), last token and sampling settings."""
        b, key = self.slots, jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
        sds = jax.ShapeDtypeStruct
        shapes = {"cache": jax.tree.map(lambda leaf: sds(leaf.shape, leaf.dtype), self.cache_spec, is_leaf=is_leaf),
                  "pos": sds((b,), jnp.int32), "token": sds((b,), jnp.int32), "temp": sds((b,), jnp.float32),
                  "top_k": sds((b,), jnp.int32), "top_p": sds((b,), jnp.float32), "key": sds((b, *key.shape), key.dtype)}
        return jax.tree.map(lambda a, sh: sds(a.shape, a.dtype, sharding=sh), shapes, self.state_shardings)

    def new_state(self) -> dict:
        """An empty decode state, born in its shardings (all slots free)."""
        if self._empty is None:
            fill = {"top_k": self.vocab, "top_p": 1}
            self._empty = jax.jit(lambda: {k: jax.tree.map(lambda a: jnp.full(a.shape, fill.get(k, 0), a.dtype), v)
                                           for k, v in self.state_shapes().items()},
                                  out_shardings=self.state_shardings)
        return self._empty()

    # -- the three compiled calls ------------------------------------------------------------------
    def _prefill_fn(self, weights, tokens, length, samp):
        """tokens [1, P], length = true prompt length -> (entry cache, first token, its logits [V])."""
        self.traces["prefill"] += 1
        p = tokens.shape[1]
        layout = _single(self.layout)
        with use_layout(layout), precision_lib.use_policy(self.policy):
            logits, cache = self._model(weights).decode(tokens, jnp.arange(p, dtype=jnp.int32)[None],
                                                        zeros(self._entry_specs[p]))
        last = jax.lax.dynamic_index_in_dim(logits[0], length - 1, keepdims=False).astype(jnp.float32)
        key = position_key(samp["key"], length - 1)
        tok = sample(last[None], samp["temp"][None], samp["top_k"][None], samp["top_p"][None], key[None])[0]
        return {"cache": cache, "length": length, "token": tok, **samp}, tok, last

    def _insert_fn(self, entry, state, slot):
        """Write a prefilled request into `slot`: its cache rows (padded to S), position, token, sampling."""
        self.traces["insert"] += 1
        onehot = jnp.arange(self.slots) == slot                                         # [B]
        length, token = entry["length"], entry["token"]

        def put(leaf, e, c):
            bd, ld = leaf.axes.index("cache_batch"), leaf.axes.index("cache_length")
            pad = [(0, 0)] * e.ndim
            pad[ld] = (0, c.shape[ld] - e.shape[ld])
            mask = onehot.reshape([-1 if d == bd else 1 for d in range(c.ndim)])
            return jnp.where(mask, jnp.pad(e, pad).astype(c.dtype), c)

        cache = jax.tree.map(put, self.cache_spec, entry["cache"], state["cache"], is_leaf=is_leaf)
        new = {"cache": cache, "pos": jnp.where(onehot, length, state["pos"]),
               "token": jnp.where(onehot, token, state["token"])}
        for k in ("temp", "top_k", "top_p"):
            new[k] = jnp.where(onehot, entry[k], state[k])
        new["key"] = jnp.where(onehot[:, None], entry["key"][None], state["key"])
        return new

    def _generate_fn(self, weights, state):
        """One token for every slot: each slot's last token at its position -> the next one."""
        self.traces["generate"] += 1
        pos = jnp.minimum(state["pos"], self.length - 1)     # a full slot is never read back (run frees it)
        with use_layout(self.layout), precision_lib.use_policy(self.policy):
            logits, cache = self._model(weights).decode(state["token"][:, None], pos[:, None], state["cache"])
        logits = logits[:, 0].astype(jnp.float32)                                       # [B, V]
        keys = jax.vmap(position_key)(state["key"], pos)
        nxt = sample(logits, state["temp"], state["top_k"], state["top_p"], keys)
        return {**state, "cache": cache, "token": nxt, "pos": state["pos"] + 1}, nxt, logits

    # -- public calls ----------------------------------------------------------------------------
    @staticmethod
    def precheck(cfg, requests) -> None:
        """The checks that need no model (run before loading one): prompt lengths and sampling ranges."""
        length = cfg.serve.cache_length or cfg.batch.length
        for r in requests:
            _check_length(r, length)
            r.sampling.check(vocab=None)

    def check(self, request: Request) -> None:
        """One line naming what is wrong with a request."""
        _check_length(request, self.length)
        bad = [t for t in request.tokens if not 0 <= int(t) < self.vocab]
        if bad:
            raise ConfigError(f"prompt token id {bad[0]} is outside the vocabulary 0..{self.vocab - 1}")
        if request.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        request.sampling.check(self.vocab)

    def bucket(self, n: int) -> int:
        return next(p for p in self.buckets if p >= n)

    def prefill(self, tokens, true_length: int | None = None, sampling: Sampling | None = None, params=None):
        """One prompt -> (entry, its first token (a device scalar), the logits that chose it [V]).

        `tokens`: the prompt's ids (padded here to its bucket), or ids already padded to a bucket with
        `true_length` the real count. The entry holds the prompt's cache [.., 1, P, ..], its length,
        first token and sampling settings, for `insert`. `params`: weights (default: the engine's)."""
        tokens = list(np.asarray(tokens).reshape(-1))
        n = len(tokens) if true_length is None else int(true_length)
        request = Request(tokens[:n], 1, sampling or Sampling())
        self.check(request)
        padded = np.zeros((1, self.bucket(max(n, len(tokens)))), np.int32)
        padded[0, :n] = tokens[:n]
        return self._prefill(self.weights if params is None else params, jnp.asarray(padded), jnp.int32(n),
                             request.sampling.arrays(self.vocab))

    def insert(self, entry, state, slot: int):
        """-> `state` with the prefilled request in `slot` (donated: updated in place)."""
        return self._insert(entry, state, jnp.int32(slot))

    def generate(self, state, params=None):
        """-> (state, next token per slot [B], logits [B, V]); `state` is donated."""
        return self._generate(self.weights if params is None else params, state)

    def warmup(self, requests=()) -> None:
        """Compile prefill/insert for the buckets of `requests` and generate, outside any timing."""
        state = self.new_state()
        for p in sorted({self.bucket(len(r.tokens)) for r in requests if r.tokens}):
            entry, _, _ = self.prefill([0] * p)
            state = self.insert(entry, state, 0)
        jax.block_until_ready(self.generate(state))

    def run(self, requests: list[Request], on_token: Callable[[int, int], None] | None = None) -> list[Completion]:
        """Continuous batching: every request decoded to its end; `on_token(request index, token)`
        streams (`meshpar.serve.batching`)."""
        return continuous_batching(self, requests, on_token)

    def compiled_generate(self):
        """The compiled decode step (HLO text, memory_analysis) without running it."""
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.weights)
        return self._generate.lower(shapes, self.state_shapes()).compile()
