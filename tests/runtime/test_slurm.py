"""meshpar under a real SLURM (tests/runtime/slurm_cluster.py: slurmctld + slurmd on this machine, loopback).

What a user submits is what runs: `launch/slurm.sbatch` (the shipped script, with this machine's
overrides on the sbatch command line) and a script from `meshpar launch --print-slurm`. Both run
with a bare `python` first on PATH, so the interpreter must come from the script, not from PATH.

- 2 tasks x 4 fake CPU devices train the default model and equal 1 process x 8 devices;
- `scontrol requeue` mid-run: every task saves at one step, SLURM runs the job again, it resumes
  and finishes with the parameters of an uninterrupted job, bit for bit, and a metrics file holding
  every step once;
- a task killed mid-run ends the job FAILED within 60 s, with the reason in its output file.
Skipped (one line) only where SLURM is not installed; `.ci/run` installs it. The jobs are `slow` (about
60 s together); the inner loop keeps the check that the shipped script is `--print-slurm`'s output.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import metrics_losses, metrics_records
from tests.runtime.slurm_cluster import SlurmCluster, unavailable

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "launch" / "slurm.sbatch"
CPU_NODE = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"]
# the default model, exact (fp32), a few seconds of steps; the same for every job below
TRAIN = ["precision=fp32", "train.log_every=1", "steps=16"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = unavailable()
    if why:
        pytest.skip(why)
    c = SlurmCluster.start(tmp_path_factory.mktemp("slurm"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def user_env(tmp_path_factory):
    """The submitting shell: a bare interpreter (no jax) first on PATH, no venv activated, and none of
    the test session's JAX / XLA settings (the jobs compile as users' runs do)."""
    bare = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_", "XLA_", "MESHPAR_", "SLURM_", "VIRTUAL_ENV", "PYTHON"))
    }
    env["PATH"] = f"{bare / 'bin'}:{env['PATH']}"
    if Path(sys.prefix) != REPO / ".venv":  # the shipped script's fallback is the submit dir's .venv
        env["VIRTUAL_ENV"] = sys.prefix
    return env


def _run_job(cluster, args, cwd, env, timeout=180):
    job = cluster.sbatch(args, cwd=cwd, env=env)
    return job, cluster.wait(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), timeout)


def _wait_for_step(cluster, job: int, metrics: Path, step: int, out: Path, timeout: float = 120) -> None:
    """Until the job's metrics file has logged `step`; fails if the job ends or stalls first."""
    deadline = time.monotonic() + timeout
    while not any(s >= step for s in metrics_losses(metrics)):
        assert cluster.job(job)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), _output(out)
        assert time.monotonic() < deadline, _output(out)
        time.sleep(0.05)


def _output(path: Path) -> str:
    return path.read_text() if path.exists() else "(no output file)"


