"""An encoder-decoder transformer (Vaswani et al. 2017) that learns to reverse sequences: your own
model, a batch of three leaves, your own loss, and a data source that honours its `length`.

    meshpar train --config examples/reverse.yaml        # from the repository root
    python examples/reverse.py                          # the same, from Python (8 fake CPU devices)

The data-source contract (meshpar.train.data): `batch_spec(global_size, length)` declares the batch, a
tree of `meshpar.Leaf(shape, dtype, logical axes)`, and `rows(seed, step, rows, length)` returns
that tree's rows for the same `length` (batch.length), a pure function of (seed, step, row).
Here: src [B, T] random tokens, tgt_in [B, T] = BOS + reversed src[:-1], tgt_out [B, T] = reversed
src. Their second axis is named `length`, meshpar's name for positions.

src -> embed + positions -> L x encoder block -> memory;  tgt_in -> embed + positions -> L x
decoder block (causal self-attention, cross-attention to memory) -> logits [B, T, V].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import meshpar

BOS = 0


def weight(rngs, shape, names, std=0.02):
    """A bare nnx.Param named by Flax's own `out_sharding` metadata."""
    return nnx.Param(std * jax.random.normal(rngs.params(), shape), out_sharding=names)


class Attention(nnx.Module):
    """q [B, T, E] attends to kv [B, S, E]: heads N x width H; optional causal mask."""

    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        h = width // heads
        self.q, self.k, self.v = (weight(rngs, (width, heads, h), ("embed", "heads", "kv")) for _ in range(3))
        self.o = weight(rngs, (heads, h, width), ("heads", "kv", "embed"))

    def __call__(self, x, memory, causal: bool):
        q = jnp.einsum("bte,enh->btnh", x, self.q[...])
        k, v = (jnp.einsum("bse,enh->bsnh", memory, w[...]) for w in (self.k, self.v))
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
        if causal:
            t = jnp.arange(x.shape[1])
            scores = jnp.where(t[:, None] >= t[None, :], scores, -1e9)
        out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, -1), v)
        return jnp.einsum("btnh,nhe->bte", out, self.o[...])


class MLP(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.up, self.down = (
            weight(rngs, (width, 4 * width), ("embed", "mlp")),
            weight(rngs, (4 * width, width), ("mlp", "embed")),
        )

    def __call__(self, x):
        return nnx.gelu(x @ self.up[...]) @ self.down[...]


def norm(width, rngs):
    return nnx.LayerNorm(
        width, scale_metadata={"out_sharding": ("norm",)}, bias_metadata={"out_sharding": ("norm",)}, rngs=rngs
    )


class EncoderBlock(nnx.Module):
    def __init__(self, width, heads, rngs):
        self.n1, self.n2, self.attn, self.mlp = (
            norm(width, rngs),
            norm(width, rngs),
            Attention(width, heads, rngs),
            MLP(width, rngs),
        )

    def __call__(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, causal=False)
        return x + self.mlp(self.n2(x))


class DecoderBlock(nnx.Module):
    def __init__(self, width, heads, rngs):
        self.n1, self.n2, self.n3 = norm(width, rngs), norm(width, rngs), norm(width, rngs)
        self.self_attn, self.cross, self.mlp = (
            Attention(width, heads, rngs),
            Attention(width, heads, rngs),
            MLP(width, rngs),
        )

    def __call__(self, x, memory):
        h = self.n1(x)
        x = x + self.self_attn(h, h, causal=True)
        x = x + self.cross(self.n2(x), memory, causal=False)
        return x + self.mlp(self.n3(x))


class Reverser(nnx.Module):
    def __init__(self, vocab: int, length: int, width: int, heads: int, layers: int, rngs: nnx.Rngs):
        self.embed = weight(rngs, (vocab, width), ("vocab", "embed"))
        self.pos = weight(rngs, (length, width), ("positions", "embed"))  # a name of its own, with a rule
        self.encoder = nnx.List([EncoderBlock(width, heads, rngs) for _ in range(layers)])
        self.decoder = nnx.List([DecoderBlock(width, heads, rngs) for _ in range(layers)])
        self.out = norm(width, rngs)

    def __call__(self, src, tgt_in):
        """src, tgt_in [B, T] -> logits [B, T, V] (tied output embedding)."""
        pos = self.pos[...][: src.shape[1]]
        memory = jnp.take(self.embed[...], src, axis=0) + pos
        for block in self.encoder:
            memory = block(memory)
        x = meshpar.constrain(jnp.take(self.embed[...], tgt_in, axis=0) + pos, ("batch", "length", "embed"))
        for block in self.decoder:
            x = block(x, memory)
        return self.out(x) @ self.embed[...].T


def reverser(cfg, rngs: nnx.Rngs) -> Reverser:
    """`model.name: examples.reverse:reverser`: sizes from `model.args`, length from batch.length."""
    a = {"vocab": 12, "width": 64, "heads": 4, "layers": 2, **cfg.model.args}
    return Reverser(a["vocab"], cfg.batch.length, a["width"], a["heads"], a["layers"], rngs)


def loss(model, batch):
    """`train.loss: examples.reverse:loss`: mean token cross-entropy, and the share of whole sequences
    reversed right."""
    logits = model(batch["src"], batch["tgt_in"]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tgt_out"]).mean()
    exact = jnp.all(jnp.argmax(logits, -1) == batch["tgt_out"], axis=-1).mean()
    return ce, {"exact": exact}


class Reversals:
    """Random sequences over tokens 1..V-1 (0 is BOS) and their reversals."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def batch_spec(self, global_size: int, length: int):
        leaf = meshpar.Leaf((global_size, length), np.int32, ("batch", "length"))
        return {"src": leaf, "tgt_in": leaf, "tgt_out": leaf}

    def rows(self, seed: int, step: int, rows: range, length: int):
        src = np.stack([np.random.default_rng([seed, step, r]).integers(1, self.vocab, length) for r in rows])
        out = src[:, ::-1]
        tgt_in = np.concatenate([np.full((len(rows), 1), BOS), out[:, :-1]], axis=1)
        return {"src": src.astype(np.int32), "tgt_in": tgt_in.astype(np.int32), "tgt_out": out.astype(np.int32)}


def source(cfg) -> Reversals:
    """`data.kind: examples.reverse:source`."""
    return Reversals({"vocab": 12, **cfg.model.args}["vocab"])


if __name__ == "__main__":
    import os
    import sys

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # fake devices on a laptop

    cfg = meshpar.load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "reverse.yaml"), sys.argv[1:])
    data = source(cfg)
    trainer = meshpar.Trainer(
        cfg,
        model=lambda rngs: reverser(cfg, rngs),
        loss=loss,
        batch_spec=data.batch_spec(cfg.batch.global_size, cfg.batch.length),
    )
    end = meshpar.run(cfg, trainer=trainer, source=data)
    print(f"loss {end['initial_loss']:.3f} -> {end['final_loss']:.3f}")
