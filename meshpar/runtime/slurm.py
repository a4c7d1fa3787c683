"""The SLURM batch script: `meshpar launch --print-slurm [--nodes N --gpus-per-node G ...] [train args]`.

One task per GPU (JAX's convention under `srun`), all joined by `jax.distributed`, which detects
the job step by itself (meshpar/runtime/distributed.py: SLURM_NTASKS > 1; coordinator the step's first
node). `launch/slurm.sbatch` is this module's output for 2 nodes x 8 GPUs (a test keeps them equal),
so what the tests run on a real single-node SLURM is what users submit.

What the script does, and why:
- the interpreter is the one that printed the script (`sys.executable`, baked in), or for the
  shipped script `$PYTHON`, the submitting shell's `$VIRTUAL_ENV`, the submit directory's `.venv`,
  `python3`, in that order; one that cannot import meshpar stops the job with one line (the compute
  node's first `python` on PATH often has no jax);
- no XLA flags of its own: each task's `meshpar train` adds meshpar's GPU flags where its jax has a CUDA
  plugin (`meshpar.runtime.xla_flags`; the job's own XLA_FLAGS win, flag by flag);
- preemption: `--signal=TERM@180` and `scancel`/`scontrol requeue` send SIGTERM to the tasks, which
  agree on a step, save a checkpoint and exit 143; the batch step (`meshpar launch --relay srun ...`) outlives its
  own SIGTERM and returns srun's status. With `--requeue` SLURM runs the script again: the same command resumes from
  checkpoint.dir (shared storage), appending to its metrics file; SLURM_RESTART_COUNT is in the start record;
- a dead task: `srun --kill-on-bad-exit` ends the step, the survivors' watchdog names the lost peer
  (MESHPAR_PEER_TIMEOUT), and the job ends FAILED with the reason in its output file;
- Gloo's connection reports (CPU jobs) are dropped from the output (`meshpar launch --relay`).
"""

from __future__ import annotations

import argparse
import shlex
import sys

PROG = "meshpar launch --print-slurm"

HEADER = """\
#!/bin/bash
# meshpar on a SLURM cluster: one task per GPU, joined by jax.distributed (it detects the job step).
# Written by `meshpar launch --print-slurm{flags}` (meshpar/runtime/slurm.py says what each part is for);
# print one for your cluster instead of editing the #SBATCH lines:
#
#   meshpar launch --print-slurm --nodes 4 --gpus-per-node 8 --partition gpu --config my.yaml > job.sbatch
#   sbatch job.sbatch checkpoint.dir=/shared/ck/run1 checkpoint.every=500    # more train arguments
#
# CPU-only nodes (fake devices, gloo): override the lines on the command line, e.g. 2 tasks on one node:
#   sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 launch/slurm.sbatch steps=3
#
# SIGTERM (preemption, the time limit's --signal, scancel, scontrol requeue): the tasks agree on a
# step, save and exit 143; with --requeue the job runs again and resumes from checkpoint.dir, which
# must be storage every node sees. A dead task ends the job (FAILED) within MESHPAR_PEER_TIMEOUT.
"""

BODY = """\
set -uo pipefail
cd "${{SLURM_SUBMIT_DIR:-.}}"
# the interpreter: $PYTHON, else {python_source}
if [[ -z "${{PYTHON:-}}" ]]; then
{python_lines}
fi
if ! "$PYTHON" -c 'import meshpar' >/dev/null 2>&1; then
  echo "meshpar: error: $PYTHON cannot import meshpar; submit from the environment that has it (source .venv/bin/activate) or set PYTHON=/path/to/venv/bin/python" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1
export MESHPAR_HEARTBEAT_TIMEOUT=${{MESHPAR_HEARTBEAT_TIMEOUT:-60}}
export MESHPAR_PEER_TIMEOUT=${{MESHPAR_PEER_TIMEOUT:-20}}
echo "meshpar: job ${{SLURM_JOB_ID}} (restart ${{SLURM_RESTART_COUNT:-0}}): ${{SLURM_NTASKS}} tasks on ${{SLURM_JOB_NUM_NODES}} node(s) (${{SLURM_JOB_NODELIST}}), $PYTHON"
# --kill-on-bad-exit: one failed task ends the step instead of leaving the others waiting.
# `launch --relay` runs srun, drops Gloo's connection reports from its output and outlives the
# SIGTERM the tasks save on (preemption, scancel, requeue); its status is srun's.
exec "$PYTHON" -m meshpar.cli launch --relay srun --kill-on-bad-exit=1 --cpu-bind=none \\
  "$PYTHON" -m meshpar.cli train{train_args} "$@"
"""

