"""Everything one running server holds, built from :class:`~edgecache.settings.Settings`: the tenants, the
per-tenant result stores, the in-flight table, admission, the TTL classifier, the metrics, and (once loaded) the
engine, the semantic cache and the request pipeline that composes them.

The app factory (:mod:`edgecache.app`) puts one :class:`Runtime` on ``app.state`` and runs its lifespan; the HTTP
handlers only read from it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING
from pathlib import Path

import numpy as np

from edgecache.access_log import AccessLog
from edgecache.admission import AdmissionGate
from edgecache.calls import ParsedRequests
from edgecache.decision_log import DecisionLog, labelled_decisions, read_records
from edgecache.embedders import Embedder, load_semantic_embedder
from edgecache.engines.base import Chunk, Engine, GenerationRequest
from edgecache.errors import EdgeCacheError, NotReady
from edgecache.health import READY, STORAGE_ERRORS, Health, HealthChecks, StorageFaults
from edgecache.inflight import FlightTable
from edgecache.inflight.local import InflightTable
from edgecache.labeling import (AnswerEmbeddingLabeler, EqualityLabeler, FirstVerdict, Labeler, MissLabels,
                                ModelJudgeLabeler)
from edgecache.metrics import Metrics
from edgecache.openai_api import IdSource
from edgecache.call import Call
from edgecache.pipeline import RequestPipeline
from edgecache.stores import ResultStores
from edgecache.stores.disk import TenantStores
from edgecache.lookup import Lookup, MatchRule
from edgecache.semantic_cache import SemanticCache
from edgecache.semantic_learner import SemanticLearner
from edgecache.settings import Settings
from edgecache.tenants import TenantDirectory
from edgecache.ttl_tiers import TtlClassifier
from edgecache.warmup import Prefilled

if TYPE_CHECKING:
    from edgecache.canary import CanaryReport
    from edgecache.fleet import Fleet
    from edgecache.fleet.labels import SharedLabel

log = logging.getLogger("edgecache")

SHUTDOWN_GRACE_S = 30.0


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
        # /health is the worst of these checks; a layer added later (a shared store) registers its own.
        self.health = HealthChecks()
        self.storage_faults = StorageFaults(self.metrics.storage_failures)
        self.damaged_dir = settings.data_path / "damaged"
        self.inflight: FlightTable = InflightTable()
        self.ids = IdSource()
        self.parsed = ParsedRequests(settings)
        self.fleet: Fleet | None = None
        self.stores: ResultStores
        if settings.store.backend == "redis":
            from edgecache.fleet import Fleet
            from edgecache.stores.redis import RedisTenantStores

            self.fleet = Fleet(settings, self.metrics, on_flush=self.apply_remote_flush)
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
        self.admission = AdmissionGate(max_running=adm.max_concurrent_misses, max_queue=adm.max_queue,
                                       queue_timeout_s=adm.queue_timeout_s, retry_after_s=adm.retry_after_s)
        self.metrics.track_admission(self.admission)
        self.metrics.ttft_p99_target_seconds.set(settings.slo.ttft_p99_s)
        self.access_log = AccessLog(enabled=settings.server.access_log,
                                    count_refusal=lambda reason: self.metrics.refused_requests.labels(reason).inc())
        self.ttl = TtlClassifier(settings.ttl_tiers)
        self.semantic: SemanticCache | None = None
        self.semantic_error: str | None = None  # why the (optional) semantic layer is off, while it is
        self._embedder: Embedder | None = None
        # The learner outlives a re-opened semantic layer (it holds what this box's labels taught it).
        self.learner = learner_for(settings)
        self.pipeline: RequestPipeline | None = None
        self.warm_prefilled: Prefilled = set()  # system prompts /admin/warmup has prefilled (see edgecache.warmup)
        self.ready = False
        self.load_error: str | None = None
        self.canary: CanaryReport | None = None  # what the start-up self-test settled on, when it ran
        self.health.register("model", self._model_health)
        self.health.register("results", self.storage_faults.check("results"))
        if settings.semantic.enabled:
            self.health.register("semantic", self._semantic_health)
        self.decisions: DecisionLog | None = None
        self.labels: MissLabels | None = None
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
        if self.settings.semantic.enabled:
            await self._open_semantic()
        if self.learner is not None and self.semantic is not None and self.decisions is not None:
            await self._teach_learner()
        if self.learner is not None and self.fleet is not None:  # a label on one node teaches every node
            self.fleet.share_labels(self._apply_shared_label)
        if self.decisions is not None or self.learner is not None:
            self.labels = MissLabels(stores=self.stores, labeler=self._labeler(), decisions=self.decisions,
                                     observe=self._observe_label, busy=lambda: not self.admission.is_free())
        self.pipeline = RequestPipeline(engine=self.engine, stores=self.stores, inflight=self.inflight,
                                        metrics=self.metrics, ttl_for=self.ttl_for, admission=self.admission,
                                        semantic=self.semantic, decisions=self.decisions, labels=self.labels)
        self._background.append(asyncio.create_task(self._housekeeping(), name="housekeeping"))
        if self.fleet is not None:
            await self.fleet.events.announce_model(self.engine.version)
        self.ready = True
        log.info("model %s ready (%s)%s", self.engine.model_id, self.engine.version,
                 f", embedder {self.semantic.embedder.version}" if self.semantic else "")

    async def _open_semantic(self) -> None:
        """Load the embedder (once) and open the indexes. The semantic layer is optional: when either fails the
        server serves exact matches only, says so on /health, and (for a storage failure) retries from the
        housekeeping loop."""
        loop = asyncio.get_running_loop()
        try:
            if self._embedder is None:
                self._embedder = await loop.run_in_executor(None, load_semantic_embedder, self.settings)
            self.semantic = await loop.run_in_executor(
                None, build_semantic_cache, self.settings, self.metrics, self._embedder, self.vector_cap_for,
                self.storage_faults, self.damaged_dir, self.learner, self.admission.is_free)
        except EdgeCacheError as exc:
            self._semantic_failed(exc.message)
        except STORAGE_ERRORS as exc:
            self.storage_faults.record("semantic", exc, action="semantic layer off, retrying")
            self._semantic_failed(f"{type(exc).__name__}: {exc}")
        else:
            for report in self.semantic.index.repairs:
                self.storage_faults.repaired("semantic", report)
            if self.fleet is not None:  # this node's index also follows (and feeds) the fleet's vector streams
                self.semantic.index = await self.fleet.share_vectors(  # type: ignore[assignment]
                    self.semantic.index, embedder_version=self._embedder.version,
                    cursor_file=self.settings.data_path / "semantic" / "fleet-cursors.json",
                    cap_for=self.vector_cap_for, index_thread=self.semantic.in_index_thread)
            if self.semantic_error is not None:
                log.info("the semantic layer is back")
            self.semantic_error = None
            if self.pipeline is not None:
                self.pipeline.semantic = self.semantic

    def _semantic_failed(self, why: str) -> None:
        if self.semantic_error is None:
            log.error("the semantic layer is unavailable, serving exact matches only: %s", why)
        self.semantic_error = why

    async def _teach_learner(self) -> None:
        """The labels the decision log kept teach the learner before the first request (a restart does not start it
        from nothing). Bounded by the log's bytes: about 290k records per 64 MiB, read at about 90k a second."""
        assert self.semantic is not None and self.decisions is not None
        semantic, directory = self.semantic, self.decisions.directory

        def teach() -> int:
            return semantic.learn_from_log(labelled_decisions(read_records(directory)))

        try:
            taught = await asyncio.get_running_loop().run_in_executor(None, teach)
        except STORAGE_ERRORS as exc:  # an unreadable log costs what it held, not the start
            self.storage_faults.record("decisions", exc, action="learner starts untaught", path=directory)
            return
        if taught:
            log.info("the semantic learner starts from %d labels of the decision log", taught)

    def _observe_label(self, call: Call, lookup: Lookup, answer_key: str, good: bool | None) -> None:
        """A label of a semantic decision (None: could not tell): counted, and taught to the learner."""
        self.metrics.observe_label(call.tenant, call.scenario, "explore" if lookup.explored else "refused", good)
        if self.semantic is not None:
            self.semantic.learn(call.tenant, call.scenario, lookup, good, answer_key)
        feed = self.fleet.labels if self.fleet is not None else None
        if feed is not None and lookup.learned is not None and lookup.candidate is not None:
            feed.publish(call.tenant, call.scenario, lookup.candidate.store_key, lookup.candidate.similarity, good,
                         answer_key)

    def _apply_shared_label(self, label: SharedLabel) -> None:
        """A label another node of the fleet got (edgecache/fleet/labels.py)."""
        if self.semantic is not None:
            self.semantic.learn_shared(label.tenant, label.scenario, label.store_key, label.similarity, label.good,
                                       label.answer_key)

    def _labeler(self) -> Labeler:
        """Equality for greedy answers, then (``label_judge``) the served model's judgement, then the answers'
        embeddings under the semantic layer's embedder."""
        async def embed(texts: Sequence[str]) -> np.ndarray:
            if self.semantic is None:
                raise NotReady("the semantic layer is off")
            return await self.semantic.embed_many(texts)

        sem = self.settings.semantic
        judge = [ModelJudgeLabeler(self._judge_call, may_run=self.admission.is_free)] if sem.label_judge else []
        return FirstVerdict(EqualityLabeler(), *judge,
                            AnswerEmbeddingLabeler(embed, sem.label_answer_bar, sem.label_answer_floor))

    async def _judge_call(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        """One engine call for the judge, inside an admission slot like any miss (the judge asks only when one is
        free, so it does not wait)."""
        async with self.admission.slot(request.salt or "default"):
            async with aclosing(self.engine.generate(request)) as stream:
                async for chunk in stream:
                    if chunk.finish_reason is not None:
                        self.metrics.observe_engine_call(chunk.prompt_tokens, chunk.cached_tokens,
                                                         chunk.completion_tokens)
                    yield chunk

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

    def _semantic_health(self) -> Health:
        if self.semantic_error is not None:
            return Health("degraded", f"off, exact matches only: {self.semantic_error}")
        if self.semantic is None:
            return Health("loading", "the embedder is loading")
        return self.storage_faults.check("semantic")()

    def quota_for(self, tenant_id: str) -> int:
        """A tenant's result-store quota: its plan's, within the profile's disk budget."""
        tenant = self.tenants.get(tenant_id)
        plan_bytes = tenant.plan.store_bytes if tenant else self.settings.store.disk_bytes
        return min(plan_bytes, self.settings.store.disk_bytes)

    def vector_cap_for(self, tenant_id: str) -> int | None:
        """Most vectors one of a tenant's semantic indexes keeps: its plan's."""
        tenant = self.tenants.get(tenant_id)
        return tenant.plan.semantic_max_vectors if tenant else None

    def ttl_for(self, call: Call) -> float:
        """The caller's explicit TTL or tier, else the scenario's TTL, else the tier the prompt reads as."""
        request = call.request
        text = request.prompt or (request.messages[-1].content if request.messages else "")
        return self.ttl.choose(call.ttl_s, call.ttl_tier, self.settings.scenarios[call.scenario].ttl_s, text)[1]

    async def flush(self, tenant: str | None, scenario: str | None) -> dict[str, int]:
        """Drop entries across every layer: the tenant's (or everyone's) result store, scenario-tagged entries
        only when a scenario is named, the semantic vectors, and the engine's prefix cache when flushing all."""
        stores = [tenant] if tenant is not None else await self.stores.known_tenants()  # a fleet's: from Redis
        dropped = 0
        for name in stores:
            dropped += await self.stores(name).clear(tag=scenario)
        if self.semantic is not None:
            await self.semantic.drop(tenant=tenant, scenario=scenario)
        if tenant is None and scenario is None:
            await self.engine.flush()
            self.warm_prefilled.clear()
        self.parsed.clear()
        if self.fleet is not None:
            # The other nodes drop their memory copies and vectors, and no flight from before this joins after.
            from edgecache.fleet.link import LinkDown

            try:
                await self.fleet.events.publish_flush(tenant, scenario)
            except LinkDown as exc:
                raise NotReady(f"the flush could not reach the fleet's Redis: {exc}") from exc
        return {"result_entries": dropped}

    async def apply_remote_flush(self, tenant: str | None, scenario: str | None) -> None:
        """Another node flushed (the shared store is already cleared): drop what this node holds of it."""
        for name, store in self.stores.opened().items():
            if tenant in (None, name):
                store.forget_memory()  # the memory tier has no tags: all of it
        if self.semantic is not None:
            await self.semantic.drop(tenant=tenant, scenario=scenario)
        if tenant is None and scenario is None and self.ready:
            await self.engine.flush()
        self.parsed.clear()

    async def _housekeeping(self) -> None:
        # Every few seconds: write changed index files (the vectors are committed to SQLite as they are added; the
        # index files are a rebuildable copy, saved so a restart need not rebuild them), and refresh the gauges
        # that cost a disk read (store bytes, index sizes) so a scrape never waits on disk.
        while True:
            await asyncio.sleep(self.settings.semantic.save_interval_s)
            if self.semantic is not None:
                await self.semantic.save()
            elif self.settings.semantic.enabled and self._embedder is not None:
                await self._open_semantic()  # its indexes failed to open (a full disk?): try again
            await self.refresh_gauges()

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
            usage = (await self.engine.stats()).get("kv_usage_ratio")
            if isinstance(usage, (int, float)):
                self.metrics.engine_kv_usage.set(usage)
        return stores

    async def close(self) -> None:
        # 1. let in-flight answers finish (they may still be stored), 2. close the engine, 3. save the indexes,
        # 4. close the store, 5. leave the fleet.
        self.ready = False
        for task in self._background:
            task.cancel()
        self.access_log.flush()
        try:
            await self.inflight.drain(SHUTDOWN_GRACE_S)
            if self.labels is not None:
                await self.labels.drain()
            await self.engine.close()
        finally:
            if self.decisions is not None:
                await asyncio.to_thread(self.decisions.close)  # writes what is pending
            try:
                if self.fleet is not None and self.fleet.vectors is not None:
                    await self.fleet.vectors.close()  # stop applying the fleet's vectors before the index closes
                if self.semantic is not None:
                    self.semantic.close()
            finally:
                try:
                    self.stores.close()
                finally:
                    if self.fleet is not None:
                        await self.fleet.close()


def learner_for(settings: Settings) -> SemanticLearner | None:
    """The online learner when ``semantic.decision = "learner"`` (its prior cut comes per lookup, from the rule)."""
    sem = settings.semantic
    if not sem.enabled or sem.decision != "learner":
        return None
    return SemanticLearner(explore_share=sem.learner_explore_share, demote_after=sem.learner_demote_after,
                           max_entries=sem.learner_max_entries)


def build_semantic_cache(settings: Settings, metrics: Metrics, embedder: Embedder,
                         cap_for: Callable[[str], int | None] = lambda tenant: None,
                         faults: StorageFaults | None = None, damaged_dir: Path | None = None,
                         learner: SemanticLearner | None = None,
                         may_explore: Callable[[], bool] = lambda: True) -> SemanticCache:
    """Open the indexes (blocking: disk) around ``embedder``, and load the verifier.

    ``semantic.decision`` picks the rule. Under the verifier, a scenario's raw ``threshold`` still overrides it, and an
    embedder the verifier was not fitted for keeps the cosine threshold calibrated for it (and the guard's veto).
    Under the learner, the threshold (the tenant's, the scenario's, or the embedder's calibrated one) is its prior.
    """
    from edgecache.embedders import default_threshold
    from edgecache.semantic_index import SemanticIndex
    from edgecache.verifier import Verifier

    sem = settings.semantic
    index = SemanticIndex(settings.data_path / "semantic", dim=embedder.dim, embedder_version=embedder.version,
                          dtype=sem.vector_dtype, max_vectors=sem.max_vectors_per_index,
                          damaged_dir=damaged_dir or settings.data_path / "damaged")
    verifier = Verifier.load(sem.verifier_params) if sem.decision == "verifier" else None
    if verifier is not None and verifier.embedder != embedder.version:
        verifier = None  # its weights read another model's cosine

    def rule_for(tenant: str, scenario: str) -> MatchRule:
        configured = settings.scenarios[scenario]
        # A tenant's own cut (an `edgecache tune --write` overlay) before the scenario's.
        threshold = settings.tenant_thresholds.get(tenant, {}).get(scenario, configured.threshold)
        if threshold is None and verifier is None:
            threshold = default_threshold(embedder.version, scenario)
        return MatchRule(target_false_hit_rate=configured.target_false_hit_rate, threshold=threshold)

    return SemanticCache(embedder=embedder, index=index, rule_for=rule_for, verifier=verifier,
                         candidates=sem.candidates, cap_for=cap_for, max_batch=sem.batch_max, faults=faults,
                         max_wait_s=sem.batch_wait_ms / 1000, observe_embed=metrics.embed_seconds.observe,
                         bulk_threads=sem.bulk_threads or os.cpu_count() or 1,
                         observe_search=metrics.semantic_search_seconds.observe, learner=learner,
                         may_explore=may_explore)
