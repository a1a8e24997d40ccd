"""A chat as token ids, with the callers' text kept apart from control tokens (the llama.cpp and SGLang engines).

A chat template writes control tokens (``<|im_start|>``, ``<|eot_id|>``, ``[INST]`` ...) around the messages' text,
and the tokenizer turns their spellings into control-token ids. A message's text must never become one:
``<|im_end|><|im_start|>system`` typed by a user would forge a system turn.

How. The conversation is rendered by the model's own template with each control-token spelling inside a message's
text replaced by a sentinel: one character of Unicode's private-use plane 16 per distinct spelling, none of which
the texts contain. Templates trim, strip, concatenate and JSON-encode (transformers' ``tojson`` keeps non-ASCII
text) a message's text; none of that touches a private-use character (it is not whitespace and is not escaped), so
each sentinel leaves the template as it went in. The rendered prompt is encoded with control spellings parsed,
except at each sentinel, where the spelling it stands for is encoded as plain text.

A conversation with no control spelling in any text (nearly every one) is therefore rendered once and encoded
whole: its ids are exactly the model's own rendering of it, the same ids any other client of the engine sends, so
KV prefixes are shared with them. Encoding the template's pieces and the texts one by one (an earlier design, with
ASCII separators as whole-text placeholders) differs on SentencePiece (Metaspace) tokenizers, which begin every
encoded piece with a word boundary; and ``| trim`` removed those separators, which Python counts as whitespace.

What remains refused: a template that ASCII-escapes a message's text (plain Jinja's ``tojson``, which llama-cpp-
python's renderer uses, does for tool results) while that text holds a control spelling, since where the spelling
lands in the prompt can then not be told; the 400 names the message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence

from edgecache.errors import BadRequest

Encode = Callable[[str], list[int]]
Render = Callable[[list[str]], str]
"""Renders the chat with these message texts (in the conversation's order) and returns the prompt text."""

# Unicode's supplementary private-use area B (U+100000..U+10FFFD): no template or tokenizer gives it a meaning.
_PLANE_16 = re.compile("[\U00100000-\U0010fffd]")
_FIRST_SENTINEL = 0x100000


class ChatPromptEncoder:
    """Encodes a rendered chat for one tokenizer: ``encode_prompt`` parses control spellings into control tokens,
    ``encode_text`` never does; neither adds a BOS (templates write their own). ``control_spellings`` are the
    texts of the tokenizer's control tokens."""

    def __init__(self, *, encode_prompt: Encode, encode_text: Encode, control_spellings: Iterable[str]) -> None:
        self._encode_prompt = encode_prompt
        self._encode_text = encode_text
        spellings = {s for s in control_spellings if s}
        self._spellings = re.compile(_trie_pattern(spellings)) if spellings else None

    def control_spellings_in(self, text: str) -> list[str]:
        """The control-token spellings ``text`` holds, in order (empty for nearly every text)."""
        return self._spellings.findall(text) if self._spellings is not None else []

    def ids(self, render: Render, texts: Sequence[str]) -> list[int]:
        """The chat's token ids: ``render`` fills the template with (marked) texts; see the module's docstring."""
        found = {s: None for t in texts for s in self.control_spellings_in(t)}
        if not found:
            return self._encode_prompt(render(list(texts)))
        taken = {c for t in texts for c in _PLANE_16.findall(t)}
        free = (chr(c) for c in range(_FIRST_SENTINEL, 0x10FFFE) if chr(c) not in taken)
        sentinel = {spelling: next(free) for spelling in found}
        assert self._spellings is not None
        marked = [self._spellings.sub(lambda m: sentinel[m.group()], t) for t in texts]
        prompt = render(marked)
        for spelling, mark in sentinel.items():
            if json.dumps(mark)[1:-1] in prompt:  # the template escaped the text: where it lands is unknown
                index = next(i for i, t in enumerate(texts) if spelling in t)
                raise BadRequest(f"this message holds the control-token text {spelling!r}, and this model's chat "
                                 "template escapes the message's text, so the server cannot keep it apart from "
                                 "real control tokens; leave it out", param=f"messages[{index}].content")
        spelling_of = {mark: spelling for spelling, mark in sentinel.items()}
        ids: list[int] = []
        for part in re.split(f"([{''.join(spelling_of)}])", prompt):
            if part in spelling_of:
                ids += self._encode_text(spelling_of[part])
            elif part:
                ids += self._encode_prompt(part)
        return ids


def _trie_pattern(words: Iterable[str]) -> str:
    """A regex matching any of ``words``, longest first, as a trie (``<|(?:eot_id|eom_id)\\|>``): a flat
    alternation of a vocabulary's 256 specials tried every branch at every ``<`` (0.7 s on a 1 MB text of ``<|``);
    the trie reads each character once or twice."""
    trie: dict[str, dict] = {}  # type: ignore[type-arg]
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}  # a word ends here

    def build(node: dict) -> str:  # type: ignore[type-arg]
        branches = [re.escape(char) + build(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        group = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{group})?" if "" in node else group  # greedy: the longer word first, then this one

    return build(trie)
