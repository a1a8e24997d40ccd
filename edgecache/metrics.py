"""Prometheus metrics for one app, in a registry of its own (two apps in one process never share counters).

``/metrics`` renders the registry as Prometheus text; ``/stats`` reads the same samples back as JSON, so the two
can never disagree.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from edgecache.call import OUTCOMES, Outcome
from edgecache.gpu import GpuCollector
from edgecache.semantic import refusals
from edgecache.semantic.false_hits import false_hit_estimate

if TYPE_CHECKING:
    from edgecache.admission import AdmissionGate


# From a 100 us memory hit to a 30 s cold generation on a CPU.
TTFT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0)


class HourlyCount:
    """Events in the last hour, in one-minute buckets (sixty counters, whatever the rate), and since start."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = clock()
        self.total = 0
        self._counts = [0] * 60
        self._minutes = [-1] * 60  # the minute each bucket holds

    def add(self, n: int = 1) -> None:
        minute = int(self._clock() // 60)
        i = minute % 60
        if self._minutes[i] != minute:
            self._minutes[i], self._counts[i] = minute, 0
        self._counts[i] += n
        self.total += n

    def last_hour(self) -> int:
        minute = int(self._clock() // 60)
        return sum(count for count, at in zip(self._counts, self._minutes) if minute - at < 60)

    def per_hour(self) -> float:
        """The average rate since start (over at least a minute, so a first label is not a thousand an hour)."""
        return self.total * 3600.0 / max(self._clock() - self.started, 60.0)


#: The similarity bins of the semantic lookups near the cut (/stats' ``semantic.near_cut``): below the first edge,
#: then one bin between each two edges (a similarity of 1 goes in the last).
NEAR_CUT_EDGES = tuple(round(0.5 + 0.025 * i, 3) for i in range(21))


class NearCut:
    """Per tenant and scenario, the semantic lookups that found a candidate, by the candidate's cosine similarity:
    those that served it and those that refused it. Where the two meet is the cut, as the traffic sees it."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], tuple[list[int], list[int]]] = {}

    def observe(self, tenant: str, scenario: str, similarity: float, served: bool) -> None:
        counts = self._counts.get((tenant, scenario))
        if counts is None:
            bins = len(NEAR_CUT_EDGES)
            counts = self._counts[(tenant, scenario)] = ([0] * bins, [0] * bins)
        counts[0 if served else 1][min(bisect.bisect_right(NEAR_CUT_EDGES, similarity), len(NEAR_CUT_EDGES) - 1)] += 1

    def report(self, tenant: str | None = None) -> dict[str, dict[str, list[int]]]:
        """Per ``tenant/scenario`` (only ``tenant``'s when named): ``served`` and ``refused`` counts per bin."""
        return {f"{t}/{s}": {"served": list(served), "refused": list(refused)}
                for (t, s), (served, refused) in sorted(self._counts.items()) if tenant is None or t == tenant}


class Metrics:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(GpuCollector())  # GPU utilisation and memory from NVML, where there is one
        self.requests = Counter("edgecache_requests", "Requests by tenant, scenario and what served them.",
                                ["tenant", "scenario", "outcome"], registry=self.registry)
        self.engine_calls = Counter("edgecache_engine_calls", "Generations the engine was asked for.",
                                    registry=self.registry)
        self.engine_prompt_tokens = Counter("edgecache_engine_prompt_tokens", "Prompt tokens sent to the engine.",
                                            registry=self.registry)
        self.engine_cached_tokens = Counter(
            "edgecache_engine_cached_tokens", "Prompt tokens the engine served from its prefix cache.",
            registry=self.registry)
        self.engine_completion_tokens = Counter(
            "edgecache_engine_completion_tokens", "Tokens the engine generated.", registry=self.registry)
        self.ttft = Histogram("edgecache_ttft_seconds",
                              "Time from request to first answer byte, by what served it.",
                              ["outcome"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.semantic_search_seconds = Histogram(
            "edgecache_semantic_search_seconds", "Time of one index search (with the guard).",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1), registry=self.registry)
        self.embed_seconds = Histogram(
            "edgecache_embed_seconds", "Time of one embedding batch.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0), registry=self.registry)
        self.semantic_index_vectors = Gauge(
            "edgecache_semantic_index_vectors", "Vectors in the semantic indexes, by tenant and scenario.",
            ["tenant", "scenario"], registry=self.registry)
        self.semantic_guard_rejections = Counter(
            "edgecache_semantic_guard_rejections",
            "Semantic lookups a guard rule refused: its candidate would have served had the rule not fired.",
            ["rule"], registry=self.registry)
        self.semantic_verifier_score = Histogram(
            "edgecache_semantic_verifier_score",
            "The verifier's score of each semantic lookup's best candidate (served or not), by scenario.",
            ["scenario"], buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99),
            registry=self.registry)
        self.semantic_miss_similarity = Histogram(
            "edgecache_semantic_miss_similarity",
            "The nearest candidate's cosine similarity on each semantic lookup that served none, by scenario: where a "
            "scenario's misses sit against its cut.", ["scenario"],
            buckets=(0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.875, 0.9, 0.925, 0.95, 0.975, 0.99, 1.0), registry=self.registry)
        self.semantic_refusals = Counter(
            "edgecache_semantic_refusals",
            "Semantic lookups that found candidates but served none, by scenario and reason (below_cut, "
            "below_threshold, veto:<rule>, guard:<rule>).", ["scenario", "reason"], registry=self.registry)
        self.store_bytes = Gauge("edgecache_store_bytes", "Bytes in a tenant's result store.", ["tenant"],
                                 registry=self.registry)
        self.store_quota_bytes = Gauge("edgecache_store_quota_bytes", "A tenant's result-store quota.", ["tenant"],
                                       registry=self.registry)
        self.store_entries = Gauge("edgecache_store_entries", "Entries in a tenant's result store.", ["tenant"],
                                   registry=self.registry)
        self.engine_kv_usage = Gauge("edgecache_engine_kv_usage_ratio",
                                     "Share of the engine's KV / prefix-cache budget in use, where it reports it.",
                                     registry=self.registry)
        self.prefix_cache_bytes = Gauge(
            "edgecache_engine_prefix_cache_bytes",
            "Bytes of a tenant's KV prefix states in each tier of the engine's prefix cache (ram, disk), where "
            "EdgeCache keeps them (llamacpp).", ["tenant", "tier"], registry=self.registry)
        self.prefix_cache_hits = Gauge(
            "edgecache_engine_prefix_cache_hits",
            "Engine calls that loaded a saved prefix state, by the tier it came from (ram, disk), since start.",
            ["tier"], registry=self.registry)
        self.fleet_records_skipped = Counter(
            "edgecache_fleet_records_skipped",
            "Fleet records this node could not decode or apply, skipped (its feeds go on), by feed (vectors, labels, "
            "events).", ["feed"], registry=self.registry)
        self.upstream_prefix_cache_hit_ratio = Gauge(
            "edgecache_upstream_prefix_cache_hit_ratio",
            "The upstream server's own prefix-cache hit ratio, read from its /metrics (serve --upstream; vLLM: hits "
            "over queries since it started, SGLang: its cache_hit_rate gauge); absent while unknown.", ["server"],
            registry=self.registry)
        self.ttft_p99_target_seconds = Gauge(
            "edgecache_ttft_p99_target_seconds", "The profile's p99 TTFT target (slo.ttft_p99_s), for alert rules.",
            registry=self.registry)
        self.admission_rejections = Counter(
            "edgecache_admission_rejections", "Misses refused with 429 because the engine was saturated.",
            registry=self.registry)
        self.refused_requests = Counter(
            "edgecache_refused_requests", "Requests refused (4xx, or the client gone before its answer), by reason.",
            ["reason"], registry=self.registry)
        self.redis_up = Gauge("edgecache_redis_up",
                              "1 while the fleet's Redis answers, 0 while this node serves on its own "
                              "(store.backend = redis only).", registry=self.registry)
        self.redis_disconnects = Counter("edgecache_redis_disconnects",
                                         "Times this node lost the fleet's Redis.", registry=self.registry)
        self.storage_failures = Counter(
            "edgecache_storage_failures", "Failed storage operations (a write skipped, a read served as a miss, a "
            "damaged file moved aside), by component and kind (disk_full, damaged, io).", ["component", "kind"],
            registry=self.registry)
        self.semantic_labels = Counter(
            "edgecache_semantic_labels", "Labels of semantic decisions (did the cached answer serve?), by tenant, "
            "scenario, the decision labelled (hit, explore, refused) and the label (good, bad, or unverified: "
            "compared, could not tell).",
            ["tenant", "scenario", "decision", "label"], registry=self.registry)
        self.semantic_false_hit_rate = Gauge(
            "edgecache_semantic_false_hit_rate", "Estimated false-hit rate of served semantic decisions, from the "
            "labels of hits and explorations seen since start, by tenant and scenario.", ["tenant", "scenario"],
            registry=self.registry)
        self.semantic_false_hit_upper = Gauge(
            "edgecache_semantic_false_hit_rate_upper", "The 95 % upper bound (Wilson) of "
            "edgecache_semantic_false_hit_rate; 1 until a served decision is labelled.", ["tenant", "scenario"],
            registry=self.registry)
        self.semantic_explorations = Counter(
            "edgecache_semantic_explorations", "Semantic candidates the learner would have served but refused, to "
            "label them against the engine's answer (semantic.decision = learner), by tenant and scenario.",
            ["tenant", "scenario"], registry=self.registry)
        self.semantic_learner_false_hit_rate = Gauge(
            "edgecache_semantic_learner_false_hit_rate", "The learner's estimate of the false hits it served, as a "
            "share of its lookups, by tenant and scenario (what it holds under the scenario's target).",
            ["tenant", "scenario"], registry=self.registry)
        self.semantic_learner_false_hit_upper = Gauge(
            "edgecache_semantic_learner_false_hit_rate_upper", "The upper bound of "
            "edgecache_semantic_learner_false_hit_rate (one standard deviation of the served decisions' estimated "
            "errors above it).", ["tenant", "scenario"], registry=self.registry)
        self.semantic_demoted_entries = Gauge(
            "edgecache_semantic_demoted_entries", "Cached answers the learner no longer serves semantically: "
            "labels showed them serving wrong answers.", registry=self.registry)
        self.feedback = Counter(
            "edgecache_feedback", "Callers' marks of the responses they received (POST /v1/feedback), by tenant, "
            "what served the response (exact, semantic, shared, miss) and the verdict (right, wrong).",
            ["tenant", "served", "verdict"], registry=self.registry)
        self.near_cut = NearCut()
        self.labels_recent = HourlyCount(clock)  # labels from every source, unverified too (/stats' rate)
        self.decision_log_dropped = Counter(
            "edgecache_decision_log_dropped", "Decision-log records not written (the writer behind, or the disk "
            "failing).", registry=self.registry)
        self._label_counts: dict[tuple[str, str], list[int]] = {}  # (tenant, scenario) -> [served n, served bad,
        #                                                                                    all n, all bad]
        # Label children are cached: .labels() takes a lock and hashes on every call, which shows on the hit path.
        self._ttft_by_outcome = {o: self.ttft.labels(o) for o in OUTCOMES}
        self._requests_children: dict[tuple[str, str, str], Counter] = {}

    def track_admission(self, gate: AdmissionGate) -> None:
        """Queue depth and running misses, read from the gate at scrape time."""
        running = Gauge("edgecache_admission_running", "Misses computing in the engine now.",
                        registry=self.registry)
        queued = Gauge("edgecache_admission_queue_depth", "Misses waiting for an engine slot.",
                       registry=self.registry)
        running.set_function(lambda: gate.running)
        queued.set_function(lambda: gate.queued)

    def observe_request(self, tenant: str, scenario: str, outcome: Outcome, ttft_s: float | None) -> None:
        labels = (tenant, scenario, outcome)
        child = self._requests_children.get(labels)
        if child is None:
            child = self._requests_children[labels] = self.requests.labels(*labels)
        child.inc()
        if outcome == "rejected":
            self.admission_rejections.inc()
        if ttft_s is not None:
            self._ttft_by_outcome[outcome].observe(ttft_s)

    def observe_label(self, tenant: str, scenario: str, decision: str, good: bool | None) -> None:
        """A label of a semantic decision (``decision``: ``explore`` or ``refused``). An exploration's label is of
        an answer the policy would have served, so it updates the served false-hit estimate; a refused candidate's
        says what a lower cut would have served. None (compared, could not tell) is only counted."""
        self.semantic_labels.labels(tenant, scenario, decision,
                                    "unverified" if good is None else "good" if good else "bad").inc()
        self.labels_recent.add()
        if good is None:
            return
        counts = self._label_counts.setdefault((tenant, scenario), [0, 0, 0, 0])
        counts[2] += 1
        counts[3] += not good
        if decision == "explore":
            counts[0] += 1
            counts[1] += not good
        rate, upper = false_hit_estimate(counts[1], counts[0])
        if rate is not None:
            self.semantic_false_hit_rate.labels(tenant, scenario).set(rate)
        self.semantic_false_hit_upper.labels(tenant, scenario).set(1.0 if upper is None else upper)

    def observe_feedback(self, tenant: str, served: str, correct: bool) -> None:
        self.feedback.labels(tenant, served, "right" if correct else "wrong").inc()

    def label_summary(self) -> dict[str, dict[str, object]]:
        """Per ``tenant/scenario``: labels seen, bad ones, and the served decisions' false-hit estimate and bound
        (None until one is labelled)."""
        summary: dict[str, dict[str, object]] = {}
        for (tenant, scenario), (n, bad, n_all, bad_all) in sorted(self._label_counts.items()):
            rate, upper = false_hit_estimate(bad, n)
            summary[f"{tenant}/{scenario}"] = {"labels": n_all, "bad": bad_all, "served_labels": n,
                                               "false_hit_rate": rate, "false_hit_upper_95": upper}
        return summary

    def observe_redis(self, up: bool) -> None:
        """The fleet link changed state (called on transitions only)."""
        if not up:
            self.redis_disconnects.inc()
        self.redis_up.set(1 if up else 0)

    def observe_engine_call(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> None:
        self.engine_calls.inc()
        self.engine_prompt_tokens.inc(prompt_tokens)
        self.engine_cached_tokens.inc(cached_tokens)
        self.engine_completion_tokens.inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, object]:
        """Counts for /stats, read from the same samples /metrics renders."""
        requests: dict[str, dict[str, dict[str, int]]] = {}
        totals = {o: 0 for o in OUTCOMES}
        ttft: dict[str, dict[str, float]] = {}
        buckets: dict[str, list[tuple[float, float]]] = {}
        engine: dict[str, int] = {}
        semantic: dict[str, object] = {"guard_rejections": 0, "index_vectors": {}}
        want_of_labels = 0
        feedback: dict[str, int] = {}
        for family in self.registry.collect():
            if family.name == "edgecache_semantic_guard_rejections":
                semantic["guard_rejections"] = int(sum(s.value for s in family.samples if s.name.endswith("_total")))
            elif family.name == "edgecache_semantic_index_vectors":
                semantic["index_vectors"] = {f"{s.labels['tenant']}/{s.labels['scenario']}": int(s.value)
                                             for s in family.samples}
            elif family.name == "edgecache_semantic_refusals":
                want_of_labels += int(sum(s.value for s in family.samples if s.name.endswith("_total")
                                          and refusals.for_want_of_labels(s.labels["reason"])))
            elif family.name == "edgecache_feedback":
                for s in family.samples:
                    if s.name.endswith("_total"):
                        verdict = f"{s.labels['served']}_{s.labels['verdict']}"
                        feedback[verdict] = feedback.get(verdict, 0) + int(s.value)
            elif family.name.startswith("edgecache_engine_") and family.type == "counter":
                engine[family.name.removeprefix("edgecache_engine_")] = int(family.samples[0].value)
            elif family.name == "edgecache_requests":
                for s in family.samples:
                    if s.name.endswith("_total"):
                        tenant, scenario, outcome = s.labels["tenant"], s.labels["scenario"], s.labels["outcome"]
                        requests.setdefault(tenant, {}).setdefault(scenario, {})[outcome] = int(s.value)
                        totals[outcome] += int(s.value)
            elif family.name == "edgecache_ttft_seconds":
                for s in family.samples:
                    if s.name.endswith("_count") or s.name.endswith("_sum"):
                        field = "count" if s.name.endswith("_count") else "sum_s"
                        ttft.setdefault(s.labels["outcome"], {})[field] = s.value
                    elif s.name.endswith("_bucket"):
                        buckets.setdefault(s.labels["outcome"], []).append((float(s.labels["le"]), s.value))
        semantic["labels"] = self.label_summary()
        # How fast the box is taught, and what the want of it costs (the learner refuses what it cannot bound).
        semantic["labelling"] = {"labels_last_hour": self.labels_recent.last_hour(),
                                 "labels_per_hour": round(self.labels_recent.per_hour(), 1),
                                 "labels_since_start": self.labels_recent.total,
                                 "refused_for_want_of_labels": want_of_labels, "feedback": feedback}
        served = sum(totals.values()) - totals["error"] - totals["rejected"]
        hits = totals["exact"] + totals["semantic"] + totals["shared"]
        return {
            "requests": totals,
            "hit_rate": hits / served if served else 0.0,
            "by_tenant": requests,
            "engine": engine,
            "semantic": semantic,
            "ttft": {o: {"count": int(v.get("count", 0)),
                         "mean_s": v.get("sum_s", 0.0) / v["count"] if v.get("count") else 0.0,
                         "p50_s": quantile(buckets.get(o, []), 0.5), "p99_s": quantile(buckets.get(o, []), 0.99)}
                     for o, v in ttft.items()},
        }


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """A quantile from cumulative histogram buckets ``(upper bound, count)``, interpolated within its bucket the
    way Prometheus' ``histogram_quantile`` does (so /stats and the dashboard agree)."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return 0.0
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            width = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width else 1.0)
        lower_bound, lower_count = bound, count
    return lower_bound
