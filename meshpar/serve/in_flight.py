"""Decoding on a pipeline mesh with the pipe kept full across ticks (`meshpar.parallel.pipeline_decode`
draws the schedule): what it adds to an engine's decode state, and its decode call.

    state["flight"]  [P, B/P, 1, E]  the activation each stage received at the last tick
    state["tick"]    []              ticks run so far
    state["born"]    [B]             per slot the tick it was last filled at (`Engine.insert`)

A decode call runs `ticks` ticks (P: every group of slots leaves the last stage once, so every slot
gets a token per call once the pipe is full). The group leaving samples its next tokens, exactly
as a decode step without a pipeline samples them (same logits, same position keys). A token that
entered before its slot was refilled is stale: it changes no state and comes out as -1, as does
every slot whose token is still in the pipe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar.core import precision as precision_lib
from meshpar.core.layout import for_rows, use_layout
from meshpar.parallel import pipeline_decode
from meshpar.serve.sampling import ROW_KEYS, adjust, position_key, sample


def shardings(mesh) -> dict:
    """The added state's shardings: the activations in flight split over `pipeline`, the rest replicated."""
    return {
        "flight": NamedSharding(mesh, P("pipeline")),
        "tick": NamedSharding(mesh, P()),
        "born": NamedSharding(mesh, P()),
    }


def state_shapes(placement) -> dict:
    """The added state's shapes and dtypes (the activation's from an abstract embed of a group) of a
    `meshpar.serve.placement.Placement`."""
    r = placement.slots // placement.stages

    def embed(w):
        with use_layout(for_rows(placement.layout, r)), precision_lib.use_policy(placement.policy):
            return placement.model(w).embed(jnp.zeros((r, 1), jnp.int32), placement.dtype)

    x = jax.eval_shape(embed, placement.weight_shapes)
    return {
        "flight": pipeline_decode.flight_shape(x, placement.stages),
        "tick": jax.ShapeDtypeStruct((), jnp.int32),
        "born": jax.ShapeDtypeStruct((placement.slots,), jnp.int32),
    }


def inserted(state, filled) -> dict:
    """What `Engine.insert` changes in the added state: the slots where `filled` [B] holds are stamped
    with the tick (the activations in flight and the tick stay)."""
    return {"born": jnp.where(filled, state["tick"], state["born"])}


def generate(placement, ticks: int, weights, state):
    """One decode call of `ticks` ticks (module docstring) over a `Placement` -> (state, next token
    per slot [B] or -1, logits [B, V] (zeros where no token came out))."""
    b, p = placement.slots, placement.stages

    def one(carry, _):
        st, toks, lg = carry
        pos = jnp.minimum(st["pos"], placement.length - 1)
        logits, cache, flight = pipeline_decode.tick(
            placement.spec,
            placement.layout,
            placement.policy,
            weights,
            st["cache"],
            placement.cache_spec,
            st["flight"],
            st["tick"],
            st["token"],
            pos,
        )
        out = jnp.arange(b // p) * p + (st["tick"] + 1) % p  # the group leaving [R]
        live = st["born"][out] <= st["tick"] - (p - 1)  # it entered after its slot was filled
        keys = jax.vmap(position_key)(st["key"][out], pos[out])
        rows = {k: st[k][out] for k in ROW_KEYS}
        nxt = sample(adjust(logits, rows, st["counts"][out]), rows["temp"], rows["top_k"], rows["top_p"], keys)
        st = {
            **st,
            "cache": cache,
            "flight": flight,
            "tick": st["tick"] + 1,
            "token": st["token"].at[out].set(jnp.where(live, nxt, st["token"][out])),
            "pos": st["pos"].at[out].add(live.astype(jnp.int32)),
            "counts": st["counts"].at[out, nxt].add(live.astype(jnp.int32)),
        }
        return (
            st,
            toks.at[out].set(jnp.where(live, nxt, toks[out])),
            lg.at[out].set(jnp.where(live[:, None], logits, lg[out])),
        ), None

    carry = (state, jnp.full((b,), -1, jnp.int32), jnp.zeros((b, placement.vocab), jnp.float32))
    with use_layout(placement.layout), precision_lib.use_policy(placement.policy):
        carry, _ = jax.lax.scan(one, carry, None, length=ticks)  # one loop: faster than unrolled
    return carry
