"""The engine's compiled calls over a placed model: their jitted bodies, each traced once per shape.

    prefill(weights, tokens [n, P], lengths [n], samplings)     -> (entry, first tokens [n], logits [n, V])
    extend(weights, caches, tails [n, T], starts, lengths, ...) -> the same, from cached prefixes
    full(cache, row)                                           -> one row of an entry as a [.., 1, S, ..] cache
    insert(entry, state, slots)                                -> state with entry row r in slot slots[r]
    generate(weights, state)                                   -> (state, next token per slot [B], logits [B, V])

generate runs the stacked layers as `serve.decode_loop` says (`meshpar.nn.layers.decode_loop`): on a
GPU, unrolled, so no decode step copies the layers' weights out of their stack.

`meshpar.serve.engine.Engine` calls them with host inputs (padding, buckets, sampling rows); the
decode state's layout is `state_shapes`. With `mesh.pipeline` > 1 the decode runs through the
stages (`meshpar.parallel.pipeline_decode`), kept in flight across calls (`meshpar.serve.in_flight`).
"""

from __future__ import annotations

import collections
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar.core import precision as precision_lib
from meshpar.core.batch import is_leaf
from meshpar.core.errors import ConfigError
from meshpar.core.layout import active_layout, for_rows, use_layout
from meshpar.core.platform import compiling_for, of_mesh
from meshpar.core.sharding import bytes_per_device
from meshpar.nn.layers import decode_loop, decode_loop_for
from meshpar.parallel import pipeline_decode
from meshpar.serve import in_flight
from meshpar.serve.placement import Placement, zeros
from meshpar.serve.sampling import ROW_KEYS, Sampling, adjust, logprobs, position_key, sample


def _padded_to(leaf, c, length: int):
    """A cache leaf (axes as `leaf`'s) zero-padded along `cache_length` to `length` positions."""
    pad = [(0, 0)] * c.ndim
    ld = leaf.axes.index("cache_length")
    pad[ld] = (0, length - c.shape[ld])
    return jnp.pad(c, pad)


def _take(has, row, e, c, bd: int):
    """Entry rows e [n, ...] (batch at dimension bd) -> per slot its row `row` where `has`, else c [B, ...]."""
    mask = has.reshape([-1 if d == bd else 1 for d in range(c.ndim)])
    return jnp.where(mask, jnp.take(e, row, axis=bd).astype(c.dtype), c)


def stack(spec, caches: list):
    """Caches [.., 1, S, ..] (tree of `spec`'s leaves) -> one [.., n, S, ..] along each's cache_batch."""
    if len(caches) == 1:
        return caches[0]
    return jax.tree.map(
        lambda leaf, *c: jnp.concatenate(c, axis=leaf.axes.index("cache_batch")), spec, *caches, is_leaf=is_leaf
    )


