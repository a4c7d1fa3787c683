"""An encoder-decoder in the stage protocol, run by tests/train/test_stages.py in a subprocess (an XLA
abort would kill the test worker): `python -m tests.train.encdec_stages VARIANT=SCHEDULE,... ...`
prints one JSON line {VARIANT: {"one device": {loss, metrics}, SCHEDULE: {loss, metrics, grads}}}:
each pipelined run on pipeline=2 x data=2 x tensor=2 against one device, from the same parameters
and batch (grads: the gradients' norm-wise relative error).

The loss is `take_along_axis` of log-probabilities over a vocab split over `tensor`. VARIANT
`array`: the activation is one array, y [b, T, E] (the decoder attends to itself); `head`: a pytree
of two lengths, (y [b, T, E], {"enc": [b, S, E], "mask": bool [b, S]}) with S != T, and post applies
the output head [E, V]; `tied`: that pytree, post pools a token per row (a gather in post) and the
loss applies the embedding table [V, E] itself.
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import meshpar  # noqa: E402
from meshpar.core.config import load_config  # noqa: E402

V, E, B, S, T, L = 16, 16, 8, 6, 4, 4
ACT = ("batch", "length", "embed")


class Block(nnx.Module):
    """(y [b, T, E], {enc [b, S, E], mask [b, S]}) -> the same: an encoder MLP on enc, y attends to enc."""

    def __init__(self, rngs):
        self.up = meshpar.param(rngs, (E, 2 * E), ("embed", "mlp"), 0.2)
        self.down = meshpar.param(rngs, (2 * E, E), ("mlp", "embed"), 0.2)
        self.q = meshpar.param(rngs, (E, E), ("embed", "mlp"), 0.2)
        self.o = meshpar.param(rngs, (E, E), ("mlp", "embed"), 0.2)

    def __call__(self, x):
        if not isinstance(x, tuple):  # variant `array`: y attends to itself
            return self((x, {"enc": x, "mask": jnp.ones(x.shape[:2], bool)}))[0]
        y, side = x
        enc = side["enc"] + jnp.tanh(side["enc"] @ self.up[...]) @ self.down[...]
        scores = jnp.einsum("bte,bse->bts", y @ self.q[...], enc) / np.sqrt(E)
        scores = jnp.where(side["mask"][:, None, :], scores, -1e9)
        y = y + jnp.einsum("bts,bse->bte", jax.nn.softmax(scores, -1), enc) @ self.o[...]
        return y, {**side, "enc": enc}


class EncDec(nnx.Module):
    def __init__(self, variant: str, rngs):
        self.variant = variant
        self.embed = meshpar.param(rngs, (V, E), ("vocab", "embed"), 0.5)
        self.pos_src = meshpar.param(rngs, (S, E), (None, "embed"), 0.1)
        self.pos_tgt = meshpar.param(rngs, (T, E), (None, "embed"), 0.1)
        self.layers = meshpar.stacked(Block, L, rngs)
        self.head = meshpar.param(rngs, (E, V), ("embed", "vocab"), 0.3)

    def pre(self, batch):
        y = jnp.take(self.embed[...], batch["tgt_in"], 0) + self.pos_tgt[...]
        enc = jnp.take(self.embed[...], batch["src"], 0) + self.pos_src[...]
        if self.variant == "array":
            return meshpar.constrain(y, ACT)
        return meshpar.constrain(y, ACT), {"enc": meshpar.constrain(enc, ACT), "mask": batch["src"] > 0}

    def post(self, x):
        y = x if self.variant == "array" else x[0]
        if self.variant in ("array", "head"):
            return y @ self.head[...]
        pick = jnp.argmax(y[..., 0], axis=1)  # one token per row
        return y + jnp.take_along_axis(y, pick[:, None, None], axis=1)

    def loss(self, outputs, batch):
        logits = outputs @ self.embed[...].T if self.variant == "tied" else outputs
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        ce = -jnp.take_along_axis(logp, batch["tgt_out"][..., None], -1).mean()
        return ce, {"top1": (jnp.argmax(logits, -1) == batch["tgt_out"]).mean()}


def trainer(variant: str, schedule: str | None):
    mesh = {"pipeline": 2, "data": 2, "tensor": 2} if schedule else {}
    items = [f"mesh.{a}={mesh.get(a, 1)}" for a in ("data", "fsdp", "tensor", "pipeline", "expert", "context")]
    if schedule:
        items += [
            f"pipeline.schedule={schedule}",
            "pipeline.microbatches=2",
            f"pipeline.virtual_stages={2 if schedule == 'interleaved' else 1}",
        ]
    cfg = load_config(
        None, ["precision=fp32", f"model.layers={L}", f"batch.global_size={B}", f"batch.length={T}", *items]
    )
    spec = {
        k: meshpar.Leaf((B, n), np.int32, ("batch", "length")) for k, n in (("src", S), ("tgt_in", T), ("tgt_out", T))
    }
    return meshpar.Trainer(
        cfg,
        devices=jax.devices()[: 8 if schedule else 1],
        model=lambda r: EncDec(variant, r),
        loss=meshpar.stage_loss,
        batch_spec=spec,
    )


def grads(tr, params, batch):
    params = jax.device_put(params, tr.param_shardings)
    batch = {k: jax.device_put(v, tr.batch_sharding[k]) for k, v in batch.items()}
    (loss, aux), g = jax.jit(tr._grads)(params, batch)
    metrics = {k: float(v) for k, v in aux.items() if k != "vars" and np.ndim(v) == 0}
    return float(loss), metrics, jax.device_get(g)


def rel(a, b) -> float:
    num = sum(
        float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )
    return (num / sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in jax.tree.leaves(b))) ** 0.5


def main(variant: str, schedules: list[str]) -> dict:
    ref = trainer(variant, None)
    params = jax.device_get(ref.init()["params"])
    rng = np.random.default_rng(0)
    batch = {
        "src": rng.integers(0, V, (B, S)),
        "tgt_in": rng.integers(0, V, (B, T)),
        "tgt_out": rng.integers(0, V, (B, T)),
    }
    batch = {k: v.astype(np.int32) for k, v in batch.items()}
    loss0, metrics0, grads0 = grads(ref, params, batch)
    out = {"one device": {"loss": loss0, "metrics": metrics0}}
    for schedule in schedules:
        loss, metrics, g = grads(trainer(variant, schedule), params, batch)
        assert jax.tree.structure(g) == jax.tree.structure(grads0)
        out[schedule] = {"loss": loss, "metrics": metrics, "grads": rel(g, grads0)}
    return out


if __name__ == "__main__":
    runs = dict(arg.split("=") for arg in sys.argv[1:])
    print(json.dumps({variant: main(variant, schedules.split(",")) for variant, schedules in runs.items()}))
