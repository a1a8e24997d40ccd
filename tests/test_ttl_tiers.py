"""TTL tiers: the classifier on a table of Chinese and English prompts, the date rules, choose()'s precedence,
custom term lists and the settings' validation."""

from __future__ import annotations

import datetime

import msgspec
import pytest

from edgecache.ttl_tiers import (
    DEFAULT_NEAR_REALTIME_TERMS,
    DEFAULT_REALTIME_TERMS,
    TermMatcher,
    Tier,
    TtlClassifier,
    TtlTierSettings,
)

TODAY = datetime.date(2026, 12, 2)  # the classifier's calendar is pinned: date rules must not depend on the run day


@pytest.fixture
def classifier() -> TtlClassifier:
    return TtlClassifier(TtlTierSettings(), today=lambda: TODAY)


# --- the prompt table --------------------------------------------------------------------------------------------

PROMPTS: list[tuple[str, Tier]] = [
    # Chinese: the present state of things.
    ("北京今天天气怎么样", "realtime"),
    ("现在几点了？", "realtime"),
    ("腾讯的股价是多少", "realtime"),
    ("美元兑人民币汇率", "realtime"),
    ("昨晚湖人队比分多少", "realtime"),
    ("上海此刻气温多少度", "realtime"),
    ("去机场的路况怎么样", "realtime"),
    ("最新的iPhone是哪一款", "realtime"),
    ("現在台北天氣如何", "realtime"),  # traditional characters
    # Chinese: recent events.
    ("最近有什么新闻", "near-realtime"),
    ("这周有什么好看的电影", "near-realtime"),
    ("今年的诺贝尔奖颁给了谁", "near-realtime"),
    ("微博热搜第一是什么", "near-realtime"),
    # Chinese: nothing dates.
    ("解释一下快速排序", "static"),
    ("把这句话翻译成英文：我爱你", "static"),
    ("写一首关于秋天的诗", "static"),
    ("法国大革命发生在1789年", "static"),
    # English: the present state of things.
    ("What's the AAPL stock price right now?", "realtime"),
    ("What is the weather in Paris today?", "realtime"),
    ("Latest score of the Lakers game", "realtime"),
    ("Is there traffic on the M25 at the moment?", "realtime"),
    ("How are TESLA STOCKS doing?", "realtime"),  # case and plural
    ("Gas prices near me", "realtime"),  # "price" matches "prices"
    ("What's today's top story?", "realtime"),
    ("Who is currently the UK prime minister?", "realtime"),
    ("Breaking: what happened at the summit", "realtime"),
    # English: recent events.
    ("What happened in tech this week?", "near-realtime"),
    ("Any news about the Mars mission?", "near-realtime"),
    ("What are the trending topics on Twitter?", "near-realtime"),
    ("Recent advances in battery chemistry", "near-realtime"),
    ("What's the status of my flight?", "near-realtime"),
    ("Who won the game yesterday?", "near-realtime"),
    # English: nothing dates, including the word-boundary traps.
    ("Explain how quicksort works", "static"),
    ("I know the answer, but explain it again", "static"),  # "now" in "know"
    ("Is olive oil healthy?", "static"),  # "live" in "olive"
    ("How do couriers deliver parcels?", "static"),  # "live" in "deliver"
    ("Where do penguins live?", "static"),  # bare "live" is a verb, not a default term
    ("Write a poem about snowy mornings", "static"),  # "now" in "snowy"
    ("Translate 'good morning' into French", "static"),
    ("What happened on July 4 1776?", "static"),  # a past date is history
    ("What happened on 4 July 1776?", "static"),
    ("Summarise the events of 1969-07-20", "static"),
    ("1998年12月2日发生了什么", "static"),
    ("Who won the World Cup in 2010?", "static"),
]


@pytest.mark.parametrize(("prompt", "expected"), PROMPTS)
def test_classify_prompt_table(classifier: TtlClassifier, prompt: str, expected: Tier) -> None:
    assert classifier.classify(prompt) == expected


def test_the_table_is_large_and_covers_every_tier_in_both_languages() -> None:
    assert len(PROMPTS) >= 30
    chinese = {tier for prompt, tier in PROMPTS if any("\u4e00" <= char <= "\u9fff" for char in prompt)}
    english = {tier for prompt, tier in PROMPTS if prompt.isascii()}
    assert chinese == english == {"realtime", "near-realtime", "static"}


# --- dates and clock times ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "expected"), [
    ("What's on 2026-12-02?", "realtime"),  # today
    ("Any events on 2026/12/03?", "realtime"),  # tomorrow: within a day (time zones)
    ("2026年12月2日有什么活动", "realtime"),
    ("12月1日有什么活动", "realtime"),  # no year: this year; yesterday
    ("Concerts on Dec 2", "realtime"),
    ("Concerts on the 2nd of December", "realtime"),
    ("Concerts on Dec 25", "near-realtime"),  # this year, not today
    ("Concerts on December 25th, 2027", "near-realtime"),  # the future
    ("12月25日有什么活动", "near-realtime"),
    ("Can we meet at 3pm?", "near-realtime"),
    ("Is the shop open at 15:30?", "near-realtime"),
    ("会议在下午3点开始吗", "near-realtime"),
    ("Best laptops of 2026", "near-realtime"),  # this year named alone
    ("Recap of Dec 3, 2025", "static"),  # last year
    ("Explain the 2008 financial crisis", "static"),
    ("Is 2026-02-30 a Monday?", "static"),  # no such date: no signal
    ("Ask the mayor 5 questions", "static"),  # "may" inside "mayor" is no month
    ("Give 3 examples of 25:99 ratios", "static"),  # no such clock time
])
def test_dates_and_times(classifier: TtlClassifier, prompt: str, expected: Tier) -> None:
    assert classifier.classify(prompt) == expected


