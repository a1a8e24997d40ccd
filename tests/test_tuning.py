"""`edgecache tune`: the bound, a known cut recovered from a synthetic log, and the overlay it writes changing what
the server does (the real embedder and index in-process, a fake engine)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from edgecache.http.app import create_app
from edgecache.cli.main import app as cli
from edgecache.semantic.decision_log import DecisionLog, DecisionRecord, read_records
from edgecache.settings import SettingsError, resolve_settings
from edgecache.semantic.false_hits import wilson_upper
from edgecache.semantic.tuning import Group, Sample, lowest_cut, overlay_toml, tune
from tests.conftest import chat_body, serve_in_process
from tests.fakes import FakeEngine
from tests.test_decision_log import settled

runner = CliRunner()


def test_the_wilson_bound() -> None:
    assert wilson_upper(0, 0) == 1.0
    assert wilson_upper(5, 100, confidence=0) == 0.05
    assert 2.5 / 1000 < wilson_upper(0, 1000) < 3.0 / 1000  # about z^2 / n with no bad label
    assert wilson_upper(10, 1000) > 0.01 > wilson_upper(2, 1000)
    assert wilson_upper(3, 200) < wilson_upper(4, 200)


def synthetic_log(directory: Path, *, cut: float, n: int = 4000, seed: int = 7, noise: float = 0.0,
                  tenants: tuple[str, ...] = ("acme",), scenario: str = "support", labelled: float = 1.0) -> None:
    """Lookups with similarities uniform in [cut - 0.3, 1): a candidate below ``cut`` serves wrongly, one above
    rightly (each label flipped with probability ``noise`` below the cut only, so the cut stays the truth)."""
    rng = random.Random(seed)
    log = DecisionLog(directory, max_bytes=64 << 20, flush_interval_s=0.05)
    for i in range(n):
        similarity = rng.uniform(cut - 0.3, 1.0)
        decision_id = log.decided(tenants[i % len(tenants)], scenario, f"q{i}", "refused", reason="below_cut",
                                  store_key=f"s{i}", vector_key=i, similarity=similarity)
        if rng.random() < labelled:
            good = similarity >= cut or rng.random() < noise
            log.labelled(decision_id, good, "equality")
    log.close()


@pytest.mark.parametrize(("cut", "noise"), [(0.80, 0.0), (0.87, 0.3), (0.72, 0.1)])
def test_tune_recovers_a_known_cut_within_a_hundredth(tmp_path: Path, cut: float, noise: float) -> None:
    synthetic_log(tmp_path, cut=cut, noise=noise, tenants=("acme", "globex"))
    found = {(c.tenant, c.scenario): c for c in tune(read_records(tmp_path), target=0.01)}
    for tenant in ("*", "acme", "globex"):
        result = found[(tenant, "support")]
        assert result.cut is not None and abs(result.cut - cut) <= 0.01, (tenant, result)
        assert result.false_hit_upper is not None and result.false_hit_upper <= 0.01
        assert result.backing > 0 and 0 < result.hit_rate < 1  # type: ignore[operator]
    # The pooled group holds both tenants' lookups.
    assert found[("*", "support")].lookups == 4000 == found[("acme", "support")].lookups * 2


def test_per_lookup_matches_the_hindsight_oracle_on_a_fully_labelled_log(tmp_path: Path) -> None:
    """False hits as a share of all lookups: the lowest cut whose wrong serves stay within 1 % of the lookups. The
    oracle here is computed directly from the log's truth (every lookup labelled), with hindsight."""
    synthetic_log(tmp_path, cut=0.85, noise=0.2, n=5000)
    records = list(read_records(tmp_path))
    decisions = {r.id: r for r in records if isinstance(r, DecisionRecord)}
    truth = sorted(((decisions[r.id].similarity, r.good) for r in records if not isinstance(r, DecisionRecord)),
                   reverse=True)
    bad, oracle = 0, None
    for similarity, good in truth:
        bad += not good
        if bad / len(truth) <= 0.01:
            oracle = similarity
    found = tune(records, target=0.01, confidence=0, per="lookup")[0]
    assert found.cut is not None and oracle is not None and abs(found.cut - oracle) <= 0.01
    assert found.cut < 0.85  # 1 % of lookups allows wrong serves below the true cut
    bounded = tune(records, target=0.01, per="lookup")[0]
    assert bounded.cut is not None and found.cut <= bounded.cut <= found.cut + 0.02


