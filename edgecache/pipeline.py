"""The request path, top to bottom, as docs/architecture.md draws it.

::

    key: canonical hash of (model version, tenant, scenario, messages, output-affecting params)
    ├─ 1. exact result store       hit -> replay the stored answer                         X-EdgeCache: exact
    ├─ 2. in-flight de-dup         an identical request is computing -> follow its stream  X-EdgeCache: shared
    │                              (cut at a smaller max_tokens; a larger one waits for its end)
    ├─ 3. semantic cache           a paraphrase's answer, similar enough and guarded       X-EdgeCache: semantic
    │                              (each decision appended to the decision log; a learner may
    │                              explore: refuse a candidate it would serve, to label it)
    └─ 4. engine                   stream to the client and followers; a complete answer is stored (and, for a
                                   first-turn chat prompt, its vector indexed; a refused candidate is then
                                   labelled against it in the background)                  X-EdgeCache: miss

The HTTP layer (:mod:`edgecache.http.app`) authenticates, validates and renders; this module decides who answers. Each
layer is an instance handed in by the app factory, so tests pass fakes without patching.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing, suppress

import msgspec
import numpy as np

from edgecache import buckets
from edgecache.admission import AdmissionGate, within_engine_time
from edgecache.call import CachePolicy, Call, Served
from edgecache.engines.base import STREAM_BATCH_S, AnswerTokens, Chunk, Engine, cut_text, prefix_stable_of
from edgecache.errors import EdgeCacheError, EngineError, NotCached
from edgecache.inflight import FlightTable, SharedFlight
from edgecache.keys import is_cacheable, prefix_stable, request_key
from edgecache.ledger import BUCKET_FILLING, EVICTED, FIRST_SEEN, NOT_CACHEABLE, POLICY, Ledger, semantic_reason
from edgecache.metrics import Metrics
from edgecache.semantic import refusals
from edgecache.semantic.cache import SemanticCache
from edgecache.semantic.decision_log import DecisionLog
from edgecache.semantic.guard import rule_of as guard_rule_of
from edgecache.semantic.labeling import MissLabels
from edgecache.semantic.lookup import Lookup, Probe, probe_for, record_lookup
from edgecache.semantic.marks import MarkedWrong
from edgecache.stores import CachedAnswer, ResultStore, serve_within


class Reply(msgspec.Struct, kw_only=True):
    """Who served the call, and the answer: a stored one (``answer``) or a stream of chunks (text deltas; the
    last one carries the counts and the finish reason). :meth:`stream` gives chunks in either case.
    ``ttl_s`` is how long the answer lives in the cache (remaining, for a hit; None when it is not stored).
    What the caller's feedback on it needs (``POST /v1/feedback``): ``key``, the request's key in the result store
    (None: not cached), and the semantic ``lookup`` made for it with its ``decision_id`` in the decision log.
    ``miss_reason``: why a miss missed (the ledger's reasons, :mod:`edgecache.ledger`). ``bucket``: the slots of a
    sampled request's bucket that answered, of its size (:func:`edgecache.buckets.label`); None without a bucket."""

    served: Served
    answer: CachedAnswer | None = None
    chunks: AsyncIterator[Chunk] | None = None
    similarity: float | None = None
    ttl_s: float | None = None
    key: str | None = None
    lookup: Lookup | None = None
    decision_id: str | None = None
    miss_reason: str | None = None
    bucket: str | None = None

    def stream(self) -> AsyncIterator[Chunk]:
        if self.answer is not None:
            return replay(self.answer)
        assert self.chunks is not None
        return self.chunks


def replay(answer: CachedAnswer) -> AsyncIterator[Chunk]:
    """A stored answer as a two-chunk stream: all its text, then its counts. The engine's prefix cache did not
    serve it, so cached_tokens is every prompt token: nothing was computed."""

    async def chunks() -> AsyncIterator[Chunk]:
        if answer.choices is None:
            yield Chunk(text=answer.text)
        yield Chunk(finish_reason=answer.finish_reason, prompt_tokens=answer.prompt_tokens,  # type: ignore[arg-type]
                    completion_tokens=answer.completion_tokens, cached_tokens=answer.prompt_tokens,
                    choices=answer.choices, stop_sequence=answer.stop_sequence)

    return chunks()


class Keys(msgspec.Struct, frozen=True):
    """A call's keys: ``full`` holds every output-affecting field (flights, and the answers that cannot be cut are
    keyed by it); ``any_max_tokens`` leaves ``max_tokens`` out, for a :func:`~edgecache.keys.prefix_stable` request
    (None otherwise), and holds its answers that carry token ends: computed ones, and a warmup line's given answer
    counted in the model's tokens."""

    full: str
    any_max_tokens: str | None = None

    def for_answer(self, answer: CachedAnswer) -> str:
        """Where ``answer`` is stored for this call: under the key without ``max_tokens`` when it can be cut."""
        return self.full if self.any_max_tokens is None or answer.token_ends is None else self.any_max_tokens


def call_keys(call: Call, model_version: str, rule: str) -> Keys:
    """The call's :class:`Keys` under the engine's ``prefix_stable`` rule."""
    full = request_key(call.request, model_version=model_version, tenant=call.tenant, scenario=call.scenario)
    if not prefix_stable(call.request, rule):
        return Keys(full)
    return Keys(full, request_key(call.request, model_version=model_version, tenant=call.tenant,
                                  scenario=call.scenario, any_max_tokens=True))


def _taught_as(text: str, answer: CachedAnswer | None) -> bool:
    """Whether ``answer``, under a warmup line's key without ``max_tokens``, is ``text`` as a warmup taught it (no
    prompt tokens, token ends). Then the line is already answered, and needs no counting in the model's tokens:
    they spell the text back, since they were counted from this same text under this same model version."""
    return answer is not None and answer.prompt_tokens == 0 and answer.token_ends is not None and answer.text == text


class CallKeys:
    """Request keys of recently served calls, by call identity.

    The HTTP layer hands the same :class:`Call` object back for a body it has seen before, so a repeated request
    (the cache's common case) finds its keys here instead of hashing its messages again. Entries hold their call, so
    an id is never reused while its entry lives; bounded by count.
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[int, tuple[Call, str, str, Keys]] = OrderedDict()

    def key(self, call: Call, model_version: str, rule: str = "") -> Keys:
        entry = self._entries.get(id(call))
        if entry is not None and entry[0] is call and entry[1] == model_version and entry[2] == rule:
            return entry[3]
        keys = call_keys(call, model_version, rule)
        self._entries[id(call)] = (call, model_version, rule, keys)
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return keys


class Cuts:
    """Stored answers served for a smaller ``max_tokens`` (:func:`~edgecache.stores.serve_within`), by answer object
    and limit: the memory tier hands a hot answer out as the same object on every hit, so its cut is made once and
    is the same object too (the HTTP front's renderings are keyed by answer object). Entries hold their answer, so
    an id is never reused while its entry lives; bounded by count."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, int], tuple[CachedAnswer, CachedAnswer | None]] = OrderedDict()

    def serve(self, answer: CachedAnswer, max_tokens: int) -> CachedAnswer | None:
        entry = self._entries.get((id(answer), max_tokens))
        if entry is not None and entry[0] is answer:
            return entry[1]
        served = serve_within(answer, max_tokens)
        self._entries[(id(answer), max_tokens)] = (answer, served)
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return served


class SemanticAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """What the semantic step found for a key: the lookup (its vector indexes the answer on a miss) and, on a hit,
    the answer. ``first``: this caller ran the lookup rather than waiting on an identical one."""

    lookup: Lookup
    answer: CachedAnswer | None = None
    similarity: float | None = None
    first: bool = True
    dropped: str | None = None       # why a hit's answer did not serve: gone (expired, evicted) or too_old
    decision_id: str | None = None   # the decision log's record of it (labels name it)
    stored_as: str | None = None     # the key a hit's answer was kept under for this request


def _fresh_enough(answer: CachedAnswer, call: Call) -> bool:
    """A caller's explicit TTL is also the oldest answer it accepts: the first computation's TTL must not decide
    for everyone (an answer stored for a day is not an answer for a caller who asked for a minute). So is its
    ``Cache-Control: max-age``, which changes nothing else."""
    if call.ttl_s is None and call.max_age_s is None:
        return True
    age = time.time() - answer.created_at
    return (call.ttl_s is None or age <= call.ttl_s) and (call.max_age_s is None or age <= call.max_age_s)


class RequestPipeline:
    """The request path. Its collaborators are handed in: ``stores`` gives a tenant's own result store,
    ``ttl_for`` decides an answer's lifetime, ``admission`` guards the engine, ``semantic`` may be None, ``ledger``
    meters the engine's calls and remembers what was stored, so a miss can say why it missed."""

    def __init__(self, *, engine: Engine, stores: Callable[[str], ResultStore], inflight: FlightTable,
                 metrics: Metrics, ttl_for: Callable[[Call], float], admission: AdmissionGate,
                 semantic: SemanticCache | None = None, decisions: DecisionLog | None = None,
                 labels: MissLabels | None = None, marks: MarkedWrong | None = None,
                 ledger: Ledger | None = None) -> None:
        self.engine = engine
        self.stores = stores
        self.inflight = inflight
        self.metrics = metrics
        self.ttl_for = ttl_for
        self.admission = admission
        self.semantic = semantic
        self.decisions = decisions  # the semantic decisions, for `edgecache tune` (None: not logged)
        self.labels = labels        # labels a refused candidate against the fresh answer (None: off)
        self.marks = marks          # candidates the callers marked wrong for a request (None: none kept)
        self.ledger = ledger if ledger is not None else Ledger()
        self._keys = CallKeys()
        self._cuts = Cuts()
        self._semantic_lookups: dict[str, asyncio.Future[SemanticAnswer]] = {}
        # Flights this node leads, by key without max_tokens, then max_tokens (see _lead).
        self._leaders: dict[str, dict[int, SharedFlight]] = {}

    def use_semantic(self, semantic: SemanticCache) -> None:
        """The semantic layer opened (again) after the pipeline was built: lookups use it from the next call."""
        self.semantic = semantic

    async def serve(self, call: Call) -> Reply:
        policy = call.cache_policy()
        if call.bucket_size and (policy.read or policy.write) and not is_cacheable(call.request):
            return await self._bucket(call, call.bucket_size, policy)  # sampling without a seed, with a bucket
        cacheable = is_cacheable(call.request) or policy.sampled
        if not policy.compute and not (cacheable and policy.read):
            raise NotCached("only-if-cached, and this request can have no cached answer: " +
                            ("sampling without a seed is never cached (send a seed or temperature 0)" if not cacheable
                             else "its cache policy reads no cache"))
        if not cacheable:
            # Sampling without a seed: every call should differ, so no layer may share or keep it.
            return await self._uncached(call, NOT_CACHEABLE)
        if not (policy.read or policy.write):
            return await self._uncached(call, POLICY)  # bypass
        keys = self._keys.key(call, self.engine.version, prefix_stable_of(self.engine))
        key = keys.full
        store = self.stores(call.tenant)  # the tenant's own store: its own quota, its own LRU
        probe: Probe | None = None
        lookup: Lookup | None = None
        found: SemanticAnswer | None = None
        decision_id: str | None = None

        if policy.read:
            # 1. exact result store (memory first: a hot hit never leaves the event loop)
            reply = await self._exact(call, keys, store)
            if reply is not None:
                return reply

            # 2. in-flight de-duplication: a leader of the same request (of another max_tokens, where it answers)
            reply = await self._in_flight(call, keys, store)
            if reply is not None:
                return reply

        # Bounds before any work that grows with the prompt or waits: a prompt the context cannot hold is refused
        # (400) and a full engine queue refuses at once (429), before the prompt is embedded. A call that will not
        # reach the engine (only-if-cached) is not refused for the engine's queue.
        if policy.compute:
            await self._refuse_early(call)
        else:
            await self.engine.check_prompt(call.request)

        if policy.read:
            # 3. semantic cache: first-turn chat prompts only, the nearest candidates, accepted by threshold + guard or the verifier
            probe = await self._probe(call, keys, policy)
            if probe is not None:
                found = await self._semantic_once(call, keys, probe, policy)
                lookup, decision_id = found.lookup, found.decision_id
                if found.answer is not None:
                    return Reply(served="semantic" if found.first else "shared", answer=found.answer,
                                 similarity=found.similarity, ttl_s=found.answer.expires_at - time.time(),
                                 key=found.stored_as if policy.write else None, lookup=lookup,
                                 decision_id=decision_id)
                # While this one looked, an identical request may have computed its answer or started to.
                reply = await self._exact(call, keys, store) or await self._in_flight(call, keys, store)
                if reply is not None:
                    return reply

        if not policy.compute:
            raise NotCached("only-if-cached, and no cached answer matches this request; nothing was computed")
        reason = await self._why_missed(call, keys.any_max_tokens or key, store, policy, found)
        purpose = "explore" if lookup is not None and lookup.explored else "warmup" if call.warmup else "miss"
        if not policy.write:
            return Reply(served="miss", chunks=self._engine_stream(call, purpose), lookup=lookup,
                         decision_id=decision_id, miss_reason=reason)  # no-store: compute, keep nothing

        # 4. engine: lead a flight that streams to every listener and stores the complete answer.
        if probe is None and not policy.read:
            probe = await self._probe(call, keys, policy)  # no-cache skipped the read: index the answer
        ttl_s = self.ttl_for(call)
        if lookup is None and probe is not None:
            lookup = Lookup(vector=None)  # no-cache: the vector is computed after the answer, for the write
        flight = self.inflight.lead(key, lambda f: self._lead(call, keys, ttl_s, f, probe, lookup, decision_id,
                                                              purpose))
        reply = Reply(served="miss", ttl_s=ttl_s, key=keys.any_max_tokens or key, lookup=lookup,
                      decision_id=decision_id, miss_reason=reason)
        reply.chunks = _served_by_whom(reply, flight)
        return reply

    async def _bucket(self, call: Call, size: int, policy: CachePolicy) -> Reply:
        """A sampled request served from its bucket of ``size`` answers, or filling it (:mod:`edgecache.buckets`).
        A fill is a flight of its own under its slot's key; the semantic layer has no part in it."""
        n = call.request.n
        if n > size:  # more different answers than the bucket keeps: computed, as without one
            if not policy.compute:
                raise NotCached(f"only-if-cached, and this request asks for {n} answers; its bucket keeps {size}")
            return await self._uncached(call, NOT_CACHEABLE)
        one = call if n == 1 else msgspec.structs.replace(call, request=buckets.one_answer(call.request))
        slots = buckets.slot_keys(call.request, size, model_version=self.engine.version, tenant=call.tenant,
                                  scenario=call.scenario)
        store = self.stores(call.tenant)

        def usable(answer: CachedAnswer) -> bool:
            return _fresh_enough(answer, call)

        stored = await buckets.read_slots(store, slots, usable) if policy.read else {}
        if len(stored) < size:
            if policy.compute:
                await self._refuse_early(call)
                if not policy.write:  # no-store: a new sample, kept nowhere
                    return Reply(served="miss", chunks=self._engine_stream(call, "warmup" if call.warmup else "miss"),
                                 miss_reason=BUCKET_FILLING)
            if policy.read:
                buckets.recheck(store, slots, stored, usable)  # from here to the flights' start, no await
        running = {i for i, key in enumerate(slots) if self.inflight.get(key) is not None}
        drawn = buckets.draw(size, n, stored, running, read=policy.read)
        if drawn.lead and not policy.compute:
            raise NotCached(f"only-if-cached, and this request's bucket holds {len(stored)} of its {size} answers; "
                            "nothing was computed")
        label = buckets.label(drawn.slots, size)
        if not drawn.lead and not drawn.follow:
            answer = buckets.combined([stored[i] for i in drawn.serve])
            return Reply(served="exact", answer=answer, ttl_s=answer.expires_at - time.time(),
                         key=slots[drawn.serve[0]] if n == 1 else None, bucket=label)
        ttl_s, purpose = self.ttl_for(call), "warmup" if call.warmup else "miss"
        led = [self.inflight.lead(slots[i], lambda flight, keys=Keys(full=slots[i]): self._compute_and_store(
            one, keys, ttl_s, flight, purpose=purpose)) for i in drawn.lead]
        followed = [flight for i in drawn.follow if (flight := self.inflight.get(slots[i])) is not None]
        reply = Reply(served="miss" if led else "shared", ttl_s=ttl_s if led else None,
                      key=slots[drawn.slots[0]] if n == 1 else None, bucket=label,
                      miss_reason=BUCKET_FILLING if led else None)
        if n == 1:
            reply.chunks = _served_by_whom(reply, led[0]) if led else followed[0].follow(batch_s=STREAM_BATCH_S)
            return reply

        def computed_elsewhere() -> None:  # a fleet's other node led every fill this one took
            if all(getattr(flight, "led_elsewhere", False) for flight in led):
                reply.served, reply.ttl_s, reply.miss_reason = "shared", None, None

        reply.chunks = buckets.gathered([*led, *followed], [stored[i] for i in drawn.serve], batch_s=STREAM_BATCH_S,
                                        before_answer=computed_elsewhere)
        return reply

    async def _probe(self, call: Call, keys: Keys, policy: CachePolicy) -> Probe | None:
        """The semantic probe of a call, or None when the semantic layer has no part in it: off, not a first-turn
        chat prompt, or a prompt longer than the embedder takes whole."""
        if self.semantic is None or not policy.semantic:
            return None
        probe = self._probe_of(call, keys)
        if probe is None or not await self.semantic.accepts(probe.text):
            return None
        return probe

    def _probe_of(self, call: Call, keys: Keys) -> Probe | None:
        """The call's probe; its namespace leaves ``max_tokens`` out where its key does, so a candidate computed or
        taught for another limit is found and serves this one under the store's rule."""
        return probe_for(call.request, self.engine.version, any_max_tokens=keys.any_max_tokens is not None)

    async def _uncached(self, call: Call, reason: str) -> Reply:
        await self._refuse_early(call)
        return Reply(served="miss", chunks=self._engine_stream(call, "warmup" if call.warmup else "miss"),
                     miss_reason=reason)

    async def _why_missed(self, call: Call, key: str, store: ResultStore, policy: CachePolicy,
                          found: SemanticAnswer | None) -> str:
        """Why a call that reached this point must be computed: one reason of :mod:`edgecache.ledger`'s. Only misses
        pay for it (a look at the key's history, and at most one store read)."""
        if not policy.read:
            return POLICY
        history = self.ledger.history
        gone = history.why_gone(key)
        if gone == EVICTED and (call.ttl_s is not None or call.max_age_s is not None) and \
                (store.get_memory(key) or await store.get(key)) is not None:
            return POLICY  # still there, but older than this caller accepts
        if gone is not None:
            return gone
        if found is not None:
            if found.lookup.refusal is not None:
                return semantic_reason(found.lookup.refusal)
            if found.dropped == "too_old":
                return POLICY
            if found.dropped == "gone" and found.lookup.candidate is not None:
                return history.why_gone(found.lookup.candidate.store_key) or EVICTED
        return FIRST_SEEN

    async def _refuse_early(self, call: Call) -> None:
        self.admission.refuse_if_full(call.tenant, call.tenant_limit)
        await self.engine.check_prompt(call.request)
        self.admission.refuse_if_full(call.tenant, call.tenant_limit)  # the check awaited: look again

    async def _exact(self, call: Call, keys: Keys, store: ResultStore) -> Reply | None:
        """The stored answer for the call: under its full key (an answer made for exactly its ``max_tokens``: a
        warmup line's, one that cannot be cut), else under its key without ``max_tokens`` where that answer covers
        the call's (cut to it where it is longer). Memory first for both, so a hot hit never leaves the event
        loop, except a warmup line's given answer, whose prompt is counted for this request on the tokenizer's
        thread (:meth:`_prompt_tokens`)."""
        free = keys.any_max_tokens
        if free is None:
            reply = self._exact_reply(call, keys.full, store.get_memory(keys.full) or await store.get(keys.full))
        else:
            reply = (self._exact_reply(call, keys.full, store.get_memory(keys.full))
                     or self._exact_reply(call, free, store.get_memory(free))
                     or self._exact_reply(call, keys.full, await store.get(keys.full))
                     or self._exact_reply(call, free, await store.get(free)))
        if reply is not None and reply.answer is not None and reply.answer.prompt_tokens == 0:
            # A warmup line's given answer counts no prompt (its 0 marks it as given, in the store): served, it
            # counts this request's, where the engine counts them itself.
            own = await self._prompt_tokens(call)
            if own:
                reply.answer = msgspec.structs.replace(reply.answer, prompt_tokens=own)
        return reply

    def _exact_reply(self, call: Call, key: str, answer: CachedAnswer | None) -> Reply | None:
        if answer is None or not _fresh_enough(answer, call):
            return None
        if answer.token_ends is not None:  # stored under a key without max_tokens
            answer = self._cuts.serve(answer, call.request.params.max_tokens)
            if answer is None:
                return None
        return Reply(served="exact", answer=answer, ttl_s=answer.expires_at - time.time(), key=key)

    async def _semantic_once(self, call: Call, keys: Keys, probe: Probe, policy: CachePolicy) -> SemanticAnswer:
        """The semantic lookup, once per key at a time: a burst of identical requests embeds once and writes a
        semantic hit under the key once; the others share the outcome (their label: ``shared``)."""
        key = keys.full
        pending = self._semantic_lookups.get(key)
        if pending is not None:
            return msgspec.structs.replace(await asyncio.shield(pending), first=False)
        pending = asyncio.ensure_future(self._semantic_answer(call, keys, probe, policy))
        self._semantic_lookups[key] = pending
        pending.add_done_callback(lambda done: self._semantic_lookups.pop(key, None)
                                  if self._semantic_lookups.get(key) is done else None)
        # Shielded: the first caller leaving (its client gone) must not cancel the lookup others wait on.
        return await asyncio.shield(pending)

    async def _semantic_answer(self, call: Call, keys: Keys, probe: Probe, policy: CachePolicy) -> SemanticAnswer:
        found = await self._semantic_decide(call, keys, probe, policy)
        if found.answer is None and found.lookup.similarity is not None:
            # How near the nearest candidate of a miss was: where a scenario's misses sit against its cut.
            self.metrics.semantic_miss_similarity.labels(call.scenario).observe(found.lookup.similarity)
        if found.lookup.similarity is not None and found.dropped is None:  # (a dropped hit was neither)
            self.metrics.near_cut.observe(call.tenant, call.scenario, found.lookup.similarity,
                                          served=found.answer is not None)
        if self.decisions is None:
            return found
        return msgspec.structs.replace(found, decision_id=record_lookup(
            self.decisions, call.tenant, call.scenario, probe.text, found.lookup, served=found.answer is not None,
            dropped=found.dropped))

    async def _semantic_decide(self, call: Call, keys: Keys, probe: Probe, policy: CachePolicy) -> SemanticAnswer:
        assert self.semantic is not None
        lookup = await self.semantic.lookup(call.tenant, call.scenario, probe)
        if lookup.hit is not None and self.marks is not None and any(
                self.marks.refuses(call.tenant, key, lookup.hit.store_key)
                for key in (keys.full, keys.any_max_tokens) if key is not None):
            lookup = msgspec.structs.replace(lookup, refusal=refusals.MARKED_WRONG)
        if lookup.score is not None:
            self.metrics.semantic_verifier_score.labels(call.scenario).observe(lookup.score)
        if lookup.refusal is not None:
            self.metrics.semantic_refusals.labels(call.scenario, lookup.refusal).inc()
        if lookup.explored:
            self.metrics.semantic_explorations.labels(call.tenant, call.scenario).inc()
        if lookup.refused_by_guard is not None:
            self.metrics.semantic_guard_rejections.labels(guard_rule_of(lookup.refused_by_guard)).inc()
        hit = lookup.hit
        if hit is None:
            return SemanticAnswer(lookup=lookup)
        store = self.stores(call.tenant)
        answer = await store.get(hit.store_key)
        # In a namespace without max_tokens (this request's key leaves it out) a candidate's answer serves this
        # request's max_tokens when it covers it, cut where it is longer; one without token ends serves none.
        served = answer if answer is None or keys.any_max_tokens is None else \
            self._cuts.serve(answer, call.request.params.max_tokens)
        if answer is None or served is None:
            # The answer expired or was evicted (or no longer covers the limit): its vector goes too, and this is
            # a miss.
            await self.semantic.forget(call.tenant, call.scenario, probe, hit.vector_key, hit.store_key)
            return SemanticAnswer(lookup=lookup, dropped="gone")
        if not _fresh_enough(answer, call):
            return SemanticAnswer(lookup=lookup, dropped="too_old")
        # The candidate's usage counts the candidate's prompt (a warmup line's given answer counts none); served to
        # this request, and kept under its key, it counts this request's: what the client is told it sent, and the
        # prefill the ledger says this hit saved.
        own = await self._prompt_tokens(call)
        if own is not None:
            answer = msgspec.structs.replace(answer, prompt_tokens=own)
            served = msgspec.structs.replace(served, prompt_tokens=own)
        # Kept under this request's own key too (unless it writes nothing): its repeats are exact hits. Whole:
        # under a key without max_tokens it serves this request's other limits too.
        key = keys.for_answer(answer)
        if policy.write and await store.put(key, answer, tag=call.scenario):
            self.ledger.history.stored(call.tenant, call.scenario, key, answer.expires_at)
        return SemanticAnswer(lookup=lookup, answer=served, similarity=hit.similarity, stored_as=key)

    async def _prompt_tokens(self, call: Call) -> int | None:
        """``call``'s prompt tokens where the engine counts them itself (a model's tokenizer in this process: the
        engines that count answers in tokens); None behind an upstream, whose count would cost an engine call."""
        if not isinstance(self.engine, AnswerTokens):
            return None
        try:
            return await self.engine.count_tokens(call.request)
        except EdgeCacheError:
            return None

    async def store_known_answers(self, known: Sequence[tuple[Call, str]]) -> list[bool | None]:
        """Warmup: keep each ``text`` as the answer to its ``call``, in the store and (first-turn chat) the semantic
        index, as if the engine had written it. Per item: True written, False already answered (in the store, or
        earlier in ``known``), None when the store refused the write (a full disk: counted by the store). Batched
        all the way down: one read per tenant of what its store holds under the lines' keys
        (:meth:`~edgecache.stores.ResultStore.get_many`), one write transaction per tenant, embeddings in large
        batches, one index insert per index.

        Where the request's key can leave ``max_tokens`` out (a prefix-stable engine's), the answer is counted in
        the model's tokens and kept there: it serves every ``max_tokens``, cut with finish ``length`` where it is
        longer, and it replaces an answer computed for the request before it was taught (a taught answer has no
        prompt tokens; a computed one has). Elsewhere, and where the tokens do not spell the answer back, it stays
        under the key with ``max_tokens`` and serves that limit only (the store's answers under those keys are read
        in a second batch). A line whose key without ``max_tokens`` already holds this very answer, taught
        (:func:`_taught_as`: a warmup run again), is not counted. Its prompt tokens are stored as 0, which marks
        it as given; a hit of it counts the request's own where the engine counts tokens (:meth:`_exact`)."""
        keys_of = [self._keys_of(call) for call, _ in known]
        counted = isinstance(self.engine, AnswerTokens)
        # Where each answer goes unless its tokens do not spell it back.
        likely = [keys.any_max_tokens if counted and keys.any_max_tokens is not None else keys.full
                  for keys in keys_of]
        held: dict[tuple[str, str], CachedAnswer | None] = {}
        await self._read_held(held, [(call.tenant, key) for (call, _), key in zip(known, likely)])
        todo = [i for i, ((call, text), keys) in enumerate(zip(known, keys_of))
                if likely[i] == keys.full or not _taught_as(text, held[call.tenant, likely[i]])]
        ends = await self._answer_ends([known[i] for i in todo], [keys_of[i] for i in todo])
        now = time.time()
        answers = {i: CachedAnswer(text=known[i][1], finish_reason="stop", prompt_tokens=0,
                                   completion_tokens=len(found_ends or ()), created_at=now,
                                   expires_at=now + self.ttl_for(known[i][0]), token_ends=found_ends)
                   for i, found_ends in zip(todo, ends)}
        keys = {i: keys_of[i].for_answer(answer) for i, answer in answers.items()}
        await self._read_held(held, [(known[i][0].tenant, keys[i]) for i in todo])  # the full keys not read yet
        outcome: list[bool | None] = [False] * len(known)
        by_tenant: dict[str, list[int]] = {}
        seen: set[tuple[str, str]] = set()
        for i in todo:
            tenant = known[i][0].tenant
            if (tenant, keys[i]) not in seen:  # a repeated line is "already answered"
                seen.add((tenant, keys[i]))
                by_tenant.setdefault(tenant, []).append(i)
        for tenant, items in by_tenant.items():
            store = self.stores(tenant)
            fresh = []
            for i in items:
                there = held[tenant, keys[i]]
                if there is not None and keys[i] == keys_of[i].any_max_tokens and there.prompt_tokens > 0:
                    await store.delete(keys[i])  # computed: replaced (the memory copy too, which a bulk write skips)
                    there = None
                if there is None:
                    fresh.append(i)
            stored = await store.put_many([(keys[i], answers[i], known[i][0].scenario) for i in fresh])
            for i in fresh:
                outcome[i] = True if stored else None
                if stored:
                    self.ledger.history.stored(tenant, known[i][0].scenario, keys[i], answers[i].expires_at)
            if stored and self.semantic is not None:
                await self._index_known(tenant, [(known[i][0], keys_of[i], keys[i]) for i in fresh])
        return outcome

    async def _read_held(self, held: dict[tuple[str, str], CachedAnswer | None],
                         wanted: Sequence[tuple[str, str]]) -> None:
        """Add to ``held`` what each tenant's store holds under the ``(tenant, key)`` pairs it lacks: one batched
        read per tenant (none where it lacks nothing)."""
        by_tenant: dict[str, dict[str, None]] = {}
        for tenant, key in wanted:
            if (tenant, key) not in held:
                by_tenant.setdefault(tenant, {})[key] = None
        for tenant, unique in by_tenant.items():
            found = await self.stores(tenant).get_many(list(unique))
            held.update(((tenant, key), answer) for key, answer in zip(unique, found))

    def _keys_of(self, call: Call) -> Keys:
        return call_keys(call, self.engine.version, prefix_stable_of(self.engine))

    async def _answer_ends(self, known: Sequence[tuple[Call, str]], keys_of: list[Keys]) -> list[tuple[int, ...] | None]:
        """The token ends of each given answer whose key can leave ``max_tokens`` out (None for the rest)."""
        ends: list[tuple[int, ...] | None] = [None] * len(known)
        counted = [i for i, keys in enumerate(keys_of) if keys.any_max_tokens is not None]
        if counted and isinstance(self.engine, AnswerTokens):
            for i, found in zip(counted, await self.engine.answer_token_ends([known[i][1] for i in counted])):
                ends[i] = found
        return ends

    async def _index_known(self, tenant: str, calls: list[tuple[Call, Keys, str]]) -> None:
        assert self.semantic is not None
        probed = [(call, probe, key) for call, keys, key in calls
                  if (probe := self._probe_of(call, keys)) is not None
                  and await self.semantic.accepts(probe.text)]  # a prompt the embedder cuts is not indexed
        if not probed:
            return
        vectors = await self.semantic.embed_many([probe.text for _, probe, _ in probed])
        by_scenario: dict[str, list[tuple[Probe, np.ndarray, str]]] = {}
        for (call, probe, key), vector in zip(probed, vectors):
            by_scenario.setdefault(call.scenario, []).append((probe, vector, key))
        for scenario, items in by_scenario.items():
            await self.semantic.remember_many(tenant, scenario, items)

    async def teach_groups(self, grouped: Sequence[tuple[Call, str]]) -> int:
        """Warmup: ``(call, group)`` of grouped lines, each stored with its group's answer, teach the semantic
        learner (:meth:`SemanticCache.teach`) per tenant and scenario; the labels taught (0 without a learner)."""
        if self.semantic is None or self.semantic.learner is None:
            return 0
        counted = isinstance(self.engine, AnswerTokens)
        by_pool: dict[tuple[str, str], list[tuple[Probe, str, str]]] = {}
        for call, group in grouped:
            keys = self._keys_of(call)
            probe = self._probe_of(call, keys)
            if probe is None or not await self.semantic.accepts(probe.text):
                continue  # not indexed, so never anyone's candidate
            # Where store_known_answers kept the line's answer.
            key = keys.any_max_tokens if keys.any_max_tokens is not None and counted else keys.full
            by_pool.setdefault((call.tenant, call.scenario), []).append((probe, key, group))
        taught = 0
        for (tenant, scenario), items in by_pool.items():
            taught += await self.semantic.teach(tenant, scenario, items)
        return taught

    async def store_known_answer(self, call: Call, text: str) -> bool:
        """:meth:`store_known_answers` for one call: False when it already has an answer or was not stored."""
        return bool((await self.store_known_answers([(call, text)]))[0])

    async def _engine_stream(self, call: Call, purpose: str) -> AsyncIterator[Chunk]:
        """One engine call, inside an admission slot (raises Overloaded, a 429, when none is to be had) and within
        the plan's engine time (a 400 past it), metered for the ledger under ``purpose`` (miss, explore, warmup)."""
        async with (self.admission.slot(call.tenant, call.tenant_limit),
                    aclosing(self.engine.generate(call.request)) as stream,
                    aclosing(within_engine_time(stream, call.engine_time_s)) as bounded,
                    aclosing(metered_stream(self.ledger, self.metrics, bounded, call.tenant, call.scenario,
                                            purpose)) as chunks):
            async for chunk in chunks:
                yield chunk

    async def _in_flight(self, call: Call, keys: Keys, store: ResultStore) -> Reply | None:
        """2. A running flight that answers the call: one of its own key; else, for a prefix-stable request without
        stop strings, one this node leads for another ``max_tokens``. A leader of a larger limit is followed and cut
        at the call's (:func:`cut_follow`). A smaller one is waited for, and serves when its stored answer covers the
        call (it ended by itself); otherwise the call goes on to compute."""
        flight = self.inflight.get(keys.full)
        if flight is not None:
            return Reply(served="shared", chunks=flight.follow(batch_s=STREAM_BATCH_S), key=keys.full)
        leaders = self._leaders.get(keys.any_max_tokens) if keys.any_max_tokens is not None else None
        if not leaders:
            return None
        limit = call.request.params.max_tokens
        larger = [leader for leader in leaders if leader > limit]
        if larger:
            return Reply(served="shared", chunks=cut_follow(leaders[min(larger)], limit), key=keys.any_max_tokens)
        await _ended(leaders[max(leaders)])
        reply = await self._exact(call, keys, store)
        if reply is not None:
            reply.served = "shared"
        return reply

    async def _lead(self, call: Call, keys: Keys, ttl_s: float, flight: SharedFlight, probe: Probe | None,
                    lookup: Lookup | None, decision_id: str | None, purpose: str) -> None:
        """A flight this node computes: while it runs, a call of the same request for another ``max_tokens`` finds
        it (:meth:`_in_flight`), where the request is prefix-stable and has no stop strings (a stop string may end
        a shorter answer where the longer one's text was held back)."""
        free, limit = keys.any_max_tokens, call.request.params.max_tokens
        if free is None or call.request.params.stop:
            return await self._compute_and_store(call, keys, ttl_s, flight, probe, lookup, decision_id, purpose)
        self._leaders.setdefault(free, {})[limit] = flight
        try:
            await self._compute_and_store(call, keys, ttl_s, flight, probe, lookup, decision_id, purpose)
        finally:
            leaders = self._leaders.get(free)
            if leaders is not None and leaders.get(limit) is flight:
                del leaders[limit]
                if not leaders:
                    del self._leaders[free]

    async def _compute_and_store(self, call: Call, keys: Keys, ttl_s: float, flight: SharedFlight,
                                 probe: Probe | None = None, lookup: Lookup | None = None,
                                 decision_id: str | None = None, purpose: str = "miss") -> None:
        final: Chunk | None = None
        async with aclosing(self._engine_stream(call, purpose)) as stream:
            async for chunk in stream:
                flight.publish(chunk)
                if chunk.finish_reason is not None:
                    final = chunk
        if final is None:
            raise EngineError("the engine ended its stream without a finish reason")
        # Streaming listeners have the whole answer now (the final chunk is out). The flight finishes only once
        # the answer is stored and its vector indexed: a non-streaming reply waits for that, so a client that has
        # its answer and asks again (or asks a paraphrase) finds it in every layer. Finishing before the writes
        # let a quick repeat miss the index: the guard-rejection test failed about 1 run in 17 that way.
        try:
            now = time.time()
            first = final.choices[0] if final.choices else None
            text = first.text if first else "".join(c.text for c in flight.chunks)
            # Token ends let the answer serve other max_tokens: kept only where the key leaves max_tokens out.
            ends = final.token_ends if keys.any_max_tokens is not None and first is None else None
            answer = CachedAnswer(
                text=text,
                finish_reason=first.finish_reason if first else final.finish_reason,
                prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens,
                created_at=now, expires_at=now + ttl_s, choices=final.choices,
                stop_sequence=first.stop_sequence if first else final.stop_sequence,
                token_ends=ends, max_tokens=call.request.params.max_tokens if ends is not None else 0)
            store = self.stores(call.tenant)
            key = keys.for_answer(answer)
            if await store.put(key, answer, tag=call.scenario):
                self.ledger.history.stored(call.tenant, call.scenario, key, now + ttl_s)
            if probe is not None and lookup is not None and self.semantic is not None:
                vector = (lookup.vector if lookup.vector is not None
                          else await self.semantic.batcher.embed(probe.text))
                await self.semantic.remember(call.tenant, call.scenario, probe, vector, key)
            if self.labels is not None and lookup is not None:
                # A refused (or explored) candidate meets the answer it was refused for: a label, off this path.
                self.labels.after_miss(call, decision_id, lookup, text, key)
        finally:
            # A failed write must not fail the answer its listeners already have (the error still reaches the
            # flight's task, which logs it).
            flight.finish()


async def cut_follow(flight: SharedFlight, limit: int) -> AsyncIterator[Chunk]:
    """A leader's stream as the engine writes it for a smaller ``limit`` (the leader's request but for its
    ``max_tokens``, without stop strings): its text to the end of the ``limit``-th token and finish ``length``, or
    the whole answer when it ends by itself first. Live: cut as soon as the leader's text chunks report that token's
    end (:attr:`Chunk.token_ends`) and the prompt's counts, else at the leader's end."""
    text = sent = ""   # the leader's text so far, and how much of it went out
    ends: list[int] = []
    counted = True     # every text chunk so far said where its tokens end
    async with aclosing(flight.follow(batch_s=STREAM_BATCH_S)) as chunks:
        async for chunk in chunks:
            if chunk.finish_reason is None:
                text += chunk.text
                counted = counted and chunk.token_ends is not None
                ends.extend(chunk.token_ends or ())
                if not counted:
                    continue  # where the cut falls is known at the leader's end
                if len(ends) < limit:
                    if len(text) > len(sent):  # all of it is within the cut: it ends before the limit-th token
                        yield Chunk(text=text[len(sent):])
                        sent = text
                    continue
                if chunk.prompt_tokens and ends[limit - 1] <= len(text.encode()):
                    final = Chunk(finish_reason="length", prompt_tokens=chunk.prompt_tokens, completion_tokens=limit,
                                  cached_tokens=chunk.cached_tokens, token_ends=tuple(ends[:limit]))
                    async for piece in _rest(sent, cut_text(text, ends[limit - 1]), final):
                        yield piece
                    return
                continue
            whole = CachedAnswer(text=text + chunk.text, finish_reason=chunk.finish_reason,
                                 prompt_tokens=chunk.prompt_tokens, completion_tokens=chunk.completion_tokens,
                                 created_at=0.0, expires_at=0.0, stop_sequence=chunk.stop_sequence,
                                 token_ends=chunk.token_ends, max_tokens=limit + 1)
            served = serve_within(whole, limit)
            if served is None:
                raise EngineError("the answer this request followed cannot be cut to its max_tokens; retry")
            final = Chunk(finish_reason=served.finish_reason, prompt_tokens=chunk.prompt_tokens,  # type: ignore[arg-type]
                          completion_tokens=served.completion_tokens, cached_tokens=chunk.cached_tokens,
                          stop_sequence=served.stop_sequence, token_ends=served.token_ends)
            async for piece in _rest(sent, served.text, final):
                yield piece
            return


async def _rest(sent: str, text: str, final: Chunk) -> AsyncIterator[Chunk]:
    """The end of a cut stream: what ``text`` adds to the ``sent`` text, then ``final``."""
    if not text.startswith(sent):
        raise EngineError("the answer this request followed changed under it; retry")
    if len(text) > len(sent):
        yield Chunk(text=text[len(sent):])
    yield final


async def _ended(flight: SharedFlight) -> None:
    """Once ``flight`` has ended, its answer stored (or failed: then nothing is)."""
    with suppress(EdgeCacheError):
        async with aclosing(flight.follow()) as chunks:
            async for _ in chunks:
                pass


async def _served_by_whom(reply: Reply, flight: SharedFlight) -> AsyncIterator[Chunk]:
    """The flight's chunks; once the first is out, the reply says whether another node of a fleet computed it (the
    flight then followed that node's stream: ``shared``). The HTTP layer reads ``served`` after the first chunk."""
    async with aclosing(flight.follow(batch_s=STREAM_BATCH_S)) as chunks:
        async for chunk in chunks:
            if getattr(flight, "led_elsewhere", False):
                reply.served, reply.ttl_s = "shared", None
            yield chunk


async def metered_stream(ledger: Ledger, metrics: Metrics, chunks: AsyncIterator[Chunk], tenant: str, scenario: str,
                         purpose: str) -> AsyncIterator[Chunk]:
    """An engine call's chunks, metered for the ledger: its share of the engine's busy time is charged to
    ``tenant``/``scenario`` under ``purpose`` (to its prefill until its first output, to its decode after), and its
    token counts reach the ledger and the engine's counters. A call that fails or is abandoned is charged its time."""
    meter = ledger.meter
    metered = meter.start(tenant, scenario, purpose)
    try:
        async for chunk in chunks:
            if chunk.finish_reason is not None:
                metrics.observe_engine_call(chunk.prompt_tokens, chunk.cached_tokens, chunk.completion_tokens)
                # Ended before the chunk goes out: the engine's work is done, whatever the consumer does next.
                metered.kv_tier, metered.kv_miss = chunk.cache_tier, chunk.kv_miss
                meter.end(metered, (chunk.prompt_tokens, chunk.cached_tokens, chunk.completion_tokens))
            elif not metered.decoding:
                meter.first_output(metered)
            yield chunk
    finally:
        meter.end(metered)
