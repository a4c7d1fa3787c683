"""Which config keys the user gave, and the warnings a config earns before anything runs.

A key is *given* when a KEY=VALUE override sets it, or when a file (the `--config` YAML, a
checkpoint's saved settings) sets it to something other than the schema's default. `meshpar config`
writes every key, most at their defaults: the file it wrote reads back as giving only what differs,
so it warns about nothing the user did not change. Given keys the run will not read (`moe.*`
without the MoE model, `pipeline.*` without a pipeline) get one warning line, and so does a warmup
longer than the run (the learning rate would never reach `train.lr`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

_UNSET = object()


def given_keys(data: dict, overrides: list[tuple[list[str], Any]], defaults) -> list[str]:
    """The dotted keys given, in order: those of `data` (files) whose values differ from `defaults`
    (a `Config()`), then every override ((keys, value) pairs; a mapping given to a section gives
    each of its keys)."""
    out: dict[str, None] = {}

    def walk(d: dict, schema, prefix: str, every: bool) -> None:
        for k, v in d.items():
            default = getattr(schema, k, _UNSET)
            if isinstance(v, dict) and dataclasses.is_dataclass(default):
                walk(v, default, f"{prefix}{k}.", every)
            elif every or default is _UNSET or v != default:
                out[prefix + k] = None

    walk(data, defaults, "", False)
    for keys, value in overrides:
        schema = defaults
        for k in keys[:-1]:
            schema = getattr(schema, k, None)
        walk({keys[-1]: value}, schema, "".join(f"{k}." for k in keys[:-1]), True)
    return list(out)


def ignored_keys(given: list[str], cfg) -> list[str]:
    """Given keys the run will not read: `moe.*` unless the model is the reference MoE LM (or a user
    factory, which may read them), `pipeline.*` when mesh.pipeline is 1."""
    moe = [k for k in given if k.startswith("moe.")] if cfg.model.name == "decoder" else []
    return moe + ([k for k in given if k.startswith("pipeline.")] if cfg.mesh.pipeline == 1 else [])


def config_warnings(cfg) -> list[str]:
    """One line each: the given keys this run ignores (`cfg.ignored`, set by `from_dict`), a warmup
    longer than the run."""
    out = []
    keys = getattr(cfg, "ignored", [])
    if keys:
        why = []
        if any(k.startswith("moe.") for k in keys):
            why.append(f"moe.* needs model.name=moe (model.name={cfg.model.name})")
        if any(k.startswith("pipeline.") for k in keys):
            why.append("pipeline.* needs mesh.pipeline > 1")
        out.append(f"warning: ignoring {', '.join(keys)}: {'; '.join(why)}")
    t = cfg.train
    if t.warmup_steps > cfg.steps:
        out.append(
            f"warning: train.warmup_steps={t.warmup_steps} is more than steps={cfg.steps}: the learning rate "
            f"rises to only {cfg.steps / t.warmup_steps:.0%} of train.lr={t.lr:g}; set train.warmup_steps "
            f"<= {cfg.steps}"
        )
    return out
