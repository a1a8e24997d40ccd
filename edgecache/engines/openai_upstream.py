"""The ``openai`` engine: generation delegated to an upstream OpenAI-compatible server.

Any server that speaks ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` works: an SGLang server or
router, vLLM, llama.cpp's server, or another EdgeCache. This is how EdgeCache fronts a fleet.

The upstream is asked to stream (SSE) with ``stream_options.include_usage`` so the last event carries token counts;
``usage.prompt_tokens_details.cached_tokens`` is read when the upstream reports its prefix-cache hit. A server that
ignores ``include_usage`` (llama-cpp-python's) still gets real counts: the completion tokens are the stream's
content events (such servers send one per token), and the prompt tokens come from a probe, the same request
unstreamed with ``max_tokens: 1`` (the upstream's prefix cache makes it cheap; its answer is discarded).

Every request field passes through (tools, tool_choice, response_format, logprobs, n, echo, top_k, min_p,
repetition_penalty, logit_bias, chat_template_kwargs, reasoning_effort, verbosity, and vLLM's min_tokens, ignore_eos,
stop_token_ids, skip_special_tokens): the upstream honours it or refuses it, and its refusal (a 4xx) reaches the
client as a 400 naming the upstream. Custom tools are the exception: the upstream's answer would carry custom tool
calls (``type: custom`` with a text ``input``), which the answers here have no shape for yet, so they are refused. A whole answer (tool calls, logprobs, several choices) is asked
for unstreamed and kept with every choice. Every failure (connection, timeout, an HTTP
error status, an ``error`` event in the stream, a malformed body) becomes one :class:`EngineError` whose message
names the upstream and the reason, never a traceback.

The upstream's own prefix-cache hit ratio (vLLM's and SGLang's ``/metrics``, see ``upstream_metrics``) is read by
:meth:`OpenAIUpstreamEngine.scrape`, which the server's housekeeping loop calls every few seconds, never a request:
an upstream whose ``/metrics`` is missing or unreachable only leaves the figure out of :meth:`stats`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import time
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import httpx
import msgspec

from edgecache.engines.base import (
    FEATURES,
    STREAM_BATCH_S,
    Choice,
    Chunk,
    FinishReason,
    GenerationRequest,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    matched_stop,
)
from edgecache.engines.http_transport import BatchingTransport
from edgecache.engines.upstream_metrics import PrefixCacheFigures, metrics_url, read_prefix_cache
from edgecache.errors import BadRequest, EngineError, NotReady

_DONE = b"[DONE]"
# Upstream error messages sometimes embed a Python traceback (llama-cpp-python's do); keep what precedes it.
_TRACEBACK = re.compile(r"\n\s*(File \"|Traceback \(most recent call last\))")
_MAX_MESSAGE = 500
# A scrape of the upstream's /metrics waits this long at most (it runs in the housekeeping loop, not a request).
log = logging.getLogger("edgecache")

SCRAPE_TIMEOUT_S = 2.0
#: How often a running server asks the upstream again what weights it serves (a change starts a new key namespace).
IDENTITY_REFRESH_S = 60.0
#: What the upstream says of its weights, where it says it: vLLM's ``/v1/models`` entry and SGLang's
#: ``/get_model_info`` (beside the ``/v1`` root).
MODEL_FIELDS = ("root", "parent", "max_model_len")
MODEL_INFO_FIELDS = ("model_path", "weight_version", "tokenizer_path")


class OpenAIUpstreamEngine:
    """The :class:`~edgecache.engines.base.Engine` backed by an OpenAI-compatible HTTP server."""

    kind = "openai (upstream)"
    # Everything passes through; the upstream decides, and says so with a 4xx. Custom tools excepted (see above).
    features = frozenset(FEATURES) - {"custom_tools"}

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        version: str | None = None,
        stream: bool = True,
        salt_field: str | None = "cache_salt",
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """
        :param base_url: the upstream's API root, e.g. ``http://10.0.0.5:30000/v1``.
        :param model: the upstream model to call; by default the first one ``/models`` lists.
        :param version: what goes into cache keys, pinned (``engine.version``). Unset, it is ``model@base_url``
            plus a hash of what the upstream says of its weights (vLLM's ``/v1/models`` ``root`` and
            ``max_model_len``, SGLang's ``/get_model_info`` ``model_path`` and ``weight_version``), read at start and
            again every :data:`IDENTITY_REFRESH_S` while serving: an upstream restarted on other weights under the
            same name starts a new namespace, and the old answers are never served for it.
        :param stream: ask the upstream to stream. ``False`` suits upstreams whose streaming is broken; the engine
            then yields the whole answer as one chunk.
        :param salt_field: the request field that carries the tenant salt (SGLang and vLLM call it ``cache_salt``);
            ``None`` for upstreams that reject unknown fields, such as api.openai.com.
        :param transport: an httpx transport, for tests that inject failures.
        """
        self.base_url = base_url.rstrip("/")
        self.model_id = model or ""
        self.version = version or ""
        self._pinned = version is not None and version != ""
        self.version_source = "pinned by engine.version" if self._pinned else "not read yet"
        self.version_changes = 0
        self._identity_read_at = 0.0
        self._api_key = api_key
        self._stream = stream
        self._salt_field = salt_field
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._direct: BatchingTransport | None = None
        self._direct_headers: list[tuple[bytes, bytes]] = []
        self._urls: dict[str, httpx.URL] = {}  # each API path under the base URL, parsed once
        self._closed = False
        self._requests = 0
        self._errors = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._completion_tokens = 0
        self._metrics_url = metrics_url(self.base_url)
        self._root = self.base_url.removesuffix("/v1")  # where SGLang's native routes are
        self._upstream_cache: PrefixCacheFigures | None = None
        self._metrics_state = "not read yet"

    async def start(self) -> None:
        """Open the connection pool and learn the model from ``/models`` when none was given."""
        if self._client is not None:
            return
        if self._closed:
            raise EngineError("the upstream engine was closed and cannot be started again")
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        transport = self._transport or _default_transport(self.base_url)
        client = httpx.AsyncClient(base_url=self.base_url + "/", headers=headers, timeout=self._timeout,
                                   transport=transport)
        # A streamed generation goes straight to the batching transport (see _open_stream); these are the headers
        # the client would have sent (no Accept-Encoding: a stream is relayed as it comes, never decompressed).
        self._direct = transport if isinstance(transport, BatchingTransport) else None
        self._direct_headers = [(b"accept", b"*/*"), (b"content-type", b"application/json"),
                                (b"user-agent", client.headers["user-agent"].encode())]
        if self._api_key:
            self._direct_headers.append((b"authorization", f"Bearer {self._api_key}".encode()))
        try:
            if not self.model_id:
                self.model_id = await self._first_model(client)
        except BaseException:
            await client.aclose()
            raise
        self._client = client
        if not self._pinned:
            self.version = await self._read_version(client)

    async def _read_version(self, client: httpx.AsyncClient) -> str:
        """``model@base_url``, with a hash of what the upstream says of its weights where it says anything."""
        self._identity_read_at = time.monotonic()
        said: dict[str, Any] = {}
        with contextlib.suppress(EngineError, ValueError, httpx.HTTPError):
            body = await self._request_json(client, "GET", "models")
            for entry in (body.get("data") or ()) if isinstance(body, Mapping) else ():
                if isinstance(entry, Mapping) and entry.get("id") == self.model_id:
                    said.update({f: entry[f] for f in MODEL_FIELDS if entry.get(f) is not None})
        try:
            info = await client.get(self._root + "/get_model_info", timeout=SCRAPE_TIMEOUT_S)
            if info.status_code == 200 and isinstance(found := info.json(), Mapping):
                said.update({f: found[f] for f in MODEL_INFO_FIELDS if found.get(f) is not None})
        except (httpx.HTTPError, ValueError):
            pass
        base = f"{self.model_id}@{self.base_url}"
        if not said:
            self.version_source = "the upstream says nothing of its weights: model@url (pin engine.version)"
            return base
        self.version_source = "the upstream's " + ", ".join(sorted(said))
        digest = hashlib.blake2b(json.dumps(said, sort_keys=True, default=str).encode(), digest_size=6).hexdigest()
        return f"{base}#{digest}"

    async def _refresh_version(self, client: httpx.AsyncClient) -> None:
        """Ask the upstream again what it serves; a change starts a new key namespace (logged and counted)."""
        version = await self._read_version(client)
        if version != self.version:
            log.warning("the upstream %s now serves other weights (%s): model version %s -> %s; answers stored "
                        "for the old one are no longer served", self.base_url, self.version_source, self.version,
                        version)
            self.version, self.version_changes = version, self.version_changes + 1

    async def _first_model(self, client: httpx.AsyncClient) -> str:
        body = await self._request_json(client, "GET", "models")
        models = body.get("data") if isinstance(body, Mapping) else None
        ids = [str(m["id"]) for m in models or () if isinstance(m, Mapping) and m.get("id")]
        if not ids:
            raise EngineError(f"upstream {self.base_url} lists no models")
        return ids[0]

    async def _request_json(self, client: httpx.AsyncClient, method: str, path: str, body: Any = None) -> Any:
        try:
            response = await client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc
        if response.status_code >= 400:
            raise self._status_error(response.status_code, response.content)
        return self._decode(response.content)

    def _running(self) -> httpx.AsyncClient:
        if self._client is None:
            raise NotReady(
                "the upstream engine is not started" if not self._closed else "the upstream engine is closed"
            )
        return self._client

    def _payload(self, request: GenerationRequest, *, stream: bool) -> tuple[str, dict[str, Any]]:
        params = request.params
        payload: dict[str, Any] = {
            "model": self.model_id,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty,
            "stream": stream,
        }
        if params.stop:
            payload["stop"] = list(params.stop)
        if params.seed is not None:
            payload["seed"] = params.seed
        # The rest only when asked for, so an upstream that refuses unknown fields (api.openai.com) still takes a
        # plain request.
        for name, value, off in (("top_k", params.top_k, 0), ("min_p", params.min_p, 0.0),
                                 ("repetition_penalty", params.repetition_penalty, 1.0), ("n", request.n, 1)):
            if value != off:
                payload[name] = value
        if params.logit_bias:
            payload["logit_bias"] = {str(token): bias for token, bias in params.logit_bias}
        # vLLM's names; only when asked for (an upstream that refuses unknown fields takes a plain request).
        for name, value, off in (("min_tokens", request.min_tokens, 0), ("ignore_eos", request.ignore_eos, False),
                                 ("stop_token_ids", list(request.stop_token_ids), []),
                                 ("skip_special_tokens", request.skip_special_tokens, True)):
            if value != off:
                payload[name] = value
        if stream:
            payload["stream_options"] = {"include_usage": True}
        if request.salt and self._salt_field:
            payload[self._salt_field] = request.salt
        if request.cache is not None and request.cache.key:
            payload["prompt_cache_key"] = request.cache.key  # the client's own routing hint, as it sent it
        if request.messages is not None:
            payload["messages"] = [_message(m) for m in request.messages]
            if request.tools:
                payload["tools"] = [{"type": "function", "function": {
                    "name": t.name, "description": t.description, "parameters": json.loads(t.parameters),
                    **({"strict": True} if t.strict else {})}} for t in request.tools]
                choice = request.tool_choice
                payload["tool_choice"] = choice if choice in ("auto", "none", "required") else \
                    {"type": "function", "function": {"name": choice}}
                if not request.parallel_tool_calls:
                    payload["parallel_tool_calls"] = False
            fmt = request.response_format
            if fmt is not None:
                payload["response_format"] = {"type": "json_object"} if fmt.kind == "json_object" else {
                    "type": "json_schema", "json_schema": {"name": fmt.name, "strict": fmt.strict,
                                                           "schema": json.loads(fmt.schema or "{}")}}
            if request.logprobs is not None:
                payload["logprobs"] = True
                if request.logprobs:
                    payload["top_logprobs"] = request.logprobs
            if request.template_kwargs:
                payload["chat_template_kwargs"] = json.loads(request.template_kwargs)
            for name, value in (("reasoning_effort", request.reasoning_effort), ("verbosity", request.verbosity)):
                if value:
                    payload[name] = value
            return "chat/completions", payload
        payload["prompt"] = request.prompt or ""
        if request.logprobs is not None:
            payload["logprobs"] = request.logprobs
        if request.echo:
            payload["echo"] = True
        return "completions", payload

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        """Stream one generation; leaving early closes the upstream response, which stops the upstream's work."""
        client = self._running()
        whole = (bool(request.tools) and request.tool_choice != "none") or request.n > 1 or \
            request.logprobs is not None
        stream = self._stream and not whole
        path, payload = self._payload(request, stream=stream)
        try:
            if stream:
                # aclosing: when our consumer leaves early, close the inner generator (and with it the upstream
                # response) now, not whenever the garbage collector finalizes it.
                async with contextlib.aclosing(self._stream_events(client, path, payload)) as events:
                    async for chunk in events:
                        yield chunk
            else:
                body = await self._request_json(client, "POST", path, payload)
                yield self._whole_answer(body, whole=whole, chat=request.messages is not None,
                                         stops=request.params.stop)
        except EngineError:
            self._errors += 1
            raise

    async def _prompt_tokens_probe(self, client: httpx.AsyncClient, path: str, payload: dict[str, Any]) -> int:
        """The prompt's token count from the same request unstreamed with max_tokens 1 (see the module's
        docstring). 0 when the upstream reports none there either."""
        probe = {k: v for k, v in payload.items() if k not in ("stream_options", "n")}
        probe.update(stream=False, max_tokens=1)
        try:
            body = await self._request_json(client, "POST", path, probe)
        except (EngineError, BadRequest):
            # The answer is complete and good: a failed count must not turn it into an error (nor keep it out of
            # the cache). The prompt count stays unknown (0), as it was before the probe existed.
            return 0
        usage = body.get("usage") if isinstance(body, Mapping) else None
        return int(usage.get("prompt_tokens") or 0) if isinstance(usage, Mapping) else 0

    async def _stream_events(
        self, client: httpx.AsyncClient, path: str, payload: dict[str, Any]
    ) -> AsyncGenerator[Chunk, None]:
        finish: FinishReason | None = None
        matched: str | None = None
        usage: Mapping[str, Any] | None = None
        content_events = 0
        stops = tuple(payload.get("stop") or ())
        try:
            async with self._open_stream(client, path, payload) as response:
                if response.status_code >= 400:
                    raise self._status_error(response.status_code, await response.aread())
                # Bytes as they arrive (the transport reads a fast upstream in batches), the events of each read
                # decoded at once and relayed as one chunk: the relay's cost is per read, not per token.
                partial, done = b"", False
                # The raw bytes where there is nothing to decode (two generator steps fewer per read); a body
                # already read whole (an answer given as content, by a test's transport) only as the decoded one.
                raw = "content-encoding" not in response.headers and not response.is_stream_consumed
                reads = response.aiter_raw() if raw else response.aiter_bytes()
                async for data in reads:
                    block = partial + data
                    cut = block.rfind(b"\n") + 1  # whole lines only
                    block, partial = block[:cut], block[cut:]
                    if not block:
                        continue
                    events, done = self._events(block)
                    texts = []
                    for text, reason, event_usage, stop in events:
                        usage = event_usage or usage
                        if reason is not None:
                            finish = self._finish_reason(reason)
                            matched = matched_stop(stop, stops)
                        if text:
                            content_events += 1
                            texts.append(text)
                    if texts:
                        yield Chunk(text="".join(texts))
                    if done:
                        break
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc
        if finish is None:
            raise EngineError(f"upstream {self.base_url} ended the stream without a finish reason")
        if usage is None:
            usage = {"prompt_tokens": await self._prompt_tokens_probe(client, path, payload),
                     "completion_tokens": content_events}
        last = _with_usage(Chunk(finish_reason=finish, stop_sequence=matched if finish == "stop" else None), usage)
        self._count(last)
        yield last

    @contextlib.asynccontextmanager
    async def _open_stream(self, client: httpx.AsyncClient, path: str,
                           payload: dict[str, Any]) -> AsyncIterator[httpx.Response]:
        """``client.stream("POST", path, json=payload)``, for the batching transport without the client's layers
        around it (URL merging, cookies, auth and redirect hooks: none of which an upstream's stream uses). They
        cost more CPU per request than a 64-token stream's own relaying; any other transport (a proxy's, a
        test's) goes through the client."""
        if self._direct is None:
            async with client.stream("POST", path, content=_encode(payload),
                                     headers={"content-type": "application/json"}) as response:
                yield response
            return
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = client.base_url.join(path)
        request = httpx.Request("POST", url, headers=self._direct_headers,
                                content=_encode(payload), extensions={"timeout": self._timeout.as_dict()})
        response = await self._direct.handle_async_request(request)
        response.request = request
        try:
            yield response
        finally:
            await response.aclose()

    def _events(self, block: bytes) -> tuple[list[tuple[str, object, Mapping[str, Any] | None, object]], bool]:
        """The text, finish reason, usage and matched stop of each event of ``block`` (whole SSE events), and whether it ended
        with ``[DONE]``. An upstream's usual block, nothing but ``data: {...}`` events, is made one JSON array by
        two byte scans and decoded by one call into the few fields read; any other (comments, event names, CRLF,
        an error event, a malformed one) is read line by line, so a fault is named."""
        if block.startswith(b"data: ") and block.endswith(b"\n\n"):
            joined = block[6:-2].replace(b"\n\ndata: ", b",")
            done = joined == _DONE or joined.endswith(b"," + _DONE)
            if done:
                joined = joined[:-len(_DONE) - 1] if joined != _DONE else b""
            if b"\n" not in joined and b"\r" not in joined and b'"error"' not in joined:
                try:
                    decoded = _decode_events(b"[%s]" % joined)
                except msgspec.DecodeError:
                    pass
                else:
                    events = []
                    for event in decoded:
                        if not event.choices:
                            events.append(("", None, event.usage, None))
                        else:
                            choice = event.choices[0]
                            text = choice.delta.content if choice.delta is not None else choice.text
                            stop = choice.stop_reason if choice.stop_reason is not None else choice.matched_stop
                            events.append((text or "", choice.finish_reason, event.usage, stop))
                    return events, done
        events = []
        for line in block.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # blank separators, comments (": ping"), event names
            body = line[5:].strip()
            if body == _DONE:
                return events, True
            events.append(self._event(body))
        return events, False

    def _event(self, body: bytes) -> tuple[str, object, Mapping[str, Any] | None, object]:
        """One stream event's text, finish reason, usage and matched stop (as :func:`_stop_of` reads it). Decoded into the
        few fields read (the rest skipped unparsed); an event of another shape, or one that carries an error, takes
        the general path."""
        if b'"error"' not in body:
            try:
                event = _decode_event(body)
            except msgspec.DecodeError:
                pass  # the general path names the fault
            else:
                if not event.choices:
                    return "", None, event.usage, None
                choice = event.choices[0]
                text = choice.delta.content if choice.delta is not None else choice.text
                stop = choice.stop_reason if choice.stop_reason is not None else choice.matched_stop
                return text or "", choice.finish_reason, event.usage, stop
        event = self._decode(body)
        if not isinstance(event, Mapping):
            raise EngineError(f"upstream {self.base_url} sent an event that is not an object")
        if "error" in event:
            raise self._event_error(event)
        text, reason, stop = _choice(event)
        usage = event.get("usage")
        return text, reason, usage if isinstance(usage, Mapping) else None, stop

    def _event_error(self, event: Mapping[str, Any]) -> EngineError | BadRequest:
        """An ``error`` event. vLLM checks some fields (logit_bias' token ids, ...) only once a stream has begun, and
        says so in an error event with the code of a 400: that is a refusal of the request, a 400 naming the
        upstream as a refused request's status would be; any other error event is the upstream failing."""
        error = event.get("error")
        code = error.get("code") if isinstance(error, Mapping) else event.get("code")
        kind = error.get("type") if isinstance(error, Mapping) else None
        if str(code) in ("400", "422") or kind in ("BadRequestError", "invalid_request_error"):
            return BadRequest(f"the upstream {self.base_url} refused the request: {_error_message(event)}")
        return EngineError(f"upstream {self.base_url} failed mid-stream: {_error_message(event)}")

    def _whole_answer(self, body: Any, *, whole: bool = False, chat: bool = True,
                      stops: tuple[str, ...] = ()) -> Chunk:
        if not isinstance(body, Mapping):
            raise EngineError(f"upstream {self.base_url} answered with something that is not an object")
        raw = [c for c in body.get("choices") or [] if isinstance(c, Mapping)]
        choice = raw[0] if raw else {}
        message = choice.get("message")
        text = message.get("content") if isinstance(message, Mapping) else choice.get("text")
        reason = choice.get("finish_reason")
        if reason is None:
            raise EngineError(f"upstream {self.base_url} answered without a finish reason")
        finish = self._finish_reason(reason)
        chunk = _with_usage(Chunk(text=text or "", finish_reason=finish,
                                  stop_sequence=_stop_of(choice, stops) if finish == "stop" else None),
                            body.get("usage"))
        if whole:
            chunk.text = ""
            chunk.choices = tuple(self._choice_of(i, c, chat, stops) for i, c in enumerate(raw))
        self._count(chunk)
        return chunk

    def _choice_of(self, position: int, raw: Mapping[str, Any], chat: bool, stops: tuple[str, ...] = ()) -> Choice:
        message = raw.get("message") if chat else None
        message = message if isinstance(message, Mapping) else {}
        text = message.get("content") if chat else raw.get("text")
        calls = []
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping):
                raise EngineError(f"upstream {self.base_url} sent a malformed tool call")
            arguments = function.get("arguments")
            calls.append(ToolCall(id=str(call.get("id") or ""), name=str(function.get("name") or ""),
                                  arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))
        index = raw.get("index")
        finish = self._finish_reason(raw.get("finish_reason"))
        return Choice(index=index if isinstance(index, int) else position, text=text or "",
                      finish_reason=finish, tool_calls=tuple(calls),
                      logprobs=_logprobs(raw.get("logprobs"), chat),
                      refusal=message.get("refusal") if isinstance(message.get("refusal"), str) else None,
                      stop_sequence=_stop_of(raw, stops) if finish == "stop" else None)

    def _finish_reason(self, reason: object) -> FinishReason:
        if reason == "stop":
            return "stop"
        if reason == "length":
            return "length"
        if reason == "tool_calls":
            return "tool_calls"
        # content_filter, ...: not an answer EdgeCache knows how to store and replay.
        raise EngineError(f"upstream {self.base_url} finished with {reason!r}, which EdgeCache does not serve")

    def _decode(self, data: str | bytes) -> Any:
        try:
            return msgspec.json.decode(data)
        except msgspec.DecodeError as exc:
            raise EngineError(f"upstream {self.base_url} sent malformed JSON: {_clean(str(data)[:80])}") from exc

    def _status_error(self, status: int, body: bytes) -> EngineError | BadRequest:
        try:
            detail = _error_message(msgspec.json.decode(body))
        except msgspec.DecodeError:
            detail = _clean(body.decode(errors="replace"))
        if status in (400, 422):
            # The upstream refused this request (a field it does not support, a schema it cannot compile): the
            # caller's to fix, so a 400 naming the upstream, not a 502.
            return BadRequest(f"the upstream {self.base_url} refused the request: {detail or 'no detail'}")
        return EngineError(f"upstream {self.base_url} answered HTTP {status}: {detail or 'no detail'}")

    def _transport_error(self, exc: httpx.HTTPError) -> EngineError:
        if isinstance(exc, httpx.TimeoutException):
            reason = f"timed out ({type(exc).__name__})"
        elif isinstance(exc, httpx.ConnectError):
            reason = f"is unreachable ({_clean(str(exc)) or 'connection refused'})"
        else:
            reason = f"failed: {type(exc).__name__} {_clean(str(exc))}".rstrip()
        return EngineError(f"upstream {self.base_url} {reason}")

    def _count(self, chunk: Chunk) -> None:
        self._requests += 1
        self._prompt_tokens += chunk.prompt_tokens
        self._cached_tokens += chunk.cached_tokens
        self._completion_tokens += chunk.completion_tokens

    async def check_prompt(self, request: GenerationRequest) -> None:
        """Nothing before the call: the upstream knows its own context and refuses an over-long prompt itself."""

    async def count_tokens(self, request: GenerationRequest) -> int:
        """The upstream's own count: the request unstreamed with max_tokens 1 (the OpenAI API has no count route),
        so the upstream's template and tokenizer count, and its prefix cache then holds the prompt."""
        client = self._running()
        path, payload = self._payload(request, stream=False)
        payload.update(max_tokens=1, n=1)
        for unneeded in ("logprobs", "top_logprobs"):
            payload.pop(unneeded, None)
        body = await self._request_json(client, "POST", path, payload)
        usage = body.get("usage") if isinstance(body, Mapping) else None
        if not isinstance(usage, Mapping) or not usage.get("prompt_tokens"):
            raise EngineError(f"upstream {self.base_url} reported no prompt token count")
        return int(usage["prompt_tokens"])

    async def flush(self) -> None:
        """Nothing to do: the OpenAI API has no cache flush, and an upstream's prefix cache is exact (it can make
        answers faster, never different)."""

    async def scrape(self) -> None:
        """Read the upstream's prefix-cache figures from its ``/metrics`` (called off the request path, by the
        server's housekeeping). Never raises: a failure is kept as the reason :meth:`stats` gives, and the last
        figures are dropped rather than shown stale."""
        client = self._client
        if client is None:
            return
        if not self._pinned and time.monotonic() - self._identity_read_at >= IDENTITY_REFRESH_S:
            await self._refresh_version(client)
        try:
            response = await client.get(self._metrics_url, timeout=SCRAPE_TIMEOUT_S)
            if response.status_code >= 400:
                raise _NoFigures(f"{self._metrics_url} answered HTTP {response.status_code}")
            figures = read_prefix_cache(response.text)
            if figures is None:
                raise _NoFigures(f"{self._metrics_url} has no prefix-cache figures")
        except _NoFigures as exc:
            self._upstream_cache, self._metrics_state = None, str(exc)
        except httpx.HTTPError as exc:
            self._upstream_cache = None
            self._metrics_state = f"{self._metrics_url} unreachable: {type(exc).__name__} {_clean(str(exc))}".rstrip()
        except ValueError as exc:  # not Prometheus text
            self._upstream_cache = None
            self._metrics_state = f"{self._metrics_url} is not Prometheus text: {_clean(str(exc))[:80]}"
        else:
            self._upstream_cache, self._metrics_state = figures, figures.server

    def upstream_prefix_cache_hit_ratio(self) -> float | None:
        """The upstream's own prefix-cache hit ratio as last read from its ``/metrics``; None when unknown."""
        return self._upstream_cache.hit_ratio if self._upstream_cache is not None else None

    async def stats(self) -> dict[str, float | int | str]:
        upstream: dict[str, float | int | str] = {"upstream_metrics": self._metrics_state}
        figures = self._upstream_cache
        if figures is not None:
            upstream["upstream_prefix_cache_hit_ratio"] = figures.hit_ratio
            if figures.hits is not None and figures.queries is not None:
                upstream["upstream_prefix_cache_hits"] = figures.hits
                upstream["upstream_prefix_cache_queries"] = figures.queries
        return {
            "engine": "openai",
            "upstream": self.base_url,
            "model": self.model_id,
            "version": self.version,
            "version_source": self.version_source,
            "version_changes": self.version_changes,
            "requests": self._requests,
            "errors": self._errors,
            "prompt_tokens": self._prompt_tokens,
            "cached_tokens": self._cached_tokens,
            "completion_tokens": self._completion_tokens,
            "prefix_hit_ratio": self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
            **upstream,
        }

    async def close(self) -> None:
        """Close the connection pool; safe to call twice."""
        client, self._client = self._client, None
        self._closed = True
        if client is not None:
            await client.aclose()


