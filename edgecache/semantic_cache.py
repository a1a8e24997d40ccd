"""Layer 3: answer a paraphrase from the answer cached for an earlier prompt.

What is matched. Only first-turn chat requests: system messages (any) followed by exactly one user message. The
user's text is embedded; everything else must be identical, so it goes into the index's namespace: the model
version, the salt, the system prompt and the output-affecting parameters are hashed into
:attr:`Probe.namespace`, and each (tenant, scenario, namespace) has an index of its own. A later turn of a
conversation, a raw completion, or a request whose system prompt differs never meets another's vectors.

When a candidate serves. The nearest stored prompt only (falling through to the second-nearest served more wrong
answers in the measurements), when its cosine similarity reaches the scenario's threshold and the guard
(:mod:`edgecache.guard`) finds no difference the answer depends on. The caller then reads the candidate's result
store entry; when that entry has expired or was evicted, the vector is dropped and the lookup is a miss, so a
semantic hit never serves an expired answer.

Cost. Embedding runs on a worker thread in micro-batches (:class:`EmbedBatcher`): concurrent lookups share one
model call. Index search and the guard run on the index's own worker thread. Nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np

from edgecache.embedders import Embedder
from edgecache.engines.base import GenerationRequest
from edgecache.guard import DEFAULT_RULES, check
from edgecache.health import STORAGE_ERRORS, StorageFaults
from edgecache.semantic_index import Candidate, SemanticIndex

_encoder = msgspec.json.Encoder()


class Probe(msgspec.Struct, frozen=True):
    """What a request offers the semantic layer: the text to embed and the namespace it must match in."""

    text: str
    namespace: str


def probe_for(request: GenerationRequest, model_version: str) -> Probe | None:
    """The semantic probe of a first-turn chat request, or None when the request is not matched semantically."""
    if request.messages is None:
        return None
    systems, rest = [], []
    for message in request.messages:
        (systems if message.role in ("system", "developer") and not rest else rest).append(message)
    if len(rest) != 1 or rest[0].role != "user" or not rest[0].content.strip():
        return None
    # Everything but the user's text: the system prompt, the sampling, and the tools, tool choice and response
    # format, so a paraphrase is never served across different tool sets or schemas.
    context = (model_version, msgspec.structs.replace(request, messages=tuple(systems)))
    return Probe(text=rest[0].content, namespace=hashlib.blake2b(_encoder.encode(context), digest_size=8).hexdigest())


class SemanticHit(msgspec.Struct, frozen=True):
    similarity: float
    store_key: str
    vector_key: int


class Lookup(msgspec.Struct, frozen=True):
    """A lookup's outcome: the hit (if any) and the query's vector, kept to index the answer on a miss."""

    vector: np.ndarray | None
    hit: SemanticHit | None = None
    refused_by_guard: str | None = None
    similarity: float | None = None


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
    """Embedder + per-namespace indexes + thresholds + guard, behind lookup / remember / forget."""

    def __init__(self, *, embedder: Embedder, index: SemanticIndex, threshold_for: Callable[[str], float],
                 cap_for: Callable[[str], int | None] = lambda tenant: None,
                 max_batch: int = 32, max_wait_s: float = 0.002, guard_rules: Sequence[str] | None = None,
                 observe_embed: Callable[[float], None] | None = None,
                 observe_search: Callable[[float], None] | None = None,
                 faults: StorageFaults | None = None) -> None:
        self.embedder = embedder
        self.index = index
        self.threshold_for = threshold_for
        self.cap_for = cap_for  # tenant -> most vectors one of its indexes keeps (its plan)
        self._guard_rules = tuple(guard_rules) if guard_rules is not None else DEFAULT_RULES
        self._observe_search = observe_search
        self._faults = faults
        self._embed_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")
        # One thread for every index call: SemanticIndex serialises on a lock anyway, and a single thread keeps
        # adds in order with the searches that follow them.
        self._index_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semantic-index")
        self.batcher = EmbedBatcher(embedder, self._embed_executor, max_batch=max_batch, max_wait_s=max_wait_s,
                                    observe=observe_embed)
        self._closed = False

    @staticmethod
    def index_scenario(scenario: str, namespace: str) -> str:
        """The index name within a tenant: the scenario, then the namespace (see :func:`probe_for`)."""
        return f"{scenario}~{namespace}"

    async def _in_index_thread(self, fn: Callable[..., object], *args: object) -> object:
        return await asyncio.get_running_loop().run_in_executor(self._index_executor, fn, *args)

    async def _on_disk(self, action: str, fallback: object, write: bool, fn: Callable[..., object],
                       *args: object) -> object:
        """Run an index call that touches the mapping or the index files. The semantic layer is optional, so a
        storage failure (a full disk, a file damaged while running) is counted and logged by ``faults`` and the
        call degrades to ``fallback`` (a lookup: no candidate; a write: skipped) instead of failing the request.
        Without ``faults`` (a bare cache in a script) the error propagates."""
        try:
            result = await self._in_index_thread(fn, *args)
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
        threshold = self.threshold_for(scenario)
        name = self.index_scenario(scenario, probe.namespace)

        def search() -> tuple[Candidate | None, str | None, float]:
            started = time.perf_counter()
            found = self.index.search(tenant, name, vector, k=1)
            elapsed = time.perf_counter() - started
            if not found or found[0].similarity < threshold:
                return (found[0] if found else None), None, elapsed
            verdict = check(probe.text, found[0].text, self._guard_rules)
            return found[0], (None if verdict.allowed else verdict.reason or "guard"), elapsed

        best, refusal, elapsed = await self._on_disk(  # type: ignore[misc]
            "lookup answered as a miss", (None, None, 0.0), False, search)
        if self._observe_search is not None:
            self._observe_search(elapsed)
        if best is None:
            return Lookup(vector=vector)
        if best.similarity < threshold or refusal is not None:
            return Lookup(vector=vector, refused_by_guard=refusal, similarity=best.similarity)
        return Lookup(vector=vector, similarity=best.similarity,
                      hit=SemanticHit(similarity=best.similarity, store_key=best.store_key,
                                      vector_key=best.vector_key))

    async def remember(self, tenant: str, scenario: str, probe: Probe, vector: np.ndarray, store_key: str) -> None:
        await self._on_disk("vector not indexed", None, True, self.index.add, tenant,
                            self.index_scenario(scenario, probe.namespace), vector, store_key, probe.text,
                            self.cap_for(tenant))

    async def embed_many(self, texts: Sequence[str], batch: int = 256) -> np.ndarray:
        """Vectors of many texts (a warmup), in the order given, in batches far larger than a lookup's micro-batch,
        on the embedding thread (so lookups still interleave between batches). Identical texts are embedded once."""
        # Sorted by length, so a batch's texts pad to similar lengths (about 10 % faster on mixed zh/en lines).
        unique = sorted(dict.fromkeys(texts), key=len)
        loop = asyncio.get_running_loop()
        parts = []
        for start in range(0, len(unique), batch):
            parts.append(await loop.run_in_executor(self._embed_executor, self.embedder.embed,
                                                    unique[start:start + batch]))
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

    async def forget(self, tenant: str, scenario: str, probe: Probe, vector_key: int) -> None:
        """Drop a vector whose result-store entry is gone (expired or evicted)."""
        await self._on_disk("stale vector kept", 0, True, self.index.remove, tenant,
                            self.index_scenario(scenario, probe.namespace), [vector_key])

    async def drop(self, tenant: str | None = None, scenario: str | None = None) -> None:
        def drop_matching() -> None:
            for tenant_, name in list(self.index.sizes()):
                if tenant in (None, tenant_) and scenario in (None, name.split("~", 1)[0]):
                    self.index.drop(tenant_, name)

        await self._in_index_thread(drop_matching)

    async def save(self) -> None:
        # A failed save loses nothing: the mapping holds every vector and the next open rebuilds the file.
        await self._on_disk("index files not saved", None, True, self.index.save)

    async def sizes(self) -> dict[tuple[str, str], int]:
        """Vectors per (tenant, scenario), summed over the scenario's namespaces."""
        raw: dict[tuple[str, str], int] = await self._in_index_thread(self.index.sizes)  # type: ignore[assignment]
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
        self._index_executor.shutdown(wait=True)
        self.index.close()
