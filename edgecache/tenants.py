"""Tenants and plans: who is calling (API key -> tenant), and what their plan allows.

The tenants file is TOML::

    [plans.basic]
    store_bytes = "2GB"
    max_concurrent_misses = 2
    policies = ["default", "no-store", "no-cache", "exact-only", "bypass"]

    [[tenants]]
    id = "acme"
    plan = "basic"
    keys = ["sk-acme-1"]

    [admin]
    keys = ["sk-admin-1"]          # for the admin routes (flush, warmup, stats) and /metrics

    [metrics]
    keys = ["sk-scraper-1"]        # for /metrics only (a Prometheus scraper's bearer token)

Keys are never kept in clear: the directory holds their SHA-256 digests, a presented key is hashed and compared
with every digest by ``hmac.compare_digest``, so neither timing nor a memory dump gives a key away. Keys are never
logged; errors name the tenant, never the key.

With no tenants file there is one tenant, ``default``, with no key and the default plan (:data:`DEFAULT_TENANT`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

from edgecache.call import POLICIES, PolicyName
from edgecache.errors import BadRequest, Unauthorized
from edgecache.settings import BucketSize, ByteSize, SettingsError, _dec_hook

ALL_POLICIES: tuple[PolicyName, ...] = tuple(POLICIES)
TenantId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


class Plan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    store_bytes: ByteSize = ByteSize(2 * 10**9)
    """The tenant's result-store quota; past it the tenant's own least recently used entries go."""
    semantic_max_vectors: Annotated[int, Meta(ge=1)] = 100_000
    """Most vectors one of the tenant's semantic indexes keeps; past it that index's oldest go."""
    semantic_max_indexes: Annotated[int, Meta(ge=1)] = 1_000
    """Most semantic indexes the tenant keeps (one per scenario and namespace: every distinct system prompt,
    ``cache_salt`` or set of output-affecting parameters of a first-turn chat makes one, in memory and as a file);
    past it the tenant's least recently used index goes whole."""
    semantic_max_tenant_vectors: Annotated[int, Meta(ge=1)] = 1_000_000
    """Most vectors across all the tenant's semantic indexes; past it the oldest vectors of its least recently used
    index go first."""
    prefix_cache_share: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.5
    """The most of the engine's prefix cache (KV states, in RAM and on disk) the tenant may hold, as a share of the
    box's budgets; past it the tenant's own least recently used prefixes go. (The default tenant of a server with
    no tenants file has all of it.)"""
    max_request_tokens: Annotated[int, Meta(ge=1)] | None = None
    """The most tokens one request may ask the engine for, ``max_tokens`` times ``n`` (unset: only the context
    bounds it); a request over it is refused with a 400, so one tenant cannot hold the engine's slots with a few
    enormous answers."""
    max_request_engine_s: Annotated[float, Meta(gt=0.0)] | None = None
    """The most engine time (seconds in its slot) one request may take (unset: no cap); a request still running
    then is aborted and refused with a 400 (``engine_time_exceeded``), nothing of it cached, and its slot goes to the
    next caller. Set below the profile's ``admission.queue_timeout_s``, so that another tenant's call waiting behind
    one of this tenant's never times out in the queue."""
    max_concurrent_misses: Annotated[int, Meta(ge=1)] | None = None
    """Most of the tenant's misses computing at once (unset: only the profile's global limit)."""
    weight: Annotated[float, Meta(gt=0.0, le=1000.0)] = 1.0
    """The tenant's weight in the engine's queue: free slots go round the waiting tenants in proportion to their
    weights, and while others wait the tenant runs at most its weight's share of the slots."""
    policies: tuple[PolicyName, ...] = ALL_POLICIES
    """The cache policies the tenant may ask for."""
    bucket_size: BucketSize = 0
    """Answers kept per request of the tenant that samples without a seed, where neither the request
    (``X-EdgeCache-Bucket-Size``) nor its scenario says (docs/caching.md, "Buckets for sampled requests"); 0: none,
    such a request always reaches the engine."""
    log_prompts: bool = False
    """Keep the tenant's query text in the decision log (for `edgecache tune` and audits); off, the log holds a
    keyed hash of it and the scores only."""


class TenantEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: TenantId
    plan: str
    keys: Annotated[list[Annotated[str, Meta(min_length=8)]], Meta(min_length=1)]


class AdminEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    keys: list[Annotated[str, Meta(min_length=8)]] = []


class TenantsFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    plans: dict[str, Plan] = {}
    tenants: list[TenantEntry] = []
    admin: AdminEntry = AdminEntry()
    metrics: AdminEntry = AdminEntry()


class Tenant(msgspec.Struct, frozen=True):
    id: str
    plan_name: str
    plan: Plan


