"""Layer 1, nn: what model code calls. Logical axis names only; never a mesh axis or a device count.

layers   `param` (annotated init), `stacked` (the `layers` axis), `scan_layers` (+ remat policies)
attention  the attention mask as data, the xla / cudnn kernels, the kernel choice (`model.attention`)
flash    blockwise attention with an online softmax and a recomputing backward: O(S) memory
splash   Pallas splash attention (TPU)
routing  MoE routing: scores, top-K, gates, capacity slots, aux/z losses, the balancing bias
moe      mixture of experts: dispatch/combine (all-to-all over `expert`), dropless grouped matmuls
gmm      grouped matmul for dropless experts: `ragged_dot`, or row tiles where XLA:CPU runs it densely
stages   the stage protocol: a model as pre / stacked layers / post / loss, what a pipeline cuts
"""
