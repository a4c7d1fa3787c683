"""What an OpenAI request body asks for: its fields checked and read into a `Request` (the prompt
tokenized: text through the tokenizer, chat through its template), or an `APIError` naming the
field at fault. What this server does not implement is refused by name, never ignored.

The work a body costs is bounded before the costly steps: the messages are counted
(`serve.max_messages`) before any is read, every list is measured before it is walked, a text is
measured against the context before it is tokenized, and the Unicode check reads only the fields
that are used. Nothing here needs JAX: `meshpar.serve.intake` runs it in a process of its own.
"""

from __future__ import annotations

import json
import re
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

from meshpar.core.errors import ConfigError
from meshpar.serve.guard import APIError, invalid_text
from meshpar.serve.requests import MAX_BIAS, TOP_LOGPROBS, Request, Sampling

ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's message roles
MAX_N = 16  # choices per request (`n`)
TOKEN_ID = re.compile(r"0|[1-9][0-9]*")  # a logit_bias key: a token id in ASCII digits, no sign, space or leading 0


@dataclass(frozen=True)
class Limits:
    """What a body is checked against: the model's vocabulary and context (serve.cache_length), the
    server's model id and end ids, its slots and queue, and the serve.* settings that read bodies."""

    vocab: int
    length: int
    name: str
    eos: tuple
    slots: int
    max_waiting: int
    max_new_tokens: int = 32
    max_messages: int = 2048
    special_in_content: bool = False


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


def _choices(body: dict, lim: Limits) -> int:
    """`n`: 1..MAX_N, and no more than the server could ever admit together (its slots and queue: a
    429 would say to retry what can never be taken)."""
    n = _field(body, "n", (int,), 1, lambda v: 1 <= v <= MAX_N, f"must be between 1 and {MAX_N}")
    if n > lim.slots + lim.max_waiting:
        raise APIError(
            400,
            f"'n'={n} choices can never be admitted together: this server has {lim.slots} slots and queues "
            f"{lim.max_waiting} more (serve.slots, serve.max_waiting); ask for at most {lim.slots + lim.max_waiting}",
            "n",
        )
    return n


def _unsupported(body: dict, chat: bool) -> None:
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
    if not chat and body.get("suffix") not in (None, ""):
        raise APIError(400, "'suffix' (text after the completion, insertion) is not supported", "suffix")
    if chat and body.get("echo") not in (None, False):
        raise APIError(400, "'echo' is a field of /v1/completions; chat completions do not echo", "echo")


def _logit_bias(body: dict, vocab: int) -> tuple:
    """`logit_bias` {token id: -100..100} -> ((id, value), ...), or 400 naming what is wrong: a key is
    a token id as OpenAI writes one (ASCII digits, no sign, space, underscore or leading zero, so no
    two keys name one token), a value a number; the count, ids and values against `Sampling.check`."""
    bias = _field(body, "logit_bias", (dict,), {})
    if len(bias) > MAX_BIAS:
        raise APIError(400, f"'logit_bias' has {len(bias)} entries; at most {MAX_BIAS}", "logit_bias")
    out = []
    for k, v in bias.items():
        if not TOKEN_ID.fullmatch(k):
            raise APIError(
                400, f"'logit_bias' keys must be token ids such as \"50256\", got {json.dumps(k)[:40]}", "logit_bias"
            )
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise APIError(
                400, f"'logit_bias' values must be numbers, got {json.dumps(v)[:40]} for token {k}", "logit_bias"
            )
        out.append((int(k), float(v)))
    try:
        Sampling(bias=tuple(out)).check(vocab)
    except ConfigError as e:
        raise APIError(400, str(e), "logit_bias") from None
    return tuple(out)


def _unicode(value, param: str) -> None:
    """400 naming `param` if a string in `value` is not valid Unicode (a lone surrogate)."""
    bad = invalid_text(value, param)
    if bad:
        raise APIError(
            400,
            f"the request body holds text that is not valid Unicode at '{bad}' (a lone surrogate such as "
            "\\ud800); send UTF-8 text",
            param,
        )


def _messages(body: dict, most: int) -> list[dict]:
    """The chat messages as [{"role", "content": str}], content given as text parts joined (by "\\n",
    as vLLM joins them); 400 for more than `most` messages and parts, or anything else."""
    msgs = body.get("messages")
    shape = '\'messages\' must be a non-empty list of {"role": str, "content": str or [{"type": "text", "text": str}]}'
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, shape, "messages")
    parts = sum(len(m["content"]) for m in msgs if isinstance(m, dict) and isinstance(m.get("content"), list))
    if len(msgs) + parts > most:
        raise APIError(
            400,
            f"'messages' has {len(msgs)} messages and {parts} content parts; this server takes at most {most} "
            "(serve.max_messages)",
            "messages",
        )
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, shape, "messages")
        content = m.get("content")
        if isinstance(content, list):
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    kind = p.get("type") if isinstance(p, dict) else None
                    raise APIError(
                        400,
                        f'messages[{i}].content[{j}] must be a text part {{"type": "text", "text": str}}'
                        + (f"; '{str(kind)[:20]}' parts are not supported (this model reads text)" if kind else ""),
                        "messages",
                    )
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, shape, "messages")
        out.append({"role": m["role"], "content": content})
    _unicode(out, "messages")
    role = next((m["role"] for m in out if m["role"] not in ROLES), None)
    if role is not None:
        raise APIError(400, f"unknown message role '{role[:40]}': use one of {', '.join(ROLES)}", "messages")
    return out


