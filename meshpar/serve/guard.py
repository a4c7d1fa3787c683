"""What an HTTP request to `meshpar serve` must pass before the routes (`meshpar.serve.api`) see it:
an API key on `/v1/*`, a JSON content type, a body within `serve.max_body_bytes`, text that is valid
Unicode; and `APIError`, the refusals' shape (OpenAI's `{"error": {"message", "type", "param",
"code"}}`). As vLLM's `--api-key`: keys from the command line and `MESHPAR_API_KEY`, compared in
constant time; `/health` stays open.
"""

from __future__ import annotations

import hmac
import json
import os


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
    `max_body` bytes: a larger one is refused (413) without being read whole."""

    def __init__(self, app, keys: list[str], max_body: int):
        self.app, self.keys, self.max_body = app, [k.encode() for k in keys], max_body

    @staticmethod
    async def refuse(send, e: APIError) -> None:
        body = json.dumps(e.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if e.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
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
        while more:  # chunked bodies: read up to the limit, then replay
            message = await receive()
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
