"""The ragged exchange (`meshpar.nn.exchange`) as JAX documents `ragged_all_to_all`: its padded form,
which XLA:CPU runs, gives the documented results (the target tier shows GPUs compile the ragged one)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshpar.nn.exchange import exchange


def _run(devices, operand, output, in_off, send, out_off, recv):
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    f = jax.shard_map(
        lambda *a: exchange(*(b[0] for b in a), "x", "padded")[None],
        mesh=mesh,
        in_specs=(P("x"),) * 6,
        out_specs=P("x"),
    )
    return np.asarray(jax.jit(f)(*(jnp.asarray(a) for a in (operand, output, in_off, send, out_off, recv))))


def test_the_documented_example():
    """jax.lax.ragged_all_to_all's docstring: two devices, results [1, 3, 0, 0] and [2, 2, 4, 0]."""
    got = _run(
        2,
        [[1, 2, 2], [3, 4, 0]],
        [[0] * 4, [0] * 4],
        [[0, 1], [0, 1]],
        [[1, 2], [1, 1]],
        [[0, 0], [1, 2]],
        [[1, 1], [2, 1]],
    )
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_random_slices_land_where_their_senders_say():
    """4 devices, uneven slices packed source after source: the pseudocode of the docstring, in numpy."""
    rng = np.random.default_rng(0)
    d, r, out_rows = 4, 6, 24
    send = np.stack([rng.multinomial(rng.integers(0, r + 1), [1 / d] * d) for _ in range(d)])  # [sender, dest]
    in_off = np.cumsum(send, axis=1) - send
    recv = send.T  # [receiver, source]
    at = np.cumsum(recv, axis=1) - recv  # receiver packs its sources in order
    out_off = at.T  # [sender, dest]: where its rows land
    operand = rng.normal(size=(d, r, 3)).astype(np.float32)
    want = np.zeros((d, out_rows, 3), np.float32)
    for s in range(d):
        for t in range(d):
            want[t, out_off[s, t] : out_off[s, t] + send[s, t]] = operand[s, in_off[s, t] : in_off[s, t] + send[s, t]]
    got = _run(
        d,
        operand,
        np.zeros((d, out_rows, 3), np.float32),
        in_off.astype(np.int32),
        send.astype(np.int32),
        out_off.astype(np.int32),
        recv.astype(np.int32),
    )
    np.testing.assert_array_equal(got, want)


def test_the_ragged_result_varies_as_the_rows_sent_so_the_backward_sums_nothing():
    """The ragged form inside a shard_map manual over two axes, exchanging over one (`expert`), the rows
    differing over the other (`fsdp`, as dropless MoE's tokens do). JAX types a ragged all-to-all's
    result as its `output` buffer; a fresh zeros buffer typed the rows received as the same on every
    `fsdp` device, and the backward summed their cotangents over `fsdp` (psum_invariant: wrong
    gradients, an all-reduce of the buffer per MoE layer on GPU and TPU). Traced only: XLA:CPU has no
    ragged all-to-all to run."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "expert"))

    def local(x, scale):
        d = 4
        off = jnp.arange(d, dtype=jnp.int32) * 2
        sizes = jnp.full((d,), 2, jnp.int32)
        got = exchange(x, jnp.zeros((8, x.shape[1]), x.dtype), off, sizes, off, sizes, "expert", "ragged")
        return (got * scale)[None]  # scale varies over both axes, as a MoE layer's gates do

    def loss(x, scale):
        both = P(("fsdp", "expert"))
        return jnp.sum(jax.shard_map(local, mesh=mesh, in_specs=(both, both), out_specs=both)(x, scale))

    x, scale = jnp.ones((64, 3)), jnp.ones((8 * 8, 3))
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(x, scale))
    assert "ragged_all_to_all" in jaxpr
    assert "psum_invariant" not in jaxpr, [ln for ln in jaxpr.splitlines() if "psum_invariant" in ln]
