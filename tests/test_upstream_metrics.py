"""The upstream's own prefix-cache hit ratio: read from its /metrics (vLLM's counters, SGLang's gauge) by the
upstream engine off the request path, shown in /stats' engine_state and as a gauge in /metrics.

``tests/data/upstream_metrics/vllm-0.32.0.txt`` is the /metrics of the vLLM that tests/test_vllm_upstream.py runs,
captured after three requests; ``sglang-0.5.23.txt`` is an SGLang server's, as its collector names and labels the
series."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from edgecache.engines.base import GenerationRequest, Message, SamplingParams
from edgecache.engines.openai_upstream import OpenAIUpstreamEngine
from edgecache.engines.upstream_metrics import PrefixCacheFigures, metrics_url, read_prefix_cache
from edgecache.http.app import create_app
from edgecache.settings import Settings
from tests.conftest import serve_in_process

DATA = Path(__file__).parent / "data" / "upstream_metrics"
VLLM = (DATA / "vllm-0.32.0.txt").read_text()
SGLANG = (DATA / "sglang-0.5.23.txt").read_text()
# The captured vLLM's own counters (three requests under one ~1,500-token system prompt, one salt): prompt tokens
# looked up in its prefix cache, and found there.
VLLM_QUERIES, VLLM_HITS = 4537, 2816
CHAT = GenerationRequest(messages=(Message(role="user", content="Name a colour."),),
                         params=SamplingParams(max_tokens=4, temperature=0.0))


def test_vllms_counters() -> None:
    figures = read_prefix_cache(VLLM)
    assert figures is not None and figures.server == "vllm"
    assert (figures.hits, figures.queries) == (VLLM_HITS, VLLM_QUERIES)
    assert figures.hit_ratio == pytest.approx(VLLM_HITS / VLLM_QUERIES)


def test_vllms_counters_are_summed_over_engines_and_older_names_are_read() -> None:
    two = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 200.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0
"""
    assert read_prefix_cache(two) == PrefixCacheFigures("vllm", 0.5, hits=200, queries=400)
    older = two.replace("vllm:prefix_cache_", "vllm:gpu_prefix_cache_")
    assert read_prefix_cache(older) == PrefixCacheFigures("vllm", 0.5, hits=200, queries=400)
    fresh = "# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total 0.0\n" \
            "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total 0.0\n"
    assert read_prefix_cache(fresh) == PrefixCacheFigures("vllm", 0.0, hits=0, queries=0)


def test_sglangs_gauge() -> None:
    assert read_prefix_cache(SGLANG) == PrefixCacheFigures("sglang", 0.8125)
    ranks = SGLANG.replace('tp_rank="1"} 0.8125', 'tp_rank="1"} 0.6875')
    assert read_prefix_cache(ranks) == PrefixCacheFigures("sglang", 0.75)  # the ranks' mean


def test_other_servers_have_no_figures_and_garbage_is_refused() -> None:
    edgecache_own = "# TYPE edgecache_engine_calls counter\nedgecache_engine_calls_total 3.0\n"
    assert read_prefix_cache(edgecache_own) is None
    assert read_prefix_cache("") is None
    only_hits = "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total 5.0\n"
    assert read_prefix_cache(only_hits) is None  # half a ratio is no ratio
    with pytest.raises(ValueError):
        read_prefix_cache("<html><body>Not Found</body></html>\n")


@pytest.mark.parametrize(("base", "expected"), [
    ("http://10.0.0.5:8000/v1", "http://10.0.0.5:8000/metrics"),
    ("http://10.0.0.5:8000/v1/", "http://10.0.0.5:8000/metrics"),
    ("https://gw.example/llm/v1", "https://gw.example/llm/metrics"),
    ("http://10.0.0.5:30000", "http://10.0.0.5:30000/metrics"),
])
def test_metrics_url(base: str, expected: str) -> None:
    assert metrics_url(base) == expected


class Upstream:
    """An OpenAI-compatible upstream behind MockTransport whose /metrics answers what the test sets: a body, a
    status, or a connection failure."""

    def __init__(self) -> None:
        self.metrics: str | int | None = VLLM
        self.metrics_reads = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            self.metrics_reads += 1
            if self.metrics is None:
                raise httpx.ConnectError("connection refused", request=request)
            if isinstance(self.metrics, int):
                return httpx.Response(self.metrics, text="nope")
            return httpx.Response(200, text=self.metrics)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200, json={"choices": [{"message": {"content": "Blue"}, "finish_reason": "stop"}],
                                         "usage": {"prompt_tokens": 5, "completion_tokens": 1}})


