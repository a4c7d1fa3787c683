"""A real single-node SLURM for the tests: `slurmctld` and `slurmd` on loopback, from Debian's
`slurm-wlm` (`.ci/run` installs it), with their own configuration, state and logs in a temporary
directory; nothing on the machine is configured or left running.

    cluster = SlurmCluster.start(tmp_dir)           # daemons up, the node idle (about a second)
    job = cluster.sbatch(["--ntasks=2", script, *args], cwd=..., env=...)
    info = cluster.wait(job, until=("COMPLETED", "FAILED"), timeout=120)   # `scontrol show job` fields
    cluster.stop()                                   # by the daemons' pids, also after a failed test

What it is: one node named as this host is (jax.distributed's SLURM detection resolves the node
list's first host name as the coordinator), at 127.0.0.1 with this machine's CPUs; processes are
tracked without cgroups (`proctrack/linuxproc`, `task/none`); authentication is `auth/none` where
the installed SLURM still ships it (22.05 does), else a private `munged` on its own socket and key.
The clients (`sbatch`, `srun` inside jobs, `scontrol`) find this cluster through SLURM_CONF, which
`env` sets and jobs inherit.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from meshpar.runtime.launch import free_port

PLUGIN_DIRS = (
    "/usr/lib/x86_64-linux-gnu/slurm-wlm",
    "/usr/lib/aarch64-linux-gnu/slurm-wlm",
    "/usr/lib64/slurm",
    "/usr/lib/slurm",
)


def unavailable() -> str | None:
    """Why this machine cannot run the cluster (one line), or None."""
    missing = [p for p in ("slurmctld", "slurmd", "sbatch", "scontrol") if shutil.which(p) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} not found; apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs"
    return None


def _plugin(name: str) -> bool:
    return any(os.path.exists(os.path.join(d, f"{name}.so")) for d in PLUGIN_DIRS)


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.pids: list[int] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- set-up ------------------------------------------------------------------------------------
    @classmethod
    def start(cls, root: Path, kill_wait_s: int = 30) -> SlurmCluster:
        cluster = cls(Path(root))
        try:
            cluster._start(kill_wait_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start(self, kill_wait_s: int) -> None:
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        auth = self._auth()
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=meshpartest",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    *auth,
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"StateSaveLocation={self.root / 'state'}",
                    f"SlurmdSpoolDir={self.root / 'spool'}",
                    f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={self.root / 'slurmd.pid'}",
                    f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "JobRequeue=1",
                    f"KillWait={kill_wait_s}",
                    "MinJobAge=600",
                    "SchedulerParameters=sched_interval=1",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
                    f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
                ]
            )
            + "\n"
        )
        for daemon in (
            ["slurmctld", "-D", "-i", "-f", str(self.conf)],
            ["slurmd", "-D", "-N", self.node, "-f", str(self.conf)],
        ):
            log = open(self.root / "log" / f"{daemon[0]}.out", "w")  # noqa: SIM115 - the daemon holds it
            p = subprocess.Popen(daemon, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.pids.append(p.pid)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = self.scontrol("show", "node", self.node, check=False)
            if "State=IDLE" in out:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the test SLURM did not come up in 30 s: {out.strip()[:300]}; logs in {self.root / 'log'}")

    def _auth(self) -> list[str]:
        if _plugin("auth_none") and _plugin("cred_none"):
            return ["AuthType=auth/none", "CredType=cred/none"]
        socket_path, key = self.root / "munge.socket", self.root / "munge.key"  # a private munged
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        p = subprocess.Popen(
            [
                "munged",
                "--force",
                "-F",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--pid-file={self.root / 'munged.pid'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--seed-file={self.root / 'munge.seed'}",
            ],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.pids.append(p.pid)
        return ["AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={socket_path}"]

    def stop(self) -> None:
        """Cancel every job, kill what the jobs left (tasks, slurmstepd: they carry this cluster's
        SLURM_CONF), then stop the daemons by their pids, so nothing outlives a test."""
        if self.pids and self.conf.exists():
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=30)
            deadline = time.monotonic() + 5
            while self._processes(jobs_only=True) and time.monotonic() < deadline:
                time.sleep(0.2)
        self._kill(self._processes())
        for pid in reversed(self.pids):
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + 10
        for pid in self.pids:
            while time.monotonic() < deadline:
                try:
                    if os.waitpid(pid, os.WNOHANG) != (0, 0):
                        break
                except ChildProcessError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.pids = []
        self._kill(self._processes())

    @staticmethod
    def _kill(pids) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _processes(self, jobs_only: bool = False) -> list[int]:
        """Processes of this cluster other than its daemons: slurmstepd and the jobs' processes (their
        environment holds its SLURM_CONF; `jobs_only`: those with a SLURM_JOB_ID)."""
        return [
            pid
            for pid, env, _ in self._environs()
            if pid not in self.pids and (not jobs_only or any(v.startswith(b"SLURM_JOB_ID=") for v in env))
        ]

    def task_pid(self, job_id: int, rank: int) -> int:
        """The pid of task `rank` of the job's first step (`srun`'s meshpar process)."""
        want = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={rank}".encode(), b"SLURM_STEP_ID=0"}
        for pid, env, cmd in self._environs():
            if want <= set(env) and b"meshpar.cli\0train" in cmd:
                return pid
        raise AssertionError(f"no task {rank} of job {job_id} found")

    def _environs(self):
        """(pid, environment entries, command line) of every process carrying this cluster's SLURM_CONF."""
        mark = f"SLURM_CONF={self.conf}".encode()
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
                cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if mark in env:
                yield int(name), env, cmd

    # -- jobs --------------------------------------------------------------------------------------
    def scontrol(self, *args: str, check: bool = True) -> str:
        r = subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=30)
        if check and r.returncode:
            raise RuntimeError(f"scontrol {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout + r.stderr

    def sbatch(self, args: list[str], cwd: Path, env: dict | None = None) -> int:
        """Submit; the job id. `env` adds to the cluster's environment (SLURM_CONF)."""
        r = subprocess.run(
            ["sbatch", "--parsable", *args],
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if r.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)}: {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, Reason, ...)."""
        out = self.scontrol("show", "job", "--oneliner", str(job_id))
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait(self, job_id: int, until, timeout: float, poll_s: float = 0.5) -> dict[str, str]:
        """Poll until the job's state is one of `until`; its `scontrol` fields. Fails on a timeout."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in until:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} still {info.get('JobState')} ({info.get('Reason')}) after {timeout} s"
                )
            time.sleep(poll_s)
