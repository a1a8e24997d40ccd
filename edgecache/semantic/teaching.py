"""What a tenant's grouped questions teach the semantic learner, and where that is kept across restarts.

A warmup line may name a ``group``: the lines of one group mean the same thing and share one answer. Every variant is
cached and indexed with that answer; :func:`group_labels` turns the groups into labels for
:meth:`edgecache.semantic.learner.SemanticLearner.teach`, as if each variant had been looked up against the others:

- a variant and its nearest variant of the same group, where no variant of another group is nearer: a right answer
  at their similarity (a lookup meets its nearest candidate);
- a variant and its nearest ``neighbours`` variants of other groups: wrong answers at theirs.

So the learner's pooled curve starts from the tenant's own questions, not from a prior, and the false-hit target holds
from the first lookup. :class:`TaughtLog` keeps what was taught (JSON lines under the data dir), so a restart teaches
it again; a flush drops a tenant's or a scenario's lines.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import numpy as np

#: Rows of the similarity matrix computed at once (a group file of 10k variants would be a 400 MB matrix whole).
_ROWS = 1024


class Taught(msgspec.Struct, frozen=True):
    """One teaching: the answer classes (store keys of one group each) and the labels on them."""

    tenant: str
    scenario: str
    classes: list[list[str]]
    #: (store key, similarity, right?, the variant's nearest candidate?): one label per variant is the lookup it
    #: stands for (its nearest), the others are more wrong answers it knows of
    labels: list[tuple[str, float, bool, bool]]


def group_labels(keys: Sequence[str], groups: Sequence[str], vectors: np.ndarray, *,
                 neighbours: int = 1) -> Taught:
    """The classes and labels that ``keys`` (each cached with its group's answer), grouped by ``groups`` and embedded
    as ``vectors`` (unit rows), teach; ``tenant`` and ``scenario`` are left empty for the caller."""
    by_group: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        by_group.setdefault(group, []).append(i)
    labels: list[tuple[str, float, bool, bool]] = []
    ids = np.array([list(by_group).index(g) for g in groups]) if len(groups) else np.zeros(0, dtype=int)
    if len(keys) > 1:
        vectors = np.asarray(vectors, dtype=np.float32)
        for start in range(0, len(keys), _ROWS):
            sim = vectors[start:start + _ROWS] @ vectors.T
            for row, i in enumerate(range(start, min(start + _ROWS, len(keys)))):
                s = sim[row]
                s[i] = -np.inf
                same = ids == ids[i]
                inside = np.where(same, s, -np.inf)
                j = int(np.argmax(inside))
                outside = np.where(same, -np.inf, s)
                # Only where the variant's nearest candidate is of its own group: a lookup meets its nearest, and a
                # right answer behind a nearer wrong one would teach the pool that such lookups come right.
                nearest_inside = bool(np.isfinite(inside[j]) and inside[j] >= outside.max())
                if nearest_inside:
                    labels.append((keys[j], float(inside[j]), True, True))
                k = min(neighbours, int((~same).sum()))
                for j in sorted(np.argpartition(-outside, k - 1)[:k] if k else (), key=lambda j: -outside[j]):
                    labels.append((keys[int(j)], float(outside[j]), False, not nearest_inside))
                    nearest_inside = True  # only the first is the variant's nearest
    classes = [[keys[i] for i in members] for members in by_group.values()]
    return Taught(tenant="", scenario="", classes=classes, labels=labels)


class TaughtLog:
    """What was taught, one :class:`Taught` per line of ``<directory>/taught.jsonl``: appended as it is taught, read
    back at start, rewritten without a tenant's (or scenario's) lines when they are flushed."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "taught.jsonl"
        self._lock = threading.Lock()
        self._encoder = msgspec.json.Encoder()

    def append(self, taught: Taught) -> None:
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("ab") as f:
                f.write(self._encoder.encode(taught) + b"\n")
                f.flush()
                os.fsync(f.fileno())

    def read(self) -> Iterator[Taught]:
        """Every teaching kept, oldest first; a damaged line (a crash mid-write) is skipped."""
        if not self.path.exists():
            return
        decoder = msgspec.json.Decoder(Taught)
        with self.path.open("rb") as f:
            for line in f:
                try:
                    yield decoder.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue

    def drop(self, tenant: str | None = None, scenario: str | None = None) -> None:
        """Forget what ``tenant`` (None: every tenant) taught for ``scenario`` (None: every scenario)."""
        with self._lock:
            if not self.path.exists():
                return
            kept = [t for t in self.read() if not (tenant in (None, t.tenant) and scenario in (None, t.scenario))]
            partial = self.path.with_suffix(".part")
            partial.write_bytes(b"".join(self._encoder.encode(t) + b"\n" for t in kept))
            partial.replace(self.path)
