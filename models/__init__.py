"""Reference models. `build(cfg, rngs)` picks one by `cfg.model.name`; adding a model is adding an entry."""
from __future__ import annotations

from flax import nnx


def _decoder(cfg, rngs):
    from meshpar.models.decoder import Decoder, DecoderConfig
    return Decoder(DecoderConfig.from_config(cfg.model), rngs)


def _moe(cfg, rngs):
    from meshpar.models.moe import build
    return build(cfg, rngs)


REGISTRY = {"decoder": _decoder, "moe": _moe}


def build(cfg, rngs: nnx.Rngs):
    from meshpar.errors import ConfigError, suggest
    if cfg.model.name not in REGISTRY:
        raise ConfigError(f"unknown model.name '{cfg.model.name}'" + suggest(cfg.model.name, REGISTRY))
    return REGISTRY[cfg.model.name](cfg, rngs)
