"""Prefix caching: the KV cache of a prompt kept, so a later prompt that starts with the same tokens
(a shared system prompt, the earlier turns of a chat) computes only what follows them.

A prompt is cut into blocks of `block` tokens; block j is named by a hash chained to its parent's
(vLLM's scheme: h_j = H(h_{j-1}, tokens of block j)), so a name stands for the whole prefix up to and
including that block. `store(tokens, cache)` keeps a prompt's cache [.., 1, S, ..] (positions < len
hold its keys and values) under the names of its whole blocks; `lookup(tokens)` finds the longest
stored prefix of whole blocks, leaving at least one token to compute (the logits of the last one
choose the first new token). Entries are evicted least recently used; an entry is the size of one
slot's cache. What follows the prefix in a stored cache is never read: the engine writes a
position before any query at or after it attends to it (causal masks).
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np


def block_names(tokens, block: int, count: int) -> list[bytes]:
    """The chained names of the first `count` whole blocks of `tokens`."""
    names, h = [], b""
    for j in range(count):
        h = hashlib.blake2b(
            h + np.asarray(tokens[j * block : (j + 1) * block], np.int64).tobytes(), digest_size=16
        ).digest()
        names.append(h)
    return names


class PrefixCache:
    """At most `entries` prompts' caches, reusable in whole blocks of `block` tokens (see the module
    docstring). hits/misses count lookups; `reused` the tokens not recomputed."""

    def __init__(self, entries: int, block: int):
        self.capacity, self.block = entries, block
        self._entries = collections.OrderedDict()  # id -> cache
        self._names = {}  # block name -> (id, whole blocks it covers)
        self._next = 0
        self.hits = self.misses = self.reused = 0

    def lookup(self, tokens):
        """-> (cache, prefix length) of the longest stored prefix of whole blocks shorter than
        `tokens`, or None (the caller says with `record` whether it used it)."""
        if self.capacity:
            names = block_names(tokens, self.block, (len(tokens) - 1) // self.block)
            for j in range(len(names) - 1, -1, -1):
                found = self._names.get(names[j])
                if found is not None and found[0] in self._entries:
                    self._entries.move_to_end(found[0])
                    return self._entries[found[0]], (j + 1) * self.block
        return None

    def record(self, reused: int) -> None:
        """Count a prompt: `reused` tokens taken from the cache (0: a miss)."""
        self.hits, self.misses, self.reused = self.hits + bool(reused), self.misses + (not reused), self.reused + reused

    def wants(self, tokens) -> bool:
        """Whether a prompt has a whole block to keep."""
        return self.capacity > 0 and len(tokens) >= self.block

    def store(self, tokens, cache) -> None:
        """Keep `cache` as the prompt `tokens`' (evicting the least recently used beyond capacity)."""
        if not self.wants(tokens):
            return
        key, self._next = self._next, self._next + 1
        self._entries[key] = cache
        for j, name in enumerate(block_names(tokens, self.block, len(tokens) // self.block)):
            self._names[name] = (key, j + 1)
        while len(self._entries) > self.capacity:
            old, _ = self._entries.popitem(last=False)
            self._names = {k: v for k, v in self._names.items() if v[0] != old}

    def __len__(self) -> int:
        return len(self._entries)
