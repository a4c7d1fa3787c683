"""How admitted prompts become KV cache in their slots (`Prefills`, the admission half of a tick):

    a cached prefix (`meshpar.serve.prefix`)  extend its tail alone
    the rest                                   prefilled together, up to serve.prefill_batch per call
                                               and one call per length bucket
    OpenAI's `n` siblings (`Request.share`)    the first prefilled, each other one extends the first's
                                               cache by the prompt's last position (its own first
                                               token, with its own seed): one prefill for all
    with serve.prefill_chunk = K               at most K prompt tokens a tick (vLLM's chunked prefill;
                                               Agrawal et al. 2024, Sarathi-Serve): every admitted
                                               prompt waits in `partial`, and each tick the prompts
                                               there share K max-min fairly (whole if under the fair
                                               share, else a power-of-two chunk), their first
                                               chunks prefilled together, the next ones extended
                                               together from their caches so far (`extend_batch`),
                                               between decode steps: a burst of long prompts never
                                               stalls the streams decoding, and a short prompt behind
                                               it still completes in one tick

Each prompt's first token is emitted as it is placed, with its log probabilities where asked.
"""

from __future__ import annotations

import collections
import time

import numpy as np


def fair_share(needs: list[int], budget: int) -> int:
    """The water level L of a max-min fair split of `budget` tokens: sum(min(need, L)) <= budget, each
    need under L met whole (at least 1)."""
    level, left = 1, budget
    for i, n in enumerate(sorted(needs)):
        share = left // (len(needs) - i)
        if n > share:
            return max(level, share)
        level, left = n, left - n
    return max(level, left)


def _share(ticket) -> tuple:
    """The key `n` siblings have in common: their share key and their prompt."""
    return ticket.request.share, tuple(ticket.request.tokens)


