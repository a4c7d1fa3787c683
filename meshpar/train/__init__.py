"""Layer 5, train: a training run, from batches to logged metrics and saved state.

optimizer  AdamW, global-norm clipping, warmup + cosine (`cfg.train`)
loss       `lm_loss` and the loss contract `(model, batch) -> (loss, metrics)`
state      `TrainSetup`: mesh, layout, the train state's shardings, the sharded init
step       `Trainer`: the jitted step (accumulation, ZeRO-1/2, loss scaling)
data       data sources (synthetic Markov language, token files, text, yours) and per-process batches
evaluate   held-out evaluation (one compiled eval step)
metrics    progress bar, JSON Lines, TensorBoard
profile    the `jax.profiler` window
flops      model FLOPs per step and the MFU denominator
loop       the loop that wires a run together: data, steps, metrics, evaluation, checkpoints
plot       `meshpar plot`: loss and throughput curves from a metrics file
"""
