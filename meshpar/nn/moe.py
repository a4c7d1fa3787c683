"""Mixture of experts: routing, dispatch and combine, expert parallelism over the `expert` mesh axis.

After GShard (Lepikhin et al. 2020, Algorithm 1) and Switch Transformer (Fedus et al. 2021). Letters:
G groups, S tokens per group, E experts, C capacity (slots per expert per group), M model width
(`embed`), H expert hidden width (`expert_mlp`), K experts per token (top1: 1, top2: 2; `moe.top_k`).

Routing family (`meshpar.nn.routing.route`): softmax scores (GShard, Switch, Mixtral, Qwen) or sigmoid (DeepSeek-V3);
the chosen K gates renormalised or not (`norm_topk`); a per-expert bias that picks experts but never
weighs them, moved against the load error after each forward (`updated_bias`, DeepSeek-V3's
auxiliary-loss-free balancing). Shared experts (DeepSeekMoE) are a dense SwiGLU the model adds
(models/moe.py).

    x [B, T, M] (in sequence order, `_stored_order`) -> regroup [G, S, M] -> router logits [G, S, E] (fp32) -> route
    capacity mode (`capacity_factor` a number), GShard's einsums (the reference, `DISPATCH="einsum"`):
        combine  [G, S, E, C] = gate of each kept (token, expert, slot), 0 elsewhere
        dispatch [G, S, E, C] = combine != 0 (as a 0/1 mask)
        GSEC,GSM->EGCM    dispatch:  G-sharded -> E-sharded (XLA: all-to-all over `expert`)
        EGCM,EMH->EGCH    expert FFN in (SwiGLU: gate and up projections)
        EGCH,EHM->EGCM    expert FFN out
        GSEC,EGCM->GSM    combine:   E-sharded -> G-sharded (all-to-all back)
    what runs by default (`DISPATCH="gather"`, `dispatch_combine_gather`): the same EGCM tensors,
        layouts and all-to-alls, but dispatch and combine are row gathers by the slot of each kept
        (token, k) -- a 0/1 mask matmul copies rows, so a gather computes the same numbers without
        the [G, S, E, C] masks (E x C times the tokens' size) or their 2 x S x E x C x M FLOPs per
        group each way; gradients are gathers too. tests/nn/test_moe_fast.py holds it to the einsums.
    dropless mode (`capacity_factor: null`): top-K experts [G, S, K] -> every device sorts its tokens
        by expert, sends each expert shard its rows (all-to-all), runs grouped matmuls over its
        local experts (`meshpar.nn.gmm`: `ragged_dot`, or row tiles on CPU), sends the rows back
        (the exchanges: `meshpar.nn.exchange`, ragged all-to-all on GPU/TPU), weighted sum over K.

Sharding. Expert weights [E, M, H] carry the logical axis `expert` (-> mesh `expert`); tokens
[G, S, M] carry `group` (-> the batch axes data/fsdp/expert jointly). The dispatch einsum runs in
the token layout (EGCM split on G like GSM: no communication), then EGCM is pinned to (`expert`,
`group`, `capacity`, `embed`): the resolver gives E the `expert` axis and G what is left of the batch
axes, so only the `expert` axis changes owner, which XLA lowers to an all-to-all; the combine does
the reverse. (Pinning only the E-split layout lets XLA pick other plans: with a `tensor` axis it
all-gathered tokens over `expert` instead.) Since no spec may use a mesh axis twice, expert weights
can never be split over `expert` on two dimensions (the layout that makes XLA all-gather them).
Under FSDP presets the `embed`/`expert_mlp` dimensions of expert weights are sharded over
data/fsdp and all-gathered over those axes for compute, as every FSDP weight is (ZeRO-3); never
over `expert`. Random routing draws U(0, 1) from a key folded with integer hashes of the tokens and
of the layer's router, so it is identical under every sharding.

Order. Capacity (which tokens come first in an expert's buffer) and random routing (which draw a
token gets) depend on the order of S. Context parallelism stores each row in its balanced (zig-zag)
order (`meshpar.core.sequence`); `moe_ffn` then gathers the tokens back into sequence order before
routing, locally (G's layout never splits S over `context`), and its output into storage order
after, so a run with `mesh.context > 1` drops the tokens one device drops. Inside a pipeline stage
manual over `context` a layer would see only its share of each sequence: refused in one line.

Routing (scores, top-K, capacity slots, the auxiliary losses, the balancing bias) is
`meshpar.nn.routing`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from meshpar.core import scopes, sequence
from meshpar.core.config import top_k
from meshpar.core.errors import ConfigError
from meshpar.core.layout import constrain
from meshpar.nn.dropless import dropless
from meshpar.nn.layers import swiglu
from meshpar.nn.routing import (
    EXPERT_HIDDEN,
    EXPERT_IN,
    GROUPED,
    MASKS,
    ROUTING,
    TOKENS,
    Routing,
    capacity,
    route,
)

# capacity mode: "gather" (default, `dispatch_combine_gather`) or "einsum" (GShard's formulation,
# `dispatch_combine`, the reference the tests hold the gather path to)
DISPATCH = "gather"


@dataclass(frozen=True)
class MoESettings:
    """The MoE part of a run config, as the layers need it (see `meshpar.core.config.MoEConfig`)."""

    num_experts: int
    top_k: int  # K: 1 (Switch), 2 (GShard, Mixtral), 8 (DeepSeek-V3) ...
    capacity_factor: float | None  # None: dropless
    every: int = 2
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001
    group_size: int | None = None
    second_expert_policy: str = "all"
    score: str = "softmax"  # softmax | sigmoid
    norm_topk: bool | None = None  # None: when top_k > 1
    shared_experts: int = 0
    expert_mlp: int | None = None  # None: the model's mlp
    balance: str = "aux"  # aux | bias
    bias_rate: float = 0.001

    @classmethod
    def from_config(cls, m) -> MoESettings:
        return cls(
            num_experts=m.num_experts,
            top_k=top_k(m),
            capacity_factor=m.capacity_factor,
            every=m.every,
            aux_loss_weight=m.aux_loss_weight,
            z_loss_weight=m.z_loss_weight,
            group_size=m.group_size,
            second_expert_policy=m.second_expert_policy,
            score=m.score,
            norm_topk=m.norm_topk,
            shared_experts=m.shared_experts,
            expert_mlp=m.expert_mlp,
            balance=m.balance,
            bias_rate=m.bias_rate,
        )

    @property
    def normalise(self) -> bool:
        return self.top_k > 1 if self.norm_topk is None else self.norm_topk


# ----------------------------------------------------------------------------------------------
# Experts


def _swiglu_experts(xe, w_gate, w_up, w_down):
    """Expert FFN on dispatched tokens, EGCM -> EGCM: per expert, (GC)M,MH->(GC)H (gate, up),
    silu(gate)*up, (GC)H,HM->(GC)M. The G and C dimensions are merged into one row dimension first:
    XLA:CPU runs a batched matmul with two free row dimensions as transposes plus an unfused
    activation, 1.9x the time of the same FLOPs as [E, G*C, M] (bench/RESULTS.md, issue 23)."""
    e, g, c, m = xe.shape
    rows = xe.reshape(e, g * c, m)
    gate = jnp.einsum("enm,emh->enh", rows, w_gate)
    up = jnp.einsum("enm,emh->enh", rows, w_up)
    h = swiglu(gate, up)
    h = constrain(h.reshape(e, g, c, -1), EXPERT_HIDDEN, "moe hidden EGCH").reshape(e, g * c, -1)
    out = jnp.einsum("enh,ehm->enm", h, w_down).reshape(e, g, c, m)
    return constrain(out, EXPERT_IN, "moe expert output EGCM")


def dispatch_combine(x, r: Routing, w_gate, w_up, w_down):
    """Capacity mode. x [G, S, M], r.combine/r.dispatch [G, S, E, C], w_gate/w_up [E, M, H],
    w_down [E, H, M] -> [G, S, M]. The G<->E reshards are the all-to-alls of expert parallelism.

    Each einsum runs where its operands already are (G-sharded, no communication); the two
    constraints around the experts are pure reshards, E-split <-> G-split over `expert`, which XLA
    lowers to all-to-all (left to itself, it may instead all-gather tokens over `expert`)."""
    dt = x.dtype
    xe = jnp.einsum("gsec,gsm->egcm", r.dispatch.astype(dt), x)  # GSEC,GSM->EGCM
    xe = constrain(constrain(xe, GROUPED, "moe dispatched EGCM"), EXPERT_IN, "moe dispatched EGCM")
    ye = _swiglu_experts(xe, w_gate, w_up, w_down)
    ye = constrain(ye, GROUPED, "moe expert output EGCM")
    y = jnp.einsum("gsec,egcm->gsm", r.combine.astype(dt), ye)  # GSEC,EGCM->GSM
    return constrain(y, TOKENS, "moe combined GSM")


# The same layer without the [G, S, E, C] masks: dispatch and combine as row gathers. Slot (e, c) of a
# group holds at most one kept assignment (s, k) and every kept (s, k) sits in exactly one slot, so
# the gather assignment -> slot and the gather slot -> assignment are each other's transpose: the
# backward of either is the other (custom VJP), never a scatter-add and never a one-hot matmul.


@jax.custom_vjp
def _move_rows(src, idx, valid, back_idx, back_valid):
    """out[g, r] = src[g, idx[g, r]] where valid[g, r], else 0. src [G, N, M]; idx, valid [G, R];
    (back_idx, back_valid) [G, N] is the inverse partial map, used by the backward pass."""
    rows = jax.vmap(lambda a, i: a[i])(src, idx)
    return jnp.where(valid[..., None], rows, jnp.zeros((), src.dtype))


def _move_rows_fwd(src, idx, valid, back_idx, back_valid):
    return _move_rows(src, idx, valid, back_idx, back_valid), (idx, valid, back_idx, back_valid)


def _move_rows_bwd(res, d):
    idx, valid, back_idx, back_valid = res
    return _move_rows(d, back_idx, back_valid, idx, valid), None, None, None, None


_move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


def slot_maps(r: Routing, num_experts: int, cap: int):
    """Index maps of one routing. Assignments a = s * K + k, slots e * C + c; returns
    (slot of a [G, S*K], a kept [G, S*K], assignment in slot [G, E*C], slot filled [G, E*C])."""
    g, s, k = r.index.shape
    a_slot = (r.index * cap + r.position).reshape(g, s * k)
    a_kept = r.kept.reshape(g, s * k)
    target = jnp.where(a_kept, a_slot, num_experts * cap)  # dropped: out of range, not written
    n = num_experts * cap
    ids = jnp.arange(s * k, dtype=jnp.int32)
    slot_a = jax.vmap(lambda t: jnp.zeros(n, jnp.int32).at[t].set(ids, mode="drop"))(target)
    slot_full = jax.vmap(lambda t: jnp.zeros(n, bool).at[t].set(True, mode="drop"))(target)
    return jnp.where(a_kept, a_slot, 0), a_kept, slot_a, slot_full


def dispatch_combine_gather(x, r: Routing, w_gate, w_up, w_down, num_experts: int, cap: int):
    """`dispatch_combine` computed by gathers: the same numbers (each slot holds one token, each
    kept assignment reads one slot) without the GSEC masks or their S x E x C x M matmuls. x [G, S, M]
    -> [G, S, M]; the EGCM layouts, constraints and all-to-alls are those of `dispatch_combine`."""
    g, s, m = x.shape
    k = r.index.shape[-1]
    a_slot, a_kept, slot_a, slot_full = slot_maps(r, num_experts, cap)
    xk = jnp.broadcast_to(x[:, :, None, :], (g, s, k, m)).reshape(g, s * k, m)  # row a = token s of (s, k)
    xe = _move_rows(xk, slot_a, slot_full, a_slot, a_kept)  # [G, E*C, M]
    xe = xe.reshape(g, num_experts, cap, m).transpose(1, 0, 2, 3)  # EGCM, groups split
    xe = constrain(constrain(xe, GROUPED, "moe dispatched EGCM"), EXPERT_IN, "moe dispatched EGCM")
    ye = constrain(_swiglu_experts(xe, w_gate, w_up, w_down), GROUPED, "moe expert output EGCM")
    ye = ye.transpose(1, 0, 2, 3).reshape(g, num_experts * cap, m)
    rows = _move_rows(ye, a_slot, a_kept, slot_a, slot_full).reshape(g, s, k, m)  # expert output per (s, k)
    y = jnp.einsum("gskm,gsk->gsm", rows, (r.gates * r.kept).astype(x.dtype))
    return constrain(y, TOKENS, "moe combined GSM")


# ----------------------------------------------------------------------------------------------
# The layer

_ROUTING_KEY = scopes.ROUTING_KEY


@contextlib.contextmanager
def routing_key(key: jax.Array | None) -> Iterator[None]:
    """PRNG key for GShard's random routing of the 2nd expert while a model is traced."""
    token = _ROUTING_KEY.set(key)
    try:
        yield
    finally:
        _ROUTING_KEY.reset(token)