def _default_transport(base_url: str) -> httpx.AsyncBaseTransport | None:
    """The batching transport (see ``engines/http_transport``), or httpx's own (None) where the environment names a
    proxy for the upstream: only httpx's speaks to proxies."""
    url = httpx.URL(base_url)
    proxies = urllib.request.getproxies()
    if (proxies.get(url.scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(url.host):
        return None
    return BatchingTransport(batch_s=STREAM_BATCH_S)


class _NoFigures(Exception):
    """The upstream answered its /metrics scrape without figures to show (the message says why)."""


class _EventDelta(msgspec.Struct):
    content: str | None = None


class _EventChoice(msgspec.Struct):
    delta: _EventDelta | None = None
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None   # vLLM's matched stop (a string, or a stop token id)
    matched_stop: str | int | None = None  # SGLang's


class _StreamEvent(msgspec.Struct):
    """The fields of an upstream stream event the relay reads (chat ``delta.content`` or completion ``text``, the
    finish reason, usage); msgspec skips the rest without building it."""

    choices: list[_EventChoice] | None = None
    usage: dict[str, Any] | None = None


_decode_event = msgspec.json.Decoder(_StreamEvent).decode
_decode_events = msgspec.json.Decoder(list[_StreamEvent]).decode
_encode = msgspec.json.Encoder().encode


def _choice(event: Mapping[str, Any]) -> tuple[str, object, object]:
    """The text, finish reason and matched stop of a stream event's first choice (chat ``delta.content`` or
    completion ``text``). The usage-only event at the end has no choices."""
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], Mapping):
        return "", None, None
    choice = choices[0]
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, Mapping) else choice.get("text")
    stop = choice.get("stop_reason")
    return (text if isinstance(text, str) else ""), choice.get("finish_reason"), \
        stop if stop is not None else choice.get("matched_stop")