def engine_on(upstream: Upstream) -> OpenAIUpstreamEngine:
    return OpenAIUpstreamEngine("http://vllm:8000/v1", stream=False, transport=httpx.MockTransport(upstream))


async def test_the_engine_reads_the_figures_only_when_scraping_and_a_failure_fails_no_request() -> None:
    upstream = Upstream()
    engine = engine_on(upstream)
    await engine.scrape()  # not started: nothing to read with, nothing read
    await engine.start()
    assert [c.text async for c in engine.generate(CHAT)] == ["Blue"]
    state = await engine.stats()
    assert upstream.metrics_reads == 0  # a request never reads /metrics
    assert state["upstream_metrics"] == "not read yet" and "upstream_prefix_cache_hit_ratio" not in state

    await engine.scrape()
    state = await engine.stats()
    assert upstream.metrics_reads == 1
    assert (state["upstream_metrics"], state["upstream_prefix_cache_hits"],
            state["upstream_prefix_cache_queries"]) == ("vllm", VLLM_HITS, VLLM_QUERIES)
    assert state["upstream_prefix_cache_hit_ratio"] == pytest.approx(VLLM_HITS / VLLM_QUERIES)
    assert engine.upstream_prefix_cache_hit_ratio() == state["upstream_prefix_cache_hit_ratio"]

    for metrics, says in ((None, "http://vllm:8000/metrics unreachable: ConnectError"),
                          (404, "http://vllm:8000/metrics answered HTTP 404"),
                          ("<html>\n", "http://vllm:8000/metrics is not Prometheus text"),
                          ("# TYPE x counter\nx_total 1.0\n", "http://vllm:8000/metrics has no prefix-cache figures")):
        upstream.metrics = metrics
        await engine.scrape()  # never raises
        state = await engine.stats()
        assert str(state["upstream_metrics"]).startswith(says), state
        assert "upstream_prefix_cache_hit_ratio" not in state and "upstream_prefix_cache_hits" not in state
        assert engine.upstream_prefix_cache_hit_ratio() is None
        assert [c.text async for c in engine.generate(CHAT)] == ["Blue"]  # requests go on

    upstream.metrics = SGLANG
    await engine.scrape()
    state = await engine.stats()
    assert (state["upstream_metrics"], state["upstream_prefix_cache_hit_ratio"]) == ("sglang", 0.8125)
    assert "upstream_prefix_cache_hits" not in state  # SGLang reports a ratio, not counts
    await engine.close()


def _gauge_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("edgecache_upstream_prefix_cache_hit_ratio{")]


async def test_stats_and_metrics_show_the_upstreams_ratio_and_drop_it_when_unknown(
        make_settings: Callable[..., Settings]) -> None:
    upstream = Upstream()
    engine = engine_on(upstream)
    async with serve_in_process(create_app(make_settings(), engine=engine)) as client:
        rt = client.app.state.runtime  # type: ignore[attr-defined]
        assert _gauge_lines((await client.get("/metrics")).text) == []  # not read yet: no series
        await rt.scrape_engine()  # what the housekeeping loop does every few seconds
        await rt.refresh_gauges()
        assert _gauge_lines((await client.get("/metrics")).text) == [
            f'edgecache_upstream_prefix_cache_hit_ratio{{server="vllm"}} {VLLM_HITS / VLLM_QUERIES!r}']
        state = (await client.get("/stats")).json()["engine_state"]
        assert state["upstream_prefix_cache_hits"] == VLLM_HITS

        upstream.metrics = None  # the upstream's /metrics goes away: the series goes, /stats says why
        await rt.scrape_engine()
        body = (await client.get("/stats")).json()
        assert "unreachable" in body["engine_state"]["upstream_metrics"]
        assert _gauge_lines((await client.get("/metrics")).text) == []
        resp = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "still served?"}], "max_tokens": 4})
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "Blue"

        upstream.metrics = SGLANG
        await rt.scrape_engine()
        await rt.refresh_gauges()
        assert _gauge_lines((await client.get("/metrics")).text) == [
            'edgecache_upstream_prefix_cache_hit_ratio{server="sglang"} 0.8125']


async def test_a_scrape_that_raises_does_not_stop_the_housekeeping(make_settings: Callable[..., Settings]) -> None:
    upstream = Upstream()
    engine = engine_on(upstream)

    async def broken() -> None:
        raise RuntimeError("a bug in an engine's scrape")

    async with serve_in_process(create_app(make_settings(), engine=engine)) as client:
        rt = client.app.state.runtime  # type: ignore[attr-defined]
        engine.scrape = broken  # type: ignore[method-assign]
        await rt.scrape_engine()  # logged, not raised
        assert (await client.get("/stats")).status_code == 200
