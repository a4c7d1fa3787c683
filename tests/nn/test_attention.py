"""`meshpar.attention` (meshpar/nn/attention.py, meshpar/nn/flash.py): xla and flash equal a naive
softmax attention, values and gradients, for every mask (causal, segment ids, window, soft-cap, all
together) with grouped KV heads; flash walks only the tiles a mask leaves (about half the matmul
FLOPs when causal) and its compiled temporaries grow as S, not S^2; bad input fails in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshpar
from meshpar.core.errors import ConfigError
from meshpar.nn import flash as flash_lib
from meshpar.train.flops import matmul_flops

B, T, N, K, H = 2, 64, 4, 2, 8


def naive(q, k, v, causal=True, segment_ids=None, window=None, softcap=None):
    """softmax(q k^T / sqrt(H) + mask) v with K/V heads repeated, every score materialised."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    i, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None]
    vis = np.ones((q.shape[1], k.shape[1]), bool)
    if causal:
        vis &= j <= i
    if window:
        vis &= np.abs(i - j) < window
    vis = jnp.asarray(vis)[None, None]
    if segment_ids is not None:
        vis = vis & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(jnp.where(vis, s, -1e30), -1), v)


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))
    seg = jnp.asarray(np.sort(rng.integers(0, 3, size=(B, T)), axis=1))
    ct = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    return q, k, v, seg, ct


MASKS = {
    "causal": {},
    "segments": {"seg": True},
    "window": {"window": 7},
    "softcap": {"softcap": 2.0},
    "all": {"seg": True, "window": 9, "softcap": 3.0},
    "bidirectional+segments": {"causal": False, "seg": True},
    "bidirectional+window": {"causal": False, "window": 5},
}


@pytest.mark.parametrize("impl", ["xla", "flash"])
@pytest.mark.parametrize("name", list(MASKS))
def test_values_and_gradients_equal_naive_attention(qkv, impl, name):
    q, k, v, seg, ct = qkv
    kw = dict(MASKS[name])
    if kw.pop("seg", False):
        kw["segment_ids"] = seg
    _assert_equals_naive(q, k, v, ct, kw, implementation=impl, block=16)


def _assert_equals_naive(q, k, v, ct, kw, **how):
    """meshpar.attention(**kw, **how) and `naive` agree within 1e-5: values, and the gradients of
    sum(o * ct) with respect to q, k and v."""
    ours = lambda q, k, v: meshpar.attention(q, k, v, **how, **kw)
    ref = lambda q, k, v: naive(q, k, v, **kw)
    assert float(jnp.abs(jax.jit(ours)(q, k, v) - ref(q, k, v)).max()) <= 1e-5
    g = jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a) * ct), (0, 1, 2)))(q, k, v)
    g0 = jax.grad(lambda *a: jnp.sum(ref(*a) * ct), (0, 1, 2))(q, k, v)
    for a, b in zip(g, g0):
        assert float(jnp.abs(a - b).max()) <= 1e-5


def test_flash_walks_only_the_tiles_the_mask_leaves():
    """8 x 8 blocks: causal lists 36 tiles of 64 and its matmul FLOPs (forward + backward, counted
    from the traced program, where a scan's body counts once per iteration) are 36/64 of the
    unmasked; a window of one block lists the diagonal and the one below."""
    idx = np.arange(256)
    assert len(flash_lib.tiles(idx, idx, 32, 32, causal=True, window=None)) == 36
    assert len(flash_lib.tiles(idx, idx, 32, 32, causal=False, window=None)) == 64
    assert len(flash_lib.tiles(idx, idx, 32, 32, causal=True, window=32)) == 8 + 7
    q = jnp.zeros((1, 256, 2, 16))

    def fl(causal):
        f = lambda q: jnp.sum(meshpar.attention(q, q, q, causal=causal, implementation="flash", block=32))
        return matmul_flops(jax.make_jaxpr(jax.value_and_grad(f))(q))

    assert fl(True) / fl(False) == pytest.approx(36 / 64, rel=1e-6)


