"""A user's model written with Flax's public sharding API only: no meshpar import.

Parameters carry logical names through `nnx.with_partitioning` and their stack through `nnx.vmap`'s
`transform_metadata`; the first stage's activations are pinned with mesh axes
(`jax.lax.with_sharding_constraint(x, P(...))`, which needs a mesh context) and every block's with
logical names (`flax.linen.with_logical_constraint`, which needs Flax's logical rules too). It keeps
the stage protocol's parts (pre / layers / post / loss), so the same class trains under any preset
and pipelined.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

VOCAB, EMBED, MLP, LAYERS = 64, 16, 32, 4
init = nnx.initializers.normal(0.3)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(
            EMBED, MLP, use_bias=False, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs
        )
        self.down = nnx.Linear(
            MLP, EMBED, use_bias=False, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs
        )

    def __call__(self, x):  # [batch, length, embed]
        h = nn.with_logical_constraint(jax.nn.gelu(self.up(x)), ("batch", "seq", "mlp"))
        return nn.with_logical_constraint(x + self.down(h), ("batch", "length", "embed"))


class FlaxNative(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, EMBED, embedding_init=nnx.with_partitioning(init, ("vocab", "embed")), rngs=rngs)

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def blocks(r):
            return Block(r)

        self.layers = blocks(rngs.fork(split=LAYERS))
        self.out = nnx.Linear(
            EMBED, VOCAB, use_bias=False, kernel_init=nnx.with_partitioning(init, ("embed", "vocab")), rngs=rngs
        )

    def pre(self, batch):  # tokens [batch, length] -> [batch, length, embed], rows over the batch's mesh axes
        return jax.lax.with_sharding_constraint(self.embed(batch["inputs"]), P(("data", "fsdp"), None, None))

    def post(self, x):
        return self.out(x)

    def loss(self, logits, batch):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        return -picked.mean(), {}
