"""What an HTTP request to `meshpar serve` must pass before the routes (`meshpar.serve.api`) see it:
an API key on `/v1/*`, a JSON content type, a body within `serve.max_body_bytes` that arrives
within `serve.body_timeout_s` of its headers (and, once a draining server's deadline has passed,
not at all), text that is valid Unicode; and `APIError`, the refusals' shape (OpenAI's `{"error":
{"message", "type", "param", "code"}}`). As vLLM's `--api-key`: keys from the command line and
`MESHPAR_API_KEY`, compared in constant time; `/health` stays open.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time


class APIError(Exception):
    """An HTTP error in OpenAI's body shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.headers = status, param, code, kind, headers

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def api_keys(given: list[str] | None, env=os.environ) -> list[str]:
    """The keys a client may send (`--api-key`, repeatable, and `MESHPAR_API_KEY`, comma-separated), as
    vLLM's `--api-key`; none: the API is open."""
    keys = list(given or []) + [k for k in env.get("MESHPAR_API_KEY", "").split(",")]
    return list(dict.fromkeys(k.strip() for k in keys if k.strip()))


def exposed(host: str, keys: list[str]) -> str | None:
    """One warning line when the server listens beyond loopback without an API key, else None."""
    if keys or host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
        return None
    return (
        f"warning: serving on {host} without an API key: anyone who can reach this address can use the "
        "model; give --api-key KEY (or MESHPAR_API_KEY=KEY)"
    )


def invalid_text(value, where: str = "") -> str | None:
    """The path of the first string in a JSON value that is not valid Unicode (a lone surrogate from a
    `\\ud800` escape), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "the body"
    elif isinstance(value, dict):
        for k, v in value.items():
            bad = invalid_text(k, where or "a key") if isinstance(k, str) else None
            bad = bad or invalid_text(v, f"{where}.{k}" if where else str(k))
            if bad:
                return bad
    elif isinstance(value, list):
        for i, v in enumerate(value):
            bad = invalid_text(v, f"{where}[{i}]")
            if bad:
                return bad
    return None


class Guard:
    """ASGI middleware in front of the routes: the API key of `/v1/*` (compared in constant time), then
    a POST's content type and size, before the body reaches JSON parsing. A body is read only up to
    `max_body` bytes: a larger one is refused (413) without being read whole; one still arriving
    `body_timeout_s` after its headers gets 408, and after a draining server's deadline (`drain`) 503."""

    def __init__(self, app, keys: list[str], max_body: int, body_timeout_s: float = 60.0):
        self.app, self.keys, self.max_body, self.body_timeout_s = (
            app,
            [k.encode() for k in keys],
            max_body,
            body_timeout_s,
        )
        self.drain_at: float | None = None  # time.monotonic() from which a body still arriving is refused
        self.drain_why = ""

    def drain(self, at: float, why: str) -> None:
        """A draining server's deadline (time.monotonic()): bodies still arriving then get 503 `why`."""
        self.drain_at, self.drain_why = at, why

    @staticmethod
    async def refuse(send, e: APIError) -> None:
        body = json.dumps(e.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if e.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if e.status in (408, 503):  # the body was not read whole: the connection cannot carry another request
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def authorized(self, headers: dict) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        ok = False
        for key in self.keys:  # every key compared, in constant time
            ok |= hmac.compare_digest(token.strip(), key)
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.keys and scope["path"].startswith("/v1") and not self.authorized(headers):
            return await self.refuse(
                send,
                APIError(
                    401,
                    "a valid API key is required: send the header 'Authorization: Bearer KEY'",
                    code="invalid_api_key",
                ),
            )
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if kind != b"application/json":
            return await self.refuse(
                send,
                APIError(
                    415,
                    f"the request body must be 'application/json', got '{kind.decode('latin-1') or 'no content type'}'",
                ),
            )
        too_big = APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_body} bytes (serve.max_body_bytes)",
            code="request_too_large",
        )
        length = headers.get(b"content-length", b"0").strip() or b"0"
        if not length.isdigit():
            return await self.refuse(
                send, APIError(400, f"the Content-Length header is not a number: '{length[:20].decode('latin-1')}'")
            )
        if int(length) > self.max_body:
            return await self.refuse(send, too_big)
        chunks, size, more = [], 0, True
        deadline = time.monotonic() + self.body_timeout_s
        while more:  # chunked bodies: read up to the limit, then replay
            message = await self._next(receive, deadline)
            if isinstance(message, APIError):
                return await self.refuse(send, message)
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body:
                return await self.refuse(send, too_big)
        body, sent = b"".join(chunks), []

        async def replay():
            if not sent:
                sent.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the client's disconnect, as the app expects

        return await self.app(scope, replay, send)

    async def _next(self, receive, deadline: float):
        """The body's next message, or the APIError of a deadline passed first (its own: 408; a
        draining server's: 503), waited for in slices so that a drain begun meanwhile is seen."""
        while True:
            now = time.monotonic()
            if self.drain_at is not None and now >= self.drain_at:
                return APIError(503, self.drain_why, code="server_shutting_down", kind="server_error")
            if now >= deadline:
                return APIError(
                    408,
                    f"the request's body did not arrive within serve.body_timeout_s={self.body_timeout_s:g} seconds "
                    "of its headers",
                    code="request_timeout",
                )
            try:
                return await asyncio.wait_for(receive(), min(deadline - now, 0.25))
            except TimeoutError:
                continue
