"""Layer 4, runtime: processes, schedulers and signals.

distributed  `jax.distributed` set-up (SLURM, Open MPI, TPU, explicit), preemption, peer-failure watchdog
launch       `meshpar launch N`: N local processes on loopback, each with its devices
slurm        the SLURM batch script (`meshpar launch --print-slurm`, launch/slurm.sbatch)
compilers    the GPU (CUDA) and TPU compilers for deviceless compiles, in their own folder (`meshpar compilers`)
"""
