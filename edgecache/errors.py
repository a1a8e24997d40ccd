"""The errors EdgeCache raises, each knowing its HTTP status and OpenAI error type.

::

    EdgeCacheError                  500 server_error
     ├─ BadRequest                  400 invalid_request_error
     │   └─ PromptTooLong               400 context_length_exceeded (the prompt does not fit the context)
     ├─ Unauthorized                401 authentication_error
     ├─ Forbidden                   403 permission_error (a policy the plan does not allow)
     ├─ NotFound                    404 not_found_error (unknown model, unknown route)
     ├─ PayloadTooLarge             413 invalid_request_error
     ├─ Overloaded                  429 rate_limit_error (carries Retry-After)
     ├─ ClientGone                  499 (the client hung up first; nobody reads the response)
     ├─ EngineError                 502 engine_error (the model runtime failed or aborted)
     ├─ NotReady                    503 service_unavailable (model still loading)
     └─ NotCached                   504 not_cached (only-if-cached, and nothing cached answers)

One handler in :mod:`edgecache.http.app` renders any of them as the OpenAI error body; nothing else catches broadly.
"""

from __future__ import annotations

import msgspec


class EdgeCacheError(Exception):
    status: int = 500
    error_type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def headers(self) -> dict[str, str]:
        return {}


class BadRequest(EdgeCacheError):
    status = 400
    error_type = "invalid_request_error"


class PromptTooLong(BadRequest):
    """The prompt does not fit the model's context. ``tokens`` is its count (or a lower bound that already does
    not fit), ``context`` the context's size in tokens: each API words it its own way (Anthropic's clients read
    "prompt is too long: N tokens > M maximum")."""

    code = "context_length_exceeded"

    def __init__(self, message: str, *, tokens: int, context: int, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.tokens = tokens
        self.context = context


class Unauthorized(EdgeCacheError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(EdgeCacheError):
    """Authenticated, but the tenant's plan does not allow what was asked (a cache policy)."""

    status = 403
    error_type = "permission_error"


class NotFound(EdgeCacheError):
    status = 404
    error_type = "not_found_error"


class ModelNotFound(NotFound):
    code = "model_not_found"


class PayloadTooLarge(EdgeCacheError):
    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class Overloaded(EdgeCacheError):
    status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ClientGone(EdgeCacheError):
    """The client closed its connection before its answer was ready: what the request held is released. 499 is
    nginx's "client closed request"; it shows in the access log, never on the wire (nobody is there)."""

    status = 499
    error_type = "client_gone"


class EngineError(EdgeCacheError):
    """The model runtime failed or aborted a generation. Nothing produced by it is cached."""

    status = 502
    error_type = "engine_error"


class StorageUnavailable(EdgeCacheError):
    """A store could not do what was asked of it (a flush on a full or damaged disk); /health says why."""

    status = 503
    error_type = "storage_unavailable"


class NotReady(EdgeCacheError):
    status = 503
    error_type = "service_unavailable"


class NotCached(EdgeCacheError):
    """The caller allowed only a cached answer (``Cache-Control: only-if-cached``) and none was there. HTTP's answer
    to that is 504 (RFC 9111, 5.2.1.7); nothing was computed."""

    status = 504
    error_type = "not_cached"
    code = "only_if_cached"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


def error_body(exc: EdgeCacheError) -> ErrorBody:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return ErrorBody(ErrorDetail(message=exc.message, type=exc.error_type, param=exc.param, code=exc.code))
