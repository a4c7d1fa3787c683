"""What an OpenAI request body asks for: its fields checked and read into a `Request` (the
prompt tokenized: text through the tokenizer, chat through its template), or an `APIError` naming
the field at fault. What this server does not implement is refused by name, never ignored.
"""

from __future__ import annotations

import json
import secrets
import uuid
from typing import Any

from meshpar.core.errors import ConfigError
from meshpar.serve.guard import APIError, invalid_text
from meshpar.serve.requests import Request
from meshpar.serve.sampling import TOP_LOGPROBS, Sampling

ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's message roles
MAX_N = 16  # choices per request (`n`)


def _field(body: dict, key: str, kinds: tuple, default: Any = None, check=None, why: str = ""):
    """body[key] of one of `kinds` (bool is not a number), else the default; `check(v)` False -> 400."""
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        raise APIError(400, f"'{key}' must be {' or '.join(k.__name__ for k in kinds)}, got {json.dumps(v)[:40]}", key)
    if check is not None and not check(v):
        raise APIError(400, f"'{key}' {why}, got {v}", key)
    return v


def _unsupported(body: dict) -> None:
    """The OpenAI fields this server does not implement: 400 naming the field, never ignored."""
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise APIError(
            400, '\'response_format\' (structured output) is not supported; only {"type": "text"}', "response_format"
        )
    for key in ("tools", "functions"):
        if body.get(key):
            raise APIError(400, f"'{key}' (tool calling) is not supported", key)
    if body.get("tool_choice") not in (None, "none"):
        raise APIError(400, "'tool_choice' is not supported (no tools)", "tool_choice")
    if body.get("best_of") not in (None, 1):
        raise APIError(400, "'best_of' is not supported; use 'n' for several choices", "best_of")


def _logit_bias(body: dict, vocab: int) -> tuple:
    """`logit_bias` {token id: -100..100} -> ((id, value), ...), or 400 naming what is wrong (the ids,
    values and count against `Sampling.check`'s own bounds)."""
    out = []
    for k, v in _field(body, "logit_bias", (dict,), {}).items():
        try:
            tok = int(k)
        except ValueError:
            raise APIError(
                400, f"'logit_bias' keys must be token ids, got {json.dumps(k)[:40]}", "logit_bias"
            ) from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise APIError(
                400, f"'logit_bias' values must be numbers, got {json.dumps(v)[:40]} for token {tok}", "logit_bias"
            )
        out.append((tok, float(v)))
    try:
        Sampling(bias=tuple(out)).check(vocab)
    except ConfigError as e:
        raise APIError(400, str(e), "logit_bias") from None
    return tuple(out)


