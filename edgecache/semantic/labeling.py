"""Labels: whether a cached answer serves a query, told by comparing it with the answer the engine computed fresh.

A :class:`Labeler` compares two answer texts for one request and says True (the cached answer serves), False
(it does not) or None (it cannot tell). Three ship:

- :class:`EqualityLabeler`: for greedy (temperature-0) requests, the same text up to whitespace is the same answer.
  A different text is not called wrong by it (a paraphrase can reword a correct answer); it says None and leaves
  the call to the next labeler.
- :class:`AnswerEmbeddingLabeler`: the two answers' cosine under the semantic layer's own embedder: True at or above
  a high bar (0.95 by default), False below a floor (0.3), None between. The bar is high on purpose: a label feeds a
  false-hit target of about 1 %, so a wrong "good" (it hides a false hit and lets ``tune`` lower the cut) costs far
  more than a wrong "bad" (it only keeps the cut higher). The floor exists because a wrong "bad" is common: measured
  with the shipped CPU model on 60 of GPTCache's pairs (``scripts/measure_answer_labels.py``), a query and its
  rewrite get answers whose cosine has a median of 0.71, unrelated queries' answers a median of 0.15 (at most 0.60);
  calling everything under 0.95 wrong would have labelled 97 % of true paraphrases as false hits. Below 0.3: 13 % of
  the paraphrases and 83 % of the unrelated pairs.
- :class:`~edgecache.semantic.judge.ModelJudgeLabeler` (``semantic.label_judge``): the served model itself, asked
  for one token, whether the cached answer answers the question as the fresh one does; used only where the served
  model can judge and once it has passed its check at start (:mod:`edgecache.semantic.judge`).

:class:`FirstVerdict` chains them: equality first, then the judge (when on), then embeddings.

The first label source needs no extra engine time: when a lookup refused its nearest candidate and the engine then
computed the answer, :class:`MissLabels` compares that fresh answer with the candidate's cached one, appends a
label record to the decision log and hands the label to ``observe`` (the metrics, and the semantic layer's learner).
An exploration (the learner refused a candidate it would have served, to find out) is labelled the same way. It runs after the answer is stored, as a background task (at most ``max_pending``
at once; past that a label is skipped and counted), and costs one store read and one embedding call. While the engine
has misses queued (``busy``) no label of a refusal is started: the embedding would compete with lookups for the CPU
exactly when the box is short of it (``scripts/bench_decision_log.py`` measures the cost). An exploration's label
is always started: the engine time it cost was spent for that label.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import numpy as np

from edgecache.call import Call
from edgecache.engines.base import GenerationRequest
from edgecache.semantic.decision_log import DecisionLog
from edgecache.semantic.lookup import Lookup
from edgecache.stores import ResultStore

log = logging.getLogger("edgecache")

DEFAULT_ANSWER_BAR = 0.95
DEFAULT_ANSWER_FLOOR = 0.3


class Labeler(Protocol):
    """Tells whether ``cached`` (the answer kept for a similar query) serves ``request`` as ``fresh`` does."""

    name: str

    async def label(self, cached: str, fresh: str, request: GenerationRequest) -> bool | None: ...


def normalised(text: str) -> str:
    return " ".join(text.split())


class EqualityLabeler:
    """Greedy decoding: an identical answer (whitespace aside) is a right one. Anything else: cannot tell."""

    name = "equality"

    async def label(self, cached: str, fresh: str, request: GenerationRequest) -> bool | None:
        if request.params.temperature != 0.0:
            return None  # a sampled answer differs from call to call; equality says nothing
        return True if normalised(cached) == normalised(fresh) else None


class AnswerEmbeddingLabeler:
    """Cosine of the two answers' embeddings at or above ``bar``: True; below ``floor``: False; between: cannot
    tell. ``embed`` embeds texts (off the event loop: the semantic layer's embedding threads)."""

    name = "answer-embedding"

    def __init__(self, embed: Callable[[Sequence[str]], Awaitable[np.ndarray]], bar: float = DEFAULT_ANSWER_BAR,
                 floor: float = DEFAULT_ANSWER_FLOOR) -> None:
        self.embed = embed
        self.bar = bar
        self.floor = min(floor, bar)

    async def label(self, cached: str, fresh: str, request: GenerationRequest) -> bool | None:
        if not cached.strip() or not fresh.strip():
            return None
        if normalised(cached) == normalised(fresh):
            return True
        vectors = np.asarray(await self.embed([cached, fresh]), dtype=np.float32)
        a, b = vectors[0], vectors[1]
        cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))
        if cosine >= self.bar:
            return True
        return False if cosine < self.floor else None


