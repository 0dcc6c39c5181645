"""What the server does about its clients' connections: a client that goes away at any point of its request
cancels it (``ClientWatch``), and a client that sends its request too slowly is cut off (``ReadTimeoutH11``).

**Going away.** A request's work must stop when its client does, wherever the request is: tokenising, waiting
for a row, prefilling or decoding (vLLM's ``with_cancellation`` does the same). A ``ClientWatch`` waits on the
connection's ASGI ``receive`` from the moment the request's body was read: once the body is read, uvicorn
answers ``receive`` only with ``http.disconnect``, when the connection closes (or when the response is complete,
after which the watch is stopped). So a disconnect is seen at once, not at the request's first token.

**Slow senders** (slowloris: headers or a body sent a byte at a time hold a connection, and its memory, forever):
uvicorn has a keep-alive timeout between requests but no limit on reading one. ``ReadTimeoutH11`` is uvicorn's h11
protocol with two more: the request line and headers must arrive within ``header_timeout_s`` of the connection
opening (or of the first byte of a later request on it), and the body within ``body_timeout_s`` of the headers'
end (as Apache's ``RequestReadTimeout header=.. body=..``, nginx's ``client_header_timeout``). A connection past
either is answered 408 (when nothing of a response was sent yet) and closed by a lingering close: the write side
first (the 408 and a FIN), then the socket after ``LINGER_S`` or when the client closes, what the client still sends
meanwhile read and dropped. Closing at once with unread bytes of the trickle in the socket makes the kernel send a
reset, and a reset can reach the client before it has read the 408 (nginx's ``lingering_close`` for the same
reason). Once a request is read, its response may take as long as the generation does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ringshm.server.connection")
HEADER_TIMEOUT_S = 10.0  # request line + headers, from the connection (or the request's first byte)
BODY_TIMEOUT_S = 30.0  # the whole body, from the end of the headers (2 MiB at 70 KB/s)
LINGER_S = 2.0  # how long a timed-out connection is read and drained after its 408 (nginx: lingering_timeout 5 s)


class ClientWatch:
    """Calls its callbacks once, when the request's client disconnects (module docstring).

    Start it after the body was read (FastAPI has parsed the request model); ``stop()`` once the response is
    complete, or the end of the response would read as a disconnect."""

    def __init__(self, receive):
        self.gone = False
        self._callbacks: list[Callable[[], None]] = []
        self._task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        self.gone = True
        for cb in self._callbacks:
            try:
                cb()
            except Exception:  # noqa: BLE001 - one callback must not stop the others
                log.exception("a disconnect callback failed")

    def on_gone(self, cb: Callable[[], None]) -> None:
        """Call ``cb`` when the client goes away (at once if it already has)."""
        if self.gone:
            cb()
        else:
            self._callbacks.append(cb)

    def stop(self) -> None:
        self._task.cancel()


class ReadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol with a header and a body read timeout (module docstring). The limits come from the
    class attributes, set per server by ``read_timeout_protocol``."""

    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_phase: str | None = None
        self._read_timer: asyncio.TimerHandle | None = None
        self._lingering: asyncio.TimerHandle | None = None
        self._track_read()

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:  # timed out and answered: what still arrives is drained
            return
        super().data_received(data)
        self._track_read()

    def connection_lost(self, exc) -> None:
        self._set_read_timer(None)
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track_read()

    def _track_read(self) -> None:
        """Arm the deadline of the phase the request is in: "header" while its line and headers are awaited
        (on a new connection, or once a byte of the next request arrived: between requests uvicorn's keep-alive
        timeout applies), "body" while its body is, none once it is read."""
        state = self.conn.their_state
        if state is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
            phase = "header"
        elif state is h11.SEND_BODY:
            phase = "body"
        else:
            phase = None
        if phase != self._read_phase:
            self._read_phase = phase
            self._set_read_timer(phase)

    def _set_read_timer(self, phase: str | None) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        if phase is not None:
            limit = self.header_timeout_s if phase == "header" else self.body_timeout_s
            self._read_timer = self.loop.call_later(limit, self._read_timed_out, phase, limit)

    def _read_timed_out(self, phase: str, limit: float) -> None:
        if self._read_phase != phase or self.transport.is_closing():
            return
        log.info("closing a connection whose request %s took over %g s to arrive", phase, limit)
        if phase == "header" or not self.cycle.response_started:  # the app has not answered this request
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        if phase == "body":  # the app waits in receive() for the rest of the body: it reads a disconnect
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()  # the 408 and a FIN; reading goes on, dropped, until the client closes
        self.flow.resume_reading()  # uvicorn may have paused it (a body over its high-water mark)
        self._lingering = self.loop.call_later(LINGER_S, self.transport.close)


def read_timeout_protocol(header_timeout_s: float, body_timeout_s: float) -> type[ReadTimeoutH11]:
    """A ``ReadTimeoutH11`` class with these limits (uvicorn's ``Config(http=...)`` takes a class).

    Raises:
        ValueError: a limit that is not > 0.
    """
    for name, value in (("header_timeout_s", header_timeout_s), ("body_timeout_s", body_timeout_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    return type("ReadTimeoutH11", (ReadTimeoutH11,), {"header_timeout_s": float(header_timeout_s),
                                                      "body_timeout_s": float(body_timeout_s)})
