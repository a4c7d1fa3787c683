"""What a checkpoint is checked against when it is restored: the signature of the state it must fit
(each leaf's shape and dtype) and its contents' fingerprint, sharding-independent per-leaf hashes
taken when it was saved (`meshpar.io.checkpoint`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _leaf_hash(x: jax.Array) -> jax.Array:
    """uint32 sum over elements of mix(bits, flat position). Integer addition mod 2^32 is associative,
    so the result is the same whatever the sharding and the order of the partial sums."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    elif x.dtype.itemsize == 8:  # only with jax_enable_x64: fold the two halves
        b = jax.lax.bitcast_convert_type(x, jnp.uint32)
        bits = b[..., 0] ^ b[..., 1]
    else:
        bits = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    pos = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(bits.ndim)):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= bits.shape[d]
    h = (bits + pos * jnp.uint32(0x9E3779B9)) * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 16)
    return jnp.sum(h, dtype=jnp.uint32)


def fingerprint(state) -> dict[str, int]:
    """{leaf path: uint32 hash} of a (sharded) state: one small jitted reduction, replicated result."""
    leaves = jax.tree_util.tree_leaves_with_path(state)
    arrays = [x for _, x in leaves]
    mesh = next((x.sharding.mesh for x in arrays if isinstance(x.sharding, NamedSharding)), None)
    hashes = _hash_fn(NamedSharding(mesh, PartitionSpec()) if mesh is not None else None)(arrays)
    values = np.asarray(hashes.addressable_data(0))
    return {jax.tree_util.keystr(p): int(v) for (p, _), v in zip(leaves, values)}


@functools.lru_cache(maxsize=8)
def _hash_fn(out_sharding):
    return jax.jit(lambda xs: jnp.stack([_leaf_hash(x) for x in xs]), out_shardings=out_sharding)


def tree_signature(abstract_state) -> dict[str, list]:
    """{leaf path: [shape, dtype]}: what a checkpoint must match to be restored into this run."""
    return {
        jax.tree_util.keystr(p): [list(a.shape), str(a.dtype)]
        for p, a in jax.tree_util.tree_leaves_with_path(abstract_state)
    }
