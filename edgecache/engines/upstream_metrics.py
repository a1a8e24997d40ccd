"""The upstream's own prefix-cache hit ratio, read from its Prometheus ``/metrics``.

Two formats are known:

- **vLLM** counts prompt tokens looked up in its prefix cache and those found there: the counters
  ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` (exposed with ``_total``; one series per engine
  core, summed here). Their ratio is the hit ratio since the server started. Releases before the V1 engine
  named them ``vllm:gpu_prefix_cache_queries`` / ``hits``, which are read too.
- **SGLang** (``--enable-metrics``) reports the ratio itself, as the gauge ``sglang:cache_hit_rate`` (one series per
  scheduler rank, averaged here): its recent prefill batches' cached share, not a lifetime figure.

Anything else (another server, a body that is not Prometheus text) gives no figures: :func:`read_prefix_cache`
returns ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

_VLLM_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_VLLM_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
_SGLANG_RATE = "sglang:cache_hit_rate"


@dataclass(frozen=True)
class PrefixCacheFigures:
    """What the upstream says of its prefix cache. ``hits`` and ``queries`` (prompt tokens) where it counts them
    (vLLM), ``None`` where it reports only a ratio (SGLang)."""

    server: str
    hit_ratio: float
    hits: int | None = None
    queries: int | None = None


def read_prefix_cache(text: str) -> PrefixCacheFigures | None:
    """The prefix-cache figures in an upstream's ``/metrics`` text, or ``None`` when it has none this module knows.
    Raises ``ValueError`` for text that is not Prometheus' exposition format."""
    queries: dict[str, float] = {name: 0.0 for name in _VLLM_QUERIES}
    hits: dict[str, float] = {name: 0.0 for name in _VLLM_HITS}
    seen: set[str] = set()
    rates: list[float] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in queries:
                queries[sample.name] += sample.value
                seen.add(sample.name)
            elif sample.name in hits:
                hits[sample.name] += sample.value
                seen.add(sample.name)
            elif sample.name == _SGLANG_RATE and sample.value == sample.value:  # NaN is no figure
                rates.append(sample.value)
    for query_name, hit_name in zip(_VLLM_QUERIES, _VLLM_HITS, strict=True):
        if query_name in seen and hit_name in seen:
            asked, found = int(queries[query_name]), int(hits[hit_name])
            return PrefixCacheFigures("vllm", found / asked if asked else 0.0, hits=found, queries=asked)
    if rates:
        return PrefixCacheFigures("sglang", sum(rates) / len(rates))
    return None


def metrics_url(base_url: str) -> str:
    """Where an OpenAI-compatible server's Prometheus metrics are: ``/metrics`` beside its ``/v1`` API root (vLLM
    and SGLang serve both from one root)."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1") + "/metrics"