def regroup(x, group_size: int | None):
    """[B, T, M] -> [G, S, M] with S = group_size (default T: one sequence per group)."""
    b, t, m = x.shape
    s = group_size or t
    if (b * t) % s or (s % t and t % s):
        raise ConfigError(
            f"moe.group_size={s} must divide or be a multiple of the sequence length {t} "
            f"and divide the {b * t} tokens of a (micro)batch"
        )
    return x.reshape(b * t // s, s, m)


def moe_ffn(x, router, w_gate, w_up, w_down, settings: MoESettings, bias=None):
    """The MoE feed-forward's routed experts. x [B, T, M]; router [M, E]; w_gate, w_up [E, M, H];
    w_down [E, H, M]; bias [E]: DeepSeek-V3's selection bias (`moe.balance=bias`).

    Returns (y [B, T, M], aux) with aux scalars: `loss` (weighted aux loss, none under bias balancing,
    + z loss: added to the training loss), `aux_loss`, `z_loss` (unweighted), `drop_fraction`,
    `load_min`, `load_max`, and with a bias `expert_load` [E] (for `updated_bias`)."""
    b, t, m = x.shape
    dt = x.dtype
    stored = _stored_order(t, settings)
    if stored is not None:  # route in the sequence's own order, as one device does
        x = sequence.permute(constrain(x, ("batch", None, "embed"), "moe tokens BTM"), np.argsort(stored))
    xg = constrain(regroup(x, settings.group_size), TOKENS, "moe tokens GSM")
    logits = jnp.einsum("gsm,me->gse", xg.astype(jnp.float32), router.astype(jnp.float32))
    logits = constrain(logits, ROUTING, "router logits GSE")
    rng = None
    if settings.second_expert_policy == "random" and settings.top_k > 1:
        rng = _ROUTING_KEY.get()
        rng = jax.random.key(0) if rng is None else rng
        # a different stream per layer: fold in the (integer, hence sharding-exact) hash of its router
        bits = jax.lax.bitcast_convert_type(router.astype(jnp.float32), jnp.int32)
        rng = jax.random.fold_in(rng, jnp.sum(bits))
    einsum = DISPATCH == "einsum" and settings.capacity_factor is not None
    r = route(
        logits,
        settings.top_k,
        settings.capacity_factor,
        settings.second_expert_policy,
        rng,
        with_masks=einsum,
        score=settings.score,
        normalise=settings.normalise,
        bias=bias,
    )
    w = [a.astype(dt) for a in (w_gate, w_up, w_down)]
    if settings.capacity_factor is None:
        y = dropless(xg, r, *w)
    elif not einsum:
        cap = capacity(xg.shape[1], settings.num_experts, settings.top_k, settings.capacity_factor)
        y = dispatch_combine_gather(xg, r, *w, settings.num_experts, cap)
    else:
        r = r._replace(
            combine=constrain(r.combine, MASKS, "moe combine GSEC"),
            dispatch=constrain(r.dispatch, MASKS, "moe dispatch GSEC"),
        )
        y = dispatch_combine(xg, r, *w)
    aux_weight = 0.0 if settings.balance == "bias" else settings.aux_loss_weight
    aux = {
        "loss": aux_weight * r.aux_loss + settings.z_loss_weight * r.z_loss,
        "aux_loss": r.aux_loss,
        "z_loss": r.z_loss,
        "drop_fraction": r.drop_fraction,
        "load_min": jnp.min(r.load),
        "load_max": jnp.max(r.load),
    }
    if bias is not None:
        aux["expert_load"] = r.load
    y = y.reshape(b, t, m)
    return (y if stored is None else sequence.permute(y, stored)), aux


def _stored_order(t: int, settings: MoESettings):
    """The storage order [T] of the tokens when it is not the sequence's and routing depends on it
    (capacity: a token's slot is its rank in the sequence; random routing: its draw), else None.
    Context parallelism stores rows in its balanced order (`meshpar.core.sequence`); the layer then
    puts the tokens back in sequence order (a local gather: G's layout does not split S) and the
    output in storage order again, so which tokens are dropped is what one device drops."""
    if sequence.manual():
        raise ConfigError(
            "an MoE layer inside a pipeline stage split over mesh.context would route only the stage's "
            "share of each sequence (capacity and load balancing change); set mesh.context=1 or "
            "mesh.pipeline=1"
        )
    random = settings.second_expert_policy == "random" and settings.top_k > 1
    return sequence.stored_order(t) if settings.capacity_factor is not None or random else None
