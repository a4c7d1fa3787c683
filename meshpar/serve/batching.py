"""Requests, their completions, and continuous batching (Orca, Yu et al. 2022): a request enters a
free slot as soon as one frees (end of sequence, its token budget, or a full cache), while the other
slots keep decoding.

    for each tick: fill free slots (prefill + insert, first token)  ->  generate one token per slot
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from meshpar.serve.sampling import Sampling


@dataclass
class Request:
    """A prompt (token ids), its budget of new tokens, its sampling settings and end token."""
    tokens: list
    max_new_tokens: int = 32
    sampling: Sampling = field(default_factory=Sampling)
    eos: int | None = None


@dataclass
class Completion:
    prompt: list
    tokens: list = field(default_factory=list)
    finish: str = ""          # eos | max_tokens | cache_full
    ttft_s: float = 0.0       # from `run` start to this request's first token (queueing included)


def continuous_batching(engine, requests: list[Request],
                        on_token: Callable[[int, int], None] | None = None) -> list[Completion]:
    """Every request decoded to its end on `engine`'s slots (a `meshpar.serve.engine.Engine`: its
    `check`, `new_state`, `prefill`, `insert`, `generate`); `on_token(request index, token)` streams.
    Sets `engine.decode_steps` and `engine.decode_s` (generate calls and their seconds)."""
    for r in requests:
        engine.check(r)
    t0 = time.perf_counter()
    out = [Completion(list(r.tokens)) for r in requests]
    queue = collections.deque(range(len(requests)))
    free, active = list(range(engine.slots)), {}
    state = engine.new_state()
    engine.decode_steps, engine.decode_s = 0, 0.0

    def emit(i, tok) -> bool:
        """Record a token; True when request i is finished."""
        r, c = requests[i], out[i]
        c.tokens.append(tok)
        if on_token:
            on_token(i, tok)
        if r.eos is not None and tok == r.eos:
            c.finish = "eos"
        elif len(c.tokens) >= r.max_new_tokens:
            c.finish = "max_tokens"
        elif len(r.tokens) + len(c.tokens) > engine.length:       # no room to write the last token
            c.finish = "cache_full"
        return bool(c.finish)

    while queue or active:
        while queue and free:
            i, slot = queue.popleft(), free.pop(0)
            r = requests[i]
            entry, tok, _ = engine.prefill(r.tokens, sampling=r.sampling)
            state = engine.insert(entry, state, slot)
            tok = int(tok)
            out[i].ttft_s = time.perf_counter() - t0
            if emit(i, tok):
                free.append(slot)
            else:
                active[slot] = i
        if not active:
            continue
        t = time.perf_counter()
        state, toks, _ = engine.generate(state)
        toks = np.asarray(toks)
        engine.decode_s += time.perf_counter() - t
        engine.decode_steps += 1
        for slot, i in list(active.items()):
            if emit(i, int(toks[slot])):
                del active[slot]
                free.append(slot)
    return out

