"""A small FAQ serves its paraphrases from the first requests: a tenant's 80-line FAQ (4 actions x 5 things x 4
phrasings, every answer given) taught with `edgecache warmup` to the real `edgecache serve --profile cpu` (llama.cpp
and SmolLM2, the default embedder use-multilingual, the learner), then asked new phrasings of its questions (lower
case without a question mark among them) and questions it never taught, with the official openai client. The fixture
is tests/data/faq/: faq.jsonl (the warmup file, no max_tokens) and asked.json (the held-out questions). The client
sends its own max_tokens, a few values as apps do: a taught answer serves each, cut where it is longer."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from typer.testing import CliRunner

from edgecache.cli.main import app
from tests.real_server import MODEL, Server

pytestmark = pytest.mark.e2e

FAQ = Path(__file__).parent / "data" / "faq"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("faq") / "data").start()
    yield srv
    srv.stop()


def answers() -> dict[str, str]:
    """Each group's answer, as the FAQ gives it."""
    rows = [json.loads(line) for line in (FAQ / "faq.jsonl").read_text().splitlines() if line.strip()]
    return {row["group"]: row["answer"] for row in rows}


def test_a_taught_faq_serves_new_phrasings_from_the_first_requests_and_no_untaught_question(server: Server) -> None:
    warmed = CliRunner().invoke(app, ["warmup", str(FAQ / "faq.jsonl"), "--url", server.url])
    assert warmed.exit_code == 0, warmed.output
    assert "80 written, 0 skipped, 0 failed" in warmed.output, warmed.output
    # What the teaching allows, from the learner's state after the warmup.
    said = re.search(r"taught 20 groups: a paraphrase above (0\.\d\d) is served; (\d+) unsure serves of head start",
                     warmed.output)
    assert said is not None, warmed.output
    line, serves = float(said.group(1)), int(said.group(2))
    assert 0.8 < line < 0.99 and serves >= 60

    asked = json.loads((FAQ / "asked.json").read_text())
    paraphrases, untaught = asked["paraphrases"], asked["untaught"]
    # The tenant's first requests: new phrasings of its questions, with a question it never taught after every
    # sixth, in a fixed order that mixes the groups and the forms.
    order = sorted(paraphrases, key=lambda p: (paraphrases.index(p) * 7) % len(paraphrases))
    requests: list[tuple[str, str | None]] = []
    for n, p in enumerate(order):
        requests.append((p["text"], p["group"]))
        if n % 6 == 5 and untaught:
            requests.append((untaught.pop(0), None))
    requests += [(text, None) for text in untaught]
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    given = answers()
    served: list[str] = []
    cut = 0
    outcomes: list[tuple[str, str]] = []
    for n, (text, group) in enumerate(requests):
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=(64, 16, 128)[n % 3])
        how = raw.headers["x-edgecache"]
        outcomes.append((text, how))
        if group is None:
            assert how != "semantic", f"an untaught question was served a taught answer: {text!r}"
            continue
        if how == "semantic":
            choice = raw.parse().choices[0]
            if choice.finish_reason == "length":  # 16 tokens: the taught answer's beginning
                assert given[group].startswith(choice.message.content) and choice.message.content, text
                cut += 1
            else:
                assert choice.message.content == given[group], text
            served.append(text)
    first = [text for text, group in requests[:24] if group is not None]
    assert len(set(first) & set(served)) * 4 >= 3 * len(first), outcomes
    assert len(served) * 4 >= 3 * len(paraphrases), outcomes
    assert cut > 0  # a client's max_tokens below the taught answer's length was served its beginning
