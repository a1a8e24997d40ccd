"""Layer 3: answer a paraphrase from the answer cached for an earlier prompt.

What is matched. Only first-turn chat requests: system messages (any) followed by exactly one user message. The
user's text is embedded; everything else must be identical, so it goes into the index's namespace: the model
version, the salt, the system prompt and the output-affecting parameters are hashed into
:attr:`Probe.namespace`, and each (tenant, scenario, namespace) has an index of its own. A later turn of a
conversation, a raw completion, or a request whose system prompt differs never meets another's vectors.

When a candidate serves. The verifier (:mod:`edgecache.semantic.verifier`) scores the nearest ``candidates`` stored prompts
(cosine, lexical overlap, the guard's rules as features) and the best-scored one serves when its score reaches the
cut that the scenario's target false-hit rate calibrates to. A scenario with a raw ``threshold`` (the override), or
an embedder the verifier was not fitted for, keeps the rule from before the verifier: the nearest candidate only,
when its cosine reaches the threshold and the guard (:mod:`edgecache.semantic.guard`) finds no difference the answer depends
on. With a learner (``semantic.decision = "learner"``, :mod:`edgecache.semantic.learner`), the nearest candidate
past the guard is decided by what this box's own labels taught it, under the scenario's target false-hit rate: serve
it, explore (refuse it so the engine computes the answer, which then labels the candidate), or miss; the scenario's
threshold is only the learner's prior. The labels come back through :meth:`SemanticCache.learn`. The caller then
reads the chosen candidate's result store entry; when that entry has expired or was evicted, the
vector is dropped and the lookup is a miss, so a semantic hit never serves an expired answer.

Cost. A prompt longer than the embedder's input (``max_input_tokens``) is not matched at all (:meth:`accepts`);
judging that tokenizes a bounded prefix, so a 1 MB prompt costs milliseconds. Embedding runs on a worker thread in micro-batches (:class:`EmbedBatcher`): concurrent lookups share one
model call. Index search and the guard run on the index's own worker thread. Nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import msgspec
import numpy as np

from edgecache.errors import StorageUnavailable
from edgecache.health import STORAGE_ERRORS, StorageFaults
from edgecache.semantic import deciders, refusals
from edgecache.semantic.deciders import Decider
from edgecache.semantic.decision_log import DecisionRecord
from edgecache.semantic.embedders import Embedder
from edgecache.semantic.guard import DEFAULT_RULES
from edgecache.semantic.index import Candidate, SemanticIndex, TenantBounds, TenantUsage
from edgecache.semantic.learner import Decision, SemanticLearner, TaughtState
from edgecache.semantic.lookup import Lookup, MatchRule, Probe
from edgecache.semantic.teaching import GroupedLines, Taught, TaughtLog
from edgecache.semantic.verifier import Verifier


def _learner_decider(query: str, found: list[Candidate], rule: MatchRule, vector: np.ndarray, *,
                     guard_rules: Sequence[str], learned: Callable[[Candidate], Decision]) -> Lookup:
    """:func:`deciders.by_learner` in the :data:`~edgecache.semantic.deciders.Decider` shape (the rule is in ``learned``)."""
    return deciders.by_learner(query, found, vector, guard_rules, learned)


class EmbedBatcher:
    """Embeds texts from concurrent callers together: the first waits up to ``max_wait_s`` for company."""

    def __init__(self, embedder: Embedder, executor: ThreadPoolExecutor, *, max_batch: int = 32,
                 max_wait_s: float = 0.002, observe: Callable[[float], None] | None = None) -> None:
        self.embedder = embedder
        self._executor = executor
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._observe = observe
        self._pending: list[tuple[str, asyncio.Future[np.ndarray]]] = []
        self._timer: asyncio.TimerHandle | None = None

    async def embed(self, text: str) -> np.ndarray:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[np.ndarray] = loop.create_future()
        self._pending.append((text, future))
        if len(self._pending) >= self.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.max_wait_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: list[tuple[str, asyncio.Future[np.ndarray]]]) -> None:
        texts = [text for text, _ in batch]
        started = time.perf_counter()
        try:
            vectors = await asyncio.get_running_loop().run_in_executor(self._executor, self.embedder.embed, texts)
        except Exception as exc:  # hand the failure to every waiter; none may hang
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        if self._observe is not None:
            self._observe(time.perf_counter() - started)
        for (_, future), vector in zip(batch, vectors):
            if not future.done():
                future.set_result(vector)


class SemanticCache:
    """Embedder + per-namespace indexes + verifier (or threshold + guard), behind lookup / remember / forget."""

    def __init__(self, *, embedder: Embedder, index: SemanticIndex, rule_for: Callable[[str, str], MatchRule],
                 verifier: Verifier | None = None, candidates: int = 3,
                 cap_for: Callable[[str], TenantBounds | None] = lambda tenant: None,
                 max_batch: int = 32, max_wait_s: float = 0.002, guard_rules: Sequence[str] | None = None,
                 observe_embed: Callable[[float], None] | None = None,
                 observe_search: Callable[[float], None] | None = None,
                 faults: StorageFaults | None = None, bulk_threads: int = 1,
                 learner: SemanticLearner | None = None, may_explore: Callable[[], bool] = lambda: True) -> None:
        self.embedder = embedder
        self.index = index
        self.rule_for = rule_for
        self.verifier = verifier
        self.candidates = candidates
        self.cap_for = cap_for  # tenant -> what its indexes may hold (its plan)
        self._guard_rules = tuple(guard_rules) if guard_rules is not None else DEFAULT_RULES
        self._observe_search = observe_search
        self._faults = faults
        self.learner = learner
        self.may_explore = may_explore  # False while the engine sheds load: exploring would cost it a slot
        # Decisions run on the index thread, labels arrive on the event loop: the (pure) learner is not thread-safe.
        self._learner_lock = threading.Lock()
        self._embed_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")
        # Bulk embedding (a warmup) gets threads of its own, so lookups never queue behind a warmup's batches; an
        # embedder that may not run on two threads at once shares the lookups' thread instead.
        self._bulk_executor = (ThreadPoolExecutor(max_workers=bulk_threads, thread_name_prefix="embed-bulk")
                               if bulk_threads > 1 and getattr(embedder, "thread_safe", False)
                               else self._embed_executor)
        # One thread for every index call: SemanticIndex serialises on a lock anyway, and a single thread keeps
        # adds in order with the searches that follow them.
        self._index_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semantic-index")
        self.batcher = EmbedBatcher(embedder, self._embed_executor, max_batch=max_batch, max_wait_s=max_wait_s,
                                    observe=observe_embed)
        self._closed = False
        #: Where what grouped warmup lines taught is kept (None: nowhere; a restart forgets it), and who else hears
        #: of it (the fleet's label feed).
        self.taught_log: TaughtLog | None = None
        self.on_taught: Callable[[Taught], None] | None = None
        #: The grouped lines taught so far per (tenant, scenario, namespace), and the lock that keeps teachings in
        #: order (each is worked out on what the one before left).
        self._grouped: dict[tuple[str, str, str], GroupedLines] = {}
        self._teaching = asyncio.Lock()
        index.on_release = self._index_released

    def _index_released(self, tenant: str, name: str) -> None:
        """An index was dropped whole or emptied (on the index thread): what its grouped lines were goes with it, so
        a later teaching there starts anew. One atomic dict operation: the event loop reads the dict too."""
        scenario, _, namespace = name.partition("~")
        self._grouped.pop((tenant, scenario, namespace), None)

    @staticmethod
    def index_scenario(scenario: str, namespace: str) -> str:
        """The index name within a tenant: the scenario, then the namespace (see :func:`probe_for`)."""
        return f"{scenario}~{namespace}"

    async def in_index_thread(self, fn: Callable[..., object], *args: object) -> object:
        """Run ``fn`` on the index's one thread, in order with every lookup and addition (the fleet's vectors go
        through here too)."""
        return await asyncio.get_running_loop().run_in_executor(self._index_executor, fn, *args)

    async def accepts(self, text: str) -> bool:
        """Whether ``text`` is embedded whole (at most the embedder's ``max_input_tokens``). A longer one is not
        matched semantically: its tail would not count. Short texts are answered at once; longer ones are
        counted on the embedding thread (bounded work, see ``embedders.fits_in_tokens``)."""
        if len(text) <= self.embedder.max_input_tokens - 2:
            return True
        fits = await asyncio.get_running_loop().run_in_executor(self._embed_executor, self.embedder.fits, text)
        return bool(fits)

    async def _on_disk(self, action: str, fallback: object, write: bool, fn: Callable[..., object],
                       *args: object) -> object:
        """Run an index call that touches the mapping or the index files. The semantic layer is optional, so a
        storage failure (a full disk, a file damaged while running) is counted and logged by ``faults`` and the
        call degrades to ``fallback`` (a lookup: no candidate; a write: skipped) instead of failing the request.
        Without ``faults`` (a bare cache in a script) the error propagates."""
        try:
            result = await self.in_index_thread(fn, *args)
        except STORAGE_ERRORS as exc:
            if self._faults is None:
                raise
            self._faults.record("semantic", exc, action=action, path=self.index.mapping_path)
            return fallback
        if write and self._faults is not None:
            self._faults.recovered("semantic")
        return result

    async def lookup(self, tenant: str, scenario: str, probe: Probe) -> Lookup:
        vector = await self.batcher.embed(probe.text)
        rule = self.rule_for(tenant, scenario)
        name = self.index_scenario(scenario, probe.namespace)
        decide: Decider
        k = 1
        if self.learner is not None:
            learner, lock, may_explore = self.learner, self._learner_lock, self.may_explore()  # on the loop

            def learned(best: Candidate) -> Decision:
                with lock:  # labels arrive on the event loop; the learner is not thread-safe
                    return learner.decide(tenant, scenario, best.store_key, best.similarity,
                                          rule.target_false_hit_rate, prior_cut=rule.threshold,
                                          may_explore=may_explore)

            decide = partial(_learner_decider, guard_rules=self._guard_rules, learned=learned)
        elif rule.threshold is not None or self.verifier is None:
            decide = partial(deciders.by_threshold, guard_rules=self._guard_rules)
        else:
            decide, k = partial(deciders.by_verifier, verifier=self.verifier), self.candidates

        def search() -> tuple[Lookup, float]:
            started = time.perf_counter()
            found = self.index.search(tenant, name, vector, k=k)
            outcome = decide(probe.text, found, rule, vector)
            return outcome, time.perf_counter() - started

        lookup, elapsed = await self._on_disk(  # type: ignore[misc]
            "lookup answered as a miss", (Lookup(vector=vector), 0.0), False, search)
        if self._observe_search is not None:
            self._observe_search(elapsed)
        return lookup

    def learn(self, tenant: str, scenario: str, lookup: Lookup, good: bool | None,
              answer_key: str | None = None) -> None:
        """A label of a decision the learner made (an exploration, or a candidate it refused): did the candidate's
        cached answer serve the query? A right one also puts the answer now cached for the query (``answer_key``)
        in the candidate's class, so each learns from the other's lookups. Labels of other decisions are ignored.

        ``good`` None (the labeler compared the answers and could not tell) counts as wrong: the learner's bound
        then holds for what the labels can verify. Ignoring it instead would let a labeler that can only ever say
        "right" (equality at temperature 0) teach the learner that every candidate it compared was right."""
        if self.learner is None or lookup.learned is None or lookup.candidate is None:
            return
        self._teach(tenant, scenario, lookup.candidate.store_key, lookup.candidate.similarity, good, answer_key,
                    decision=lookup.learned)

    def learn_shared(self, tenant: str, scenario: str, store_key: str, similarity: float, good: bool | None,
                     answer_key: str | None) -> None:
        """A label another node of the fleet got for a shared answer (:mod:`edgecache.fleet.labels`): taught as
        this node's own, except that it says nothing of this node's calibration (the decision was the other's)."""
        if self.learner is not None:
            self._teach(tenant, scenario, store_key, similarity, good, answer_key)

    def _teach(self, tenant: str, scenario: str, store_key: str, similarity: float, good: bool | None,
               answer_key: str | None, decision: Decision | None = None) -> bool:
        """One label to the learner; False when its scenario is no longer configured (a label from a log written
        before the profile changed, or from a fleet node whose profile still has it): nothing of it to teach."""
        assert self.learner is not None
        try:
            prior_cut = self.rule_for(tenant, scenario).threshold
        except KeyError:
            return False
        with self._learner_lock:
            self.learner.record(tenant, scenario, store_key, similarity, good is True, prior_cut=prior_cut,
                                decision=decision)
            if good is True and answer_key is not None and answer_key != store_key:
                self.learner.link(tenant, scenario, answer_key, store_key)
        return True

    async def teach(self, tenant: str, scenario: str, items: Sequence[tuple[Probe, str, str]]) -> int:
        """Warmup lines of one tenant and scenario given in groups, as (probe, store key, group), each already stored
        with its group's answer: what they teach the learner beside every grouped line taught before in the same
        namespace (:class:`~edgecache.semantic.teaching.GroupedLines`: a file sent in parts teaches what it would
        whole; only a namespace's entries are ever each other's candidates), on the vectors the index holds, as
        lookups meet them; kept in :attr:`taught_log` and handed to :attr:`on_taught`. Returns the labels taught (0
        without a learner)."""
        if self.learner is None or not items:
            return 0
        by_namespace: dict[str, list[tuple[str, str]]] = {}
        for probe, key, group in items:
            by_namespace.setdefault(probe.namespace, []).append((key, group))
        taught = 0
        async with self._teaching:  # one teaching at a time: each is worked out on what the one before left
            for namespace, lines in by_namespace.items():
                grouped = self._grouped.setdefault((tenant, scenario, namespace), GroupedLines())
                vectors = await self._on_disk("lines not taught", None, False, self.index.vectors_of, tenant,
                                              self.index_scenario(scenario, namespace),
                                              [*grouped.lines(), *(key for key, _ in lines)])
                if vectors is None:
                    continue  # the index could not be read: nothing is taught rather than a part of it
                found = await asyncio.to_thread(grouped.add, [key for key, _ in lines],
                                                [group for _, group in lines], vectors)
                found = msgspec.structs.replace(found, tenant=tenant, scenario=scenario, namespace=namespace)
                taught += self.teach_taught(found)
                if self.taught_log is not None:
                    await asyncio.to_thread(self.taught_log.append, found)
                if self.on_taught is not None:
                    self.on_taught(found)
        return taught

    def teach_taught(self, taught: Taught) -> int:
        """A teaching (this node's, one kept from before a restart, or a fleet node's) to the learner; 0 when its
        scenario is no longer configured. Its lines count as taught in their namespace, so a later teaching there
        is worked out beside them."""
        if self.learner is None:
            return 0
        try:
            prior_cut = self.rule_for(taught.tenant, taught.scenario).threshold
        except KeyError:
            return 0
        if taught.groups:
            self._grouped.setdefault((taught.tenant, taught.scenario, taught.namespace),
                                     GroupedLines()).known(taught.classes, taught.groups)
        with self._learner_lock:
            return self.learner.teach(taught.tenant, taught.scenario, taught.classes, taught.labels,
                                      variants=taught.variants, prior_cut=prior_cut)

    def taught_state(self, tenant: str, scenario: str) -> TaughtState | None:
        """What ``tenant``'s teaching allows now in ``scenario`` (:meth:`SemanticLearner.taught_state`, at the
        scenario's target); None without a learner, a teaching, or the scenario."""
        if self.learner is None:
            return None
        try:
            target = self.rule_for(tenant, scenario).target_false_hit_rate
        except KeyError:
            return None
        with self._learner_lock:
            return self.learner.taught_state(tenant, scenario, target)

    def learn_from_log(self, labelled: Iterable[tuple[DecisionRecord, bool | None]]) -> int:
        """Teach the learner the labels a decision log kept (at start: what this box learned before a restart, or
        under another rule before the learner was turned on). A candidate the guard refused is skipped, as it is
        live, and so is a label of a scenario the profile no longer has. Returns the labels taught."""
        if self.learner is None:
            return 0
        taught = 0
        for decision, good in labelled:
            if refusals.is_rule(decision.reason):
                continue
            assert decision.store_key is not None and decision.similarity is not None
            # One lock per label: lookups may already be deciding. None counts as wrong, as in learn.
            if self._teach(decision.tenant, decision.scenario, decision.store_key, decision.similarity, good, None):
                taught += 1
        return taught

    def learned(self) -> dict[str, object] | None:
        """What the learner holds (None without one): per ``tenant/scenario`` its lookups, explorations, labels and
        estimated false-hit rate with its bound; entries tracked; entries demoted."""
        if self.learner is None:
            return None
        with self._learner_lock:
            pools = {f"{tenant}/{scenario}": figures for (tenant, scenario), figures in self.learner.summary().items()}
            return {"pools": pools, "entries": self.learner.entries, "demoted": self.learner.demoted}

    async def remember(self, tenant: str, scenario: str, probe: Probe, vector: np.ndarray, store_key: str) -> None:
        await self._on_disk("vector not indexed", None, True, self.index.add, tenant,
                            self.index_scenario(scenario, probe.namespace), vector, store_key, probe.text,
                            self.cap_for(tenant))

    async def embed_many(self, texts: Sequence[str], batch: int = 256) -> np.ndarray:
        """Vectors of many texts (a warmup), in the order given, in batches far larger than a lookup's micro-batch,
        side by side on the bulk threads (lookups keep their own thread). Identical texts are embedded once."""
        # Sorted by length, so a batch's texts pad to similar lengths (about 10 % faster on mixed zh/en lines).
        unique = sorted(dict.fromkeys(texts), key=len)
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(*(loop.run_in_executor(self._bulk_executor, self.embedder.embed,
                                                            unique[start:start + batch])
                                       for start in range(0, len(unique), batch)))
        vectors = np.concatenate(parts) if parts else np.zeros((0, self.embedder.dim), dtype=np.float32)
        row = {text: i for i, text in enumerate(unique)}
        return vectors[[row[text] for text in texts]] if len(texts) else vectors

    async def remember_many(self, tenant: str, scenario: str,
                            items: Sequence[tuple[Probe, np.ndarray, str]]) -> None:
        """:meth:`remember` for many (probe, vector, store key): one batched add per index."""
        by_index: dict[str, list[tuple[Probe, np.ndarray, str]]] = {}
        for item in items:
            by_index.setdefault(self.index_scenario(scenario, item[0].namespace), []).append(item)
        for name, group in by_index.items():
            await self._on_disk("vectors not indexed", None, True, self.index.add_many, tenant, name,
                                np.stack([vector for _, vector, _ in group]), [key for _, _, key in group],
                                [probe.text for probe, _, _ in group], self.cap_for(tenant))

    async def forget(self, tenant: str, scenario: str, probe: Probe, vector_key: int,
                     store_key: str | None = None) -> None:
        """Drop a vector whose result-store entry is gone (expired or evicted), and what was learned about it."""
        if self.learner is not None and store_key is not None:
            with self._learner_lock:
                self.learner.forget(tenant, scenario, store_key)
        await self._on_disk("stale vector kept", 0, True, self.index.remove, tenant,
                            self.index_scenario(scenario, probe.namespace), [vector_key])

    async def drop(self, tenant: str | None = None, scenario: str | None = None) -> None:
        def drop_matching() -> None:
            for tenant_, name in list(self.index.sizes()):
                if tenant in (None, tenant_) and scenario in (None, name.split("~", 1)[0]):
                    self.index.drop(tenant_, name)

        if self.learner is not None:
            with self._learner_lock:
                self.learner.drop(tenant, scenario)
        for key in [key for key in list(self._grouped) if tenant in (None, key[0]) and scenario in (None, key[1])]:
            self._grouped.pop(key, None)  # (the index thread may have released it meanwhile)
        if self.taught_log is not None:
            await asyncio.to_thread(self.taught_log.drop, tenant, scenario)
        try:
            await self.in_index_thread(drop_matching)
        except STORAGE_ERRORS as exc:
            if self._faults is not None:
                self._faults.record("semantic", exc, action="flush failed", path=self.index.mapping_path)
            raise StorageUnavailable(f"the semantic index could not be flushed: {exc}") from exc

    async def usage(self, tenant: str) -> TenantUsage:
        """What ``tenant``'s indexes hold (its ``/stats``)."""
        usage = await self._on_disk("usage not read", TenantUsage(), False, self.index.usage, tenant)
        return usage  # type: ignore[return-value]

    async def save(self) -> None:
        # A failed save loses nothing: the mapping holds every vector and the next open rebuilds the file.
        await self._on_disk("index files not saved", None, True, self.index.save)

    async def sizes(self) -> dict[tuple[str, str], int]:
        """Vectors per (tenant, scenario), summed over the scenario's namespaces."""
        raw: dict[tuple[str, str], int] = await self._on_disk(  # type: ignore[assignment]
            "sizes not read", {}, False, self.index.sizes)
        out: dict[tuple[str, str], int] = {}
        for (tenant, name), count in raw.items():
            key = (tenant, name.split("~", 1)[0])
            out[key] = out.get(key, 0) + count
        return out

    def close(self) -> None:
        """Save the indexes and stop the workers; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._embed_executor.shutdown(wait=True)
        self._bulk_executor.shutdown(wait=True)
        self._index_executor.shutdown(wait=True)
        self.index.close()
