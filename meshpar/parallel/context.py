"""Context parallelism: one sequence split over the `context` mesh axis (Megatron-LM's CP; Llama 3's
all-gather CP, Grattafiori et al. 2024): the attention across the shards (`across`) that the public
`meshpar.attention` (`meshpar.parallel.attention`) runs when sequences are split.

Shapes: B batch, T queries, S keys, N query heads, K key/value heads, H head width; cp devices on
`context`; C = T / (2 cp) tokens per chunk.

Layout. The rule tables map `length` and `seq` to `context`, so every [B, T, ...] activation is cut
along T and everything but attention is token-local (GSPMD needs nothing more; weight gradients
are summed over `context` as over `data`). Two orders of the tokens on the devices:

    natural   device d holds tokens d T/cp .. (d+1) T/cp - 1
    balanced  T cut into 2cp chunks; device d holds chunks d and 2cp-1-d (zig-zag). Causal work is
              then the same on every device: chunk d sees d+1 chunks of keys, chunk 2cp-1-d sees
              2cp-d, 2cp+1 in all; in natural order the last device does 2cp-1 times the first's.

The built-in LM loss stores its rows balanced (`balance` permutes tokens, targets, positions and
segment ids alike, under `balanced()`); every other caller's activations are in natural order:
correct, unbalanced. The orders, the `balanced()` flag and `context_size` live in
`meshpar.core.sequence` (re-exported here), where layers below this one (MoE capacity) read them.

Attention across shards, inside `jax.shard_map` manual over `context` and the batch axes (and the
heads' axes; or inside the pipeline's shard_map, which is manual over `context` when sequences are
split: `meshpar.parallel.pipeline`), one custom VJP (`model.context_strategy`):

    all_gather  (default; Llama 3) each device all-gathers K and V [b, S/cp, K, H] -> [b, S, K, H]
                (small under GQA, K << N) and attends its own queries with the tiles its own indices
                leave, so flash skips the chunks its causal mask hides; the backward gathers again
                and reduce-scatters dK, dV. Per layer and device: forward (cp-1)/cp x 2 b S K H
                elements received, backward as much again plus the scatter.
    ring        (Ring Attention, Liu et al. 2023) K/V shards hop round the ring with `ppermute`,
                cp - 1 hops, partial results merged by their log-sum-exp; the backward sends K/V
                round again (cp - 1 hops) with their fp32 dK/dV accumulators (cp hops). The
                forward moves the all-gather's bytes, the backward about twice its bytes in bf16;
                hop by hop (`_in_turn`), only two K/V shards and one hop's partial sums live at a
                time, and each hop's transfer can hide behind the previous block's compute. (The
                planner costs the all-gather's traffic for both, and each one's own buffers.)
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from meshpar.core.config.checks import check_context_attention, check_length
from meshpar.core.config.schema import CONTEXT_STRATEGIES
from meshpar.core.errors import ConfigError, suggest
from meshpar.core.layout import active_layout
from meshpar.core.precision import gather_dtype
from meshpar.core.rules import spec_axes
from meshpar.core.sequence import AXIS, balanced, context_size, is_balanced, manual, order  # noqa: F401 (this module's API)
from meshpar.nn import attention as attn_lib
from meshpar.nn import flash as flash_lib


def balance(*rows):
    """Rows [B, T] (or [T]) in natural order -> the balanced order, when the active layout splits
    sequences over `context` (else unchanged). Use under `balanced()`."""
    cp = context_size()
    if cp == 1:
        return rows
    perm = order(rows[0].shape[-1], cp)
    return tuple(None if r is None else jnp.take(r, perm, axis=-1) for r in rows)


def balance_rows(rows: dict, positions: bool = False) -> dict:
    """Rows {name: [B, T]} -> the balanced order when sequences are split over `context`, with the
    positions (which the order scrambles) made explicit first; else unchanged (with `positions`,
    made explicit anyway)."""
    cp = context_size()
    if cp > 1 or positions:
        first = next(iter(rows.values()))
        rows = {"positions": jnp.broadcast_to(jnp.arange(first.shape[1], dtype=jnp.int32), first.shape), **rows}
    return rows if cp == 1 else dict(zip(rows, balance(*rows.values())))


def _indices(t: int, cp: int, balanced_order: bool) -> np.ndarray:
    """Sequence indices [cp, T/cp] of the tokens each device holds."""
    idx = order(t, cp) if balanced_order else np.arange(t)
    return idx.reshape(cp, t // cp)


def shard_mesh():
    """The mesh a shard_map here runs on: the active (abstract) mesh, else the layout's."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh if mesh.axis_names else active_layout().mesh


