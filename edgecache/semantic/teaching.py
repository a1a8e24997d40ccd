"""What a tenant's grouped questions teach the semantic learner, and where that is kept across restarts.

A warmup line may name a ``group``: the lines of one group mean the same thing and share one answer. Every variant is
cached and indexed with that answer; :class:`GroupedLines` turns the groups of an index into labels for
:meth:`edgecache.semantic.learner.SemanticLearner.teach`, as if each variant had been looked up against the others:

- a variant and its nearest variant of the same group, where no variant of another group is nearer: a right answer
  at their similarity (a lookup meets its nearest candidate);
- a variant and its nearest variant of another group: a wrong answer at theirs.

Lines sent apart (a file's parts, or another file later) are taught against every grouped line the index already
holds, so what a file teaches does not depend on how it was cut into sends. So the learner's pooled curve starts from
the tenant's own questions, not from a prior, and the false-hit target holds from the first lookup.
:class:`TaughtLog` keeps what was taught (JSON lines under the data dir), so a restart teaches it again; a flush drops
a tenant's or a scenario's lines.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import msgspec
import numpy as np

#: Cells of the similarity matrix computed at once (rows of it at a time: 64 MB).
_CELLS = 1 << 24


class Taught(msgspec.Struct, frozen=True):
    """One teaching: the answer classes (store keys of one group each) and the labels on them."""

    tenant: str
    scenario: str
    classes: list[list[str]]
    #: (store key, similarity, right?, the variant's nearest candidate?): one label per variant is the lookup it
    #: stands for (its nearest), the others are more wrong answers it knows of
    labels: list[tuple[str, float, bool, bool]]
    #: The namespace its lines were indexed in, and each class's group name (a later teaching of the same index is
    #: taught against these: :class:`GroupedLines`); empty in a teaching kept before they were recorded.
    namespace: str = ""
    groups: list[str] = []
    #: The store key of the variant each label stands for: a later teaching that names a variant again replaces its
    #: labels (:meth:`edgecache.semantic.learner.SemanticLearner.teach`); empty: the labels are never replaced.
    variants: list[str] = []


class GroupedLines:
    """The grouped lines taught so far in one index (a tenant, scenario and namespace): each variant's group, and its
    nearest variant of its own group and of another (:meth:`add`).

    ``edgecache warmup`` sends a file in parts (2,048 lines or 512 KiB each, a group whole), and each part's lines
    meet every line of the index at lookup time, not only those they were sent with. So a part is taught against
    every line taught before it, and where one of its lines is nearer to an earlier line than that line's nearest
    was, the earlier line's labels are taught again (a teaching names its variants, and the learner replaces a
    variant's labels). After the last part the labels are those of the whole file taught at once: a class's wrong
    labels come from every group of the file, not from the few sent with it.
    """

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.groups: list[str] = []
        self._position: dict[str, int] = {}
        #: Per variant (rows in ``keys`` order): the similarity of its nearest variant of its own group and that
        #: variant's position, then the same of another group (-inf and -1 where there is none); None when unknown
        #: (lines known from a kept teaching, or an index that lost some of them): the next :meth:`add` works it
        #: out again for every line.
        self._nearest: np.ndarray | None = np.zeros((0, 4))

    def known(self, classes: Sequence[Sequence[str]], groups: Sequence[str]) -> None:
        """Lines a kept (or another node's) teaching taught, by class and group name: counted as taught, their
        nearest worked out again at the next :meth:`add`."""
        for keys, group in zip(classes, groups):
            for key in keys:
                at = self._position.get(key)
                if at is None:
                    self._position[key] = len(self.keys)
                    self.keys.append(key)
                    self.groups.append(group)
                    self._nearest = None
                elif self.groups[at] != group:
                    self.groups[at] = group
                    self._nearest = None

    def add(self, keys: Sequence[str], groups: Sequence[str], vectors: Mapping[str, np.ndarray]) -> Taught:
        """Teach the lines ``keys`` in ``groups`` beside those taught before; ``vectors``: the unit vector of every
        line the index holds (earlier ones included). Returns the teaching: the classes of the groups sent (with
        their earlier lines, so they are one class), and the labels of every variant whose nearest changed (the new
        ones, and earlier ones a new line came nearer to), each naming its variant. A line the index no longer
        holds is dropped (the others' nearest worked out again)."""
        if any(key not in vectors for key in self.keys):
            kept = [(k, g) for k, g in zip(self.keys, self.groups) if k in vectors]
            self.keys, self.groups = [k for k, _ in kept], [g for _, g in kept]
            self._position = {k: n for n, k in enumerate(self.keys)}
            self._nearest = None
        first = len(self.keys)
        sent: dict[str, None] = {}
        for key, group in zip(keys, groups):
            if key not in vectors:
                continue  # not indexed: never anyone's candidate
            sent.setdefault(group)
            at = self._position.get(key)
            if at is None:
                self._position[key] = len(self.keys)
                self.keys.append(key)
                self.groups.append(group)
            elif self.groups[at] != group:
                self.groups[at] = group
                self._nearest = None
        n = len(self.keys)
        matrix = np.stack([np.asarray(vectors[key], dtype=np.float32) for key in self.keys]) if n else \
            np.zeros((0, 0), dtype=np.float32)
        names = {g: i for i, g in enumerate(dict.fromkeys(self.groups))}
        ids = np.array([names[g] for g in self.groups], dtype=np.int64)
        if self._nearest is None:
            self._nearest = np.tile([-np.inf, -1.0, -np.inf, -1.0], (n, 1))
            changed = np.ones(n, dtype=bool)
            rows = range(0, n)
        else:
            self._nearest = np.vstack([self._nearest, np.tile([-np.inf, -1.0, -np.inf, -1.0], (n - first, 1))])
            changed = np.zeros(n, dtype=bool)
            changed[first:] = True
            rows = range(first, n)
        before = self._nearest.copy()
        new_rows = np.arange(rows.start, rows.stop)
        # Rows at a time: a variant's similarity to every line is a row of the matrix; a file of 100k lines would
        # be 40 GB whole.
        step = max(1, _CELLS // max(n, 1))
        for start in range(0, len(new_rows), step):
            chunk = new_rows[start:start + step]
            sim = matrix[chunk] @ matrix.T
            sim[np.arange(len(chunk)), chunk] = -np.inf
            same = ids[chunk][:, None] == ids[None, :]
            self._nearest[chunk] = _nearest_of(sim, same)
            # The earlier lines (columns) this chunk may have come nearer to: kept unless strictly nearer, so a tie
            # keeps the earlier variant, as one teaching of the whole file would.
            if rows.start:
                old = slice(0, rows.start)
                closer = _nearest_of(sim[:, old].T, same[:, old].T, offset=chunk[0])
                mine = self._nearest[old]
                for col in (0, 2):
                    better = closer[:, col] > mine[:, col]
                    mine[better, col] = closer[better, col]
                    mine[better, col + 1] = closer[better, col + 1]
        changed |= np.any(self._nearest != before, axis=1)
        labels: list[tuple[str, float, bool, bool]] = []
        variants: list[str] = []
        for i in np.flatnonzero(changed):
            same_sim, same_at, other_sim, other_at = self._nearest[i]
            # A right answer only where the variant's nearest candidate is of its own group: a lookup meets its
            # nearest, and a right answer behind a nearer wrong one would teach the pool that such lookups come right.
            nearest_inside = same_at >= 0 and same_sim >= other_sim
            if nearest_inside:
                labels.append((self.keys[int(same_at)], float(same_sim), True, True))
                variants.append(self.keys[i])
            if other_at >= 0:
                labels.append((self.keys[int(other_at)], float(other_sim), False, not nearest_inside))
                variants.append(self.keys[i])
        taught = set(sent) if rows.start else set(self.groups)
        members: dict[str, list[str]] = {}
        for key, group in zip(self.keys, self.groups):
            if group in taught:
                members.setdefault(group, []).append(key)
        return Taught(tenant="", scenario="", classes=list(members.values()), labels=labels,
                      groups=list(members), variants=variants)


def _nearest_of(sim: np.ndarray, same: np.ndarray, offset: int = 0) -> np.ndarray:
    """Per row of ``sim``: the highest similarity where ``same`` and its column, then where not (-inf and -1 where
    there is none); columns counted from ``offset``."""
    out = np.empty((sim.shape[0], 4))
    for col, mask in ((0, same), (2, ~same)):
        masked = np.where(mask, sim, -np.inf)
        at = np.argmax(masked, axis=1) if masked.shape[1] else np.zeros(masked.shape[0], dtype=np.int64)
        best = masked[np.arange(len(at)), at] if masked.shape[1] else np.full(len(at), -np.inf)
        out[:, col] = best
        out[:, col + 1] = np.where(np.isfinite(best), at + offset, -1)
    return out


def group_labels(keys: Sequence[str], groups: Sequence[str], vectors: np.ndarray) -> Taught:
    """The classes and labels that ``keys`` (each cached with its group's answer), grouped by ``groups`` and embedded
    as ``vectors`` (unit rows), teach at once (:meth:`GroupedLines.add`); ``tenant`` and ``scenario`` are left empty
    for the caller."""
    return GroupedLines().add(keys, groups, dict(zip(keys, np.asarray(vectors, dtype=np.float32))))


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
