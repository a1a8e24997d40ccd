"""The HTTP server under the app: uvicorn's httptools protocol with the limits it lacks, and one uvicorn config.

uvicorn bounds neither a request's head nor how slowly it may arrive: a 100 MB header was buffered whole, and a
client that sends half its headers (or half its body) and waits held a connection open for ever (slow loris).
:class:`LimitedHttpProtocol` adds both:

- a request head (request line plus headers) over ``server.max_header_bytes`` gets 431 and the connection closes,
  counted as the bytes arrive, so an oversized head is refused before it is buffered;
- a connection that goes ``server.read_timeout_s`` without completing its head, or between two parts of its body,
  gets 408 and closes (a silent new connection too). Idle keep-alive connections close after
  ``server.keep_alive_s`` (uvicorn's own timer);
- a request whose head and body are not whole ``server.request_deadline_s`` after its first byte gets 408 and the
  connection closes, however steadily it trickles (a byte every few seconds resets no deadline).

Both refusals happen below the ASGI app, so they are reported to ``on_refused`` (the runtime's refusal counter and
access log). :func:`uvicorn_config` is the one road from settings to a uvicorn ``Config``: ``edgecache serve``
and the tests use it. :class:`EdgeCacheServer` runs it as ``edgecache serve`` does.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import sys
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from edgecache.settings import Settings

Refused = Callable[[int, str], None]  # (status, method or "-")

LINGER_S = 2.0  # how long a refused connection's late bytes are read and dropped before it closes
_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large"}


class LimitedHttpProtocol(HttpToolsProtocol):
    """httptools' protocol with a head-size limit and read timeouts. Subclassed per server by
    :func:`limited_protocol`, which sets the three class attributes."""

    max_head_bytes: int = 64 * 2**10
    read_timeout_s: float = 30.0
    request_deadline_s: float = 30.0
    on_refused: Refused | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True
        self._head_bytes = 0
        self._tail = b""
        self._read_timer: asyncio.TimerHandle | None = None
        self._deadline: asyncio.TimerHandle | None = None  # armed from a request's first byte to its last
        self._discarding = False  # refused: whatever else arrives is dropped until the connection closes

    # --- the read timer: armed while the server waits for a part of a request --------------------------------

    def _arm_read_timer(self) -> None:
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        self._refuse(408, "the request did not arrive in time")

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _deadline_passed(self) -> None:
        self._deadline = None
        self._refuse(408, f"the request was not whole within {self.request_deadline_s:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` if no response has started, and close the connection either way."""
        self._cancel_read_timer()
        self._cancel_deadline()
        if self.transport.is_closing() or self._discarding:
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            body = message.encode()
            self.transport.write(b"".join([
                f"HTTP/1.1 {status} {_REASONS[status]}\r\n".encode(),
                b"content-type: text/plain; charset=utf-8\r\n",
                b"content-length: " + str(len(body)).encode() + b"\r\n",
                b"connection: close\r\n\r\n", body]))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app, if it is waiting for the body, sees the client gone
            cycle.message_event.set()
        # A lingering close: closing with unread bytes in the socket sends a reset that can destroy the answer
        # before the client reads it. So end our side (the client sees the answer, then end of stream), discard
        # what it still sends, and close for good a moment later.
        self._discarding = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)
        if self.on_refused is not None:
            method = self.scope.get("method", "-") if self.scope is not None else "-"
            self.on_refused(status, method)

    # --- protocol events ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_timer()  # a connection that never sends a byte is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        if self._reading_head:
            # Count only the head's bytes: a chunk may carry the end of the head and the start of the body.
            seen = self._tail + data
            end = seen.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._tail))
            if self._head_bytes > self.max_head_bytes:
                self._refuse(431, f"the request head is over {self.max_head_bytes} bytes")
                return
            self._tail = seen[-3:]
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_read_timer()
        self._cancel_deadline()
        self._deadline = self.loop.call_later(self.request_deadline_s, self._deadline_passed)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        super().on_headers_complete()
        self._arm_read_timer()  # for the body; on_message_complete disarms it

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._arm_read_timer()

    def on_message_complete(self) -> None:
        self._cancel_read_timer()
        self._cancel_deadline()
        # Whatever arrives next on this connection is the next request's head (pipelined, or after the response;
        # idle time in between is the keep-alive timer's).
        self._reading_head, self._head_bytes, self._tail = True, 0, b""
        super().on_message_complete()


def limited_protocol(settings: Settings, on_refused: Refused | None = None) -> type[LimitedHttpProtocol]:
    """A protocol class carrying this server's limits (uvicorn builds one instance per connection)."""
    return type("EdgeCacheHttpProtocol", (LimitedHttpProtocol,), {
        "max_head_bytes": int(settings.server.max_header_bytes),
        "read_timeout_s": settings.server.read_timeout_s,
        "request_deadline_s": settings.server.request_deadline_s,
        "on_refused": staticmethod(on_refused) if on_refused is not None else None,
    })


def uvicorn_config(app: Any, settings: Settings, *, on_refused: Refused | None = None, **overrides: Any
                   ) -> uvicorn.Config:
    """The uvicorn config of an EdgeCache server: the limited protocol, uvloop where there is one, no uvicorn
    access log (ours is :mod:`edgecache.http.access_log`), lifespan on. ``on_refused`` defaults to the app's runtime
    (its refusal counter and access log), looked up when a refusal happens."""
    if on_refused is None:
        on_refused = _runtime_refusals(app)
    options: dict[str, Any] = {
        "host": settings.server.host, "port": settings.server.port,
        "loop": "uvloop" if sys.platform != "win32" else "asyncio",
        "http": limited_protocol(settings, on_refused), "log_level": settings.server.log_level, "access_log": False,
        "lifespan": "on", "timeout_keep_alive": settings.server.keep_alive_s}
    options.update(overrides)
    return uvicorn.Config(app, **options)


def _runtime_refusals(app: Any) -> Refused:
    def refused(status: int, method: str) -> None:
        front = getattr(getattr(app, "state", None), "front", None)
        if front is not None:
            front.access_log.record(method, "-", status, None, None, 0.0)

    return refused


class EdgeCacheServer(uvicorn.Server):
    """uvicorn's server, with the heap that start-up built frozen out of the garbage collector's passes.

    What start-up builds (modules, the app, the engine's and the embedder's Python objects: ~80k objects with the
    semantic layer off) lives as long as the process, yet every full collection walked it again. Relaying 64
    streams, a full pass took 52-79 ms, and every stream stalled for it (``gc.callbacks``); with the start-up heap
    frozen (``gc.freeze()``, after one collection so that start-up's own garbage is not kept) a pass took ~15 ms.
    What the server makes while it runs is collected as before. Only a process that is one server does this: an app
    built inside another program (a test) leaves that program's heap alone.
    """

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            gc.collect()
            gc.freeze()
