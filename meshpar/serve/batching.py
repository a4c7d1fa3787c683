"""What is served: a request (prompt ids, budget, sampling, end tokens) and its completion. The
loop that serves them: `meshpar.serve.scheduler`."""
from __future__ import annotations

from dataclasses import dataclass, field

from meshpar.serve.sampling import Sampling


@dataclass
class Request:
    """A prompt (token ids), its budget of new tokens, its sampling settings and end token(s)."""
    tokens: list
    max_new_tokens: int = 32
    sampling: Sampling = field(default_factory=Sampling)
    eos: int | list | None = None


@dataclass
class Completion:
    prompt: list
    tokens: list = field(default_factory=list)
    finish: str = ""          # eos | max_tokens | cache_full | cancelled | error
    error: str = ""           # what failed (finish: error)
    ttft_s: float = 0.0       # from submission to this request's first token (queueing included)
