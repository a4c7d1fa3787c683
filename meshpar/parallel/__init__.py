"""Layer 2, parallel: what is written by hand over one mesh axis (everything else is GSPMD's).

schedules  pipeline schedules as tick tables (GPipe, 1F1B, interleaved), bubble, activation stash
residuals  1F1B's stash: a stage's VJP kept as arrays between its forward and backward tick
pipeline   pipeline parallelism: `jax.shard_map` manual over `pipeline`, microbatches through the stages
pipeline_decode  decoding through the stages, the pipe kept full across calls (serving on a pipeline mesh)
context    context parallelism: sequences split over `context`, attention across the shards (`meshpar.attention`)
"""
