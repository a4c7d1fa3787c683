"""MoE routing: which experts each token goes to, with what weight, in which slot (fp32).

After GShard (Lepikhin et al. 2020, Algorithm 1), Switch Transformer (Fedus et al. 2021), Mixtral
(softmax over the chosen K), DeepSeek-V3 (sigmoid scores; auxiliary-loss-free balancing by a
per-expert bias, Wang et al. 2024). Letters: G groups, S tokens per group, E experts, C capacity
(slots per expert per group), K experts per token. `meshpar.nn.moe` moves the tokens to the experts.

Auxiliary losses (per MoE layer):
    aux_loss = E * mean_G sum_E (mean_S gates[G,S,E]) * (mean_S top1_mask[G,S,E])   (GShard eq. 4,
               Switch eq. 4; sigmoid scores normalised per token first): exactly 1 when the gates
               are uniform, so the training loss gets `aux_loss_weight` then.
    z_loss   = mean_{G,S} logsumexp(logits)^2   (ST-MoE, Zoph et al. 2022)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar.core.errors import ConfigError

# the MoE tensors' logical axes (letters as above; M embed, H expert_mlp), named once for
# `meshpar.nn.moe` (capacity mode) and `meshpar.nn.dropless`
TOKENS = ("group", None, "embed")  # GSM
ROUTING = ("group", None, None)  # GSE, GSK
MASKS = ("group", None, None, None)  # GSEC
EXPERT_IN = ("expert", "group", "capacity", "embed")  # EGCM, experts split (compute layout)
GROUPED = (None, "group", "capacity", "embed")  # EGCM, groups split (token layout)
EXPERT_HIDDEN = ("expert", "group", "capacity", "expert_mlp")  # EGCH
W_IN = ("expert", "embed", "expert_mlp")  # EMH
W_OUT = ("expert", "expert_mlp", "embed")  # EHM


def capacity(group_size: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per group: C = ceil(K * S * capacity_factor / E) (GShard §2.2)."""
    if capacity_factor <= 0:
        raise ConfigError(f"moe.capacity_factor must be > 0 or null (dropless), got {capacity_factor}")
    return max(1, math.ceil(top_k * group_size * capacity_factor / num_experts))


class Routing(NamedTuple):
    """What the router decided for logits [G, S, E]."""

    index: jax.Array  # [G, S, K] int32: chosen experts, best first
    gates: jax.Array  # [G, S, K] fp32: top1 the softmax gate; top2 g_k / (g1 + g2); 0 if not routed
    routed: jax.Array  # [G, S, K] bool: assignment made (False: 2nd expert skipped by random routing)
    kept: jax.Array  # [G, S, K] bool: routed and within capacity (all routed when dropless)
    position: jax.Array  # [G, S, K] int32: slot in the expert's buffer (meaningful where kept)
    combine: jax.Array | None  # [G, S, E, C] fp32 combine weights (None when dropless)
    dispatch: jax.Array | None  # [G, S, E, C] bool dispatch mask (None when dropless)
    aux_loss: jax.Array  # scalar: load-balancing loss, 1.0 under uniform gates (unweighted)
    z_loss: jax.Array  # scalar: mean logsumexp(logits)^2 (unweighted)
    drop_fraction: jax.Array  # scalar: dropped / routed (token, expert) assignments
    load: jax.Array  # [E]: fraction of routed assignments per expert (sums to 1)


def load_balancing_loss(gates: jax.Array, top1: jax.Array) -> jax.Array:
    """E * mean_G sum_E mean_S(gates) * mean_S(top1 one-hot). gates, top1 [G, S, E] -> scalar.

    Uniform gates (1/E each) give exactly 1 whatever the top-1 choices, since the top-1 fractions sum
    to 1 over experts."""
    e = gates.shape[-1]
    me = jnp.mean(gates, axis=1)  # [G, E] mean gate
    ce = jnp.mean(top1, axis=1)  # [G, E] fraction of tokens whose first choice is e
    return e * jnp.mean(jnp.sum(me * ce, axis=-1))


