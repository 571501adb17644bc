"""ASGI middleware of `hisparse serve`: API-key auth and the request-body guard.

Plain ASGI rather than @app.middleware: Starlette's BaseHTTPMiddleware wraps `receive` so that a handler never
sees its client disconnect (`app.collect` relies on it).
"""

from __future__ import annotations

import asyncio
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, error_response


ADMIN_ROUTES = ("/reset_prefix_cache",)   # outside /v1, and guarded the same way


class ApiKeyAuth:
    """/v1 routes and the admin routes need `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in ADMIN_ROUTES):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(token.encode(), self.key):
                reply = error_response(APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                                code="invalid_api_key", kind="authentication_error"))
                return await reply(scope, receive, send)
        await self.app(scope, receive, send)


class HeaderGuard:
    """Answers 431 to a request whose head (request line and headers) exceeds `max_bytes`: h11 bounds only a
    head that arrives in pieces, and one that arrives whole would otherwise be accepted at any size."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + len(scope["query_string"]) + sum(
                len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.max_bytes:
                reply = error_response(APIError(431, f"request headers are {size:,} bytes; this server accepts at "
                                                     f"most {self.max_bytes:,} (--max-header-bytes)",
                                                code="request_header_fields_too_large"))
                return await reply(scope, receive, send)
        await self.app(scope, receive, send)


class BodyGuard:
    """Reads a request's whole body before the app sees it, within `max_bytes` (else 413, without reading the
    rest when Content-Length says so up front) and `timeout_s` (else 408: a client that stops sending cannot hold
    a handler, or a graceful shutdown, forever). The app then gets the body in one message; later `receive` calls
    (disconnect detection) go to the client's connection."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    def too_large(self, size: str) -> APIError:
        return APIError(413, f"request body is {size} bytes; this server accepts at most {self.max_bytes:,} "
                             "(--max-request-bytes)", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await error_response(APIError(400, "invalid Content-Length header"))(scope, receive, send)
            if int(declared) > self.max_bytes:
                return await error_response(self.too_large(f"{int(declared):,}"))(scope, receive, send)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_bytes:
                        return await error_response(self.too_large(f"more than {self.max_bytes:,}"))(
                            scope, receive, send)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await error_response(APIError(408, f"request body not received within {self.timeout_s:g} s",
                                                 code="request_timeout"))(scope, receive, send)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
