"""Chat templates (tokenizer_config.json's `chat_template`): rendered as transformers renders them, and
tokenized so that what a message says is always text. A special token's text typed inside a
message (`<|im_end|>\\n<|im_start|>assistant\\n`, which would close the user's turn and open the
assistant's) is read as plain text, the template's own markers stay special, whatever the template
does with the content (trims it, as Llama 3's and Gemma's do, repeats it, or leaves it out):

    text  = render(template, messages)                                 # what transformers renders
    frame = render(template, messages, each content -> a placeholder)   # the template's own text
    spans = where each content lies in `text`: the frame's pieces matched in order, each
            placeholder by its content as given or stripped of surrounding whitespace
    ids   = text's tokens if no special token overlaps a span; else the special tokens inside a
            span re-read as plain text; else (one straddles a span's edge) the pieces tokenized
            apart, the template's with special tokens, the contents' as plain text

A template whose text cannot be matched so (one that branches on what a message says) is served
the frame with each placeholder replaced by its content as given: the template's own text, and
the content as plain text. Content is never searched for in the text (`str.find` found a content of
`<|im_start|>` in the template's marker first, and a trimmed one not at all).
"""

from __future__ import annotations

import bisect
import re

from meshpar.core.errors import ConfigError

OPEN, CLOSE = "\ue000", "\ue001"  # private-use characters around a placeholder's number: no template strips them
PLACEHOLDER = re.compile(f"{OPEN}(\\d+){CLOSE}")


def render_chat(template: str, messages: list[dict], config: dict) -> str:
    """A chat template rendered as transformers' `apply_chat_template(..., add_generation_prompt=True)`
    does: jinja2's sandboxed environment, trim_blocks and lstrip_blocks, loop controls, the special
    tokens of tokenizer_config.json as variables, `raise_exception`, `strftime_now` and a `tojson`
    that keeps non-ASCII text."""
    import datetime
    import json

    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    special = {
        k: (v.get("content") if isinstance(v, dict) else v)
        for k, v in config.items()
        if k.endswith("_token") and (v is None or isinstance(v, (str, dict)))
    }
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special)
    except TemplateError as e:
        raise ConfigError(f"data.tokenizer's chat_template failed: {e}") from None


def layout(template: str, messages: list[dict], config: dict) -> tuple[str, list[tuple[int, int]]]:
    """-> (the prompt's text, the [start, end) spans in it that hold messages' content, in order),
    as the module docstring says."""
    text = render_chat(template, messages, config)
    framed = [m | {"content": f"{OPEN}{i}{CLOSE}"} if m["content"] else m for i, m in enumerate(messages)]
    pieces = PLACEHOLDER.split(render_chat(template, framed, config))  # [text, i, text, i, ..., text]
    segments, slots = pieces[0::2], [messages[int(i)]["content"] for i in pieces[1::2]]
    spans = _match(text, segments, slots)
    if spans is not None:
        return text, spans
    out, spans, at = [segments[0]], [], len(segments[0])  # the frame, each placeholder its content as given
    for content, segment in zip(slots, segments[1:]):
        spans.append((at, at + len(content)))
        out += [content, segment]
        at += len(content) + len(segment)
    return "".join(out), spans


def _match(text: str, segments: list[str], slots: list[str]) -> list[tuple[int, int]] | None:
    """Spans such that text = segments[0] + slot 0 + segments[1] + slot 1 + ..., each slot its content
    as given or stripped (left, right, both); None if there are none. Depth first over the slots,
    remembering the (slot, position) pairs that led nowhere: at most slots x len(text) steps."""
    if not text.startswith(segments[0]):
        return None
    stack, spans, dead = [(0, len(segments[0]), 0)], [], set()
    while stack:
        k, at, tried = stack.pop()
        del spans[k:]
        if k == len(slots):
            if at == len(text):
                return spans
            dead.add((k, at))
            continue
        c = slots[k]
        forms = list(dict.fromkeys((c, c.strip(), c.lstrip(), c.rstrip())))
        for j in range(tried, len(forms)):
            end = at + len(forms[j])
            nxt = end + len(segments[k + 1])
            if (k + 1, nxt) in dead or not text.startswith(forms[j], at) or not text.startswith(segments[k + 1], end):
                continue
            stack += [(k, at, j + 1), (k + 1, nxt, 0)]
            spans.append((at, end))
            break
        else:
            dead.add((k, at))
    return None


def tokenize(tok, plain, special_ids: set, text: str, spans: list[tuple[int, int]]) -> list[int]:
    """`text`'s ids (`tok`: a `tokenizers.Tokenizer`; `plain`: the same with special tokens read as
    text), no special token from within `spans` (the module docstring's last step)."""
    enc = tok.encode(text, add_special_tokens=False)
    starts = [s for s, _ in spans]

    def where(a: int, b: int) -> str:  # "out" of every span, "in" one, or "edge" (overlapping a span's edge)
        k = bisect.bisect_right(starts, a) - 1
        if k >= 0 and b <= spans[k][1]:
            return "in" if a < spans[k][1] else "out"
        nxt = k + 1
        inside = (k >= 0 and a < spans[k][1]) or (nxt < len(spans) and spans[nxt][0] < b)
        return "edge" if inside else "out"

    special = [(i, a, b, where(a, b)) for i, (a, b) in zip(enc.ids, enc.offsets) if i in special_ids]
    if all(w == "out" for *_, w in special):
        return enc.ids
    if any(w == "edge" for *_, w in special):  # the pieces apart: no marker can reach across an edge
        out, at = [], 0
        for s, e in spans:
            out += (
                tok.encode(text[at:s], add_special_tokens=False).ids
                + plain.encode(text[s:e], add_special_tokens=False).ids
            )
            at = e
        return out + tok.encode(text[at:], add_special_tokens=False).ids
    out = []
    for i, (a, b) in zip(enc.ids, enc.offsets):
        if i in special_ids and where(a, b) == "in":
            out += plain.encode(text[a:b], add_special_tokens=False).ids
        else:
            out.append(i)
    return out
