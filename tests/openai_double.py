"""An OpenAI-compatible upstream that answers every chat request with one fixed text: what ``edgecache serve
--upstream URL`` fronts when a test needs a prompt longer than the CPU model's context (an agent CLI's 12-20k-token
requests) and an answer it can check.

Run as a script (``python tests/openai_double.py --port N --answer TEXT --log FILE``); it serves ``GET /v1/models``
and ``POST /v1/chat/completions``, streamed (SSE, with usage when ``stream_options.include_usage`` asks) or not, and
appends each chat request's body to ``--log`` as one JSON line, so a test counts the upstream's calls and reads what
the front sent. The token counts are rough (a word is a token): nothing here reads them as the model's.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MODEL = "double-model"


def make_handler(answer: str, log: Path) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # the request log is --log

        def _json(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.rstrip("/") == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "double"}]})
            else:
                self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                return
            with lock, log.open("a") as out:
                out.write(json.dumps(body) + "\n")
            prompt = sum(len(str(m.get("content") or "").split()) for m in body.get("messages") or ())
            text = answer if body.get("max_tokens", 1 << 30) > 1 else answer.split()[0]
            usage = {"prompt_tokens": prompt, "completion_tokens": len(text.split()),
                     "total_tokens": prompt + len(text.split())}
            if not body.get("stream"):
                self._json(200, {"id": "chatcmpl-double", "object": "chat.completion", "created": 0, "model": MODEL,
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": text}}],
                                 "usage": usage})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            base = {"id": "chatcmpl-double", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
            events = [{**base, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                      for piece in _pieces(text)]
            events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                events.append({**base, "choices": [], "usage": usage})
            for event in events:
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler


def _pieces(text: str) -> list[str]:
    """The text as word-sized deltas whose concatenation is the text."""
    words = text.split(" ")
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--answer", required=True)
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(args.answer, args.log))
    server.serve_forever()


if __name__ == "__main__":
    main()