def specs(q, k, seq=AXIS):
    """shard_map specs of q [B, T, N, H], k/v [B, S, K, H] and segment ids [B, T], and the manual
    axes: the batch axes, `seq` (`context`), and the heads' axes when query and key/value heads split
    alike (a query head's key/value head then sits on its device). Attention is then local but for the
    gathered keys; with the batch axes left auto, XLA gathered whole batches into each device."""
    layout = active_layout()
    qspec = tuple(layout.spec(("batch", "seq", "heads", "kv"), q.shape)) + (None,) * 4
    kspec = tuple(layout.spec(("batch", "seq", "kv_heads", "kv"), k.shape)) + (None,) * 4
    batch, heads = qspec[0], (qspec[2] if qspec[2] == kspec[2] else None)
    qs, ks, ss = P(batch, seq, heads), P(batch, seq, heads), P(batch, seq)
    return qs, ks, ss, frozenset(spec_axes(qs))


@dataclass(frozen=True)
class _Call:
    """What one context-parallel attention call knows before tracing."""

    cp: int
    impl: str  # flash | xla
    mask: attn_lib.Mask
    kern: flash_lib.Kernel
    q_idx: np.ndarray  # [cp, T/cp] sequence indices of each device's queries
    k_idx: np.ndarray  # [cp, S/cp] ... of each device's keys


def _gather(x):
    """[B, S/cp, ...] -> [B, S, ...] over `context` (in fp32 on CPU: see precision.gather_dtype)."""
    if x is None:
        return None
    return lax.all_gather(x.astype(gather_dtype(x.dtype)), AXIS, axis=1, tiled=True).astype(x.dtype)


def _scatter(x):
    return lax.psum_scatter(x.astype(gather_dtype(x.dtype)), AXIS, scatter_dimension=1, tiled=True).astype(x.dtype)


def _all_gather(c: _Call):
    """Llama 3's CP: K/V all-gathered, queries local; the backward reduce-scatters dK/dV. The
    indices and tiles are shard_map operands (row d on device d), not constants made inside,
    which partial evaluation would hoist out. -> (forward, backward, operands, their specs)."""
    k_all = c.k_idx.reshape(-1)
    table = flash_lib.pad_tiles(
        [flash_lib.tiles(c.q_idx[d], k_all, c.kern.bq, c.kern.bk, c.mask.causal, c.mask.window) for d in range(c.cp)]
    )

    def fwd(q, k, v, q_seg, k_seg, qi, ki, tiles):
        k, v, k_seg = _gather(k), _gather(v), _gather(k_seg)
        if c.impl == "flash":
            return flash_lib.forward(c.kern, q, k, v, qi[0], ki, q_seg, k_seg, tiles[0])
        o = attn_lib.reference(q, k, v, c.mask, qi[0], ki, q_seg, k_seg)
        return o, o[:, :, : k.shape[2], :1].astype(jnp.float32) * 0.0  # no lse: [B, T, K, 1] zeros

    def bwd(q, k, v, q_seg, k_seg, qi, ki, tiles, o, lse, do):
        kg, vg, k_seg = _gather(k), _gather(v), _gather(k_seg)
        if c.impl == "flash":
            dq, dk, dv = flash_lib.backward(c.kern, q, kg, vg, qi[0], ki, q_seg, k_seg, tiles[0], o, lse, do)
        else:
            f = lambda q, k, v: attn_lib.reference(q, k, v, c.mask, qi[0], ki, q_seg, k_seg)
            dq, dk, dv = jax.vjp(f, q, kg, vg)[1](do)
        return dq, _scatter(dk), _scatter(dv)

    return fwd, bwd, (c.q_idx, k_all, table), (P(AXIS), P(), P(AXIS))


def _merge(o, lse, o2, lse2):
    """Two partial attentions over disjoint keys -> one: weights e^(lse_i - lse), lse = log sum e^lse_i."""
    m = jnp.maximum(lse, lse2)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    w1, w2 = jnp.exp(lse - m_safe), jnp.exp(lse2 - m_safe)
    total = w1 + w2
    out = (o.astype(jnp.float32) * _heads(w1, o) + o2.astype(jnp.float32) * _heads(w2, o)) / _heads(
        jnp.where(total == 0, 1.0, total), o
    )  # fp32: the caller casts once, at the end
    return out, jnp.where(total == 0, -jnp.inf, m_safe + jnp.log(jnp.where(total == 0, 1.0, total)))