SHIPPED_PYTHON = """\
  if [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then PYTHON=$VIRTUAL_ENV/bin/python
  elif [[ -x .venv/bin/python ]]; then PYTHON=$PWD/.venv/bin/python
  else PYTHON=python3; fi"""


def render(
    nodes: int = 2,
    gpus_per_node: int = 8,
    tasks_per_node: int | None = None,
    cpus_per_task: int = 8,
    time: str = "24:00:00",
    partition: str | None = None,
    account: str | None = None,
    job_name: str = "meshpar",
    python: str | None = None,
    train_args=(),
    flags: str = "",
) -> str:
    """The batch script. `python`: the interpreter baked in (None: found at run time, as shipped)."""
    tasks = tasks_per_node or max(gpus_per_node, 1)
    lines = [f"--job-name={job_name}", f"--nodes={nodes}", f"--ntasks-per-node={tasks}"]
    lines += [f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    lines += [f"--cpus-per-task={cpus_per_task}", f"--time={time}"]
    lines += [f"--partition={partition}"] if partition else []
    lines += [f"--account={account}"] if account else []
    lines += ["--signal=TERM@180", "--requeue", "--open-mode=append", f"--output={job_name}-%j.out"]
    if python is None:
        source, python_lines = "the submitting shell's venv, the submit directory's .venv, python3", SHIPPED_PYTHON
    else:
        source, python_lines = "the one that wrote this script", f"  PYTHON={shlex.quote(python)}"
    args = "".join(" " + shlex.quote(a) for a in train_args)
    return (
        HEADER.format(flags=flags)
        + "".join(f"#SBATCH {x}\n" for x in lines)
        + BODY.format(python_source=source, python_lines=python_lines, train_args=args)
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Print a SLURM batch script for `meshpar train` on a "
        "cluster (then: sbatch it). Arguments it does not know are train arguments.",
    )
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=8, help="0 for CPU-only nodes")
    p.add_argument("--tasks-per-node", type=int, default=None, help="default: one per GPU (1 without GPUs)")
    p.add_argument("--cpus-per-task", type=int, default=8)
    p.add_argument("--time", default="24:00:00", help="the job's time limit (SIGTERM comes 180 s before it)")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--job-name", default="meshpar")
    p.add_argument(
        "--shipped",
        action="store_true",
        help="find the interpreter at run time (as launch/slurm.sbatch does) instead of baking in this one",
    )
    return p


def main(argv: list[str]) -> int:
    """`argv`: the arguments after `--print-slurm`; the script goes to stdout."""
    parser = _parser()
    opts, train_args = parser.parse_known_args(argv)
    for name in ("nodes", "cpus_per_task"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}")
    if opts.gpus_per_node < 0 or (opts.tasks_per_node is not None and opts.tasks_per_node < 1):
        parser.error("--gpus-per-node must be >= 0 and --tasks-per-node >= 1")
    given = [a for a in argv if a not in train_args]
    sys.stdout.write(
        render(
            opts.nodes,
            opts.gpus_per_node,
            opts.tasks_per_node,
            opts.cpus_per_task,
            opts.time,
            opts.partition,
            opts.account,
            opts.job_name,
            None if opts.shipped else sys.executable,
            train_args,
            flags="".join(" " + shlex.quote(a) for a in given),
        )
    )
    return 0
