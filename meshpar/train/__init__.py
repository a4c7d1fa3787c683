"""Layer 5, train: a training run, from batches to logged metrics and saved state.

step      the pure step: sharded init, loss -> grads -> update (accumulation, ZeRO-1/2, loss scaling)
data      data sources (synthetic Markov language, token files, text, yours) and per-process batches
loop      the loop that wires a run together: data, steps, metrics, evaluation, checkpoints
evaluate  held-out evaluation (one compiled eval step)
metrics   progress bar, JSON Lines, TensorBoard
profile   the `jax.profiler` window
flops     model FLOPs per step and the MFU denominator
plot      `meshpar plot`: loss and throughput curves from a metrics file
"""
