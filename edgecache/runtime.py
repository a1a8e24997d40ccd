"""Everything one running server holds, built from :class:`~edgecache.settings.Settings`: the tenants, the
per-tenant result stores, the in-flight table, admission, the TTL classifier, the metrics, and (once loaded) the
engine, the semantic cache and the request pipeline that composes them.

The app factory (:mod:`edgecache.http.app`) puts one :class:`Runtime` on ``app.state`` and runs its lifespan; the HTTP
handlers only read from it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from edgecache.admission import AdmissionGate
from edgecache.call import Call
from edgecache.engines.base import Chunk, Engine, GenerationRequest, TieredPrefixEngine
from edgecache.engines.kv_tiers import COMPONENT as KV_DISK
from edgecache.engines.kv_tiers import TIERS, tenant_of
from edgecache.errors import EdgeCacheError, NotReady
from edgecache.health import READY, Health, HealthChecks, StorageFaults
from edgecache.inflight import FlightTable
from edgecache.inflight.local import InflightTable
from edgecache.ledger import Ledger
from edgecache.metrics import NEAR_CUT_EDGES, Metrics
from edgecache.pipeline import RequestPipeline, metered_stream
from edgecache.semantic.assembly import SemanticLayer
from edgecache.semantic.cache import SemanticCache
from edgecache.semantic.decision_log import DecisionLog
from edgecache.semantic.index import TenantBounds, TenantUsage
from edgecache.semantic.judge import JudgeCheckResult, ModelJudgeLabeler, check_judge
from edgecache.semantic.labeling import AnswerEmbeddingLabeler, EqualityLabeler, FirstVerdict, Labeler, MissLabels
from edgecache.semantic.learner import SemanticLearner
from edgecache.semantic.lookup import Lookup
from edgecache.semantic.marks import MarkedWrong
from edgecache.settings import Settings
from edgecache.stores import ResultStores
from edgecache.stores.disk import TenantStores
from edgecache.tenants import Plan, TenantDirectory
from edgecache.ttl_tiers import TtlClassifier

if TYPE_CHECKING:
    from edgecache.canary import CanaryReport
    from edgecache.fleet import Fleet

log = logging.getLogger("edgecache")

SHUTDOWN_GRACE_S = 30.0
#: How often a changed ledger is written to the data dir (and at shutdown): a crash loses at most this much of it.
LEDGER_SAVE_INTERVAL_S = 30.0


class Runtime:
    """Everything one running app holds, on ``app.state.runtime``. Built by the lifespan, closed in reverse.

    The store opens at once; the engine and the embedder load in the background (:meth:`load`), and the request
    pipeline is assembled when both are ready. Until then every model route answers 503.
    """

    def __init__(self, settings: Settings, engine: Engine, tenants: TenantDirectory) -> None:
        self.settings = settings
        self.engine = engine
        self.tenants = tenants
        self.metrics = Metrics()
        # What the cache saved and the engine spent, per tenant: kept under the data dir across restarts.
        led = settings.ledger
        self.ledger = Ledger(path=settings.data_path / "ledger" / "ledger.json", price_per_hour=led.price_per_hour,
                             currency=led.currency, fit_min_calls=led.fit_min_calls,
                             fit_half_life_calls=led.fit_half_life_calls,
                             parallel_calls=getattr(engine, "parallel_calls", None))
        self.metrics.registry.register(self.ledger.collector())
        self._ledger_saved_at = time.monotonic()
        # /health is the worst of these checks; a layer added later (a shared store) registers its own.
        self.health = HealthChecks()
        self.storage_faults = StorageFaults(self.metrics.storage_failures)
        self.damaged_dir = settings.data_path / "damaged"
        self.inflight: FlightTable = InflightTable()
        self.fleet: Fleet | None = None
        self.stores: ResultStores
        if settings.store.backend == "redis":
            from edgecache.fleet import Fleet
            from edgecache.stores.redis import RedisTenantStores

            self.fleet = Fleet(settings, on_flush=self.apply_remote_flush, on_link_state=self.metrics.observe_redis,
                               on_skip=lambda feed: self.metrics.fleet_records_skipped.labels(feed).inc())
            self.health.register("redis", self.fleet.health_check)
            from edgecache.inflight.redis import RedisFlightTable

            fleet = self.fleet
            self.inflight = RedisFlightTable(fleet.link, node_id=fleet.node_id, epoch=lambda: fleet.events.epoch,
                                             lease_s=settings.store.redis_lease_s)
            self.stores = RedisTenantStores(self.fleet.link, quota_for=self.quota_for,
                                            memory_bytes=settings.store.memory_bytes,
                                            model_version=lambda: self.engine.version)
        else:
            self.stores = TenantStores(settings.data_path / "results", quota_for=self.quota_for,
                                       memory_bytes=settings.store.memory_bytes, faults=self.storage_faults,
                                       damaged_dir=self.damaged_dir)
        adm = settings.admission
        # An engine that runs one call at a time gets one: the rest wait in the gate's fair queue, not in the engine.
        parallel = getattr(self.engine, "parallel_calls", None)
        running = min(adm.max_concurrent_misses, parallel) if parallel else adm.max_concurrent_misses
        self.admission = AdmissionGate(max_running=running, max_queue=adm.max_queue,
                                       queue_timeout_s=adm.queue_timeout_s, turn_timeout_s=adm.turn_timeout_s,
                                       retry_after_s=adm.retry_after_s, weight_of=self.engine_weight_for)
        self.metrics.track_admission(self.admission)
        self.metrics.ttft_p99_target_seconds.set(settings.slo.ttft_p99_s)
        self.ttl = TtlClassifier(settings.ttl_tiers)
        # The semantic layer (optional): opened once the engine is up, re-opened if its storage failed.
        self.semantic_layer: SemanticLayer | None = None
        if settings.semantic.enabled:
            self.semantic_layer = SemanticLayer(
                settings, faults=self.storage_faults, damaged_dir=self.damaged_dir, cap_for=self.vector_cap_for,
                may_explore=self.admission.is_free, observe_embed=self.metrics.embed_seconds.observe,
                observe_search=self.metrics.semantic_search_seconds.observe, fleet=self.fleet)
        self.pipeline: RequestPipeline | None = None
        # Called after every flush, here or from another node (the HTTP front forgets what it memoised).
        self.flush_listeners: list[Callable[[str | None, str | None], None]] = []
        self.ready = False
        self.load_error: str | None = None
        self.canary: CanaryReport | None = None  # what the start-up self-test settled on, when it ran
        self.health.register("model", self._model_health)
        self.health.register("results", self.storage_faults.check("results"))
        if settings.semantic.enabled:
            assert self.semantic_layer is not None
            self.health.register("semantic", self.semantic_layer.health)
        if isinstance(engine, TieredPrefixEngine):  # prefix states in tiers EdgeCache keeps: budgets, faults
            engine.attach(share_for=self.prefix_share_for, faults=self.storage_faults)
            if engine.has_disk_tier:
                self.health.register(KV_DISK, self.storage_faults.check(KV_DISK))
        self.decisions: DecisionLog | None = None
        self.labels: MissLabels | None = None
        # Candidates the callers marked wrong for a request (POST /v1/feedback), refused for it from then on.
        self.marks = MarkedWrong(settings.data_path / "feedback" / "marked.msgpack",
                                 max_entries=settings.server.feedback_responses)
        self.judge: ModelJudgeLabeler | None = None  # the served model as labeler, where it may judge
        self.judge_check: JudgeCheckResult | None = None
        if settings.semantic.enabled and settings.semantic.decision_log_bytes > 0:
            self.decisions = DecisionLog(
                settings.data_path / "decisions", max_bytes=settings.semantic.decision_log_bytes,
                files=settings.semantic.decision_log_files, keeps_prompts=self.keeps_prompts,
                faults=self.storage_faults, on_drop=self.metrics.decision_log_dropped.inc)
            self.health.register("decisions", self.storage_faults.check("decisions"))
        self.started_at = int(time.time())
        self._background: list[asyncio.Task[None]] = []

    async def load(self) -> None:
        try:
            if self.fleet is not None:
                await self.fleet.start()  # a Redis that is down does not stop the node: it serves on its own
            await self.engine.start()
        except EdgeCacheError as exc:
            self.load_error = exc.message
            log.error("loading the model failed: %s", exc.message)
            return
        except Exception as exc:  # a load failure must show on /health, not kill the server silently
            self.load_error = f"{type(exc).__name__}: {exc}"
            # One line for the operator; the traceback only at debug level (it is llama.cpp's, not theirs).
            log.error("loading the model failed: %s", self.load_error)
            log.debug("model load traceback", exc_info=exc)
            return
        layer = self.semantic_layer
        if layer is not None:
            await layer.open()
            await layer.teach_taught()
            if self.decisions is not None:
                await layer.teach_from_log(self.decisions)
        if self.decisions is not None or self.learner is not None:
            self.labels = MissLabels(stores=self.stores, labeler=self._labeler(), decisions=self.decisions,
                                     observe=self._observe_label, busy=lambda: not self.admission.is_free())
        self.pipeline = RequestPipeline(engine=self.engine, stores=self.stores, inflight=self.inflight,
                                        metrics=self.metrics, ttl_for=self.ttl_for, admission=self.admission,
                                        semantic=self.semantic, decisions=self.decisions, labels=self.labels,
                                        marks=self.marks, ledger=self.ledger)
        if layer is not None:
            layer.on_open.append(self.pipeline.use_semantic)
        self._background.append(asyncio.create_task(self._housekeeping(), name="housekeeping"))
        if self.judge is not None and not self.judge.trusted:
            self._background.append(asyncio.create_task(self._check_judge(self.judge), name="judge-check"))
        if self.fleet is not None:
            await self.fleet.events.announce_model(self.engine.version)
        self.ready = True
        log.info("model %s ready (%s)%s", self.engine.model_id, self.engine.version,
                 f", embedder {self.semantic.embedder.version}" if self.semantic else "")

    def _observe_label(self, call: Call, lookup: Lookup, answer_key: str, good: bool | None) -> None:
        """A label of a semantic decision (None: could not tell): counted, and taught to the learner."""
        self.metrics.observe_label(call.tenant, call.scenario, "explore" if lookup.explored else "refused", good)
        if self.semantic_layer is not None:
            self.semantic_layer.learn(call.tenant, call.scenario, lookup, answer_key, good)

    def near_cut(self, tenant: str | None = None) -> dict[str, object]:
        """The semantic layer near its cut, for /stats (only ``tenant``'s rows when named): per ``tenant/scenario``
        the lookups that found a candidate by its similarity (bins between ``edges``), served and refused; the
        scenario's target false-hit rate; the cosine cut where one is set (a threshold rule, or the learner's
        prior); and the false-hit estimates, the learner's (``learner``) and the labelled served decisions'
        (``labelled``), each None where there is none."""
        pools = {}
        if self.semantic is not None and (learned := self.semantic.learned()) is not None:
            pools = learned["pools"]  # type: ignore[assignment]
        labelled = self.metrics.label_summary()
        rows: dict[str, object] = {}
        for name, counts in self.metrics.near_cut.report(tenant).items():
            who, scenario = name.split("/", 1)
            configured = self.settings.scenarios.get(scenario)
            rule = self.semantic.rule_for(who, scenario) if self.semantic is not None and configured else None
            pool = pools.get(name)  # type: ignore[attr-defined]
            rows[name] = {**counts,
                          "target_false_hit_rate": rule.target_false_hit_rate if rule is not None else None,
                          "threshold": rule.threshold if rule is not None else None,
                          "learner": ({"false_hit_rate": pool["false_hit_rate"],
                                       "false_hit_upper": pool["false_hit_upper"], "lookups": pool["lookups"],
                                       "labels": pool["labels"]} if pool is not None else None),
                          "labelled": labelled.get(name)}
        return {"decision": self.settings.semantic.decision, "edges": list(NEAR_CUT_EDGES), "by_tenant_scenario": rows}

    def judge_wanted(self) -> bool:
        """Whether the served model is asked to judge: ``label_judge``, or unset, where the engine serves a model
        that can (a GPU engine, an upstream's), never the CPU default's small model."""
        wanted = self.settings.semantic.label_judge
        return wanted if wanted is not None else self.settings.engine.kind in ("sglang", "openai")

    def judge_status(self) -> dict[str, object]:
        """For /stats: whether labels come from the served model as judge, and why (not)."""
        bar = self.settings.semantic.label_judge_min_agreement
        if self.judge is None:
            why = ("semantic.label_judge = false" if self.settings.semantic.label_judge is False else
                   f"the {self.settings.engine.kind} engine's model is not asked to judge (semantic.label_judge "
                   "unset: on for sglang and openai only)")
            return {"state": "off", "why": why}
        status: dict[str, object] = {"state": "checking", "min_agreement": bar, "asked": self.judge.asked}
        if self.judge_check is not None:
            status["check"] = msgspec.to_builtins(self.judge_check)
        if self.judge.trusted:
            status["state"] = "on"
        elif self.judge_check is not None:
            status["state"] = "off"
            status["why"] = (f"it judged {self.judge_check.agreement:.0%} of the start-up check right, under the "
                             f"bar of {bar:.0%} (semantic.label_judge_min_agreement)")
        return status

    async def _check_judge(self, judge: ModelJudgeLabeler) -> None:
        """The judge's start-up check (:func:`~edgecache.semantic.judge.check_judge`), once the engine is idle:
        its verdicts are used only if it passes."""
        async def until_free() -> None:
            while not self.admission.is_free():
                await asyncio.sleep(1.0)

        try:
            self.judge_check = await check_judge(judge, until_free=until_free)
        except EdgeCacheError as exc:
            log.warning("the served model's judge check failed (%s): its labels are not used", exc.message)
            return
        bar = self.settings.semantic.label_judge_min_agreement
        judge.trusted = self.judge_check.agreement >= bar
        log.info("the served model as judge: %.0f%% of its check right (bar %.0f%%): %s",
                 100 * self.judge_check.agreement, 100 * bar, "used" if judge.trusted else "not used")

    def _labeler(self) -> Labeler:
        """Equality for greedy answers, then (where the served model may judge, and passed its check) the
        model's judgement, then the answers' embeddings under the semantic layer's embedder."""
        async def embed(texts: Sequence[str]) -> np.ndarray:
            if self.semantic_layer is None:
                raise NotReady("the semantic layer is off")
            return await self.semantic_layer.embed(texts)

        sem = self.settings.semantic
        if self.judge_wanted():
            self.judge = ModelJudgeLabeler(self._judge_call, may_run=self.admission.is_free,
                                           trusted=sem.label_judge_min_agreement == 0.0)
        judge = [self.judge] if self.judge is not None else []
        return FirstVerdict(EqualityLabeler(), *judge,
                            AnswerEmbeddingLabeler(embed, sem.label_answer_bar, sem.label_answer_floor))

    async def _judge_call(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        """One engine call for the judge, inside an admission slot like any miss (the judge asks only when one is
        free, so it does not wait). The ledger charges it to the tenant whose label it judges (its salt's tenant),
        under the default scenario."""
        tenant = tenant_of(request.salt)
        async with (self.admission.slot(tenant),
                    aclosing(self.engine.generate(request)) as stream,
                    aclosing(metered_stream(self.ledger, self.metrics, stream, tenant, "default", "judge")) as chunks):
            async for chunk in chunks:
                yield chunk

    @property
    def semantic(self) -> SemanticCache | None:
        """The semantic cache while its layer is open (None: off, loading, or failed; see /health)."""
        return self.semantic_layer.cache if self.semantic_layer is not None else None

    @property
    def learner(self) -> SemanticLearner | None:
        """The semantic learner (``semantic.decision = "learner"``), which outlives a re-opened cache."""
        return self.semantic_layer.learner if self.semantic_layer is not None else None

    def keeps_prompts(self, tenant_id: str) -> bool:
        """Whether the tenant's plan lets the decision log keep its query text."""
        tenant = self.tenants.get(tenant_id)
        return tenant.plan.log_prompts if tenant else False

    def _model_health(self) -> Health:
        if self.ready:
            return READY
        if self.load_error:
            return Health("failed", f"the model failed to load: {self.load_error}")
        return Health("loading", "the model is loading")

    def quota_for(self, tenant_id: str) -> int:
        """A tenant's result-store quota: its plan's, within the profile's disk budget."""
        tenant = self.tenants.get(tenant_id)
        plan_bytes = tenant.plan.store_bytes if tenant else self.settings.store.disk_bytes
        return min(plan_bytes, self.settings.store.disk_bytes)

    def prefix_share_for(self, tenant_id: str) -> float:
        """The share of the engine's prefix-cache budgets a tenant may hold: its plan's."""
        tenant = self.tenants.get(tenant_id)
        return (tenant.plan if tenant else Plan()).prefix_cache_share

    def engine_weight_for(self, tenant_id: str) -> float:
        """A tenant's weight in the engine's queue: its plan's."""
        tenant = self.tenants.get(tenant_id)
        return (tenant.plan if tenant else Plan()).weight

    def vector_cap_for(self, tenant_id: str) -> TenantBounds | None:
        """What a tenant's semantic indexes may hold: its plan's bounds (None: a tenant this node does not know,
        e.g. a fleet's record from a node with another tenants file)."""
        tenant = self.tenants.get(tenant_id)
        if tenant is None:
            return None
        plan = tenant.plan
        return TenantBounds(vectors_per_index=plan.semantic_max_vectors, indexes=plan.semantic_max_indexes,
                            vectors=plan.semantic_max_tenant_vectors)

    async def tenant_bounds(self, tenant_id: str) -> dict[str, dict[str, float | int | None]]:
        """What ``tenant_id`` holds of everything it can grow, each beside its bound (its ``/stats``): its plan's
        own bounds (the engine, its semantic indexes) and its use of the tables every tenant shares, each with a
        share (past such a table's bound the tenant that holds the most gives way first). Its own figures only."""
        tenant = self.tenants.get(tenant_id)
        plan = tenant.plan if tenant else Plan()
        semantic = self.semantic
        used = await semantic.usage(tenant_id) if semantic is not None else TenantUsage()
        learner = self.learner
        return {
            "engine_running": {"used": self.admission.running_by_tenant.get(tenant_id, 0),
                               "bound": plan.max_concurrent_misses, "weight": plan.weight},
            "engine_queued": {"used": self.admission.queued_of(tenant_id), "bound": self.admission.max_queue},
            "request_tokens": {"bound": plan.max_request_tokens},
            "request_engine_s": {"bound": plan.max_request_engine_s},
            "semantic_indexes": {"used": used.indexes, "bound": plan.semantic_max_indexes},
            "semantic_vectors": {"used": used.vectors, "bound": plan.semantic_max_tenant_vectors},
            "semantic_vectors_per_index": {"used": used.largest, "bound": min(
                plan.semantic_max_vectors, self.settings.semantic.max_vectors_per_index)},
            "marks": {"used": self.marks.held(tenant_id), "bound": self.marks.max_entries},
            "learner_entries": {"used": learner.entries_of(tenant_id) if learner is not None else 0,
                                "bound": learner.max_entries if learner is not None else 0},
            "key_history": {"used": self.ledger.history.held(tenant_id), "bound": self.ledger.history.max_keys},
        }

    def ttl_for(self, call: Call) -> float:
        """The caller's explicit TTL or tier, else the scenario's TTL, else the tier the prompt reads as."""
        request = call.request
        text = request.prompt or (request.messages[-1].content if request.messages else "")
        return self.ttl.choose(call.ttl_s, call.ttl_tier, self.settings.scenarios[call.scenario].ttl_s, text)[1]

    async def flush(self, tenant: str | None, scenario: str | None) -> dict[str, int]:
        """Drop entries across every layer: the tenant's (or everyone's) result store, scenario-tagged entries
        only when a scenario is named, the semantic vectors, and the engine's prefix cache: the tenant's states in
        every tier where EdgeCache keeps them (llamacpp), all of it on another engine when flushing all."""
        stores = [tenant] if tenant is not None else await self.stores.known_tenants()  # a fleet's: from Redis
        self.ledger.history.flushed(tenant, scenario)  # the misses it causes are counted as flushed
        dropped = 0
        for name in stores:
            dropped += await self.stores(name).clear(tag=scenario)
        if self.semantic is not None:
            await self.semantic.drop(tenant=tenant, scenario=scenario)
        self.marks.drop(tenant)
        prefixes = await self._flush_engine(tenant, scenario)
        for listener in self.flush_listeners:
            listener(tenant, scenario)
        if self.fleet is not None:
            # The other nodes drop their memory copies and vectors, and no flight from before this joins after.
            from edgecache.fleet.link import LinkDown

            try:
                await self.fleet.events.publish_flush(tenant, scenario)
            except LinkDown as exc:
                raise NotReady(f"the flush could not reach the fleet's Redis: {exc}") from exc
        return {"result_entries": dropped, **({"prefix_states": prefixes} if prefixes is not None else {})}

    async def _flush_engine(self, tenant: str | None, scenario: str | None) -> int | None:
        """The engine's part of a flush: how many prefix states went (None: the engine does not say)."""
        if scenario is not None:
            return None
        if isinstance(self.engine, TieredPrefixEngine):
            return await self.engine.flush_tenant(tenant)
        if tenant is None:
            await self.engine.flush()
        return None

    async def apply_remote_flush(self, tenant: str | None, scenario: str | None) -> None:
        """Another node flushed (the shared store is already cleared): drop what this node holds of it."""
        self.ledger.history.flushed(tenant, scenario)
        for name, store in self.stores.opened().items():
            if tenant in (None, name):
                store.forget_memory()  # the memory tier has no tags: all of it
        if self.semantic is not None:
            await self.semantic.drop(tenant=tenant, scenario=scenario)
        self.marks.drop(tenant)
        if self.ready:
            await self._flush_engine(tenant, scenario)
        for listener in self.flush_listeners:
            listener(tenant, scenario)

    async def _housekeeping(self) -> None:
        # Every few seconds: write changed index files (the vectors are committed to SQLite as they are added; the
        # index files are a rebuildable copy, saved so a restart need not rebuild them), and refresh the gauges
        # that cost a disk read (store bytes, index sizes) so a scrape never waits on disk.
        while True:
            await asyncio.sleep(self.settings.semantic.save_interval_s)
            if self.semantic is not None:
                await self.semantic.save()
            elif self.semantic_layer is not None:
                await self.semantic_layer.retry()  # its indexes failed to open (a full disk?): try again
            await self.scrape_engine()
            await self.refresh_gauges()
            self.ledger.tick()
            if self.ledger.dirty and time.monotonic() - self._ledger_saved_at >= LEDGER_SAVE_INTERVAL_S:
                await self.save_ledger()

    async def scrape_engine(self) -> None:
        """Let an engine that reads figures from elsewhere (the upstream's /metrics: ``scrape``) read them now, off
        the request path. A fault there is logged, never raised: it must not stop the housekeeping."""
        scrape = getattr(self.engine, "scrape", None)
        if scrape is None or not self.ready:
            return
        try:
            await scrape()
        except Exception as exc:  # noqa: BLE001 (an engine's own fault; the loop goes on)
            log.warning("reading the engine's figures failed: %s: %s", type(exc).__name__, exc)

    async def save_ledger(self) -> None:
        """Write the ledger to the data dir: encoded on the loop (a consistent snapshot), written off it. A failed
        write is counted and logged like any storage fault; the ledger stays in memory and is written next time."""
        self._ledger_saved_at = time.monotonic()
        data = self.ledger.encoded()
        try:
            await asyncio.to_thread(self.ledger.write, data)
        except OSError as exc:
            self.storage_faults.record("ledger", exc, action="ledger not written; retrying",
                                       path=self.ledger.path)
        else:
            self.storage_faults.recovered("ledger")

    async def refresh_gauges(self) -> dict[str, dict[str, int]]:
        """Store bytes against quota per tenant and index sizes per (tenant, scenario); returns the store stats."""
        stores = {}
        for name in self.stores.existing_tenants():
            stats = stores[name] = await self.stores(name).stats()
            self.metrics.store_bytes.labels(name).set(stats["bytes"])
            self.metrics.store_quota_bytes.labels(name).set(stats["budget_bytes"])
            self.metrics.store_entries.labels(name).set(stats["entries"])
        if self.semantic is not None:
            for (tenant, scenario), count in (await self.semantic.sizes()).items():
                self.metrics.semantic_index_vectors.labels(tenant, scenario).set(count)
            learned = self.semantic.learned()
            if learned is not None:
                self.metrics.semantic_demoted_entries.set(learned["demoted"])  # type: ignore[arg-type]
                for name, figures in learned["pools"].items():  # type: ignore[attr-defined]
                    tenant, scenario = name.split("/", 1)
                    self.metrics.semantic_learner_false_hit_rate.labels(tenant, scenario).set(
                        figures["false_hit_rate"])
                    self.metrics.semantic_learner_false_hit_upper.labels(tenant, scenario).set(
                        figures["false_hit_upper"])
        if self.ready:
            engine = await self.engine.stats()
            usage = engine.get("kv_usage_ratio")
            if isinstance(usage, (int, float)):
                self.metrics.engine_kv_usage.set(usage)
            self._upstream_gauge(engine)
            self._prefix_gauges(engine)
        return stores

    def prefix_cache_usage(self) -> dict[str, dict[str, int]]:
        """Each tenant's bytes in each tier of the engine's prefix cache, where EdgeCache keeps it (else empty)."""
        if not self.ready or not isinstance(self.engine, TieredPrefixEngine):
            return {}
        return self.engine.prefix_cache_usage()

    def _prefix_gauges(self, engine: dict[str, float | int | str]) -> None:
        """Each tenant's prefix-cache bytes by tier, and the tiers' hits, where EdgeCache keeps the states."""
        if not isinstance(self.engine, TieredPrefixEngine):
            return
        gauge = self.metrics.prefix_cache_bytes
        usage = self.prefix_cache_usage()
        for tenant, tier in list(gauge._metrics):  # prometheus_client has no public list of label sets
            if tenant not in usage:
                gauge.remove(tenant, tier)
        for tenant, tiers in usage.items():
            for tier in TIERS:
                gauge.labels(tenant, tier).set(tiers.get(tier, 0))
        for tier in TIERS:
            hits = engine.get(f"prefix_cache_hits_{tier}")
            if isinstance(hits, (int, float)):
                self.metrics.prefix_cache_hits.labels(tier).set(hits)

    def _upstream_gauge(self, engine: dict[str, float | int | str]) -> None:
        """edgecache_upstream_prefix_cache_hit_ratio{server} from the engine's stats: one series while the upstream
        reports the figure, none while it does not (no stale value on a dashboard)."""
        gauge = self.metrics.upstream_prefix_cache_hit_ratio
        ratio, server = engine.get("upstream_prefix_cache_hit_ratio"), engine.get("upstream_metrics")
        known = {str(server)} if isinstance(ratio, (int, float)) else set()
        for (old,) in list(gauge._metrics):  # prometheus_client has no public list of label sets
            if old not in known:
                gauge.remove(old)
        if known:
            gauge.labels(str(server)).set(float(ratio))  # type: ignore[arg-type]

    async def close(self) -> None:
        # 1. let in-flight answers finish (they may still be stored), 2. close the engine, 3. save the indexes,
        # 4. close the store, 5. leave the fleet.
        self.ready = False
        for task in self._background:
            task.cancel()
        try:
            await self.inflight.drain(SHUTDOWN_GRACE_S)
            if self.labels is not None:
                await self.labels.drain()
            await self.engine.close()
        finally:
            if self.decisions is not None:
                await asyncio.to_thread(self.decisions.close)  # writes what is pending
            await self.save_ledger()
            await asyncio.to_thread(self.marks.save)
            try:
                if self.fleet is not None and self.fleet.vectors is not None:
                    await self.fleet.vectors.close()  # stop applying the fleet's vectors before the index closes
                if self.semantic_layer is not None:
                    self.semantic_layer.close()
            finally:
                try:
                    self.stores.close()
                finally:
                    if self.fleet is not None:
                        await self.fleet.close()
