"""Serving a model that spans several processes (`jax.distributed`; `meshpar launch N serve ...`, or
a scheduler's job): process 0 runs the HTTP API; every process runs the same scheduler
(`meshpar.serve.scheduler`) over the same global mesh.

Compiled calls on a mesh that spans processes must be made by every process, in the same order,
with the same host inputs. The schedulers make the same calls if they see the same requests at the
same ticks: so at the start of every tick process 0 broadcasts its intake (the requests submitted and
cancelled since the last tick, and whether to stop) and the others apply it. Everything else a
scheduler decides from is the same everywhere: the tokens a step returns are replicated arrays, and
the prefix cache's keys are the prompts' tokens. An idle process 0 ticks empty every second, so the
others are never left waiting in a collective for long; on SIGTERM it drains its requests and then
tells the others to stop.

One tick's intake is JSON: {"new": [{"id", "tokens", "max_new_tokens", "sampling": [temperature,
top_k, top_p, seed], "eos"}], "cancel": [ids], "stop": bool}, sent as its byte length, then the bytes
padded to a power of two (two broadcasts; one compilation per padded size).
"""

from __future__ import annotations

import json

import numpy as np

from meshpar.serve.failures import PeerLost
from meshpar.serve.requests import Completion, Request, Sampling
from meshpar.serve.scheduler import Ticket


def broadcast_json(obj, leader: bool):
    """`obj` of process 0 (None elsewhere) -> the same object on every process."""
    from jax.experimental import multihost_utils

    data = json.dumps(obj).encode() if leader else b""
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    buf = np.zeros(1 << max(6, (n - 1).bit_length()), np.uint8)
    buf[: len(data)] = np.frombuffer(data, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return json.loads(out[:n].tobytes())


def encode(ticket) -> dict:
    """A ticket's request as JSON: everything that decides which compiled calls a tick makes and what
    they are fed (sampling, bias, penalties, logprobs, `n` siblings), so every process makes the same."""
    r, s = ticket.request, ticket.request.sampling
    return {
        "id": ticket.id,
        "tokens": [int(t) for t in r.tokens],
        "max_new_tokens": r.max_new_tokens,
        "sampling": [s.temperature, s.top_k, s.top_p, s.seed, s.presence, s.frequency, [list(b) for b in s.bias]],
        "eos": r.eos,
        "logprobs": r.logprobs,
        "share": r.share,
    }


def decode(d: dict):

    t, k, p, seed, presence, frequency, bias = d["sampling"]
    sampling = Sampling(t, k, p, seed, presence, frequency, tuple((int(i), float(v)) for i, v in bias))
    request = Request(d["tokens"], d["max_new_tokens"], sampling, d["eos"], d["logprobs"], d["share"])
    return Ticket(request, Completion(list(request.tokens)), id=d["id"])


class Replicas:
    """Each tick's intake, from process 0 to every process (see the module docstring)."""

    def __init__(self):
        import jax

        self.leader = jax.process_index() == 0

    def share(self, new: list, cancels: set, stop: bool) -> tuple[list, set, bool]:
        """Process 0's (new tickets, cancelled ids, stop) -> the same on every process (tickets rebuilt
        from their requests elsewhere, without callbacks); `PeerLost` if it cannot be shared (a
        broadcast of a few bytes fails only when a process is gone)."""
        try:
            msg = broadcast_json(
                {"new": [encode(t) for t in new], "cancel": sorted(cancels), "stop": stop} if self.leader else None,
                self.leader,
            )
        except Exception as e:  # noqa: BLE001 - gloo's, NCCL's or the runtime's error, whatever its type
            raise PeerLost(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        if self.leader:
            return new, cancels, stop
        return [decode(d) for d in msg["new"]], set(msg["cancel"]), bool(msg["stop"])
