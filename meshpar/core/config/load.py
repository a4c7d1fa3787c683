"""Loading a run config: YAML files that compose (`base:`), dotted KEY=VALUE overrides, and the
coercion of plain values into `schema`'s typed dataclasses, with one-line errors naming the key."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from meshpar.core.config.checks import validate
from meshpar.core.config.schema import Config, top_k
from meshpar.core.errors import ConfigError, suggest
from meshpar.core.notices import given_keys, ignored_keys
from meshpar.core.pretrained import resolve


def _config_dir() -> Path:
    """`configs/` of a source checkout, else the copy installed as the package `meshpar.configs`."""
    src = Path(__file__).resolve().parents[3] / "configs"
    if (src / "tiny.yaml").exists():
        return src
    import importlib.resources

    return Path(str(importlib.resources.files("meshpar.configs")))


CONFIG_DIR = _config_dir()
DEFAULT_CONFIG = CONFIG_DIR / "tiny.yaml"


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert `value` to type `tp`; `key` is the dotted name for errors."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return _build(tp, value, key + ".")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        _, vt = typing.get_args(tp)
        return {k: _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads '1e-3' (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
        if not math.isfinite(number):  # nan, inf, .inf: no setting means that
            raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
    return value


def _build(cls, data: dict, prefix: str = ""):
    types_ = _field_types(cls)
    for k in data:
        if k not in types_:
            raise ConfigError(f"unknown config key '{prefix}{k}'" + suggest(k, types_, prefix))
    kwargs = {k: _coerce(v, types_[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "dcn":
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_yaml(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"config file '{path}' does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file '{path}' is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "a config is YAML: save it as UTF-8"
        ) from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping at the top level")
    base = data.pop("base", None)
    if base is not None:
        base_path = (path.parent / base) if not Path(base).is_absolute() else Path(base)
        if not base_path.exists() and (CONFIG_DIR / base).exists():
            base_path = CONFIG_DIR / base
        data = _merge(_read_yaml(base_path), data)
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """'mesh.tensor=2' -> (['mesh', 'tensor'], 2); values are parsed as YAML scalars/lists."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like KEY=VALUE (e.g. mesh.tensor=2)")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = _merge({}, data)
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{k}' is not a section")
        node[keys[-1]] = value
    return data


def from_dict(data: dict, given: list[str] | None = None) -> Config:
    """Build, complete from `model.init_from` (`meshpar.core.pretrained`) and validate; `given`: the
    dotted keys the user set (default: those of `data` that differ from the defaults,
    `meshpar.core.notices`); `cfg.ignored` lists those the run will not read."""
    cfg = _build(Config, data)
    given = given_keys(data, [], Config()) if given is None else given
    resolve(cfg, given, top_k)  # what a Mixtral / Qwen3-MoE model.init_from implies (model.name, moe.*)
    validate(cfg)
    cfg.ignored = ignored_keys(given, cfg)
    return cfg


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, under: dict | None = None
) -> Config:
    """The YAML file (default: the embedded configs/tiny.yaml) + KEY=VALUE overrides, validated.
    `under`: settings laid under them (a checkpoint's saved model settings, for `generate`): a given
    file and the overrides win over them, and they win over the embedded default."""
    data = _read_yaml(Path(path) if path else DEFAULT_CONFIG)
    if under:
        data = _merge(under, data) if path else _merge(data, under)
    overrides = overrides or []
    given = given_keys(data, [parse_override(o) for o in overrides], Config())
    return from_dict(apply_overrides(data, overrides), given)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
