"""Multi-process runs: settings from flags / environment / cluster, and a real 2-process launch on
loopback (gloo) that matches one process, survives nothing silently when a peer dies, and resumes."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshpar.core.errors import ConfigError
from meshpar.runtime.distributed import Settings, resolve
from tests.conftest import checkpoint_steps, metrics_losses

REPO = Path(__file__).resolve().parents[2]


# -- where the settings come from --------------------------------------------------------------


def test_flags_win_over_environment():
    env = {"MESHPAR_COORDINATOR": "h:1", "MESHPAR_NUM_PROCESSES": "4", "MESHPAR_PROCESS_ID": "3"}
    s = resolve("10.0.0.1:1234", 2, 1, environ=env)
    assert (s.coordinator, s.num_processes, s.process_id, s.method) == ("10.0.0.1:1234", 2, 1, "explicit")
    s = resolve(environ=env)
    assert (s.coordinator, s.num_processes, s.process_id) == ("h:1", 4, 3)
    s = resolve(environ={"JAX_COORDINATOR_ADDRESS": "j:2", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"})
    assert (s.coordinator, s.num_processes, s.process_id) == ("j:2", 2, 0)


def test_single_process_needs_no_distributed_runtime():
    assert resolve(environ={}) is None
    assert resolve(num_processes=1, process_id=0, environ={}) is None
    # an interactive `salloc` shell has a job but no job step: not a multi-process launch
    assert resolve(environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8"}) is None


def test_cluster_detection_from_environment():
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_NTASKS": "16", "SLURM_PROCID": "5"}
    s = resolve(environ=slurm)
    assert (s.method, s.num_processes, s.process_id, s.coordinator) == ("slurm", 16, 5, None)
    s = resolve(environ={"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"})
    assert (s.method, s.num_processes, s.process_id) == ("ompi", 4, 2)
    assert resolve(environ={"MESHPAR_DISTRIBUTED": "auto"}).method == "tpu"
    assert (
        resolve(
            environ={
                "MESHPAR_HEARTBEAT_TIMEOUT": "12",
                "MESHPAR_NUM_PROCESSES": "2",
                "MESHPAR_PROCESS_ID": "1",
                "MESHPAR_COORDINATOR": "h:1",
            }
        ).heartbeat_timeout
        == 12
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_processes=2, process_id=0), r"--coordinator"),
        (dict(coordinator="h:1", num_processes=2, process_id=2), r"--process-id must be in \[0, 2\), got 2"),
        (dict(coordinator="h:1", num_processes=0, process_id=0), r"--num-processes must be >= 1"),
    ],
)
def test_incomplete_or_impossible_settings_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        resolve(**kwargs, environ={})


def test_settings_describe_names_the_process():
    assert Settings("h:1", 2, 1, "explicit").describe() == "process 1 of 2 (explicit, coordinator h:1)"


# -- two real processes -------------------------------------------------------------------------

STEPS = 16
RUN = [f"steps={STEPS}", "train.log_every=1"]  # the default config (tiny LM, bf16, data=2 fsdp=2 tensor=2)


def _env():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MESHPAR_PEER_TIMEOUT": "10"}
    env.pop("XLA_FLAGS", None)
    return env


def _start(path: Path) -> dict:
    return json.loads(path.read_text().splitlines()[0])


def _local(n: int, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "meshpar.cli", "launch", str(n), "--metrics-out", str(out), *RUN, *extra],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_two_processes_match_one_and_fail_fast_and_resume(tmp_path):
    ck = tmp_path / "ck"
    ref = subprocess.Popen(
        [sys.executable, "-m", "meshpar.cli", "train", "--metrics-out", str(tmp_path / "ref.jsonl"), *RUN],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = _local(2, tmp_path / "mp1.jsonl", f"checkpoint.dir={ck}", "checkpoint.every=2")
    pids, t0 = None, time.monotonic()
    while True:  # until process 0 logged step 5 and a checkpoint >= 4 is complete
        assert first.poll() is None, first.stderr.read()[-3000:]
        assert time.monotonic() - t0 < 240, "2-process run made no progress"
        if max(metrics_losses(tmp_path / "mp1.jsonl"), default=0) >= 5 and any(s >= 4 for s in checkpoint_steps(ck)):
            break
        time.sleep(0.05)
    # the launcher's first stderr line names the pids: "meshpar launch: 2 processes on ...: pids A B"
    line = first.stderr.readline()
    while "pids" not in line:
        line = first.stderr.readline()
    pids = [int(p) for p in re.search(r"pids ([\d ]+)", line).group(1).split()]
    os.kill(pids[1], signal.SIGKILL)
    t_kill = time.monotonic()
    _, err = first.communicate(timeout=90)
    waited = time.monotonic() - t_kill
    assert first.returncode != 0
    assert waited < 60, f"survivor took {waited:.0f}s"
    assert "lost a peer: process 1 stopped responding" in err, err[-3000:]

    second = _local(2, tmp_path / "mp2.jsonl", f"checkpoint.dir={ck}", "checkpoint.every=2")
    _, err2 = second.communicate(timeout=400)
    assert second.returncode == 0, err2[-3000:]
    resumed = _start(tmp_path / "mp2.jsonl")["resumed_from"]
    assert resumed >= 4 and _start(tmp_path / "mp2.jsonl")["processes"] == 2
    assert (
        min(metrics_losses(tmp_path / "mp2.jsonl")) == resumed + 1
        and max(metrics_losses(tmp_path / "mp2.jsonl")) == STEPS
    )

    _, err_ref = ref.communicate(timeout=400)
    assert ref.returncode == 0, err_ref[-3000:]
    want = metrics_losses(tmp_path / "ref.jsonl")
    assert sorted(want) == list(range(1, STEPS + 1))
    # 2 processes x 4 devices == 1 process x 8 devices, step for step. Only the order of the gloo
    # reductions differs from the in-process ones; under bf16 compute that reaches ~1e-4 relative
    # after 16 steps, far below one bf16 ulp (2^-8 = 4e-3)
    for name in ("mp1.jsonl", "mp2.jsonl"):
        got = metrics_losses(tmp_path / name)
        assert got
        for s, v in got.items():
            assert v == pytest.approx(want[s], rel=1e-3), (name, s, v, want[s])
    diff = max(
        abs(v / want[s] - 1) for n in ("mp1.jsonl", "mp2.jsonl") for s, v in metrics_losses(tmp_path / n).items()
    )
    print(f"peer loss noticed after {waited:.1f}s; resumed from {resumed}; max relative loss difference {diff:.2e}")


def test_the_watchdog_leaves_the_client_before_exit_and_a_finished_peer_is_not_lost(monkeypatch):
    """At exit each process's watchdog stops and waits for its thread to leave the coordination client
    (a daemon thread inside its C++ call at interpreter finalization aborts the process: a resumed
    2-process run's process 1 died so, SIGABRT, "FATAL: exception not rethrown"), then marks itself
    done; process 0 does not call a done peer lost, however long it runs on (a fake client, no JAX)."""
    import threading

    from meshpar.runtime import peers

    class Client:  # the coordination service's key-value store, as the watchdog uses it
        def __init__(self):
            self.kv, self.inside = {}, threading.Event()

        def key_value_set(self, key, value, allow_overwrite=False):
            self.inside.set()
            time.sleep(0.05)  # a call in flight, as a remote one is
            self.kv[key] = value
            self.inside.clear()

        def key_value_dir_get(self, prefix):
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

        def key_value_try_get(self, key):
            if key not in self.kv:
                raise RuntimeError("NOT_FOUND")
            return self.kv[key]

    def watchdog(me, client):
        w = peers._Watchdog.__new__(peers._Watchdog)
        threading.Thread.__init__(w, daemon=True)
        w.client, w.me, w.n, w.timeout, w.period, w.done = client, me, 2, 0.3, 0.05, threading.Event()
        return w

    lost = []
    monkeypatch.setattr(peers, "_peer_lost", lambda what, me: lost.append(what))
    client = Client()
    peer = watchdog(1, client)
    peer.start()
    time.sleep(0.3)
    peer.stop()
    assert not peer.is_alive() and not client.inside.is_set()  # out of the client's call, for good
    assert client.kv["meshpar/alive/1"] == peers.DONE
    seen, start = {}, time.monotonic() - 10
    watchdog(0, client)._watch_peers(seen, start)  # long past the timeout: a done peer is not lost
    assert lost == []
    client.kv["meshpar/alive/1"] = "7"  # one that stopped beating mid-run still is
    w0 = watchdog(0, client)
    w0._watch_peers(seen, start)
    time.sleep(0.35)
    w0._watch_peers(seen, start)
    assert lost and lost[0].startswith("process 1 stopped responding")


# -- launch scripts that cannot run here: their contract, checked without a cluster ---------------


def test_tpu_pod_dry_run_prints_the_gcloud_command_with_the_arguments_intact():
    """launch/tpu_pod.sh needs a TPU VM pod; `--dry-run` prints the one command it would run."""
    import shlex

    args = ["steps=10", "checkpoint.dir=gs://bucket/run 1", "--metrics-out", "m.jsonl"]
    r = subprocess.run(
        ["bash", str(REPO / "launch" / "tpu_pod.sh"), "--dry-run", "my-v5p-64", "us-east5-a", *args],
        env={**os.environ, "PROJECT": "proj", "PYTHON": "python3.12"},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout)
    assert argv[:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v5p-64", "--zone", "us-east5-a", "--project"]
    assert argv[9:12] == ["proj", "--worker=all", "--command"] and len(argv) == 13
    remote = shlex.split(argv[12])  # what every worker's shell runs
    assert remote[:3] == ["cd", "~/meshpar", "&&"] and "MESHPAR_DISTRIBUTED=auto" in remote
    assert remote[-(len(args) + 4) :] == ["python3.12", "-m", "meshpar.cli", "train", *args]
    bad = subprocess.run(
        ["bash", str(REPO / "launch" / "tpu_pod.sh"), "--dry-run", "only-a-name"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stderr.startswith("usage: launch/tpu_pod.sh [--dry-run] TPU_NAME ZONE")


def test_print_slurm_writes_a_script_for_the_cluster_asked_for():
    def printed(*args):
        return subprocess.run(
            [sys.executable, "-m", "meshpar.cli", "launch", "--print-slurm", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
        )

    r = printed(
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--partition",
        "gpu",
        "--time",
        "2:00:00",
        "--config",
        "my run.yaml",
        "steps=100",
    )
    assert r.returncode == 0, r.stderr
    sbatch = [x.split(" ", 1)[1] for x in r.stdout.splitlines() if x.startswith("#SBATCH ")]
    assert sbatch[:5] == [
        "--job-name=meshpar",
        "--nodes=4",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--cpus-per-task=8",
    ]
    assert {"--time=2:00:00", "--partition=gpu", "--requeue", "--signal=TERM@180"} <= set(sbatch)
    assert f"  PYTHON={sys.executable}" in r.stdout.splitlines()  # the interpreter that printed it
    assert "meshpar.cli train --config 'my run.yaml' steps=100 \"$@\"" in r.stdout
    cpu = printed("--nodes", "1", "--gpus-per-node", "0")
    assert "#SBATCH --ntasks-per-node=1" in cpu.stdout and "#SBATCH --gpus-per-node" not in cpu.stdout
    bash_n = subprocess.run(["bash", "-n"], input=r.stdout, capture_output=True, text=True)
    assert bash_n.returncode == 0, bash_n.stderr  # the script parses
    bad = printed("--nodes", "0")
    assert bad.returncode == 2 and "--nodes must be >= 1, got 0" in bad.stderr
