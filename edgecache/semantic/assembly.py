"""The semantic layer built from :class:`~edgecache.settings.Settings` and run for one server: the indexes around
the embedder, the scenario's rule (threshold, verifier or the learner's prior), the learner, and what the layer
shares with a fleet (:class:`SemanticLayer`).

The runtime holds a :class:`SemanticLayer` and knows nothing of how the layer is put together; a script or a test
builds the same cache the server runs from the same settings (:func:`build_semantic_cache`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgecache.errors import EdgeCacheError, NotReady
from edgecache.health import STORAGE_ERRORS, Health, StorageFaults
from edgecache.semantic.cache import SemanticCache
from edgecache.semantic.decision_log import DecisionLog, labelled_decisions, read_records
from edgecache.semantic.embedders import Embedder, load_semantic_embedder
from edgecache.semantic.index import TenantBounds
from edgecache.semantic.learner import SemanticLearner
from edgecache.semantic.lookup import Lookup, MatchRule
from edgecache.semantic.teaching import Taught, TaughtLog
from edgecache.settings import Settings

if TYPE_CHECKING:  # a single box never imports the fleet (nor the redis client)
    from edgecache.fleet import Fleet
    from edgecache.fleet.labels import SharedLabel

log = logging.getLogger("edgecache")


def learner_for(settings: Settings) -> SemanticLearner | None:
    """The online learner when ``semantic.decision = "learner"`` (its prior cut comes per lookup, from the rule)."""
    sem = settings.semantic
    if not sem.enabled or sem.decision != "learner":
        return None
    return SemanticLearner(explore_share=sem.learner_explore_share, demote_after=sem.learner_demote_after,
                           max_entries=sem.learner_max_entries)


def build_semantic_cache(settings: Settings, embedder: Embedder,
                         cap_for: Callable[[str], TenantBounds | None] = lambda tenant: None,
                         faults: StorageFaults | None = None, damaged_dir: Path | None = None,
                         learner: SemanticLearner | None = None,
                         may_explore: Callable[[], bool] = lambda: True,
                         observe_embed: Callable[[float], None] | None = None,
                         observe_search: Callable[[float], None] | None = None) -> SemanticCache:
    """Open the indexes (blocking: disk) around ``embedder``, and load the verifier.

    ``semantic.decision`` picks the rule. Under the verifier, a scenario's raw ``threshold`` still overrides it, and an
    embedder the verifier was not fitted for keeps the cosine threshold calibrated for it (and the guard's veto).
    Under the learner, the threshold (the tenant's, the scenario's, or the embedder's calibrated one) is its prior.
    """
    from edgecache.semantic.embedders import default_threshold
    from edgecache.semantic.index import SemanticIndex
    from edgecache.semantic.verifier import Verifier

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
                         max_wait_s=sem.batch_wait_ms / 1000, observe_embed=observe_embed,
                         bulk_threads=sem.bulk_threads or os.cpu_count() or 1,
                         observe_search=observe_search, learner=learner,
                         may_explore=may_explore)


class SemanticLayer:
    """The semantic layer of one running server: its embedder, its cache (indexes and rule), its learner, and what
    it shares with a fleet. The runtime holds one (``semantic.enabled``) and asks it to :meth:`open` once the
    engine is up; the pipeline gets :attr:`cache` (and, through :attr:`on_open`, a cache re-opened later).

    The layer is optional: when the embedder or the indexes fail to open, the server serves exact matches only,
    :meth:`health` says why, and a storage failure is retried by :meth:`retry` from the housekeeping loop. The
    learner outlives a re-opened cache (it holds what this box's labels taught it).
    """

    def __init__(self, settings: Settings, *, faults: StorageFaults, damaged_dir: Path,
                 cap_for: Callable[[str], TenantBounds | None], may_explore: Callable[[], bool],
                 observe_embed: Callable[[float], None] | None = None,
                 observe_search: Callable[[float], None] | None = None, fleet: Fleet | None = None) -> None:
        self.settings = settings
        self.learner = learner_for(settings)
        self.cache: SemanticCache | None = None
        self.error: str | None = None  # why the layer is off, while it is
        self.on_open: list[Callable[[SemanticCache], None]] = []
        self._faults = faults
        self._damaged_dir = damaged_dir
        self._cap_for = cap_for
        self._may_explore = may_explore
        self._observe_embed = observe_embed
        self._observe_search = observe_search
        self._fleet = fleet
        self._embedder: Embedder | None = None

    async def open(self) -> None:
        """Load the embedder (once) and open the indexes; on a fleet, the index also follows and feeds the fleet's
        vector streams and the learner its labels."""
        loop = asyncio.get_running_loop()
        try:
            if self._embedder is None:
                self._embedder = await loop.run_in_executor(None, load_semantic_embedder, self.settings)
            cache = await loop.run_in_executor(None, partial(
                build_semantic_cache, self.settings, self._embedder, self._cap_for, self._faults, self._damaged_dir,
                self.learner, self._may_explore, observe_embed=self._observe_embed,
                observe_search=self._observe_search))
        except EdgeCacheError as exc:
            self._failed(exc.message)
            return
        except STORAGE_ERRORS as exc:
            self._faults.record("semantic", exc, action="semantic layer off, retrying")
            self._failed(f"{type(exc).__name__}: {exc}")
            return
        for report in cache.index.repairs:
            self._faults.repaired("semantic", report)
        cache.taught_log = TaughtLog(self.settings.data_path / "semantic")
        if self._fleet is not None:
            cache.index = await self._fleet.share_vectors(  # type: ignore[assignment]  # the same methods
                cache.index, embedder_version=self._embedder.version,
                cursor_file=self.settings.data_path / "semantic" / "fleet-cursors.json",
                cap_for=self._cap_for, index_thread=cache.in_index_thread)
            if self.learner is not None:  # a label on one node teaches every node
                from edgecache.fleet.labels import SharedTeaching

                feed = self._fleet.share_labels(self._apply_shared_label)
                cache.on_taught = lambda t: feed.publish_taught(t.tenant, t.scenario, SharedTeaching(
                    classes=t.classes, labels=t.labels, namespace=t.namespace, groups=t.groups, variants=t.variants))
        if self.error is not None:
            log.info("the semantic layer is back")
        self.error = None
        self.cache = cache
        for listener in self.on_open:
            listener(cache)

    async def retry(self) -> None:
        """Open again after the indexes failed to (a full disk?); nothing while open or never loaded."""
        if self.cache is None and self._embedder is not None:
            await self.open()

    def _failed(self, why: str) -> None:
        if self.error is None:
            log.error("the semantic layer is unavailable, serving exact matches only: %s", why)
        self.error = why

    async def teach_taught(self) -> None:
        """What grouped warmup lines taught before a restart teaches the learner again, before the first request."""
        cache = self.cache
        if cache is None or self.learner is None or cache.taught_log is None:
            return
        log_ = cache.taught_log

        def teach() -> int:
            return sum(cache.teach_taught(taught) for taught in log_.read())

        try:
            taught = await asyncio.get_running_loop().run_in_executor(None, teach)
        except STORAGE_ERRORS as exc:
            self._faults.record("semantic", exc, action="taught labels not read", path=log_.path)
            return
        if taught:
            log.info("the semantic learner starts from %d taught labels", taught)

    async def teach_from_log(self, decisions: DecisionLog) -> None:
        """The labels the decision log kept teach the learner before the first request (a restart does not start it
        from nothing). Bounded by the log's bytes: about 290k records per 64 MiB, read at about 90k a second."""
        cache, directory = self.cache, decisions.directory
        if cache is None or self.learner is None:
            return

        def teach() -> int:
            return cache.learn_from_log(labelled_decisions(read_records(directory)))

        try:
            taught = await asyncio.get_running_loop().run_in_executor(None, teach)
        except STORAGE_ERRORS as exc:  # an unreadable log costs what it held, not the start
            self._faults.record("decisions", exc, action="learner starts untaught", path=directory)
            return
        if taught:
            log.info("the semantic learner starts from %d labels of the decision log", taught)

    def learn(self, tenant: str, scenario: str, lookup: Lookup, answer_key: str | None, good: bool | None) -> None:
        """A label of one of this node's decisions (None: could not tell; ``answer_key``: where the fresh answer
        it was compared with is stored, None for a caller's mark): taught to the learner, and to the fleet's."""
        if self.cache is not None:
            self.cache.learn(tenant, scenario, lookup, good, answer_key)
        feed = self._fleet.labels if self._fleet is not None else None
        if feed is not None and lookup.learned is not None and lookup.candidate is not None:
            feed.publish(tenant, scenario, lookup.candidate.store_key, lookup.candidate.similarity, good,
                         answer_key)

    def _apply_shared_label(self, label: SharedLabel) -> None:
        """A label another node of the fleet got (edgecache/fleet/labels.py), or one a group taught there (kept here
        too, so this node's restart keeps it)."""
        if self.cache is not None and label.taught is not None:
            shared = label.taught
            taught = Taught(tenant=label.tenant, scenario=label.scenario, classes=shared.classes, labels=shared.labels,
                            namespace=shared.namespace, groups=shared.groups, variants=shared.variants)
            if self.cache.teach_taught(taught) and self.cache.taught_log is not None:
                asyncio.get_running_loop().run_in_executor(None, self.cache.taught_log.append, taught)
            return
        if self.cache is not None:
            self.cache.learn_shared(label.tenant, label.scenario, label.store_key, label.similarity, label.good,
                                    label.answer_key)

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Vectors under the layer's embedder (the answers a labeler compares)."""
        if self.cache is None:
            raise NotReady("the semantic layer is off")
        return await self.cache.embed_many(texts)

    def health(self) -> Health:
        if self.error is not None:
            return Health("degraded", f"off, exact matches only: {self.error}")
        if self.cache is None:
            return Health("loading", "the embedder is loading")
        return self._faults.check("semantic")()

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
