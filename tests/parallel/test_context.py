"""Context parallelism (meshpar/parallel/context.py): attention over sequences split on `context`
equals attention on one device, values and gradients, in natural and balanced order, for every
mask and both kernels; the balanced order gives every device the same causal work; the compiled
program gathers K/V over `context` (one all-gather each per layer forward, (cp-1)/cp of K/V
received); bad lengths fail in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshpar
from meshpar.core.config import from_dict
from meshpar.core.errors import ConfigError
from meshpar.core.layout import Layout, use_layout
from meshpar.core.mesh import make_mesh, mesh_shape
from meshpar.core.rules import get_strategy
from meshpar.nn import flash as flash_lib
from meshpar.parallel import context
from meshpar.plan.inspect import collectives
from tests.conftest import devices, make_cfg

B, T, N, K, H, CP = 2, 64, 4, 2, 8, 4


@pytest.fixture(scope="module")
def setup():
    devices(8)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))
    seg = jnp.asarray(np.sort(rng.integers(0, 3, size=(B, T)), axis=1))
    ct = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    mesh = make_mesh(from_dict({"mesh": {"context": CP, "data": 2}}).mesh)
    return (q, k, v, seg, ct), Layout(mesh, get_strategy("fsdp"))


def split(layout, impl, balanced, **kw):
    """Attention on rows stored in `balanced` (or natural) order, split over data x context, returned
    in natural order."""
    perm = context.order(T, CP) if balanced else np.arange(T)
    segments = kw.pop("segments", False)

    def f(q, k, v, seg):
        with use_layout(layout), context.balanced(balanced):
            q, k, v = (
                jax.lax.with_sharding_constraint(x[:, perm], NamedSharding(layout.mesh, P("data", "context")))
                for x in (q, k, v)
            )
            extra = dict(kw, segment_ids=seg[:, perm]) if segments else kw
            o = meshpar.attention(q, k, v, implementation=impl, block=4, **extra)
            return o[:, np.argsort(perm)]

    return f


@pytest.mark.parametrize("impl", ["flash", "xla"])
@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "natural"])
@pytest.mark.parametrize(
    "masks",
    [{}, {"segments": True}, {"segments": True, "window": 9, "softcap": 3.0}],
    ids=["causal", "segments", "all"],
)
def test_split_sequences_attend_as_one_device(setup, impl, balanced, masks):
    (q, k, v, seg, ct), layout = setup
    kw = dict(masks)
    ref_kw = {k_: v_ for k_, v_ in kw.items() if k_ != "segments"}
    if kw.get("segments"):
        ref_kw["segment_ids"] = seg
    f = split(layout, impl, balanced, **kw)
    ref = meshpar.attention(q, k, v, implementation="xla", **ref_kw)
    assert float(jnp.abs(jax.jit(f)(q, k, v, seg) - ref).max()) <= 1e-5
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, seg) * ct), (0, 1, 2)))(q, k, v)
    g0 = jax.grad(lambda q, k, v: jnp.sum(meshpar.attention(q, k, v, implementation="xla", **ref_kw) * ct), (0, 1, 2))(
        q, k, v
    )
    for a, b in zip(g, g0):
        assert float(jnp.abs(a - b).max()) <= 1e-5


def test_balanced_order_gives_every_device_the_same_causal_work():
    """Chunks d and 2cp-1-d: 2cp+1 chunk pairs per device; natural order: 1 .. 2cp-1 x the first's work."""
    t, cp, blk = 64, 4, 8
    work = {}
    for bal in (True, False):
        idx = (context.order(t, cp) if bal else np.arange(t)).reshape(cp, -1)
        work[bal] = [len(flash_lib.tiles(idx[d], idx.reshape(-1), blk, blk, True, None)) for d in range(cp)]
    assert work[True] == [2 * cp + 1] * cp  # chunk d sees d+1 key chunks, chunk 2cp-1-d 2cp-d
    assert work[False] == [3, 7, 11, 15]  # blocks 2d, 2d+1 see 2d+1 and 2d+2 key blocks
    assert sorted(context.order(8, 2)) == list(range(8)) and list(context.order(8, 2)) == [0, 1, 6, 7, 2, 3, 4, 5]


