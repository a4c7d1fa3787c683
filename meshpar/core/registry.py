"""Names in a config -> code: `PKG.MODULE:NAME` imports (`model.name`, `train.loss`, `data.kind`),
the reference models by short name (`meshpar.models.REGISTRY`) and the built-in losses.
One line naming the config key when a name does not resolve."""

from __future__ import annotations

import functools
from collections.abc import Callable

from meshpar.core.config import Config
from meshpar.core.errors import ConfigError, suggest


def import_object(path: str, key: str):
    """'pkg.module:name' -> that object; one line naming the config key when it does not import."""
    import importlib
    import os
    import sys

    module, _, name = path.partition(":")
    if os.getcwd() not in sys.path:  # like `python -m`: your package from the current directory
        sys.path.insert(0, os.getcwd())
    if not module or not name:
        raise ConfigError(f"config key '{key}': '{path}' must look like PKG.MODULE:NAME")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"config key '{key}': cannot import module '{module}' ({e}); is it installed or on PYTHONPATH?"
        ) from None
    if not hasattr(mod, name):
        public = [n for n in dir(mod) if not n.startswith("_")]
        raise ConfigError(f"config key '{key}': module '{module}' has no '{name}'" + suggest(name, public))
    return getattr(mod, name)


def model_factory(name: str):
    """`model.name` -> FACTORY(cfg, rngs): a reference model of `meshpar.models` by short name, or any
    PKG.MODULE:FACTORY."""
    if ":" in name:
        return import_object(name, "model.name")
    registry = import_object("meshpar.models:REGISTRY", "model.name")
    if name not in registry:
        raise ConfigError(
            f"unknown model.name '{name}'"
            + suggest(name, registry)
            + "; or name your own factory as PKG.MODULE:FACTORY"
        )
    return registry[name]


def loss_function(name: str, chunks: int = 1):
    """`train.loss` -> FN(model, batch) -> (loss, metrics): `lm` is meshpar.train.loss.lm_loss (its
    logits in `chunks` token slices: `train.loss_chunks`), `stages` meshpar.nn.stages.stage_loss (a
    model with pre/layers/post/loss, which can also be pipelined)."""
    if name in ("lm", "stages"):
        fn = import_object(
            {"lm": "meshpar.train.loss:lm_loss", "stages": "meshpar.nn.stages:stage_loss"}[name], "train.loss"
        )
        if name == "lm" and chunks > 1:
            return functools.update_wrapper(functools.partial(fn, chunks=chunks), fn)
        return fn
    return import_object(name, "train.loss")


def default_model(cfg: Config) -> Callable:
    """`cfg.model.name` as a factory `rngs -> nnx.Module` (`PKG.MODULE:FN` or a reference model)."""
    fn = model_factory(cfg.model.name)
    return lambda rngs: fn(cfg, rngs)
