"""An MLP-Mixer (Tolstikhin et al. 2021) classifying synthetic images: your own model, loss and data.

Everything meshpar needs is named here, nothing in meshpar is edited:
* the model annotates its parameters with meshpar's helper `meshpar.param` and its own logical
  names (`pos`, `token_mlp`, `classes` are not meshpar's; `rules` in vision.yaml map or leave them);
* the batch is a dict `{images [B, H, W, C] float32, labels [B] int32}` whose leaves declare their
  logical axes (`meshpar.Leaf`), built by a data source named by `data.kind`;
* the loss is softmax cross-entropy with an accuracy metric, named by `train.loss`.

    meshpar train --config examples/vision.yaml        # from the repository root
    python examples/vision.py                          # the same, from Python (8 fake CPU devices)

images [B, H, W, C] -> patches [B, N, P*P*C] -> stem -> L x (token mixing over N, channel mixing
over D) -> LayerNorm -> mean over N -> logits [B, K]. N = (H/P)(W/P) patches, D width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import meshpar


class MLP(nnx.Module):
    """x [..., I] -> gelu(x W1 + b1) W2 + b2 [..., I]; W1 [I, H] named (inner, hidden)."""

    def __init__(self, width: int, hidden: int, inner: str, hidden_name: str, rngs: nnx.Rngs):
        self.w1 = meshpar.param(rngs, (width, hidden), (inner, hidden_name), width**-0.5)
        self.b1 = meshpar.param(rngs, (hidden,), (hidden_name,), init="zeros")
        self.w2 = meshpar.param(rngs, (hidden, width), (hidden_name, inner), hidden**-0.5)
        self.b2 = meshpar.param(rngs, (width,), (inner,), init="zeros")

    def __call__(self, x):
        dt = x.dtype
        h = jax.nn.gelu(x @ self.w1[...].astype(dt) + self.b1[...].astype(dt))
        return h @ self.w2[...].astype(dt) + self.b2[...].astype(dt)


class LayerNorm(nnx.Module):
    """Over the last axis, statistics in fp32; scale and bias named `norm`."""

    def __init__(self, width: int, rngs: nnx.Rngs):
        self.scale = meshpar.param(rngs, (width,), ("norm",), init="ones")
        self.bias = meshpar.param(rngs, (width,), ("norm",), init="zeros")

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = (x32 - x32.mean(-1, keepdims=True)) * jax.lax.rsqrt(x32.var(-1, keepdims=True) + 1e-6)
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


class MixerBlock(nnx.Module):
    """x [B, N, D] -> x + TokenMLP(LN(x)^T)^T -> + ChannelMLP(LN(x)) [B, N, D]."""

    def __init__(self, patches: int, width: int, token_hidden: int, channel_hidden: int, rngs: nnx.Rngs):
        self.norm1, self.norm2 = LayerNorm(width, rngs), LayerNorm(width, rngs)
        self.tokens = MLP(patches, token_hidden, "pos", "token_mlp", rngs)
        self.channels = MLP(width, channel_hidden, "embed", "mlp", rngs)

    def __call__(self, x):
        x = x + jnp.swapaxes(self.tokens(jnp.swapaxes(self.norm1(x), 1, 2)), 1, 2)
        x = meshpar.constrain(x, ("batch", None, "embed"))
        return meshpar.constrain(x + self.channels(self.norm2(x)), ("batch", None, "embed"))


class Mixer(nnx.Module):
    def __init__(self, image: int, channels: int, patch: int, width: int, layers: int, classes: int, rngs: nnx.Rngs):
        self.patch = patch
        n = (image // patch) ** 2
        self.stem = meshpar.param(
            rngs, (patch * patch * channels, width), (None, "embed"), (patch * patch * channels) ** -0.5
        )
        self.blocks = nnx.List([MixerBlock(n, width, 2 * n, 4 * width, rngs) for _ in range(layers)])
        self.norm = LayerNorm(width, rngs)
        self.head = meshpar.param(rngs, (width, classes), ("embed", "classes"), width**-0.5)

    def __call__(self, images):
        """images [B, H, W, C] -> logits [B, K], in the policy's compute dtype."""
        dt = meshpar.compute_dtype()
        b, h, w, c = images.shape
        p = self.patch
        x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * c)
        x = meshpar.constrain(x.astype(dt) @ self.stem[...].astype(dt), ("batch", None, "embed"))
        for block in self.blocks:
            x = block(x)
        return self.norm(x).mean(axis=1) @ self.head[...].astype(dt)


def mixer(cfg, rngs: nnx.Rngs) -> Mixer:
    """`model.name: examples.vision:mixer`; sizes from `model.args`."""
    a = {"image": 16, "channels": 3, "patch": 4, "width": 32, "layers": 2, "classes": 10, **cfg.model.args}
    return Mixer(a["image"], a["channels"], a["patch"], a["width"], a["layers"], a["classes"], rngs)


def classification_loss(model, batch):
    """`train.loss: examples.vision:classification_loss`. Mean softmax cross-entropy (fp32) and accuracy."""
    logits = model(batch["images"]).astype(jnp.float32)
    ce = meshpar.cross_entropy(logits, batch["labels"])
    return ce, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["labels"])}


class SyntheticImages:
    """Class-conditional images: class k is a fixed random template plus Gaussian noise, so a model
    can learn it. Row r of step s depends only on (seed, s, r): any process split, exact resume."""

    def __init__(self, image: int = 16, channels: int = 3, classes: int = 10, noise: float = 0.5, seed: int = 0):
        self.shape, self.classes, self.noise = (image, image, channels), classes, noise
        self.templates = np.random.default_rng(seed).standard_normal((classes, *self.shape)).astype(np.float32)

    def batch_spec(self, global_size: int, length: int):
        return {
            "images": meshpar.Leaf((global_size, *self.shape), np.float32, ("batch", None, None, None)),
            "labels": meshpar.Leaf((global_size,), np.int32, ("batch",)),
        }

    def rows(self, seed: int, step: int, rows: range, length: int):
        out = {"images": np.empty((len(rows), *self.shape), np.float32), "labels": np.empty(len(rows), np.int32)}
        for i, r in enumerate(rows):
            rng = np.random.default_rng([seed, step, r])
            k = int(rng.integers(self.classes))
            out["labels"][i] = k
            out["images"][i] = self.templates[k] + self.noise * rng.standard_normal(self.shape, np.float32)
        return out


def source(cfg) -> SyntheticImages:
    """`data.kind: examples.vision:source`."""
    a = {"image": 16, "channels": 3, "classes": 10, **cfg.model.args}
    return SyntheticImages(a["image"], a["channels"], a["classes"], seed=cfg.data.seed)


if __name__ == "__main__":
    import os
    import sys

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # fake devices on a laptop

    cfg = meshpar.load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "vision.yaml"), sys.argv[1:])
    data = source(cfg)
    trainer = meshpar.Trainer(
        cfg,
        model=lambda rngs: mixer(cfg, rngs),
        loss=classification_loss,
        batch_spec=data.batch_spec(cfg.batch.global_size, cfg.batch.length),
    )
    end = meshpar.run(cfg, trainer=trainer, source=data)
    print(f"loss {end['initial_loss']:.3f} -> {end['final_loss']:.3f}")
