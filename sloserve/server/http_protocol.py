"""uvicorn's HTTP/1.1 connection protocol (h11) with a deadline on the request headers.

uvicorn times out a connection idle between requests (keep-alive), but a client that sends
its headers a byte at a time (slowloris), or a fresh connection that sends nothing, is never
timed out: every byte cancels the keep-alive timer. Here each request's headers must be
complete within `header_timeout_s` of the connection opening or of the previous response
ending; otherwise the connection is closed. (The body's deadline is http_guards'.)
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout_s = 10.0  # set per server by `with_header_timeout`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        """Wait for the next request's headers (a new cycle) until the deadline."""
        self._disarm()
        self._waiting_from = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def handle_events(self) -> None:
        super().handle_events()
        if self._header_timer is not None and self.cycle is not self._waiting_from:
            self._disarm()  # the headers of a request arrived: the app has it

    def on_response_complete(self) -> None:
        self._arm()  # first: a pipelined request handled in there disarms it again
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers took over %g s",
                             self.header_timeout_s)
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class to give uvicorn.Config(http=...)."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,),
                {"header_timeout_s": float(seconds)})
