"""A small Vision Transformer (Dosovitskiy et al. 2021) written in meshpar's stage protocol, so it can
be pipelined like the reference LM, with its own loss and a BatchNorm stem whose statistics train.

The protocol (meshpar.nn.stages) is four names, each taking one microbatch:

    pre(batch) -> x       images [b, H, W, C] -> BatchNorm -> patches [b, N, P*P*C] -> embed, class
                          token, positions, dropout -> x [b, N+1, E]            (first stage)
    layers                L pre-LN blocks (Flax's nnx.MultiHeadAttention, GELU MLP), meshpar.stacked
    post(x) -> logits     LayerNorm of the class token -> logits [b, K]           (last stage)
    loss(logits, batch)   softmax cross-entropy with the labels, and accuracy    (last stage)

`train.loss: stages` (meshpar.nn.stages.stage_loss) trains it unpipelined and pipelined alike:

    meshpar train --config examples/vit.yaml                                  # data=2 fsdp=2 tensor=2
    meshpar train --config examples/vit.yaml mesh.pipeline=2 mesh.fsdp=1 pipeline.schedule=1f1b
    python examples/vit.py                                                    # the same from Python

The BatchNorm's running mean/variance and the dropout's RNG stream are non-Param state of `pre`
(meshpar carries them in the train state and checkpoints them); the stacked blocks hold parameters
only, as a pipeline needs. The images and labels come from examples/vision.py's synthetic source.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax
from flax import nnx

normal, ones, zeros = nnx.initializers.normal(0.02), nnx.initializers.ones, nnx.initializers.zeros


def named(init, *names):
    return nnx.with_partitioning(init, names)


class Block(nnx.Module):
    """Pre-LN transformer encoder block, x [b, N, E] -> [b, N, E]; parameters only (no dropout)."""

    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(width, scale_init=named(ones, "norm"), bias_init=named(zeros, "norm"), rngs=rngs)
        self.ln2 = nnx.LayerNorm(width, scale_init=named(ones, "norm"), bias_init=named(zeros, "norm"), rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            heads,
            width,
            decode=False,
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

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class ViT(nnx.Module):
    def __init__(
        self,
        image: int,
        channels: int,
        patch: int,
        width: int,
        heads: int,
        layers: int,
        classes: int,
        dropout: float,
        rngs: nnx.Rngs,
    ):
        import meshpar

        self.patch, n = patch, (image // patch) ** 2
        self.stem = nnx.BatchNorm(channels, scale_init=named(ones, "norm"), bias_init=named(zeros, "norm"), rngs=rngs)
        self.embed = nnx.Linear(
            patch * patch * channels,
            width,
            kernel_init=named(normal, "pixels", "embed"),
            bias_init=named(zeros, "embed"),
            rngs=rngs,
        )
        self.cls = nnx.Param(zeros(rngs.params(), (1, 1, width)), out_sharding=(None, None, "embed"))
        self.pos = nnx.Param(normal(rngs.params(), (n + 1, width)), out_sharding=("pos", "embed"))
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.layers = meshpar.stacked(lambda r: Block(width, heads, r), layers, rngs)
        self.norm = nnx.LayerNorm(width, scale_init=named(ones, "norm"), bias_init=named(zeros, "norm"), rngs=rngs)
        self.head = nnx.Linear(
            width, classes, kernel_init=named(normal, "embed", "classes"), bias_init=named(zeros, "classes"), rngs=rngs
        )

    def pre(self, batch):
        """{images [b, H, W, C], ...} -> x [b, N+1, E]: normalised pixels, patch embeddings, class token."""
        import meshpar

        x = self.stem(batch["images"])
        b, h, w, c = x.shape
        p = self.patch
        x = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // p) * (w // p), p * p * c)
        x = self.embed(x)
        x = jnp.concatenate([jnp.broadcast_to(self.cls[...], (b, 1, x.shape[-1])), x], axis=1) + self.pos[...]
        return meshpar.constrain(self.drop(x), ("batch", None, "embed"))

    def post(self, x):
        """x [b, N+1, E] -> logits [b, K] from the class token."""
        return self.head(self.norm(x[:, 0]))

    def loss(self, logits, batch):
        """-> (mean softmax cross-entropy, {"accuracy"})."""
        labels = batch["labels"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()
        return ce, {"accuracy": (jnp.argmax(logits, -1) == labels).mean()}

    def __call__(self, images):
        """images [B, H, W, C] -> logits [B, K] (evaluation and serving use the whole model)."""
        import meshpar

        return self.post(meshpar.apply_layers(self, self.pre({"images": images}))[0])


def vit(cfg, rngs: nnx.Rngs) -> ViT:
    """The factory `model.name: examples.vit:vit` names: sizes from `model.args`."""
    a = {
        "image": 16,
        "channels": 3,
        "patch": 4,
        "width": 32,
        "heads": 4,
        "layers": 2,
        "classes": 10,
        "dropout": 0.1,
        **cfg.model.args,
    }
    return ViT(
        a["image"], a["channels"], a["patch"], a["width"], a["heads"], a["layers"], a["classes"], a["dropout"], rngs
    )


if __name__ == "__main__":
    import os
    import sys

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # fake devices on a laptop
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import meshpar
    from examples.vision import source

    cfg = meshpar.load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "vit.yaml"), sys.argv[1:])
    data = source(cfg)
    trainer = meshpar.Trainer(
        cfg,
        model=lambda rngs: vit(cfg, rngs),
        loss=meshpar.stage_loss,
        batch_spec=data.batch_spec(cfg.batch.global_size, cfg.batch.length),
    )
    end = meshpar.run(cfg, trainer=trainer, source=data)
    print(f"loss {end['initial_loss']:.3f} -> {end['final_loss']:.3f}")
