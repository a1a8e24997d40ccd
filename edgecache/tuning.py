"""`edgecache tune`: replay a decision log, join its labels to their decisions, and find per tenant and scenario the
lowest similarity cut that meets a false-hit target with a confidence bound.

For a cut ``c``, the labelled decisions whose candidate's similarity is at least ``c`` are the ones the cut would
have served; the bad labels among them are its false hits. The cut is accepted when the one-sided Wilson upper
bound of that false-hit rate (at ``confidence``, 95 % by default) is at most the target; the lowest accepted cut is
reported, with the hit rate it would have given (the share of all logged lookups of the group whose candidate is at
least that similar) and how many labels back it.

Labels from misses sit below the cut that was running (the refused candidates), so on such a log the estimate for
a lower cut is drawn from exactly the band it would add; an above-cut hit is labelled only when it was explored.

``per="lookup"`` counts false hits as a share of all the group's lookups instead (the issue's definition, and the
static oracle's in ``scripts/eval_semantic.py --stream``): meaningful when the labels cover the decisions a lower cut
would serve, as on a fully labelled replay.

Pure functions over records, so the CLI and tests share them; :func:`overlay_toml` writes the per-scenario
``threshold`` overlay (and each tenant's own, ``tenant_thresholds``) that ``edgecache serve --overlay FILE`` loads on
top of the profile.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal
from statistics import NormalDist

import msgspec

from edgecache.decision_log import DecisionRecord, LabelRecord, Record

ALL = "*"


def wilson_upper(bad: int, n: int, confidence: float = 0.95) -> float:
    """One-sided Wilson score upper bound of a rate seen as ``bad`` of ``n`` (1.0 with no observations).
    ``confidence`` 0 gives the plain rate."""
    if n <= 0:
        return 1.0
    p = bad / n
    if confidence <= 0:
        return p
    z = NormalDist().inv_cdf(confidence)
    z2 = z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z2 / n))


class Sample(msgspec.Struct, frozen=True):
    similarity: float
    good: bool


class Group(msgspec.Struct, kw_only=True):
    """One (tenant, scenario)'s lookups: how many, the similarities of their candidates, and the labelled ones."""

    tenant: str
    scenario: str
    lookups: int = 0
    similarities: list[float] = msgspec.field(default_factory=list)
    labelled: list[Sample] = msgspec.field(default_factory=list)


