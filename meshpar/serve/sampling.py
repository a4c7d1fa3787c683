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

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from meshpar.core.errors import ConfigError

MAX_BIAS = 300  # logit_bias entries per request (a fixed [MAX_BIAS] row: one compiled shape)
TOP_LOGPROBS = 20  # most likely tokens `logprobs` returns per position (OpenAI's top_logprobs bound)
ROW_KEYS = ("temp", "top_k", "top_p", "key", "presence", "frequency", "bias_ids", "bias_vals")  # per row, traced


@dataclass(frozen=True)
class Sampling:
    """One request's sampling settings. temperature 0 is greedy; top_k None and top_p 1.0 are off;
    presence and frequency penalties 0 and no `bias` ((token id, value) pairs) leave the logits alone."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0
    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple = ()

    def check(self, vocab: int | None) -> Sampling:
        """One line naming the bad value (vocab None: the model is not known yet); returns self."""
        t, k, p = self.temperature, self.top_k, self.top_p
        if not (t >= 0.0) or t != t:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {t}")
        if k is not None and k < 1:
            raise ConfigError(f"top-k must be >= 1, got {k}; omit it to sample from the whole vocabulary")
        if k is not None and vocab is not None and k > vocab:
            raise ConfigError(
                f"top-k must be between 1 and the vocabulary size {vocab}, got {k}; "
                "omit it to sample from the whole vocabulary"
            )
        if not 0.0 < p <= 1.0:
            raise ConfigError(f"top-p must be in (0, 1], got {p}; use 1.0 to turn nucleus sampling off")
        for name, v in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not -2.0 <= v <= 2.0:
                raise ConfigError(f"{name} must be between -2 and 2, got {v}")
        if len(self.bias) > MAX_BIAS:
            raise ConfigError(f"logit_bias has {len(self.bias)} entries; at most {MAX_BIAS}")
        for tok, v in self.bias:
            if tok < 0 or (vocab is not None and tok >= vocab):
                raise ConfigError(f"logit_bias token {tok} is outside the vocabulary 0..{(vocab or 0) - 1}")
            if not -100.0 <= v <= 100.0:
                raise ConfigError(f"logit_bias value for token {tok} must be between -100 and 100, got {v}")
        return self

    def arrays(self, vocab: int) -> dict:
        """As traced values: temperature f32, top_k i32 (vocab when off), top_p f32, key (key data),
        the penalties f32, and the bias as [MAX_BIAS] ids and values (padding: token 0 + 0.0)."""
        ids, vals = np.zeros(MAX_BIAS, np.int32), np.zeros(MAX_BIAS, np.float32)
        for i, (tok, v) in enumerate(self.bias):
            ids[i], vals[i] = tok, v
        return {
            "temp": jnp.float32(self.temperature),
            "top_k": jnp.int32(self.top_k or vocab),
            "top_p": jnp.float32(self.top_p),
            "key": jax.random.key_data(jax.random.key(self.seed)),
            "presence": jnp.float32(self.presence),
            "frequency": jnp.float32(self.frequency),
            "bias_ids": ids,
            "bias_vals": vals,
        }


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
    keep = before < top_p[:, None]  # entry 0 always kept
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