def test_too_few_labels_give_no_cut_and_no_overlay_line(tmp_path: Path) -> None:
    group = Group(tenant="*", scenario="code", lookups=50, similarities=[0.99] * 50,
                  labelled=[Sample(0.99, True)] * 50)
    result = lowest_cut(group, target=0.01)
    assert result.cut is None  # 50 good labels cannot show <= 1 % at 95 %
    assert "[scenarios.code]" not in overlay_toml([result])


def test_the_tune_command_prints_and_writes_an_overlay(tmp_path: Path) -> None:
    logs = tmp_path / "decisions"
    synthetic_log(logs, cut=0.8)
    overlay = tmp_path / "cuts.toml"
    result = runner.invoke(cli, ["tune", str(logs), "--target-error", "0.01", "--write", str(overlay)])
    assert result.exit_code == 0, result.output
    assert "support" in result.output and "tenant * pools" in result.output and "wrote 1 scenario thresholds and 1 tenant" in result.output
    settings = resolve_settings("cpu", {"data_dir": str(tmp_path / "data")}, environ={}, overlays=[overlay])
    assert abs(settings.scenarios["support"].threshold - 0.8) <= 0.01  # type: ignore[operator]
    assert settings.scenarios["support"].ttl_s == resolve_settings("cpu", environ={}).scenarios["support"].ttl_s
    shown = runner.invoke(cli, ["profiles", "show", "cpu", "--json", "--overlay", str(overlay)])
    assert json.loads(shown.output)["settings"]["scenarios"]["support"]["threshold"] == \
        settings.scenarios["support"].threshold
    # Another tenant or scenario than the log holds: nothing to tune, and an empty path is a clean error.
    assert runner.invoke(cli, ["tune", str(logs), "--scenario", "code"]).exit_code == 0
    missing = runner.invoke(cli, ["tune", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "no decision log" in missing.output
    bad = runner.invoke(cli, ["serve", "--profile", "cpu", "--overlay", str(tmp_path / "none.toml"),
                              "--data-dir", str(tmp_path / "d")])
    assert bad.exit_code == 2 and "overlay file not found" in bad.output


STORED = "How do I reset my password?"
ASKED = "I forgot my password, what should I do now?"


async def ask_pair(settings: Any, keys: tuple[str, ...] = ("",)) -> list[tuple[str, DecisionRecord]]:
    """For each API key: store STORED, ask ASKED; what served it, and the decision the log holds for it."""
    out = []
    async with serve_in_process(create_app(settings, engine=FakeEngine())) as c:
        for key in keys:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            stored = await c.post("/v1/chat/completions", json=chat_body(STORED), headers=headers)
            assert stored.headers["x-edgecache"] == "miss"
            await settled(c)
            resp = await c.post("/v1/chat/completions", json=chat_body(ASKED), headers=headers)
            await settled(c)
            out.append(resp.headers["x-edgecache"])
    decisions = [r for r in read_records(Path(settings.data_dir) / "decisions") if isinstance(r, DecisionRecord)]
    asked = [d for d in decisions if d.store_key]  # the paraphrase's lookups (the stored prompt's had no candidate)
    return list(zip(out, asked))


async def test_the_overlay_tune_writes_turns_a_miss_into_a_hit(tmp_path: Path) -> None:
    # Tune's overlay sets cosine thresholds: the threshold rule's cut (an explicit opt-in).
    rule = {"semantic.enabled": True, "semantic.decision": "threshold"}
    before = resolve_settings("cpu", {"data_dir": str(tmp_path / "before"), **rule}, environ={})
    [(served, decision)] = await ask_pair(before)
    assert served == "miss" and decision.decision == "refused" and decision.reason == "below_threshold"
    similarity = decision.similarity  # below the embedder's calibrated cut for `default` (it missed)
    assert similarity is not None and similarity > 0.6
    # A log whose labels say candidates from (similarity - 0.03) up serve right: tune lowers the default cut.
    logs = tmp_path / "decisions"
    synthetic_log(logs, cut=similarity - 0.03, scenario="default")
    overlay = tmp_path / "cuts.toml"
    assert runner.invoke(cli, ["tune", str(logs), "--write", str(overlay)]).exit_code == 0
    after = resolve_settings("cpu", {"data_dir": str(tmp_path / "after"), **rule}, environ={},
                             overlays=[overlay])
    assert after.scenarios["default"].threshold is not None and after.scenarios["default"].threshold < similarity
    [(served, decision)] = await ask_pair(after)
    assert served == "semantic" and decision.decision == "hit"
    # A tenant's own cut: tuned on acme's decisions only, it changes acme's lookups and no one else's.
    acme_logs = tmp_path / "acme-decisions"
    synthetic_log(acme_logs, cut=similarity - 0.03, scenario="default", tenants=("acme",))
    acme_overlay = tmp_path / "acme.toml"
    result = runner.invoke(cli, ["tune", str(acme_logs), "--tenant", "acme", "--write", str(acme_overlay)])
    assert result.exit_code == 0 and "wrote 0 scenario thresholds and 1 tenant" in result.output, result.output
    assert "[scenarios" not in acme_overlay.read_text()
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[plans.basic]\n[[tenants]]\nid = "acme"\nplan = "basic"\nkeys = ["sk-acme-0001"]\n'
                       '[[tenants]]\nid = "globex"\nplan = "basic"\nkeys = ["sk-globex-001"]\n')
    per_tenant = resolve_settings("cpu", {"data_dir": str(tmp_path / "per-tenant"), **rule,
                                          "tenants_file": str(tenants)}, environ={}, overlays=[acme_overlay])
    assert per_tenant.scenarios["default"].threshold is None and per_tenant.tenant_thresholds["acme"]["default"] < \
        similarity
    (acme, acme_decision), (globex, _) = await ask_pair(per_tenant, ("sk-acme-0001", "sk-globex-001"))
    assert (acme, globex) == ("semantic", "miss") and acme_decision.tenant == "acme"


def test_a_tenant_threshold_for_an_unknown_scenario_is_refused(tmp_path: Path) -> None:
    overlay = tmp_path / "bad.toml"
    overlay.write_text('[tenant_thresholds."acme"]\nnope = 0.8\n')
    with pytest.raises(SettingsError, match="unknown scenarios: nope"):
        resolve_settings("cpu", {"data_dir": str(tmp_path)}, environ={}, overlays=[overlay])


def audited_log(directory: Path, *, n: int = 20000, seed: int = 0, serve_from: float = 0.85,
                audit: float = 0.5) -> list[tuple[float, bool]]:
    """A policy's log: at or above ``serve_from`` a lookup is served (a ``hit``, never labelled) except a random
    ``audit`` share, explored and labelled; below it refused and labelled. Wrong with probability 0.10 below 0.85,
    0.02 above (so the hits carry false hits a plain replay never sees). Returns every lookup's truth."""
    rng = random.Random(seed)
    log = DecisionLog(directory, max_bytes=64 << 20, flush_interval_s=0.05)
    truth = []
    for i in range(n):
        similarity = rng.uniform(0.5, 1.0)
        good = rng.random() >= (0.10 if similarity < 0.85 else 0.02)
        truth.append((similarity, good))
        if similarity >= serve_from and rng.random() >= audit:
            log.decided("acme", "support", f"q{i}", "hit", reason="confident", store_key=f"s{i}",
                        similarity=similarity)
            continue
        kind, reason = ("explore", "audit") if similarity >= serve_from else ("refused", "above_cut")
        decision_id = log.decided("acme", "support", f"q{i}", kind, reason=reason, store_key=f"s{i}",
                                  similarity=similarity)
        log.labelled(decision_id, good, "truth")
    log.close()
    return truth


@pytest.mark.parametrize("seed", [0, 1])
def test_audits_stand_for_the_unlabelled_hits(tmp_path: Path, seed: int) -> None:
    truth = sorted(audited_log(tmp_path, seed=seed), reverse=True)
    bad, oracle = 0, None
    for similarity, good in truth:  # the hindsight cut with every lookup's truth, per lookup
        bad += not good
        if bad <= 0.01 * len(truth):
            oracle = similarity
    assert oracle is not None
    records = list(read_records(tmp_path))
    weighed = tune(records, target=0.01, confidence=0, per="lookup")[0]
    plain = tune(records, target=0.01, confidence=0, per="lookup", weigh=False)[0]
    assert weighed.cut is not None and abs(weighed.cut - oracle) <= 0.01, (weighed, oracle)
    # Counting only the labels misses the hits' false hits: the cut comes out too low.
    assert plain.cut is not None and plain.cut < oracle - 0.008, (plain, oracle)
    # Half the hits' stratum labelled: each audit stands for two, and the bound sees fewer effective labels.
    assert weighed.effective < weighed.backing and weighed.unlabelled == 0
    bounded = tune(records, target=0.01, per="lookup")[0]
    assert bounded.cut is not None and weighed.cut <= bounded.cut


def test_hits_with_no_audit_are_reported_unlabelled(tmp_path: Path) -> None:
    audited_log(tmp_path, n=3000, audit=0.0)
    found = tune(read_records(tmp_path), target=0.05, confidence=0)[0]
    assert found.cut is not None and found.unlabelled > 0  # left out of the estimate, and said so
    result = runner.invoke(cli, ["tune", str(tmp_path), "--target-error", "0.05", "--confidence", "0"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "no label in their stratum" in result.output


def test_the_learners_budget_refusals_stand_for_its_hits(tmp_path: Path) -> None:
    """A candidate the learner refused only because its ledger was spent is labelled and was servable: it shares
    the hits' stratum, as an audit does; a refusal above the learner's cut does not."""
    log = DecisionLog(tmp_path, max_bytes=1 << 20, flush_interval_s=0.05)
    for i in range(30):
        log.decided("acme", "support", f"h{i}", "hit", store_key="s", similarity=0.95)
    for i, (kind, reason, good) in enumerate([("refused", "learner:budget", False), ("refused", "learner:budget", True),
                                              ("refused", "learner:above_cut", False)]):
        log.labelled(log.decided("acme", "support", f"r{i}", kind, reason=reason, store_key="s", similarity=0.95),
                     good, "truth")
    log.close()
    found = tune(read_records(tmp_path), target=0.6, confidence=0, per="lookup")[0]
    # 32 servable decisions, half of their two labels bad: 16 estimated false hits, and the refusal above the cut's.
    assert found.cut == 0.95 and found.unlabelled == 0
    assert found.false_hit_rate is not None and abs(found.false_hit_rate - 17 / 33) < 1e-9


def test_unverified_labels_count_as_bad_unless_told_to_skip_them(tmp_path: Path) -> None:
    # Right above 0.80, wrong below; but between 0.80 and 0.90 the labelers could not tell (good: null).
    rng = random.Random(3)
    log = DecisionLog(tmp_path, max_bytes=64 << 20, flush_interval_s=0.05)
    for i in range(4000):
        similarity = rng.uniform(0.5, 1.0)
        decision_id = log.decided("acme", "support", f"q{i}", "refused", reason="below_cut", store_key=f"s{i}",
                                  vector_key=i, similarity=similarity)
        log.labelled(decision_id, None if 0.80 <= similarity < 0.90 else similarity >= 0.80, "equality")
    log.close()
    strict = {c.tenant: c for c in tune(read_records(tmp_path), target=0.01)}["acme"]
    skipped = {c.tenant: c for c in tune(read_records(tmp_path), target=0.01, unverified="skip")}["acme"]
    assert strict.cut is not None and strict.cut > 0.89  # only verified labels back a cut (a few bad ones fit the bound)
    assert skipped.cut is not None and abs(skipped.cut - 0.80) <= 0.01  # as if missing at random
    result = runner.invoke(cli, ["tune", str(tmp_path), "--unverified", "maybe"])
    assert result.exit_code == 2 and "--unverified" in result.output
