"""A lost peer of a multi-process run (`jax.distributed`, `meshpar.runtime.distributed`): noticed, said
in one line, and the process ended with status 3 (`EXIT_PEER_LOST`), whichever process died.

Every process bumps a counter in the coordination service's key-value store once a second; a
watchdog thread in process 0 checks them all. A peer silent for `MESHPAR_PEER_TIMEOUT` seconds
(default 10) is published by number, and every surviving process prints it and exits with status 3
(no hang: the main thread may be blocked inside a collective), after `on_peer_lost`'s callbacks (a
server answers its open requests first). If the lost process is 0, the coordination service goes
with it and JAX itself aborts the others at once (SIGABRT, a C++ report and stack);
`coordinator_loss_exits` turns that into the same one line and status 3 (a multi-process server's
other processes).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time

EXIT_PEER_LOST = 3


progress = {"step": 0}  # the loop's last finished step, for the watchdog's message
on_peer_lost: list = []  # callables (what was lost) run before a lost peer's exit: a server answers its requests
stopping = ""  # what this process does on a lost peer, said in its line ("" : a training run's words)
_watchdog = None
_coordinator: str | None = None  # HOST:PORT of process 0's coordination service, once `watch` began
_reporting = threading.Lock()  # one report of a lost peer per process, from whichever thread comes first
DONE = "done"  # a process's last heartbeat value, once its run has ended


def watch(timeout: float, coordinator: str | None) -> None:
    """After `jax.distributed.initialize`: remember the coordinator's address (`coordinator`, else the
    one JAX resolved) and, with several processes, start the watchdog (`timeout`: seconds of silence)."""
    import jax

    global _coordinator, _watchdog
    try:
        from jax._src import distributed as jax_distributed  # the address JAX resolved (no public handle)

        resolved = jax_distributed.global_state.coordinator_address
    except (ImportError, AttributeError):
        resolved = None
    _coordinator = coordinator or resolved
    if jax.process_count() > 1:
        try:
            _watchdog = _Watchdog(timeout)
        except Exception:  # noqa: BLE001 - JAX internals moved: its heartbeat timeout remains the backstop
            _watchdog = None
        else:
            _watchdog.start()
            atexit.register(_watchdog.stop)  # after JAX's own exit hook was registered: runs before it


class _Watchdog(threading.Thread):
    """Peer liveness through the coordination service's key-value store, O(processes) requests a
    second in all: every process bumps `meshpar/alive/<id>`; process 0 reads them all in one request
    and, when one stops moving for `timeout` seconds, publishes `meshpar/lost` naming it and exits;
    the others read that one key and exit with the same message. Runs beside the main thread, which
    may be blocked inside a collective with the dead peer."""

    def __init__(self, timeout: float, period: float = 1.0):
        super().__init__(name="meshpar-peer-watchdog", daemon=True)
        import jax
        from jax._src import distributed  # the client JAX already connected (no public handle)

        self.client = distributed.global_state.client
        if self.client is None:
            raise RuntimeError("jax.distributed has no client")
        self.me, self.n = jax.process_index(), jax.process_count()
        self.timeout, self.period = timeout, period
        self.done = threading.Event()

    def run(self) -> None:
        beat, seen, start = 0, {}, time.monotonic()
        while not self.done.is_set():
            beat += 1
            try:
                self.client.key_value_set(f"meshpar/alive/{self.me}", str(beat), allow_overwrite=True)
                if self.me == 0:
                    self._watch_peers(seen, start)
                else:
                    self._read_verdict()
            except Exception as e:  # noqa: BLE001 - the coordination service (in process 0) is gone
                if self.me != 0 and not self.done.is_set():
                    _peer_lost(f"process 0 (the coordinator) is unreachable: {str(e).splitlines()[0][:160]}", self.me)
            self.done.wait(self.period)

    def stop(self) -> None:
        """At exit (`atexit`, before JAX's own shutdown of the client): end the loop, wait for it to leave
        the coordination client, and mark this process finished (`done`), which process 0 does not count
        as a lost peer. A daemon thread still inside a C++ call of that client when the interpreter
        finalizes is unwound by force there and the process aborts (SIGABRT, "terminate called after
        throwing an instance of ''", "FATAL: exception not rethrown"), as a resumed 2-process run's
        process 1 once did."""
        self.done.set()
        self.join(timeout=2 * self.period + 5)
        try:
            self.client.key_value_set(f"meshpar/alive/{self.me}", DONE, allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the coordination service is already gone: nothing to tell
            pass

    def _watch_peers(self, seen: dict, start: float) -> None:
        now = time.monotonic()
        beats = dict(self.client.key_value_dir_get("meshpar/alive/"))
        for peer in range(1, self.n):
            value = beats.get(f"meshpar/alive/{peer}")
            if value == DONE:  # finished its run and exiting: its beat stopped on purpose
                continue
            if peer not in seen or value != seen[peer][0]:
                seen[peer] = (value, now)
            elif now - max(seen[peer][1], start) > self.timeout:
                what = f"process {peer} stopped responding (no heartbeat for {now - seen[peer][1]:.0f} s)"
                self.client.key_value_set("meshpar/lost", what, allow_overwrite=True)
                time.sleep(2 * self.period)  # let the others read it before the service goes down
                _peer_lost(what, self.me)

    def _read_verdict(self) -> None:
        try:
            what = self.client.key_value_try_get("meshpar/lost")
        except Exception as e:  # noqa: BLE001
            if "NOT_FOUND" in str(e):
                return
            raise
        _peer_lost(what, self.me)


def await_peer_verdict(error: BaseException) -> None:
    """After a failed collective: give the watchdog time to name a lost peer (it exits the process);
    return if every peer is still alive, so the caller re-raises `error`."""
    if _watchdog is None:
        return
    deadline = time.monotonic() + _watchdog.timeout + 3 * _watchdog.period
    while time.monotonic() < deadline:
        time.sleep(0.2)


def exit_lost(why: str) -> None:
    """After a collective with the others failed: the watchdog names the lost process and exits
    (`await_peer_verdict`); if it has nothing to say within its timeout, exit 3 saying `why`."""
    await_peer_verdict(None)
    peer_lost(why)


def peer_lost(what: str) -> None:
    """Report a lost peer (`what`) in one line and exit with status 3 (`_peer_lost`)."""
    import jax

    _peer_lost(what, jax.process_index())


def _peer_lost(what: str, me: int) -> None:
    """`on_peer_lost`'s callbacks, one line, exit 3. A second thread to come here waits for the first
    one's exit: two reports never share stderr, and a signal handler never returns into an abort."""
    _reporting.acquire()
    for fn in list(on_peer_lost):
        try:
            fn(what)
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    doing = stopping or (
        f"stops after step {progress['step']}. Relaunch the same command to resume from the last checkpoint"
    )
    sys.stderr.write(f"meshpar: error: lost a peer: {what}; process {me} {doing}\n")
    sys.stderr.flush()
    os._exit(EXIT_PEER_LOST)


_abort_handler = None  # the C function pointer `coordinator_loss_exits` installed (kept alive here)


@contextlib.contextmanager
def coordinator_loss_exits():
    """While inside (a process > 0): process 0's death ends this process as a lost peer ends it (one
    line, status 3), not with JAX's abort. JAX's coordination client aborts the process the moment
    the coordination service in process 0 goes away (LOG(FATAL) -> SIGABRT, after a C++ report and
    stack) and takes no callback that could stop it (jaxlib's missed_heartbeat_callback cannot be
    given a Python function: the call dies in std::bad_cast). So absl's C++ log lines are kept off
    stderr here, and a C-level SIGABRT handler (ctypes) asks whether the coordinator still answers:
    if not, it reports process 0 lost and exits 3; if it does, the abort had another cause, said in
    one line, and the process aborts as it would have. Elsewhere (no jaxlib log controls, no libc
    `signal`), nothing changes."""
    global _abort_handler
    import ctypes
    import socket

    try:
        from jax._src.lib import utils  # JAX's absl log controls (no public handle)

        libc = ctypes.CDLL(None)
        quiet, loud = (utils.absl_set_min_log_level, utils.absl_set_stderr_threshold), (1, 0)
    except (ImportError, AttributeError, OSError):
        yield
        return
    handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)

    def on_abort(signum):
        host, _, port = (_coordinator or ":").rpartition(":")
        for _ in range(5):  # over a second: a process killed a moment ago may not have closed its port yet
            try:
                socket.create_connection((host or "127.0.0.1", int(port or 0)), timeout=1.0).close()
            except (OSError, ValueError):
                _peer_lost(f"process 0 (the coordinator, {_coordinator}) is gone", _process_index())
            time.sleep(0.2)
        sys.stderr.write(
            f"meshpar: error: process {_process_index()} aborted inside JAX (SIGABRT) while its coordinator "
            "still answers; its C++ report is kept off stderr in processes > 0 of a server\n"
        )
        sys.stderr.flush()
        libc.signal(signal.SIGABRT, ctypes.cast(0, handler_type))  # SIG_DFL: abort as it would have
        os.abort()

    _abort_handler = handler_type(on_abort)
    libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, handler_type], ctypes.c_void_p
    libc.signal(signal.SIGABRT, _abort_handler)
    for fn in quiet:
        fn(4)  # above FATAL: absl writes nothing to stderr (its fatal report included)
    try:
        yield
    finally:
        for fn, level in zip(quiet, loud):
            fn(level)
        libc.signal(signal.SIGABRT, ctypes.cast(0, handler_type))


def _process_index() -> int:
    import jax

    return jax.process_index()
