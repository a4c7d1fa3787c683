"""Dropless MoE (MegaBlocks, Gale et al. 2023): every routed token is computed, none dropped. Each
device sends its tokens' rows to the devices of their experts (an all-to-all over `expert`, ragged
where the backend has one: `meshpar.nn.exchange`), runs its experts as grouped matmuls
(`meshpar.nn.gmm`) on rows sorted by expert, and sends the results back.

Letters as `meshpar.nn.routing`'s: G groups, S tokens per group, M embed, H expert_mlp, E experts,
K experts per token; R rows a device receives.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshpar.core import scopes, sequence
from meshpar.core.layout import active_layout, constrain
from meshpar.nn import exchange as exchange_lib
from meshpar.nn.exchange import exchange
from meshpar.nn.gmm import grouped_matmul
from meshpar.nn.layers import swiglu
from meshpar.nn.routing import TOKENS, W_IN, Routing

# dropless mode's grouped matmuls: "auto" (row tiles on CPU, `ragged_dot` elsewhere), "ragged_dot", "tiles"
GMM = "auto"
# dropless mode's token exchange: "auto" (padded all-to-all on CPU, ragged_all_to_all elsewhere), "ragged", "padded"
EXCHANGE = "auto"
# the wire under EXCHANGE="ragged"'s packed layout: "ragged" (ragged_all_to_all); "padded" runs the same layout
# and offsets over JAX's documented semantics on any backend (the CPU tests of the GPU/TPU path)
PACKED_WIRE = "ragged"


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _spec_axes(spec, n: int) -> list[tuple[str, ...]]:
    parts = list(spec) + [None] * (n - len(spec))
    return [_axes(p) for p in parts]


def _chunk_of(starts, positions):
    """For each position, the last chunk (of those starting at `starts`, ascending) that starts at or
    before it: the chunk holding it, also past empty chunks that share its start."""
    return jnp.sum(starts[None, 1:] <= positions[:, None], axis=-1)


def _dropless_local(x, index, routed, gates, w_gate, w_up, w_down, ep_axes=(), ep=1, h_axes=()):
    """One device's share of the dropless MoE. x [n, M]; index, routed, gates [n, K]; local experts
    w_gate, w_up [E_l, M, H_l], w_down [E_l, H_l, M] -> [n, M].

    The n*K assignments are sorted by expert (unrouted ones last, never sent). The shard owning
    experts [d*E_l, (d+1)*E_l) gets its rows by a ragged exchange over `ep_axes`
    (`meshpar.nn.exchange`): `ragged_all_to_all` on GPU/TPU, packed source after source into a buffer
    [ep*R, M] (static, sized for the worst case: a token's K experts are distinct, so a source sends a
    shard at most R = n*min(K, E_l) rows, not n*K; MaxText's bound); on CPU an all-to-all of slices
    padded to R rows, source s at rows s*R. The receiver orders its
    rows by local expert and runs SwiGLU as grouped matmuls (`meshpar.nn.gmm`); partial sums over
    `h_axes` (H split by tensor parallelism) are reduced; the rows return by the reverse exchange,
    each to its sorted position, and are weighted by their gates."""
    n, k = index.shape
    e_local = w_gate.shape[0]
    e_total = e_local * ep
    nk = n * k
    r = n * min(k, e_local)  # rows one source can send one shard
    j = jnp.arange(nk)
    flat_e = jnp.where(routed, index, e_total).reshape(nk)  # unrouted -> sentinel E
    order = jnp.argsort(flat_e, stable=True)  # assignments sorted by expert
    counts = jnp.bincount(flat_e, length=e_total + 1)[:e_total].astype(jnp.int32)  # [E]
    per_dest = counts.reshape(ep, e_local)  # [ep, E_l] rows for each shard
    send = jnp.sum(per_dest, axis=1)  # [ep]
    dest_start = jnp.cumsum(send) - send
    recv_counts = exchange_lib.swap(per_dest, ep_axes)  # [ep (source), E_l]
    recv = jnp.sum(recv_counts, axis=1)  # [ep] rows from each source
    dt = x.dtype
    ragged = exchange_lib.resolve(EXCHANGE, ep_axes) == "ragged"
    if ragged:  # packed: source after source
        recv_start = jnp.cumsum(recv) - recv
        buf = exchange(
            x[order // k],
            jnp.zeros((ep * r, x.shape[1]), dt),
            dest_start,
            send,
            exchange_lib.swap(recv_start, ep_axes),
            recv,
            ep_axes,
            PACKED_WIRE,
        )  # [ep*R, M]
    else:  # source s at rows s*R.. (padded)
        recv_start = jnp.arange(ep, dtype=recv.dtype) * r
        buf = exchange_lib.dense(x[order // k], dest_start, send, ep_axes, r).reshape(ep * r, -1)
    # local expert of every received row (E_l: padding), then all rows grouped by local expert
    jj = jnp.arange(ep * r)
    src = _chunk_of(recv_start, jj)
    bounds = jnp.cumsum(recv_counts, axis=1)[src]  # [ep*nK, E_l]
    local = jnp.sum(bounds <= (jj - recv_start[src])[:, None], axis=-1)
    local = jnp.where(jj - recv_start[src] < recv[src], local, e_local)
    order2 = jnp.argsort(local, stable=True)
    rows = buf[order2]
    sizes = jnp.sum(recv_counts, axis=0).astype(jnp.int32)  # [E_l] rows per local expert
    gate = grouped_matmul(rows, w_gate, sizes, GMM)
    up = grouped_matmul(rows, w_up, sizes, GMM)
    out = grouped_matmul(swiglu(gate, up), w_down, sizes, GMM)  # [ep*R, M]
    if h_axes:
        out = jax.lax.psum(out, h_axes)
    inv2 = jnp.zeros_like(order2).at[order2].set(jnp.arange(ep * r))
    # each row back to its sender, at its sorted position there; unrouted positions stay 0
    if ragged:
        per_sorted = exchange(
            out[inv2],
            jnp.zeros((nk, x.shape[1]), out.dtype),
            recv_start,
            recv,
            exchange_lib.swap(dest_start, ep_axes),
            send,
            ep_axes,
            PACKED_WIRE,
            slice_rows=nk,
        )  # [nK, M]: a source sent at most nK
    else:  # sorted position p came back from shard d at row p - dest_start[d] of its slice
        back = exchange_lib.dense(out[inv2], recv_start, recv, ep_axes, r).reshape(ep * r, -1)  # [ep*R, M]
        d = _chunk_of(dest_start, j)
        per_sorted = jnp.where((j < jnp.sum(send))[:, None], back[d * r + j - dest_start[d]], 0)
    inv = jnp.zeros_like(order).at[order].set(j)
    per_assignment = per_sorted[inv].reshape(n, k, -1)
    return jnp.einsum("nkm,nk->nm", per_assignment, gates.astype(dt))


_BRANCHES = scopes.BRANCHES


@contextlib.contextmanager
def in_device_branches(on: bool = True) -> Iterator[None]:
    """Declare that layers traced inside run in per-device branches (1F1B's `lax.switch` on the stage
    index): dropless routing then runs replicated over the stage's devices (see `dropless`)."""
    token = _BRANCHES.set(on)
    try:
        yield
    finally:
        _BRANCHES.reset(token)


def dropless(x, r: Routing, w_gate, w_up, w_down):
    """Dropless mode. x [G, S, M], r.index/r.gates [G, S, K] -> [G, S, M].

    Under a layout: `shard_map` over the whole mesh, tokens split as `group`, experts split as
    `expert` (all-to-all over those mesh axes), H split over the axes `expert_mlp` resolves to that
    tokens do not use (Megatron-style psum). Parameters are never gathered over `expert`.
    Inside the pipeline's shard_map (already manual over `pipeline`) the one-device computation runs
    auto-partitioned instead: XLA places it (gathering expert weights where it must). A nested
    shard_map there trips JAX 0.10's derivation of residual/cotangent specs under Shardy. Inside
    1F1B's per-device branches (`in_device_branches`) it runs replicated over the stage's devices,
    tokens and expert weights gathered first: XLA:CPU partitions the sort and grouped matmuls with
    collective-permutes, whose rendezvous waits for every device of the program, also those of the
    other stages, which run other branches (a deadlock). That repeats the expert work on each of the
    stage's devices: correct, not fast; GPipe and interleaved keep the partitioned path."""
    g, s, m = x.shape
    k = r.index.shape[-1]
    layout = active_layout()
    if layout is not None and _BRANCHES.get():  # replicated: no collective-permute inside a branch
        rep = lambda a: jax.lax.with_sharding_constraint(a, P())
        x, w_gate, w_up, w_down = map(rep, (x, w_gate, w_up, w_down))
        r = r._replace(index=rep(r.index), routed=rep(r.routed), gates=rep(r.gates))
    if layout is None or sequence.in_manual_region():
        y = _dropless_local(
            x.reshape(g * s, m),
            r.index.reshape(g * s, k),
            r.routed.reshape(g * s, k),
            r.gates.reshape(g * s, k),
            w_gate,
            w_up,
            w_down,
        )
        return y.reshape(g, s, m)
    g_axes = _spec_axes(layout.spec(("group",)), 1)[0]
    e_axes, _, h_axes = _spec_axes(layout.spec(W_IN, w_gate.shape, "moe expert weights"), 3)
    h_axes = tuple(a for a in h_axes if a not in g_axes)
    ep = math.prod(layout.shape[a] for a in e_axes)
    tok = P(g_axes or None, None, None)
    w_in, w_out = P(e_axes or None, None, h_axes or None), P(e_axes or None, h_axes or None, None)
    x = constrain(x, TOKENS, "moe tokens GSM")

    # Tokens not split over the expert axes (a decode batch smaller than them): every expert shard
    # holds all tokens, computes the rows routed to its own experts, and the shards' outputs are summed.
    replicated = bool(e_axes) and not set(e_axes) & set(g_axes)

    def local(x, index, routed, gates, wg, wu, wd):
        gl = x.shape[0]
        flat = lambda a: a.reshape(gl * s, *a.shape[2:])  # noqa: E731
        if replicated:
            first = jax.lax.axis_index(e_axes) * wg.shape[0]
            mine = routed & (index >= first) & (index < first + wg.shape[0])
            y = _dropless_local(flat(x), flat(index - first), flat(mine), flat(gates), wg, wu, wd, h_axes=h_axes)
            return jax.lax.psum(y, e_axes).reshape(gl, s, m)
        y = _dropless_local(flat(x), flat(index), flat(routed), flat(gates), wg, wu, wd, e_axes, ep, h_axes)
        return y.reshape(gl, s, m)

    fn = jax.shard_map(local, mesh=layout.mesh, in_specs=(tok, tok, tok, tok, w_in, w_in, w_out), out_specs=tok)
    return constrain(fn(x, r.index, r.routed, r.gates, w_gate, w_up, w_down), TOKENS, "moe combined GSM")
