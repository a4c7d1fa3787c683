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


def server_error(message: str, finish: str = "error") -> APIError:
    """The error of a request that ended without its tokens: 503 when a draining server cut it
    (`finish` "shutdown"), else 500 (the step that held it failed)."""
    if finish == "shutdown":
        return APIError(503, message, code="server_shutting_down", kind="server_error")
    return APIError(500, f"the step serving this request failed: {message}", kind="server_error")


async def complete(server, http, chat: bool, body_of):
    """One completion or chat completion request of `http` -> its response: `n` choices submitted
    together, answered whole or streamed (their events merged as they come), with echo and logprobs
    where asked (module docstring)."""
    # off the event loop: a long prompt's tokenizing never stalls the other clients or /health
    req, opt = await asyncio.to_thread(server.parse, await body_of(http), chat)
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
    streams = [server.events(o, opt["stop"], http.is_disconnected) for o in opened]
    firsts = await asyncio.gather(*(anext(e, None) for e in streams))  # errors before any byte is sent
    if any(f is None for f in firsts):  # the client went away while it waited
        return Response(status_code=499)
    for f in firsts:
        if f[0] == "done" and f[1] in ("error", "shutdown"):
            raise server_error(f[2], f[1])
    n_prompt = len(req.tokens)
    echo = opt["echo_text"] if opt["echo"] else ""

    def usage(n):
        return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}

    def choice(index, text=None, finish=None, role=False, lps=None, offset=0):
        lp = logprobs_object(server.tok, lps, chat, offset) if lps is not None and opt["logprobs"] is not None else None
        if not chat:
            return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    async def merged():
        """(choice index, event) of every choice's stream, as they come."""
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

    if opt["stream"]:
        extra = {"usage": None} if opt["include_usage"] else {}

        def chunk(body):
            return f"data: {json.dumps(head | body)}\n\n"

        async def sse():
            sent, total = [len(echo)] * len(streams), 0
            for i in range(len(streams)):
                if chat:
                    yield chunk({"choices": [choice(i, "", role=True)], **extra})
                elif echo:
                    yield chunk({"choices": [choice(i, echo)], **extra})
            async for i, ev in merged():
                if ev[0] == "text":
                    yield chunk({"choices": [choice(i, ev[1], lps=ev[2], offset=sent[i])], **extra})
                    sent[i] += len(ev[1])
                elif ev[1] in ("error", "shutdown"):
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
    async for i, ev in merged():
        if ev[0] == "text":
            texts[i] += ev[1]
            lps[i] += ev[2]
        elif ev[1] in ("error", "shutdown"):
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
        "choices": [choice(i, texts[i], finish[i], lps=lps[i], offset=len(echo)) for i in range(len(streams))],
        "usage": usage(sum(count)),
    }


def logprobs_object(tok, entries: list, chat: bool, offset: int = 0) -> dict:
    """OpenAI's `logprobs` object of `entries` [(token, log p, [(id, log p)] most likely first)]:
    chat's {"content": [...]}, completions' {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    (`offset`: where the first token's text starts in the choice's text)."""

    def piece(t):
        return tok.decode([t])

    if chat:
        return {
            "content": [
                {
                    "token": piece(t),
                    "logprob": lp,
                    "bytes": list(piece(t).encode()),
                    "top_logprobs": [
                        {"token": piece(i), "logprob": v, "bytes": list(piece(i).encode())} for i, v in top
                    ],
                }
                for t, lp, top in entries
            ]
        }
    offsets, at = [], offset
    for t, _, _ in entries:
        offsets.append(at)
        at += len(piece(t))
    return {
        "tokens": [piece(t) for t, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [{piece(i): v for i, v in top} for _, _, top in entries],
        "text_offset": offsets,
    }
