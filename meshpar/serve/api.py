"""The OpenAI-compatible HTTP API (`meshpar serve`): FastAPI routes over a `Scheduler` whose
thread keeps decoding while requests come and go.

    POST /v1/completions        {"model", "prompt": text | [ids], "max_tokens", "temperature", "top_p",
                                 "top_k" (extension), "stop", "seed", "n": 1, "stream"}
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], ... the same}
    GET  /v1/models             the one model served;  GET /health

Responses and stream chunks follow OpenAI's shapes (`text_completion`, `chat.completion`,
`chat.completion.chunk`; server-sent events `data: {...}` ending with `data: [DONE]`), with `usage`
counts (in a stream: a last chunk when `stream_options.include_usage`). finish_reason: `stop` (an
end token or a stop string), `length` (max_tokens, or the KV cache full). Errors are
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad body (malformed JSON, text that is
not valid Unicode, a field of the wrong type or out of range, a prompt and max_tokens beyond the
cache), 401 without a valid API key (`--api-key`, `MESHPAR_API_KEY`; `/health` stays open), 404 for
an unknown model, 413 for a body over serve.max_body_bytes (refused before it is read whole), 415 for
a body that is not `application/json` (so a web page cannot post to a local server without a CORS
preflight), 429 with Retry-After when serve.max_waiting requests already wait. Prompts are tokenized
off the event loop, and a text longer than the cache could hold at the tokenizer's most characters
per token is refused before it is. A client that goes away frees its slot at the next tick.
Temperature defaults to 1, as OpenAI's does (0 is greedy).
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from meshpar.core.errors import ConfigError
from meshpar.serve.batching import Request
from meshpar.serve.guard import APIError, Guard, api_keys, exposed, invalid_text
from meshpar.serve.sampling import Sampling
from meshpar.serve.scheduler import QueueFull, Scheduler

ROLES = ("system", "developer", "user", "assistant", "tool")     # OpenAI's message roles
FINISH = {"eos": "stop", "max_tokens": "length", "cache_full": "length", "cancelled": "stop"}


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


class Server:
    """The routes' state: the scheduler (running on its own thread), the tokenizer, the served name."""

    def __init__(self, engine, serve_cfg, tokenizer, name: str, eos: list[int], replicas=None):
        self.engine, self.tok, self.name, self.eos = engine, tokenizer, name, eos
        self.default_tokens = serve_cfg.max_new_tokens
        self.special_in_content = serve_cfg.allow_special_tokens_in_content
        self.scheduler = Scheduler.for_config(engine, serve_cfg, bounded=True, replicas=replicas)
        self.created = int(time.time())

    # -- a request body -> Request -------------------------------------------------------------------
    def parse(self, body: Any, chat: bool) -> tuple[Request, dict]:
        """-> (Request, options {stream, stop, include_usage}); APIError naming the field at fault."""
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        bad = invalid_text(body)
        if bad:
            raise APIError(400, f"the request body holds text that is not valid Unicode at '{bad}' (a lone "
                                "surrogate such as \\ud800); send UTF-8 text", bad.split(".")[0].split("[")[0])
        model = _field(body, "model", (str,))
        if model is None:
            raise APIError(400, "'model' is required", "model")
        if model != self.name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.name}'", "model",
                           "model_not_found")
        _field(body, "n", (int,), 1, lambda v: v == 1, "must be 1 (one choice per request)")
        if body.get("echo") or body.get("logprobs") or body.get("best_of", 1) not in (1, None):
            raise APIError(400, "echo, logprobs and best_of are not supported", "logprobs")
        tokens = self._prompt(body, chat)
        room = self.engine.length - len(tokens) + 1            # the last token is never written to the cache
        if room < 1:
            raise APIError(400, f"the prompt has {len(tokens)} tokens; this server's context (serve.cache_length) "
                                f"holds {self.engine.length}", "messages" if chat else "prompt", "context_length_exceeded")
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        n = _field(body, key, (int,), None, lambda v: v >= 1, "must be >= 1")
        if n is not None and n > room:
            raise APIError(400, f"'{key}'={n} with a prompt of {len(tokens)} tokens exceeds this server's context of "
                                f"{self.engine.length} tokens (serve.cache_length): at most {room}", key,
                           "context_length_exceeded")
        temp = _field(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "must be between 0 and 2")
        top_p = _field(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "must be in (0, 1]")
        top_k = _field(body, "top_k", (int,), None, lambda v: v == -1 or 1 <= v <= self.engine.vocab,
                       f"must be -1 (off) or between 1 and the vocabulary {self.engine.vocab}")
        seed = _field(body, "seed", (int,), None)
        seed = secrets.randbits(31) if seed is None else seed      # unseeded: a fresh draw per request, as OpenAI
        stop = _field(body, "stop", (str, list), [])
        stop = [stop] if isinstance(stop, str) else stop
        if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, "'stop' must be a string or a list of up to 4 non-empty strings", "stop")
        stream = _field(body, "stream", (bool,), False)
        if body.get("stream_options") is not None and not stream:
            raise APIError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
        usage = bool((_field(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
        samp = Sampling(float(temp), None if top_k in (None, -1) else top_k, float(top_p), seed % (2 ** 31))
        req = Request(tokens, n or min(self.default_tokens, room), samp, eos=self.eos)
        return req, {"stream": stream, "stop": stop, "include_usage": usage}

    def _prompt(self, body: dict, chat: bool) -> list[int]:
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs):
                raise APIError(400, "'messages' must be a non-empty list of {\"role\": str, \"content\": str}",
                               "messages")
            role = next((m["role"] for m in msgs if m["role"] not in ROLES), None)
            if role is not None:
                raise APIError(400, f"unknown message role '{role[:40]}': use one of {', '.join(ROLES)}", "messages")
            if not hasattr(self.tok, "chat"):
                raise APIError(400, "this server has no chat template (serve a model with data.tokenizer=DIR whose "
                                    "tokenizer_config.json has one); use /v1/completions", "messages")
            self._fits(sum(len(m["content"]) for m in msgs), "messages")
            try:
                return self.tok.chat([{"role": m["role"], "content": m["content"]} for m in msgs],
                                     split_special=not self.special_in_content)
            except Exception as e:  # noqa: BLE001 - a template's own error (ConfigError) or its Python's
                raise APIError(400, str(e).splitlines()[0] if str(e) else type(e).__name__, "messages") from None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                                        # a batch of one
        if isinstance(prompt, str) and prompt:
            self._fits(len(prompt), "prompt")
            return self.tok.prompt(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not all(0 <= t < self.engine.vocab for t in prompt):
                raise APIError(400, f"'prompt' token ids must be in 0..{self.engine.vocab - 1}", "prompt")
            return list(prompt)
        raise APIError(400, "'prompt' must be a non-empty string or list of token ids (one prompt per request)",
                       "prompt")

    def _fits(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text longer than the cache could hold even at the tokenizer's
        most characters per token (twice that: a normalizer may drop characters)."""
        most = 2 * self.engine.length * getattr(self.tok, "max_chars_per_token", 1)
        if chars > most:
            raise APIError(400, f"the {param} has {chars} characters, more than this server's context of "
                                f"{self.engine.length} tokens (serve.cache_length) can hold", param,
                           "context_length_exceeded")

    # -- running one request ------------------------------------------------------------------------
    async def events(self, req: Request, stop: list[str], disconnected):
        """Submit `req`; yield ("text", delta) as text becomes final and one ("done", finish, tokens)
        (finish "error": the tick that ran it failed). Returns early when the client has gone."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def post(item):          # from the scheduler's thread; a closed loop (shutting down) drops it
            if not loop.is_closed():
                loop.call_soon_threadsafe(q.put_nowait, item)
        try:
            ticket = self.scheduler.submit(req, lambda t: post(("tok", t)), lambda c: post(("done", c)))
        except QueueFull as e:
            raise APIError(429, f"the server is busy ({e}); retry shortly", code="rate_limit_exceeded",
                           kind="rate_limit_error", headers={"Retry-After": "1"}) from None
        except ConfigError as e:
            raise APIError(400, str(e)) from None
        text, checked = Detokenizer(self.tok, req.tokens, self.eos, stop), time.monotonic()
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(q.get(), 0.25)
                except asyncio.TimeoutError:
                    kind = None
                if time.monotonic() - checked > 0.25:      # tokens may flow faster than the timeout: look anyway
                    checked = time.monotonic()
                    if await disconnected():
                        return
                if kind == "done":
                    if value.finish == "error":
                        yield "done", "error", value.error
                        return
                    break
                if kind == "tok":
                    delta, stopped = text.add(value)
                    if delta:
                        yield "text", delta
                    if stopped:
                        self.scheduler.cancel(ticket)
                        break
            delta = text.flush()
            if delta:
                yield "text", delta
            yield "done", "stop" if text.stopped else FINISH.get(value.finish, "stop"), len(text.tokens)
        finally:
            self.scheduler.cancel(ticket)                      # a no-op once finished; frees a vanished client's slot


class Detokenizer:
    """A completion's text as its tokens come, in O(1) decoding work per token (vLLM's incremental
    detokenizer): each new token is decoded with the few tokens before it (so a leading space, or a
    character split over tokens, decodes as in the whole text), and text grows only once a character
    is whole. End tokens are left out; the text is cut at the first stop string; text that a stop
    string may still change is held back until it cannot."""

    def __init__(self, tok, prompt, eos, stop: list[str]):
        self.tok, self.eos, self.stop = tok, set(eos), stop
        self.window = [int(t) for t in prompt[-4:]]    # tokens decoded together: [0, read) already text
        self.read = len(self.window)
        self.hold = max((len(x) - 1 for x in stop), default=0)
        self.tokens, self.all, self.sent, self.searched, self.stopped = [], "", "", 0, False

    def _grow(self, final: bool) -> None:
        """Append the text of the tokens past `read`, decoded after those before it; a character still
        unfinished waits (unless final, or 16 tokens wait: far more than a character has bytes)."""
        before = self.tok.decode(self.window[:self.read])
        now = self.tok.decode(self.window)
        if len(now) > len(before) and (final or not now.endswith("\ufffd") or len(self.window) - self.read > 16):
            self.all += now[len(before):] if now.startswith(before) else self.tok.decode(self.window[self.read:])
            # the tokens just read become the context: they end on a character boundary
            self.window = self.window[self.read:]
            self.read = len(self.window)

    def _ready(self, final: bool) -> str:
        """The text that can be sent: cut at a stop string (searched from where it could begin)."""
        hits = [i for i in (self.all.find(x, max(0, self.searched - self.hold - 1)) for x in self.stop) if i >= 0]
        self.searched = len(self.all)
        if hits:
            self.stopped = True
            self.all = self.all[:min(hits)]
            return self.all
        return self.all if final else self.all[:max(0, len(self.all) - self.hold)]

    def _delta(self, ready: str) -> str:
        if len(ready) <= len(self.sent) or not ready.startswith(self.sent):
            return ""
        delta, self.sent = ready[len(self.sent):], ready
        return delta

    def add(self, token: int) -> tuple[str, bool]:
        """-> (text now final, whether a stop string ended the completion)."""
        self.tokens.append(int(token))
        if self.stopped or int(token) in self.eos:
            return "", self.stopped
        self.window.append(int(token))
        self._grow(final=False)
        return self._delta(self._ready(final=False)), self.stopped

    def flush(self) -> str:
        """The rest, once the completion has ended."""
        if not self.stopped:
            self._grow(final=True)
        return self._delta(self._ready(final=True))


def create_app(server: Server, keys: list[str] = (), max_body: int = 4 * 2**20, cors_origins: list[str] = (),
               openapi: bool = False):
    """The ASGI application of `server`: its FastAPI routes (the schema at /openapi.json with `openapi`)
    behind `Guard` (API keys, body type and size), behind CORS for `cors_origins` (none: a browser
    page of another origin may not read the answers; its preflights pass before the key check)."""
    app = Guard(_routes(server, openapi), list(keys), max_body)
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware
        app = CORSMiddleware(app, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                             allow_headers=["Authorization", "Content-Type"])
    return app


def _routes(server: Server, openapi: bool = False):
    """The FastAPI application of `server`."""
    from fastapi.responses import Response
    from starlette.exceptions import HTTPException

    app = FastAPI(title="meshpar", docs_url=None, redoc_url=None, openapi_url="/openapi.json" if openapi else None)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):      # no such route (404), method (405), ...
        what = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return JSONResponse(APIError(e.status_code, what, code="not_found" if e.status_code == 404 else None).body(),
                            status_code=e.status_code)

    @app.get("/health")
    async def health():
        sched = server.scheduler
        return {"status": "ok", "waiting": len(sched.waiting) + len(sched.inbox), "active": len(sched.active),
                "decode_steps": sched.decode_steps, "errors": sched.errors,
                "compilations": sum(server.engine.traces.values())}     # a new (rows, bucket) shape compiles once

    def card():
        return {"id": server.name, "object": "model", "created": server.created, "owned_by": "meshpar"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != server.name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{server.name}'", "model",
                           "model_not_found")
        return card()

    async def body_of(http: HTTPRequest):
        raw = await http.body()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise APIError(400, f"the request body is not valid JSON ({str(e).splitlines()[0]})") from None

    def server_error(message: str) -> APIError:
        return APIError(500, f"the step serving this request failed: {message}", kind="server_error")

    async def complete(http: HTTPRequest, chat: bool):
        # off the event loop: a long prompt's tokenizing never stalls the other clients or /health
        req, opt = await asyncio.to_thread(server.parse, await body_of(http), chat)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": server.name}
        events = server.events(req, opt["stop"], http.is_disconnected)
        try:
            first = await events.__anext__()             # errors (429, 400) before any byte is sent
        except StopAsyncIteration:                       # the client went away while it waited
            return Response(status_code=499)
        if first[0] == "done" and first[1] == "error":
            raise server_error(first[2])
        n_prompt = len(req.tokens)

        def usage(n):
            return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}

        def choice(text=None, finish=None, role=False):
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        async def all_events():
            yield first
            async for ev in events:
                yield ev

        if opt["stream"]:
            extra = {"usage": None} if opt["include_usage"] else {}

            def chunk(body):
                return f"data: {json.dumps(head | body)}\n\n"

            async def sse():
                if chat:
                    yield chunk({"choices": [choice("", role=True)], **extra})
                async for ev in all_events():
                    if ev[0] == "text":
                        yield chunk({"choices": [choice(ev[1])], **extra})
                    elif ev[1] == "error":
                        yield f"data: {json.dumps(server_error(ev[2]).body())}\n\n"
                    else:
                        yield chunk({"choices": [choice(None if chat else "", ev[1])], **extra})
                        if opt["include_usage"]:
                            yield chunk({"choices": [], "usage": usage(ev[2])})
                yield "data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, finish, n = "", "stop", 0
        async for ev in all_events():
            if ev[0] == "text":
                text += ev[1]
            elif ev[1] == "error":
                raise server_error(ev[2])
            else:
                finish, n = ev[1], ev[2]
        if chat:
            out = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": finish}
            return head | {"object": "chat.completion", "choices": [out], "usage": usage(n)}
        return head | {"choices": [choice(text, finish)], "usage": usage(n)}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await complete(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await complete(http, chat=True)

    return app


def serve_http(cfg, host: str, sock, model_name: str | None = None, keys: list[str] | None = None) -> None:
    """`meshpar serve` on `sock` (`listen`): the engine, its scheduler on a thread, uvicorn on the main
    one until SIGTERM or Ctrl-C (then: no new connections, the requests in flight finish, return). A
    process > 0 of a multi-process server ticks with process 0 instead (`meshpar.serve.multihost`)."""
    import signal
    import sys
    import threading
    from pathlib import Path

    import jax
    import uvicorn

    from meshpar.io.hf import end_tokens
    from meshpar.io.tokenizer import ByteTokenizer, HFTokenizer
    from meshpar.serve.engine import Engine
    from meshpar.serve.multihost import Replicas
    leader = jax.process_index() == 0       # `sock`: process 0's listening socket (`listen`), None elsewhere
    tok = HFTokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None    # on every process: fails alike
    engine = Engine(cfg, info=lambda m: print(m, file=sys.stderr))
    replicas = Replicas() if jax.process_count() > 1 else None
    if not leader:           # another process of the server: tick with process 0 until it says stop
        for sig in (signal.SIGTERM, signal.SIGINT):                        # process 0 drains, then says stop
            signal.signal(sig, lambda signum, frame: None)
        engine.warmup()
        Scheduler.for_config(engine, cfg.serve, replicas=replicas).follow()
        return
    for note in engine.notes:
        print(note, file=sys.stderr)
    if tok is not None and tok.vocab_size > engine.vocab:
        raise ConfigError(f"data.tokenizer has {tok.vocab_size} tokens, more than the model's vocabulary {engine.vocab}")
    tok = tok or ByteTokenizer(max(256, engine.vocab))
    source = cfg.checkpoint.dir or (cfg.model.init_from or "")[3:]
    name = model_name or (Path(source).name if source else cfg.model.name)
    server = Server(engine, cfg.serve, tok, name, end_tokens(tok, cfg.model.init_from), replicas)
    engine.warmup()
    stop = threading.Event()
    worker = threading.Thread(target=server.scheduler.serve, args=(stop,), name="meshpar-scheduler", daemon=True)
    worker.start()
    procs = f" in {jax.process_count()} processes" if replicas is not None else ""
    print(f"serving {name} ({engine.source}) on http://{host}:{sock.getsockname()[1]} with {engine.mesh.devices.size} "
          f"devices{procs} ({cfg.serve.strategy}, {engine.slots} slots, cache {engine.length}, prefill batch "
          f"{server.scheduler.prefill_batch}, prefix cache {cfg.serve.prefix_cache})", file=sys.stderr, flush=True)
    keys = api_keys(keys)
    warning = exposed(host, keys)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    config = uvicorn.Config(create_app(server, keys, cfg.serve.max_body_bytes, cfg.serve.cors_origins,
                                       cfg.serve.openapi), log_level="warning", timeout_graceful_shutdown=None)
    # uvicorn drains on SIGTERM, then raises it again under the handler it found: make that one a no-op,
    # so a drained server exits 0 (Ctrl-C still ends with 130, through interrupts_exit's handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        stop.set()                       # the scheduler finishes what it took, then (other processes) says stop
        worker.join()
    p = server.scheduler.prefix
    print(f"stopped: {server.scheduler.decode_steps} decode steps, {server.scheduler.prefill_calls} prefill calls"
          + (f", prefix cache {p.hits} hits / {p.misses} misses" if p is not None else ""), file=sys.stderr)


def listen(host: str, port: int):
    """A socket listening on host:port (0: any free port), or one line saying why not."""
    import socket
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is out of range: use 1..65535 (0: any free one)")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); "
                          "choose another port (0: any free one)") from None
    sock.listen(1024)
    return sock
