"""What only the HTTP front holds for one running server: response ids and what each response was (for the
callers' feedback), the memo of parsed request bodies, the renderings of stored answers, the access log, the system
prompts ``/admin/warmup`` has prefilled, and the Responses API's stored responses.

The runtime (:mod:`edgecache.runtime`) holds the layers and knows nothing of HTTP; the app factory builds one
:class:`Front` beside it, puts it on ``app.state.front``, and has the runtime call :meth:`Front.after_flush` when
the caches are flushed (here or by another node of a fleet).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from edgecache.http.access_log import AccessLog
from edgecache.http.calls import ParsedRequests
from edgecache.http.feedback import ResponseLedger
from edgecache.http.openai_api import IdSource
from edgecache.http.replies import Renderings
from edgecache.http.responses_api import ResponsesApi
from edgecache.settings import Settings
from edgecache.warmup import Prefilled

if TYPE_CHECKING:
    from edgecache.fleet import Fleet


class Front:
    """The front's own state; ``count_refusal`` counts a refused request by its reason (the runtime's metric);
    ``fleet`` (a node of one) keeps the stored responses in the fleet's Redis."""

    def __init__(self, settings: Settings, count_refusal: Callable[[str], None], fleet: Fleet | None = None) -> None:
        self.ids = IdSource()
        self.ledger = ResponseLedger(settings.data_path / "feedback" / "responses.msgpack",
                                     max_entries=settings.server.feedback_responses)  # for POST /v1/feedback
        self.parsed = ParsedRequests(settings)
        self.renderings = Renderings()  # stored answers rendered once per writer shape, for hits
        self.access_log = AccessLog(enabled=settings.server.access_log, count_refusal=count_refusal)
        self.warm_prefilled: Prefilled = set()  # system prompts /admin/warmup has prefilled (see edgecache.warmup)
        self.responses = ResponsesApi(settings, self.parsed, fleet)

    def after_flush(self, tenant: str | None, scenario: str | None) -> None:
        """Entries were dropped: forget the parsed bodies and the answers' renderings, and (everything flushed, the
        engine's prefix cache with it) which system prompts were prefilled."""
        self.parsed.clear()
        self.renderings.clear()
        self.ledger.drop(tenant)
        if tenant is None and scenario is None:
            self.warm_prefilled.clear()

    async def close(self) -> None:
        self.access_log.flush()
        try:
            await self.responses.close()
        finally:
            self.ledger.save()
