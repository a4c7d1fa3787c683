"""What is served: a request (prompt ids, budget, sampling settings, end tokens) and its completion.
The loop that serves them: `meshpar.serve.scheduler`; the sampling itself: `meshpar.serve.sampling`.
Nothing here needs JAX (a server's request parser, `meshpar.serve.intake`, runs without it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshpar.core.errors import ConfigError

MAX_BIAS = 300  # logit_bias entries per request (a fixed [MAX_BIAS] row: one compiled shape)
TOP_LOGPROBS = 20  # most likely tokens `logprobs` returns per position (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class Sampling:
    """One request's sampling settings. temperature 0 is greedy; top_k None and top_p 1.0 are off;
    presence and frequency penalties 0 and no `bias` ((token id, value) pairs) leave the logits alone."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0
    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple = ()

    def check(self, vocab: int | None) -> Sampling:
        """One line naming the bad value (vocab None: the model is not known yet); returns self."""
        t, k, p = self.temperature, self.top_k, self.top_p
        if not (t >= 0.0) or t != t:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {t}")
        if k is not None and k < 1:
            raise ConfigError(f"top-k must be >= 1, got {k}; omit it to sample from the whole vocabulary")
        if k is not None and vocab is not None and k > vocab:
            raise ConfigError(
                f"top-k must be between 1 and the vocabulary size {vocab}, got {k}; "
                "omit it to sample from the whole vocabulary"
            )
        if not 0.0 < p <= 1.0:
            raise ConfigError(f"top-p must be in (0, 1], got {p}; use 1.0 to turn nucleus sampling off")
        for name, v in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not -2.0 <= v <= 2.0:
                raise ConfigError(f"{name} must be between -2 and 2, got {v}")
        if len(self.bias) > MAX_BIAS:
            raise ConfigError(f"logit_bias has {len(self.bias)} entries; at most {MAX_BIAS}")
        for tok, v in self.bias:
            if tok < 0 or (vocab is not None and tok >= vocab):
                raise ConfigError(f"logit_bias token {tok} is outside the vocabulary 0..{(vocab or 0) - 1}")
            if not -100.0 <= v <= 100.0:
                raise ConfigError(f"logit_bias value for token {tok} must be between -100 and 100, got {v}")
        return self

    def arrays(self, vocab: int) -> dict:
        """As traced values: temperature f32, top_k i32 (vocab when off), top_p f32, key (key data),
        the penalties f32, and the bias as [MAX_BIAS] ids and values (padding: token 0 + 0.0)."""
        import jax  # here, not at the top: a request parser builds settings without loading JAX
        import jax.numpy as jnp
        import numpy as np

        ids, vals = np.zeros(MAX_BIAS, np.int32), np.zeros(MAX_BIAS, np.float32)
        for i, (tok, v) in enumerate(self.bias):
            ids[i], vals[i] = tok, v
        return {
            "temp": jnp.float32(self.temperature),
            "top_k": jnp.int32(self.top_k or vocab),
            "top_p": jnp.float32(self.top_p),
            "key": jax.random.key_data(jax.random.key(self.seed)),
            "presence": jnp.float32(self.presence),
            "frequency": jnp.float32(self.frequency),
            "bias_ids": ids,
            "bias_vals": vals,
        }


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
