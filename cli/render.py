"""Rich tables for ``edgecache stats``: the /stats JSON made readable, once or as a live view."""

from __future__ import annotations

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
    tables = [overview, ttft, tenants, store]
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
