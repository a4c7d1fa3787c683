"""Decoding with the stacked layers cut over `pipeline` (a model served across P stages), two ways.

A prefill (`decode`) of B rows runs as M microbatches of B/M rows that follow each other through the
stages, so stage s works on microbatch t - s at tick t; the pipe fills and drains within the call:

    tick   0    1    2    3    4          (P = 2 stages, M = 4 microbatches; `.` = idle)
    s=0    m0   m1   m2   m3   .
    s=1    .    m0   m1   m2   m3

M + P - 1 ticks, each stage busy M of them (GPipe's bubble, Huang et al. 2019). Where the rows are
split over data, microbatch i is rows i, i + M, ... (`take_rows`): a block of rows would sit on
some data shards only, and slicing it would all-gather the cache over data at every tick.

Decoding (`tick`: one tick) keeps the pipe full across ticks: the B KV-cache slots are P
groups (slot b in group b mod P, so each group spreads over the data axes as the slots do), and at
tick t stage s works on group (t - s) mod P:

    tick   t    t+1  t+2  t+3              (P = 4 stages; gN = group N's current token)
    s=0    g0   g1   g2   g3               <- embeds the group's last sampled tokens
    s=1    g3   g0   g1   g2
    s=2    g2   g3   g0   g1
    s=3    g1   g2   g3   g0               -> that group's logits: it samples its next tokens

Every stage works every tick, and the group leaving the last stage is the one that enters stage 0
next: a slot's next token comes out P ticks after its last, and a tick costs one stage's pass over
B/P rows, where a decode step filled and drained would cost M + P - 1 of them (M = P). A decode call
(`Engine.generate`) runs P ticks: one token per slot. The activations in flight [P, B/P, 1, E] (one
per stage) are decode state, carried between calls. A slot may be refilled (`Engine.insert`, between
calls) while its last token is still in the pipe: insert stamps the slot with the tick it was
refilled at, and a token leaving at tick t entered at t - P + 1, so one that entered before its
slot's stamp is stale: it comes out as none (-1) and changes no state. Its cache writes on the way
need no mask: every stage reads the slot's position from the decode state, so they land at the new
request's next position, which its own first token overwrites, layer by layer, before attending
there (the protocol's decode writes each token's keys and values at its position before reading).

The model is the LM cut of `meshpar.nn.stages`: `embed(tokens, dtype)`, the stacked `layers`
(called with the cache by `scan_layers`), `head(x, dtype)`, and optionally `decoding()`, a context
its `decode` runs in (the MoE decoder's: route dropless); every leaf of its cache is stacked over
`layers` first. One `jax.shard_map` manual over `pipeline` only: tensor/data stay automatic inside;
the last stage's logits reach every stage by one psum over `pipeline`.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from meshpar.core import precision as precision_lib
from meshpar.core.batch import is_leaf
from meshpar.core.errors import ConfigError
from meshpar.core.layout import for_rows, use_layout
from meshpar.nn.layers import scan_layers
from meshpar.nn.stages import check_protocol, layer_options
from meshpar.parallel.stage_model import vary

AXIS = "pipeline"


def check(abstract, var_shapes, cache_spec, slots: int, stages: int) -> None:
    """One line for a model or setting pipelined decoding cannot serve."""
    check_protocol(abstract, lm=True)
    if var_shapes and "layers" in var_shapes:
        raise ConfigError(
            f"serving with mesh.pipeline={stages}: the stacked layers of {type(abstract).__name__} hold "
            "non-Param state, which pipelined decoding does not carry; set mesh.pipeline=1"
        )
    for leaf in jax.tree.leaves(cache_spec, is_leaf=is_leaf):
        if leaf.axes[:1] != ("layers",):
            raise ConfigError(
                f"serving with mesh.pipeline={stages}: every leaf of {type(abstract).__name__}.cache_spec "
                f"must be stacked over 'layers' first (got axes {leaf.axes}); set mesh.pipeline=1"
            )
    if slots % stages:
        raise ConfigError(
            f"serve.slots={slots} is not divisible by mesh.pipeline={stages} (decoding keeps one group "
            f"of slots per stage in flight); use a multiple of {stages}"
        )


def take_rows(a, g, d: int, groups: int):
    """Group g of `groups` strided groups of a's dimension d (rows g, g + groups, ...): [.., B, ..] ->
    [.., B/groups, ..]. Strided, a group spreads over the shards of a dimension split in blocks."""
    split = a.reshape(a.shape[:d] + (a.shape[d] // groups, groups) + a.shape[d + 1 :])
    return lax.dynamic_index_in_dim(split, g, d + 1, keepdims=False)


def put_rows(a, part, g, d: int, groups: int):
    """`a` with group g of dimension d (`take_rows`) replaced by `part`."""
    split = a.reshape(a.shape[:d] + (a.shape[d] // groups, groups) + a.shape[d + 1 :])
    return lax.dynamic_update_index_in_dim(split, part, g, d + 1).reshape(a.shape)


def decode(spec, layout, policy, weights, tokens, positions, cache, cache_spec, microbatches: int):
    """tokens, positions [B, T] -> (logits [B, T, V], cache) through the stages, filled and drained
    (module docstring; a prefill, or with `Engine(flush=True)` a decode step).
    `weights` {"params", "vars"} (pure dicts, the layers' leaves [L, ...] split over `pipeline`);
    `cache` a tree of [L, B, ...] whose `cache_spec` leaves name the batch axis `cache_batch`."""

    p = layout.shape[AXIS]
    b = tokens.shape[0]
    m = microbatches if b % microbatches == 0 else 1  # a prefill's rows may not divide
    rows = b // m
    split = layout.ways("cache_batch")
    strided = m > 1 and split > 1 and rows % split == 0
    batch_dims = jax.tree.map(lambda leaf: leaf.axes.index("cache_batch"), cache_spec, is_leaf=is_leaf)
    params = weights["params"]
    outer = {k: v for k, v in params.items() if k != "layers"}
    vars_ = weights["vars"]
    dtype = policy.compute_dtype

    def body(outer, layers, vars_, cache, tokens, positions):
        module = spec.merge({**outer, "layers": layers}, vars_)
        if hasattr(module, "eval"):
            module.eval()
        _, scan = layer_options(module)
        s = lax.axis_index(AXIS)

        def rows_of(a, i, dim):  # split over data: strided microbatches (a block would all-gather the cache)
            return take_rows(a, i, dim, m) if strided else lax.dynamic_slice_in_dim(a, i * rows, rows, dim)

        def put(a, part, i, dim):  # (a block of contiguous rows, where it can be, is updated in place)
            return put_rows(a, part, i, dim, m) if strided else lax.dynamic_update_slice_in_dim(a, part, i * rows, dim)

        def tick(carry, t):
            recv, cache, logits = carry
            i = jnp.clip(t - s, 0, m - 1)
            valid = (t - s >= 0) & (t - s < m)
            tok, pos = rows_of(tokens, i, 0), rows_of(positions, i, 0)
            x = jnp.where(s == 0, module.embed(tok, dtype), recv)
            old = jax.tree.map(lambda c, d: rows_of(c, i, d), cache, batch_dims)
            y, _, new = scan_layers(module.layers, x, pos, "none", scan, cache=old)
            # an idle tick writes its rows back unchanged: the select is on the rows, the update in place
            cache = jax.tree.map(
                lambda c, n, o, d: put(c, jnp.where(valid, n.astype(c.dtype), o), i, d), cache, new, old, batch_dims
            )
            out = module.head(y, dtype).astype(jnp.float32)
            logits = put(logits, jnp.where(valid & (s == p - 1), out, rows_of(logits, i, 0)), i, 0)
            send = lax.ppermute(y, AXIS, [(k, k + 1) for k in range(p - 1)])
            return (vary(send), cache, logits), None

        decoding = getattr(module, "decoding", contextlib.nullcontext)  # a model's decode-time switches (MoE: dropless)
        with use_layout(for_rows(layout, rows)), precision_lib.use_policy(policy), decoding():
            x0 = jax.eval_shape(lambda: module.embed(tokens[:rows], dtype))
            v = jax.eval_shape(lambda: module.head(jnp.zeros(x0.shape, x0.dtype), dtype)).shape[-1]
            init = (vary(jnp.zeros(x0.shape, x0.dtype)), cache, vary(jnp.zeros((b, tokens.shape[1], v), jnp.float32)))
            (_, cache, logits), _ = lax.scan(tick, init, jnp.arange(m + p - 1))
        return lax.psum(logits, AXIS), cache

    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        axis_names={AXIS},
        in_specs=(P(), P(AXIS), P(), P(AXIS), P(), P()),
        out_specs=(P(), P(AXIS)),
    )
    return fn(outer, params["layers"], vars_, cache, tokens, positions)


def flight_shape(x, stages: int):
    """What `tick` keeps in flight, for a group's activation `x` [R, 1, E] (a ShapeDtypeStruct): per
    stage the activation it received at the last tick [P, R, 1, E]."""
    return jax.ShapeDtypeStruct((stages, *x.shape), x.dtype)


def tick(spec, layout, policy, weights, cache, cache_spec, flight, t, tokens, positions):
    """Tick t of the steady schedule (module docstring): `tokens`, `positions` [B] every slot's last
    token and where it goes; `flight` [P, R, 1, E] what each stage received at tick t - 1 ->
    (logits [R, V] of the group leaving the last stage, (t + 1) mod P; cache; flight).
    R = B / P rows per group; group g = slots g, g + P, ..."""

    p, b = layout.shape[AXIS], tokens.shape[0]
    r = b // p
    batch_dims = jax.tree.map(lambda leaf: leaf.axes.index("cache_batch"), cache_spec, is_leaf=is_leaf)
    params, dtype = weights["params"], policy.compute_dtype
    outer = {k: v for k, v in params.items() if k != "layers"}

    def body(outer, layers, vars_, cache, fx, t, tokens, positions):
        module = spec.merge({**outer, "layers": layers}, vars_)
        if hasattr(module, "eval"):
            module.eval()
        _, scan = layer_options(module)
        s = lax.axis_index(AXIS)
        g = (t - s) % p  # the group this stage works on

        def rows(a, d):
            return take_rows(a, g, d, p)

        def put(a, part, d):
            return put_rows(a, part, g, d, p)

        def work(cache):
            x = jnp.where(s == 0, module.embed(rows(tokens, 0)[:, None], dtype), fx[0])
            y, _, new = scan_layers(
                module.layers, x, rows(positions, 0)[:, None], "none", scan, cache=jax.tree.map(rows, cache, batch_dims)
            )
            cache = jax.tree.map(lambda c, n, d: put(c, n.astype(c.dtype), d), cache, new, batch_dims)
            logits = jnp.where(s == p - 1, module.head(y, dtype)[:, 0].astype(jnp.float32), 0.0)
            return lax.psum(logits, AXIS), cache, lax.ppermute(y, AXIS, [(k, k + 1) for k in range(p - 1)])[None]

        decoding = getattr(module, "decoding", contextlib.nullcontext)
        with use_layout(for_rows(layout, r)), precision_lib.use_policy(policy), decoding():
            return work(cache)

    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        axis_names={AXIS},
        in_specs=(P(), P(AXIS), P(), P(AXIS), P(AXIS), P(), P(), P()),
        out_specs=(P(), P(AXIS), P(AXIS)),
    )
    return fn(outer, params["layers"], weights["vars"], cache, flight, t, tokens, positions)
