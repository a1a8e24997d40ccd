"""What the request path is asked and what it answers with, named once: the :class:`Call`, the cache policies a
call may carry, and who served it.

Every API adapter (:mod:`edgecache.calls` for OpenAI's routes, the warmup's lines) builds a :class:`Call`; the
pipeline (:mod:`edgecache.pipeline`) serves it; the labeler, metrics and ``edgecache stats`` read these names from
here, so a policy or an outcome is spelled in one place.
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from edgecache.engines.base import GenerationRequest

#: Who answered a call (the ``X-EdgeCache`` header, and the layers of ``edgecache_requests_total``).
Served = Literal["exact", "semantic", "shared", "miss"]
SERVED: tuple[Served, ...] = get_args(Served)
#: The layers that answer without computing: a hit is any of these.
HITS: tuple[Served, ...] = ("exact", "semantic", "shared")
#: A request's outcome in the metrics: who served it, or why nobody did.
Outcome = Literal[Served, "error", "rejected"]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)

#: The cache policies a request may ask for (``X-EdgeCache-Policy`` or ``edgecache.policy``) and a plan may allow.
PolicyName = Literal["default", "no-store", "no-cache", "exact-only", "bypass", "reuse"]


class CachePolicy(msgspec.Struct, frozen=True):
    """What a request may read from and write to the caches. The policies are data: :data:`POLICIES`."""

    read: bool        # answer from the exact store, a running flight, or the semantic index
    semantic: bool    # the semantic layer may be read (if ``read``) and written (if ``write``)
    write: bool       # store the answer (and index its vector)
    sampled: bool = False  # cache even sampling without a seed (the caller asked for reuse)


POLICIES: dict[PolicyName, CachePolicy] = {
    "default": CachePolicy(read=True, semantic=True, write=True),
    "no-store": CachePolicy(read=True, semantic=True, write=False),     # read, never write
    "no-cache": CachePolicy(read=False, semantic=True, write=True),     # skip reads, compute, write: a refresh
    "exact-only": CachePolicy(read=True, semantic=False, write=True),   # no semantic layer
    "bypass": CachePolicy(read=False, semantic=False, write=False),     # touch nothing
    "reuse": CachePolicy(read=True, semantic=True, write=True, sampled=True),
}
assert tuple(POLICIES) == get_args(PolicyName), "every named policy is defined, in the same order"


class Call(msgspec.Struct, frozen=True, kw_only=True):
    """One request as the pipeline sees it: what to generate, for whom, under which scenario and policy.

    ``ttl_s`` / ``ttl_tier`` are the caller's explicit choice of how long the answer may live (None: let the
    scenario or the classifier decide). ``tenant_limit`` is the plan's cap on the tenant's concurrent misses.
    """

    request: GenerationRequest
    tenant: str = "default"
    scenario: str = "default"
    policy: PolicyName = "default"
    ttl_s: float | None = None
    ttl_tier: str | None = None
    tenant_limit: int | None = None
