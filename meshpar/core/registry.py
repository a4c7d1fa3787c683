"""Names in a config -> code: `PKG.MODULE:NAME` imports (`model.name`, `train.loss`, `data.kind`),
the reference models by short name (`meshpar.models.REGISTRY`) and the built-in losses.
One line naming the config key when a name does not resolve; what a user's module, factory or loss
raises comes out through `meshpar.core.errors.user_code`, saying which key meshpar was working on."""

from __future__ import annotations

import functools
from collections.abc import Callable

from meshpar.core.config import Config
from meshpar.core.errors import ConfigError, suggest, user_code


def import_object(path: str, key: str, what: str = "NAME"):
    """'pkg.module:name' -> that object; one line naming the config key when it does not import
    (`what`: what NAME must be, for the message), suggesting only the module's own functions and
    classes (not what it imports: `jnp`, `nnx`)."""
    import importlib
    import os
    import sys

    module, _, name = path.partition(":")
    if os.getcwd() not in sys.path:  # like `python -m`: your package from the current directory
        sys.path.insert(0, os.getcwd())
    if not module or not name:
        raise ConfigError(f"config key '{key}': '{path}' must look like PKG.MODULE:{what}")
    try:
        with user_code(f"importing {key}={path}"):
            mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"config key '{key}': cannot import module '{module}' ({e}); is it installed or on PYTHONPATH?"
        ) from None
    if not hasattr(mod, name):
        own = [
            n
            for n, v in vars(mod).items()
            if not n.startswith("_") and callable(v) and getattr(v, "__module__", None) == mod.__name__
        ]
        hint = suggest(name, own) if own else f" (it defines no public function or class; {what} is one)"
        raise ConfigError(f"config key '{key}': module '{module}' has no '{name}'" + hint)
    return getattr(mod, name)


def model_factory(name: str):
    """`model.name` -> FACTORY(cfg, rngs): a reference model of `meshpar.models` by short name, or any
    PKG.MODULE:FACTORY."""
    if ":" in name:
        return import_object(name, "model.name", "FACTORY")
    registry = import_object("meshpar.models:REGISTRY", "model.name")
    if name not in registry:
        raise ConfigError(
            f"unknown model.name '{name}'"
            + suggest(name, registry)
            + "; or name your own factory as PKG.MODULE:FACTORY"
        )
    return registry[name]


LOSSES = {"lm": "meshpar.train.loss:lm_loss", "stages": "meshpar.nn.stages:stage_loss"}


def loss_function(name: str, chunks: int = 1):
    """`train.loss` -> FN(model, batch) -> (loss, metrics): `lm` is meshpar.train.loss.lm_loss (its
    logits in `chunks` token slices: `train.loss_chunks`), `stages` meshpar.nn.stages.stage_loss (a
    model with pre/layers/post/loss, which can also be pipelined); PKG.MODULE:FN a loss of the user's,
    which runs inside `user_code` ("tracing train.loss=...")."""
    if name in LOSSES:
        fn = import_object(LOSSES[name], "train.loss")
        if name == "lm" and chunks > 1:
            return functools.update_wrapper(functools.partial(fn, chunks=chunks), fn)
        return fn
    if ":" not in name:
        raise ConfigError(
            f"config key 'train.loss' has unknown value '{name}'"
            + suggest(name, LOSSES)
            + "; or name your own loss as PKG.MODULE:FN, FN(model, batch) -> (loss, metrics)"
        )
    fn = import_object(name, "train.loss", "FN (FN(model, batch) -> (loss, metrics))")

    @functools.wraps(fn)
    def loss(model, batch):
        with user_code(f"tracing train.loss={name}"):
            return fn(model, batch)

    return loss


def default_model(cfg: Config) -> Callable:
    """`cfg.model.name` as a factory `rngs -> nnx.Module` (`PKG.MODULE:FN` or a reference model),
    called inside `user_code` ("building model.name=...")."""
    fn, name = model_factory(cfg.model.name), cfg.model.name

    def factory(rngs):
        with user_code(f"building model.name={name}"):
            return fn(cfg, rngs)

    return factory