class FirstVerdict:
    """The first labeler that can tell decides; ``name`` is recorded as the label's source."""

    def __init__(self, *labelers: Labeler) -> None:
        self.labelers = labelers
        self.name = "+".join(labeler.name for labeler in labelers)

    async def label(self, cached: str, fresh: str, request: GenerationRequest) -> bool | None:
        for labeler in self.labelers:
            verdict = await labeler.label(cached, fresh, request)
            if verdict is not None:
                return verdict
        return None


class MissLabels:
    """Labels a refused candidate against the answer the engine computed instead, in the background.

    ``stores`` gives a tenant's result store; ``decisions`` (None: not logged) gets a label record per label;
    ``observe(call, lookup, answer_key, good)`` gets each label (``answer_key``: where the fresh answer is stored;
    ``good`` None: compared, could not tell). ``labelled`` / ``unverified`` / ``skipped`` count labels made, answers
    compared without a verdict, and labels skipped (a full queue, or ``busy()``: the box is
    shedding or queueing load).
    """

    def __init__(self, *, stores: Callable[[str], ResultStore], labeler: Labeler, decisions: DecisionLog | None,
                 observe: Callable[[Call, Lookup, str, bool | None], None] | None = None, max_pending: int = 8,
                 busy: Callable[[], bool] = lambda: False) -> None:
        self.stores = stores
        self.labeler = labeler
        self.decisions = decisions
        self.observe = observe
        self.max_pending = max_pending
        self.busy = busy
        self.labelled = 0
        self.unverified = 0  # compared, and the labeler could not tell
        self.skipped = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def after_miss(self, call: Call, decision_id: str | None, lookup: Lookup, fresh: str, answer_key: str) -> None:
        """Schedule the label of ``lookup``'s refused candidate against ``fresh``, the answer stored under
        ``answer_key`` (nothing when the candidate served or there was none)."""
        if lookup.candidate is None or lookup.refusal is None:  # no candidate, or it served
            return
        if len(self._tasks) >= self.max_pending * (2 if lookup.explored else 1) or (
                self.busy() and not lookup.explored):
            self.skipped += 1
            return
        task = asyncio.get_running_loop().create_task(
            self._label(call, decision_id, lookup, fresh, answer_key), name="label")
        self._tasks.add(task)  # held: the loop keeps only weak references to tasks
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("labelling a refused candidate failed", exc_info=task.exception())

    async def _label(self, call: Call, decision_id: str | None, lookup: Lookup, fresh: str, answer_key: str) -> None:
        assert lookup.candidate is not None
        cached = await self.stores(call.tenant).get(lookup.candidate.store_key)
        if cached is None:
            return  # the candidate's answer is gone: nothing to compare
        good = await self.labeler.label(cached.text, fresh, call.request)
        # "Could not tell" is kept too: a labeler that can only ever say "right" (equality) would otherwise teach
        # whoever reads the labels that every candidate it compared was right.
        if self.decisions is not None and decision_id is not None:
            self.decisions.labelled(decision_id, good, self.labeler.name)
        if good is None:
            self.unverified += 1
        else:
            self.labelled += 1
        if self.observe is not None:
            self.observe(call, lookup, answer_key, good)

    async def drain(self) -> None:
        """Wait for the labels under way (shutdown: before the decision log closes)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))