def test_today_follows_the_injected_calendar() -> None:
    later = TtlClassifier(TtlTierSettings(), today=lambda: datetime.date(2027, 3, 1))
    assert later.classify("What's on 2026-12-02?") == "static"  # last year by then
    assert later.classify("What's on 2027-03-01?") == "realtime"


def test_a_term_beats_a_past_date(classifier: TtlClassifier) -> None:
    # Erring toward the shorter TTL costs hit rate; erring toward the longer one serves stale facts.
    assert classifier.classify("How does today's price compare with 2019?") == "realtime"


# --- term matching -----------------------------------------------------------------------------------------------


def test_english_terms_match_whole_words_with_plurals() -> None:
    matcher = TermMatcher(["live", "price", "right now"])
    for text in ("live", "live!", "watch it live.", "prices", "price's", "right   now", "(live)", "now live"):
        assert matcher.search(text), text
    for text in ("deliver", "olive", "alive", "lively", "priceless", "overpriced", "rightnow", "live2"):
        assert not matcher.search(text), text


def test_chinese_terms_match_substrings() -> None:
    matcher = TermMatcher(["天气"])
    assert matcher.search("北京今天天气怎么样")
    assert matcher.search("weather天气")
    assert not matcher.search("天 气")


def test_an_empty_term_list_matches_nothing() -> None:
    assert not TermMatcher([]).search("anything at all, now")


# --- settings and custom lists -----------------------------------------------------------------------------------


def test_defaults() -> None:
    settings = TtlTierSettings()
    assert (settings.realtime_s, settings.near_realtime_s, settings.static_s) == (30.0, 300.0, 86400.0)
    assert settings.realtime_terms == list(DEFAULT_REALTIME_TERMS)
    assert settings.near_realtime_terms == list(DEFAULT_NEAR_REALTIME_TERMS)
    assert {"今天", "现在", "股价", "天气", "now", "today", "price", "score"} <= set(settings.realtime_terms)
    assert {"最近", "新闻", "this week", "news"} <= set(settings.near_realtime_terms)


def test_custom_term_lists_replace_the_defaults() -> None:
    settings = msgspec.convert(
        {"realtime_terms": ["Queue Length", "排队"], "near_realtime_terms": ["menu"]}, TtlTierSettings)
    classifier = TtlClassifier(settings, today=lambda: TODAY)
    assert classifier.classify("What's the queue length at gate B?") == "realtime"  # case-insensitive phrase
    assert classifier.classify("食堂排队的人多吗") == "realtime"
    assert classifier.classify("What's on the menus?") == "near-realtime"
    assert classifier.classify("What's the weather today?") == "static"  # the defaults are gone


def test_custom_ttls_are_used(classifier: TtlClassifier) -> None:
    custom = TtlClassifier(msgspec.convert({"realtime_s": 2, "near_realtime_s": 7.5, "static_s": 60},
                                           TtlTierSettings))
    assert [custom.ttl_s(tier) for tier in ("realtime", "near-realtime", "static")] == [2.0, 7.5, 60.0]
    assert custom.choose(None, None, None, "stock price now") == ("realtime", 2.0)
    assert classifier.ttl_s("static") == 86400.0


@pytest.mark.parametrize("bad", [
    {"realtime_s": -1},
    {"near_realtime_s": 0},
    {"static_s": "a day"},
    {"realtime_terms": ["now", ""]},  # an empty term would match every prompt
    {"near_realtime_terms": ["   "]},
    {"realtime_terms": "now"},
    {"realtme_s": 30},  # unknown field: a typo must not pass silently
])
def test_invalid_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(bad, TtlTierSettings)


def test_every_setting_has_help_text() -> None:
    schema = msgspec.json.schema(TtlTierSettings)
    properties = schema["$defs"]["TtlTierSettings"]["properties"]
    assert set(properties) == {f.name for f in msgspec.structs.fields(TtlTierSettings)}
    for name, prop in properties.items():
        assert len(prop.get("description", "")) > 20, name


# --- choose(): precedence ----------------------------------------------------------------------------------------


def test_explicit_ttl_wins_over_everything(classifier: TtlClassifier) -> None:
    assert classifier.choose(12.5, "static", 600.0, "stock price now") == ("explicit", 12.5)


def test_explicit_tier_wins_over_scenario_and_classifier(classifier: TtlClassifier) -> None:
    assert classifier.choose(None, "static", 600.0, "stock price now") == ("static", 86400.0)
    assert classifier.choose(None, "realtime", None, "explain quicksort") == ("realtime", 30.0)


def test_scenario_default_wins_over_the_classifier(classifier: TtlClassifier) -> None:
    assert classifier.choose(None, None, 600.0, "stock price now") == ("explicit", 600.0)


def test_the_classifier_decides_last(classifier: TtlClassifier) -> None:
    assert classifier.choose(None, None, None, "北京今天天气怎么样") == ("realtime", 30.0)
    assert classifier.choose(None, None, None, "最近有什么新闻") == ("near-realtime", 300.0)
    assert classifier.choose(None, None, None, "解释一下快速排序") == ("static", 86400.0)


@pytest.mark.parametrize("ttl", [0, -5.0, float("nan"), float("inf")])
def test_bad_explicit_or_scenario_ttls_are_refused(classifier: TtlClassifier, ttl: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        classifier.choose(ttl, None, None, "hello")
    with pytest.raises(ValueError, match="positive"):
        classifier.choose(None, None, ttl, "hello")


def test_an_unknown_tier_is_refused(classifier: TtlClassifier) -> None:
    with pytest.raises(ValueError, match="unknown TTL tier"):
        classifier.choose(None, "forever", None, "hello")  # type: ignore[arg-type]
