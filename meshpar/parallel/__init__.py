"""Layer 2, parallel: what is written by hand over one mesh axis (everything else is GSPMD's).

schedules  pipeline schedules as tick tables (GPipe, 1F1B, interleaved), bubble, activation stash
pipeline   pipeline parallelism: `jax.shard_map` manual over `pipeline`, microbatches through the stages
"""
