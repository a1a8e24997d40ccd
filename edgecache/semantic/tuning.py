"""`edgecache tune`: replay a decision log, join its labels to their decisions, and find per tenant and scenario the
lowest similarity cut that meets a false-hit target with a confidence bound.

For a cut ``c``, the labelled decisions whose candidate's similarity is at least ``c`` are the ones the cut would
have served; the bad labels among them are its false hits. The cut is accepted when the one-sided Wilson upper
bound of that false-hit rate (at ``confidence``, 95 % by default) is at most the target; the lowest accepted cut is
reported, with the hit rate it would have given (the share of all logged lookups of the group whose candidate is at
least that similar) and how many labels back it.

Labels from misses sit below the cut that was running (the refused candidates), so on such a log the estimate for
a lower cut is drawn from exactly the band it would add.

**Served decisions are not labelled** (a hit's answer went out; nothing computed a second answer to compare), so a
plain replay of the labels is biased wherever the running policy served: per served it sees only the candidates
that were refused or explored up there (the doubtful ones: too high a cut), per lookup it misses the hits' false
hits (too low a cut). The online learner leaves labels that stand for its hits: its audits (``explore``, reason
``audit``: a random share of its confident serves) and the candidates it refused only because its false-hit ledger
was spent (``refused``, reason ``learner:budget``), both labelled like every refusal. So every decision belongs to a
stratum, ``served`` (hits and those, :data:`SERVABLE`) or its own kind (``refused``, ``explore``, ``miss``), and a
label counts for ``decisions / labelled`` of its stratum (Horvitz-Thompson, missing at random within a stratum
assumed); the bound uses the weighted rate and Kish's effective number of labels (one bad audit standing for 40
hits is one observation, not 40). A stratum with no label at all (hits under the threshold rule, which neither
audits nor keeps a ledger) cannot be estimated: it is left out and its decisions at or above the cut are reported
as ``unlabelled``, so the bias is shown rather than hidden.

Pure functions over records, so the CLI and tests share them; :func:`overlay_toml` writes the per-scenario
``threshold`` overlay (and each tenant's own, ``tenant_thresholds``) that ``edgecache serve --overlay FILE`` loads on
top of the profile.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import msgspec

from edgecache.semantic import refusals
from edgecache.semantic.decision_log import DecisionRecord, LabelRecord, Record
from edgecache.semantic.false_hits import wilson_upper
from edgecache.semantic.learner import AUDIT, BUDGET
from edgecache.semantic.marks import FEEDBACK_LABELER

ALL = "*"


class Sample(msgspec.Struct, frozen=True):
    similarity: float
    good: bool
    weight: float = 1.0    # how many decisions of its stratum this label stands for


#: Decisions the running policy judged servable but did not serve, so their labels may stand for its hits: the
#: learner's audits (a random share of its confident serves) and the candidates it refused only because its
#: false-hit ledger was spent (``budget``: under the cut and not demoted, refused for the time they came, not for
#: themselves; a little riskier than the hits on the whole, since unsure candidates are among them and the ledger
#: turns away the costlier ones first, so the estimate errs high).
SERVABLE = {("explore", AUDIT), ("refused", refusals.by_learner(BUDGET))}


def stratum_of(record: DecisionRecord) -> str:
    """Which decisions a label may stand for: hits and the :data:`SERVABLE` decisions share the ``served`` stratum;
    any other decision stands for its own kind."""
    if record.decision == "hit" or (record.decision, record.reason) in SERVABLE:
        return "served"
    return record.decision


class Group(msgspec.Struct, kw_only=True):
    """One (tenant, scenario)'s lookups: how many, the similarities of their candidates, and the labelled ones."""

    tenant: str
    scenario: str
    lookups: int = 0
    similarities: list[float] = msgspec.field(default_factory=list)
    labelled: list[Sample] = msgspec.field(default_factory=list)
    unlabelled: list[float] = msgspec.field(default_factory=list)  # decisions in a stratum with no label at all


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
    effective: float = 0.0  # the labels' effective number (Kish) behind the bound: backing when unweighted
    unlabelled: int = 0    # decisions at or above the cut whose stratum has no label: not in the estimate


