"""The access log: one line per request, written in batches, and the count of refused requests by reason.

A line says what an operator needs to see a request's fate, and nothing a request carried::

    t=1764730000.123 method=POST route=/v1/chat/completions status=200 served=exact tenant=acme ms=0.41

The route is the matched route's template (``/v1/models/{model_id:str}``), never the path itself: never a key, a
prompt, a query string or a path that matched no route (that is logged as ``route=-``): the log
is read by more people than the tenants trust with their data. The tenant is the one the key resolved to, the
``served`` field the layer that answered (the ``X-EdgeCache`` header), ``-`` when none did.

Lines are batched: a request appends a string to a list, and the list is written as one log record when it holds
``max_batch`` lines or ``flush_interval_s`` after its first line (scripts/bench_access_log.py measures the cost on
the hit path). A refused request (4xx, and 499 when the client left before its answer) also counts in
``edgecache_refused_requests_total{reason}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("edgecache.access")

# Why a request was refused, by the status it got. 499 is nginx's "client closed request": the client left before
# its answer was complete.
REFUSAL_REASONS = {
    400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
    408: "read_timeout", 413: "too_large", 429: "overloaded", 431: "headers_too_large", 499: "client_gone",
    503: "not_ready",
}

TENANT_SCOPE_KEY = "edgecache.tenant"  # set by the handlers once the key resolved to a tenant


class AccessLog:
    """Collects lines and writes them in batches; counts refusals through ``count_refusal``."""

    def __init__(self, *, enabled: bool = True, count_refusal: Callable[[str], None] | None = None,
                 max_batch: int = 256, flush_interval_s: float = 1.0) -> None:
        self.enabled = enabled
        self.count_refusal = count_refusal
        self.max_batch = max_batch
        self.flush_interval_s = flush_interval_s
        self._lines: list[str] = []
        self._timer: asyncio.TimerHandle | None = None

    def record(self, method: str, route: str, status: int, served: str | None, tenant: str | None,
               seconds: float) -> None:
        reason = REFUSAL_REASONS.get(status)
        if reason is not None and self.count_refusal is not None:
            self.count_refusal(reason)
        if not self.enabled:
            return
        # Each line carries its own time: a batch is written as one log record, stamped when it is written.
        self._lines.append(f"t={time.time():.3f} method={method} route={route} status={status} "
                           f"served={served or '-'} tenant={tenant or '-'} ms={seconds * 1000:.2f}")
        if len(self._lines) >= self.max_batch:
            self.flush()
        elif self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(self.flush_interval_s, self.flush)
            except RuntimeError:  # no loop (a protocol callback at shutdown): write now
                self.flush()

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        lines, self._lines = self._lines, []
        if lines:
            log.info("\n".join(lines))


class AccessLogMiddleware:
    """ASGI middleware around the whole app (routing and error rendering included, so 404s and 405s are seen):
    times the request, reads the status and the ``X-EdgeCache`` header off the response, and records one line.
    ``access_log`` gives the app's :class:`AccessLog` (it lives in the app's lifespan, so it is looked up per
    request); None means not serving yet."""

    def __init__(self, app: Any, access_log: Callable[[], AccessLog | None]) -> None:
        self.app = app
        self.access_log = access_log

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status, served = 499, None  # no response started: the client left first
        complete = False

        async def send_and_watch(message: Any) -> None:
            nonlocal status, served, complete
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", ()):
                    if name == b"x-edgecache":
                        served = value.decode("latin-1")
                        break
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            access = self.access_log()
            if access is not None:
                # A stream the client left mid-way started as a 200, but the client did not get its answer.
                handler = scope.get("route_handler")  # litestar's, once a route matched
                route = min(handler.paths) if handler is not None and handler.paths else "-"
                access.record(scope["method"], route, status if complete or status != 200 else 499,
                              served, scope.get(TENANT_SCOPE_KEY), time.perf_counter() - started)
