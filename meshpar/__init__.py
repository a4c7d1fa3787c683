"""meshpar: one named device mesh, logical axis rules, and every parallelism as a rule set.

The public API (imported lazily, so `import meshpar` stays cheap and sets up no JAX backend):

    import meshpar
    cfg = meshpar.load_config("my.yaml", ["strategy=fsdp", "mesh.fsdp=8"])
    trainer = meshpar.Trainer(cfg, model=my_factory, loss=my_loss, batch_spec=my_batch_spec)
    meshpar.run(cfg, trainer=trainer, source=my_source)

The folders are the layers, lowest first (core, nn, parallel, io, runtime, train, serve, plan, cli); each
imports only from those below it. docs/architecture.md's table is the one list of the modules, a line each
(tests/test_layout.py checks both).
The reference models (`meshpar.models`, the repo's `models/`) use this API like any user model.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> module that defines it
_API = {
    # configuration and the mesh
    "Config": "meshpar.core.config",
    "load_config": "meshpar.core.config",
    "from_dict": "meshpar.core.config",
    "make_mesh": "meshpar.core.mesh",
    "fake_cpu_devices": "meshpar.core.mesh",
    # logical axes and strategies
    "PRESETS": "meshpar.core.rules",
    "LOGICAL_AXES": "meshpar.core.rules",
    "Layout": "meshpar.core.layout",
    "get_strategy": "meshpar.core.rules",
    "parse_user_rules": "meshpar.core.rules",
    "constrain": "meshpar.core.layout",
    "use_layout": "meshpar.core.layout",
    # model-building helpers
    "attention": "meshpar.parallel.attention",
    "param": "meshpar.nn.layers",
    "stacked": "meshpar.nn.layers",
    "scan_layers": "meshpar.nn.layers",
    "after": "meshpar.nn.layers",
    "settled_cotangent": "meshpar.nn.layers",
    "gated_inputs": "meshpar.nn.layers",
    "stage_loss": "meshpar.nn.stages",
    "apply_layers": "meshpar.nn.stages",
    "use_policy": "meshpar.core.precision",
    "get_policy": "meshpar.core.precision",
    "compute_dtype": "meshpar.core.precision",
    "param_dtype": "meshpar.core.precision",
    "cross_entropy": "meshpar.core.precision",
    "weighted": "meshpar.core.objective",
    "chunked_cross_entropy": "meshpar.core.precision",
    # shardings of a model
    "model_spec": "meshpar.core.sharding",
    "building": "meshpar.core.sharding",
    "logical_axes": "meshpar.core.sharding",
    "param_shardings": "meshpar.core.sharding",
    "sharding_table": "meshpar.core.sharding",
    "render_sharding_table": "meshpar.core.sharding",
    # batches and data
    "Leaf": "meshpar.core.batch",
    "lm_batch_spec": "meshpar.core.batch",
    "Batches": "meshpar.train.batches",
    # training
    "Trainer": "meshpar.train.step",
    "lm_loss": "meshpar.train.loss",
    "run": "meshpar.train.loop",
    "Checkpointer": "meshpar.io.checkpoint",
    "report": "meshpar.plan.inspect",
    # serving
    "Engine": "meshpar.serve.engine",
    "Request": "meshpar.serve.requests",
    "Completion": "meshpar.serve.requests",
    "Sampling": "meshpar.serve.requests",
    # errors
    "MeshparError": "meshpar.core.errors",
    "ConfigError": "meshpar.core.errors",
    "ShardingError": "meshpar.core.errors",
}

__all__ = sorted(_API)


def _models_beside_the_package() -> None:
    """A source checkout keeps the reference models in `models/` beside this package (an install
    puts them in `meshpar/models`). From the repository root the checkout shadows any install
    (`python -m meshpar.cli`, `meshpar launch`'s processes), so map `meshpar.models` to that folder,
    ahead of every other finder (an editable install of another checkout maps it to its own);
    nothing is imported until a config names a reference model."""
    import importlib.abc
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    beside = os.path.join(os.path.dirname(here), "models")
    if os.path.isdir(os.path.join(here, "models")) or not os.path.isfile(os.path.join(beside, "__init__.py")):
        return

    class BesideFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "meshpar.models":
                return None
            return importlib.util.spec_from_file_location(
                name, os.path.join(beside, "__init__.py"), submodule_search_locations=[beside]
            )

    sys.meta_path.insert(0, BesideFinder())


_models_beside_the_package()


def __getattr__(name: str):
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'meshpar' has no attribute '{name}'")


def __dir__():
    return sorted(set(globals()) | set(_API))