class DecodeState:
    """The decode state's layout over a `Placement`: the cache [.., B, S, ..] and per slot its
    position (where its last token goes), last token, sampling settings and token counts; with a
    pipeline in flight also the activations in flight, the tick count and per slot the tick it was
    filled at (`meshpar.serve.in_flight`). `entry_spec(rows, length)`: a prefill's cache tree."""

    def __init__(self, placement: Placement, flying: bool):
        self.placement, self.in_flight = placement, flying
        self.shardings = placement.state_shardings
        if flying:
            self.shardings = {**self.shardings, **in_flight.shardings(placement.mesh)}
        self._empty, self._specs = None, {}

    def shapes(self) -> dict:
        """Every leaf's shape, dtype and sharding (ShapeDtypeStructs)."""
        b, vocab, sds = self.placement.slots, self.placement.vocab, jax.ShapeDtypeStruct
        rows = jax.eval_shape(lambda: Sampling().arrays(vocab))  # one row's settings
        shapes = {
            "cache": jax.tree.map(lambda leaf: sds(leaf.shape, leaf.dtype), self.placement.cache_spec, is_leaf=is_leaf),
            "pos": sds((b,), jnp.int32),
            "token": sds((b,), jnp.int32),
            **{k: sds((b, *rows[k].shape), rows[k].dtype) for k in ROW_KEYS},
            "counts": sds((b, vocab), jnp.int32),
        }  # tokens generated so far (penalties)
        if self.in_flight:
            shapes.update(in_flight.state_shapes(self.placement))
        return jax.tree.map(lambda a, sh: sds(a.shape, a.dtype, sharding=sh), shapes, self.shardings)

    def new(self) -> dict:
        """An empty decode state, born in its shardings (all slots free)."""
        if self._empty is None:
            fill = {"top_k": self.placement.vocab, "top_p": 1}
            self._empty = jax.jit(
                lambda: {
                    k: jax.tree.map(lambda a, k=k: jnp.full(a.shape, fill.get(k, 0), a.dtype), v)
                    for k, v in self.shapes().items()
                },
                out_shardings=self.shardings,
            )
        return self._empty()

    def entry_spec(self, rows: int, length: int):
        """The cache tree of `rows` prompts of `length` positions (tree of Leaf)."""
        if (rows, length) not in self._specs:
            with precision_lib.use_policy(self.placement.policy):
                self._specs[rows, length] = self.placement.abstract.cache_spec(rows, length)
        return self._specs[rows, length]

    def bytes_per_device(self) -> dict:
        """`Placement.bytes_per_device`, and the slots' own state beside the cache (positions, tokens,
        sampling settings, the penalties' token counts)."""
        rest = [a for k, v in self.shapes().items() if k != "cache" for a in jax.tree.leaves(v)]
        return {
            **self.placement.bytes_per_device(),
            "slot_state": int(sum(bytes_per_device(a.shape, a.dtype, a.sharding) for a in rest)),
        }


