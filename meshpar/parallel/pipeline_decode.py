"""Decoding with the stacked layers cut over `pipeline` (a model served across P stages): one decode
call of B rows (the KV-cache slots, or prompts being prefilled) runs as M microbatches of B/M rows
that follow each other through the stages, so stage s works on microbatch t - s at tick t:

    tick   0    1    2    3    4          (P = 2 stages, M = 4 microbatches; `.` = idle)
    s=0    m0   m1   m2   m3   .
    s=1    .    m0   m1   m2   m3

Stage 0 embeds its microbatch's tokens; every stage runs its layers [L/P] on the activation it got
from stage s - 1 at the tick before (`lax.ppermute`), reading and writing its microbatch's rows of
its own cache layers [L/P, B, ...]; the last stage applies the head and keeps its microbatch's
logits, which one psum over `pipeline` hands to every stage at the end. M + P - 1 ticks; each stage
works M of them, so a step costs about (M + P - 1) / M microbatch passes of one stage where M = 1
(the whole batch at once) costs P: more microbatches keep more stages busy (GPipe's argument,
Huang et al. 2019, applied to one decode step; each step fills and drains the pipe).

The model is the LM cut of `meshpar.nn.stages`: `embed(tokens, dtype)`, the stacked `layers`
(called with the cache by `scan_layers`), `head(x, dtype)`, and optionally `decoding()`, a context
its `decode` runs in (the MoE decoder's: route dropless); every leaf of its cache is stacked over
`layers` first. One `jax.shard_map` manual over `pipeline` only: tensor/data stay automatic inside.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from meshpar.core.batch import is_leaf
from meshpar.core.errors import ConfigError
from meshpar.nn.layers import scan_layers
from meshpar.nn.stages import check_protocol, layer_options, vary

AXIS = "pipeline"


def check(abstract, var_shapes, cache_spec, slots: int, microbatches: int, stages: int) -> None:
    """One line for a model or setting pipelined decoding cannot serve."""
    check_protocol(abstract, lm=True)
    if var_shapes and "layers" in var_shapes:
        raise ConfigError(f"serving with mesh.pipeline={stages}: the stacked layers of {type(abstract).__name__} hold "
                          "non-Param state, which pipelined decoding does not carry; set mesh.pipeline=1")
    for leaf in jax.tree.leaves(cache_spec, is_leaf=is_leaf):
        if leaf.axes[:1] != ("layers",):
            raise ConfigError(f"serving with mesh.pipeline={stages}: every leaf of {type(abstract).__name__}.cache_spec "
                              f"must be stacked over 'layers' first (got axes {leaf.axes}); set mesh.pipeline=1")
    if slots % microbatches:
        raise ConfigError(f"serve.slots={slots} is not divisible by serve.pipeline_microbatches={microbatches}; "
                          f"use a multiple of {microbatches}")


def decode(spec, layout, policy, weights, tokens, positions, cache, cache_spec, microbatches: int):
    """tokens, positions [B, T] -> (logits [B, T, V], cache) through the stages (module docstring).
    `weights` {"params", "vars"} (pure dicts, the layers' leaves [L, ...] split over `pipeline`);
    `cache` a tree of [L, B, ...] whose `cache_spec` leaves name the batch axis `cache_batch`."""
    from meshpar.core.rules import for_rows, use_layout
    from meshpar.core import precision as precision_lib
    p = layout.shape[AXIS]
    b = tokens.shape[0]
    m = microbatches if b % microbatches == 0 else 1            # a prefill's rows may not divide
    rows = b // m
    batch_dims = jax.tree.map(lambda leaf: leaf.axes.index("cache_batch"), cache_spec, is_leaf=is_leaf)
    params = weights["params"]
    outer = {k: v for k, v in params.items() if k != "layers"}
    vars_ = weights["vars"]
    dtype = policy.compute_dtype

    def body(outer, layers, vars_, cache, tokens, positions):
        module = spec.merge({**outer, "layers": layers}, vars_)
        if hasattr(module, "eval"):
            module.eval()
        remat, scan = layer_options(module)
        s = lax.axis_index(AXIS)

        def rows_of(a, i, dim):
            return lax.dynamic_slice_in_dim(a, i * rows, rows, dim)

        def tick(carry, t):
            recv, cache, logits = carry
            i = jnp.clip(t - s, 0, m - 1)
            valid = (t - s >= 0) & (t - s < m)
            tok, pos = rows_of(tokens, i, 0), rows_of(positions, i, 0)
            x = jnp.where(s == 0, module.embed(tok, dtype), recv)
            old = jax.tree.map(lambda c, d: rows_of(c, i, d), cache, batch_dims)
            y, _, new = scan_layers(module.layers, x, pos, "none", scan, cache=old)
            # an idle tick writes its rows back unchanged: the select is on the rows, the update in place
            cache = jax.tree.map(lambda c, n, o, d: lax.dynamic_update_slice_in_dim(
                c, jnp.where(valid, n.astype(c.dtype), o), i * rows, d), cache, new, old, batch_dims)
            out = module.head(y, dtype).astype(jnp.float32)
            mine = jnp.where(valid & (s == p - 1), out, rows_of(logits, i, 0))
            logits = lax.dynamic_update_slice_in_dim(logits, mine, i * rows, 0)
            send = lax.ppermute(y, AXIS, [(k, k + 1) for k in range(p - 1)])
            return (vary(send), cache, logits), None

        decoding = getattr(module, "decoding", contextlib.nullcontext)   # a model's decode-time switches (MoE: dropless)
        with use_layout(for_rows(layout, rows)), precision_lib.use_policy(policy), decoding():
            x0 = jax.eval_shape(lambda: module.embed(tokens[:rows], dtype))
            v = jax.eval_shape(lambda: module.head(jnp.zeros(x0.shape, x0.dtype), dtype)).shape[-1]
            init = (vary(jnp.zeros(x0.shape, x0.dtype)), cache,
                    vary(jnp.zeros((b, tokens.shape[1], v), jnp.float32)))
            (_, cache, logits), _ = lax.scan(tick, init, jnp.arange(m + p - 1))
        return lax.psum(logits, AXIS), cache

    fn = jax.shard_map(body, mesh=layout.mesh, axis_names={AXIS},
                       in_specs=(P(), P(AXIS), P(), P(AXIS), P(), P()), out_specs=(P(), P(AXIS)))
    return fn(outer, params["layers"], vars_, cache, tokens, positions)
