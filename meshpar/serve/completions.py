"""The response side of `meshpar serve`: a completion request's choices, whole or streamed in OpenAI's
shapes (`text_completion`, `chat.completion`, `chat.completion.chunk`; server-sent events ending
with `data: [DONE]`), their `usage`, `logprobs` objects and errors (500: the step failed; 503: a
draining server's deadline cut the request).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

from fastapi.responses import Response, StreamingResponse

from meshpar.serve.guard import APIError

FAILED = ("error", "shutdown", "lost")  # finishes without the request's tokens (`server_error`)


def server_error(message: str, finish: str = "error") -> APIError:
    """The error of a request that ended without its tokens: 503 when a draining server cut it
    (`finish` "shutdown") or a process of a multi-process server was lost ("lost"), else 500 (the
    step that held it failed)."""
    if finish == "shutdown":
        return APIError(503, message, code="server_shutting_down", kind="server_error")
    if finish == "lost":
        return APIError(503, message, code="peer_lost", kind="server_error")
    return APIError(500, f"the step serving this request failed: {message}", kind="server_error")


async def complete(server, http, chat: bool):
    """One completion or chat completion request of `http` -> its response: `n` choices submitted
    together, answered whole or streamed (their events merged as they come), with echo and logprobs
    where asked (module docstring)."""
    # read outside the event loop and this process (meshpar.serve.intake): no body stalls the others
    parsed = await server.intake.parse(await http.body(), chat, http.is_disconnected)
    if parsed is None:  # the client went away while its body was read
        return Response(status_code=499)
    req, opt = parsed
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": server.name,
    }
    # `n` choices: one request each (seed + i), submitted together so that they share one prefill
    reqs = [req] + [
        dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, seed=(req.sampling.seed + i) % (2**31)))
        for i in range(1, opt["n"])
    ]
    opened = server.open(reqs)
    timing = server.metrics.timing()
    streams = [server.events(o, opt["stop"], http.is_disconnected, timing) for o in opened]
    firsts = await asyncio.gather(*(anext(e, None) for e in streams))  # errors before any byte is sent
    if any(f is None for f in firsts):  # the client went away while it waited
        return Response(status_code=499)
    for f in firsts:
        if f[0] == "done" and f[1] in FAILED:
            raise server_error(f[2], f[1])
    n_prompt = len(req.tokens)
    echo = opt["echo_text"] if opt["echo"] else ""

    def usage(n):
        return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}

    def choice(index, text=None, finish=None, role=False, lps=None):
        lp = (
            logprobs_object(server.tok, lps, chat, len(echo))
            if lps is not None and opt["logprobs"] is not None
            else None
        )
        if not chat:
            return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    if opt["stream"]:
        extra = {"usage": None} if opt["include_usage"] else {}

        def chunk(body):
            return f"data: {json.dumps(head | body)}\n\n"

        async def sse():
            total = 0
            for i in range(len(streams)):
                if chat:
                    yield chunk({"choices": [choice(i, "", role=True)], **extra})
                elif echo:
                    yield chunk({"choices": [choice(i, echo)], **extra})
            async for i, ev in merged(streams, firsts, timing):
                if ev[0] == "text":
                    yield chunk({"choices": [choice(i, ev[1], lps=ev[2])], **extra})
                elif ev[1] in FAILED:
                    yield f"data: {json.dumps(server_error(ev[2], ev[1]).body())}\n\n"
                else:
                    total += ev[2]
                    yield chunk({"choices": [choice(i, None if chat else "", ev[1])], **extra})
            if opt["include_usage"]:
                yield chunk({"choices": [], "usage": usage(total)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    texts, lps = [echo] * len(streams), [[] for _ in streams]
    finish, count = ["stop"] * len(streams), [0] * len(streams)
    async for i, ev in merged(streams, firsts, timing):
        if ev[0] == "text":
            texts[i] += ev[1]
            lps[i] += ev[2]
        elif ev[1] in FAILED:
            raise server_error(ev[2], ev[1])
        else:
            finish[i], count[i] = ev[1], ev[2]
    if chat:
        out = [
            {
                "index": i,
                "message": {"role": "assistant", "content": texts[i]},
                "logprobs": logprobs_object(server.tok, lps[i], True) if opt["logprobs"] is not None else None,
                "finish_reason": finish[i],
            }
            for i in range(len(streams))
        ]
        return head | {"object": "chat.completion", "choices": out, "usage": usage(sum(count))}
    return head | {
        "choices": [choice(i, texts[i], finish[i], lps=lps[i]) for i in range(len(streams))],
        "usage": usage(sum(count)),
    }


async def merged(streams: list, firsts: list, timing):
    """(choice index, event) of every choice's stream (each already read up to its first event,
    `firsts`), as they come; at the end, the request's latency (`timing`)."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream, first):
        await q.put((i, first))
        async for ev in stream:
            await q.put((i, ev))
        await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, st, f)) for i, (st, f) in enumerate(zip(streams, firsts))]
    try:
        ended = 0
        while ended < len(tasks):
            i, ev = await q.get()
            if ev is None:
                ended += 1
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        timing.done()


def token_text(tok, t: int) -> tuple[str, list[int]]:
    """A token's text and UTF-8 bytes as OpenAI's logprobs give them: a token that is a piece of a
    character (one byte of a byte-level vocabulary) is written `bytes:\\xe2\\x80`, as OpenAI's
    completions write it, never U+FFFD; its `bytes` are its own."""
    data = tok.token_bytes(t) if hasattr(tok, "token_bytes") else tok.decode([t]).encode()
    try:
        return data.decode("utf-8"), list(data)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data), list(data)


def logprobs_object(tok, entries: list, chat: bool, offset: int = 0) -> dict:
    """OpenAI's `logprobs` object of `entries` [(token, log p, [(id, log p)] most likely first, where
    the token's text begins in the completion's text)]: chat's {"content": [...]}, completions'
    {"tokens", "token_logprobs", "top_logprobs", "text_offset"} (`offset`: the echoed prompt's
    length before the completion's text)."""
    if chat:
        content = []
        for t, lp, top, _ in entries:
            text, data = token_text(tok, t)
            tops = [{"token": token_text(tok, i)[0], "logprob": v, "bytes": token_text(tok, i)[1]} for i, v in top]
            content.append({"token": text, "logprob": lp, "bytes": data, "top_logprobs": tops})
        return {"content": content}
    return {
        "tokens": [token_text(tok, t)[0] for t, *_ in entries],
        "token_logprobs": [lp for _, lp, _, _ in entries],
        "top_logprobs": [{token_text(tok, i)[0]: v for i, v in top} for _, _, top, _ in entries],
        "text_offset": [offset + at for *_, at in entries],
    }
