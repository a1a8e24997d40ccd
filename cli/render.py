"""Rich tables for ``edgecache stats``: the /stats JSON made readable."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def stats_tables(body: dict[str, Any]) -> list[Table]:
    model = body.get("model", {})
    overview = Table(title=f"EdgeCache: {model.get('id', '?')} (profile {body.get('profile', '?')})")
    overview.add_column("figure")
    overview.add_column("value", justify="right")
    requests = body.get("requests", {})
    overview.add_row("requests", str(sum(requests.values())))
    for outcome, count in requests.items():
        overview.add_row(f"  {outcome}", str(count))
    overview.add_row("hit rate", _pct(body.get("hit_rate", 0.0)))
    engine = body.get("engine", {})
    overview.add_row("engine calls", str(engine.get("calls", 0)))
    prompt = engine.get("prompt_tokens", 0)
    overview.add_row("engine prefix-cache hit", _pct(engine.get("cached_tokens", 0) / prompt if prompt else 0.0))
    store = body.get("store", {})
    overview.add_row("store entries", str(store.get("entries", 0)))
    overview.add_row("store bytes / budget", f"{store.get('bytes', 0):,} / {store.get('budget_bytes', 0):,}")
    overview.add_row("in flight", str(body.get("inflight", 0)))

    ttft = Table(title="TTFT by outcome")
    for col in ("outcome", "count", "mean"):
        ttft.add_column(col, justify="right" if col != "outcome" else "left")
    for outcome, figures in body.get("ttft", {}).items():
        ttft.add_row(outcome, str(figures.get("count", 0)), f"{1000 * figures.get('mean_s', 0.0):.2f} ms")

    tenants = Table(title="By tenant and scenario")
    for col in ("tenant", "scenario", "exact", "shared", "miss", "error", "hit rate"):
        tenants.add_column(col)
    for tenant, scenarios in body.get("by_tenant", {}).items():
        for scenario, counts in scenarios.items():
            served = sum(v for k, v in counts.items() if k not in ("error", "rejected"))
            hits = sum(counts.get(k, 0) for k in ("exact", "semantic", "shared"))
            tenants.add_row(tenant, scenario, *(str(counts.get(k, 0)) for k in ("exact", "shared", "miss", "error")),
                            _pct(hits / served if served else 0.0))
    return [overview, ttft, tenants]