def test_keys_and_values_are_gathered_over_context(setup):
    """Forward: one all-gather of K and one of V over the 4 context devices (each [B/2, T, K, H] fp32
    out of a [B/2, T/4, K, H] shard: (cp-1)/cp of the result received), nothing else over `context`."""
    (q, k, v, seg, _), layout = setup
    f = split(layout, "flash", True)
    hlo = jax.jit(f).lower(q, k, v, seg).compile().as_text()
    gathers = [
        c for c in collectives(hlo, mesh_shape(layout.mesh)) if c["kind"] == "all-gather" and "context" in c["axes"]
    ]
    per = B // 2 * T * K * H * 4
    assert len(gathers) == 2 and all(c["bytes"] == per for c in gathers)


def test_length_not_divisible_by_twice_context_is_one_line():
    from meshpar.train.step import Trainer

    with pytest.raises(ConfigError, match=r"batch.length=20 is not divisible by 2 x mesh.context = 8"):
        make_cfg("batch.length=20", mesh={"context": 4, "data": 2})
    # a mesh that is not the config's `devices` (mesh.context=4 of devices=8): said when the mesh is built on 4
    with pytest.raises(ConfigError, match=r"batch.length=20 is not divisible by 2 x mesh.context = 8"):
        Trainer(make_cfg("batch.length=20", mesh={"context": 4}), devices=devices(4))
    with pytest.raises(ConfigError, match="cudnn cannot attend across mesh.context"):
        make_cfg("model.attention=cudnn", "batch.length=16", mesh={"context": 4, "data": 2})


@pytest.mark.parametrize(
    "balanced,impl", [(True, "flash"), (False, "flash"), (True, "auto")], ids=["balanced", "natural", "auto"]
)
@pytest.mark.parametrize("masks", [{}, {"segments": True, "window": 9, "softcap": 3.0}], ids=["causal", "all"])
def test_the_ring_attends_as_one_device(setup, balanced, impl, masks):
    """K/V passed round the ring (cp - 1 hops, merged by log-sum-exp): values and gradients of one
    device (`auto` means flash there, whatever the length)."""
    (q, k, v, seg, ct), layout = setup
    kw = dict(masks, context_strategy="ring")
    ref_kw = {k_: v_ for k_, v_ in masks.items() if k_ != "segments"}
    if masks.get("segments"):
        ref_kw["segment_ids"] = seg
    f = split(layout, impl, balanced, **kw)
    ref = lambda q, k, v: meshpar.attention(q, k, v, implementation="xla", **ref_kw)
    assert float(jnp.abs(jax.jit(f)(q, k, v, seg) - ref(q, k, v)).max()) <= 1e-5
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, seg) * ct), (0, 1, 2)))(q, k, v)
    g0 = jax.grad(lambda q, k, v: jnp.sum(ref(q, k, v) * ct), (0, 1, 2))(q, k, v)
    for a, b in zip(g, g0):
        assert float(jnp.abs(a - b).max()) <= 1e-5


def test_the_ring_permutes_kv_shards_instead_of_gathering(setup):
    """Forward: (cp - 1) hops of K, V (and nothing gathered over `context`), each a [b, T/cp, K, H]
    shard: the same bytes the all-gather moves, two shards alive at a time."""
    (q, k, v, seg, _), layout = setup
    hlo = jax.jit(split(layout, "flash", True, context_strategy="ring")).lower(q, k, v, seg).compile().as_text()
    ops = [
        c
        for c in collectives(hlo, mesh_shape(layout.mesh))
        if "context" in c["axes"] or c["kind"] == "collective-permute"
    ]
    permutes = [c for c in ops if c["kind"] == "collective-permute"]
    assert not [c for c in ops if c["kind"] == "all-gather"]
    assert sum(c["bytes"] * c["times"] for c in permutes) == 2 * (CP - 1) * (B // 2) * (T // CP) * K * H * 4
