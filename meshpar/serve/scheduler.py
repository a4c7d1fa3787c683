"""Continuous batching (Orca, Yu et al. 2022) over an `Engine`'s slots, one tick at a time, for a
request list (`run_all`, what `meshpar generate` and `Engine.run` use) or a server that keeps
taking requests from other threads (`Scheduler.serve`, `meshpar serve`):

    tick:  take what came since the last tick: new requests into the queue, cancellations
           drop cancelled requests (their slots free)
           admit waiting requests into free slots: a cached prefix (`meshpar.serve.prefix`) -> extend
           its tail alone; the rest prefilled together, up to serve.prefill_batch per call and one
           call per length bucket; each first token emitted
           generate one token for every busy slot (with a pipeline in flight, none for a slot whose
           token is still in the pipe: `meshpar.serve.in_flight`); emit each; a finished request
           frees its slot

A request finishes at its end token (`eos`), its token budget (`max_tokens`), a full cache
(`cache_full`), when cancelled (`cancelled`: a client that went away, or a stop string its
reader saw) or when cut (`shutdown`: a draining server's deadline passed, `Scheduler.cut`).
Requests beyond `max_waiting` queued are refused with `QueueFull` (HTTP 429).
A tick that raises fails the requests it held, and on several processes a tick whose intake
cannot be shared loses the server (`meshpar.serve.failures`).
Callbacks run on the scheduler's thread, in token order. Submissions and cancellations take
effect only at the start of a tick, so that on several processes (`meshpar.serve.multihost`) process
0 can hand every tick's intake to the others, whose schedulers then make the same calls.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from meshpar.runtime import peers
from meshpar.serve.failures import Failures, Unavailable
from meshpar.serve.prefill import Prefills, logprobs_of
from meshpar.serve.prefix import PrefixCache
from meshpar.serve.requests import Completion, Request


class QueueFull(Exception):
    """More requests than slots + `max_waiting`: try again later."""


@dataclass(eq=False)
class Ticket:
    """A submitted request: its completion so far and where its tokens go."""

    request: Request
    completion: Completion
    on_token: Callable[[int], None] | None = None
    on_done: Callable[[Completion], None] | None = None
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    id: int = 0
    cut: str | None = None  # why it was cut short (`Scheduler.cut`), None if it was not


class TickLoop(Prefills):
    """The tick of the module docstring, on one thread: queue, slots, admission (`Prefills`), emission.
    `prefill_batch`: prompts per prefill call; `prefix`: a PrefixCache or None; `max_waiting`: queue
    bound (None: unbounded); `replicas`: a `meshpar.serve.multihost.Replicas` that shares each tick's
    intake between processes; `prefill_chunk`: prompt tokens prefilled per tick at most (None: all)."""

    def __init__(
        self,
        engine,
        *,
        prefill_batch: int = 1,
        prefix: PrefixCache | None = None,
        max_waiting: int | None = None,
        replicas=None,
        prefill_chunk: int | None = None,
    ):
        self.engine, self.prefill_batch, self.prefix, self.max_waiting = engine, prefill_batch, prefix, max_waiting
        self.replicas, self.prefill_chunk = replicas, prefill_chunk
        self.partial: dict[int, list] = {}  # slot -> a prompt in prefill (`Prefills`)
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.active: dict[int, Ticket] = {}
        self.free = list(range(engine.slots))
        self.inbox: list[Ticket] = []  # submitted since the last tick
        self.cancels: set[int] = set()  # ids cancelled since the last tick
        self.tickets: dict[int, Ticket] = {}  # id -> not yet finished
        self.halted = False
        self.queued = 0  # in the inbox or waiting (the queue bound counts these)
        self.errors = 0  # ticks that failed (their requests finished with an error)
        self._ids = itertools.count()
        self.state = None
        self.cv = threading.Condition()
        self.decode_steps, self.decode_s, self.prefill_calls = 0, 0.0, 0

    def busy(self) -> bool:
        return bool(self.waiting or self.active or self.inbox or self.partial)

    def _intake(self, halt: bool) -> bool:
        """What came since the last tick (shared by process 0 with the others) -> whether to halt."""
        with self.cv:
            new, self.inbox = self.inbox, []
            cancels, self.cancels = self.cancels, set()
            self.tickets.update((t.id, t) for t in new)  # before the share: if it fails, they are answered
        if self.replicas is not None:
            new, cancels, halt = self.replicas.share(new, cancels, halt)  # PeerLost: a process is gone
        for t in new:
            self.tickets[t.id] = t
            self.waiting.append(t)
        for i in cancels:
            if i in self.tickets:
                self.tickets[i].cancelled = True
        self.halted = halt
        return halt

    def step(self, halt: bool = False) -> bool:
        """One tick (see the module docstring) -> whether work remains. `halt`: the last tick."""
        if self._intake(halt):
            return False
        with self.cv:
            dropped = [t for t in self.waiting if t.cancelled]
            for t in dropped:
                self.waiting.remove(t)
            admitted = [self.waiting.popleft() for _ in range(min(len(self.waiting), len(self.free)))]
            slots = [self.free.pop(0) for _ in admitted]
            self.queued -= len(dropped) + len(admitted)
        for t in dropped:
            self._finish(t, None, "cancelled")
        for slot, t in list(self.active.items()):
            if t.cancelled:
                self._finish(t, slot, "cancelled")
        for slot, (t, _, _) in list(self.partial.items()):
            if t.cancelled:  # a prompt cancelled while in prefill: its slot was never active
                del self.partial[slot]
                self.free.append(slot)
                self._finish(t, None, "cancelled")
        if not admitted and not self.active and not self.partial:
            return self.busy()
        if self.state is None:
            self.state = self.engine.new_state()
        if admitted:
            self._admit(admitted, slots)
        if self.partial:
            self._chunks()
        if self.active:
            t0 = time.perf_counter()
            self.state, toks, logits = self.engine.generate(self.state)
            toks = np.asarray(toks)
            self.decode_s += time.perf_counter() - t0
            self.decode_steps += 1
            lp = logprobs_of(self.engine, self.active.values(), logits, np.maximum(toks, 0))
            for slot, t in list(self.active.items()):
                if toks[slot] >= 0:  # -1: its token is still in a pipeline (meshpar.serve.in_flight)
                    self._emit(t, slot, int(toks[slot]), lp and [a[slot] for a in lp])
        with self.cv:
            return self.busy()

    def _emit(self, t: Ticket, slot: int, tok: int, lp=None) -> None:
        """Record a token (and, where asked, its log probabilities: `lp` (log p, ids, log ps));
        finish the request when it ends."""
        r, c = t.request, t.completion
        if r.logprobs is not None and lp is not None:
            c.logprobs.append(
                (float(lp[0]), [(int(i), float(v)) for i, v in zip(lp[1][: r.logprobs], lp[2][: r.logprobs])])
            )
        c.tokens.append(tok)
        if t.on_token:
            _call(t.on_token, tok)
        why = _ended(r, c, tok, self.engine.length)
        if why:
            self._finish(t, slot, why)

    def _finish(self, t: Ticket, slot: int | None, why: str) -> None:
        if why == "cancelled" and t.cut:
            why, t.completion.error = "shutdown", t.cut
        t.completion.finish = t.completion.finish or why
        self.tickets.pop(t.id, None)
        if slot is not None and self.active.get(slot) is t:
            del self.active[slot]
            self.free.append(slot)
        if t.on_done:
            _call(t.on_done, t.completion)


class Scheduler(TickLoop, Failures):
    """Requests -> an engine's slots (see the module docstring): `TickLoop` and its `Failures`, plus what
    other threads call (submit, cancel, cut) and the loops a server runs (`serve` on process 0,
    `follow` elsewhere)."""

    @classmethod
    def for_config(cls, engine, serve, bounded: bool = False, replicas=None) -> Scheduler:
        """From `cfg.serve`: prefill batch, prefix cache and (a server's) queue bound."""
        prefix = PrefixCache(serve.prefix_cache, serve.prefix_block) if serve.prefix_cache else None
        return cls(
            engine,
            prefill_batch=min(serve.prefill_batch, engine.slots),
            prefix=prefix,
            max_waiting=serve.max_waiting if bounded else None,
            replicas=replicas,
            prefill_chunk=serve.prefill_chunk,
        )

    def submit(self, request: Request, on_token=None, on_done=None) -> Ticket:
        """Queue a request (checked first: ConfigError names what is wrong) -> its ticket."""
        return self.submit_all([(request, on_token, on_done)])[0]

    def submit_all(self, items: list) -> list[Ticket]:
        """Queue [(request, on_token, on_done)] at once: the same tick takes all of them (OpenAI's `n`
        siblings then share one prefill), or none when the queue has no room for all."""
        for request, _, _ in items:
            self.engine.check(request)
        tickets = [Ticket(r, Completion(list(r.tokens)), on_token, on_done) for r, on_token, on_done in items]
        with self.cv:
            if self.lost:
                raise Unavailable(self.lost)
            if self.max_waiting is not None and self.queued + len(tickets) > self.max_waiting + len(self.free):
                raise QueueFull(f"{self.queued} requests are waiting for {self.engine.slots} slots")
            for ticket in tickets:
                ticket.id = next(self._ids)
                self.inbox.append(ticket)
            self.queued += len(tickets)
            self.cv.notify()
        return tickets

    def cancel(self, ticket: Ticket) -> None:
        """Stop a request at the next tick (its slot frees); a finished one is left as it is."""
        with self.cv:
            if not ticket.completion.finish:
                self.cancels.add(ticket.id)
                self.cv.notify()

    def cut(self, why: str) -> int:
        """End every request not yet finished at the next tick, each with finish `shutdown` and `why`
        as its error (a draining server whose `serve.drain_timeout_s` passed) -> how many."""
        with self.cv:
            taken = [t for t in (*self.inbox, *list(self.tickets.values())) if not t.completion.finish]
            for t in taken:
                t.cut = why
                self.cancels.add(t.id)
            self.cv.notify()
        return len(taken)

    def serve(self, stop: threading.Event, heartbeat_s: float = 1.0) -> None:
        """Tick while there is work, wait while there is none (with other processes: tick empty every
        `heartbeat_s`, so they hear from process 0); once `stop` is set and every request taken has
        finished, tick one last time telling the others to stop, and return."""
        wait = heartbeat_s if self.replicas is not None else 0.05
        while True:
            with self.cv:
                t0 = time.monotonic()
                while not self.busy() and not self.cancels and not stop.is_set() and time.monotonic() - t0 < wait:
                    self.cv.wait(min(0.05, wait))
                halt = stop.is_set() and not self.busy()
            self.safe_step(halt=halt)
            if self.lost:
                peers.exit_lost(self.lost)  # the watchdog's verdict, else this: exit 3
            if halt:
                return

    def follow(self) -> None:
        """A process > 0 of a multi-process server: tick on process 0's intake until it says stop."""
        while not self.halted:
            self.safe_step()
            if self.lost:
                peers.exit_lost(self.lost)


def _call(fn, *args) -> None:
    """A request's callback; one that raises (its reader gone, its event loop closed) never stops a tick."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        pass


def run_all(engine, requests: list[Request], on_token: Callable[[int, int], None] | None = None) -> list[Completion]:
    """Every request decoded to its end (`cfg.serve`'s prefill batch and prefix cache);
    `on_token(request index, token)` streams. Sets `engine.decode_steps` and `engine.decode_s`."""
    sched = Scheduler.for_config(engine, engine.serve)
    tickets = [
        sched.submit(r, (lambda tok, i=i: on_token(i, tok)) if on_token else None) for i, r in enumerate(requests)
    ]
    while sched.step():
        pass
    engine.decode_steps, engine.decode_s = sched.decode_steps, sched.decode_s
    return [t.completion for t in tickets]


def _ended(r: Request, c: Completion, tok: int, length: int) -> str | None:
    """Why a request ends with the token `tok` just emitted (`length`: the cache's), or None."""
    eos = r.eos if isinstance(r.eos, (list, tuple, set)) else () if r.eos is None else (r.eos,)
    if tok in eos:
        return "eos"
    if len(c.tokens) >= r.max_new_tokens:
        return "max_tokens"
    if len(r.tokens) + len(c.tokens) > length:  # no room to write the last token
        return "cache_full"
    return None
