"""Layer 0, core: what every other layer speaks. No model, no training, no devices touched at import.

errors     one-line user errors (`MeshparError`, `ConfigError`, `ShardingError`) and suggestions
config     the run config schema (dataclasses), YAML + dotted overrides, validation
annotate   the config as commented YAML (`meshpar config`)
registry   names in a config -> code (`PKG.MODULE:NAME`, reference models, losses)
platform   the platform a program is built for (cpu, gpu, tpu): JAX's backend, or a deviceless target's
mesh       the device mesh from `cfg.mesh`: named axes pipeline, data, fsdp, context, expert, tensor (ICI x DCN)
rules      logical axis names, strategy presets as rule tables, first-match resolution, `constrain`
precision  dtype policies (bf16, fp32, fp16 + dynamic loss scaling), fp32 cross-entropy
batch      what a batch is: a tree of `Leaf` (shape, dtype, logical axes)
sharding   any nnx.Module -> parameter / variable / optimizer-state / batch shardings, the sharding table
"""
