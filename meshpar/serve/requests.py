"""What is served: a request (prompt ids, budget, sampling, end tokens) and its completion. The
loop that serves them: `meshpar.serve.scheduler`."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshpar.serve.sampling import Sampling


@dataclass
class Request:
    """A prompt (token ids), its budget of new tokens, its sampling settings and end token(s);
    `logprobs`: k >= 0 records each token's log probability and the k most likely (None: none);
    `share`: requests with the same key and prompt admitted together prefill it once (OpenAI's `n`)."""

    tokens: list
    max_new_tokens: int = 32
    sampling: Sampling = field(default_factory=Sampling)
    eos: int | list | None = None
    logprobs: int | None = None
    share: str | None = None


@dataclass
class Completion:
    prompt: list
    tokens: list = field(default_factory=list)
    finish: str = ""  # eos | max_tokens | cache_full | cancelled | error | shutdown
    error: str = ""  # what failed (finish: error)
    ttft_s: float = 0.0  # from submission to this request's first token (queueing included)
    logprobs: list = field(default_factory=list)  # per token (log p, [(id, log p)] of the k most likely)
