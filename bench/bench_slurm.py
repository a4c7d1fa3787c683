"""Two processes of the default model under a real single-node SLURM vs `meshpar launch 2`, side by side.

    python bench/bench_slurm.py [--rounds 3] [--steps 40]

Needs SLURM installed (apt-get install slurm-wlm munge) and root; starts its own daemons on loopback
(tests/runtime/slurm_cluster.py). Alternates the two launchers each round, so both see the same machine.
Reports per launcher: seconds from submission (`sbatch` returning / `meshpar launch` started) to the
first step record in the metrics file, and the median step time of steps 3.. (what training costs
once compiled), medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from meshpar.train.plot import read_run  # noqa: E402
from tests.runtime.slurm_cluster import SlurmCluster, unavailable  # noqa: E402


def _first_step_s(path: Path, t0: float, alive) -> float:
    while not (path.exists() and '"event": "step"' in path.read_text()):
        if not alive():
            raise RuntimeError(f"the run ended before its first step ({path})")
        time.sleep(0.02)
    return time.monotonic() - t0


def _median_step(path: Path) -> float:
    return statistics.median(r["step_time_s"] for r in read_run(str(path))["steps"] if r["step"] >= 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    opts = ap.parse_args()
    why = unavailable()
    if why:
        sys.exit(f"bench_slurm: {why}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    train = [f"steps={opts.steps}", "train.log_every=1"]
    root = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
    cluster = SlurmCluster.start(root / "cluster")
    results = {"slurm": [], "launch": []}
    try:
        for r in range(opts.rounds):
            d = root / f"round{r}"
            d.mkdir()
            m = d / "slurm.jsonl"
            t0 = time.monotonic()
            job = cluster.sbatch(
                [
                    "--nodes=1",
                    "--ntasks-per-node=2",
                    "--gpus-per-node=0",
                    "--cpus-per-task=1",
                    f"--output={d / 'slurm.out'}",
                    str(REPO / "launch" / "slurm.sbatch"),
                    *train,
                    f"--metrics-out={m}",
                ],
                cwd=REPO,
                env={**env, "PYTHON": sys.executable},
            )
            alive = ("PENDING", "RUNNING", "CONFIGURING")
            first = _first_step_s(m, t0, lambda job=job, alive=alive: cluster.job(job)["JobState"] in alive)
            info = cluster.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 600)
            assert info["JobState"] == "COMPLETED", (d / "slurm.out").read_text()[-2000:]
            results["slurm"].append((first, _median_step(m)))

            m = d / "launch.jsonl"
            t0 = time.monotonic()
            p = subprocess.Popen(
                [sys.executable, "-m", "meshpar.cli", "launch", "2", *train, f"--metrics-out={m}"],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            first = _first_step_s(m, t0, lambda p=p: p.poll() is None)
            assert p.wait() == 0
            results["launch"].append((first, _median_step(m)))
            print(f"round {r}: slurm {results['slurm'][-1]}, launch {results['launch'][-1]}", flush=True)
    finally:
        cluster.stop()
    print("\n| launcher | submit -> first step (s) | step time (ms, median of steps 3..) |")
    print("|---|---|---|")
    for name, label in (
        ("slurm", "`sbatch launch/slurm.sbatch` (2 tasks x 4 devices)"),
        ("launch", "`meshpar launch 2` (2 processes x 4 devices)"),
    ):
        firsts, steps = zip(*results[name])
        print(f"| {label} | {statistics.median(firsts):.1f} | {1e3 * statistics.median(steps):.1f} |")


if __name__ == "__main__":
    main()
