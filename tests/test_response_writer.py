"""Chat's and Completions' SSE text frames are made from bytes cut once per response (``ResponseWriter.sse_delta``):
they must be exactly the frames the structs encode, whatever the text and the model name hold."""

from __future__ import annotations

import pytest

from edgecache.http.openai_api import ResponseWriter

TEXTS = ["", "a", 'quote " and backslash \\', "line\nbreak\ttab\x01\x1f", "é 中文 🙂 \u2028\u2029", '"content":""',
         '"text":""', "</script>"]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("model", ["smollm2", "", '"content":""', '"text":""', 'a"b'])
def test_a_delta_frame_is_the_struct_encoded_frame(chat: bool, model: str) -> None:
    writer = ResponseWriter(chat=chat, model=model, response_id="chatcmpl-0123", include_usage=True)
    for text in TEXTS:
        assert writer.sse_delta(text) == writer._delta_frame(text), (text, model)
