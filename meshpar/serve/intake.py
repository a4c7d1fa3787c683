"""Request bodies read in processes of their own (`serve.parse_workers`, 1 by default): the JSON, the
fields (`meshpar.serve.fields`), the chat template and the tokenizer. Reading a body is Python work
that holds the interpreter's lock the whole time (`json.loads` of 4 MiB of small objects: about
0.1 s; a chat template over 2,048 messages as long): in the serving process it would stall the
scheduler's decode loop and the event loop that streams every client's tokens. In a worker, at the
lowest CPU priority (nice +19), a body costs the server its bytes only; decoding keeps its pace
whatever the clients send.

    intake = Intake(fields, workers=1, queue=264)
    parsed = await intake.parse(raw, chat, gone)   # (Request, options); APIError as Fields.parse raises it;
    intake.close()                                 # None: the client went away (`await gone()`)

A worker is `sys.executable -m meshpar.serve.intake` (the server's own interpreter), fed over its
stdin and answering over a private copy of its stdout, each message `[4-byte length][data]`: first
the pickled `Fields` (its limits and tokenizer), then per body one byte (1: chat) and the body as
it came; each answer is pickled ("ok", request, options) or ("error", APIError's arguments).
One thread per worker hands it the bodies, the smallest first (by powers of two of their size,
in order of arrival within one): reading a body costs about its size, so a request of a few hundred
bytes never waits behind megabytes of someone else's. A body whose client has gone before its turn
is skipped, one being read is let finish (the work is bounded) and its answer dropped. A worker that
dies is started again and its body answered 500. More than `queue` bodies waiting: 429, as a full
request queue. `workers=0` reads bodies on a thread of the serving process.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import queue as queue_lib
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass

from meshpar.serve.fields import Fields
from meshpar.serve.guard import APIError


def _write(pipe, *parts: bytes) -> None:
    pipe.write(struct.pack("<I", sum(map(len, parts))))
    for p in parts:
        pipe.write(p)
    pipe.flush()


def _read(pipe) -> bytes | None:
    head = pipe.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack("<I", head)
    data = pipe.read(n)
    return data if len(data) == n else None


def answer(fields: Fields, raw: bytes, chat: bool) -> tuple:
    """A body read by `fields` -> ("ok", request, options) or ("error", APIError's arguments)."""
    try:
        req, opt = fields.parse_raw(raw, chat)
    except APIError as e:
        return ("error", e.status, str(e), e.param, e.code, e.kind, e.headers)
    return ("ok", req, opt)


@dataclass(eq=False)
class _Job:
    raw: bytes
    chat: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    dropped: bool = False

    def settle(self, result: tuple) -> None:
        """From a worker's thread: the answer, to the waiting request (dropped if it has gone)."""

        def put():
            if not self.future.done():
                self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(put)
        except RuntimeError:  # the event loop has closed (the server is stopping)
            pass


class Intake:
    """The server's request parser (module docstring): `fields` read bodies in `workers` processes."""

    def __init__(self, fields: Fields, workers: int = 1, queue: int = 256):
        self.fields, self.workers, self.bound = fields, workers, queue
        self.jobs: queue_lib.PriorityQueue = queue_lib.PriorityQueue()  # (size class, arrival, job)
        self.arrivals = itertools.count()
        self.procs: list = []
        self.skipped = 0  # bodies not read: their clients had gone before their turn
        self.setup = pickle.dumps(fields) if workers else b""
        self.threads = [
            threading.Thread(target=self._serve, name=f"meshpar-intake-{i}", daemon=True) for i in range(workers)
        ]
        for t in self.threads:
            t.start()

    async def parse(self, raw: bytes, chat: bool, gone=None):
        """A body -> (Request, options), APIError, or None when `await gone()` said the client left."""
        if gone is not None and await gone():
            self.skipped += 1
            return None
        if not self.workers:
            return await asyncio.to_thread(self.fields.parse_raw, raw, chat)
        if self.jobs.qsize() >= self.bound:
            raise APIError(
                429,
                f"the server is busy ({self.jobs.qsize()} request bodies are waiting to be read); retry shortly",
                code="rate_limit_exceeded",
                kind="rate_limit_error",
                headers={"Retry-After": "1"},
            )
        loop = asyncio.get_running_loop()
        job = _Job(raw, chat, loop, loop.create_future())
        self.jobs.put((len(raw).bit_length(), next(self.arrivals), job))
        try:
            while not job.future.done():
                await asyncio.wait({job.future}, timeout=0.25)
                if not job.future.done() and gone is not None and await gone():
                    return None
        finally:
            job.dropped = not job.future.done()  # skipped if not begun; if begun, its answer is dropped
        kind, *rest = job.future.result()
        if kind == "ok":
            return rest[0], rest[1]
        status, message, param, code, error_kind, headers = rest
        raise APIError(status, message, param, code, error_kind, headers)

    def _start(self):
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshpar.serve.intake"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        _write(proc.stdin, self.setup)
        self.procs.append(proc)
        return proc

    def _serve(self) -> None:
        """One worker's thread: start it, hand it the bodies in order, set their answers."""
        proc = self._start()
        while True:
            *_, job = self.jobs.get()
            if job is None:
                break
            if job.dropped:
                self.skipped += 1
                continue
            try:
                proc = proc or self._start()
                _write(proc.stdin, b"\x01" if job.chat else b"\x00", job.raw)
                reply = _read(proc.stdout)
                if reply is None:
                    raise EOFError("the request parser ended")
                result = pickle.loads(reply)
            except (OSError, EOFError, pickle.UnpicklingError) as e:
                result = (
                    "error",
                    500,
                    f"reading the request failed ({e}); send it again",
                    None,
                    None,
                    "server_error",
                    None,
                )
                if proc is not None:
                    proc.kill()
                proc = None  # started again for the next body
            job.settle(result)

    def close(self) -> None:
        """Stop the threads and the workers (each ends when its stdin closes)."""
        for _ in self.threads:
            self.jobs.put((-1, next(self.arrivals), None))
        for p in self.procs:
            try:
                p.stdin.close()
            except OSError:
                pass


def main() -> None:
    """A worker (`python -m meshpar.serve.intake`): the pickled `Fields`, then bodies, until stdin closes."""
    out = os.fdopen(os.dup(1), "wb")  # answers go on a private copy of stdout; stdout itself becomes stderr
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    fields = pickle.loads(_read(inp) or b"")
    try:
        os.nice(19)  # the serving process's decode loop comes first
    except (OSError, AttributeError):
        pass
    try:
        while (frame := _read(inp)) is not None:
            _write(out, pickle.dumps(answer(fields, frame[1:], frame[:1] == b"\x01")))
    except BrokenPipeError:  # the server has gone (stopping, or killed): so does its parser
        pass


if __name__ == "__main__":
    main()
