"""How `meshpar serve` stops: SIGTERM (and Ctrl-C) drain the server, within `serve.drain_timeout_s`.

    SIGTERM / Ctrl-C    uvicorn takes no new connection, closes the idle ones, waits for the others
    + drain_timeout_s   every request not yet finished is cut: 503 (a stream: that error, then [DONE]);
                        a body still arriving: 503 (`meshpar.serve.guard`)
    + 2 s               uvicorn ends whatever still holds a connection (its timeout_graceful_shutdown)

The scheduler then finishes the ticks it took and (other processes) says stop; the process exits 0
after SIGTERM, 130 after Ctrl-C (`meshpar.serve.api.serve_http`).
"""

from __future__ import annotations

import signal
import threading
import time


class Drain:
    """SIGTERM's (and Ctrl-C's) deadline (`serve.drain_timeout_s`): uvicorn stops taking connections
    and waits for the requests in flight; once `timeout_s` has passed since the signal, every request
    not yet finished is cut (`Scheduler.cut`): a response not yet begun is a 503 in OpenAI's shape, a
    stream ends with that error and `[DONE]`, so no client is left with a reset connection; a body
    still arriving is answered 503 by the `guard`. A second Ctrl-C cuts at once. `cut`: how many;
    `signal`: the one that began the drain."""

    def __init__(self, scheduler, timeout_s: float | None, guard=None):
        self.scheduler, self.timeout_s, self.guard = scheduler, timeout_s, guard
        self.cut, self.timer, self.signal = 0, None, None

    def server(self, config):
        import uvicorn  # local: uvicorn loads only for a server

        drain = self

        class Draining(uvicorn.Server):
            def handle_exit(self, sig, frame):
                drain.start(sig)
                super().handle_exit(sig, frame)

        return Draining(config)

    def start(self, sig=None) -> None:
        """A signal came (uvicorn's handler): the first begins the drain, a second Ctrl-C cuts at once."""
        if self.signal is not None:
            if sig == signal.SIGINT:
                if self.guard is not None:
                    self.guard.drain(time.monotonic(), self._why("interrupted twice"))
                self._cut("interrupted twice")
            return
        self.signal = sig
        if self.timeout_s is not None:
            when = f"serve.drain_timeout_s={self.timeout_s:g} passed"
            if self.guard is not None:
                self.guard.drain(time.monotonic() + self.timeout_s, self._why(when))
            self.timer = threading.Timer(self.timeout_s, self._cut, args=(when,))
            self.timer.daemon = True
            self.timer.start()

    @staticmethod
    def _why(when: str) -> str:
        return f"the server is shutting down: {when} before this request finished; send it again (to another replica)"

    def _cut(self, when: str) -> None:
        self.cut += self.scheduler.cut(self._why(when))

    def done(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