class Fields:
    """The request side of `meshpar serve`: `parse` a body against `limits` with `tokenizer`."""

    def __init__(self, limits: Limits, tokenizer):
        self.limits, self.tok = limits, tokenizer

    def parse_raw(self, raw: bytes, chat: bool) -> tuple[Request, dict]:
        """A request body's bytes -> `parse` of its JSON (400 for JSON that is not)."""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise APIError(400, f"the request body is not valid JSON ({str(e).splitlines()[0]})") from None
        return self.parse(body, chat)

    def parse(self, body: Any, chat: bool) -> tuple[Request, dict]:
        """-> (Request, options {stream, stop, include_usage, n, echo, echo_text, logprobs}); APIError
        naming the field at fault."""
        lim = self.limits
        _check_body(body, lim.name)
        n_choices = _choices(body, lim)
        _unsupported(body, chat)
        logprobs, echo = _logprob_fields(body, chat)
        bias = _logit_bias(body, lim.vocab)
        stop, stream, usage = _stream_fields(body)
        tokens = self._prompt(body, chat)
        room = lim.length - len(tokens) + 1  # the last token is never written to the cache
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {len(tokens)} tokens; this server's context (serve.cache_length) holds {lim.length}",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        # chat's max_completion_tokens replaces max_tokens (deprecated there); null means not given
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        n = _field(body, key, (int,), None, lambda v: v >= 1, "must be >= 1")
        if n is not None and n > room:
            raise APIError(
                400,
                f"'{key}'={n} with a prompt of {len(tokens)} tokens exceeds this server's context of "
                f"{lim.length} tokens (serve.cache_length): at most {room}",
                key,
                "context_length_exceeded",
            )
        req = Request(
            tokens,
            n or min(lim.max_new_tokens, room),
            _sampling(body, lim.vocab, bias),
            eos=list(lim.eos),
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
        lim = self.limits
        if chat:
            msgs = _messages(body, lim.max_messages)
            if not hasattr(self.tok, "chat"):
                raise APIError(
                    400,
                    "this server has no chat template (serve a model with data.tokenizer=DIR whose "
                    "tokenizer_config.json has one); use /v1/completions",
                    "messages",
                )
            self._fits(sum(len(m["content"]) for m in msgs), "messages")
            try:
                return self.tok.chat(msgs, split_special=not lim.special_in_content)
            except Exception as e:  # noqa: BLE001 - a template's own error (ConfigError) or its Python's
                raise APIError(400, str(e).splitlines()[0] if str(e) else type(e).__name__, "messages") from None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            _unicode(prompt, "prompt")
            self._fits(len(prompt), "prompt")
            return self.tok.prompt(prompt)
        if isinstance(prompt, list) and 0 < len(prompt) <= lim.length + 1:
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                if not all(0 <= t < lim.vocab for t in prompt):
                    raise APIError(400, f"'prompt' token ids must be in 0..{lim.vocab - 1}", "prompt")
                return list(prompt)
        elif isinstance(prompt, list) and prompt:
            raise APIError(
                400,
                f"the prompt has {len(prompt)} tokens; this server's context (serve.cache_length) holds {lim.length}",
                "prompt",
                "context_length_exceeded",
            )
        raise APIError(
            400, "'prompt' must be a non-empty string or list of token ids (one prompt per request)", "prompt"
        )

    def _fits(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text longer than the cache could hold even at the tokenizer's
        most characters per token (twice that: a normalizer may drop characters)."""
        length = self.limits.length
        if chars > 2 * length * getattr(self.tok, "max_chars_per_token", 1):
            raise APIError(
                400,
                f"the {param} has {chars} characters, more than this server's context of "
                f"{length} tokens (serve.cache_length) can hold",
                param,
                "context_length_exceeded",
            )


def _check_body(body: Any, name: str) -> None:
    """The body is a JSON object, for the model this server serves (`name`)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = _field(body, "model", (str,))
    if model is None:
        raise APIError(400, "'model' is required", "model")
    _unicode(model, "model")
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
    _unicode(stop, "stop")
    stream = _field(body, "stream", (bool,), False)
    if body.get("stream_options") is not None and not stream:
        raise APIError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    usage = bool((_field(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
    return stop, stream, usage
