"""The decision log: every semantic decision, and later the labels that say whether it was right, as JSON lines.

``edgecache tune`` replays it to find, per tenant and scenario, the lowest similarity cut that meets a false-hit
target (the field report's advice: tune thresholds from replayed production traffic, never by feel). Two kinds of
record share the files, told apart by ``kind``::

    {"kind":"decision","id":"9f2c01aa-17","t":1764730000.1,"tenant":"acme","scenario":"support",
     "query_hash":"5d41...","query":null,"store_key":"...","vector_key":42,"similarity":0.83,"score":null,
     "decision":"refused","reason":"below_threshold"}
    {"kind":"label","id":"9f2c01aa-17","t":1764730001.4,"good":false,"labeler":"answer-embedding"}

``decision`` is ``hit`` (the candidate served), ``miss`` (no candidate, or its answer gone or too old: ``reason``),
``refused`` (a candidate was there and not served: ``reason`` is the lookup's refusal) or ``explore`` (the
candidate would have served, but the engine answered to label it). A label names its decision's id; ``good`` says
whether the candidate's cached answer serves the query, or is ``null`` when the labeler compared the two answers and
could not tell (the learner counts such a candidate as wrong, and so does ``tune`` unless told ``--unverified skip``).

**Query text** is kept only for a tenant whose plan says ``log_prompts = true``; otherwise the record holds a keyed
hash of it (BLAKE2b keyed with a secret kept beside the log, so equal queries can be matched within the log but a
short prompt cannot be found by hashing guesses) and the scores.

**Bounded and off the loop.** Records are encoded on the event loop (a microsecond) and handed to one writer thread,
which appends them in batches (every ``flush_interval_s``, or sooner when many are waiting). The files rotate: at
most ``files`` files of ``max_bytes / files`` bytes each, the oldest deleted first, so the log never holds more than
``max_bytes``. When the writer falls behind, records past ``max_pending`` are dropped and counted. A failed write (a
full disk) is counted and logged once per interval through :class:`~edgecache.health.StorageFaults` (component
``decisions``) and never reaches a request.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal

import msgspec

from edgecache.health import STORAGE_ERRORS, StorageFaults

log = logging.getLogger("edgecache")

COMPONENT = "decisions"
FILE_PATTERN = re.compile(r"^decisions-(\d{8})\.jsonl$")
KEY_FILE = ".query-key"

Decision = Literal["hit", "miss", "refused", "explore"]


class DecisionRecord(msgspec.Struct, tag="decision", tag_field="kind", kw_only=True, omit_defaults=True):
    id: str
    t: float
    tenant: str
    scenario: str
    query_hash: str
    decision: Decision
    query: str | None = None
    reason: str | None = None
    store_key: str | None = None
    vector_key: int | None = None
    similarity: float | None = None
    score: float | None = None


class LabelRecord(msgspec.Struct, tag="label", tag_field="kind", kw_only=True):
    id: str
    t: float
    good: bool | None  # None: compared, and the labeler could not tell
    labeler: str


Record = DecisionRecord | LabelRecord

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)


def log_files(path: Path) -> list[Path]:
    """The log's files, oldest first: ``path`` itself when it is a file, else the rotated files in the folder."""
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if FILE_PATTERN.match(p.name)) if path.is_dir() else []


def read_records(path: Path, on_bad_line: Callable[[Path, int], None] | None = None,
                 on_bytes: Callable[[int], None] | None = None) -> Iterator[Record]:
    """Every record of a log file or folder, in order. A line that does not decode (the tail of a file a crash cut
    short) is skipped and reported to ``on_bad_line``; ``on_bytes`` hears how many bytes were read, now and then
    (a progress bar)."""
    for file in log_files(path):
        with file.open("rb") as lines:
            unreported = 0
            for number, line in enumerate(lines, 1):
                unreported += len(line)
                if on_bytes is not None and unreported >= 1 << 20:
                    on_bytes(unreported)
                    unreported = 0
                if not line.strip():
                    continue
                try:
                    yield _decoder.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    if on_bad_line is not None:
                        on_bad_line(file, number)
            if on_bytes is not None and unreported:
                on_bytes(unreported)