def _final_params(ckpt_dir: Path):
    """The newest checkpoint's step and training state (parameters, optimizer) as numpy arrays."""
    import jax
    import orbax.checkpoint as ocp

    step = max(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
    path, reader = ckpt_dir / str(step) / "state", ocp.PyTreeCheckpointer()
    meta = reader.metadata(path)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", getattr(meta, "item_metadata", meta))
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return step, reader.restore(path, restore_args=as_numpy)


@pytest.fixture(scope="module")
def uninterrupted(cluster, user_env, tmp_path_factory):
    """The shipped script, 2 tasks on one CPU node, from the repository root as the README runs it."""
    d = tmp_path_factory.mktemp("whole")
    out = d / "job.out"
    job, info = _run_job(
        cluster,
        [
            *CPU_NODE,
            f"--output={out}",
            str(SHIPPED),
            *TRAIN,
            f"checkpoint.dir={d / 'ck'}",
            f"--metrics-out={d / 'm.jsonl'}",
        ],
        cwd=REPO,
        env=user_env,
    )
    assert info["JobState"] == "COMPLETED", _output(out)
    return d, job, out


def test_the_shipped_script_is_print_slurm_default_output():
    printed = subprocess.run(
        [sys.executable, "-m", "meshpar.cli", "launch", "--print-slurm", "--shipped"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed == SHIPPED.read_text(), "launch/slurm.sbatch differs from `meshpar launch --print-slurm --shipped`"


@pytest.mark.slow
def test_two_tasks_equal_one_process_of_eight_devices(uninterrupted, tmp_path):
    d, job, out = uninterrupted
    text = out.read_text()
    assert f"meshpar: job {job} (restart 0): 2 tasks on 1 node(s)" in text, text
    assert "8 devices in 2 processes" in text and f"slurm job {job}" in text, text
    assert "[Gloo]" not in text and "is connected to" not in text, text
    start = metrics_records(d / "m.jsonl")[0]
    assert start["processes"] == 2 and start["scheduler"]["job_id"] == str(job)
    assert start["scheduler"]["restart_count"] == 0
    ref = tmp_path / "ref.jsonl"
    subprocess.run(
        [sys.executable, "-m", "meshpar.cli", "train", *TRAIN, f"--metrics-out={ref}"],
        env={k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))},
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=300,
    )
    two, one = metrics_losses(d / "m.jsonl"), metrics_losses(ref)
    assert metrics_records(ref)[0]["processes"] == 1
    assert abs(two[3] - one[3]) <= 1e-5 * abs(one[3]), (two[3], one[3])


@pytest.mark.slow
def test_requeue_mid_run_resumes_and_ends_bitwise_equal(cluster, user_env, uninterrupted, tmp_path):
    whole, _, _ = uninterrupted
    script = tmp_path / "job.sbatch"  # a script as --print-slurm writes it (interpreter baked in)
    script.write_text(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "meshpar.cli",
                "launch",
                "--print-slurm",
                "--nodes",
                "1",
                "--gpus-per-node",
                "0",
                "--tasks-per-node",
                "2",
                "--cpus-per-task",
                "1",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    out, metrics = tmp_path / "job.out", tmp_path / "m.jsonl"
    job = cluster.sbatch(
        [
            f"--output={out}",
            str(script),
            *TRAIN,
            f"checkpoint.dir={tmp_path / 'ck'}",
            "checkpoint.every=100",
            f"--metrics-out={metrics}",
        ],
        cwd=tmp_path,
        env=user_env,
    )
    _wait_for_step(cluster, job, metrics, 3, out)
    cluster.scontrol("requeue", str(job))
    # SLURM lets a requeued job start again only after 120 s (Reason=BeginTime); a queue would wait
    # as long for free nodes anyway. The test moves that begin time to now, nothing else.
    cluster.wait(job, ("PENDING",), 90)
    cluster.scontrol("update", f"JobId={job}", "StartTime=now")
    info = cluster.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 120)
    text = _output(out)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, text)
    assert f"meshpar: job {job} (restart 1)" in text and f"slurm job {job} restart 1" in text, text
    starts = [r for r in metrics_records(metrics) if r["event"] == "start"]
    assert [s["scheduler"]["restart_count"] for s in starts] == [0, 1], starts
    saved = starts[1]["resumed_from"]
    assert 3 <= saved < 16, text  # saved mid-run by the tasks on SIGTERM, not at the end
    steps = [r["step"] for r in metrics_records(metrics) if r["event"] == "step"]
    assert sorted(steps) == list(range(1, 17)) and len(steps) == 16, steps
    step_a, a = _final_params(whole / "ck")
    step_b, b = _final_params(tmp_path / "ck")
    assert step_a == step_b == 16
    import jax

    assert len(jax.tree.leaves(a)) > 10
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_a_killed_task_fails_the_job_within_a_minute(cluster, user_env, tmp_path):
    out, metrics = tmp_path / "job.out", tmp_path / "m.jsonl"
    job = cluster.sbatch(
        [*CPU_NODE, f"--output={out}", str(SHIPPED), *TRAIN, "steps=2000", f"--metrics-out={metrics}"],
        cwd=REPO,
        env={**user_env, "MESHPAR_PEER_TIMEOUT": "10"},
    )
    _wait_for_step(cluster, job, metrics, 1, out)
    os.kill(cluster.task_pid(job, rank=1), signal.SIGKILL)
    t0 = time.monotonic()
    info = cluster.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 90)
    took = time.monotonic() - t0
    text = _output(out)
    print(f"job {job} ended {info['JobState']} {took:.1f} s after its task 1 was killed")
    assert info["JobState"] == "FAILED" and took <= 60, (info, took, text)
    assert "task 1: Killed" in text, text  # srun names the dead task
    assert "lost a peer: process 1 stopped responding" in text, text  # the survivor names its lost peer
