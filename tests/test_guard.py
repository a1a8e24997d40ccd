"""The false-hit guard on a table of Chinese and English cases: each refusal reason, and paraphrases that must pass."""

from __future__ import annotations

import pytest

from edgecache.semantic.guard import DEFAULT_RULES, RULES, GuardVerdict, check

REFUSE = [
    # numbers: amounts, dates, versions
    ("numbers", "How much is 100 USD in euros?", "How much is 250 USD in euros?"),
    ("numbers", "Is Python 3.11 faster than before?", "Is Python 3.12 faster than before?"),
    ("numbers", "What happened on 2023-05-01?", "What happened on 2024-05-01?"),
    ("numbers", "三个苹果多少钱", "五个苹果多少钱"),
    ("numbers", "2024 年春节是哪天", "2025 年春节是哪天"),
    # named entities
    ("entities", "What is the weather in Paris today?", "What is the weather in London today?"),
    ("entities", "北京今天多少度", "上海今天多少度"),
    ("entities", "iPhone 的电池能用多久", "Pixel 的电池能用多久"),
    # negation / polarity
    ("negation", "Why is my card not working?", "Why is my card working?"),
    ("negation", "I don't want to cancel my order", "I want to cancel my order"),
    ("negation", "我不喜欢这部电影的结局", "我喜欢这部电影的结局"),
    ("negation", "这个药没有副作用吗", "这个药有副作用吗"),
    # antonym pairs
    ("antonyms", "上一句是什么", "下一句是什么"),
    ("antonyms", "What should I do before the exam?", "What should I do after the exam?"),
    ("antonyms", "How do I upload a file?", "How do I download a file?"),
    # who-does-what-to-whom
    ("order", "狗咬了人", "人咬了狗"),
    ("order", "the dog bit the man", "the man bit the dog"),
    ("order", "西罗希是印度南部拉贾斯坦邦西部的一个城市。", "西罗希是印度西部拉贾斯坦邦南部的一个城市。"),
    # code tokens
    ("code", "what does `x = a + b` return", "what does `x = a - b` return"),
    ("code", "Why does `df.dropna()` fail?", "Why does `df.fillna()` fail?"),
]

ALLOW = [
    ("How do I reset my password?", "I forgot my password, how can I change it?"),
    ("Can I track my card while it is being delivered?", "Is there a way to track the delivery of my card?"),
    ("How can I find an ATM that accepts this card?", "Which cash machines accept this card?"),
    ("北京的天气怎么样", "北京今天天气如何"),
    ("怎么重置我的密码", "我忘记密码了，如何重新设置密码"),
    ("What is the capital of France?", "what is the capital of France"),
    ("Why hasn't my transfer arrived?", "Why hasn't my transfer arrived yet?"),
    ("How do I sort a list in Python?", "What is the way to sort a Python list?"),
]


@pytest.mark.parametrize(("rule", "query", "cached"), REFUSE)
def test_refuses_what_the_answer_depends_on(rule: str, query: str, cached: str) -> None:
    verdict = check(query, cached)
    assert not verdict.allowed, verdict
    assert verdict.reason is not None and verdict.reason.startswith(rule), verdict.reason
    # Symmetric: which side is cached does not matter.
    assert not check(cached, query).allowed


@pytest.mark.parametrize(("rule", "query", "cached"), REFUSE)
def test_each_rule_alone_catches_its_case(rule: str, query: str, cached: str) -> None:
    assert RULES[rule](query, cached) is not None


@pytest.mark.parametrize(("query", "cached"), ALLOW)
def test_allows_paraphrases(query: str, cached: str) -> None:
    assert check(query, cached) == GuardVerdict(allowed=True, reason=None)


def test_identical_is_always_allowed() -> None:
    assert check("不是 3 个", "不是 3 个").allowed


def test_no_rules_allows_everything() -> None:
    assert check("北京今天多少度", "上海今天多少度", rules=()).allowed


def test_default_rules_are_registered() -> None:
    assert set(DEFAULT_RULES) <= set(RULES)
