"""The operator's ledger: what the cache saved and what the engine spent, per tenant and scenario, in engine-seconds,
tokens and (with a box price) money, and why each miss missed.

Every request of the API lands here once (:meth:`Ledger.request`), with what served it:

- an **exact**, **shared** or **semantic** hit saved the whole request: its prompt and completion tokens, and the
  engine-seconds they would have cost;
- a **miss** is counted under exactly one reason (:data:`MISS_REASONS`, plus ``semantic:<refusal>`` for a semantic
  candidate refused, spelled as :mod:`edgecache.semantic.refusals` spells it);
- the engine's own prefix cache (**kv_prefix**) saved the prefill of the cached tokens of every engine call; those
  tokens are also counted by the tier they came from (``ram``, ``disk``, or what the engine calls its tier; ``engine``
  where it does not say), and an engine call that could have found more of its prompt cached is counted under why it
  did not (``kv_tiers.KV_MISS_REASONS``: never seen, evicted from RAM, evicted from disk).

Engine time is measured, not assumed. :class:`EngineMeter` watches every engine call (misses, explorations, the
judge, warmup) and splits the engine's **busy time** (the wall time during which at least one
call is running) between the calls that share it: while ``k`` calls run, each is charged ``1/k`` of every second,
to its prefill phase until its first output and to its decode phase after. The charges add up to the busy time
exactly, however many calls a batching engine (SGLang, vLLM, several llama.cpp slots) runs at once, so the cost of a
token is the box's cost (busy time over the tokens computed in it), not one request's latency. An engine that runs
one call at a time (``parallel_calls = 1``: llama.cpp) charges only the call it is running; the others wait.

:class:`CostFit` turns those charges into what a call costs whatever its prompt, what one more prompt token costs
and what one more completion token costs (least squares over recent calls, so that it follows the engine when it gets
slower). Until it rests on ``fit_min_calls`` calls it prices nothing: the tokens saved meanwhile are kept, unpriced,
and priced once the fit has a basis.

So the engine-seconds spent (by purpose) are measured, and the engine-seconds saved are the fit applied to the
tokens not computed: ``saved + spent`` is what the box would have computed with no cache at all, ``saved / (saved +
spent)`` the share of that work the cache did, and ``(saved + spent) / spent`` the effective capacity.

The ledger keeps the rows as they stood at the start of each minute of the last :data:`FINE_MINUTES`, and of one
minute in every :data:`COARSE_MINUTES` before that, back a day (:data:`HISTORY_MINUTES`): the last hour's figures
are now's less an hour ago's, and :meth:`Ledger.timeline` gives what each minute saved and spent. Each kept minute
holds only the rows changed since the one before, so its memory grows with the rows that change, not with the rows
there are.

The ledger survives a restart (``<data dir>/ledger/ledger.json``, written by the runtime's housekeeping and at
shutdown). Nothing on the hit path waits for it: a request adds three numbers, booked at the next read.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("edgecache")

#: What saved a request, or part of one. ``kv_prefix``: the engine's own prefix cache, on a call it computed.
LAYERS = ("exact", "shared", "semantic", "kv_prefix")
#: Why the engine was asked: a client's miss, a learner's exploration (a miss the learner chose, to label a
#: candidate), the served model judging a label, a warmup line (or its system prompt's prefill).
PURPOSES = ("miss", "explore", "judge", "warmup")

# Why a miss missed: one of these, or SEMANTIC_PREFIX + the semantic layer's refusal reason.
FIRST_SEEN = "first_seen"        # no answer was ever stored under its key that this node knows of
EXPIRED = "expired"              # its answer was stored and outlived its TTL
EVICTED = "evicted"              # its answer was stored, is not expired, and is gone: the quota's LRU dropped it
FLUSHED = "flushed"              # its answer was flushed (`edgecache flush`, here or on another node)
NOT_CACHEABLE = "not_cacheable"  # sampling without a seed: no layer may keep or share it
POLICY = "policy"                # the caller's policy read no cache (bypass, no-cache), or its max-age refused one
ENGINE_ERROR = "engine_error"    # the engine was asked and failed
BUCKET_FILLING = "bucket_filling"  # sampling without a seed, its bucket holds fewer answers than its size
MISS_REASONS = (FIRST_SEEN, EXPIRED, EVICTED, FLUSHED, NOT_CACHEABLE, POLICY, ENGINE_ERROR, BUCKET_FILLING)
SEMANTIC_PREFIX = "semantic:"

#: How far back the kept minutes reach: a day, so that the hour a hit rate fell can be found the next morning.
HISTORY_MINUTES = 24 * 60
#: The most recent minutes are kept one by one; before them, one minute in every COARSE_MINUTES (the first kept of
#: each such block; the others are folded into the next), so a day costs 306 snapshots, not 1,440.
FINE_MINUTES = 180
COARSE_MINUTES = 10
#: The fields :meth:`Ledger.timeline` gives per minute (what was saved and spent, what served, why misses missed).
HISTORY_FIELDS = ("requests", "misses", "saved_prompt_tokens", "saved_completion_tokens", "saved_engine_s",
                  "spent_engine_s", "spent_prompt_tokens", "spent_completion_tokens", "kv_prefix_tokens")


_HIT_LAYERS = frozenset({"exact", "shared", "semantic"})


def semantic_reason(refusal: str) -> str:
    """The miss reason of a semantic candidate refused for ``refusal`` (``below_cut``, ``learner:unsure``, ...)."""
    return SEMANTIC_PREFIX + refusal


class CostFit:
    """What an engine call costs on this box, fitted on the busy time charged to engine calls.

    A call's prefill charge (until its first output) is fitted as ``a + p * n`` by weighted least squares over the
    calls, ``n`` being the prompt tokens it computed (its prefix cache's excluded): ``a`` is what a call costs
    whatever its prompt (setting up, and sampling its first token), ``p`` the cost of one more prompt token. Its
    decode charge is ``q`` per completion token after the first. A least-squares fit with its own ``a`` leaves no
    residual on the whole: the fitted costs of the calls add up to their charges. Without ``a``, a call's fixed cost
    would be spread over its prompt tokens, and a token the prefix cache held would be valued at the cost of a
    short prompt's token (measured: 2x too dear on the CPU profile).

    Every sum is weighted by ``0.5 ** (age / half_life_calls)`` (age in calls), so a slower engine moves the fit
    within a few hundred calls. ``rates()`` is None until ``min_calls`` calls with completion tokens were seen: the
    ledger then says so instead of printing a figure with no basis.
    """

    def __init__(self, *, min_calls: int, half_life_calls: float) -> None:
        self.min_calls = min_calls
        self.half_life_calls = half_life_calls
        self._decay = 0.5 ** (1.0 / half_life_calls)
        self.calls = 0  # calls observed (unweighted)
        # Weighted sums: calls, prompt tokens n, prefill seconds y, n*n, n*y; decode seconds and tokens.
        self._w = self._n = self._y = self._nn = self._ny = self._decode_s = self._decode_tokens = 0.0
        self._rates: tuple[float, float, float] | None = None

    def observe(self, prefill_s: float, prefill_tokens: int, decode_s: float, completion_tokens: int) -> None:
        d = self._decay
        n = float(prefill_tokens)
        self._w = self._w * d + 1.0
        self._n = self._n * d + n
        self._y = self._y * d + prefill_s
        self._nn = self._nn * d + n * n
        self._ny = self._ny * d + n * prefill_s
        self._decode_s = self._decode_s * d + decode_s
        self._decode_tokens = self._decode_tokens * d + max(0, completion_tokens - 1)
        self.calls += 1
        self._rates = self._fit()

    def _fit(self) -> tuple[float, float, float] | None:
        if self.calls < self.min_calls or self._decode_tokens <= 0:
            return None
        w, n, y = self._w, self._n, self._y
        spread = w * self._nn - n * n
        if spread > 1e-9 * w * self._nn:
            p = (w * self._ny - n * y) / spread
            a = (y - p * n) / w
        else:  # every call computed as many prompt tokens: no way to tell a call's cost from its tokens'
            p, a = (y / n, 0.0) if n > 0 else (0.0, y / w)
        if p < 0:
            p, a = 0.0, y / w
        elif a < 0:
            p, a = (y / n if n > 0 else 0.0), 0.0
        return a, p, self._decode_s / self._decode_tokens

    def rates(self) -> tuple[float, float, float] | None:
        """(seconds per call, per prompt token computed, per completion token after the first), or None while the
        fit rests on too few calls."""
        return self._rates

    def cost(self, calls: int, prompt_tokens: int, completion_tokens: int) -> float | None:
        """What ``calls`` calls with these token totals would have cost (None: no fit yet). A token the prefix
        cache held is priced with ``calls = 0``: one prompt token more, no call."""
        rates = self._rates
        if rates is None:
            return None
        return rates[0] * calls + rates[1] * prompt_tokens + rates[2] * max(0, completion_tokens - calls)

    def state(self) -> dict[str, float]:
        return {"calls": self.calls, "w": self._w, "n": self._n, "y": self._y, "nn": self._nn, "ny": self._ny,
                "decode_s": self._decode_s, "decode_tokens": self._decode_tokens}

    def restore(self, state: dict[str, float]) -> None:
        self.calls = int(state.get("calls", 0))
        self._w, self._n, self._y = (float(state.get(k, 0.0)) for k in ("w", "n", "y"))
        self._nn, self._ny = float(state.get("nn", 0.0)), float(state.get("ny", 0.0))
        self._decode_s = float(state.get("decode_s", 0.0))
        self._decode_tokens = float(state.get("decode_tokens", 0.0))
        self._rates = self._fit()


class MeteredCall:
    """One engine call as the meter charges it (see :class:`EngineMeter`). ``kv_tier`` and ``kv_miss``: what its
    last chunk said of the engine's prefix cache (the tier its cached tokens came from, why more was not cached)."""

    __slots__ = ("decode_s", "decoding", "ended", "kv_miss", "kv_tier", "prefill_s", "purpose", "scenario", "tenant")

    def __init__(self, tenant: str, scenario: str, purpose: str) -> None:
        self.tenant, self.scenario, self.purpose = tenant, scenario, purpose
        self.prefill_s = self.decode_s = 0.0
        self.decoding = False  # its first output is out: its charges go to decode
        self.ended = False
        self.kv_tier = self.kv_miss = ""


class EngineMeter:
    """The engine's busy time, shared out between the calls running in it (the module says how).

    Every method runs on the event loop (the engine's streams are consumed there), so no lock is needed. ``parallel``:
    how many calls the engine runs at once (None: as many as it is given); calls past that many, in the order they
    started, wait and are charged nothing.
    """

    def __init__(self, on_end: Callable[[MeteredCall, tuple[int, int, int] | None], None], *,
                 parallel: int | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self._on_end = on_end
        self._parallel = parallel
        self._clock = clock
        self._running: list[MeteredCall] = []
        self._last = clock()
        self.busy_s = 0.0

    def _advance(self) -> None:
        now = self._clock()
        dt, self._last = now - self._last, now
        if not self._running or dt <= 0:
            return
        self.busy_s += dt
        charged = self._running if self._parallel is None else self._running[:self._parallel]
        share = dt / len(charged)
        for call in charged:
            if call.decoding:
                call.decode_s += share
            else:
                call.prefill_s += share

    def start(self, tenant: str, scenario: str, purpose: str) -> MeteredCall:
        self._advance()
        call = MeteredCall(tenant, scenario, purpose)
        self._running.append(call)
        return call

    def first_output(self, call: MeteredCall) -> None:
        if not call.decoding:
            self._advance()
            call.decoding = True

    def end(self, call: MeteredCall, tokens: tuple[int, int, int] | None = None) -> None:
        """The call is over: ``tokens`` (prompt, cached, completion) when it finished, None when it failed or was
        abandoned (its time is still spent). Safe to call twice: the second is ignored."""
        if call.ended:
            return
        self._advance()
        call.ended = True
        self._running.remove(call)
        self._on_end(call, tokens)

    @property
    def running(self) -> int:
        return len(self._running)


class Row(msgspec.Struct, kw_only=True):
    """One tenant and scenario's figures since the ledger began. Token counts are ints; seconds are floats."""

    requests: dict[str, int] = {}
    misses: dict[str, int] = {}
    saved_prompt_tokens: dict[str, int] = {}
    saved_completion_tokens: dict[str, int] = {}
    saved_engine_s: dict[str, float] = {}
    # Tokens saved while the cost fit had no basis yet; priced (moved into saved_engine_s) once it has one.
    unpriced_prompt_tokens: dict[str, int] = {}
    unpriced_completion_tokens: dict[str, int] = {}
    unpriced_calls: dict[str, int] = {}  # whole requests among them (each saved a call's own cost too)
    spent_engine_s: dict[str, float] = {}
    spent_prompt_tokens: dict[str, int] = {}
    spent_completion_tokens: dict[str, int] = {}
    spent_calls: dict[str, int] = {}
    # The kv_prefix layer's saved prompt tokens by the tier they came from; engine calls by why more was not cached.
    kv_prefix_tokens: dict[str, int] = {}
    kv_misses: dict[str, int] = {}


#: A request key's first 16 hex characters (64 bits) name it in the history: the file stays small, and a collision
#: among 50,000 keys is a one-in-ten-billion chance of a miss counted under another reason.
_KEY_CHARS = 16


class KeyHistory:
    """Why a key this node stored an answer under has none now: expired, evicted or flushed (None: never stored
    here, so the miss is a first sighting). Bounded: past ``max_keys`` the oldest key of the tenant that holds the
    most is forgotten (its miss then reads as first seen), so a tenant within its share never loses its history to
    another tenant's traffic. Kept with the ledger across restarts.

    A key's entry says when its answer was stored and when it expires; a flush of its tenant (or scenario, or all)
    after it was stored makes it flushed; a removal (a caller marked it wrong) is recorded as such. Neither: the
    quota's LRU (or the store's own LRU) evicted it.
    """

    def __init__(self, max_keys: int = 50_000) -> None:
        self.max_keys = max_keys
        # key -> (tenant, scenario, stored_at, expires_at, removed reason or "")
        self._keys: dict[str, tuple[str, str, float, float, str]] = {}
        self._order_of: dict[str, dict[str, None]] = {}  # tenant -> its keys here, oldest first
        self._flushes: dict[tuple[str, str], float] = {}  # ("" = any tenant / scenario) -> last flush time

    def stored(self, tenant: str, scenario: str, key: str, expires_at: float, now: float | None = None) -> None:
        key = key[:_KEY_CHARS]
        old = self._keys.pop(key, None)  # re-inserted: the newest are kept longest
        if old is not None:
            self._order_of[old[0]].pop(key, None)
        self._keys[key] = (tenant, scenario, time.time() if now is None else now, expires_at, "")
        self._order_of.setdefault(tenant, {})[key] = None
        if len(self._keys) > self.max_keys:
            largest = max(self._order_of.values(), key=len)
            del self._keys[next(iter(largest))]
            del largest[next(iter(largest))]

    def held(self, tenant: str) -> int:
        """Keys of ``tenant`` remembered here (its ``/stats``)."""
        return len(self._order_of.get(tenant, ()))

    def removed(self, key: str, reason: str) -> None:
        key = key[:_KEY_CHARS]
        entry = self._keys.get(key)
        if entry is not None:
            self._keys[key] = (*entry[:4], reason)

    def flushed(self, tenant: str | None, scenario: str | None, now: float | None = None) -> None:
        self._flushes[(tenant or "", scenario or "")] = time.time() if now is None else now

    def why_gone(self, key: str, now: float | None = None) -> str | None:
        """expired, evicted, flushed, a removal's reason, or None (never stored here)."""
        entry = self._keys.get(key[:_KEY_CHARS])
        if entry is None:
            return None
        tenant, scenario, stored_at, expires_at, removed = entry
        flushed_at = min((at for (t, s), at in self._flushes.items()
                          if t in ("", tenant) and s in ("", scenario) and at >= stored_at), default=None)
        now = time.time() if now is None else now
        if flushed_at is not None and flushed_at < min(expires_at, now):
            return FLUSHED
        if expires_at <= now:
            return EXPIRED
        return removed or EVICTED

    def state(self) -> dict[str, Any]:
        return {"keys": self._keys, "flushes": [[t, s, at] for (t, s), at in self._flushes.items()]}

    def restore(self, state: dict[str, Any]) -> None:
        """Read back :meth:`state`; raises ValueError or TypeError, changing nothing, on anything else."""
        keys = state.get("keys", {})
        if not isinstance(keys, dict):
            raise TypeError("the key history is not an object")
        restored: dict[str, tuple[str, str, float, float, str]] = {}
        for key, entry in keys.items():
            if not isinstance(entry, (list, tuple)) or len(entry) != 5:
                raise ValueError(f"the key history's entry {key!r} is not [tenant, scenario, stored, expires, why]")
            tenant, scenario, stored_at, expires_at, removed = entry
            restored[str(key)] = (str(tenant), str(scenario), float(stored_at), float(expires_at), str(removed))
        flushes: dict[tuple[str, str], float] = {}
        for flush in state.get("flushes", []):
            if not isinstance(flush, (list, tuple)) or len(flush) != 3:
                raise ValueError(f"a flush in the key history is not [tenant, scenario, at]: {flush!r}")
            flushes[(str(flush[0]), str(flush[1]))] = float(flush[2])
        self._keys, self._flushes = restored, flushes
        self._order_of = {}
        for key, (tenant, *_) in restored.items():
            self._order_of.setdefault(tenant, {})[key] = None


class _Saved(msgspec.Struct):
    version: int
    started_at: float
    fit: dict[str, float]
    rows: dict[str, Row]
    minutes: list[tuple[int, dict[str, Row]]] = []  # (minute, rows then): the last hour's starting points
    history: dict[str, Any] = {}
    busy_s: float = 0.0


_FORMAT_VERSION = 1


def _row_key(tenant: str, scenario: str) -> str:
    return f"{tenant}/{scenario}"


class Ledger:
    """Per tenant and scenario: requests, misses by reason, tokens and engine-seconds saved by layer and spent by
    purpose. ``price_per_hour`` (with ``currency``): the box's price, for money figures (None: none are given)."""

    def __init__(self, *, path: Path | None = None, price_per_hour: float | None = None, currency: str = "USD",
                 fit_min_calls: int = 10, fit_half_life_calls: float = 500.0, parallel_calls: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.price_per_hour = price_per_hour
        self.currency = currency
        self._clock = clock
        self.fit = CostFit(min_calls=fit_min_calls, half_life_calls=fit_half_life_calls)
        self.meter = EngineMeter(self._engine_call_ended, parallel=parallel_calls)
        self.history = KeyHistory()
        self.started_at = clock()
        self._rows: dict[tuple[str, str], Row] = {}
        self._scenarios_of: dict[str, set[str]] = {}  # tenant -> its rows' scenarios (a tenant's view reads these)
        self._touched: set[tuple[str, str]] = set()  # rows changed since the last minute's snapshot
        # Requests not yet booked: (tenant, scenario, outcome) -> [requests, prompt tokens, completion tokens].
        self._counts: dict[tuple[str, str, str], list[int]] = {}
        self._unpriced = False
        self._minutes: list[tuple[int, dict[str, Row]]] = []
        # Each kept minute's rows as last encoded, by the rows' identity (a kept minute is never changed in place;
        # folding one makes a new one): a save encodes only the minutes kept since the last.
        self._encoded_minutes: dict[int, tuple[dict[str, Row], msgspec.Raw]] = {}
        # The timeline's points up to the last kept minute, by (tenant, minutes, step), until the next kept minute.
        self._timelines: dict[tuple[str | None, int, int], tuple[tuple[int, ...], dict[int, dict[str, Any]],
                                                                  dict[str, Row]]] = {}
        self._busy_before = 0.0  # busy seconds of earlier runs (the meter counts this run's)
        self._dirty = False
        if path is not None:
            self._load(path)

    # ---- recording ----

    def _row(self, tenant: str, scenario: str) -> Row:
        """A row about to change (the one road to a row for a write: it is marked for the next minute's snapshot)."""
        self._touched.add((tenant, scenario))
        row = self._rows.get((tenant, scenario))
        if row is None:
            self._scenarios_of.setdefault(tenant, set()).add(scenario)
            row = self._rows[(tenant, scenario)] = Row(requests={}, misses={}, saved_prompt_tokens={},
                                                       saved_completion_tokens={}, saved_engine_s={},
                                                       unpriced_prompt_tokens={}, unpriced_completion_tokens={},
                                                       unpriced_calls={},
                                                       spent_engine_s={}, spent_prompt_tokens={},
                                                       spent_completion_tokens={}, spent_calls={},
                                                       kv_prefix_tokens={}, kv_misses={})
        return row

    def request(self, tenant: str, scenario: str, outcome: str, *, miss_reason: str | None = None,
                prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """One request of the API, once, with its outcome (exact, semantic, shared, miss, error, rejected). A hit
        saved ``prompt_tokens`` and ``completion_tokens``; a miss (or an error the engine raised on a miss:
        ``miss_reason`` ENGINE_ERROR) is counted under ``miss_reason``."""
        # The hit path: one look-up and three additions. Requests, tokens and seconds are booked into the rows when
        # the ledger is next read (or at the housekeeping tick, every few seconds), at the fit's rates then.
        counts = self._counts.get((tenant, scenario, outcome))
        if counts is None:
            counts = self._counts[(tenant, scenario, outcome)] = [0, 0, 0]
        counts[0] += 1
        counts[1] += prompt_tokens
        counts[2] += completion_tokens
        if miss_reason is not None:
            row = self._row(tenant, scenario)
            row.misses[miss_reason] = row.misses.get(miss_reason, 0) + 1
            self._dirty = True

    def _settle(self) -> None:
        """Book the requests counted since the last read into their rows (a hit's tokens as saved)."""
        if not self._counts:
            return
        counts, self._counts = self._counts, {}
        self._dirty = True
        for (tenant, scenario, outcome), (n, prompt, completion) in counts.items():
            row = self._row(tenant, scenario)
            row.requests[outcome] = row.requests.get(outcome, 0) + n
            if outcome in _HIT_LAYERS:
                self._save(row, outcome, n, prompt, completion)

    def _save(self, row: Row, layer: str, calls: int, prompt_tokens: int, completion_tokens: int) -> None:
        """``calls`` whole requests (0: prompt tokens the prefix cache held) with these tokens were not computed."""
        row.saved_prompt_tokens[layer] = row.saved_prompt_tokens.get(layer, 0) + prompt_tokens
        row.saved_completion_tokens[layer] = row.saved_completion_tokens.get(layer, 0) + completion_tokens
        seconds = self.fit.cost(calls, prompt_tokens, completion_tokens)
        if seconds is None:
            row.unpriced_prompt_tokens[layer] = row.unpriced_prompt_tokens.get(layer, 0) + prompt_tokens
            row.unpriced_completion_tokens[layer] = row.unpriced_completion_tokens.get(layer, 0) + completion_tokens
            row.unpriced_calls[layer] = row.unpriced_calls.get(layer, 0) + calls
            self._unpriced = True
            return
        if self._unpriced:
            self._price_pending()
        row.saved_engine_s[layer] = row.saved_engine_s.get(layer, 0.0) + seconds

    def _price_pending(self) -> None:
        """The fit has a basis now: what was saved before it is priced at its rates."""
        self._unpriced = False
        for name, row in self._rows.items():
            if row.unpriced_prompt_tokens or row.unpriced_completion_tokens or row.unpriced_calls:
                self._touched.add(name)
            for layer in set(row.unpriced_prompt_tokens) | set(row.unpriced_completion_tokens):
                seconds = self.fit.cost(row.unpriced_calls.get(layer, 0), row.unpriced_prompt_tokens.get(layer, 0),
                                        row.unpriced_completion_tokens.get(layer, 0)) or 0.0
                row.saved_engine_s[layer] = row.saved_engine_s.get(layer, 0.0) + seconds
            row.unpriced_prompt_tokens.clear()
            row.unpriced_completion_tokens.clear()
            row.unpriced_calls.clear()

    def _engine_call_ended(self, call: MeteredCall, tokens: tuple[int, int, int] | None) -> None:
        row = self._row(call.tenant, call.scenario)
        purpose = call.purpose
        spent = call.prefill_s + call.decode_s
        row.spent_engine_s[purpose] = row.spent_engine_s.get(purpose, 0.0) + spent
        row.spent_calls[purpose] = row.spent_calls.get(purpose, 0) + 1
        self._dirty = True
        if tokens is None:
            return
        prompt, cached, completion = tokens
        computed = max(0, prompt - cached)
        row.spent_prompt_tokens[purpose] = row.spent_prompt_tokens.get(purpose, 0) + computed
        row.spent_completion_tokens[purpose] = row.spent_completion_tokens.get(purpose, 0) + completion
        if call.decoding:
            self.fit.observe(call.prefill_s, computed, call.decode_s, completion)
        # A whole answer at once (tool calls, logprobs, a warmup's one-token prefill) has no first output to split
        # its phases at: it teaches the fit nothing, and is still spent.
        if cached > 0:
            self._save(row, "kv_prefix", 0, cached, 0)
            tier = call.kv_tier or "engine"
            row.kv_prefix_tokens[tier] = row.kv_prefix_tokens.get(tier, 0) + cached
        if call.kv_miss:
            row.kv_misses[call.kv_miss] = row.kv_misses.get(call.kv_miss, 0) + 1

    # ---- reading ----

    def rows(self, tenant: str | None = None) -> dict[str, Row]:
        self._settle()
        if tenant is not None:  # only this tenant's rows are read
            return {_row_key(tenant, s): self._rows[(tenant, s)] for s in sorted(self._scenarios_of.get(tenant, ()))}
        return {_row_key(t, s): row for (t, s), row in sorted(self._rows.items())}

    @property
    def busy_s(self) -> float:
        """Engine busy seconds since the ledger began (earlier runs included)."""
        return self._busy_before + self.meter.busy_s

    def fit_report(self) -> dict[str, Any]:
        rates = self.fit.rates()
        report: dict[str, Any] = {"calls": self.fit.calls, "min_calls": self.fit.min_calls, "ready": rates is not None,
                                  "call_s": rates[0] if rates else None,
                                  "prefill_s_per_token": rates[1] if rates else None,
                                  "decode_s_per_token": rates[2] if rates else None}
        if rates is None:
            report["why"] = (f"the engine's cost per token rests on {self.fit.calls} engine calls (it needs "
                             f"{self.fit.min_calls} with prompt and completion tokens): engine-seconds saved are "
                             "not given until then; the tokens saved meanwhile are priced once it has")
        return report

    def report(self, tenant: str | None = None) -> dict[str, Any]:
        """The ledger as /stats shows it: per ``tenant/scenario``, per tenant and in total (only ``tenant``'s rows
        when named), since the ledger began, and over the last hour."""
        rows = self.rows(tenant)
        hour_ago = self._baseline(int(self._clock() // 60) - 60)
        fit = self.fit_report()
        if tenant is not None:  # the fit rests on every tenant's calls: its basis is the admin's to see
            fit = {"ready": fit["ready"]}
        body: dict[str, Any] = {
            "since": self.started_at,
            "fit": fit,
            "price": ({"per_hour": self.price_per_hour, "currency": self.currency}
                      if self.price_per_hour is not None else None),
            **self._report_of(rows),
        }
        body["last_hour"] = {"since": hour_ago[0] * 60 if hour_ago is not None else self.started_at,
                             **self._report_of(_less(rows, hour_ago))}
        if tenant is None:
            body["engine_busy_s"] = self.busy_s
        return body

    def _report_of(self, rows: dict[str, Row]) -> dict[str, Any]:
        by_tenant: dict[str, list[Row]] = {}
        for name, row in rows.items():
            by_tenant.setdefault(name.split("/", 1)[0], []).append(row)
        return {"total": self._figures(list(rows.values())),
                "by_tenant": {tenant: self._figures(of) for tenant, of in by_tenant.items()},
                "by_tenant_scenario": {name: self._figures([row]) for name, row in rows.items()}}

    def timeline(self, tenant: str | None = None, *, minutes: int = FINE_MINUTES, step: int = 1) -> dict[str, Any]:
        """What each minute of the last ``minutes`` saved and spent (only ``tenant``'s rows when named), from the
        kept minutes, summed into points of ``step`` minutes: per point its start (``at``, unix seconds), the minutes
        it covers (fewer where the server was down, a coarse kept minute's ten, a fraction for the minute under
        way), and per field of :data:`HISTORY_FIELDS` what changed in it. ``window``: the ledger's figures over the
        whole span (now's less the rows as they stood at its start: :meth:`_baseline`); the points add up to it."""
        rows = self.rows(tenant)
        now = self._clock()
        start = int(now // 60) - minutes
        points: dict[int, dict[str, Any]] = {}

        def add(since: float, until: float, changed: dict[str, Row], before: dict[str, Row]) -> None:
            bucket = int(since // 60) // step * step
            point = points.get(bucket)
            if point is None:
                point = points[bucket] = {"at": bucket * 60, "minutes": 0.0, **{f: {} for f in HISTORY_FIELDS}}
            point["minutes"] += max(0.0, until - since) / 60
            for name, row in changed.items():
                then = before.get(name)
                for field in HISTORY_FIELDS:
                    sums, old = point[field], getattr(then, field) if then is not None else {}
                    for k, v in getattr(row, field).items():
                        if d := v - old.get(k, 0):
                            sums[k] = sums.get(k, 0) + d

        began_within = self.started_at >= start * 60
        # The points up to the last kept minute change only when a minute is kept: walked once per kept minute.
        stamp = (start, len(self._minutes), self._minutes[0][0] if self._minutes else -1,
                 self._minutes[-1][0] if self._minutes else -1)
        known = self._timelines.get((tenant, minutes, step))
        if known is not None and known[0] == stamp:
            points = {k: {**p, **{f: dict(p[f]) for f in HISTORY_FIELDS}} for k, p in known[1].items()}
            state = known[2]
        else:
            state = {}  # ``rows`` as they stood at the kept minute the walk is at
            for i, (minute, changed) in enumerate(self._minutes):
                mine = {name: row for name, row in changed.items() if name in rows}
                if i and self._minutes[i - 1][0] >= start:
                    add(self._minutes[i - 1][0] * 60, minute * 60, mine, state)
                elif not i and began_within:  # from the ledger's start to its first kept minute
                    add(self.started_at, minute * 60, mine, {})
                state.update(mine)
            if len(self._timelines) >= 32:  # a few views are asked for; a key holder asking for many finds none
                self._timelines.clear()
            self._timelines[(tenant, minutes, step)] = (
                stamp, {k: {**p, **{f: dict(p[f]) for f in HISTORY_FIELDS}} for k, p in points.items()}, state)
        if self._minutes and self._minutes[-1][0] >= start:
            add(self._minutes[-1][0] * 60, now, rows, state)  # the minute under way, until now
        elif not self._minutes and began_within:
            add(self.started_at, now, rows, {})
        first = self._baseline(start)
        return {"since": first[0] * 60 if first is not None else self.started_at, "now": now, "step_minutes": step,
                "points": [points[k] for k in sorted(points)],
                "window": self._figures(list(_less(rows, first).values()))}

    def _baseline(self, minute: int) -> tuple[int, dict[str, Row]] | None:
        """The rows as they stood at ``minute``: the first kept minute since, with every row then (None: the ledger
        began since, so every row counts whole; or no minute was kept since, and the same holds)."""
        if self.started_at >= minute * 60:
            return None
        return self._as_of(minute)

    def _figures(self, rows: list[Row]) -> dict[str, Any]:
        def total(field: str) -> dict[str, float]:
            out: dict[str, float] = {}
            for row in rows:
                for k, v in getattr(row, field).items():
                    out[k] = out.get(k, 0) + v
            return out

        saved_s, spent_s = total("saved_engine_s"), total("spent_engine_s")
        unpriced = {k: v for k, v in total("unpriced_prompt_tokens").items() if v}
        unpriced_c = {k: v for k, v in total("unpriced_completion_tokens").items() if v}
        saved, spent = sum(saved_s.values()), sum(spent_s.values())
        misses = total("misses")
        figures: dict[str, Any] = {
            "requests": total("requests"),
            "misses": int(sum(misses.values())),
            "miss_reasons": misses,
            "saved": {layer: {"prompt_tokens": int(total("saved_prompt_tokens").get(layer, 0)),
                              "completion_tokens": int(total("saved_completion_tokens").get(layer, 0)),
                              "engine_s": saved_s.get(layer, 0.0)}
                      for layer in LAYERS},
            "spent": {purpose: {"engine_s": spent_s.get(purpose, 0.0), "calls": int(total("spent_calls").get(purpose, 0)),
                                "prompt_tokens": int(total("spent_prompt_tokens").get(purpose, 0)),
                                "completion_tokens": int(total("spent_completion_tokens").get(purpose, 0))}
                      for purpose in PURPOSES},
            "saved_engine_s": saved,
            "spent_engine_s": spent,
            # Of the work the box would have done with no cache, the share the cache did; and how many boxes'
            # worth of work this one did (None while nothing was spent).
            "cache_share": saved / (saved + spent) if saved + spent > 0 else None,
            "effective_capacity": (saved + spent) / spent if spent > 0 else None,
        }
        # The kv_prefix layer by tier: its tokens, and its engine-seconds shared out by tokens (a cached token is
        # priced the same whichever tier held it: the prefill it spared).
        tiers = total("kv_prefix_tokens")
        kv_tokens, kv_s = sum(tiers.values()), saved_s.get("kv_prefix", 0.0)
        figures["kv_prefix"] = {
            "by_tier": {tier: {"prompt_tokens": int(n), "engine_s": kv_s * n / kv_tokens if kv_tokens else 0.0}
                        for tier, n in sorted(tiers.items())},
            "misses": {reason: int(n) for reason, n in sorted(total("kv_misses").items()) if n}}
        if unpriced or unpriced_c:
            figures["unpriced_tokens"] = {"prompt": unpriced, "completion": unpriced_c}
        if self.price_per_hour is not None:
            per_s = self.price_per_hour / 3600.0
            figures["cost_saved"] = {layer: saved_s.get(layer, 0.0) * per_s for layer in LAYERS}
            figures["cost_saved_total"] = saved * per_s
            figures["cost_spent"] = spent * per_s
            figures["currency"] = self.currency
        return figures

    # ---- the last hour ----

    def tick(self, now: float | None = None) -> None:
        """Called every few seconds (the runtime's housekeeping): keeps the rows as they stood at the start of each
        minute (see the module's docstring for which minutes are kept, and for how long)."""
        self._settle()
        minute = int((self._clock() if now is None else now) // 60)
        if self._minutes and self._minutes[-1][0] == minute:
            return
        # The first kept minute holds every row as it stood; each later one only the rows changed since the one
        # before (memory stays flat however many rows there are).
        changed = self._rows if not self._minutes else {n: self._rows[n] for n in self._touched if n in self._rows}
        self._touched = set()
        self._minutes.append((minute, {_row_key(*name): _copy(row) for name, row in changed.items()}))
        self._forget_before(minute - HISTORY_MINUTES)
        self._coarsen_before(minute - FINE_MINUTES)
        self._timelines.clear()

    def _forget_before(self, minute: int) -> None:
        """Drop the kept minutes older than ``minute``, folding each into the next so that the first kept one still
        holds every row as it stood then."""
        while len(self._minutes) > 1 and self._minutes[0][0] < minute:
            self._fold(0)
        if self._minutes and self._minutes[0][0] < minute:
            self._minutes.pop(0)

    def _coarsen_before(self, minute: int) -> None:
        """Before ``minute``, keep one minute in every COARSE_MINUTES: the first kept of each block."""
        i = 1
        while i < len(self._minutes) - 1 and self._minutes[i][0] < minute:
            if self._minutes[i][0] // COARSE_MINUTES == self._minutes[i - 1][0] // COARSE_MINUTES:
                self._fold(i)
            else:
                i += 1

    def _fold(self, i: int) -> None:
        """Drop kept minute ``i``: the next one takes the rows it held that did not change again (it then holds
        every row changed since the minute before ``i``)."""
        _, rows = self._minutes.pop(i)
        at, changed = self._minutes[i]
        self._minutes[i] = (at, {**rows, **changed})

    def _as_of(self, minute: int) -> tuple[int, dict[str, Row]] | None:
        """The first kept minute at or after ``minute``, with every row as it stood then (None: none kept since)."""
        state: dict[str, Row] = {}
        for at, changed in self._minutes:
            state.update(changed)
            if at >= minute:
                return at, state
        return None

    # ---- Prometheus ----

    def collector(self) -> Collector:
        return _LedgerCollector(self)

    # ---- persistence ----

    def _load(self, path: Path) -> None:
        """Read the ledger back. A file that does not decode to the ledger's shape, or is of another format
        version, is moved aside (kept for whoever wants to read it), logged, and the ledger starts again."""
        if not path.is_file():
            return
        try:
            saved = msgspec.json.decode(path.read_bytes(), type=_Saved)
            if saved.version != _FORMAT_VERSION:
                raise ValueError(f"it is of format version {saved.version}; this server writes {_FORMAT_VERSION}")
            rows: dict[tuple[str, str], Row] = {}
            names = list(saved.rows) + [name for _, rows_then in saved.minutes for name in rows_then]
            for name in names:
                if "/" not in name:
                    raise ValueError(f"a row {name!r} names no tenant/scenario")
            for name, row in saved.rows.items():
                tenant, scenario = name.split("/", 1)
                rows[(tenant, scenario)] = row
            history = KeyHistory(self.history.max_keys)
            history.restore(saved.history)
            fit = CostFit(min_calls=self.fit.min_calls, half_life_calls=self.fit.half_life_calls)
            fit.restore(saved.fit)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            # Kept for whoever wants to read it; the ledger starts again (the next write would overwrite it).
            aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
            try:
                os.replace(path, aside)
            except OSError:
                aside = path
            log.error("the ledger at %s could not be read (%s); kept as %s, the ledger starts again", path, exc,
                      aside)
            return
        self.started_at = saved.started_at
        self.fit = fit
        self._busy_before = saved.busy_s
        for row in rows.values():
            self._unpriced = self._unpriced or bool(row.unpriced_prompt_tokens or row.unpriced_completion_tokens
                                                    or row.unpriced_calls)
        self._rows = rows
        self._touched = set(rows)  # the next kept minute holds them as they were at shutdown
        for tenant, scenario in rows:
            self._scenarios_of.setdefault(tenant, set()).add(scenario)
        self._minutes = [(minute, rows_then) for minute, rows_then in saved.minutes]
        self.history = history

    def save(self) -> None:
        """Write the ledger (blocking: call it off the event loop, with no recording running meanwhile, or from a
        snapshot taken on the loop: :meth:`encoded`)."""
        if self.path is None:
            return
        self.write(self.encoded())

    def encoded(self) -> bytes:
        """The ledger as it stands, encoded (on the event loop: a consistent snapshot). A kept minute encoded for an
        earlier save is not encoded again (a day of them is most of the file)."""
        self._dirty = False
        before, self._encoded_minutes = self._encoded_minutes, {}
        minutes = []
        for minute, rows in self._minutes:
            known = before.get(id(rows))
            raw = known[1] if known is not None and known[0] is rows else msgspec.Raw(msgspec.json.encode(rows))
            self._encoded_minutes[id(rows)] = (rows, raw)
            minutes.append((minute, raw))
        return msgspec.json.encode(_Saved(version=_FORMAT_VERSION, started_at=self.started_at, fit=self.fit.state(),
                                          rows=self.rows(), minutes=minutes,  # type: ignore[arg-type]  # (encoded)
                                          history=self.history.state(), busy_s=self.busy_s))

    @property
    def dirty(self) -> bool:
        return self._dirty

    def write(self, data: bytes) -> None:
        """Write ``data`` (from :meth:`encoded`) to the ledger's file, atomically (blocking: a worker thread)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)


def _copy(row: Row) -> Row:
    return msgspec.structs.replace(row, **{f: dict(getattr(row, f)) for f in row.__struct_fields__})


def _less(rows: dict[str, Row], then: tuple[int, dict[str, Row]] | None) -> dict[str, Row]:
    """``rows`` less what each was at a kept minute (``then`` from :meth:`Ledger._as_of`; None: nothing to take)."""
    before = then[1] if then is not None else {}
    return {name: _minus(row, before.get(name)) for name, row in rows.items()}


def _minus(row: Row, before: Row | None) -> Row:
    if before is None:
        return row
    out = _copy(row)
    for field in row.__struct_fields__:
        now, then = getattr(out, field), getattr(before, field)
        for k in list(now):
            now[k] = now[k] - then.get(k, 0)
    return out


class _LedgerCollector(Collector):
    """The ledger's counters in Prometheus' conventions, read at scrape time (nothing is paid per request)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        ledger = self.ledger
        rows = ledger.rows()
        saved_s = CounterMetricFamily("edgecache_saved_engine_seconds", "Engine-seconds the cache saved, by tenant, "
                                      "scenario and layer (exact, shared, semantic: whole requests; kv_prefix: the "
                                      "prefill of tokens the engine's prefix cache held), at the engine's measured "
                                      "cost per token.", labels=["tenant", "scenario", "layer"])
        saved_p = CounterMetricFamily("edgecache_saved_prompt_tokens", "Prompt tokens not computed, by tenant, "
                                      "scenario and layer.", labels=["tenant", "scenario", "layer"])
        saved_c = CounterMetricFamily("edgecache_saved_completion_tokens", "Completion tokens not generated, by "
                                      "tenant, scenario and layer.", labels=["tenant", "scenario", "layer"])
        spent_s = CounterMetricFamily("edgecache_spent_engine_seconds", "Engine busy seconds, shared out between "
                                      "the calls running, by tenant, scenario and purpose (miss, explore, judge, "
                                      "warmup).", labels=["tenant", "scenario", "purpose"])
        spent_p = CounterMetricFamily("edgecache_spent_prompt_tokens", "Prompt tokens the engine computed (its "
                                      "prefix cache's excluded), by tenant, scenario and purpose.",
                                      labels=["tenant", "scenario", "purpose"])
        spent_c = CounterMetricFamily("edgecache_spent_completion_tokens", "Tokens the engine generated, by tenant, "
                                      "scenario and purpose.", labels=["tenant", "scenario", "purpose"])
        kv_tokens = CounterMetricFamily("edgecache_saved_kv_prefix_tokens", "Prompt tokens the engine's prefix cache "
                                        "held, by tenant, scenario and the tier they came from (ram, disk; engine: "
                                        "an engine that does not say).", labels=["tenant", "scenario", "tier"])
        kv_misses = CounterMetricFamily("edgecache_kv_prefix_misses", "Engine calls that could have found more of "
                                        "their prompt in the prefix cache, by tenant, scenario and why not "
                                        "(never_seen, evicted_ram, evicted_disk).",
                                        labels=["tenant", "scenario", "reason"])
        misses = CounterMetricFamily("edgecache_misses", "Misses by tenant, scenario and reason (first_seen, "
                                     "expired, evicted, flushed, not_cacheable, policy, engine_error, "
                                     "bucket_filling, semantic:<refusal>).", labels=["tenant", "scenario", "reason"])
        cost = (CounterMetricFamily("edgecache_saved_cost", "What the engine-seconds saved cost at the box's price "
                                    "(ledger.price_per_hour), by tenant, scenario and layer.",
                                    labels=["tenant", "scenario", "layer", "currency"])
                if ledger.price_per_hour is not None else None)
        per_s = (ledger.price_per_hour or 0.0) / 3600.0
        for name, row in rows.items():
            tenant, scenario = name.split("/", 1)
            for layer in LAYERS:
                if layer in row.saved_prompt_tokens or layer in row.saved_completion_tokens:
                    saved_p.add_metric([tenant, scenario, layer], row.saved_prompt_tokens.get(layer, 0))
                    saved_c.add_metric([tenant, scenario, layer], row.saved_completion_tokens.get(layer, 0))
                if layer in row.saved_engine_s:
                    saved_s.add_metric([tenant, scenario, layer], row.saved_engine_s[layer])
                    if cost is not None:
                        cost.add_metric([tenant, scenario, layer, ledger.currency], row.saved_engine_s[layer] * per_s)
            for purpose, seconds in row.spent_engine_s.items():
                spent_s.add_metric([tenant, scenario, purpose], seconds)
                spent_p.add_metric([tenant, scenario, purpose], row.spent_prompt_tokens.get(purpose, 0))
                spent_c.add_metric([tenant, scenario, purpose], row.spent_completion_tokens.get(purpose, 0))
            for reason, n in row.misses.items():
                misses.add_metric([tenant, scenario, reason], n)
            for tier, n in row.kv_prefix_tokens.items():
                kv_tokens.add_metric([tenant, scenario, tier], n)
            for reason, n in row.kv_misses.items():
                kv_misses.add_metric([tenant, scenario, reason], n)
        yield from (saved_s, saved_p, saved_c, spent_s, spent_p, spent_c, misses, kv_tokens, kv_misses)
        if cost is not None:
            yield cost
        busy = CounterMetricFamily("edgecache_engine_busy_seconds", "Seconds during which the engine was running "
                                   "at least one call (since the ledger began).")
        busy.add_metric([], ledger.busy_s)
        yield busy
        rates = ledger.fit.rates()
        if rates is not None:
            per_token = GaugeMetricFamily("edgecache_engine_seconds_per_token", "The engine's measured cost of a "
                                          "token on this box, by phase (prefill: one more prompt token computed; "
                                          "decode: one more completion token), fitted on busy time.",
                                          labels=["phase"])
            per_token.add_metric(["prefill"], rates[1])
            per_token.add_metric(["decode"], rates[2])
            yield per_token
            per_call = GaugeMetricFamily("edgecache_engine_seconds_per_call", "What an engine call costs whatever "
                                         "its prompt (setting up, its first token), fitted on busy time.")
            per_call.add_metric([], rates[0])
            yield per_call
        calls = GaugeMetricFamily("edgecache_engine_cost_fit_calls", "Engine calls the cost per token rests on.")
        calls.add_metric([], ledger.fit.calls)
        yield calls