class Prefills:
    """The admission half of `meshpar.serve.scheduler.TickLoop` (its engine, slots, prefix cache and
    `prefill_chunk`); `partial` holds, per slot, a prompt still being prefilled: [ticket, where its
    cache so far is (a cache tree and its row) or None, positions done]."""

    def _admit(self, tickets, slots) -> None:
        """Prefill `tickets` into `slots` (module docstring); with a chunk budget, into `partial`."""
        e, rest = self.engine, []
        for t, slot in zip(tickets, slots):
            tokens = t.request.tokens
            hit = self.prefix.lookup(tokens) if self.prefix is not None else None
            use = hit is not None and e.can_extend(len(tokens), hit[1])
            if self.prefix is not None:
                self.prefix.record(hit[1] if use else 0)
            if self.prefill_chunk:
                self.partial[slot] = [t, (hit[0], 0) if use else None, hit[1] if use else 0]
            elif use:
                entry, tok, lg = e.extend(hit[0], tokens, hit[1], t.request.sampling)
                self.prefix.store(tokens, entry["cache"])
                self._place(entry, [t], [slot], np.asarray(tok)[None], lg)
            else:
                rest.append((t, slot))
        self._batched(rest)

    def _batched(self, rest) -> None:
        """Prompts prefilled whole, batched per length bucket; `n` siblings extend their first's row."""
        e, leaders = self.engine, set()
        groups, followers = collections.defaultdict(list), collections.defaultdict(list)
        for t, slot in rest:
            n = len(t.request.tokens)
            if t.request.share is not None and _share(t) in leaders and e.can_extend(n, n - 1):
                followers[_share(t)].append((t, slot))
            else:
                leaders.add(_share(t))
                groups[e.bucket(n)].append((t, slot))
        for group in groups.values():
            for i in range(0, len(group), self.prefill_batch):
                part = group[i : i + self.prefill_batch]
                entry, toks, last = e.prefill_batch(
                    [t.request.tokens for t, _ in part], [t.request.sampling for t, _ in part]
                )
                self.prefill_calls += 1
                if self.prefix is not None:
                    for r, (t, _) in enumerate(part):
                        if self.prefix.wants(t.request.tokens):
                            self.prefix.store(t.request.tokens, e.full(entry, r))
                self._place(entry, [t for t, _ in part], [s for _, s in part], np.asarray(toks), last)
                for r, (t, _) in enumerate(part):  # `n`: the siblings recompute the last position only
                    for sib, slot in followers.get(_share(t), []):
                        tokens = sib.request.tokens
                        one, tok, lg = e.extend(e.full(entry, r), tokens, len(tokens) - 1, sib.request.sampling)
                        self._place(one, [sib], [slot], np.asarray(tok)[None], lg)

    def _chunks(self) -> None:
        """One tick's work on the prompts in `partial` (module docstring): K shared max-min fairly;
        first chunks prefilled together, later ones extended together, per tail bucket."""
        e = self.engine
        need = {slot: len(t.request.tokens) - done for slot, (t, _, done) in self.partial.items()}
        level = fair_share(list(need.values()), self.prefill_chunk)
        fresh, later = collections.defaultdict(list), collections.defaultdict(list)
        for slot, (t, ref, done) in list(self.partial.items()):
            n = need[slot]
            if n > level or (ref is not None and e.bucket(n) >= e.length):
                # a chunk: a power of two (its tail fills its bucket), an extend's shorter than the cache
                n = 1 << (min(level, e.length // 2).bit_length() - 1)
            (fresh if ref is None else later)[e.bucket(n)].append((slot, t, ref, done, n))
        for group in fresh.values():
            for i in range(0, len(group), self.prefill_batch):
                part = group[i : i + self.prefill_batch]
                entry, toks, last = e.prefill_batch(
                    [t.request.tokens[:n] for _, t, _, _, n in part], [t.request.sampling for _, t, _, _, _ in part]
                )
                self.prefill_calls += 1
                self._advance(entry, part, toks, last)
        for group in later.values():
            for i in range(0, len(group), self.prefill_batch):
                part = group[i : i + self.prefill_batch]
                entry, toks, last = e.extend_batch(
                    [e.full({"cache": ref[0]}, ref[1]) for _, _, ref, _, _ in part],
                    [t.request.tokens[: done + n] for _, t, _, done, n in part],
                    [done for _, _, _, done, _ in part],
                    [t.request.sampling for _, t, _, _, _ in part],
                )
                self._advance(entry, part, toks, last)

    def _advance(self, entry, part, toks, logits) -> None:
        """The rows of one chunk call: a prompt now whole takes its slot and emits its first token;
        the others wait in `partial` with their cache so far (row r of `entry`)."""
        placed = []
        for r, (slot, t, _, done, n) in enumerate(part):
            if done + n < len(t.request.tokens):
                self.partial[slot] = [t, (entry["cache"], r), done + n]
                continue
            del self.partial[slot]
            if self.prefix is not None and self.prefix.wants(t.request.tokens):
                self.prefix.store(t.request.tokens, self.engine.full(entry, r))
            placed.append((r, t, slot))
        if placed:
            self._place_rows(entry, placed, np.asarray(toks), logits)

    def _place(self, entry, tickets, slots, toks, logits=None) -> None:
        """Entry rows 0.. into `slots`, each emitting its first token `toks[r]`."""
        self._place_rows(entry, [(r, t, s) for r, (t, s) in enumerate(zip(tickets, slots))], toks, logits)

    def _place_rows(self, entry, placed, toks, logits=None) -> None:
        """Entry row r into its slot for each (r, ticket, slot) of `placed` (other rows dropped)."""
        rows = [-1] * entry["length"].shape[0]
        for r, _, slot in placed:
            rows[r] = slot
        self.state = self.engine.insert(entry, self.state, rows)
        now = time.perf_counter()
        picked = np.asarray([r for r, _, _ in placed])
        logits = None if logits is None else logits.reshape(-1, logits.shape[-1])[picked]
        lp = logprobs_of(self.engine, [t for _, t, _ in placed], logits, np.asarray(toks)[picked])
        for i, (r, t, slot) in enumerate(placed):
            t.completion.ttft_s = now - t.submitted
            self.active[slot] = t
            self._emit(t, slot, int(toks[r]), lp and [a[i] for a in lp])


def logprobs_of(engine, tickets, logits, toks) -> list | None:
    """The engine's log probabilities of `toks` under `logits` when any of `tickets` asked for them."""
    if logits is None or not any(t.request.logprobs is not None for t in tickets):
        return None
    return list(engine.logprobs(logits, toks))
