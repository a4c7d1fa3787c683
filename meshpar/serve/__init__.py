"""Layer 6, serve: inference with a KV cache in a serving layout.

sampling   greedy / temperature / top-k / top-p, traced per slot
placement  the model in its serving layout: mesh, KV-cache spec and shardings, weights loaded once
engine     `Engine`: compiled prefill (batched), extend (after a cached prefix), insert and generate
in_flight  decoding on a pipeline mesh with one group of slots per stage in flight across ticks
batching   `Request`, `Completion`
prefix     `PrefixCache`: prompts' KV caches reused by a shared prefix (hashed blocks)
scheduler  continuous batching over the engine's slots, for a list or a server's queue
multihost  a server spanning processes: process 0 broadcasts each tick's intake
guard      what a request must pass first: API keys, JSON bodies within a size, valid Unicode
api        the OpenAI-compatible HTTP API (`meshpar serve`)
"""
