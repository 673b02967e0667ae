"""The outer guard: API key and body size, before any routing or parsing."""
from __future__ import annotations

import hmac

from iterserve.server.errors import error_response

_GUARDED = ("/v1/", "/tokenize", "/detokenize")  # paths that need the API key, when one is set


class _Guard:
    """Plain ASGI middleware (no per-request task, unlike BaseHTTPMiddleware): checks the API key
    on /v1/ routes in constant time and refuses bodies over max_request_bytes with a 413."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"].startswith(_GUARDED):
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            # the scheme is case-insensitive (RFC 7235): clients send "bearer" too
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.api_key):
                return await error_response(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                            "authentication_error")(scope, receive, send)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            too_big = error_response(413, f"the request body is over {self.max_request_bytes} bytes",
                                     "invalid_request_error")
            try:
                if int(headers.get(b"content-length", b"0")) > self.max_request_bytes:
                    return await too_big(scope, receive, send)
            except ValueError:
                return await error_response(400, "bad Content-Length", "invalid_request_error")(scope, receive, send)
            body = await _read_body(receive, self.max_request_bytes)
            if body is None:
                return await too_big(scope, receive, send)
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes `limit` (chunked bodies carry no Content-Length)."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts)
        size += len(message.get("body", b""))
        if size > limit:
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then the real channel: http.disconnect
    return replay
