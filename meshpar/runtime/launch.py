"""`meshpar launch N [train arguments...]`: N training processes on this machine (loopback, gloo);
`meshpar launch N serve [serve arguments...]`: one server in N processes (meshpar/serve/multihost.py);
`meshpar launch --print-slurm ...`: the SLURM batch script for a cluster (`launch/slurm.sbatch` is
its default output).

A real multi-process run without a cluster. Every process is `sys.executable -m meshpar.cli train
...`, the interpreter that runs the launcher (never a `python` found on PATH, which on a fresh machine
may not have jax). Process 0 hosts the coordination service on a free port (MESHPAR_PORT to choose
one); `--devices D` (or the config's `devices`) counts all processes together, so with N=2 and 8
devices each process fakes 4 (see meshpar.cli._setup_devices).

Contract, the same as `launch/local.sh` (now a thin wrapper around this module):
- SIGTERM/SIGINT to the launcher go to every process (a preemption: they agree on a step, save a
  checkpoint if checkpoint.dir is set and exit 128 + signal);
- a process that dies is noticed by the others within MESHPAR_PEER_TIMEOUT seconds; they exit 3
  naming it (meshpar/runtime/distributed.py); one still running 10 s after that (waiting for the
  failed process to meet it) is killed;
- the launcher returns the first non-zero exit status (0 when all succeed).
Launch again with the same arguments to resume from checkpoint.dir.

Output: every line of every process reaches the launcher's stdout/stderr whole, one line at a
time (two processes never share a line); lines of process i > 0 are prefixed `[process i]` (only
process 0 logs the run; the others print errors); Gloo's connection reports (`[Gloo] Rank 0 is
connected to 1 peer ranks...`, about 40 lines) are dropped. The processes write into pipes, so
there is no progress bar: each logged step is a line.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from meshpar.runtime.slurm import main as slurm_main

PROG = "meshpar launch"
# Gloo's connection report, `[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected
# peer ranks is : 7`, printed piece by piece from several threads: pieces of two reports share lines
CHATTER = re.compile(
    rb"\[Gloo\] Rank \d*| ?is connected to \d*| peer ranks\. ?|Expected number of connected peer ranks is : \d*"
)
_write_lock = threading.Lock()


def _relay(pipe, out, prefix: bytes) -> None:
    """Copy a child's stream to `out` line by line (whole lines, prefixed), dropping Gloo chatter."""
    burst = False  # inside a run of report lines: a lone number is a piece of one
    for line in iter(pipe.readline, b""):
        kept = CHATTER.sub(b"", line)
        pieces = not kept.strip(b" \t\r\n0123456789")
        burst, drop = (kept != line) or (burst and pieces), pieces and ((kept != line) or burst)
        if drop:
            continue
        line = prefix + kept.rstrip(b"\n") + b"\n"
        with _write_lock:
            out.flush()
            if hasattr(out, "buffer"):
                out.buffer.write(line)
            else:  # a text-only stream (a test's capture)
                out.write(line.decode(errors="replace"))
            out.flush()
    pipe.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _why(rc: int) -> str:
    if rc < 0:  # Popen reports death by signal as -signum
        return f"signal {-rc} ({signal.Signals(-rc).name})"
    if rc > 128:
        return f"status {rc} (signal {rc - 128}: killed, or saved and stopped on it)"
    return f"exit status {rc}"


COMMANDS = ("train", "serve")  # what the processes run: `meshpar launch N serve ...`; default train


