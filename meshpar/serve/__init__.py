"""Layer 6, serve: inference with a KV cache in a serving layout.

sampling  greedy / temperature / top-k / top-p, traced per slot
engine    load and place weights; compiled prefill, insert, generate; the continuous-batching loop
"""
