"""Refuse a semantic-cache candidate whose prompt differs from the query in what the answer depends on.

An embedding puts "北京今天多少度" and "上海今天多少度", or "狗咬了人" and "人咬了狗", close together; serving one's
answer for the other is a confident wrong answer. :func:`check` compares the two prompts with cheap lexical rules
(regexes and small word lists, tens of microseconds, no model), Chinese and English:

- ``numbers``   amounts, dates, versions, Chinese numerals with a measure word
- ``entities``  capitalised / Latin names, and a small gazetteer of Chinese places
- ``negation``  not / never / n't / 不 / 没 / 别 / 未 / 非 ... (polarity parity)
- ``antonyms``  上/下, 前/后, before/after, buy/sell ... (one side has one term, the other side the other)
- ``order``     the same content tokens where two of them trade places (who does what to whom)
- ``code``      identifiers, operators and literals of code in the prompt

Which rules run by default is data (:data:`DEFAULT_RULES`), chosen from the per-rule measurements in
docs/calibration.md, "The guard": a rule stays only where it removes more false hits than true hits at the calibrated
thresholds.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Callable, Sequence

import msgspec


class GuardVerdict(msgspec.Struct, frozen=True):
    allowed: bool
    #: The first rule that refused, e.g. "numbers: 2023 vs 2024"; None when allowed.
    reason: str | None = None


_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_'\-]*|\d+(?:[.,:/\-]\d+)*|[\u3400-\u9fff]|[^\s\w]", re.UNICODE)

# ---- numbers ----
_DIGITS = re.compile(r"\d+(?:[.,:/\-]\d+)*")
_ZH_NUMERAL = "零〇一二两三四五六七八九十百千万亿"
# A Chinese numeral counts only with a measure word / date unit after it (or 第 before it): 一 alone is in
# 一起 / 一样 / 一下, which say nothing about quantity.
_ZH_NUMBER = re.compile(
    rf"第[{_ZH_NUMERAL}]+|[{_ZH_NUMERAL}]+(?=[个年月日号天次元块岁点分秒米里斤位名本张台件倍周期层楼届级成折%％])"
)
_EN_NUMBER_WORDS = (
    # "one", "first", "second", "once" are left out: far more often pronoun / adverb than a quantity.
    "zero two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand million billion "
    "third fourth fifth sixth seventh eighth ninth tenth"
).split()
_EN_NUMBER = re.compile(r"\b(?:" + "|".join(_EN_NUMBER_WORDS) + r")\b", re.IGNORECASE)


def _numbers(text: str) -> Counter[str]:
    found = [m.replace(",", "") for m in _DIGITS.findall(text)]
    found += _ZH_NUMBER.findall(text)
    found += [w.lower() for w in _EN_NUMBER.findall(text)]
    return Counter(found)


def numbers_rule(query: str, cached: str) -> str | None:
    a, b = _numbers(query), _numbers(cached)
    # A substitution (3.11 vs 3.12), not an omission: paraphrases often spell out or drop a count ("two-step").
    if (a - b) and (b - a):
        return f"numbers: {sorted(a.elements())} vs {sorted(b.elements())}"
    return None


# ---- named entities ----
_CAPITALISED = re.compile(r"\b[A-Z][A-Za-z0-9]*(?:[-'][A-Za-z0-9]+)*")
_SENTENCE_START = re.compile(r"(?:^|[.!?:;\"(]\s*)$")
_LATIN_WORD = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_HAS_CJK = re.compile(r"[\u3400-\u9fff]")
# Words capitalised for grammar or habit, not because they name something.
_NOT_NAMES = frozenset(
    "i i'm i've i'd i'll a an the my your our their his her its it this that these those what which who whom whose "
    "when where why how is are was were do does did can could would should will shall may might must please hi hello "
    "hey thanks thank ok okay yes no not if and or but so also then there here is am be".split()
)
# Chinese places are the entity a short question most often turns on (weather, prices, travel); a gazetteer is
# the only cheap detector for Chinese names without a segmenter.
_ZH_PLACES = tuple(
    "北京 上海 天津 重庆 广州 深圳 杭州 南京 苏州 武汉 成都 西安 长沙 郑州 沈阳 大连 青岛 济南 厦门 福州 合肥 昆明 "
    "贵阳 南宁 海口 三亚 南昌 太原 石家庄 哈尔滨 长春 呼和浩特 兰州 西宁 银川 乌鲁木齐 拉萨 香港 澳门 台北 宁波 无锡 "
    "东莞 佛山 珠海 温州 广东 广西 浙江 江苏 山东 山西 河南 河北 湖南 湖北 四川 云南 贵州 福建 江西 安徽 辽宁 吉林 "
    "黑龙江 陕西 甘肃 青海 海南 台湾 新疆 西藏 内蒙古 宁夏 中国 美国 英国 法国 德国 日本 韩国 俄罗斯 印度 加拿大 "
    "澳大利亚 新加坡 意大利 西班牙 巴西 东京 纽约 伦敦 巴黎 首尔".split()
)


def _entities(text: str) -> set[str]:
    if _HAS_CJK.search(text):
        # In Chinese text every Latin word is a name, a product or a code (iPhone, Tabaci, GPT).
        names = {w.lower() for w in _LATIN_WORD.findall(text)}
        return names | {p for p in _ZH_PLACES if p in text}
    text = text.strip()
    return {
        m.group().lower()
        for m in _CAPITALISED.finditer(text)
        # A capital after a sentence start is grammar; inside a sentence (or all-caps, "GPU") it names something.
        if m.group().lower() not in _NOT_NAMES
        and (not _SENTENCE_START.search(text[max(0, m.start() - 3) : m.start()]) or m.group().isupper())
    }


def entities_rule(query: str, cached: str) -> str | None:
    a, b = _entities(query), _entities(cached)
    # Substitution only (Paris vs London): "ATM" vs "cash machine" drops a name without naming another.
    if (a - b) and (b - a):
        return f"entities: {sorted(a - b)} vs {sorted(b - a)}"
    return None


# ---- negation / polarity ----
_EN_NEGATION = re.compile(
    r"\b(?:not|no|never|none|nobody|nothing|neither|nor|without|cannot|unable)\b|n't\b", re.IGNORECASE
)
# Fixed words that contain a negation character without negating anything (非常 = very, 不过 = but, 无论 = whatever).
_ZH_NOT_NEGATION = re.compile(r"非常|不过|不仅|不断|不少|不久|不管|无论|并非|是否|能否|可否|否则|除非|未来|毫无疑问|差不多")
_ZH_NEGATION = re.compile(r"没有|不|没|别|未|非|无|勿|莫|甭")


def _negations(text: str) -> int:
    return len(_EN_NEGATION.findall(text)) + len(_ZH_NEGATION.findall(_ZH_NOT_NEGATION.sub("", text)))


_NEGATORS = re.compile(_EN_NEGATION.pattern + "|" + _ZH_NEGATION.pattern, re.IGNORECASE)


def _overlap(query: str, cached: str) -> float:
    """Jaccard overlap of the content units of two texts."""
    a, b = set(units(query)), set(units(cached))
    return len(a & b) / max(len(a | b), 1)


def negation_rule(query: str, cached: str) -> str | None:
    a, b = _negations(query), _negations(cached)
    # Only when the rest is nearly the same words: a reworded paraphrase often moves polarity into a verb
    # ("isn't showing" / "still the same"), and there the embedding, not a word count, is the better judge.
    if a % 2 != b % 2 and _overlap(_NEGATORS.sub(" ", query), _NEGATORS.sub(" ", cached)) >= 0.5:
        return f"negation: {a} vs {b} negators"
    return None


# ---- antonym pairs ----
_ANTONYMS: tuple[tuple[str, str], ...] = (
    ("上一", "下一"), ("上个", "下个"), ("上周", "下周"), ("上午", "下午"), ("上次", "下次"), ("上面", "下面"),
    ("上半", "下半"), ("上升", "下降"), ("上涨", "下跌"), ("上传", "下载"), ("之前", "之后"), ("以前", "以后"),
    ("前天", "后天"), ("最高", "最低"), ("最大", "最小"), ("最多", "最少"), ("增加", "减少"), ("买", "卖"),
    ("借", "还"), ("左", "右"), ("早", "晚"), ("打开", "关闭"), ("开启", "关闭"), ("加密", "解密"), ("收入", "支出"),
    ("before", "after"), ("above", "below"), ("increase", "decrease"), ("buy", "sell"), ("maximum", "minimum"),
    ("max", "min"), ("first", "last"), ("left", "right"), ("higher", "lower"), ("more", "less"), ("upload", "download"),
    ("import", "export"), ("encrypt", "decrypt"), ("enable", "disable"), ("start", "stop"), ("true", "false"),
    ("open", "close"), ("add", "remove"), ("send", "receive"), ("deposit", "withdraw"), ("earlier", "later"),
    ("previous", "next"), ("up", "down"), ("in", "out"), ("on", "off"), ("win", "lose"), ("push", "pull"),
)
_EN_WORD = re.compile(r"[a-z]+")


def _has(term: str, text: str, words: set[str]) -> bool:
    return term in words if term.isascii() else term in text


def antonyms_rule(query: str, cached: str) -> str | None:
    q, c = query.lower(), cached.lower()
    qw, cw = set(_EN_WORD.findall(q)), set(_EN_WORD.findall(c))
    for x, y in _ANTONYMS:
        qx, qy, cx, cy = _has(x, q, qw), _has(y, q, qw), _has(x, c, cw), _has(y, c, cw)
        if (qx and not qy and cy and not cx) or (qy and not qx and cx and not cy):
            return f"antonyms: {x} / {y}"
    return None


# ---- who-does-what-to-whom order ----
_EN_STOP = frozenset(
    "a an the of to in on at for by with from and or is are was were be been it its this that as his her their "
    "he she they we you i my your our".split()
)


def units(text: str) -> list[str]:
    """Content units in order: Latin words (lower-cased, stopwords dropped), numbers, single Chinese characters."""
    out = []
    for tok in _TOKEN.findall(text.lower()):
        if tok in _EN_STOP or not (tok[0].isalnum() or tok[0] == "_"):
            continue
        out.append(tok)
    return out


def _moved(a: list[str], b: list[str]) -> str | None:
    """Units taken out at one place of ``a`` and put back at another place of ``b`` (南部...西部 / 西部...南部)."""
    removed: Counter[str] = Counter()
    inserted: Counter[str] = Counter()
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op != "equal":
            removed.update(a[i1:i2])
            inserted.update(b[j1:j2])
    moved = removed & inserted
    n_moved = sum(moved.values())
    # Most of what changed is the same units at new places: an exchange, not a rewording.
    if n_moved >= 2 and n_moved * 2 >= max(sum(removed.values()), sum(inserted.values())):
        return f"order: {''.join(sorted(moved.elements()))[:20]} moved"
    return None


def order_rule(query: str, cached: str) -> str | None:
    """Refuse when two units trade places with their neighbours (狗咬了人 / 人咬了狗; A of B / B of A).

    A clause moved as a whole keeps each unit's neighbours, so a paraphrase that reorders clauses passes;
    an exchange puts unit x in the slot (left and right neighbour) that unit y held.
    """
    a, b = units(query), units(cached)
    # Span moves are the PAWS-style negative in Chinese (南部...西部 / 西部...南部); English paraphrases move clauses
    # all the time (measured: it refused 30x more true hits than false ones there), so English gets slot swaps only.
    cjk = bool(_HAS_CJK.search(query) and _HAS_CJK.search(cached))
    moved = _moved(a, b) if cjk else None
    if moved is not None:
        return moved
    ca, cb = Counter(a), Counter(b)
    shared = {u for u in ca if ca[u] == 1 and cb.get(u) == 1}
    if len(shared) < 3:
        return None

    def slots(seq: list[str]) -> dict[str, tuple[str, str]]:
        padded = ["^", *seq, "$"]
        return {padded[i]: (padded[i - 1], padded[i + 1]) for i in range(1, len(padded) - 1) if padded[i] in shared}

    pos_a = {u: i for i, u in enumerate(a) if u in shared}
    pos_b = {u: i for i, u in enumerate(b) if u in shared}
    sa, sb = slots(a), slots(b)
    for x in shared:
        for y in shared:
            if x >= y or (pos_a[x] < pos_a[y]) == (pos_b[x] < pos_b[y]):
                continue
            # x took y's place (y's left or right neighbour) and y took x's: an exchange, not a moved clause.
            # Chinese units are single characters, so one matching side is already specific; English words
            # must take over both neighbours (measured: one side refused many English rewordings).
            x_in_y = sa[y] == sb[x] or (cjk and (sa[y][0] == sb[x][0] or sa[y][1] == sb[x][1]))
            y_in_x = sa[x] == sb[y] or (cjk and (sa[x][0] == sb[y][0] or sa[x][1] == sb[y][1]))
            if x_in_y and y_in_x:
                return f"order: {x} and {y} swapped"
    return None


# ---- code ----
_CODE_SPAN = re.compile(r"```.*?```|`[^`\n]+`", re.DOTALL)
_CODE_SIGNAL = re.compile(r"[A-Za-z_]\w*\(|[=!<>]=|->|=>|::|&&|\|\||[{};]|\b[a-z]+_[a-z_]+\b|\b[a-z]+[A-Z]\w*\b|\w\.\w+\(")
_CODE_TOKEN = re.compile(
    r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[A-Za-z_]\w*|\d+(?:\.\d+)?|==|!=|<=|>=|->|=>|::|&&|\|\||<<|>>|\*\*|//|[-+*/%<>=!&|^~]"
)


def _code_tokens(text: str) -> Counter[str] | None:
    spans = _CODE_SPAN.findall(text)
    if spans:
        return Counter(_CODE_TOKEN.findall(" ".join(s.strip("`") for s in spans)))
    if len(_CODE_SIGNAL.findall(text)) >= 2:
        # Code inline in prose: compare only what is unmistakably code, not the prose words around it.
        return Counter(_CODE_SIGNAL.findall(text))
    return None


def code_rule(query: str, cached: str) -> str | None:
    a, b = _code_tokens(query), _code_tokens(cached)
    if a is None and b is None:
        return None
    a, b = a or Counter(), b or Counter()
    # Substitution (x + b vs x - b, foo() vs bar()), not a snippet quoted on one side only.
    if (a - b) and (b - a):
        return f"code: {sorted(a - b)[:3]} vs {sorted(b - a)[:3]}"
    return None


Rule = Callable[[str, str], "str | None"]

RULES: dict[str, Rule] = {
    "numbers": numbers_rule,
    "entities": entities_rule,
    "negation": negation_rule,
    "antonyms": antonyms_rule,
    "order": order_rule,
    "code": code_rule,
}

#: The rules that paid for themselves in the measurements (docs/calibration.md, "The guard").
DEFAULT_RULES: tuple[str, ...] = ("numbers", "entities", "negation", "antonyms", "order", "code")


def rule_of(reason: str) -> str:
    """The rule's name in one of its reasons (``numbers: 20 vs 50`` -> ``numbers``)."""
    return reason.split(":", 1)[0]


def check(query: str, cached: str, rules: Sequence[str] = DEFAULT_RULES) -> GuardVerdict:
    """May the answer cached for ``cached`` be served for ``query``? Identical prompts always may."""
    if query == cached:
        return GuardVerdict(allowed=True)
    for name in rules:
        reason = RULES[name](query, cached)
        if reason is not None:
            return GuardVerdict(allowed=False, reason=reason)
    return GuardVerdict(allowed=True)