def launch(n: int, train_args: list[str], env: dict | None = None, poll_s: float = 0.2) -> int:
    """Start `n` processes of `meshpar train *train_args*` (or `serve`, when the arguments start with
    it), forward signals, wait; first non-zero status."""
    command, train_args = (
        (train_args[0], train_args[1:]) if train_args[:1] and train_args[0] in COMMANDS else ("train", train_args)
    )
    base = dict(os.environ if env is None else env)
    base.setdefault("JAX_PLATFORMS", "cpu")
    port = int(base.get("MESHPAR_PORT") or free_port())
    procs, relays = [], []
    for i in range(n):
        penv = {
            **base,
            "MESHPAR_COORDINATOR": f"127.0.0.1:{port}",
            "MESHPAR_NUM_PROCESSES": str(n),
            "MESHPAR_PROCESS_ID": str(i),
        }
        p = subprocess.Popen(
            [sys.executable, "-m", "meshpar.cli", command, *train_args],
            env=penv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        procs.append(p)
        prefix = b"" if i == 0 else f"[process {i}] ".encode()
        for pipe, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            relays.append(threading.Thread(target=_relay, args=(pipe, out, prefix), daemon=True))
            relays[-1].start()
    print(
        f"{PROG}: {n} processes on 127.0.0.1:{port}: pids {' '.join(str(p.pid) for p in procs)}",
        file=sys.stderr,
        flush=True,
    )

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    status, running, failed_at = 0, dict(enumerate(procs)), None
    # after a failure the others normally end by themselves (the peer watchdog: exit 3); one that cannot
    # (still waiting for the failed process to meet it, e.g. in jax.distributed.initialize) is killed
    grace = float(base.get("MESHPAR_PEER_TIMEOUT") or 10) + 10
    try:
        while running:
            for i, p in list(running.items()):
                rc = p.poll()
                if rc is None:
                    continue
                del running[i]
                if rc != 0:
                    print(f"{PROG}: process {i} (pid {p.pid}) ended with {_why(rc)}", file=sys.stderr, flush=True)
                    if status == 0:
                        status, failed_at = (rc if rc > 0 else 128 - rc), time.monotonic()
            if running and failed_at is not None and time.monotonic() - failed_at > grace:
                for i, p in running.items():
                    print(
                        f"{PROG}: process {i} (pid {p.pid}) still running {grace:.0f} s after a failure: killed",
                        file=sys.stderr,
                        flush=True,
                    )
                    p.kill()
                failed_at = None
            if running:
                time.sleep(poll_s)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for t in relays:  # the children's last lines (their error messages) come out whole
            t.join(timeout=5)
    return status


def relay(command: list[str]) -> int:
    """Run `command` with its stdout and stderr copied to ours whole lines at a time, without Gloo's
    connection reports; outlive SIGTERM/SIGINT (the command gets them from its scheduler too: the
    SLURM script's tasks save and stop) saying so in one line; return the command's status."""

    def note(signum, _frame):
        print(
            f"{PROG}: {signal.Signals(signum).name}: waiting for {command[0]} (its tasks save and stop)",
            file=sys.stderr,
            flush=True,
        )

    old = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}  # the child gets defaults
    try:
        p = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as e:
        print(f"meshpar: error: {PROG} --relay: cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
        return 127
    threads = [
        threading.Thread(target=_relay, args=(pipe, out, b""), daemon=True)
        for pipe, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))
    ]
    for t in threads:
        t.start()
    try:
        rc = p.wait()
    finally:
        for t in threads:
            t.join(timeout=10)
        for s, h in old.items():
            signal.signal(s, h)
    return rc if rc >= 0 else 128 - rc


USAGE = f"""usage: {PROG} N [meshpar train arguments...]
       {PROG} N serve [meshpar serve arguments...]     (process 0 serves HTTP)
       {PROG} --print-slurm [--nodes N] [--gpus-per-node G] [...] [train arguments...]   (--print-slurm --help)
       {PROG} --relay COMMAND...     (the SLURM script's output filter)"""


def main(argv: list[str]) -> int:
    """`argv` = [N, train arguments...]; the train arguments are passed through unread."""
    if argv[:1] == ["--print-slurm"]:
        return slurm_main(argv[1:])
    if argv[:1] == ["--relay"]:
        if len(argv) < 2:
            print(f"meshpar: error: {PROG} --relay needs a command to run", file=sys.stderr)
            return 2
        return relay(argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.split("\n\n", 1)[1].strip())
        return 0 if argv else 2
    if not argv[0].isdigit() or int(argv[0]) < 1:
        print(
            f"meshpar: error: {PROG}: N must be a positive number of processes, got {argv[0]!r} "
            f"(e.g. `{PROG} 2 steps=20`)",
            file=sys.stderr,
        )
        return 2
    return launch(int(argv[0]), argv[1:])
