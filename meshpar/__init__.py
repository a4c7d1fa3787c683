"""meshpar: one named device mesh, logical axis rules, and every parallelism as a rule set.

The public API (imported lazily, so `import meshpar` stays cheap and sets up no JAX backend):

    import meshpar
    cfg = meshpar.load_config("my.yaml", ["strategy=fsdp", "mesh.fsdp=8"])
    trainer = meshpar.Trainer(cfg, model=my_factory, loss=my_loss, batch_spec=my_batch_spec)
    meshpar.run(cfg, trainer=trainer, source=my_source)

Where each idea lives (no import cycles; tests/test_user_contract.py checks it):
  errors.py      one-line user errors;          mesh.py  the device mesh (pipeline, data, fsdp, expert, tensor)
  rules.py       logical axis names, strategy presets as rule tables, first-match resolution, `constrain`
  precision.py   dtype policies (bf16, fp32, fp16 + dynamic loss scaling), fp32 cross-entropy
  layers.py      helpers for model code: `param` (annotated init), `stacked`, `scan_layers` (+ remat)
  sharding.py    abstract model -> parameter / variable / optimizer-state / batch shardings, sharding table
  data.py        batch specs (`Leaf`), synthetic Markov language, token files, text; per-process rows
  moe.py         mixture of experts: GShard/Switch routing, dispatch/combine (all-to-all over `expert`)
  stages.py      the stage protocol: a model as pre / stacked layers / post / loss, what a pipeline cuts
  schedules.py   pipeline schedules as tick tables (GPipe, 1F1B, interleaved), bubble, stash
  pipeline.py    pipeline parallelism: shard_map manual over `pipeline`, microbatches through stages
  step.py        optimizer, sharded init, the jitted train step (accumulation, ZeRO-1/2, loss scaling)
  flops.py       model FLOPs and MFU denominators;   inspect.py  compiled-HLO collectives, memory, FLOPs
  hardware.py, costmodel.py, plan.py, dryrun.py      `meshpar plan`: presets, formulas, search, compile-and-compare
  checkpoint.py  Orbax checkpoints: async save, restore onto any mesh, damaged-checkpoint fallback
  distributed.py jax.distributed set-up, preemption (SIGTERM), peer-failure watchdog
  slurm.py       the SLURM batch script (`meshpar launch --print-slurm`, launch/slurm.sbatch)
  metrics.py     progress bar, JSON Lines, TensorBoard; loop.py  the training loop (data, metrics, checkpoints)
  evaluate.py    held-out evaluation;  profile.py  jax.profiler window;  plot.py  `meshpar plot`
  sampling.py    greedy / temperature / top-k / top-p, traced per slot
  serve.py       KV-cache inference: prefill, insert, generate, continuous batching (serving layouts)
  tokenizer.py   byte-level and `tokenizers` text <-> ids;  hf.py  Hugging Face safetensors import/export
  config.py      YAML + dotted overrides, validated; cli.py / launch.py  `meshpar train|inspect|launch|plan|generate|export|plot`
The reference models (`meshpar.models`, the repo's `models/`) use this API like any user model.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> module that defines it
_API = {
    # configuration and the mesh
    "Config": "meshpar.core.config", "load_config": "meshpar.core.config", "from_dict": "meshpar.core.config",
    "make_mesh": "meshpar.core.mesh", "fake_cpu_devices": "meshpar.core.mesh",
    # logical axes and strategies
    "PRESETS": "meshpar.core.rules", "LOGICAL_AXES": "meshpar.core.rules", "Layout": "meshpar.core.rules",
    "get_strategy": "meshpar.core.rules", "parse_user_rules": "meshpar.core.rules", "constrain": "meshpar.core.rules",
    "use_layout": "meshpar.core.rules",
    # model-building helpers
    "param": "meshpar.nn.layers", "stacked": "meshpar.nn.layers", "scan_layers": "meshpar.nn.layers",
    "stage_loss": "meshpar.nn.stages", "apply_layers": "meshpar.nn.stages",
    "use_policy": "meshpar.core.precision", "get_policy": "meshpar.core.precision", "compute_dtype": "meshpar.core.precision",
    "param_dtype": "meshpar.core.precision", "cross_entropy": "meshpar.core.precision",
    # shardings of a model
    "model_spec": "meshpar.core.sharding", "building": "meshpar.core.sharding", "logical_axes": "meshpar.core.sharding",
    "param_shardings": "meshpar.core.sharding", "sharding_table": "meshpar.core.sharding",
    "render_sharding_table": "meshpar.core.sharding",
    # batches and data
    "Leaf": "meshpar.core.batch", "lm_batch_spec": "meshpar.core.batch", "Batches": "meshpar.train.data",
    # training
    "Trainer": "meshpar.train.step", "lm_loss": "meshpar.train.loss", "run": "meshpar.train.loop",
    "Checkpointer": "meshpar.io.checkpoint", "report": "meshpar.plan.inspect",
    # serving
    "Engine": "meshpar.serve.engine", "Request": "meshpar.serve.batching", "Completion": "meshpar.serve.batching",
    "Sampling": "meshpar.serve.sampling",
    # errors
    "MeshparError": "meshpar.core.errors", "ConfigError": "meshpar.core.errors", "ShardingError": "meshpar.core.errors",
}

__all__ = sorted(_API)


def _models_beside_the_package() -> None:
    """A source checkout keeps the reference models in `models/` beside this package (an install
    puts them in `meshpar/models`). From the repository root the checkout shadows any install
    (`python -m meshpar.cli`, `meshpar launch`'s processes), so map `meshpar.models` to that folder;
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
            return importlib.util.spec_from_file_location(name, os.path.join(beside, "__init__.py"),
                                                          submodule_search_locations=[beside])
    sys.meta_path.append(BesideFinder())


_models_beside_the_package()


def __getattr__(name: str):
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'meshpar' has no attribute '{name}'")


def __dir__():
    return sorted(set(globals()) | set(_API))
