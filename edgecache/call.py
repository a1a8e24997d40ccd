"""What the request path is asked and what it answers with, named once: the :class:`Call`, the cache policies a
call may carry, and who served it.

Every API adapter (:mod:`edgecache.http.calls` for OpenAI's routes, the warmup's lines) builds a :class:`Call`; the
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
PolicyName = Literal["default", "no-store", "no-cache", "exact-only", "bypass", "reuse", "only-if-cached"]


class CachePolicy(msgspec.Struct, frozen=True):
    """What a request may read from and write to the caches. The policies are data: :data:`POLICIES`."""

    read: bool        # answer from the exact store, a running flight, or the semantic index
    semantic: bool    # the semantic layer may be read (if ``read``) and written (if ``write``)
    write: bool       # store the answer (and index its vector)
    sampled: bool = False  # cache even sampling without a seed (the caller asked for reuse)
    compute: bool = True   # the engine may answer (off: a cached answer or a 504, never engine work)

    def narrowed(self, other: CachePolicy) -> CachePolicy:
        """What both policies allow (``sampled`` stays this one's: it widens what may be cached, not how)."""
        return CachePolicy(read=self.read and other.read, semantic=self.semantic and other.semantic,
                           write=self.write and other.write, sampled=self.sampled,
                           compute=self.compute and other.compute)


POLICIES: dict[PolicyName, CachePolicy] = {
    "default": CachePolicy(read=True, semantic=True, write=True),
    "no-store": CachePolicy(read=True, semantic=True, write=False),     # read, never write
    "no-cache": CachePolicy(read=False, semantic=True, write=True),     # skip reads, compute, write: a refresh
    "exact-only": CachePolicy(read=True, semantic=False, write=True),   # no semantic layer
    "bypass": CachePolicy(read=False, semantic=False, write=False),     # touch nothing
    "reuse": CachePolicy(read=True, semantic=True, write=True, sampled=True),
    "only-if-cached": CachePolicy(read=True, semantic=True, write=False, compute=False),  # a hit or a 504
}
assert tuple(POLICIES) == get_args(PolicyName), "every named policy is defined, in the same order"

#: The ``Cache-Control`` request directives (RFC 9111) and the named policy each amounts to. HTTP's request
#: ``no-store`` lets a cache answer from what it holds; here it touches nothing (``bypass``):
#: a caller who says no-store about its prompt means its answer too. ``max-age`` is not a policy but a bound on
#: an answer's age (:attr:`Call.max_age_s`); other directives (``max-stale``, ``min-fresh``, ``no-transform``,
#: ``stale-if-error``) are ignored, as HTTP tells a cache to ignore what it does not implement.
CACHE_CONTROL: dict[str, PolicyName] = {"no-cache": "no-cache", "no-store": "bypass",
                                        "only-if-cached": "only-if-cached"}


class Call(msgspec.Struct, frozen=True, kw_only=True):
    """One request as the pipeline sees it: what to generate, for whom, under which scenario and policy.

    ``ttl_s`` / ``ttl_tier`` are the caller's explicit choice of how long the answer may live (None: let the
    scenario or the classifier decide). ``tenant_limit`` is the plan's cap on the tenant's concurrent misses,
    ``engine_time_s`` its cap on one request's engine time (:func:`edgecache.admission.within_engine_time`).

    ``narrowed_by``: the policies the request's ``Cache-Control`` directives amount to (:data:`CACHE_CONTROL`);
    each narrows ``policy`` (:meth:`cache_policy`). ``max_age_s``: ``Cache-Control: max-age``, the oldest stored
    answer the caller accepts; it leaves the TTL an answer is written with alone. ``warmup``: a warmup line's call,
    not a client's (the ledger charges its engine time to warmup).

    ``bucket_size``: how many answers a request that samples without a seed keeps and is served from
    (:mod:`edgecache.buckets`); 0 or None: none. The HTTP front resolves the caller's, the scenario's and the plan's
    into one number.
    """

    request: GenerationRequest
    tenant: str = "default"
    scenario: str = "default"
    policy: PolicyName = "default"
    ttl_s: float | None = None
    ttl_tier: str | None = None
    tenant_limit: int | None = None
    engine_time_s: float | None = None
    narrowed_by: tuple[PolicyName, ...] = ()
    max_age_s: float | None = None
    warmup: bool = False
    bucket_size: int | None = None

    def cache_policy(self) -> CachePolicy:
        """What this call may do with the caches: its named policy, narrowed by its Cache-Control directives."""
        policy = POLICIES[self.policy]
        for name in self.narrowed_by:
            policy = policy.narrowed(POLICIES[name])
        return policy