def _stop_of(choice: Mapping[str, Any], stops: tuple[str, ...]) -> str | None:
    """The stop string a choice says it matched: vLLM's ``stop_reason``, SGLang's ``matched_stop``. Servers that
    report neither (llama.cpp's, api.openai.com) leave it unknown."""
    stop = choice.get("stop_reason")
    return matched_stop(stop if stop is not None else choice.get("matched_stop"), stops)



def _message(m: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
        out["content"] = m.content or None
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _logprobs(raw: object, chat: bool) -> tuple[TokenLogprob, ...] | None:
    """OpenAI's logprobs (chat: ``{"content": [...]}``; completions: parallel lists) as our tokens."""
    if not isinstance(raw, Mapping):
        return None
    if chat:
        out = []
        for t in raw.get("content") or ():
            if isinstance(t, Mapping):
                out.append(TokenLogprob(token=str(t.get("token", "")), logprob=float(t.get("logprob") or 0.0),
                                        bytes=tuple(t["bytes"]) if t.get("bytes") is not None else None,
                                        top=tuple(TopLogprob(str(a.get("token", "")), float(a.get("logprob") or 0.0),
                                                             tuple(a["bytes"]) if a.get("bytes") is not None else None)
                                                  for a in t.get("top_logprobs") or () if isinstance(a, Mapping))))
        return tuple(out)
    tokens, values = raw.get("tokens") or [], raw.get("token_logprobs") or []
    tops = raw.get("top_logprobs") or [None] * len(tokens)
    return tuple(TokenLogprob(token=str(tok), logprob=float(lp or 0.0),
                              top=tuple(TopLogprob(str(k), float(v)) for k, v in (top or {}).items()))
                 for tok, lp, top in zip(tokens, values, tops, strict=False))


def _with_usage(chunk: Chunk, usage: object) -> Chunk:
    if isinstance(usage, Mapping):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        chunk.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        chunk.completion_tokens = int(usage.get("completion_tokens") or 0)
        chunk.cached_tokens = int(cached or 0)
    return chunk


def _error_message(body: object) -> str:
    """The message of an OpenAI error body (``{"error": {"message"}}``), FastAPI's ``{"detail"}`` or a bare
    ``{"message"}``; anything else is shown as it came."""
    if isinstance(body, Mapping):
        error = body.get("error")
        if isinstance(error, Mapping) and error.get("message"):
            return _clean(str(error["message"]))
        for key in ("error", "detail", "message"):
            if body.get(key):
                return _clean(str(body[key]))
    return _clean(str(body))


def _clean(message: str) -> str:
    """One tidy line: no embedded traceback, no runs of whitespace, bounded length."""
    message = _TRACEBACK.split(message, maxsplit=1)[0]
    message = " ".join(message.split())
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 1] + "…"
