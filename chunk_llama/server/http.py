"""uvicorn's settings for the server, with a request-read timeout uvicorn lacks.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`), but a client that opens
a connection and sends its request head, or its body, a byte at a time holds it forever (a
slowloris client). `ReadTimeoutH11Protocol` gives each request `header_timeout` seconds from
the moment the server starts waiting for it (the connection opened, or the previous response
ended) to arrive whole, head and body; past that the connection is closed. The handler of a
request whose body stopped half way sees a disconnect. A request being served is not timed
here: its deadline is the engine's (`--request-timeout`).
"""

from __future__ import annotations

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class ReadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request does not arrive in time."""

    header_timeout: float = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._waits = 0
        self._arm_read_timeout()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_read_timeout()

    def _arm_read_timeout(self) -> None:
        self._waits += 1
        self.loop.call_later(self.header_timeout, self._read_timed_out, self._waits)

    def _read_timed_out(self, wait: int) -> None:
        # Only the latest wait counts, and only while the request is still coming in: its head
        # (IDLE, or headers half sent) or its body (SEND_BODY).
        if wait != self._waits or self.transport.is_closing():
            return
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self.logger.info("closing a connection whose request did not arrive in %g s", self.header_timeout)
            self.transport.close()  # connection_lost tells a handler waiting for the body


def uvicorn_config(app, *, host: str, port: int, header_timeout: float, keep_alive_timeout: float,
                   log_level: str = "info", **kwargs) -> uvicorn.Config:
    """A `uvicorn.Config` for `app` with the read timeout above and the keep-alive timeout;
    `kwargs` go to `uvicorn.Config`."""
    protocol = type("ReadTimeoutH11Protocol", (ReadTimeoutH11Protocol,), {"header_timeout": header_timeout})
    return uvicorn.Config(app, host=host, port=port, http=protocol, timeout_keep_alive=keep_alive_timeout,
                          log_level=log_level, **kwargs)
