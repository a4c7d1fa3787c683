"""How a server's ticks fail (the failure half of `meshpar.serve.scheduler.Scheduler`):

    a tick raises                 the requests it held finish with the error (HTTP 500), the slots and
                                  the decode state start afresh, serving goes on: a shape that cannot
                                  compile fails its requests, not the server
    on several processes, a       the server is lost: every request taken or queued finishes `lost`
    tick's intake cannot be       (HTTP 503), new ones are refused (`Unavailable`), and the process
    shared (`PeerLost`)           waits for the peer watchdog's verdict and exits 3 (`meshpar.runtime.peers`)

A tick that fails in a step is told apart from a lost process by taking one intake more at once:
every process whose tick failed alike does the same, in step, and with a process gone it fails
(its requests then get 503, not the step's error).
"""

from __future__ import annotations

import collections


class PeerLost(Exception):
    """A tick's intake could not be shared with the other processes of the server: one is gone."""


class Unavailable(Exception):
    """The server takes no more requests: a process of it was lost (HTTP 503)."""


class Failures:
    """The scheduler's failing ticks (module docstring): its queue, tickets and slots are `TickLoop`'s."""

    lost = ""  # why a process of the server was lost ("": none was; `lose`)

    def _end(self, taken: list, finish: str, error: str) -> None:
        """Finish the tickets `taken` that have not finished, with `finish` and `error`, out of the queue."""
        with self.cv:
            gone = {t.id for t in taken}
            before = len(self.waiting)
            self.waiting = collections.deque(t for t in self.waiting if t.id not in gone)
            self.queued -= before - len(self.waiting)
        for t in taken:
            if not t.completion.finish:
                t.completion.error = error
                self._finish(t, None, finish)

    def _fail(self, error: BaseException, taken: list | None = None) -> None:
        """A tick raised: every request it had taken (`taken`; default all: waiting, active, admitted
        but not placed) finishes with the error, the slots and the decode state start afresh, and
        serving goes on (a shape that cannot compile fails its requests, not the server)."""
        import traceback

        traceback.print_exception(error)
        self.errors += 1
        message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        self._end(list(self.tickets.values()) if taken is None else taken, "error", message)
        self.active.clear()
        self.partial.clear()
        self.free = list(range(self.engine.slots))
        self.state = None

    def safe_step(self, halt: bool = False) -> bool:
        """`step`, with a failing tick turned into failed requests (`_fail`), or on several processes,
        when the next tick's intake cannot be shared either, into a lost server (`lose`)."""
        try:
            return self.step(halt)
        except PeerLost as e:
            self.lose(f"a collective with the server's other processes failed ({e})")
            return False
        except Exception as e:  # noqa: BLE001 - reported to each request, and on stderr
            taken = list(self.tickets.values())
            if self.replicas is not None:
                try:  # an intake more, at once: every process whose tick failed alike takes it, in step
                    self._intake(False)
                except PeerLost:
                    self.lose(f"a step with the server's other processes failed ({str(e).splitlines()[0][:200]})")
                    return False
            self._fail(e, taken)
            return self.busy()

    def lose(self, why: str) -> None:
        """A process of the server is gone: every request not yet finished (queued, running, submitted)
        finishes `lost` with `why`, and `submit_all` refuses new ones (`Unavailable`). Any thread."""
        with self.cv:
            if self.lost:
                return
            self.lost = why
            taken = list({t.id: t for t in (*self.inbox, *self.tickets.values())}.values())
            self.inbox = []
        why = f"a process of this multi-process server was lost: {why}; the server is stopping, send the request again"
        self._end(taken, "lost", why)
