"""Layer 6, serve: inference with a KV cache in a serving layout.

sampling   greedy / temperature / top-k / top-p, traced per slot
placement  the model in its serving layout: mesh, KV-cache spec and shardings, weights loaded once
engine     `Engine`: compiled prefill, insert and generate
batching   `Request`, `Completion` and continuous batching over the engine's slots
"""
