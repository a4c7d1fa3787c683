"""The OpenAI-compatible HTTP API (`meshpar serve`): FastAPI routes over a `Scheduler` whose
thread keeps decoding while requests come and go. A body's fields are read by
`meshpar.serve.fields`, the choices answered by `meshpar.serve.completions`.

    POST /v1/completions        {"model", "prompt": text | [ids], "max_tokens", "temperature", "top_p",
                                 "top_k" (extension), "stop", "seed", "n", "stream", "logprobs": k <= 5,
                                 "echo", "logit_bias", "presence_penalty", "frequency_penalty"}
    POST /v1/chat/completions   {"model", "messages": [{"role", "content": text or text parts}], ... the
                                 same, but "max_completion_tokens", "logprobs": bool and "top_logprobs":
                                 k <= 20, no "echo"}
    GET  /v1/models             the one model served;  GET /health
    GET  /metrics               Prometheus's text format (`meshpar.serve.metrics`); open, as /health is

Responses and stream chunks follow OpenAI's shapes (`text_completion`, `chat.completion`,
`chat.completion.chunk`; server-sent events `data: {...}` ending with `data: [DONE]`), with `usage`
counts (in a stream: a last chunk when `stream_options.include_usage`). finish_reason: `stop` (an
end token or a stop string), `length` (max_tokens, or the KV cache full). Errors are
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad body (malformed JSON, text that is
not valid Unicode, a field of the wrong type or out of range, more than serve.max_messages messages,
`n` beyond the slots and queue, a prompt and max_tokens beyond the cache), 401 without a valid API
key (`--api-key`, `MESHPAR_API_KEY`; `/health` stays open), 404 for an unknown model, 408 for
headers or a body that did not arrive in time (serve.header_timeout_s, serve.body_timeout_s), 413
for a body over serve.max_body_bytes (refused before it is read whole), 415 for a body that is not
`application/json` (so a web page cannot post to a local server without a CORS preflight), 429
with Retry-After when serve.max_waiting requests already wait (or a client holds
serve.max_connections_per_client connections), 503 for a request still running when a draining
server's serve.drain_timeout_s passed (a stream ends with it) and for every request once a process
of a multi-process server is lost. Bodies are read in worker processes (`meshpar.serve.intake`), the
work they may cost bounded before it is done (`meshpar.serve.fields`). A client that goes away frees
its slot at the next tick. Temperature defaults to 1, as OpenAI's does (0 is greedy). `n` choices
are submitted together and share one prefill (each sibling recomputes the prompt's last position
only, with seed + i); logprobs are the model's own (log_softmax of its logits, before bias,
penalties and temperature); logit_bias and the penalties act inside the compiled sampling step
(`meshpar.serve.sampling`). What is not implemented gets 400 naming the field: `response_format`
other than text, `tools`, `functions`, `tool_choice`, `best_of` > 1, `echo` with `logprobs`,
`suffix`, and chat's `echo`.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from meshpar.core.errors import ConfigError
from meshpar.runtime import distributed, peers
from meshpar.serve import completions as completions_lib
from meshpar.serve.connections import policed
from meshpar.serve.detokenizer import Detokenizer
from meshpar.serve.drain import Drain
from meshpar.serve.engine import Engine
from meshpar.serve.failures import Unavailable
from meshpar.serve.fields import Fields, Limits
from meshpar.serve.guard import APIError, Guard, api_keys, exposed
from meshpar.serve.intake import Intake
from meshpar.serve.metrics import Observed, ServeMetrics
from meshpar.serve.multihost import Replicas
from meshpar.serve.requests import Request
from meshpar.serve.scheduler import QueueFull, Scheduler

FINISH = {"eos": "stop", "max_tokens": "length", "cache_full": "length", "cancelled": "stop"}


class Server:
    """The routes' state: the scheduler (running on its own thread), the request parser (`intake`), the
    tokenizer, the served name; `guard`: the app's `Guard` once `create_app` made it (a drain tells it
    its deadline)."""

    guard: Guard | None = None

    def __init__(self, engine, serve_cfg, tokenizer, name: str, eos: list[int], replicas=None):
        self.engine, self.tok, self.name, self.eos = engine, tokenizer, name, eos
        limits = Limits(
            engine.vocab,
            engine.length,
            name,
            tuple(eos),
            engine.slots,
            serve_cfg.max_waiting,
            serve_cfg.max_new_tokens,
            serve_cfg.max_messages,
            serve_cfg.allow_special_tokens_in_content,
        )
        # request bodies are read in worker processes (meshpar.serve.intake), queued as requests are
        self.intake = Intake(Fields(limits, tokenizer), serve_cfg.parse_workers, serve_cfg.max_waiting + engine.slots)
        self.scheduler = Scheduler.for_config(engine, serve_cfg, bounded=True, replicas=replicas)
        self.metrics = ServeMetrics(self.scheduler, engine)
        self.created = int(time.time())

    # -- running one request ------------------------------------------------------------------------
    def open(self, reqs: list[Request]) -> list:
        """Submit `reqs` together -> per request (ticket, the queue its tokens and end arrive on, in
        this event loop); 429 when the queue has no room for all, 400 for what the engine refuses."""
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in reqs]

        def post(q, item):  # from the scheduler's thread; a closed loop (shutting down) drops it
            if not loop.is_closed():
                loop.call_soon_threadsafe(q.put_nowait, item)

        try:
            tickets = self.scheduler.submit_all(
                [
                    (r, lambda t, q=q: post(q, ("tok", t)), lambda c, q=q: post(q, ("done", c)))
                    for r, q in zip(reqs, queues)
                ]
            )
        except Unavailable as e:
            raise APIError(
                503, f"this server is stopping: a process of it was lost ({e})", code="peer_lost", kind="server_error"
            ) from None
        except QueueFull as e:
            raise APIError(
                429,
                f"the server is busy ({e}); retry shortly",
                code="rate_limit_exceeded",
                kind="rate_limit_error",
                headers={"Retry-After": "1"},
            ) from None
        except ConfigError as e:
            raise APIError(400, str(e)) from None
        return list(zip(tickets, queues))

    def peer_lost(self, what: str) -> None:
        """The peer watchdog's verdict (`meshpar.runtime.peers.on_peer_lost`, before it exits the
        process): every request still open is answered 503, and given up to 2 s to be written."""
        self.scheduler.lose(what)
        deadline = time.monotonic() + 2.0
        while self.metrics.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)

    async def events(self, opened, stop: list[str], disconnected, timing):
        """The request `opened` (`open`): yield ("text", delta, log probabilities of the tokens whose
        text is now sent, each with where its text begins) as text becomes final, and one ("done",
        finish, tokens) (finish "error": the tick that ran it failed, "shutdown": a draining server's
        deadline cut it, "lost": a process of the server was lost; then the error's message in place
        of tokens). The tokens of a stop string cut from the text have no log probabilities, as
        OpenAI's. Returns early when the client has gone. `timing`: its request's `RequestTiming`."""
        ticket, q = opened
        req = ticket.request
        text, checked = Detokenizer(self.tok, req.tokens, self.eos, stop), time.monotonic()
        m, last, pending = self.metrics, None, []
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(q.get(), 0.25)
                except TimeoutError:
                    kind = None
                if time.monotonic() - checked > 0.25:  # tokens may flow faster than the timeout: look anyway
                    checked = time.monotonic()
                    if await disconnected():
                        return
                if kind == "done":
                    if value.finish in completions_lib.FAILED:
                        yield "done", value.finish, value.error
                        return
                    break
                if kind == "tok":
                    now = time.perf_counter()
                    timing.token(now, len(req.tokens))
                    if last is not None:
                        m.itl.observe(now - last)
                    last = now
                    m.generation_tokens.inc()
                    index, at = len(text.tokens), len(text.all)  # where this token's text begins
                    delta, stopped = text.add(value)
                    if req.logprobs is not None and value not in self.eos:
                        pending.append((value, *ticket.completion.logprobs[index], at))
                    sent = [e for e in pending if e[3] < len(text.sent)]  # their text is out: never cut now
                    if delta or sent:
                        yield "text", delta, sent
                        pending = pending[len(sent) :]
                    if stopped:
                        self.scheduler.cancel(ticket)
                        break
            delta = text.flush()
            end = len(text.all) if text.stopped else float("inf")  # a stop string's tokens lie past its cut
            rest = [e for e in pending if e[3] < end]
            if delta or rest:
                yield "text", delta, rest
            yield "done", "stop" if text.stopped else FINISH.get(value.finish, "stop"), len(text.tokens)
        finally:
            self.scheduler.cancel(ticket)  # a no-op once finished; frees a vanished client's slot


def create_app(
    server: Server,
    keys: list[str] = (),
    max_body: int = 4 * 2**20,
    cors_origins: list[str] = (),
    openapi: bool = False,
    body_timeout_s: float = 60.0,
):
    """The ASGI application of `server`: its FastAPI routes (the schema at /openapi.json with `openapi`)
    behind `Guard` (API keys, body type, size and deadline), behind CORS for `cors_origins` (none: a
    browser page of another origin may not read the answers; its preflights pass before the key check)."""
    app = guard = Guard(_routes(server, openapi), list(keys), max_body, body_timeout_s)
    if server is not None:  # (None: the routes alone, for their schema)
        server.guard = guard
        app = Observed(app, server.metrics)
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app = CORSMiddleware(
            app,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
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
    async def http_error(request, e: HTTPException):  # no such route (404), method (405), ...
        what = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return JSONResponse(
            APIError(e.status_code, what, code="not_found" if e.status_code == 404 else None).body(),
            status_code=e.status_code,
        )

    @app.get("/health")
    async def health():
        sched = server.scheduler
        if sched.lost:  # a process of the server is gone: it answers every request 503 until it exits
            return JSONResponse({"status": "peer_lost", "error": sched.lost}, status_code=503)
        return {
            "status": "ok",
            "waiting": len(sched.waiting) + len(sched.inbox),
            "active": len(sched.active),
            "decode_steps": sched.decode_steps,
            "prefill_calls": sched.prefill_calls,
            "errors": sched.errors,
            "compilations": sum(server.engine.traces.values()),
        }  # a new (rows, bucket) shape compiles once

    @app.get("/metrics")
    async def metrics():
        body, content_type = server.metrics.exposition()
        return Response(body, media_type=content_type)

    def card():
        return {"id": server.name, "object": "model", "created": server.created, "owned_by": "meshpar"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != server.name:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves '{server.name}'",
                "model",
                "model_not_found",
            )
        return card()

    async def complete(http: HTTPRequest, chat: bool):
        return await completions_lib.complete(server, http, chat)

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

    from meshpar.io.hf import end_tokens  # local: safetensors loads only for a run that reads or writes one
    from meshpar.io.tokenizer import ByteTokenizer, HFTokenizer  # local: the tokenizers library loads only for text

    leader = jax.process_index() == 0  # `sock`: process 0's listening socket (`listen`), None elsewhere
    tok = HFTokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None  # on every process: fails alike
    engine = Engine(cfg, info=lambda m: print(m, file=sys.stderr))
    replicas = Replicas() if jax.process_count() > 1 else None
    peers.stopping = "stops serving. Relaunch the same command to serve again"
    if not leader:  # another process of the server: tick with process 0 until it says stop
        for sig in (signal.SIGTERM, signal.SIGINT):  # process 0 drains, then says stop
            signal.signal(sig, lambda signum, frame: None)
        engine.warmup()
        with peers.coordinator_loss_exits():  # process 0's death: one line and status 3, not JAX's abort
            Scheduler.for_config(engine, cfg.serve, replicas=replicas).follow()
        return
    for note in engine.notes:
        print(note, file=sys.stderr)
    if tok is not None and tok.vocab_size > engine.vocab:
        raise ConfigError(
            f"data.tokenizer has {tok.vocab_size} tokens, more than the model's vocabulary {engine.vocab}"
        )
    tok = tok or ByteTokenizer(max(256, engine.vocab))
    source = cfg.checkpoint.dir or (cfg.model.init_from or "")[3:]
    name = model_name or (Path(source).name if source else cfg.model.name)
    server = Server(engine, cfg.serve, tok, name, end_tokens(tok, cfg.model.init_from), replicas)
    peers.on_peer_lost.append(server.peer_lost)  # the open requests answered 503 before the exit (3)
    engine.warmup()
    stop = threading.Event()
    worker = threading.Thread(target=server.scheduler.serve, args=(stop,), name="meshpar-scheduler", daemon=True)
    worker.start()
    procs = f" in {jax.process_count()} processes" if replicas is not None else ""
    print(
        f"serving {name} ({engine.source}) on http://{host}:{sock.getsockname()[1]} with {engine.mesh.devices.size} "
        f"devices{procs} ({cfg.serve.strategy}, {engine.slots} slots, cache {engine.length}, prefill batch "
        f"{server.scheduler.prefill_batch}, prefix cache {cfg.serve.prefix_cache})",
        file=sys.stderr,
        flush=True,
    )
    keys = api_keys(keys)
    warning = exposed(host, keys)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    s = cfg.serve
    config = uvicorn.Config(
        create_app(server, keys, s.max_body_bytes, s.cors_origins, s.openapi, s.body_timeout_s),
        log_level="warning",
        http=policed(s.header_timeout_s, s.max_connections_per_client),  # headers' deadline, connections per client
        # past the drain's deadline (and its 503s written), uvicorn ends what still holds a connection
        timeout_graceful_shutdown=None if s.drain_timeout_s is None else s.drain_timeout_s + 2.0,
    )
    # uvicorn drains on SIGTERM and SIGINT, then raises them again under the handlers it found: make those
    # no-ops, so the scheduler stops in order (and tells the other processes) before the exit: 0 for
    # SIGTERM, 130 for SIGINT (Preempted, as a shell expects of Ctrl-C)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    drain = Drain(server.scheduler, s.drain_timeout_s, server.guard)
    try:
        drain.server(config).run(sockets=[sock])
    finally:
        drain.done()
        server.intake.close()
        stop.set()  # the scheduler finishes what it took, then (other processes) says stop
        worker.join()
    if drain.cut:
        print(
            f"serve.drain_timeout_s={cfg.serve.drain_timeout_s:g} passed: {drain.cut} requests in flight were cut "
            "(answered 503)",
            file=sys.stderr,
        )
    p = server.scheduler.prefix
    print(
        f"stopped: {server.scheduler.decode_steps} decode steps, {server.scheduler.prefill_calls} prefill calls"
        + (f", prefix cache {p.hits} hits / {p.misses} misses" if p is not None else ""),
        file=sys.stderr,
    )
    if drain.signal == signal.SIGINT:
        raise distributed.Preempted(signal.SIGINT, "interrupted: drained and stopped")


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
        raise ConfigError(
            f"--host {host} --port {port}: cannot listen there ({e.strerror}); choose another port (0: any free one)"
        ) from None
    sock.listen(1024)
    return sock
