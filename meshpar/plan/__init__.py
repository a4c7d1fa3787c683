"""Layer 7, plan: what a configuration will cost before it runs, and what the compiled step holds.

hardware   accelerator presets (FLOP/s, memory, ICI / DCN bandwidth)
costmodel  a candidate layout and its memory formulas (state, activations, workspace)
steptime   its collectives and step time (ring formulas, overlap, bubble); `evaluate` joins the two
search     `meshpar plan`: candidate layouts, ranking, the winner as YAML
inspect    the compiled step: collectives by bytes and mesh axes, memory, FLOPs
dryrun     compile the planned layout on fake devices (or a --target) and compare with the formulas
target     deviceless targets: H100 / TPU v5p ... devices from jax.experimental.topologies (`--target`)
program    a target's compiled program: the kernels chosen, the collective bytes its schedule hides
"""
