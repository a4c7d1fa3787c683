"""Run configuration: a typed schema, YAML files that compose, and dotted KEY=VALUE overrides.

    cfg = load_config("configs/tiny.yaml", ["steps=20", "mesh.tensor=2", "strategy=fsdp"])

Every key is a dataclass field of `schema`; an unknown key, a wrong type or an impossible value raises
`ConfigError` naming the dotted key and, for typos, the closest valid one. A YAML file may say
`base: other.yaml` (relative to itself) to start from another file.

    schema   the sections and their fields, each with its meaning; the option lists, typed once
    load     YAML files, overrides and type coercion -> a validated `Config`
    checks   the value checks that need no devices, each made once (the runtime calls the same ones)
"""

from meshpar.core.config.checks import validate
from meshpar.core.config.load import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    apply_overrides,
    from_dict,
    load_config,
    parse_override,
    to_dict,
)
from meshpar.core.config.schema import (
    TOP_K,
    BatchConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    MeshConfig,
    MetricsConfig,
    ModelConfig,
    MoEConfig,
    PipelineConfig,
    ProfileConfig,
    ServeConfig,
    TrainConfig,
    top_k,
)
from meshpar.core.errors import ConfigError

__all__ = [
    "CONFIG_DIR",
    "DEFAULT_CONFIG",
    "TOP_K",
    "BatchConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "MeshConfig",
    "MetricsConfig",
    "ModelConfig",
    "MoEConfig",
    "PipelineConfig",
    "ProfileConfig",
    "ServeConfig",
    "TrainConfig",
    "apply_overrides",
    "from_dict",
    "load_config",
    "parse_override",
    "to_dict",
    "top_k",
    "validate",
]
