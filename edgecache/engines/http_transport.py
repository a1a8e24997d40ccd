"""The upstream engine's HTTP/1.1 transport: httpx's interface over asyncio, parsed by llhttp (``httptools``), with a
streamed body read in batches.

Why not httpx's own transport: it parses HTTP in pure Python (httpcore + h11) and hands over one event per HTTP
chunk, and an SSE server writes one chunk per token, so relaying a fast upstream cost most of the relay's CPU in
the parser (profiled: ~60 %). aiohttp's C parser halved that, but its stream reader still costs a callback, a
flow-control call and a buffer step per chunk. Here a socket read is parsed in C, and while a body streams the
socket is read at most once per ``batch_s``: the kernel gathers the tokens of that time into one read, so the
relay's cost per token is its own line handling. A stream's first bytes are never held back (the pause starts
after a read), so time to first token is unchanged.

It is a plain :class:`httpx.AsyncBaseTransport` (the engine keeps httpx's client, its timeouts and its errors, and
tests still inject ``httpx.MockTransport``): HTTP/1.1 only, ``http`` and ``https``, keep-alive connections kept per
origin, no proxy (the engine uses httpx's own transport when the environment names a proxy for the upstream).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any

import httptools
import httpx

# A streamed body's bytes that may wait for the reader before the socket stops being read (flow control).
_HIGH_WATER = 1 << 20


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection, one response at a time; httptools calls the ``on_*`` methods while it parses."""

    def __init__(self, loop: asyncio.AbstractEventLoop, window: Callable[[], float]) -> None:
        self._loop = loop
        self._window = window
        self._transport: asyncio.Transport | None = None
        self.closed = False
        self._paused = False          # the socket is not being read
        self._batch_pending = False   # a batch is gathering in the kernel (timer set)
        self._watchdog: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False         # any byte of this response
        self.body: list[bytes] = []
        self.buffered = 0
        self.error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._held = False            # the buffer is full: no reading until the reader takes it
        self._last_read = self._loop.time()
        self._read_timeout: float | None = None
        # Set while a body its reader left is read to its end (and dropped): who gets the connection then.
        self._on_end: Callable[[_Connection], None] | None = None
        self._grace: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        self._last_read = self._loop.time()
        before = self.buffered
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed HTTP response: {exc}"))
            return
        if self._on_end is not None:
            if self.complete:
                self._ended()
            return
        # The batch starts with a read that brought body bytes, so the head never delays the first token.
        if self.buffered > before and not self.complete:
            self._held = self.buffered > _HIGH_WATER
            if not self._batch_pending:
                window = self._window()
                if window > 0:
                    self._batch_pending = True
                    self._loop.call_later(window, self._batch_over)
            self._update_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._on_end = None
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._grace is not None:
            self._grace.cancel()
        if self.headers_done and not self.complete and not self._chunked_or_sized():
            self.complete = True  # a body delimited by the connection's close
        elif not self.complete:
            self.error = self.error or httpx.ReadError(
                "the upstream closed the connection" + (f": {exc}" if exc else ""))
        self._wake()

    # -- httptools callbacks

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if self._on_end is not None:
            return
        self.body.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()

    # -- used by the transport

    @property
    def usable(self) -> bool:
        """Open as far as anyone can tell: the upstream may have closed it without the protocol hearing yet
        (``connection_lost`` comes a turn after the transport starts closing)."""
        return not self.closed and self._transport is not None and not self._transport.is_closing()

    def send(self, head: bytes, body: bytes) -> None:
        """Write the request; ``httpx.WriteError`` when the connection is closed already (uvloop refuses the
        write of a transport the upstream closed before the protocol heard of it)."""
        assert self._transport is not None
        self._last_read = self._loop.time()  # the read timeout counts from the request
        try:
            self._transport.writelines((head, body))
        except RuntimeError as exc:
            self.close()
            raise httpx.WriteError(f"the connection to the upstream is closed: {exc}") from exc

    async def wait(self, read_timeout: float | None) -> None:
        """Until something new (bytes, the end, an error); ``ReadTimeout`` when the upstream is silent too long."""
        if self.error is not None:
            raise self.error
        self._waiter = self._loop.create_future()
        self._read_timeout = read_timeout
        if read_timeout is not None and self._watchdog is None:
            self._watchdog = self._loop.call_at(self._last_read + read_timeout, self._watch)
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def take(self) -> bytes:
        """The body bytes parsed so far (and reading again if a full buffer had stopped it)."""
        data = b"".join(self.body) if len(self.body) != 1 else self.body[0]
        self.body.clear()
        self.buffered = 0
        if self._held:
            self._held = False
            self._update_reading()
        return data

    def reuse(self) -> None:
        """Ready for the next request on the same connection."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self._reset()
        self._update_reading()

    def read_to_end(self, grace_s: float, then: Callable[[_Connection], None]) -> None:
        """The reader left before the response's end: read on at once (no batch), dropping the body, and hand the
        connection to ``then`` when the response completes; close it if that takes longer than ``grace_s``."""
        self.body.clear()
        self.buffered = 0
        self._held = self._batch_pending = False
        self._on_end = then
        self._grace = self._loop.call_later(grace_s, self.close)
        self._update_reading()

    def _ended(self) -> None:
        then, self._on_end = self._on_end, None
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        if then is not None:
            then(self)

    def close(self) -> None:
        self.closed = True
        self._on_end = None
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        if self._transport is not None:
            self._transport.close()

    # -- internals

    def _chunked_or_sized(self) -> bool:
        return any(n.lower() in (b"content-length", b"transfer-encoding") for n, _ in self.headers)

    def _update_reading(self) -> None:
        """Read the socket unless a batch is gathering or the buffer is full."""
        if self._transport is None or self.closed:
            return
        pause = self._held or (self._batch_pending and self.headers_done and not self.complete)
        if pause and not self._paused:
            self._transport.pause_reading()
        elif not pause and self._paused:
            self._transport.resume_reading()
        self._paused = pause

    def _batch_over(self) -> None:
        self._batch_pending = False
        self._update_reading()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _watch(self) -> None:
        self._watchdog = None
        if self.closed or self._waiter is None or self._read_timeout is None:
            return
        due = self._last_read + self._read_timeout
        if self._loop.time() >= due:
            self._fail(httpx.ReadTimeout(f"no data from the upstream for {self._read_timeout:g} s"))
        else:
            self._watchdog = self._loop.call_at(due, self._watch)

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self.close()
        self._wake()


class _Body(httpx.AsyncByteStream):
    """A response's body as it arrives: each step is every byte parsed since the last one."""

    def __init__(self, transport: BatchingTransport, origin: tuple[str, str, int], conn: _Connection,
                 read_timeout: float | None) -> None:
        self._transport = transport
        self._origin = origin
        self._conn = conn
        self._read_timeout = read_timeout
        self._streaming = not conn.complete
        if self._streaming:
            transport._streaming += 1

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            if conn.body:
                yield conn.take()
            if conn.complete:
                break
            await conn.wait(self._read_timeout)
        if conn.body:
            yield conn.take()

    async def aclose(self) -> None:
        conn = self._conn
        if self._streaming:
            self._streaming = False
            self._transport._streaming -= 1
        if conn.complete:
            self._transport._release(self._origin, conn)
        elif conn.headers_done and conn.usable:
            # Left before the end. Often only the end is missing: an SSE reader stops at its last event
            # ("data: [DONE]"), and the chunked body's terminator comes a moment later. Reading that on keeps the
            # connection for the next request (a new one per request cost both sides a connect and, over https, a
            # handshake). A reader that left a long answer early costs the upstream at most the grace's work,
            # then the connection is closed, which stops it.
            conn.read_to_end(self._transport.end_grace_s, lambda done: self._transport._release(self._origin, done))
        else:
            conn.close()  # no answer yet: closing the connection stops the upstream's work


class BatchingTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over asyncio with httptools, streamed bodies read in batches (see the module).

    A streamed body is read at most once per ``batch_s``, and with many bodies streaming at once, at most
    ``reads_per_s`` times a second in all (each body's window widens, up to ``max_batch_s``): the relay's cost is per
    read, and with many streams each one's tokens come slower, so a fixed window would read about a token at a time
    just when the process is busiest. 64 streams read every 16 ms, that is 60 times a second: smoother than a reader
    can follow.
    """

    def __init__(self, *, batch_s: float, reads_per_s: float = 4000.0, max_batch_s: float = 0.05,
                 max_idle: int = 100, end_grace_s: float = 0.25, ssl_context: ssl.SSLContext | None = None) -> None:
        self._batch_s = batch_s
        self.end_grace_s = end_grace_s  # how long a body its reader left is read on for the connection's sake
        self._reads_per_s = reads_per_s
        self._max_batch_s = max_batch_s
        self._max_idle = max_idle
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._closed = False
        self._streaming = 0  # bodies being read now

    def window(self) -> float:
        """How long a streamed body's socket rests after a read."""
        if self._batch_s <= 0:
            return 0.0
        return min(self._max_batch_s, max(self._batch_s, self._streaming / self._reads_per_s))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {url.scheme!r}", request=request)
        origin = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        body = await request.aread()
        head = b"%s %s HTTP/1.1\r\n%s\r\n" % (
            request.method.encode(), url.raw_path,
            b"".join(b"%s: %s\r\n" % (name, value) for name, value in request.headers.raw))
        for attempt in (0, 1):
            conn = self._idle_connection(origin)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(origin, timeouts.get("connect"), request)
            try:
                conn.send(head, body)
                while not conn.headers_done:
                    await conn.wait(timeouts.get("read"))
            except (httpx.ReadError, httpx.WriteError):
                # A kept-alive connection the upstream had closed before our request reached it (nothing was
                # read back): the request was never seen, so it goes once more, on a new connection.
                if reused and not conn.received and attempt == 0:
                    continue
                raise
            except httpx.TransportError as exc:
                exc.request = request
                raise
            except BaseException:
                conn.close()  # cancelled before the answer's head: closing it stops the upstream's work
                raise
            break
        extensions = {"http_version": b"HTTP/1.1", "reason_phrase": conn.reason}
        return httpx.Response(conn.status, headers=conn.headers, extensions=extensions,
                              stream=_Body(self, origin, conn, timeouts.get("read")))

    async def _connect(self, origin: tuple[str, str, int], timeout: float | None,
                       request: httpx.Request) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            tls = self._ssl = self._ssl or ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop, self.window), host, port, ssl=tls,
                                       server_hostname=host if tls else None), timeout)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out", request=request) from exc
        except OSError as exc:
            raise httpx.ConnectError(f"{host}:{port}: {exc.strerror or exc}", request=request) from exc
        return conn

    def _idle_connection(self, origin: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.usable:
                return conn
            conn.close()
        return None

    def _release(self, origin: tuple[str, str, int], conn: _Connection) -> None:
        """A connection whose response is complete: kept for the next request when it can be."""
        idle = self._idle.setdefault(origin, [])
        if not conn.keep_alive or conn.closed or self._closed or len(idle) >= self._max_idle:
            conn.close()
            return
        conn.reuse()
        idle.append(conn)

    async def aclose(self) -> None:
        self._closed = True  # a body still read on (see _Body.aclose) closes its connection when it ends
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
