"""A plain ASGI middleware (cheaper than Starlette's BaseHTTPMiddleware, and it leaves
streaming responses alone): refuses oversized bodies and adds security headers."""

from __future__ import annotations

import json

__all__ = ["SecurityHeaders", "MAX_BODY_BYTES"]

MAX_BODY_BYTES = 2_000_000
_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
            (b"referrer-policy", b"same-origin")]
_CSP = (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'")


class SecurityHeaders:
    def __init__(self, app, max_body_bytes: int = MAX_BODY_BYTES):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            body = json.dumps({"detail": f"request body over {self.max_body_bytes} bytes"}).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                names = {k.lower() for k, _ in headers}
                headers += [h for h in _HEADERS if h[0] not in names]
                ctype = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                if ctype.startswith(b"text/html") and _CSP[0] not in names:
                    headers.append(_CSP)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
