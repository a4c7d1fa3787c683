"""Reference models, users of meshpar's public API like any model of yours.

`REGISTRY` maps the short names `model.name` accepts to factories `FACTORY(cfg, rngs) -> nnx.Module`;
any other model is named `PKG.MODULE:FACTORY` instead. meshpar itself never imports this package.
"""

from __future__ import annotations

from flax import nnx


def decoder(cfg, rngs: nnx.Rngs):
    """The Llama-style dense decoder LM (`meshpar.models.decoder`)."""
    from meshpar.models.decoder import Decoder, DecoderConfig

    return Decoder(DecoderConfig.from_config(cfg.model), rngs)


def moe(cfg, rngs: nnx.Rngs):
    """The GShard/Switch mixture-of-experts LM (`meshpar.models.moe`)."""
    from meshpar.models.moe import build

    return build(cfg, rngs)


REGISTRY = {"decoder": decoder, "moe": moe}


def build(cfg, rngs: nnx.Rngs):
    """`model.name` of a run config -> the model (reference names or PKG.MODULE:FACTORY)."""
    from meshpar.core.registry import model_factory

    return model_factory(cfg.model.name)(cfg, rngs)