class Fields:
    """The request side of `meshpar serve`: `parse` a body for this engine and tokenizer."""

    def __init__(self, engine, tokenizer, name: str, eos: list[int], serve_cfg):
        self.engine, self.tok, self.name, self.eos = engine, tokenizer, name, eos
        self.default_tokens = serve_cfg.max_new_tokens
        self.special_in_content = serve_cfg.allow_special_tokens_in_content

    def parse(self, body: Any, chat: bool) -> tuple[Request, dict]:
        """-> (Request, options {stream, stop, include_usage}); APIError naming the field at fault."""
        _check_body(body, self.name)
        n_choices = _field(body, "n", (int,), 1, lambda v: 1 <= v <= MAX_N, f"must be between 1 and {MAX_N}")
        _unsupported(body)
        logprobs, echo = _logprob_fields(body, chat)
        bias = _logit_bias(body, self.engine.vocab)
        tokens = self._prompt(body, chat)
        room = self.engine.length - len(tokens) + 1  # the last token is never written to the cache
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {len(tokens)} tokens; this server's context (serve.cache_length) "
                f"holds {self.engine.length}",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        n = _field(body, key, (int,), None, lambda v: v >= 1, "must be >= 1")
        if n is not None and n > room:
            raise APIError(
                400,
                f"'{key}'={n} with a prompt of {len(tokens)} tokens exceeds this server's context of "
                f"{self.engine.length} tokens (serve.cache_length): at most {room}",
                key,
                "context_length_exceeded",
            )
        samp = _sampling(body, self.engine.vocab, bias)
        stop, stream, usage = _stream_fields(body)
        req = Request(
            tokens,
            n or min(self.default_tokens, room),
            samp,
            eos=self.eos,
            logprobs=logprobs,
            share=uuid.uuid4().hex if n_choices > 1 else None,
        )
        prompt = body.get("prompt")
        prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str) else prompt
        echo_text = (prompt if isinstance(prompt, str) else self.tok.decode(tokens)) if echo else ""
        return req, {
            "stream": stream,
            "stop": stop,
            "include_usage": usage,
            "n": n_choices,
            "echo": echo,
            "echo_text": echo_text,
            "logprobs": logprobs,
        }

    def _prompt(self, body: dict, chat: bool) -> list[int]:
        if chat:
            msgs = body.get("messages")
            if (
                not isinstance(msgs, list)
                or not msgs
                or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs
                )
            ):
                raise APIError(
                    400, '\'messages\' must be a non-empty list of {"role": str, "content": str}', "messages"
                )
            role = next((m["role"] for m in msgs if m["role"] not in ROLES), None)
            if role is not None:
                raise APIError(400, f"unknown message role '{role[:40]}': use one of {', '.join(ROLES)}", "messages")
            if not hasattr(self.tok, "chat"):
                raise APIError(
                    400,
                    "this server has no chat template (serve a model with data.tokenizer=DIR whose "
                    "tokenizer_config.json has one); use /v1/completions",
                    "messages",
                )
            self._fits(sum(len(m["content"]) for m in msgs), "messages")
            try:
                return self.tok.chat(
                    [{"role": m["role"], "content": m["content"]} for m in msgs],
                    split_special=not self.special_in_content,
                )
            except Exception as e:  # noqa: BLE001 - a template's own error (ConfigError) or its Python's
                raise APIError(400, str(e).splitlines()[0] if str(e) else type(e).__name__, "messages") from None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            self._fits(len(prompt), "prompt")
            return self.tok.prompt(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not all(0 <= t < self.engine.vocab for t in prompt):
                raise APIError(400, f"'prompt' token ids must be in 0..{self.engine.vocab - 1}", "prompt")
            return list(prompt)
        raise APIError(
            400, "'prompt' must be a non-empty string or list of token ids (one prompt per request)", "prompt"
        )

    def _fits(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text longer than the cache could hold even at the tokenizer's
        most characters per token (twice that: a normalizer may drop characters)."""
        most = 2 * self.engine.length * getattr(self.tok, "max_chars_per_token", 1)
        if chars > most:
            raise APIError(
                400,
                f"the {param} has {chars} characters, more than this server's context of "
                f"{self.engine.length} tokens (serve.cache_length) can hold",
                param,
                "context_length_exceeded",
            )


def _check_body(body: Any, name: str) -> None:
    """The body is a JSON object of valid Unicode, for the model this server serves (`name`)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    bad = invalid_text(body)
    if bad:
        raise APIError(
            400,
            f"the request body holds text that is not valid Unicode at '{bad}' (a lone "
            "surrogate such as \\ud800); send UTF-8 text",
            bad.split(".")[0].split("[")[0],
        )
    model = _field(body, "model", (str,))
    if model is None:
        raise APIError(400, "'model' is required", "model")
    if model != name:
        raise APIError(
            404, f"the model '{model}' does not exist; this server serves '{name}'", "model", "model_not_found"
        )


def _logprob_fields(body: dict, chat: bool) -> tuple:
    """-> (logprobs: top ids per token or None, echo): chat's `logprobs` and `top_logprobs`,
    completions' `logprobs` and `echo`."""
    if chat:
        top = _field(
            body,
            "top_logprobs",
            (int,),
            None,
            lambda v: 0 <= v <= TOP_LOGPROBS,
            f"must be between 0 and {TOP_LOGPROBS}",
        )
        if top is not None and not body.get("logprobs"):
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if _field(body, "logprobs", (bool,), False) else None
        echo = False
    else:
        logprobs = _field(body, "logprobs", (int,), None, lambda v: 0 <= v <= 5, "must be between 0 and 5")
        echo = _field(body, "echo", (bool,), False)
        if echo and logprobs is not None:
            raise APIError(
                400,
                "'echo' with 'logprobs' is not supported (the prompt's log probabilities are not "
                "computed); send one of them",
                "echo",
            )
    return logprobs, echo


def _sampling(body: dict, vocab: int, bias: tuple) -> Sampling:
    """The request's sampling settings (temperature, top-k/p, seed, penalties, logit bias)."""
    presence = _field(body, "presence_penalty", (int, float), 0.0, lambda v: -2 <= v <= 2, "must be between -2 and 2")
    frequency = _field(body, "frequency_penalty", (int, float), 0.0, lambda v: -2 <= v <= 2, "must be between -2 and 2")
    temp = _field(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "must be between 0 and 2")
    top_p = _field(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "must be in (0, 1]")
    top_k = _field(
        body,
        "top_k",
        (int,),
        None,
        lambda v: v == -1 or 1 <= v <= vocab,
        f"must be -1 (off) or between 1 and the vocabulary {vocab}",
    )
    seed = _field(body, "seed", (int,), None)
    seed = secrets.randbits(31) if seed is None else seed  # unseeded: a fresh draw per request, as OpenAI
    return Sampling(
        float(temp),
        None if top_k in (None, -1) else top_k,
        float(top_p),
        seed % (2**31),
        float(presence),
        float(frequency),
        bias,
    )


def _stream_fields(body: dict) -> tuple:
    """-> (stop strings, stream, include_usage)."""
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "'stop' must be a string or a list of up to 4 non-empty strings", "stop")
    stream = _field(body, "stream", (bool,), False)
    if body.get("stream_options") is not None and not stream:
        raise APIError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    usage = bool((_field(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
    return stop, stream, usage