DEFAULT_TENANT = Tenant("default", "default", Plan(prefix_cache_share=1.0))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class TenantDirectory:
    """API key -> tenant. ``open`` directories (no tenants file) answer every request as the default tenant."""

    def __init__(self, tenants: list[tuple[Tenant, list[str]]], admin_keys: list[str], *, open_: bool,
                 metrics_keys: Sequence[str] = ()) -> None:
        self.open = open_
        self._by_digest: dict[bytes, Tenant] = {}
        self._tenants: dict[str, Tenant] = {}
        for tenant, keys in tenants:
            self._tenants[tenant.id] = tenant
            for key in keys:
                digest = _digest(key)
                if digest in self._by_digest:
                    raise SettingsError(f"tenants: a key of {tenant.id!r} is also a key of "
                                        f"{self._by_digest[digest].id!r}")
                self._by_digest[digest] = tenant
        self._admin_digests = [_digest(k) for k in admin_keys]
        self._metrics_digests = [_digest(k) for k in metrics_keys]
        if open_:
            self._tenants[DEFAULT_TENANT.id] = DEFAULT_TENANT

    @classmethod
    def open_directory(cls) -> TenantDirectory:
        return cls([], [], open_=True)

    @classmethod
    def from_file(cls, path: str | Path) -> TenantDirectory:
        try:
            parsed = msgspec.toml.decode(Path(path).read_bytes(), type=TenantsFile, dec_hook=_dec_hook)
        except FileNotFoundError as exc:
            raise SettingsError(f"tenants file not found: {path}") from exc
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            # msgspec's message names the field and the value's position, never echoing a key's text.
            raise SettingsError(f"tenants file {path}: {exc}") from exc
        entries = []
        seen: set[str] = set()
        for entry in parsed.tenants:
            if entry.id in seen:
                raise SettingsError(f"tenants file {path}: tenant {entry.id!r} appears twice")
            seen.add(entry.id)
            if entry.plan not in parsed.plans:
                raise SettingsError(f"tenants file {path}: tenant {entry.id!r} has unknown plan {entry.plan!r}; "
                                    f"plans: {', '.join(sorted(parsed.plans)) or 'none'}")
            entries.append((Tenant(entry.id, entry.plan, parsed.plans[entry.plan]), entry.keys))
        return cls(entries, parsed.admin.keys, open_=False, metrics_keys=parsed.metrics.keys)

    @property
    def tenants(self) -> dict[str, Tenant]:
        return dict(self._tenants)

    def get(self, tenant_id: str) -> Tenant | None:
        return self._tenants.get(tenant_id)

    def authenticate(self, authorization: str | None, api_key: str | None = None) -> Tenant:
        """The tenant a request's key names (``Authorization: Bearer <key>`` or ``x-api-key: <key>``, see
        :func:`presented_key`); 401 when there is none."""
        if self.open:
            return DEFAULT_TENANT
        key = presented_key(authorization, api_key)
        if key is None:
            raise Unauthorized("missing API key: send Authorization: Bearer <key> (or x-api-key: <key>)")
        digest = _digest(key)
        found: Tenant | None = None
        # Every digest is compared, in constant time, with no early exit: how long this takes says nothing about
        # which key, or how much of one, was right.
        for candidate, tenant in self._by_digest.items():
            if hmac.compare_digest(digest, candidate):
                found = tenant
        if found is None:
            raise Unauthorized("invalid API key")
        return found

    def authenticate_admin(self, authorization: str | None, api_key: str | None = None) -> None:
        """Admin routes: open when there is no tenants file (loopback only), else an admin key is needed."""
        if self.open:
            return
        key = presented_key(authorization, api_key)
        digest = _digest(key) if key is not None else b""
        if not _any_match(digest, self._admin_digests):
            raise Unauthorized("an admin key is needed for this route")

    def authenticate_stats(self, authorization: str | None, api_key: str | None = None) -> Tenant | None:
        """``/stats``: an admin key sees every tenant (None); a tenant's key sees its own figures (its Tenant)."""
        if self.open:
            return None
        key = presented_key(authorization, api_key)
        digest = _digest(key) if key is not None else b""
        if _any_match(digest, self._admin_digests):
            return None
        return self.authenticate(authorization, api_key)

    def authenticate_metrics(self, authorization: str | None, api_key: str | None = None) -> None:
        """``/metrics`` names every tenant with its traffic: with a tenants file it needs the admin key or a key
        from the file's ``[metrics]`` section (a scraper's token that opens nothing else)."""
        if self.open:
            return
        key = presented_key(authorization, api_key)
        digest = _digest(key) if key is not None else b""
        # Both lists are compared in full (no short circuit), like every key comparison here.
        admin, metrics = _any_match(digest, self._admin_digests), _any_match(digest, self._metrics_digests)
        if not (admin or metrics):
            raise Unauthorized("a metrics or admin key is needed for /metrics")


def _any_match(digest: bytes, digests: list[bytes]) -> bool:
    found = False
    for candidate in digests:
        found |= hmac.compare_digest(digest, candidate)
    return found


def presented_key(authorization: str | None, api_key: str | None) -> str | None:
    """The key a request presents: ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>``
    (Anthropic's). Both may be sent (the anthropic SDK given both an api_key and an auth_token does), but then they
    must name the same key: two different keys leave it ambiguous who is calling, so that is a 400, never a guess
    (the same rule as a header sent twice)."""
    bearer = _bearer(authorization)
    key = api_key.strip() if api_key is not None and api_key.strip() else None
    if bearer is not None and key is not None and bearer != key:
        raise BadRequest("the Authorization and x-api-key headers name different keys; send one key",
                         param="x-api-key")
    return bearer if bearer is not None else key


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
