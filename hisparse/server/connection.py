"""uvicorn's h11 connection with a header read timeout.

uvicorn waits for a new connection's request headers indefinitely, so a client that opens a connection and sends
nothing (or half a request line) holds it for ever. This protocol closes a connection that has no request in
progress `header_timeout_s` after it opened or after its last response (the body has its own timeout in
`middleware.BodyGuard`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutH11(H11Protocol):
    header_timeout_s = 30.0

    @classmethod
    def with_timeout(cls, seconds: float) -> type["HeaderTimeoutH11"]:
        """This protocol with a header read timeout of `seconds` (uvicorn.Config(http=...) takes a class)."""
        return type(cls.__name__, (cls,), {"header_timeout_s": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        self.loop.call_later(self.header_timeout_s, self._headers_overdue)

    def _headers_overdue(self, *_: Any) -> None:
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return     # closed already, or a request is in progress
        self.transport.close()
