"""The public `meshpar.attention`: attention on whatever the active layout makes of q, k and v. On
each device's tokens a kernel of `meshpar.nn.attention` runs (xla, flash, cudnn, splash; splash inside
a shard_map of its own, as Mosaic kernels need); with sequences split over `context` the attention
runs across the shards (`meshpar.parallel.context`: K/V gathered, or passed round a ring)."""

from __future__ import annotations

import jax

from meshpar.core.layout import active_layout
from meshpar.core.sequence import context_size
from meshpar.nn import attention as attn_lib
from meshpar.nn import splash as splash_lib
from meshpar.parallel.context import across, shard_mesh, specs


def attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    segment_ids=None,
    kv_segment_ids=None,
    window: int | None = None,
    softcap: float | None = None,
    implementation: str = "auto",
    block: int = attn_lib.DEFAULT_BLOCK,
    context_strategy: str = "all_gather",
):
    """softmax(mask(q k^T / sqrt(H))) v: q [B, T, N, H], k/v [B, S, K, H] -> [B, T, N, H], the layout
    of `jax.nn.dot_product_attention`. segment_ids [B, T] (kv_segment_ids [B, S], default the same):
    a query sees only keys of its own segment; window W: query i sees keys i-W+1..i (not causal:
    |i - j| < W); softcap c:
    scores c tanh(s / c) before masking; implementation: xla | flash | cudnn | splash | auto
    (meshpar.nn.attention). Sequences split over `context` attend across the shards by
    `context_strategy`: all_gather (K/V gathered) or ring (K/V passed round, flash only)."""
    mask = attn_lib.Mask(causal, window, softcap).check()
    kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
    attn_lib.check_shapes(q, k, v, mask, segment_ids, kv_seg)
    cp = context_size()
    if cp == 1:

        def local(impl):
            return lambda q, k, v, s, ks: attn_lib.local_attention(
                q, k, v, mask, q_seg=s, k_seg=ks, implementation=impl, block=block
            )

        if _kernel_unpartitionable(q, k, mask, segment_ids, kv_seg, implementation):  # chosen here, run per device
            return _per_device(local("splash"), q, k, v, segment_ids, kv_seg)
        return local(implementation)(q, k, v, segment_ids, kv_seg)
    return across(q, k, v, mask, segment_ids, kv_seg, implementation, block, cp, context_strategy)


def _kernel_unpartitionable(q, k, mask, q_seg, k_seg, implementation) -> bool:
    """True when the kernel serving this call is splash, a Mosaic kernel XLA's partitioner cannot
    split (it must run inside a shard_map), on a mesh of more than one device."""
    layout = active_layout()
    if layout is None or layout.mesh.size == 1:
        return False

    natural_ok = splash_lib.serves(q, k, q_seg, k_seg, True)
    return attn_lib.choose(implementation, q, k, mask, q_seg is not None, natural_ok) == "splash"


def _per_device(local, q, k, v, q_seg, k_seg):
    """`local` attention inside a shard_map manual over every mesh axis (a Mosaic kernel allows no
    auto axis), q split over the batch and heads' axes (`_specs`, sequence whole), replicated over the
    rest: each device attends its own rows and heads, as the kernel requires."""
    qs, ks, ss, _ = specs(q, k, seq=None)
    mesh = shard_mesh()
    axes = frozenset(mesh.axis_names) - frozenset(getattr(mesh, "manual_axes", ()))
    segs = None if q_seg is None else ss
    # check_vma off: jax's splash kernel declares its outputs without the varying-axes type
    return jax.shard_map(
        local, mesh=mesh, in_specs=(qs, ks, ks, segs, segs), out_specs=qs, axis_names=axes, check_vma=False
    )(q, k, v, q_seg, k_seg)
