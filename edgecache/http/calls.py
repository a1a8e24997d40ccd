"""From an HTTP request to the pipeline's :class:`~edgecache.call.Call`: decode, validate, apply the caller's
cache options (body field ``edgecache`` and the ``X-EdgeCache-*`` headers) and the tenant's plan.

A repeated request is the common case on a cache (that is what a hit is), and its body is byte-for-byte the same:
:class:`ParsedRequests` maps (tenant, route, body) straight to the parsed result, so an exact hit costs a hash of
the body instead of a decode, a validation and the building of a call.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NamedTuple, TypeVar

import msgspec

from edgecache.call import CACHE_CONTROL, POLICIES, Call, PolicyName
from edgecache.engines.base import CacheHints, GenerationRequest
from edgecache.errors import BadRequest, ClientGone, Forbidden, PayloadTooLarge
from edgecache.http.request_surface import (
    CacheOptions,
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
    features_used,
)
from edgecache.settings import MAX_BUCKET_SIZE, Settings
from edgecache.tenants import Tenant

T = TypeVar("T")


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
    if chat:
        req = decode_request(body, ChatCompletionRequest)  # type: ignore[assignment]
        assert isinstance(req, ChatCompletionRequest)
        if len(req.messages) > settings.server.max_messages:
            raise PayloadTooLarge(f"at most {settings.server.max_messages} messages per request")
    else:
        req = decode_request(body, CompletionRequest)  # type: ignore[assignment]
        assert isinstance(req, CompletionRequest)
    return parsed_from(req, tenant, settings)


def parsed_from(req: ChatCompletionRequest | CompletionRequest, tenant: Tenant, settings: Settings) -> Parsed:
    """A decoded request as the pipeline's call. Other APIs (Responses) build a ChatCompletionRequest and come
    through here, so the same generation asked through any of them has one key."""
    chat = isinstance(req, ChatCompletionRequest)
    salt = tenant.id
    generation = req.generation(settings.engine.default_max_tokens, salt)
    if isinstance(req, ChatCompletionRequest) and \
            (hints := openai_cache_hints(req.prompt_cache_retention, req.prompt_cache_key)) is not None:
        generation = msgspec.structs.replace(generation, cache=hints)
    if req.cache_salt:
        # A caller's own salt namespaces within its tenant: the tenant always leads the engine's salt.
        generation = msgspec.structs.replace(generation, salt=f"{tenant.id}:{req.cache_salt}")
    return Parsed(call=build_call(generation, req.edgecache, tenant, settings), model=req.model, chat=chat,
                  stream=req.stream, include_usage=req.include_usage(), features=features_used(generation))


#: How long ``prompt_cache_retention: "24h"`` keeps a prefix.
RETENTION_24H_S = 86400.0


def openai_cache_hints(retention: str | None, key: str | None) -> CacheHints | None:
    """OpenAI's prompt-cache fields as hints to the engine's prefix cache: ``"24h"`` keeps the prompt's prefix a
    day (on the disk tier), ``"in_memory"`` keeps it in RAM only; ``prompt_cache_key`` goes to an upstream. They
    change what is kept, never an answer (no key holds them)."""
    if not retention and not key:
        return None
    return CacheHints(retention_s=RETENTION_24H_S if retention == "24h" else 0.0,
                      memory_only=retention in ("in_memory", "in-memory"), key=key or "")


def build_call(generation: GenerationRequest, options: CacheOptions | None, tenant: Tenant,
               settings: Settings) -> Call:
    """The pipeline's Call for a generation, under the caller's cache options (the body's ``edgecache`` field) and
    the tenant's plan: the same for every API, so one generation asked through any of them is one call."""
    if options is not None and options.ttl is not None and options.ttl > longest_ttl_s(settings):
        raise BadRequest(f"edgecache.ttl is {options.ttl:g} s; the longest this server keeps an answer is "
                         f"{longest_ttl_s(settings):g} s (its longest TTL tier)", param="edgecache.ttl")
    cap = tenant.plan.max_request_tokens
    if cap is not None and generation.params.max_tokens * generation.n > cap:
        asked = generation.params.max_tokens * generation.n
        raise BadRequest(f"this request asks for up to {asked} tokens (max_tokens x n); this key's plan allows "
                         f"{cap} a request", param="max_tokens")
    return Call(request=generation, tenant=tenant.id, tenant_limit=tenant.plan.max_concurrent_misses,
                engine_time_s=tenant.plan.max_request_engine_s,
                scenario=(options.scenario if options else None) or "default",
                policy=(options.policy if options else None) or "default",
                ttl_s=options.ttl if options else None, ttl_tier=options.ttl_tier if options else None,
                bucket_size=options.bucket_size if options else None)


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
    api_key: str | None = None  # x-api-key, Anthropic's clients' way to send the key (see tenants.presented_key)
    cache_control: str | None = None
    bucket_size: str | None = None


_HEADER_FIELDS = {b"authorization": 0, b"x-edgecache-scenario": 1, b"x-edgecache-policy": 2, b"x-api-key": 3,
                  b"cache-control": 4, b"x-edgecache-bucket-size": 5}
_LIST_FIELDS = frozenset({4})  # HTTP list fields: several lines are one comma-separated value (RFC 9110, 5.3)


def read_headers(raw: Iterable[tuple[bytes, bytes]]) -> CallHeaders:
    """One pass over the ASGI scope's raw headers for the few that matter (names arrive lower-cased). Cheaper
    than building a full case-insensitive header map on every request, which showed on the hit path.

    One rule for every route: a header that matters, sent twice, is a 400. Taking the first or the last copy is
    what let two ``Authorization`` headers name different tenants on different routes (each framework layer
    picked its own copy). ``Cache-Control`` is a list by definition: its lines are joined, as HTTP says."""
    found: list[str | None] = [None] * len(_HEADER_FIELDS)
    for name, value in raw:
        index = _HEADER_FIELDS.get(name)
        if index is not None:
            text = value.decode("latin-1")
            if found[index] is not None:
                if index not in _LIST_FIELDS:
                    raise BadRequest(f"the {name.decode()} header was sent more than once; send it once",
                                     param=name.decode())
                text = f"{found[index]}, {text}"
            found[index] = text
    return CallHeaders(*found)


class RequestCacheControl(NamedTuple):
    """What a request's ``Cache-Control`` asks of the cache: the named policies its directives amount to (in
    :data:`~edgecache.call.CACHE_CONTROL` order, each once) and ``max-age`` in seconds (the smallest, if several)."""

    policies: tuple[PolicyName, ...] = ()
    max_age_s: float | None = None


# One directive: a token, optionally "=" and a token or a quoted string (which may hold commas).
_DIRECTIVE = re.compile(r'\s*([^\s=,]+)(?:\s*=\s*("(?:[^"\\]|\\.)*"|[^,]*))?\s*(?:,|$)')
_DELTA_SECONDS = re.compile(r"[0-9]+")
_MAX_DELTA_SECONDS = 2**31  # RFC 9111, 1.2.2: a larger delta-seconds is taken as this


def parse_cache_control(value: str) -> RequestCacheControl:
    """The request directives this cache implements; unknown ones are ignored (RFC 9111, 5.2.3). A ``max-age``
    that is not delta-seconds (a non-negative integer) is a 400: guessing what the caller meant by an age could
    serve an answer older than it accepts."""
    policies: set[PolicyName] = set()
    max_age: float | None = None
    for match in _DIRECTIVE.finditer(value):
        name, argument = match.group(1).lower(), (match.group(2) or "").strip()
        if name == "max-age":
            if len(argument) >= 2 and argument[0] == argument[-1] == '"':
                argument = argument[1:-1]  # the quoted form, which a recipient must accept too
            if not _DELTA_SECONDS.fullmatch(argument):
                raise BadRequest(f"Cache-Control max-age must be a whole number of seconds, not {argument!r}",
                                 param="Cache-Control")
            seconds = float(min(int(argument), _MAX_DELTA_SECONDS))
            max_age = seconds if max_age is None else min(max_age, seconds)
        elif name in CACHE_CONTROL:
            policies.add(CACHE_CONTROL[name])
    return RequestCacheControl(tuple(p for p in CACHE_CONTROL.values() if p in policies), max_age)


def apply_headers(parsed: Parsed, headers: CallHeaders, tenant: Tenant, settings: Settings) -> Parsed:
    """``X-EdgeCache-Scenario`` and ``X-EdgeCache-Policy`` override the body, ``Cache-Control`` narrows the policy
    (:meth:`~edgecache.call.Call.cache_policy`); then all of it is checked against the server and the plan: every
    policy a request ends up under, named or from a directive, must be one its plan allows. The bucket size is
    resolved last (:func:`resolved_bucket_size`), once the scenario and the policy are known."""
    scenario, policy = headers.scenario, headers.policy
    call = parsed.call
    if (scenario is not None and scenario != call.scenario) or (policy is not None and policy != call.policy):
        call = msgspec.structs.replace(call, scenario=scenario or call.scenario, policy=policy or call.policy)
    if headers.cache_control is not None:
        control = parse_cache_control(headers.cache_control)
        if control.policies or control.max_age_s is not None:
            call = msgspec.structs.replace(call, narrowed_by=control.policies, max_age_s=control.max_age_s)
    if call is not parsed.call:
        parsed = msgspec.structs.replace(parsed, call=call)
    if call.scenario not in settings.scenarios:
        raise BadRequest(f"unknown scenario {call.scenario!r}; this server has: "
                         f"{', '.join(sorted(settings.scenarios))}", param="edgecache.scenario")
    if call.policy not in POLICIES:
        raise BadRequest(f"unknown cache policy {call.policy!r}; policies: {', '.join(POLICIES)}",
                         param="edgecache.policy")
    bucket_size = resolved_bucket_size(call, headers.bucket_size, tenant, settings)
    if bucket_size != (call.bucket_size or 0):  # None and 0 are the same: no call made anew on the hit path
        call = msgspec.structs.replace(call, bucket_size=bucket_size)
        parsed = msgspec.structs.replace(parsed, call=call)
    if call.policy not in tenant.plan.policies:
        raise Forbidden(f"the {tenant.plan_name!r} plan does not allow the cache policy {call.policy!r}",
                        param="edgecache.policy")
    for name in call.narrowed_by:
        if name not in tenant.plan.policies:
            directive = next(d for d, p in CACHE_CONTROL.items() if p == name)
            raise Forbidden(f"the {tenant.plan_name!r} plan does not allow the cache policy {name!r}, which "
                            f"Cache-Control: {directive} asks for", param="Cache-Control")
    return parsed


_BUCKET_SIZE = re.compile(r"[0-9]{1,3}")


def resolved_bucket_size(call: Call, header: str | None, tenant: Tenant, settings: Settings) -> int:
    """How many answers the call's bucket holds (:mod:`edgecache.buckets`): ``X-EdgeCache-Bucket-Size``, else the
    body's ``edgecache.bucket_size``, else none where the caller named the ``reuse`` policy (one frozen answer is what
    it asked for), else its scenario's ``bucket_size``, else its plan's. A header that is not a whole number from 0 to
    :data:`~edgecache.settings.MAX_BUCKET_SIZE` is a 400."""
    if header is not None:
        text = header.strip()
        if not _BUCKET_SIZE.fullmatch(text) or int(text) > MAX_BUCKET_SIZE:
            raise BadRequest(f"X-EdgeCache-Bucket-Size must be a whole number from 0 to {MAX_BUCKET_SIZE}, not "
                             f"{header!r}", param="X-EdgeCache-Bucket-Size")
        return int(text)
    if call.bucket_size is not None:
        return call.bucket_size
    if call.policy == "reuse":
        return 0
    scenario = settings.scenarios.get(call.scenario)
    if scenario is not None and scenario.bucket_size is not None:
        return scenario.bucket_size
    return tenant.plan.bucket_size


class ParsedRequests:
    """Recently seen (tenant, route, body) -> parsed request, bounded by count: one memo for every API (chat and
    text, Messages, Responses; another API's entry is what its own parser makes of the body).

    Only valid bodies are kept, so an invalid one is re-checked (and refused) every time; bodies over
    ``MAX_BODY_BYTES`` are not kept, so the memo's memory stays bounded.
    """

    MAX_BODY_BYTES = 16_384

    def __init__(self, settings: Settings, max_entries: int = 4096) -> None:
        self.settings = settings
        self.max_entries = max_entries
        # (tenant, route, body): the route is chat (True) or text (False) for OpenAI's, a name for another API's.
        self._entries: OrderedDict[tuple[str, bool | str, bytes], Any] = OrderedDict()

    def clear(self) -> None:
        self._entries.clear()

    def parse(self, chat: bool, body: bytes, tenant: Tenant) -> Parsed:
        key = (tenant.id, chat, body)
        parsed: Parsed | None = self._entries.get(key)
        if parsed is not None:
            self._entries.move_to_end(key)
            return parsed
        parsed = parse(chat, body, tenant, self.settings)
        self._keep(key, body, parsed)
        return parsed

    def recall(self, route: str, body: bytes, tenant: Tenant, parse_body: Callable[[bytes, Tenant, Settings], T]
               ) -> T:
        """Another API's parsed request: ``parse_body`` runs only for a body not seen recently on ``route``."""
        parsed: T | None = self.recalled(route, body, tenant)
        if parsed is None:
            parsed = parse_body(body, tenant, self.settings)
            self.remember(route, body, tenant, parsed)
        return parsed

    def recalled(self, route: str, body: bytes, tenant: Tenant) -> Any:
        """What ``body`` parsed to on ``route`` recently, or None (for a parser that cannot run in
        :meth:`recall`: Responses reads a stored conversation first, and keeps only what needed none)."""
        key = (tenant.id, route, body)
        parsed = self._entries.get(key)
        if parsed is not None:
            self._entries.move_to_end(key)
        return parsed

    def remember(self, route: str, body: bytes, tenant: Tenant, parsed: Any) -> None:
        self._keep((tenant.id, route, body), body, parsed)

    def _keep(self, key: tuple[str, bool | str, bytes], body: bytes, parsed: Any) -> None:
        if len(body) <= self.MAX_BODY_BYTES:
            self._entries[key] = parsed
            if len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
