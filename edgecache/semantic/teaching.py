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
        #: Every line taught here (store key and group), in the order taught.
        self.keys: list[str] = []
        self.groups: list[str] = []
        self._position: dict[str, int] = {}
        #: Lines a kept or another node's teaching taught, (classes, groups), merged at the next :meth:`add` (which
        #: runs on a worker thread: appending here is all :meth:`known` does on the caller's).
        self._pending: list[tuple[Sequence[Sequence[str]], Sequence[str]]] = []
        #: The lines the last :meth:`add` worked on (those the index held then), and per line, in that order: the
        #: similarity of its nearest line of its own group and that line's row, then the same of another group
        #: (-inf and -1 where there is none).
        self._present: list[str] = []
        self._nearest = np.zeros((0, 4))

    def lines(self) -> list[str]:
        """Every line taught here so far (those a kept or another node's teaching taught included): the vectors
        :meth:`add` needs besides the new lines'."""
        return [*self.keys, *(key for classes, _ in list(self._pending) for members in classes for key in members)]

    def known(self, classes: Sequence[Sequence[str]], groups: Sequence[str]) -> None:
        """Lines a kept (or another node's) teaching taught, by class and group name: taught here from the next
        :meth:`add` on, their nearest worked out again there."""
        self._pending.append((classes, groups))

    def add(self, keys: Sequence[str], groups: Sequence[str], vectors: Mapping[str, np.ndarray]) -> Taught:
        """Teach the lines ``keys`` in ``groups`` beside those taught before; ``vectors``: the unit vector of every
        line the index holds (earlier ones included). Returns the teaching: the classes of the groups sent (with
        their earlier lines, so they are one class), and the labels of every line whose nearest changed (the new
        ones, and earlier ones a new line came nearer to), each naming its variant. Where the index holds other
        earlier lines than the last time (one expired, or a fleet node's came), every line is worked out again."""
        while self._pending:
            classes, names = self._pending.pop(0)
            for members, group in zip(classes, names):
                self._taught(members, [group] * len(members))
        earlier = [key for key in self.keys if key in vectors]
        sent = self._taught(keys, groups)
        present = [*earlier, *(key for key in dict.fromkeys(keys) if key in vectors and key not in earlier)]
        again = earlier != self._present
        n, first = len(present), 0 if again else len(self._present)
        matrix = np.stack([np.asarray(vectors[key], dtype=np.float32) for key in present]) if n else \
            np.zeros((0, 0), dtype=np.float32)
        names = {g: i for i, g in enumerate(dict.fromkeys(self.groups))}
        ids = np.array([names[self.groups[self._position[key]]] for key in present], dtype=np.int64)
        unknown = np.tile([-np.inf, -1.0, -np.inf, -1.0], (n - first, 1))
        before = np.vstack([self._nearest[:first], unknown])
        nearest = before.copy()
        rows = np.arange(first, n)
        # Rows at a time: a line's similarity to every line is a row of the matrix; a file of 100k lines would be
        # 40 GB whole.
        step = max(1, _CELLS // max(n, 1))
        for start in range(0, len(rows), step):
            chunk = rows[start:start + step]
            sim = matrix[chunk] @ matrix.T
            sim[np.arange(len(chunk)), chunk] = -np.inf
            same = ids[chunk][:, None] == ids[None, :]
            nearest[chunk] = _nearest_of(sim, same)
            if first:
                # The earlier lines (columns) this chunk may have come nearer to: kept unless strictly nearer, so a
                # tie keeps the earlier line, as one teaching of the whole file would.
                closer = _nearest_of(sim[:, :first].T, same[:, :first].T, offset=int(chunk[0]))
                mine = nearest[:first]
                for col in (0, 2):
                    better = closer[:, col] > mine[:, col]
                    mine[better, col] = closer[better, col]
                    mine[better, col + 1] = closer[better, col + 1]
        changed = np.any(nearest != before, axis=1)
        changed[first:] = True
        self._present, self._nearest = present, nearest
        labels: list[tuple[str, float, bool, bool]] = []
        variants: list[str] = []
        for i in np.flatnonzero(changed):
            same_sim, same_at, other_sim, other_at = nearest[i]
            # A right answer only where the line's nearest candidate is of its own group: a lookup meets its nearest,
            # and a right answer behind a nearer wrong one would teach the pool that such lookups come right.
            nearest_inside = same_at >= 0 and same_sim >= other_sim
            if nearest_inside:
                labels.append((present[int(same_at)], float(same_sim), True, True))
                variants.append(present[i])
            if other_at >= 0:
                labels.append((present[int(other_at)], float(other_sim), False, not nearest_inside))
                variants.append(present[i])
        taught = set(self.groups) if again else sent
        members: dict[str, list[str]] = {}
        for key, group in zip(self.keys, self.groups):
            if group in taught:
                members.setdefault(group, []).append(key)
        return Taught(tenant="", scenario="", classes=list(members.values()), labels=labels,
                      groups=list(members), variants=variants)

    def _taught(self, keys: Sequence[str], groups: Sequence[str]) -> set[str]:
        """Count ``keys`` in ``groups`` as taught here (a line taught again in another group moves to it); returns
        their groups."""
        for key, group in zip(keys, groups):
            at = self._position.get(key)
            if at is None:
                self._position[key] = len(self.keys)
                self.keys.append(key)
                self.groups.append(group)
            elif self.groups[at] != group:
                self.groups[at] = group
                self._present = []  # its earlier labels are another group's: every line is worked out again
        return set(groups)


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