def join(records: Iterable[Record], *, tenant: str | None = None, scenario: str | None = None,
         pooled: bool = True, weigh: bool = True,
         unverified: Literal["bad", "skip"] = "bad") -> dict[tuple[str, str], Group]:
    """Decisions by (tenant, scenario) with their labels joined (a decision's last label wins). With ``pooled``,
    every scenario also gets a group over all the selected tenants, under tenant ``*``. Without ``weigh`` every
    label counts once and nothing is reported unlabelled (the plain replay, biased where the policy served)."""
    decisions: dict[str, DecisionRecord] = {}
    labels: dict[str, bool] = {}
    for record in records:
        if isinstance(record, DecisionRecord):
            if (tenant is None or record.tenant == tenant) and (scenario is None or record.scenario == scenario):
                decisions[record.id] = record
        elif isinstance(record, LabelRecord):
            if record.labeler == FEEDBACK_LABELER:
                continue  # a caller's mark: what it noticed, not a sample of its stratum (the weights would lie)
            if record.good is not None:
                labels[record.id] = record.good
            elif unverified == "bad":  # compared, and no labeler could tell: not evidence that it serves
                labels[record.id] = False
    # Per group and stratum: decisions with a candidate, and how many of them are labelled.
    counts: dict[tuple[str, str, str], list[int]] = {}
    names_of: dict[str, list[tuple[str, str]]] = {}
    for record in decisions.values():
        names_of[record.id] = [(record.tenant, record.scenario)] + ([(ALL, record.scenario)] if pooled else [])
        if record.similarity is None:
            continue
        for name in names_of[record.id]:
            count = counts.setdefault((*name, stratum_of(record)), [0, 0])
            count[0] += 1
            count[1] += record.id in labels
    groups: dict[tuple[str, str], Group] = {}
    for record in decisions.values():
        good = labels.get(record.id)
        for name in names_of[record.id]:
            group = groups.get(name)
            if group is None:
                group = groups[name] = Group(tenant=name[0], scenario=name[1])
            group.lookups += 1
            if record.similarity is None:
                continue
            group.similarities.append(record.similarity)
            decided, labelled = counts[(*name, stratum_of(record))]
            if good is not None:
                group.labelled.append(Sample(record.similarity, good, decided / labelled if weigh else 1.0))
            elif not labelled and weigh:
                group.unlabelled.append(record.similarity)
    return groups


def lowest_cut(group: Group, *, target: float, confidence: float = 0.95,
               per: Literal["served", "lookup"] = "served") -> Cut:
    """The lowest similarity cut whose false-hit bound among the decisions at or above it (``per`` served) or among
    all the group's lookups (``per`` lookup) is within ``target``, each label weighted for the decisions of its
    stratum it stands for (all 1 on a log whose every stratum is fully labelled: then per lookup is the bound of
    bad labels of all lookups, per served of bad labels of those at or above the cut)."""
    labelled = sorted(group.labelled, key=lambda s: -s.similarity)
    best: tuple[float, float, float, float, int] | None = None  # cut, weighted bad, weighted n, effective n, n
    bad = weight = squares = 0.0
    n = i = 0
    while i < len(labelled):
        value = labelled[i].similarity
        while i < len(labelled) and labelled[i].similarity == value:  # ties enter together
            sample = labelled[i]
            bad += sample.weight * (not sample.good)
            weight += sample.weight
            squares += sample.weight * sample.weight
            n += 1
            i += 1
        effective = weight * weight / squares  # Kish: n when every weight is equal
        if _upper(bad, weight, effective, group.lookups, per, confidence) <= target:
            best = (value, bad, weight, effective, n)
    if best is None:
        return Cut(tenant=group.tenant, scenario=group.scenario, lookups=group.lookups, labels=len(labelled),
                   cut=None)
    cut, bad, weight, effective, n = best
    served = sum(1 for s in group.similarities if s >= cut)
    return Cut(tenant=group.tenant, scenario=group.scenario, lookups=group.lookups, labels=len(labelled), cut=cut,
               false_hit_rate=bad / (weight if per == "served" else group.lookups),
               false_hit_upper=_upper(bad, weight, effective, group.lookups, per, confidence), backing=n,
               hit_rate=served / group.lookups if group.lookups else 0.0, effective=effective,
               unlabelled=sum(1 for s in group.unlabelled if s >= cut))


def _upper(bad: float, weight: float, effective: float, lookups: int, per: str, confidence: float) -> float:
    """The bound of the weighted false-hit rate: per served among the (weighted) decisions at or above the cut with
    ``effective`` labels behind it; per lookup of all lookups, the lookups shrunk by the same design effect."""
    if per == "served":
        return wilson_upper(bad / weight * effective, effective, confidence)
    scaled = lookups * effective / weight
    return wilson_upper(bad / lookups * scaled, scaled, confidence)


def tune(records: Iterable[Record], *, target: float = 0.01, confidence: float = 0.95, tenant: str | None = None,
         scenario: str | None = None, per: Literal["served", "lookup"] = "served", weigh: bool = True,
         unverified: Literal["bad", "skip"] = "bad") -> list[Cut]:
    """:func:`lowest_cut` for every group of :func:`join`, the pooled ``*`` groups first within a scenario."""
    groups = join(records, tenant=tenant, scenario=scenario, weigh=weigh, unverified=unverified)
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
