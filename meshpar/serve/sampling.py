"""Token sampling for decoding: greedy, temperature, top-k, top-p (nucleus), one setting per row.

    next = sample(logits [B, V], temperature [B], top_k [B], top_p [B], keys [B, 2])   # -> [B] int32

Every parameter is a traced array, so a request may change any of them without a recompilation
(MaxText's engine makes top-k/top-p static jit arguments). Per row b, with z = logits / T:

    greedy            T == 0: argmax z (keys unused)
    top-k (Fan et al. 2018)      keep the k largest z (k = V keeps all)
    top-p (Holtzman et al. 2020) keep the smallest prefix of z sorted descending whose softmax mass
                                 reaches p (the most likely token is always kept)
    then draw from softmax over the kept entries with the row's own key.

Ties at a threshold keep every tied entry. The key of a row is the request's seed folded with the
position being predicted (`meshpar.serve.engine`), so a request samples the same tokens whichever slot
and batch it runs in.

Before that, `adjust` applies OpenAI's logit_bias and penalties to the logits (per row, traced too):

    l[j] += bias[j]                                         logit_bias: up to MAX_BIAS (token, value) pairs
    l[j] -= c[j] * frequency + (c[j] > 0) * presence        c [B, V]: counts of each token generated so far

and `logprobs` reads the model's own distribution (log_softmax of the logits before any of this) at
the chosen tokens and its TOP_LOGPROBS most likely ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshpar.serve.requests import MAX_BIAS, TOP_LOGPROBS, Sampling  # noqa: F401 - the settings, named here too

ROW_KEYS = ("temp", "top_k", "top_p", "key", "presence", "frequency", "bias_ids", "bias_vals")  # per row, traced


def adjust(logits, rows: dict, counts=None):
    """logits [B, V] f32 with each row's logit_bias added and, given `counts` [B, V] (tokens generated
    so far), its presence and frequency penalties subtracted (module docstring)."""
    b = logits.shape[0]
    logits = logits.at[jnp.arange(b)[:, None], rows["bias_ids"]].add(rows["bias_vals"])
    if counts is None:
        return logits

    def penalize(z):
        c = counts.astype(jnp.float32)
        return z - rows["frequency"][:, None] * c - rows["presence"][:, None] * (c > 0)

    # a batch with no penalized row skips the [B, V] arithmetic (as `sample` skips its sort)
    return jax.lax.cond(jnp.any((rows["frequency"] != 0) | (rows["presence"] != 0)), penalize, lambda z: z, logits)


def logprobs(logits, tokens):
    """logits [B, V], tokens [B] -> (log p of each token [B], the TOP_LOGPROBS most likely ids [B, K]
    and their log p [B, K]), from log_softmax of the logits as the model gave them."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, jnp.clip(tokens, 0, lp.shape[-1] - 1)[:, None], axis=-1)[:, 0]
    top, ids = jax.lax.top_k(lp, min(TOP_LOGPROBS, lp.shape[-1]))
    return chosen, ids, top


def position_key(key, position):
    """The key that draws the token after `position`: a request's key (key data) folded with it, the
    same in prefill and decode, so a request samples alike in any slot or batch."""
    return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(key), position))


def _truncate(z, top_k, top_p):
    """z [B, V] with the entries outside each row's top-k and top-p set to -inf (module docstring)."""
    desc = -jnp.sort(-z, axis=-1)  # [B, V] largest first
    v = z.shape[-1]
    k = jnp.clip(top_k, 1, v)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # [B, 1] top-k threshold
    ranked = jnp.where(jnp.arange(v)[None, :] < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above
    keep = (before < top_p[:, None]) | (jnp.arange(v)[None, :] == 0)  # the most likely always kept (a top_p that
    # rounds to 0 in float32, 1e-46, keeps it alone)
    last = jnp.sum(keep, axis=-1) - 1  # index of the last kept
    pth = jnp.take_along_axis(desc, last[:, None], axis=-1)  # [B, 1] top-p threshold
    return jnp.where(z >= jnp.maximum(kth, pth), z, -jnp.inf)


def sample(logits, temperature, top_k, top_p, keys):
    """logits [B, V]; temperature, top_p [B] f32; top_k [B] int (1..V); keys [B, 2] key data -> [B] int32.
    A batch with no sampled row skips the draw, and one with no top-k/top-p row the sort (`lax.cond`)."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    v = logits.shape[-1]

    def draw(_):
        z = logits / jnp.maximum(temperature, 1e-6)[:, None]
        z = jax.lax.cond(jnp.any((top_k < v) | (top_p < 1.0)), lambda z: _truncate(z, top_k, top_p), lambda z: z, z)
        drawn = jax.vmap(lambda key, row: jax.random.categorical(jax.random.wrap_key_data(key), row))(keys, z)
        return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)

    return jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)
