"""What one connection to `meshpar serve` may hold, below its HTTP requests: uvicorn's h11 protocol
with deadlines and a bound (as nginx's client_header_timeout and limit_conn, or Apache's
mod_reqtimeout, against clients that open connections and trickle bytes into them):

- a request's headers must arrive within `serve.header_timeout_s` of the connection's start, or of
  the end of its last answer: a connection that sends nothing is closed then, one whose headers are
  still coming is answered 408 and closed (the deadline is for the whole headers, so trickling a
  byte at a time does not renew it);
- one client address holds at most `serve.max_connections_per_client` connections (0: no bound);
  the next is answered 429 and closed.

A request's body has its own deadline (`serve.body_timeout_s`, from its headers), which the guard
(`meshpar.serve.guard`) keeps, answering in OpenAI's shape; so does a draining server's deadline.
"""

from __future__ import annotations

import collections
import json

from meshpar.serve.guard import APIError

REASONS = {408: "Request Timeout", 429: "Too Many Requests"}


def refusal(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 answer in OpenAI's error shape that closes the connection."""
    body = json.dumps(APIError(status, message, code=code).body()).encode()
    head = (
        f"HTTP/1.1 {status} {REASONS[status]}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        + ("retry-after: 1\r\n" if status == 429 else "")
        + "connection: close\r\n\r\n"
    )
    return head.encode() + body


def policed(header_timeout_s: float, max_per_client: int):
    """uvicorn's H11Protocol with the module docstring's deadline and bound: a class per server (the
    connections it counts per client address are its own)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol  # local: uvicorn loads only for a server

    held: collections.Counter = collections.Counter()

    class Policed(H11Protocol):
        timer = None
        counted = False
        began = False  # bytes came since the last answer: a request is on its way

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.address = self.client[0] if self.client else None
            held[self.address] += 1
            self.counted = True
            if max_per_client and held[self.address] > max_per_client:
                self._close(
                    429,
                    f"this client already holds {max_per_client} connections to the server "
                    "(serve.max_connections_per_client); reuse one, or close some",
                    "too_many_connections",
                )
                return
            self._arm()

        def connection_lost(self, exc) -> None:
            if self.counted:
                self.counted = False
                held[self.address] -= 1
                if held[self.address] <= 0:
                    del held[self.address]
            if self.timer is not None:
                self.timer.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            self.began = True
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.began = False
            if not self.transport.is_closing():
                self._arm()

        def _arm(self) -> None:
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_later(header_timeout_s, self._expired)

        def _expired(self) -> None:
            self.timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return  # a request is under way: its body and its answer have deadlines of their own
            if self.began:
                self._close(
                    408,
                    f"the request's headers did not arrive within serve.header_timeout_s={header_timeout_s:g} seconds",
                    "request_timeout",
                )
            else:
                self.transport.close()

        def _close(self, status: int, message: str, code: str) -> None:
            self.transport.write(refusal(status, message, code))
            self.transport.close()

    return Policed
