"""TTL tiers: how long a cached answer may be served, picked per request.

Three tiers, with lengths from the profile:

==================  =========  ====================================================================
tier                default    what belongs there
==================  =========  ====================================================================
``realtime``        30 s       the present state of the world: prices, scores, weather, "right now"
``near-realtime``   5 min      things that change over hours or days: news, "this week", "recently"
``static``          24 h       everything else: explanations, code, history, definitions
==================  =========  ====================================================================

Precedence (:meth:`TtlClassifier.choose`): the caller's explicit ``edgecache.ttl`` wins, then the caller's explicit
tier, then the scenario's configured TTL, and only then the classifier over the prompt.

The classifier asks one question: *would the right answer to this prompt be different a few minutes from now?* An
answer goes stale when it reports a state of the world (a price, a score, the weather, traffic, what is open now)
or events (news, what happened this week); it does not go stale when it explains, computes, translates or recounts
the past. So the term lists name states and events and words that pin a question to the present, not topics.

Rules, in order; the first that fires decides:

1. A realtime term → ``realtime``.
2. A date that is today, give or take one day → ``realtime``. (One day of slack because the server's calendar and the
   user's can differ by a time zone; a question about tomorrow's or yesterday's date is fresh either way.)
3. A near-realtime term → ``near-realtime``.
4. Any other date or year that is not in the past (a date with no year, a date or bare year in this year or the
   next), or a clock time ("3pm", "15:30", "下午3点") → ``near-realtime``: it points at the near present, but we
   cannot tell that it means *now*.
5. Otherwise → ``static``. A date in a past year ("July 4 1776", "2019-03-01", "1998年") adds no freshness at all:
   a question about the past has a fixed answer.

Why terms beat a past date: a misclassification toward a shorter TTL costs hit rate, one toward a longer TTL serves
a stale fact. So "How does today's price compare with 2019?" is realtime, and so (at a small cost) is "What was the
AAPL stock price in 2019?". For the same reason topic words that misfire ("chicken stock", "credit score", "electric
current") are kept: they cost a shorter TTL, never a wrong answer. Bare "live" is not a default term (a verb far
more often than not: "Where do penguins live?"); the phrases "live score", "live stream", ... are.

Matching: English terms are case-insensitive and whole-word: a term must not be glued to another ASCII letter or
digit on either side ("now" does not match "know" or "nowadays", "live" not "deliver" or "olive"), with an optional
plural ``s``/``es`` ("price" matches "prices", "today" matches "todays"); spaces inside a phrase match any run of
whitespace. Chinese terms (any term whose end is not an ASCII letter or digit) match as substrings, since Chinese is
written without spaces. Dates recognised: ``2026-12-02`` (also ``/`` and ``.``), ``2026年12月2日``, ``12月2日``/``号``,
``Dec 2``, ``December 2nd, 2026``, ``2 Dec 2026``; a bare year 1000-2999. Not recognised, deliberately: numeric
``12/2`` (a fraction as often as a date) and Chinese-numeral dates and times (``三点``, ``十二月``).

Pass the text the user wrote (the user turns), not a system prompt: system prompts often carry "Today is
2026-12-02", which would make every request realtime.

Speed: each term list is compiled once, when the classifier is built, into a trie-shaped regex (two per tier, see
:class:`TermMatcher`); dates and clock times are a few more module-level regexes, tried only when the prompt has a
digit and no realtime term. Measured on this project's CPU box (Python 3.11.7, default lists, best of 5 x 5,000
calls): 1.0 us for "What's the AAPL stock price right now?", 2-3 us for short Chinese prompts, 8 us for a
75-character static English prompt, 15 us for a 54-character prompt with numbers in it (the date path); a
1,000-character prompt takes 58 us, or 93 us when full of numbers. The budget is 100 us for a typical prompt.
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Callable, Iterable
from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta

Tier = Literal["realtime", "near-realtime", "static"]
TIERS: tuple[Tier, ...] = get_args(Tier)


def _help(text: str) -> Meta:
    return Meta(description=text)


# A term: at least one non-space character (an empty term would match every prompt).
_Term = Annotated[str, Meta(pattern=r"\S")]

DEFAULT_REALTIME_TERMS: tuple[str, ...] = (
    # Chinese (simplified, with traditional variants where the characters differ).
    "今天", "今日", "今晚", "现在", "現在", "此刻", "此时", "此時", "目前", "当前", "當前", "刚刚", "剛剛",
    "实时", "實時", "即时", "即時", "最新", "直播",
    "股价", "股價", "股市", "汇率", "匯率", "金价", "金價", "油价", "油價", "币价", "幣價", "行情",
    "比分", "天气", "天氣", "气温", "氣溫", "路况", "路況", "几点了", "幾點了", "营业中", "營業中",
    # English.
    "right now", "now", "today", "tonight", "this morning", "this afternoon", "this evening", "this minute",
    "at the moment", "latest", "current", "currently", "breaking",
    "live score", "live stream", "livestream", "live coverage", "live update", "live result",
    "price", "stock", "exchange rate", "score", "weather", "forecast",
    "traffic", "what time is it",
)

DEFAULT_NEAR_REALTIME_TERMS: tuple[str, ...] = (
    # Chinese.
    "本周", "本週", "这周", "這週", "这个星期", "這個星期", "这几天", "這幾天", "本月", "这个月", "這個月",
    "最近", "近期", "近来", "近來", "今年", "昨天", "明天", "新闻", "新聞", "热搜", "熱搜", "热点", "熱點",
    "动态", "動態", "进展", "進展", "状态", "狀態", "排名", "排行榜",
    # English.
    "this week", "this weekend", "this month", "this year", "this season", "last week", "past week",
    "recent", "recently", "lately", "these days", "nowadays", "so far", "yesterday", "tomorrow", "upcoming",
    "news", "headline", "trending", "update", "status", "ranking", "standings",
)


class TtlTierSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    realtime_s: Annotated[float, Meta(gt=0), _help(
        "How long an answer about the present state of things (prices, scores, weather, 'right now') stays "
        "valid, in seconds.")] = 30.0
    near_realtime_s: Annotated[float, Meta(gt=0), _help(
        "How long an answer about recent events (news, 'this week', 'recently') stays valid, in seconds.")] \
        = 300.0
    static_s: Annotated[float, Meta(gt=0), _help(
        "How long an answer that does not date (explanations, code, history) stays valid, in seconds.")] \
        = 86400.0
    realtime_terms: Annotated[list[_Term], _help(
        "Words and phrases that put a prompt in the realtime tier when no explicit TTL, tier or scenario TTL "
        "applies. English terms match whole words, case-insensitively, plurals included; Chinese terms match as "
        "substrings.")] = msgspec.field(default_factory=lambda: list(DEFAULT_REALTIME_TERMS))
    near_realtime_terms: Annotated[list[_Term], _help(
        "Words and phrases that put a prompt in the near-realtime tier (when no realtime term or today's date "
        "is in it); matched like realtime_terms.")] = msgspec.field(
        default_factory=lambda: list(DEFAULT_NEAR_REALTIME_TERMS))


_WORD_START = r"(?<![a-z0-9])"
_WORD_END = r"(?:e?s)?(?![a-z0-9])"  # an optional plural, then no letter or digit glued on


def _is_ascii_alnum(char: str) -> bool:
    return char.isascii() and char.isalnum()


class TermMatcher:
    """A tier's term list compiled for :meth:`search` over lower-cased text.

    The terms become a trie-shaped regex (``n(?:ow|ews)`` rather than ``now|news``), so the engine follows one branch
    per character instead of trying every term at every position. Terms that start with an ASCII letter or digit go
    into one regex that must start at a word start, the rest (Chinese) into a second one. Why two: one alternation of
    both measured 3-4 times slower than the two searches together (sre cannot skip ahead on a pattern whose branches
    start differently), 4.4 us against 1.4 us on a 75-character prompt.
    """

    def __init__(self, terms: Iterable[str]) -> None:
        normalised = {" ".join(term.lower().split()) for term in terms} - {""}
        words = {term for term in normalised if _is_ascii_alnum(term[0])}
        self._patterns = tuple(
            re.compile(prefix + _trie_regex(group))
            for prefix, group in ((_WORD_START, words), ("", normalised - words)) if group)

    def search(self, lowered: str) -> bool:
        return any(pattern.search(lowered) for pattern in self._patterns)


def _trie_regex(terms: Iterable[str]) -> str:
    trie: dict[str, dict] = {}
    for term in terms:
        node = trie
        for char in term:
            node = node.setdefault(char, {})
        node[""] = {}  # a term ends here
    return _emit(trie, "")


def _emit(node: dict[str, dict], previous: str) -> str:
    branches = []
    for char in sorted(node):
        if char:
            piece = r"\s+" if char == " " else re.escape(char)
            branches.append(piece + _emit(node[char], char))
    if "" in node:
        if not _is_ascii_alnum(previous):
            return ""  # a substring term ended: any longer term through this node adds nothing to a search
        branches.append(_WORD_END)
    return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"


_MONTHS = {
    "january": 1, "jan": 1, "february": 2, "feb": 2, "march": 3, "mar": 3, "april": 4, "apr": 4, "may": 5,
    "june": 6, "jun": 6, "july": 7, "jul": 7, "august": 8, "aug": 8, "september": 9, "sept": 9, "sep": 9,
    "october": 10, "oct": 10, "november": 11, "nov": 11, "december": 12, "dec": 12,
}
_MONTH = _trie_regex(_MONTHS).replace(_WORD_END, "")  # a bare trie; the patterns below bound it themselves
_ORDINAL = r"(?:st|nd|rd|th)?"

# Dates, each form its own regex with groups y (optional), m or mn (month number or name) and d. Each pattern starts
# with a character (class), and the "not glued to a digit" checks come right after that first character rather
# than before it, because then sre can jump from one candidate character to the next instead of trying the whole
# pattern at every position. Separate patterns rather than one alternation for the same reason (TermMatcher):
# a 54-character prompt with digits took 18 us with the lookbehinds first, 3 us like this.
_DATES = (
    # 2026-12-02, 2026/12/02, 2026.12.02
    re.compile(r"(?P<y>[12](?<!\d[12])\d{3})([-/.])(?P<m>\d{1,2})\2(?P<d>\d{1,2})(?!\d)"),
    # 12月2日, 12月2号; a year in front (2026年12月2日) is read by _ZH_YEAR_BEFORE
    re.compile(r"(?P<m>\d(?<!\d\d)\d?)\s*月\s*(?P<d>\d{1,2})\s*[日号號](?P<y>)"),
    # Dec 2, December 2nd, 2026 (the check that no letter precedes the month is in code: _starts_word)
    re.compile(rf"(?P<mn>{_MONTH})\.?\s+(?P<d>\d{{1,2}}){_ORDINAL}(?:,?\s+(?P<y>[12]\d{{3}}))?(?![\d:])"),
    # 2 Dec 2026, 2nd of December
    re.compile(rf"(?P<d>\d(?<!\d\d)\d?){_ORDINAL}\s+(?:of\s+)?(?P<mn>{_MONTH})(?![a-z])\.?"
               r"(?:,?\s+(?P<y>[12]\d{3}))?(?!\d)"),
)
_ZH_YEAR_BEFORE = re.compile(r"(?<!\d)([12]\d{3})\s*年\s*$")
_CLOCK = re.compile(
    r"(?P<h>\d(?<![\d:]\d)\d?)"
    r"(?::[0-5]\d(?::[0-5]\d)?(?![\d:])"  # 15:30, 9:05:10
    r"|(?::[0-5]\d)?\s*[ap]\.?m\b"  # 3pm, 10:30 a.m.
    r"|\s*[点點]\s*(?:\d{1,2}\s*分|半|钟|鐘))")  # 3点半, 3点15分
_ZH_CLOCK = re.compile(r"(?:上午|下午|晚上|早上|凌晨|中午|傍晚)\s*\d{1,2}\s*[点點时時]")  # 下午3点
_BARE_YEAR = re.compile(r"[12](?<![\d.:/-][12])\d{3}(?![\d.:/-])")  # 2026, 1998年
_HAS_DIGIT = re.compile(r"\d")


class TtlClassifier:
    """Picks a request's TTL tier: explicit choices first, then the scenario, then the prompt's words and dates."""

    def __init__(self, settings: TtlTierSettings, *,
                 today: Callable[[], datetime.date] = datetime.date.today) -> None:
        self.settings = settings
        self._ttl: dict[str, float] = {
            "realtime": settings.realtime_s,
            "near-realtime": settings.near_realtime_s,
            "static": settings.static_s,
        }
        self._realtime = TermMatcher(settings.realtime_terms)
        self._near_realtime = TermMatcher(settings.near_realtime_terms)
        self._today = today  # injectable so tests can pin the calendar

    def ttl_s(self, tier: Tier) -> float:
        try:
            return self._ttl[tier]
        except KeyError:
            raise ValueError(f"unknown TTL tier {tier!r}; expected one of {', '.join(TIERS)}") from None

    def classify(self, text: str) -> Tier:
        lowered = text.lower()
        if self._realtime.search(lowered):
            return "realtime"
        dated = self._date_signal(lowered) if _HAS_DIGIT.search(lowered) else None
        if dated == "realtime":
            return "realtime"
        if self._near_realtime.search(lowered):
            return "near-realtime"
        return dated or "static"

    def choose(self, explicit_ttl_s: float | None, explicit_tier: Tier | None, scenario_default_s: float | None,
               text: str) -> tuple[Tier | Literal["explicit"], float]:
        """The tier label and TTL for one request.

        The caller's explicit TTL wins (label ``"explicit"``), then the caller's explicit tier, then the scenario's
        configured TTL (also labelled ``"explicit"``: a fixed length, not a tier), then :meth:`classify`. Pass the
        scenario's own ``ttl_s`` (None when unset), not a value that already fell back to the store's default, or
        the classifier never runs.
        """
        if explicit_ttl_s is not None:
            return "explicit", _positive("the explicit TTL", explicit_ttl_s)
        if explicit_tier is not None:
            return explicit_tier, self.ttl_s(explicit_tier)
        if scenario_default_s is not None:
            return "explicit", _positive("the scenario's TTL", scenario_default_s)
        tier = self.classify(text)
        return tier, self._ttl[tier]

    def _date_signal(self, lowered: str) -> Tier | None:
        """``realtime`` for a date within a day of today; ``near-realtime`` for another date that is not in a past
        year, for this year or next named alone, or for a clock time; None otherwise (only past dates, or none)."""
        today = self._today()
        signal: Tier | None = None
        for pattern in _DATES:
            for match in pattern.finditer(lowered):
                if "mn" in pattern.groupindex:
                    if not _starts_word(lowered, match.start()):
                        continue  # "xdec 2"
                    month = _MONTHS[match["mn"]]
                else:
                    month = int(match["m"])
                year_text = match["y"]
                if year_text == "":  # the Chinese form: look for a year just before it
                    before = _ZH_YEAR_BEFORE.search(lowered, max(0, match.start() - 8), match.start())
                    year_text = before[1] if before else None
                year = int(year_text) if year_text else today.year
                if year < today.year:
                    continue  # history: a fixed answer
                try:
                    date = datetime.date(year, month, int(match["d"]))
                except ValueError:
                    continue  # not a real date (Feb 30, month 13): no signal
                if abs((date - today).days) <= 1:
                    return "realtime"
                signal = "near-realtime"
        if signal is not None or _ZH_CLOCK.search(lowered):
            return "near-realtime"
        if any(int(match["h"]) <= 23 for match in _CLOCK.finditer(lowered)):
            return "near-realtime"
        if any(today.year <= int(match[0]) <= today.year + 1 for match in _BARE_YEAR.finditer(lowered)):
            return "near-realtime"
        return None


def _starts_word(text: str, index: int) -> bool:
    return index == 0 or not _is_ascii_alnum(text[index - 1])


def _positive(what: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive number of seconds, not {value!r}")
    return value