def labelled_decisions(records: Iterable[Record], *,
                       window: int = 100_000) -> Iterator[tuple[DecisionRecord, bool | None]]:
    """Each decision that has a label, with the label (None: could not tell), in the order the labels came. A label
    follows its decision within seconds, so only the last ``window`` decisions wait for theirs: memory is bounded
    whatever the log's size."""
    waiting: OrderedDict[str, DecisionRecord] = OrderedDict()
    for record in records:
        if isinstance(record, DecisionRecord):
            if record.store_key is not None and record.similarity is not None:
                waiting[record.id] = record
                if len(waiting) > window:
                    waiting.popitem(last=False)
        elif (decision := waiting.get(record.id)) is not None:
            yield decision, record.good


class DecisionLog:
    """Appends decision and label records to rotated files under ``directory`` from a writer thread.

    ``keeps_prompts(tenant)`` says whether a tenant's plan lets its query text be kept. ``dropped`` counts records
    lost to a full queue or a failed write; ``written`` those appended.
    """

    def __init__(self, directory: Path, *, max_bytes: int, files: int = 8,
                 keeps_prompts: Callable[[str], bool] = lambda tenant: False,
                 faults: StorageFaults | None = None, flush_interval_s: float = 1.0, max_pending: int = 50_000,
                 on_drop: Callable[[int], None] | None = None, clock: Callable[[], float] = time.time) -> None:
        if max_bytes <= 0 or files < 1:
            raise ValueError("a decision log needs max_bytes > 0 and files >= 1")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.files = files
        self.file_bytes = max(1, max_bytes // files)
        self.keeps_prompts = keeps_prompts
        self.flush_interval_s = flush_interval_s
        self.max_pending = max_pending
        self._faults = faults
        self._on_drop = on_drop
        self._clock = clock
        self.written = 0
        self.dropped = 0
        # Ids unique across restarts without coordination: a random prefix per process, then a counter.
        self._prefix = secrets.token_hex(4)
        self._counter = itertools.count(1)
        self._pending: deque[bytes] = deque()
        self._wake = threading.Event()
        self._write_lock = threading.Lock()  # held while a batch is being written (flush waits on it)
        self._stop = False
        self._query_key = self._load_query_key()
        self._current: Path | None = None
        self._current_size = 0
        self._thread = threading.Thread(target=self._run, name="decision-log", daemon=True)
        self._thread.start()

    # --- the event loop's side: encode and hand over -----------------------------------------------------------

    def query_hash(self, text: str) -> str:
        return hashlib.blake2b(text.encode("utf-8"), key=self._query_key, digest_size=16).hexdigest()

    def decided(self, tenant: str, scenario: str, query: str, decision: Decision, *, reason: str | None = None,
                store_key: str | None = None, vector_key: int | None = None, similarity: float | None = None,
                score: float | None = None) -> str:
        """Append a decision; returns its id (for the label that may follow)."""
        record = DecisionRecord(
            id=f"{self._prefix}-{next(self._counter)}", t=round(self._clock(), 3), tenant=tenant,
            scenario=scenario, query_hash=self.query_hash(query),
            query=query if self.keeps_prompts(tenant) else None, decision=decision, reason=reason,
            store_key=store_key, vector_key=vector_key,
            similarity=None if similarity is None else round(float(similarity), 5),
            score=None if score is None else round(float(score), 5))
        self._put(_encoder.encode(record))
        return record.id

    def labelled(self, decision_id: str, good: bool | None, labeler: str) -> None:
        """Append the label of an earlier decision."""
        self._put(_encoder.encode(LabelRecord(id=decision_id, t=round(self._clock(), 3), good=good,
                                              labeler=labeler)))

    def _put(self, line: bytes) -> None:
        if self._stop:
            return
        if len(self._pending) >= self.max_pending:
            self._drop(1)
            return
        self._pending.append(line + b"\n")
        if len(self._pending) >= 1024:
            self._wake.set()

    def _drop(self, count: int) -> None:
        self.dropped += count
        if self._on_drop is not None:
            self._on_drop(count)

    # --- the writer thread ----------------------------------------------------------------------------------------

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wake the writer and wait (up to ``timeout_s``) until what was pending has been written or dropped."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()
        while self._pending and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.005)
        # The writer may still hold the last batch it took; wait for it too.
        with self._write_lock:
            pass

    def close(self) -> None:
        """Write what is pending and stop the writer; safe to call twice."""
        if self._stop:
            return
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            stopping = self._stop
            self._write_pending()
            if stopping:
                return

    def _write_pending(self) -> None:
        with self._write_lock:
            batch: list[bytes] = []
            while self._pending:
                batch.append(self._pending.popleft())
            if not batch:
                return
            try:
                self._append(batch)
            except STORAGE_ERRORS as exc:
                self._drop(len(batch))
                self._current = None  # reopen (and re-measure) on the next batch
                if self._faults is not None:
                    self._faults.record(COMPONENT, exc, action="decision records dropped", path=self.directory)
                else:  # a bare log (a script): the writer must live on, so say it here
                    log.warning("decision log: %d records dropped: %s", len(batch), exc)
                return
            self.written += len(batch)
            if self._faults is not None:
                self._faults.recovered(COMPONENT)

    def _append(self, lines: list[bytes]) -> None:
        """Append ``lines`` to the current file, rotating before a line would take it past ``file_bytes``."""
        if self._current is None:
            self._open_current()
        assert self._current is not None
        chunk: list[bytes] = []
        size = self._current_size
        for line in lines:
            if len(line) > self.file_bytes:
                self._drop(1)  # a record larger than a whole file (a huge prompt kept in clear) is not kept
                continue
            if size + len(line) > self.file_bytes and size > 0:
                self._write(chunk)
                chunk = []
                self._rotate()
                size = 0
            chunk.append(line)
            size += len(line)
        self._write(chunk)

    def _write(self, chunk: list[bytes]) -> None:
        if not chunk:
            return
        assert self._current is not None
        data = b"".join(chunk)
        with self._current.open("ab") as file:
            file.write(data)
        self._current_size += len(data)

    def _open_current(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = log_files(self.directory)
        # A smaller budget than the last run's: the oldest files go until the rest fit.
        while existing and (len(existing) > self.files
                            or sum(p.stat().st_size for p in existing) > self.max_bytes):
            existing.pop(0).unlink(missing_ok=True)
        if existing:
            self._current = existing[-1]
            self._current_size = self._current.stat().st_size
        else:
            self._current = self.directory / "decisions-00000001.jsonl"
            self._current_size = 0

    def _rotate(self) -> None:
        assert self._current is not None
        number = int(FILE_PATTERN.match(self._current.name).group(1))  # type: ignore[union-attr]
        self._current = self.directory / f"decisions-{number + 1:08d}.jsonl"
        self._current_size = 0
        # The new file is one of the ``files``: keep the newest files - 1 of the others.
        for old in log_files(self.directory)[:-(self.files - 1) or None]:
            old.unlink(missing_ok=True)

    def _load_query_key(self) -> bytes:
        """The secret that keys query hashes, made on first use and kept beside the log (owner-readable only)."""
        path = self.directory / KEY_FILE
        try:
            key = path.read_bytes()
            if len(key) == 32:
                return key
        except OSError:
            pass
        key = secrets.token_bytes(32)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(key)
        except STORAGE_ERRORS as exc:  # hashes still work for this run; they will not match the next run's
            if self._faults is not None:
                self._faults.record(COMPONENT, exc, action="query-hash key not saved", path=path)
        return key
