"""Rich tables for ``edgecache stats``: the /stats JSON made readable, once or as a live view."""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table

from edgecache.call import HITS, OUTCOMES, SERVED


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


def _served(counts: dict[str, int]) -> int:
    return sum(v for k, v in counts.items() if k not in ("error", "rejected"))


def _merge(scenarios: dict[str, dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for counts in scenarios.values():
        for outcome, n in counts.items():
            out[outcome] = out.get(outcome, 0) + n
    return out


def stats_tables(body: dict[str, Any], *, tenant: str | None = None, previous: dict[str, Any] | None = None,
                 seconds: float | None = None) -> list[Table]:
    """Overview, TTFT, and per tenant/scenario tables. With ``previous`` and ``seconds`` (the live view) the
    overview also shows requests/s since the previous sample."""
    by_tenant: dict[str, dict[str, dict[str, int]]] = body.get("by_tenant", {})
    stores: dict[str, dict[str, int]] = body.get("stores", {})
    tenant = body.get("tenant", tenant)  # a tenant's key: the server sent that tenant's figures only
    if tenant is not None:
        by_tenant = {tenant: by_tenant.get(tenant, {})}
        stores = {tenant: stores[tenant]} if tenant in stores else {}
    model = body.get("model", {})
    title = f"EdgeCache: {model.get('id', '?')} (profile {body.get('profile', '?')})"
    overview = Table(title=title + (f", tenant {tenant}" if tenant else ""))
    overview.add_column("figure")
    overview.add_column("value", justify="right")
    counts = _merge({f"{t}/{s}": c for t, sc in by_tenant.items() for s, c in sc.items()})
    total = sum(counts.values())
    overview.add_row("requests", f"{total:,}")
    if previous is not None and seconds:
        before = sum(sum(c.values()) for t, sc in previous.get("by_tenant", {}).items()
                     if tenant in (None, t) for c in sc.values())
        overview.add_row("requests/s", f"{(total - before) / seconds:.1f}")
    served = _served(counts)
    overview.add_row("hit rate", _pct(sum(counts.get(k, 0) for k in HITS) / served if served else 0.0))
    for layer in HITS:
        overview.add_row(f"  {layer}", _pct(counts.get(layer, 0) / served if served else 0.0))
    for outcome in (o for o in OUTCOMES if o not in HITS):
        overview.add_row(outcome, f"{counts.get(outcome, 0):,}")
    if tenant is None:
        engine = body.get("engine", {})
        overview.add_row("engine calls", f"{engine.get('calls', 0):,}")
        prompt = engine.get("prompt_tokens", 0)
        overview.add_row("engine prefix-cache hit", _pct(engine.get("cached_tokens", 0) / prompt if prompt else 0.0))
        admission = body.get("admission", {})
        overview.add_row("admission running / queued / rejected",
                         f"{admission.get('running', 0)} / {admission.get('queued', 0)} / "
                         f"{admission.get('rejected', 0)}")
        overview.add_row("in flight", str(body.get("inflight", 0)))

    ttft = Table(title="TTFT by outcome (all tenants)")
    for col in ("outcome", "count", "p50", "p99", "mean"):
        ttft.add_column(col, justify="left" if col == "outcome" else "right")
    for outcome, figures in body.get("ttft", {}).items():
        if figures.get("count"):
            ttft.add_row(outcome, f"{figures['count']:,}", _ms(figures.get("p50_s", 0.0)),
                         _ms(figures.get("p99_s", 0.0)), _ms(figures.get("mean_s", 0.0)))

    tenants = Table(title="By tenant and scenario")
    for col in ("tenant", "scenario", "requests", *SERVED, "hit rate"):
        tenants.add_column(col, justify="left" if col in ("tenant", "scenario") else "right")
    for name, scenarios in sorted(by_tenant.items()):
        for scenario, c in sorted(scenarios.items()):
            s = _served(c)
            tenants.add_row(name, scenario, f"{sum(c.values()):,}", *(f"{c.get(k, 0):,}" for k in SERVED),
                            _pct(sum(c.get(k, 0) for k in HITS) / s if s else 0.0))

    store = Table(title="Result stores")
    for col in ("tenant", "entries", "bytes", "quota", "used"):
        store.add_column(col, justify="left" if col == "tenant" else "right")
    for name, st in sorted(stores.items()):
        quota = st.get("budget_bytes", 0)
        store.add_row(name, f"{st.get('entries', 0):,}", f"{st.get('bytes', 0):,}", f"{quota:,}",
                      _pct(st.get("bytes", 0) / quota if quota else 0.0))
    tables = [overview, *ledger_tables(body.get("ledger") or {}), ttft, tenants, store]
    labelling: dict[str, Any] = body.get("semantic", {}).get("labelling") or {}
    feedback: dict[str, int] = labelling.get("feedback") or {}
    if tenant is None and (labelling.get("labels_since_start") or labelling.get("refused_for_want_of_labels")
                           or any(feedback.values())):
        # How fast this box is taught, and what the want of labels costs: a learner with no labeler it can trust
        # (a CPU box without a judge) refuses what it cannot bound, and says so here. Box-wide figures.
        taught = Table(title="Semantic labelling (this box)")
        for col in ("labels last hour", "per hour", "since start", "refused for want of labels", "feedback"):
            taught.add_column(col, justify="right")
        marks = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in sorted(feedback.items()) if v) or "-"
        taught.add_row(f"{labelling.get('labels_last_hour', 0):,}", f"{labelling.get('labels_per_hour', 0.0):,.1f}",
                       f"{labelling.get('labels_since_start', 0):,}",
                       f"{labelling.get('refused_for_want_of_labels', 0):,}", marks)
        tables.append(taught)
    labels: dict[str, dict[str, Any]] = body.get("semantic", {}).get("labels", {})
    if tenant is not None:
        labels = {k: v for k, v in labels.items() if k.split("/", 1)[0] == tenant}
    if labels:
        # Labels of semantic decisions (a refused candidate's, from its miss; a served one's, from an exploration):
        # the served false-hit estimate needs the latter.
        judged = Table(title="Semantic labels (false hits of served decisions, 95 % bound)")
        for col in ("tenant/scenario", "labels", "bad", "served labels", "false hits", "bound"):
            judged.add_column(col, justify="left" if col == "tenant/scenario" else "right")
        for name, figures in sorted(labels.items()):
            rate, bound = figures.get("false_hit_rate"), figures.get("false_hit_upper_95")
            judged.add_row(name, f"{figures.get('labels', 0):,}", f"{figures.get('bad', 0):,}",
                           f"{figures.get('served_labels', 0):,}", "-" if rate is None else _pct(rate),
                           "-" if bound is None else _pct(bound))
        tables.append(judged)
    learner: dict[str, Any] = body.get("semantic", {}).get("learner") or {}
    pools: dict[str, dict[str, Any]] = {k: v for k, v in learner.get("pools", {}).items()
                                        if tenant is None or k.split("/", 1)[0] == tenant}
    if pools:
        # semantic.decision = learner: what it served against its target, and what its explorations cost.
        learned = Table(title=f"Semantic learner ({learner.get('demoted', 0):,} answers demoted)")
        for col in ("tenant/scenario", "lookups", "explored", "labels", "false hits (est.)", "bound"):
            learned.add_column(col, justify="left" if col == "tenant/scenario" else "right")
        for name, figures in sorted(pools.items()):
            learned.add_row(name, f"{figures.get('lookups', 0):,}", f"{figures.get('explorations', 0):,}",
                            f"{figures.get('labels', 0):,}", _pct(figures.get("false_hit_rate", 0.0)),
                            _pct(figures.get("false_hit_upper", 0.0)))
        tables.append(learned)
    return tables


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _money(amount: float | None, currency: str) -> str:
    if amount is None:
        return "-"
    return f"{amount:,.2f} {currency}" if abs(amount) >= 1 else f"{amount:.4f} {currency}"


def _tokens(figures: dict[str, Any]) -> int:
    return sum(v.get("prompt_tokens", 0) + v.get("completion_tokens", 0) for v in figures.get("saved", {}).values())


def ledger_tables(ledger: dict[str, Any]) -> list[Table]:
    """What the cache saved, per tenant and scenario, since the ledger began and in the last hour; the layers it
    saved through; why the misses missed."""
    if not ledger:
        return []
    fit = ledger.get("fit", {})
    price = ledger.get("price")
    currency = price["currency"] if price else ""
    since = time.strftime("%Y-%m-%d %H:%M", time.localtime(ledger.get("since", 0)))
    tables = []
    for window, figures_of, title in (
            ("since", ledger, f"What the cache saved, since {since}"),
            ("last hour", ledger.get("last_hour", {}), "What the cache saved, last hour")):
        rows: dict[str, Any] = figures_of.get("by_tenant_scenario", {})
        if not rows:
            continue
        caption = None if fit.get("ready") else fit.get("why")
        saved = Table(title=title, caption=caption)
        columns = ["tenant/scenario", "requests", "misses", "tokens saved", "engine time saved", "engine time spent",
                   "cache's share", "capacity"]
        if price:
            columns.append("cost saved")
        for col in columns:
            saved.add_column(col, justify="left" if col == "tenant/scenario" else "right")
        for name, figures in [*sorted(rows.items()), ("all", figures_of.get("total", {}))]:
            share, capacity = figures.get("cache_share"), figures.get("effective_capacity")
            cells = [name, f"{sum(figures.get('requests', {}).values()):,}", f"{figures.get('misses', 0):,}",
                     f"{_tokens(figures):,}",
                     _duration(figures.get("saved_engine_s")) if fit.get("ready") or figures.get("saved_engine_s")
                     else "not yet measured",
                     _duration(figures.get("spent_engine_s")), "-" if share is None else _pct(share),
                     "-" if capacity is None else f"{capacity:.2f}x"]
            if price:
                cells.append(_money(figures.get("cost_saved_total"), currency))
            saved.add_row(*cells)
        tables.append(saved)
        if window != "since":
            continue
        layers = Table(title="Saved by layer (since the ledger began)")
        for col in ("tenant/scenario", "layer", "prompt tokens", "completion tokens", "engine time",
                    *(("cost",) if price else ())):
            layers.add_column(col, justify="left" if col in ("tenant/scenario", "layer") else "right")
        for name, figures in sorted(rows.items()):
            for layer, figs in figures.get("saved", {}).items():
                if figs.get("prompt_tokens") or figs.get("completion_tokens"):
                    layers.add_row(name, layer, f"{figs['prompt_tokens']:,}", f"{figs['completion_tokens']:,}",
                                   _duration(figs.get("engine_s")),
                                   *((_money(figures.get("cost_saved", {}).get(layer), currency),) if price else ()))
        if layers.row_count:
            tables.append(layers)
    reasons = Table(title="Why misses missed (since the ledger began; last hour)")
    for col in ("tenant/scenario", "reason", "misses", "share", "last hour"):
        reasons.add_column(col, justify="left" if col in ("tenant/scenario", "reason") else "right")
    hour = ledger.get("last_hour", {}).get("by_tenant_scenario", {})
    for name, figures in sorted(ledger.get("by_tenant_scenario", {}).items()):
        total = figures.get("misses", 0)
        recent = hour.get(name, {}).get("miss_reasons", {})
        for reason, n in sorted(figures.get("miss_reasons", {}).items(), key=lambda kv: -kv[1]):
            if n:
                reasons.add_row(name, reason, f"{n:,}", _pct(n / total if total else 0.0), f"{recent.get(reason, 0):,}")
    if reasons.row_count:
        tables.append(reasons)
    return tables
