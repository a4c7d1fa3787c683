"""A GPT-2-style LM (Radford et al. 2019) from Flax built-ins, sharded by meshpar without editing meshpar.

LayerNorm, learned positions, GELU MLP, dropout, tied input/output embeddings; annotated with Flax's
own API only (`nnx.with_partitioning`). The names say what a dimension means (`vocab`, `embed`,
`heads`, `kv`, `mlp`, `norm`); meshpar's rule table decides which mesh axes split them.

    meshpar train --config examples/gpt2.yaml          # from the repository root
    python examples/gpt2.py                            # the same, from Python (8 fake CPU devices)

tokens [B, T] -> wte + wpe -> L x (x + Attn(LN(x)), x + MLP(LN(x))) -> LN -> wte^T -> logits [B, T, V]

Served by `meshpar generate` / `meshpar.serve.engine.Engine` through two more methods (meshpar's decode
protocol): `cache_spec` declares a KV cache per block [B, S, N, H] by logical names, and `decode`
runs new tokens at their positions against it, reusing the built-in attention's own projections.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar import Leaf

normal, ones, zeros = nnx.initializers.normal(0.02), nnx.initializers.ones, nnx.initializers.zeros


def named(init, *names):
    return nnx.with_partitioning(init, names)


def layer_norm(width, rngs):
    return nnx.LayerNorm(width, scale_init=named(ones, "norm"), bias_init=named(zeros, "norm"), rngs=rngs)


class Block(nnx.Module):
    """Pre-LN transformer block. x [B, T, E] -> [B, T, E]."""

    def __init__(self, width: int, heads: int, dropout: float, rngs: nnx.Rngs):
        self.ln1, self.ln2 = layer_norm(width, rngs), layer_norm(width, rngs)
        self.attn = nnx.MultiHeadAttention(
            heads,
            width,
            dropout_rate=dropout,
            decode=False,
            deterministic=False,
            rngs=rngs,
            kernel_init=named(normal, "embed", "heads", "kv"),
            bias_init=named(zeros, "heads", "kv"),
            out_kernel_init=named(normal, "heads", "kv", "embed"),
            out_bias_init=named(zeros, "embed"),
        )
        self.up = nnx.Linear(
            width, 4 * width, kernel_init=named(normal, "embed", "mlp"), bias_init=named(zeros, "mlp"), rngs=rngs
        )
        self.down = nnx.Linear(
            4 * width, width, kernel_init=named(normal, "mlp", "embed"), bias_init=named(zeros, "embed"), rngs=rngs
        )
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(x[..., 0])
        x = x + self.drop(self.attn(self.ln1(x), mask=mask))
        return x + self.drop(self.down(nnx.gelu(self.up(self.ln2(x)))))

    def decode(self, x, positions, cache):
        """x [B, T, E] at positions [B, T]; cache {"k", "v"} [B, S, N, H] -> (x, cache with these written)."""
        h = self.ln1(x)
        q, k, v = self.attn.query(h), self.attn.key(h), self.attn.value(h)  # [B, T, N, H]
        rows = jnp.arange(x.shape[0])[:, None]
        kc, vc = cache["k"].at[rows, positions].set(k), cache["v"].at[rows, positions].set(v)
        mask = jnp.arange(kc.shape[1])[None, None, :] <= positions[:, :, None]  # [B, T, S]
        x = x + self.attn.out(jax.nn.dot_product_attention(q, kc, vc, mask=mask[:, None]))
        return x + self.down(nnx.gelu(self.up(self.ln2(x)))), {"k": kc, "v": vc}


class GPT2(nnx.Module):
    """tokens [B, T] -> logits [B, T, V]."""

    def __init__(self, vocab: int, length: int, width: int, heads: int, layers: int, dropout: float, rngs: nnx.Rngs):
        self.wte = nnx.Embed(vocab, width, embedding_init=named(normal, "vocab", "embed"), rngs=rngs)
        self.wpe = nnx.Embed(length, width, embedding_init=named(normal, None, "embed"), rngs=rngs)
        self.blocks = nnx.List([Block(width, heads, dropout, rngs) for _ in range(layers)])
        self.ln_f = layer_norm(width, rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, tokens):
        x = self.drop(self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1])))
        for block in self.blocks:
            x = block(x)
        return self.wte.attend(self.ln_f(x))  # tied output embedding

    def cache_spec(self, batch: int, length: int) -> list:
        """Per block {"k", "v"} [B, S, N, H] (the model computes in fp32)."""
        attn = self.blocks[0].attn
        leaf = Leaf(
            (batch, length, attn.num_heads, attn.head_dim), jnp.float32, ("cache_batch", "cache_length", "heads", "kv")
        )
        return [{"k": leaf, "v": leaf} for _ in self.blocks]

    def decode(self, tokens, positions, cache):
        """tokens, positions [B, T] -> (logits [B, T, V], cache)."""
        x = self.wte(tokens) + self.wpe(positions)
        new = []
        for block, c in zip(self.blocks, cache):
            x, c = block.decode(x, positions, c)
            new.append(c)
        return self.wte.attend(self.ln_f(x)), new


def gpt2(cfg, rngs: nnx.Rngs) -> GPT2:
    """The factory `model.name: examples.gpt2:gpt2` names: sizes from `model.args`."""
    a = {"vocab": 128, "width": 64, "heads": 4, "layers": 2, "dropout": 0.1, **cfg.model.args}
    return GPT2(a["vocab"], cfg.batch.length, a["width"], a["heads"], a["layers"], a["dropout"], rngs)


if __name__ == "__main__":
    import os
    import sys

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # fake devices on a laptop
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import meshpar

    cfg = meshpar.load_config(os.path.join(os.path.dirname(__file__), "gpt2.yaml"), sys.argv[1:])
    trainer = meshpar.Trainer(cfg, model=lambda rngs: gpt2(cfg, rngs))  # loss: next-token LM (default)
    end = meshpar.run(cfg, trainer=trainer)
    print(f"loss {end['initial_loss']:.3f} -> {end['final_loss']:.3f}")