def _heads(w, o):
    """[B, T, K, G] weights -> [B, T, N, 1] to scale o [B, T, N, H] (query head n = k G + g)."""
    return w.reshape(w.shape[0], w.shape[1], -1)[..., None]


def _ring(c: _Call):
    """Ring attention (Liu et al. 2023): K/V shards travel the ring with `ppermute` (cp - 1 hops, the
    next hop's transfer issued before this hop's blocks are computed), partial results merged with
    the online-softmax weights; the backward sends K/V round again with their dK/dV accumulators,
    which reach their owner after one more hop. At hop h device d holds device (d - h)'s shard."""
    check_context_attention("ring", c.impl)
    n, ring = c.cp, [(j, (j + 1) % c.cp) for j in range(c.cp)]
    src = [[(d - h) % n for h in range(n)] for d in range(n)]
    tables = flash_lib.pad_tiles(
        [
            flash_lib.tiles(c.q_idx[d], c.k_idx[src[d][h]], c.kern.bq, c.kern.bk, c.mask.causal, c.mask.window)
            for d in range(n)
            for h in range(n)
        ]
    )
    tables = tables.reshape(n, n, *tables.shape[1:])  # [cp (device), cp (hop), P, 3]
    k_of = np.stack([[c.k_idx[src[d][h]] for h in range(n)] for d in range(n)])  # [cp, cp, S/cp]
    send = lambda *xs: tuple(None if x is None else lax.ppermute(x, AXIS, ring) for x in xs)

    def fwd(q, k, v, q_seg, k_seg, qi, ki, tiles):
        o = lse = None
        for h in range(n):
            nxt = send(k, v, k_seg) if h < n - 1 else None
            o2, lse2 = flash_lib.forward(c.kern, q, k, v, qi[0], ki[0, h], q_seg, k_seg, tiles[0, h])
            o, lse = (o2.astype(jnp.float32), lse2) if o is None else _merge(o, lse, o2, lse2)
            if nxt is not None:
                (o, lse), (k, v, k_seg) = _in_turn((o, lse), nxt)
        return o.astype(q.dtype), lse

    def bwd(q, k, v, q_seg, k_seg, qi, ki, tiles, o, lse, do):
        dq = dk = dv = 0.0
        for h in range(n):
            nxt = send(k, v, k_seg) if h < n - 1 else None
            dq_h, dk_h, dv_h = flash_lib.backward(
                c.kern, q, k, v, qi[0], ki[0, h], q_seg, k_seg, tiles[0, h], o, lse, do
            )
            sums = (dq + dq_h.astype(jnp.float32), dk + dk_h.astype(jnp.float32), dv + dv_h.astype(jnp.float32))
            if nxt is not None:
                sums, (k, v, k_seg) = _in_turn(sums, nxt)
            dq, (dk, dv) = sums[0], send(*sums[1:])
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    return fwd, bwd, (c.q_idx, k_of, tables), (P(AXIS), P(AXIS), P(AXIS))


def _in_turn(done, arrived):
    """(done, arrived) unchanged, with the next hop's K/V shards (`arrived`) readable only once this
    hop's sums (`done`: its merged output; dQ, dK, dV) exist (`lax.optimization_barrier`), so one
    hop's partial results live at a time. Without it XLA:GPU ran every hop's flash blocks first and
    summed after, holding every hop's fp32 dQ and bf16 dK, dV partials: 1b at context=32 on 64 H100s
    peaked at 4.46 GiB per device, 2.19 with it. The backward's K/V sends are then its own, as the
    ring's backward is written: XLA no longer shares them with the recomputed forward's, 25% more
    permute bytes there (41.6 against 33.3 GB a step), fewer of them exposed (22.1 against 24.0).
    Sending the shards as they travel instead kept the shared sends and every hop's K/V: 2.65 GiB
    on the H100, and libtpu's v5p program (context=4) no smaller at all (5.45 GiB; 4.89 as here)."""
    kept = [x for x in arrived if x is not None]
    every = (*done, *kept)  # one varying type for all (segment ids may vary over fewer manual axes)
    done, kept = lax.optimization_barrier(
        tuple(tuple(flash_lib.varying_like(x, *every) for x in g) for g in (done, kept))
    )
    it = iter(kept)
    return done, tuple(None if x is None else next(it) for x in arrived)