class Cut(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    scenario: str
    lookups: int
    labels: int            # labelled decisions in the group
    cut: float | None      # None: no cut meets the target with the labels there are
    false_hit_rate: float | None = None    # among the labelled decisions at or above the cut
    false_hit_upper: float | None = None   # its upper bound
    backing: int = 0       # labelled decisions at or above the cut
    hit_rate: float | None = None          # share of the group's lookups the cut would have served


def join(records: Iterable[Record], *, tenant: str | None = None, scenario: str | None = None,
         pooled: bool = True) -> dict[tuple[str, str], Group]:
    """Decisions by (tenant, scenario) with their labels joined (a decision's last label wins). With ``pooled``,
    every scenario also gets a group over all the selected tenants, under tenant ``*``."""
    decisions: dict[str, DecisionRecord] = {}
    labels: dict[str, bool] = {}
    for record in records:
        if isinstance(record, DecisionRecord):
            if (tenant is None or record.tenant == tenant) and (scenario is None or record.scenario == scenario):
                decisions[record.id] = record
        elif isinstance(record, LabelRecord):
            labels[record.id] = record.good
    groups: dict[tuple[str, str], Group] = {}
    for record in decisions.values():
        names = [(record.tenant, record.scenario)] + ([(ALL, record.scenario)] if pooled else [])
        good = labels.get(record.id)
        for name in names:
            group = groups.get(name)
            if group is None:
                group = groups[name] = Group(tenant=name[0], scenario=name[1])
            group.lookups += 1
            if record.similarity is not None:
                group.similarities.append(record.similarity)
                if good is not None:
                    group.labelled.append(Sample(record.similarity, good))
    return groups


def lowest_cut(group: Group, *, target: float, confidence: float = 0.95,
               per: Literal["served", "lookup"] = "served") -> Cut:
    """The lowest similarity cut whose false-hit bound among the labelled decisions at or above it (``per``
    served) or among all the group's lookups (``per`` lookup) is within ``target``."""
    labelled = sorted(group.labelled, key=lambda s: -s.similarity)
    best: tuple[float, int, int] | None = None  # cut, bad, n
    bad = n = 0
    i = 0
    while i < len(labelled):
        value = labelled[i].similarity
        while i < len(labelled) and labelled[i].similarity == value:  # ties enter together
            bad += not labelled[i].good
            n += 1
            i += 1
        if wilson_upper(bad, n if per == "served" else group.lookups, confidence) <= target:
            best = (value, bad, n)
    if best is None:
        return Cut(tenant=group.tenant, scenario=group.scenario, lookups=group.lookups, labels=len(labelled),
                   cut=None)
    cut, bad, n = best
    served = sum(1 for s in group.similarities if s >= cut)
    base = n if per == "served" else group.lookups
    return Cut(tenant=group.tenant, scenario=group.scenario, lookups=group.lookups, labels=len(labelled), cut=cut,
               false_hit_rate=bad / base, false_hit_upper=wilson_upper(bad, base, confidence), backing=n,
               hit_rate=served / group.lookups if group.lookups else 0.0)


def tune(records: Iterable[Record], *, target: float = 0.01, confidence: float = 0.95, tenant: str | None = None,
         scenario: str | None = None, per: Literal["served", "lookup"] = "served") -> list[Cut]:
    """:func:`lowest_cut` for every group of :func:`join`, the pooled ``*`` groups first within a scenario."""
    groups = join(records, tenant=tenant, scenario=scenario)
    order = sorted(groups, key=lambda key: (key[1], key[0] != ALL, key[0]))
    return [lowest_cut(groups[key], target=target, confidence=confidence, per=per) for key in order]


def overlay_toml(cuts: Iterable[Cut], *, pooled: bool = True) -> str:
    """The settings overlay of the cuts: the pooled ones as ``[scenarios.NAME] threshold = ...`` (with ``pooled``:
    every tenant's traffic was replayed, so they suit every tenant), each tenant's own as
    ``[tenant_thresholds."T"] NAME = ...``. Cuts are rounded up to 4 decimals (rounding down could admit a labelled
    false hit)."""
    lines = ["# Written by `edgecache tune`: similarity thresholds per scenario and per tenant, loaded by",
             "# `edgecache serve --overlay FILE` on top of the profile.", ""]
    by_tenant: dict[str, list[Cut]] = {}
    for cut in cuts:
        if cut.cut is None:
            continue
        if cut.tenant != ALL:
            by_tenant.setdefault(cut.tenant, []).append(cut)
        elif pooled:
            lines += [_because(cut), f"[scenarios.{_toml_key(cut.scenario)}]", f"threshold = {_up(cut.cut)}", ""]
    for tenant, own in sorted(by_tenant.items()):
        lines.append(f"[tenant_thresholds.{msgspec.json.encode(tenant).decode()}]")
        for cut in own:
            lines += [_because(cut), f"{_toml_key(cut.scenario)} = {_up(cut.cut)}"]  # type: ignore[arg-type]
        lines.append("")
    return "\n".join(lines)


def _up(cut: float) -> str:
    return f"{math.ceil(cut * 10_000 - 1e-9) / 10_000:.4f}"


def _because(cut: Cut) -> str:
    return (f"# {cut.labels} labels, {cut.backing} at or above the cut, false hits <= {cut.false_hit_upper:.4f}, "
            f"hit rate {cut.hit_rate:.3f}")


def _toml_key(name: str) -> str:
    return name if name.replace("-", "").replace("_", "").isalnum() else msgspec.json.encode(name).decode()