class DecodePrograms:
    """The jitted bodies of prefill, extend, insert and generate over a `Placement` (`Engine` calls
    them with host inputs); `traces` counts their compilations per name. `microbatches`: with
    `mesh.pipeline` > 1, the decode batch's microbatches through the stages (`pipeline.microbatches`).
    `loop` (`serve.decode_loop`): generate's layers, "auto" resolved for the mesh's platform."""

    def __init__(self, placement: Placement, *, flush: bool = False, ticks=None, microbatches: int = 1, loop="auto"):
        self.placement, self.microbatches = placement, microbatches
        for name in "mesh layout policy stages slots vocab length cache_spec weight_shardings".split():
            setattr(self, name, getattr(placement, name))  # the placement's facts the bodies read
        self.loop = decode_loop_for(loop, of_mesh(self.mesh))
        rep = NamedSharding(self.mesh, P())
        # mesh.pipeline > 1: one group of slots per stage in flight across generate calls, `ticks` (1..P,
        # default P) ticks per call; `flush`: each call fills and drains the pipe instead (for comparison)
        # (`meshpar.serve.in_flight`)
        self.in_flight = self.stages > 1 and not flush
        self.ticks = ticks or self.stages
        if not 1 <= self.ticks <= self.stages:
            raise ConfigError(f"ticks={ticks}: a decode call runs 1 to mesh.pipeline={self.stages} ticks")
        self.state = DecodeState(placement, self.in_flight)
        self.state_shardings, self.entry_spec = self.state.shardings, self.state.entry_spec
        self.traces = collections.Counter()  # compilations: one trace per compiled shape
        self.prefill = jax.jit(self._prefill_fn, out_shardings=(None, rep, rep))
        self.extend = jax.jit(self._extend_fn, out_shardings=(None, rep, rep))
        self.full = jax.jit(self._full_fn)
        self.logprobs = jax.jit(logprobs)
        self.insert = jax.jit(partial(_insert_rows, self), out_shardings=self.state_shardings, donate_argnums=(1,))
        self.generate = jax.jit(
            self._generate_fn,
            in_shardings=(self.weight_shardings, self.state_shardings),
            out_shardings=(self.state_shardings, rep, rep),
            donate_argnums=(1,),
        )

    def compiled_generate(self, options: dict | None = None):
        """The compiled decode step (HLO text, memory_analysis) without running it, for this mesh's
        platform (a deviceless target's GPU or TPU too), with XLA compiler `options`."""
        shapes = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.placement.weights
        )
        with compiling_for(of_mesh(self.mesh)):
            return self.generate.lower(shapes, self.state.shapes()).compile(options)

    def _decode(self, weights, tokens, positions, cache):
        """The model's decode (under the active layout), or with `mesh.pipeline` > 1 the same through
        the stages in `pipeline.microbatches` microbatches (`meshpar.parallel.pipeline_decode`)."""
        if self.stages == 1:
            return self.placement.model(weights).decode(tokens, positions, cache)
        return pipeline_decode.decode(
            self.placement.spec,
            active_layout(),
            self.policy,
            weights,
            tokens,
            positions,
            cache,
            self.cache_spec,
            self.microbatches,
        )

    def _first(self, weights, tokens, positions, cache, last_at, samp):
        """Decode `tokens` [n, T] at `positions` into `cache`; sample each row's token after index
        `last_at` [n] -> (entry, first tokens [n], their logits [n, V])."""
        with use_layout(for_rows(self.layout, tokens.shape[0])), precision_lib.use_policy(self.policy):
            logits, cache = self._decode(weights, tokens, positions, cache)
        last = jnp.take_along_axis(logits, last_at[:, None, None], axis=1)[:, 0].astype(jnp.float32)  # [n, V]
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
        cache = stack(self.entry_spec(1, self.length), list(caches))
        positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        return self._first(weights, tokens, positions, cache, length - 1 - start, samp)

    def _full_fn(self, cache, row):
        """Row `row` of a prefill's cache [.., n, P, ..], padded to [.., 1, S, ..] (a prefix to keep)."""
        self.traces["full"] += 1
        return jax.tree.map(
            lambda leaf, c: _padded_to(
                leaf, jax.lax.dynamic_index_in_dim(c, row, leaf.axes.index("cache_batch"), keepdims=True), self.length
            ),
            self.entry_spec(1, self.length),
            cache,
            is_leaf=is_leaf,
        )

    def _generate_fn(self, weights, state):
        """One token for every slot: each slot's last token at its position -> the next one."""
        self.traces["generate"] += 1
        with decode_loop(self.loop):  # unrolled on a GPU (meshpar.nn.layers.decode_loop)
            if self.in_flight:
                return in_flight.generate(self.placement, self.ticks, weights, state)
            pos = jnp.minimum(state["pos"], self.length - 1)  # a full slot is never read back (run frees it)
            with use_layout(self.layout), precision_lib.use_policy(self.policy):
                logits, cache = self._decode(weights, state["token"][:, None], pos[:, None], state["cache"])
        logits = logits[:, 0].astype(jnp.float32)  # [B, V]
        keys = jax.vmap(position_key)(state["key"], pos)
        nxt = sample(adjust(logits, state, state["counts"]), state["temp"], state["top_k"], state["top_p"], keys)
        counts = state["counts"].at[jnp.arange(self.slots), nxt].add(1)
        return {**state, "cache": cache, "token": nxt, "pos": state["pos"] + 1, "counts": counts}, nxt, logits


def _insert_rows(programs, entry, state, slots):
    """Write entry row r into slot slots[r] (a slot of -1: a padding row, dropped): its cache rows
    (padded to S), position, token and sampling settings."""
    programs.traces["insert"] += 1
    hit = slots[:, None] == jnp.arange(programs.slots)[None, :]  # [n, B]
    has, row = jnp.any(hit, axis=0), jnp.argmax(hit, axis=0)  # [B] each
    take = partial(_take, has, row)
    cache = jax.tree.map(
        lambda leaf, e, c: take(
            _padded_to(leaf, e, c.shape[leaf.axes.index("cache_length")]), c, leaf.axes.index("cache_batch")
        ),
        programs.cache_spec,
        entry["cache"],
        state["cache"],
        is_leaf=is_leaf,
    )
    new = {**state, "cache": cache, "pos": take(entry["length"], state["pos"], 0)}
    for k in ("token", *ROW_KEYS):
        new[k] = take(entry[k], state[k], 0)
    first = jax.nn.one_hot(entry["token"], programs.vocab, dtype=jnp.int32)  # the first token, counted
    new["counts"] = take(first, state["counts"], 0)
    if programs.in_flight:  # the slot's tokens still in the pipe are the old request's: stale from now on
        new.update(in_flight.inserted(state, has))
    return new
