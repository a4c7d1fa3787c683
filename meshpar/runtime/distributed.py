"""Multi-process runs: `jax.distributed` set-up, peer-failure watchdog, preemption signals.

    settings = resolve(coordinator, num_processes, process_id)   # flags > env > cluster detection
    initialize(settings, local_devices=4)                        # before anything touches a JAX backend

Where the three numbers come from, first match wins:

1. flags `--coordinator HOST:PORT --num-processes N --process-id I`;
2. environment `MESHPAR_COORDINATOR`, `MESHPAR_NUM_PROCESSES`, `MESHPAR_PROCESS_ID`
   (or JAX's own `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`);
3. a detected cluster, resolved by JAX: a SLURM job step (`srun`, SLURM_NTASKS > 1), Open MPI
   (`mpirun`, OMPI_COMM_WORLD_SIZE > 1), a Cloud TPU VM pod slice (`MESHPAR_DISTRIBUTED=auto`,
   set by launch/tpu_pod.sh, or more than one TPU_WORKER_HOSTNAMES entry);
4. otherwise a single process (no `jax.distributed` at all).

On CPU every process fakes `devices / num_processes` devices and collectives go over gloo (TCP), so
`launch/local.sh 2` is a real two-process run on one machine. Each process builds only the rows of
the batch its devices hold (meshpar.train.batches.Batches) and only process 0 writes logs and metrics.

Failure of a peer (`meshpar.runtime.peers`): a watchdog names a process silent for
`MESHPAR_PEER_TIMEOUT` seconds (default 10), and every surviving process exits with status 3 in one
line; JAX's heartbeat timeout (`MESHPAR_HEARTBEAT_TIMEOUT`, default 30 s) is the backstop. The next
launch resumes from the last complete checkpoint.

Preemption: SIGTERM / SIGINT ask the loop to save a checkpoint and stop (`PreemptionGuard`). With
several processes the stop step must be the same everywhere; JAX's preemption sync manager (which
owns SIGTERM once `jax.distributed` is up) agrees on it, and SIGINT is forwarded to it as SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from dataclasses import dataclass

from meshpar.core.errors import ConfigError, MeshparError
from meshpar.core.mesh import fake_cpu_devices
from meshpar.runtime import peers


@dataclass(frozen=True)
class Settings:
    coordinator: str | None  # HOST:PORT of process 0's coordination service (None: JAX detects it)
    num_processes: int | None
    process_id: int | None
    method: str  # explicit | slurm | ompi | tpu
    heartbeat_timeout: int = 30
    peer_timeout: float = 10.0

    def describe(self) -> str:
        return (
            f"process {self.process_id if self.process_id is not None else '?'} of "
            f"{self.num_processes or '?'} ({self.method}, coordinator {self.coordinator or 'auto'})"
        )


def _env_int(env, *names) -> int | None:
    for n in names:
        v = env.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                raise ConfigError(f"environment variable {n}={v!r} must be an integer") from None
    return None


def resolve(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None, environ=None
) -> Settings | None:
    """Multi-process settings from flags, environment or cluster detection; None for one process."""
    env = os.environ if environ is None else environ
    coordinator = coordinator or env.get("MESHPAR_COORDINATOR") or env.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None:
        num_processes = _env_int(env, "MESHPAR_NUM_PROCESSES", "JAX_NUM_PROCESSES")
    if process_id is None:
        process_id = _env_int(env, "MESHPAR_PROCESS_ID", "JAX_PROCESS_ID")
    timeouts = dict(
        heartbeat_timeout=_env_int(env, "MESHPAR_HEARTBEAT_TIMEOUT") or 30,
        peer_timeout=float(env.get("MESHPAR_PEER_TIMEOUT") or 10.0),
    )
    if num_processes == 1 and not coordinator:
        return None
    if num_processes is not None or process_id is not None or coordinator:
        missing = [
            n
            for n, v in [
                ("--coordinator / MESHPAR_COORDINATOR", coordinator),
                ("--num-processes / MESHPAR_NUM_PROCESSES", num_processes),
                ("--process-id / MESHPAR_PROCESS_ID", process_id),
            ]
            if v is None
        ]
        if missing and not _detected(env):
            raise ConfigError(f"multi-process launch needs {', '.join(missing)} as well (or run under srun/mpirun)")
        if num_processes is not None and num_processes < 1:
            raise ConfigError(f"--num-processes must be >= 1, got {num_processes}")
        if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
            raise ConfigError(f"--process-id must be in [0, {num_processes}), got {process_id}")
        return Settings(coordinator, num_processes, process_id, _detected(env) or "explicit", **timeouts)
    method = _detected(env)
    if method is None:
        return None
    n = {"slurm": _env_int(env, "SLURM_NTASKS"), "ompi": _env_int(env, "OMPI_COMM_WORLD_SIZE")}.get(method)
    pid = {"slurm": _env_int(env, "SLURM_PROCID"), "ompi": _env_int(env, "OMPI_COMM_WORLD_RANK")}.get(method)
    return Settings(None, n, pid, method, **timeouts)


def _detected(env) -> str | None:
    """The cluster we run in, from environment variables only (no network probes)."""
    if env.get("SLURM_STEP_NODELIST") and (_env_int(env, "SLURM_NTASKS") or 1) > 1:
        return "slurm"  # inside `srun` (a bare salloc shell has no job step)
    if (_env_int(env, "OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "ompi"
    if env.get("MESHPAR_DISTRIBUTED") == "auto" or len((env.get("TPU_WORKER_HOSTNAMES") or "").split(",")) > 1:
        return "tpu"
    return None


def scheduler_job(environ=None) -> dict | None:
    """The batch job this process runs in (SLURM: job id, restart count after a requeue, step), for
    the start record; None outside a scheduler."""
    env = os.environ if environ is None else environ
    if not env.get("SLURM_JOB_ID"):
        return None
    return {
        "name": "slurm",
        "job_id": env["SLURM_JOB_ID"],
        "restart_count": _env_int(env, "SLURM_RESTART_COUNT") or 0,
        "step_id": env.get("SLURM_STEP_ID"),
        "nodes": env.get("SLURM_JOB_NODELIST"),
    }


def initialize(settings: Settings, local_devices: int | None = None) -> None:
    """Start `jax.distributed` (must run before any JAX backend is used) and the peer watchdog.

    `local_devices`: CPU devices to fake in this process (ignored on GPU/TPU hosts)."""
    import jax

    if local_devices is not None:
        fake_cpu_devices(local_devices)
    if os.environ.get("JAX_PLATFORMS", "cpu") in ("cpu", ""):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = dict(heartbeat_timeout_seconds=settings.heartbeat_timeout)
    if settings.method in ("slurm", "ompi") and settings.coordinator is None:
        kwargs["cluster_detection_method"] = settings.method
    try:
        jax.distributed.initialize(settings.coordinator, settings.num_processes, settings.process_id, **kwargs)
    except (RuntimeError, ValueError) as e:
        raise MeshparError(
            f"could not join the job as {settings.describe()}: {str(e).splitlines()[0]}; check that "
            "every process got the same coordinator address and process count"
        ) from None
    peers.watch(settings.peer_timeout, settings.coordinator)


def is_main() -> bool:
    import jax

    return jax.process_index() == 0


# ----------------------------------------------------------------------------------------------
# Preemption.

on_interrupt: list = []  # run before an exit on Ctrl-C outside the loop (the metrics logger's close)


@contextlib.contextmanager
def interrupts_exit():
    """While inside: SIGINT (Ctrl-C) ends the program at once, status 130, after `on_interrupt`'s
    callbacks (the progress bar stopped, metrics files closed). Not by raising KeyboardInterrupt:
    raised inside a garbage-collector callback (JAX's `_xla_gc_callback` runs at every collection)
    it is printed and dropped, and the run goes on; raised while XLA compiles on its own threads,
    interpreter finalization under them segfaults (exit 139). Outside the training loop nothing is
    being written that an exit could leave half-done; inside it, `PreemptionGuard` takes over."""

    def handler(signum, frame):
        for fn in reversed(on_interrupt):
            try:
                fn()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        sys.stdout.flush()
        sys.stderr.write("meshpar: interrupted\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


class PreemptionGuard:
    """`with PreemptionGuard() as guard: ... if guard.reached(step): save and stop`.

    One process: SIGTERM / SIGINT set a flag that `reached` returns at the next step (a second
    SIGINT interrupts at once). Several processes: `reached` is JAX's preemption sync point, True
    on every process at the same step after any of them got SIGTERM; SIGINT is re-sent as SIGTERM
    to feed the same protocol. Handlers are restored on exit."""

    def __init__(self):
        self.signal: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self):
        import jax

        self.multi = jax.process_count() > 1
        if threading.current_thread() is not threading.main_thread():
            return self
        sigs = (signal.SIGINT,) if self.multi else (signal.SIGTERM, signal.SIGINT)
        for s in sigs:
            self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        return False

    def _handle(self, signum, frame):
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum
        if self.multi:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's C++ notifier owns SIGTERM here

    def reached(self, step: int) -> int | None:
        """The signal number if the run should save and stop after `step`, else None."""
        if self.multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                return self.signal or signal.SIGTERM
            return None
        return self.signal


class Preempted(MeshparError):
    """The run saved (if it has a checkpoint.dir) and stopped on a signal; exit status 128 + signal."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