def z_loss(logits: jax.Array) -> jax.Array:
    """Router z-loss: mean over tokens of logsumexp(logits)^2. logits [G, S, E] -> scalar."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))


def route(
    logits: jax.Array,
    top_k: int,
    capacity_factor: float | None,
    second_policy: str = "all",
    rng: jax.Array | None = None,
    with_masks: bool = True,
    score: str = "softmax",
    normalise: bool | None = None,
    bias: jax.Array | None = None,
) -> Routing:
    """GShard Algorithm 1 (top2) / Switch (top1) and their descendants on router logits [G, S, E], in fp32.

    - scores = softmax(logits) (GShard, Mixtral, Qwen) or sigmoid(logits) (DeepSeek-V3); experts
      1..K = the K best scores, or the K best scores + `bias` [E] (DeepSeek-V3's balancing: the bias
      picks, the score weighs); ties: lowest index.
    - gates = the chosen scores, renormalised to sum to 1 when `normalise` (default: K > 1; for
      softmax scores that is Mixtral's softmax over the chosen K). `second_policy="random"` keeps the
      2nd expert only where 2 * g2 > U(0, 1) (needs `rng`). Unnormalised top1 is Switch: the gate is
      the probability itself, so the router gets a gradient.
    - capacity C = ceil(K * S * capacity_factor / E); a token's slot in an expert is its rank by
      cumulative sum over S, first choices of the whole group before second choices; assignments at
      slot >= C are dropped (the token then only passes through the residual connection). S is
      taken as given: `meshpar.nn.moe.moe_ffn` passes it in the sequence's own order (it undoes
      context parallelism's balanced storage order first), so the same tokens are dropped on any mesh.
    - capacity_factor None: dropless, every routed assignment is kept.
    - `with_masks=False`: skip the [G, S, E, C] combine/dispatch tensors (None); the fast path needs only
      index, gates, kept and position.
    """
    logits = logits.astype(jnp.float32)
    g, s, e = logits.shape
    if top_k > e:
        raise ConfigError(f"moe.top_k={top_k} needs at least {top_k} experts, got moe.num_experts={e}")
    probs = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    index, gates, masks = [], [], []
    rest = probs if bias is None else probs + jax.lax.stop_gradient(bias.astype(jnp.float32))
    for _ in range(top_k):
        i = jnp.argmax(rest, axis=-1)  # [G, S]
        mask = jax.nn.one_hot(i, e, dtype=jnp.float32)  # [G, S, E]
        index.append(i)
        gates.append(jnp.sum(probs * mask, axis=-1))
        masks.append(mask)
        rest = jnp.where(mask > 0, -jnp.inf, rest)  # exclude the chosen
    index = jnp.stack(index, -1).astype(jnp.int32)  # [G, S, K]
    gates = jnp.stack(gates, -1)  # [G, S, K]
    if top_k > 1 if normalise is None else normalise:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    routed = jnp.ones(index.shape, bool)
    if second_policy == "random" and top_k > 1:
        if rng is None:
            raise ValueError("second_policy='random' needs an rng key")
        u = jax.random.uniform(rng, (g, s), jnp.float32)
        routed = routed.at[..., 1].set(2.0 * gates[..., 1] > u)
    gates = gates * routed

    aux = load_balancing_loss(probs if score == "softmax" else probs / jnp.sum(probs, -1, keepdims=True), masks[0])
    zl = z_loss(logits)
    routed_f = routed.astype(jnp.float32)
    onehots = jnp.stack(masks, axis=2) * routed_f[..., None]  # [G, S, K, E]
    load = jnp.sum(onehots, axis=(0, 1, 2)) / jnp.maximum(jnp.sum(routed_f), 1.0)

    if capacity_factor is None:
        return Routing(
            index, gates, routed, routed, jnp.zeros_like(index), None, None, aux, zl, jnp.zeros((), jnp.float32), load
        )

    cap = capacity(s, e, top_k, capacity_factor)
    filled = jnp.zeros((g, 1, e), jnp.float32)  # slots taken per expert [G, 1, E]
    kept, position = [], []
    combine = jnp.zeros((g, s, e, cap), jnp.float32) if with_masks else None
    for k in range(top_k):
        mask = onehots[:, :, k]  # [G, S, E]
        pos = (jnp.cumsum(mask, axis=1) - 1.0 + filled) * mask  # slot per (token, expert)
        mask = mask * (pos < cap)
        filled = filled + jnp.sum(mask, axis=1, keepdims=True)
        pos_k = jnp.sum(pos * mask, axis=-1).astype(jnp.int32)  # [G, S]
        kept_k = jnp.sum(mask, axis=-1) > 0  # [G, S]
        if with_masks:
            slot = jax.nn.one_hot(pos_k, cap, dtype=jnp.float32) * kept_k[..., None]  # [G, S, C]
            combine = combine + (gates[..., k, None] * mask)[..., None] * slot[:, :, None, :]
        kept.append(kept_k)
        position.append(pos_k)
    kept = jnp.stack(kept, -1)
    position = jnp.stack(position, -1)
    drop = (jnp.sum(routed_f) - jnp.sum(kept.astype(jnp.float32))) / jnp.maximum(jnp.sum(routed_f), 1.0)
    if not with_masks:
        return Routing(index, gates, routed, kept, position, None, None, aux, zl, drop, load)
    dispatch = jnp.zeros((g, s, e, cap), bool)
    for k in range(top_k):
        hit = jax.nn.one_hot(index[..., k], e, dtype=bool) & kept[..., k, None]  # [G, S, E]
        dispatch = dispatch | (hit[..., None] & jax.nn.one_hot(position[..., k], cap, dtype=bool)[:, :, None, :])
    return Routing(index, gates, routed, kept, position, combine, dispatch, aux, zl, drop, load)


class ExpertBias(nnx.Variable):
    """DeepSeek-V3's per-expert selection bias [E] (`moe.balance=bias`): state, not a parameter."""


def updated_bias(bias, load, rate: float):
    """Auxiliary-loss-free balancing (DeepSeek-V3, Wang et al. 2024): b_e <- b_e + rate * sign(1/E -
    load_e), load_e the fraction of routed assignments expert e got; bias, load [..., E]."""
    load = jax.lax.stop_gradient(load)
    return bias + rate * jnp.sign(1.0 / load.shape[-1] - load)