STRATEGIES = {"all_gather": _all_gather, "ring": _ring}
assert tuple(STRATEGIES) == CONTEXT_STRATEGIES, "one strategy per option of model.context_strategy"


def across(q, k, v, mask, q_seg, k_seg, implementation, block, cp, strategy):
    """Context-parallel attention as one custom VJP over two `shard_map`s (manual over `context` and
    the batch axes): the strategy's forward (K/V gathered or passed round a ring), its backward
    (flash: from the saved o and lse), so no autodiff of a shard_map hands residuals across its
    boundary. Inside a shard_map already manual over `context` (a pipeline stage, whose rows arrive
    split and balanced) the strategy's functions run as they are, no shard_map nested."""
    inside = manual()  # already local in length: [B, T/cp, ...]
    t, s = (q.shape[1] * cp, k.shape[1] * cp) if inside else (q.shape[1], k.shape[1])
    in_balanced = is_balanced()
    for n, what in ((t, "the queries' length"), (s, "the keys' length")):
        if in_balanced:
            check_length(n, cp, what)
        elif n % cp:
            raise ConfigError(f"{what} {n} is not divisible by mesh.context={cp}")
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown context strategy '{strategy}'" + suggest(strategy, STRATEGIES))
    whole_k = jax.ShapeDtypeStruct((k.shape[0], s, *k.shape[2:]), k.dtype)  # auto decides by the whole length
    impl = attn_lib.choose(implementation, q, whole_k, mask, q_seg is not None)
    if implementation == "auto" and (impl in ("cudnn", "splash") or strategy == "ring"):
        impl = "flash"  # what auto means across shards: cudnn and splash cannot, the ring merges lse
    check_context_attention(strategy, impl)
    unit_q = t // (2 * cp) if in_balanced else t // cp
    unit_k = s // (2 * cp) if in_balanced else s // cp
    kern = flash_lib.Kernel(
        mask.causal,
        mask.window,
        mask.softcap,
        1.0 / float(np.sqrt(q.shape[-1])),
        flash_lib.block_size(unit_q, block),
        flash_lib.block_size(unit_k, block),
    )
    call = _Call(cp, impl, mask, kern, _indices(t, cp, in_balanced), _indices(s, cp, in_balanced))
    fwd_local, bwd_local, consts, const_specs = STRATEGIES[strategy](call)

    if inside:  # each device's rows of the per-device operands, picked by its index on `context`
        fwd, bwd, rows = fwd_local, bwd_local, lax.axis_index(AXIS)
        consts = [
            x if sp == P() else lax.dynamic_index_in_dim(jnp.asarray(x, jnp.int32), rows, 0)
            for x, sp in zip(consts, const_specs)
        ]
    else:
        fwd, bwd = _mapped(q, k, q_seg, fwd_local, bwd_local, const_specs)

    @jax.custom_vjp
    def run(q, k, v, q_seg, k_seg, *consts):
        return fwd(q, k, v, q_seg, k_seg, *consts)[0]

    def run_fwd(q, k, v, q_seg, k_seg, *consts):
        o, lse = fwd(q, k, v, q_seg, k_seg, *consts)
        return o, (q, k, v, q_seg, k_seg, consts, o, lse)

    def run_bwd(res, do):
        q, k, v, q_seg, k_seg, consts, o, lse = res
        grads = bwd(q, k, v, q_seg, k_seg, *consts, o, lse, do)
        grads = [flash_lib.varying_like(g, x) for g, x in zip(grads, (q, k, v))]  # typed like their inputs
        return (*grads, None, None, None, None, None)

    run.defvjp(run_fwd, run_bwd)
    return run(q, k, v, q_seg, k_seg, *(jnp.asarray(x, jnp.int32) for x in consts))


def _mapped(q, k, q_seg, fwd_local, bwd_local, const_specs):
    """The strategy's per-device forward and backward as `shard_map`s manual over `context`, the batch
    axes and the heads' axes (`_specs`)."""
    qs, ks, ss, axes = specs(q, k)
    segs = None if q_seg is None else ss
    mesh = shard_mesh()
    smap = lambda f, ins, outs: jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs, axis_names=axes)
    return (
        smap(fwd_local, (qs, ks, ks, segs, segs, *const_specs), (qs, ks)),
        smap(bwd_local, (qs, ks, ks, segs, segs, *const_specs, qs, ks, qs), (qs, ks, ks)),
    )