def test_flash_temporaries_grow_with_s_not_s_squared():
    """Compiled temp bytes of value-and-grad at S and 4S on one device: xla's grow about 16x (the
    [B, N, S, S] scores and probabilities), flash's about 4x; at 2048 flash's are under 1/4 of xla's."""

    def temp(impl, s):
        q = jax.ShapeDtypeStruct((1, s, 2, 16), jnp.float32)
        f = lambda q, k, v: jnp.sum(meshpar.attention(q, k, v, implementation=impl))
        c = jax.jit(jax.value_and_grad(f, (0, 1, 2))).lower(q, q, q).compile()
        return c.memory_analysis().temp_size_in_bytes

    xla = [temp("xla", s) for s in (512, 2048)]
    fl = [temp("flash", s) for s in (512, 2048)]
    assert xla[1] / xla[0] > 10 and fl[1] / fl[0] < 6
    assert fl[1] <= 0.25 * xla[1]


def test_auto_picks_flash_for_long_keys_on_cpu(qkv):
    from meshpar.nn.attention import Mask, choose

    q = jnp.zeros((1, 2048, 2, 8))
    assert choose("auto", q, q, Mask(), False) == "flash"
    assert choose("auto", q[:, :256], q[:, :256], Mask(), False) == "xla"


def test_a_query_that_sees_no_key_gets_zeros_from_every_kernel(qkv):
    """Keys of other segments only (kv_segment_ids apart from segment_ids): zeros, not V's mean."""
    q, k, v, seg, _ = qkv
    for impl in ("xla", "flash"):
        o = meshpar.attention(q, k, v, causal=False, segment_ids=seg, kv_segment_ids=seg + 10, implementation=impl)
        assert float(jnp.abs(o).max()) == 0.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(window=0), "window=0 must be a positive"),
        (dict(window=-3), "window=-3 must be a positive"),
        (dict(softcap=0.0), "softcap=0.0 must be a positive number"),
        (dict(segment_ids=jnp.zeros((B, T - 1), jnp.int32)), r"segment_ids has shape \(2, 63\)"),
        (dict(implementation="flsh"), "did you mean 'flash'"),
        (dict(implementation="cudnn"), "cudnn cannot serve this call"),
        (dict(window="abc"), "window='abc' must be a positive number"),
        (dict(kv_segment_ids=jnp.zeros((B, T), jnp.int32)), "kv_segment_ids needs segment_ids"),
    ],
)
def test_bad_input_is_one_line(qkv, kwargs, match):
    q, k, v, _, _ = qkv
    with pytest.raises(ConfigError, match=match):
        meshpar.attention(q, k, v, **kwargs)


def test_causal_needs_as_many_queries_as_keys(qkv):
    q, k, v, _, _ = qkv
    with pytest.raises(ConfigError, match="as many queries as keys"):
        meshpar.attention(q[:, :8], k, v)
    assert meshpar.attention(q[:, :8], k, v, causal=False).shape == (B, 8, N, H)


@pytest.mark.parametrize("name", ["causal", "all", "bidirectional+window"])
def test_splash_equals_naive_attention(name):
    """Pallas splash attention (`implementation="splash"`; TPU, here Pallas's interpreter) at 256
    tokens in blocks of 128, grouped KV heads: values and gradients as the naive attention's."""
    from meshpar.nn import splash

    if not splash.available():
        pytest.fail("this jax ships no splash attention kernel (jax.experimental.pallas.ops.tpu)")
    rng = np.random.default_rng(1)
    t = 256
    q, k, v, ct = (
        jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((1, t, N, H), (1, t, K, H), (1, t, K, H), (1, t, N, H))
    )
    kw = dict(MASKS[name])
    if kw.pop("seg", False):
        kw["segment_ids"] = jnp.asarray(np.repeat([0, 1, 2], [100, 100, 56])[None])
    _assert_equals_naive(q, k, v, ct, kw, implementation="splash", block=128)


def test_splash_refuses_what_it_cannot_serve_in_one_line():
    q = jnp.zeros((1, 200, 2, 8))
    with pytest.raises(ConfigError, match="model.attention=splash cannot serve this call"):
        meshpar.attention(q, q, q, implementation="splash")
