"""From an HTTP request to the pipeline's :class:`~edgecache.call.Call`: decode, validate, apply the caller's
cache options (body field ``edgecache`` and the ``X-EdgeCache-*`` headers) and the tenant's plan.

A repeated request is the common case on a cache (that is what a hit is), and its body is byte-for-byte the same:
:class:`ParsedRequests` maps (tenant, route, body) straight to the parsed result, so an exact hit costs a hash of
the body instead of a decode, a validation and the building of a call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NamedTuple

import msgspec

from edgecache.errors import BadRequest, ClientGone, Forbidden, PayloadTooLarge
from edgecache.call import POLICIES, Call
from edgecache.http.request_surface import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
    features_used,
)
from edgecache.settings import Settings
from edgecache.tenants import Tenant


class Parsed(msgspec.Struct, frozen=True, kw_only=True):
    """A validated request: the pipeline's Call plus how to render the answer."""

    call: Call
    model: str
    chat: bool
    stream: bool
    include_usage: bool
    # The request fields the engine must honour beyond plain sampling (checked against the running engine).
    features: frozenset[str] = frozenset()


def parse(chat: bool, body: bytes, tenant: Tenant, settings: Settings) -> Parsed:
    req: ChatCompletionRequest | CompletionRequest
    salt = tenant.id
    if chat:
        req = decode_request(body, ChatCompletionRequest)  # type: ignore[assignment]
        assert isinstance(req, ChatCompletionRequest)
        if len(req.messages) > settings.server.max_messages:
            raise PayloadTooLarge(f"at most {settings.server.max_messages} messages per request")
    else:
        req = decode_request(body, CompletionRequest)  # type: ignore[assignment]
        assert isinstance(req, CompletionRequest)
    generation = req.generation(settings.engine.default_max_tokens, salt)
    if req.cache_salt:
        # A caller's own salt namespaces within its tenant: the tenant always leads the engine's salt.
        generation = msgspec.structs.replace(generation, salt=f"{tenant.id}:{req.cache_salt}")
    options = req.edgecache
    if options is not None and options.ttl is not None and options.ttl > longest_ttl_s(settings):
        raise BadRequest(f"edgecache.ttl is {options.ttl:g} s; the longest this server keeps an answer is "
                         f"{longest_ttl_s(settings):g} s (its longest TTL tier)", param="edgecache.ttl")
    call = Call(request=generation, tenant=tenant.id, tenant_limit=tenant.plan.max_concurrent_misses,
                scenario=(options.scenario if options else None) or "default",
                policy=(options.policy if options else None) or "default",
                ttl_s=options.ttl if options else None, ttl_tier=options.ttl_tier if options else None)
    return Parsed(call=call, model=req.model, chat=chat, stream=req.stream, include_usage=req.include_usage(),
                  features=features_used(generation))


def longest_ttl_s(settings: Settings) -> float:
    """The longest an answer may live here: the longest TTL tier, or a scenario's own TTL if that is longer."""
    tiers = settings.ttl_tiers
    scenario_ttls = [s.ttl_s for s in settings.scenarios.values() if s.ttl_s is not None]
    return max(tiers.realtime_s, tiers.near_realtime_s, tiers.static_s, *scenario_ttls)


async def read_body(receive: Callable[[], Awaitable[Any]], limit: int) -> bytes:
    """The request body from the ASGI messages, refused with a 413 once it grows past ``limit`` bytes.

    litestar's ``Request.body()`` builds a header map to read the content length first, which was a fifth of an
    in-process exact hit; counting the bytes as they come enforces the same limit."""
    message = await receive()
    if message["type"] == "http.request" and not message.get("more_body", False):
        body: bytes = message.get("body", b"")  # the common case: the whole body in one message
    else:
        parts = []
        while message["type"] == "http.request":
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
            if sum(map(len, parts)) > limit:
                break
            message = await receive()
        else:
            raise ClientGone("the client closed the connection while sending its request")
        body = b"".join(parts)
    if len(body) > limit:
        raise PayloadTooLarge(f"the request body is over this server's limit of {limit} bytes")
    return body


class CallHeaders(NamedTuple):
    """The request headers a call depends on."""

    authorization: str | None = None
    scenario: str | None = None
    policy: str | None = None


_HEADER_FIELDS = {b"authorization": 0, b"x-edgecache-scenario": 1, b"x-edgecache-policy": 2}


def read_headers(raw: Iterable[tuple[bytes, bytes]]) -> CallHeaders:
    """One pass over the ASGI scope's raw headers for the three that matter (names arrive lower-cased). Cheaper
    than building a full case-insensitive header map on every request, which showed on the hit path.

    One rule for every route: a header that matters, sent twice, is a 400. Taking the first or the last copy is
    what let two ``Authorization`` headers name different tenants on different routes (each framework layer
    picked its own copy)."""
    found: list[str | None] = [None, None, None]
    for name, value in raw:
        index = _HEADER_FIELDS.get(name)
        if index is not None:
            if found[index] is not None:
                raise BadRequest(f"the {name.decode()} header was sent more than once; send it once",
                                 param=name.decode())
            found[index] = value.decode("latin-1")
    return CallHeaders(*found)


def apply_headers(parsed: Parsed, headers: CallHeaders, tenant: Tenant, settings: Settings) -> Parsed:
    """``X-EdgeCache-Scenario`` and ``X-EdgeCache-Policy`` override the body; then both are checked."""
    scenario, policy = headers.scenario, headers.policy
    call = parsed.call
    if (scenario is not None and scenario != call.scenario) or (policy is not None and policy != call.policy):
        call = msgspec.structs.replace(call, scenario=scenario or call.scenario, policy=policy or call.policy)
        parsed = msgspec.structs.replace(parsed, call=call)
    if call.scenario not in settings.scenarios:
        raise BadRequest(f"unknown scenario {call.scenario!r}; this server has: "
                         f"{', '.join(sorted(settings.scenarios))}", param="edgecache.scenario")
    if call.policy not in POLICIES:
        raise BadRequest(f"unknown cache policy {call.policy!r}; policies: {', '.join(POLICIES)}",
                         param="edgecache.policy")
    if call.policy not in tenant.plan.policies:
        raise Forbidden(f"the {tenant.plan_name!r} plan does not allow the cache policy {call.policy!r}",
                        param="edgecache.policy")
    return parsed


class ParsedRequests:
    """Recently seen (tenant, route, body) -> parsed request, bounded by count.

    Only valid bodies are kept, so an invalid one is re-checked (and refused) every time; bodies over
    ``MAX_BODY_BYTES`` are not kept, so the memo's memory stays bounded.
    """

    MAX_BODY_BYTES = 16_384

    def __init__(self, settings: Settings, max_entries: int = 4096) -> None:
        self.settings = settings
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, bool, bytes], Parsed] = OrderedDict()

    def clear(self) -> None:
        self._entries.clear()

    def parse(self, chat: bool, body: bytes, tenant: Tenant) -> Parsed:
        key = (tenant.id, chat, body)
        parsed = self._entries.get(key)
        if parsed is not None:
            self._entries.move_to_end(key)
            return parsed
        parsed = parse(chat, body, tenant, self.settings)
        if len(body) <= self.MAX_BODY_BYTES:
            self._entries[key] = parsed
            if len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return parsed
