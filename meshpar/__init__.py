"""meshpar: one named device mesh, logical axis rules, and every parallelism as a rule set.

Where each idea lives:
  mesh.py       the device mesh (axes pipeline, data, fsdp, expert, tensor; fake CPU devices)
  rules.py      logical axis names, strategy presets (dp, zero1/2, fsdp, hsdp, tp, tp_sp, fsdp_tp), resolution
  sharding.py   abstract model -> per-parameter / optimizer-state shardings, the sharding table
  pipeline.py   pipeline parallelism: shard_map over `pipeline`, GPipe / 1F1B / interleaved schedules
  moe.py        mixture of experts: GShard/Switch routing, dispatch/combine (all-to-all over `expert`)
  precision.py  dtype policies (bf16, fp32, fp16 + dynamic loss scaling), fp32 cross-entropy
  train.py      optimizer, sharded init, jitted step (microbatches, ZeRO-2 grads), the loop
  data.py       synthetic Markov language (known entropy floor), token files, text; per-process rows
  checkpoint.py Orbax checkpoints: async save, restore onto any mesh, damaged-checkpoint fallback
  distributed.py  jax.distributed set-up, preemption (SIGTERM), peer-failure watchdog
  inspect.py    compiled HLO collectives (bytes, mesh axes), memory_analysis, FLOPs
  metrics.py    progress bar and JSON Lines records
  config.py     YAML + dotted overrides, validated;   cli.py  `meshpar train` / `meshpar inspect`
"""
__version__ = "0.1.0"
