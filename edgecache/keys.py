"""The request key: a canonical hash of everything that decides what the model writes.

Two requests get the same key exactly when the engine would be asked the same thing: same model version, same
tenant and scenario namespace, same salt (the tenant plus a caller's own ``cache_salt``), same messages (system
prompt included) or prompt, same output-affecting parameters, tools, tool choice, response format, logprobs, n and
template variables: the whole :class:`~edgecache.engines.base.GenerationRequest`, which holds exactly the fields
that can change the output (:mod:`edgecache.http.request_surface` decides which those are), less the client's
prefix-cache hints, which change what the engine keeps and never what it writes.
Fields that only change the framing of the answer (``stream``, ``stream_options``, ``user``) are left out, so a
streaming request can be answered from a non-streaming one and the other way round.
"""

from __future__ import annotations

import hashlib

import msgspec

from edgecache.engines.base import GenerationRequest, answer_fields

# Bump when the layout below changes, so old entries can never be read under a new meaning.
KEY_SCHEMA = 2

_encoder = msgspec.json.Encoder()


def request_key(request: GenerationRequest, *, model_version: str, tenant: str, scenario: str) -> str:
    """A 32-hex-digit key. Built from a JSON array, so no field can run into its neighbour."""
    # The request struct omits its defaults when encoded, so a field nobody set never changes a key.
    canonical = (KEY_SCHEMA, model_version, tenant, scenario, answer_fields(request))
    return hashlib.blake2b(_encoder.encode(canonical), digest_size=16).hexdigest()


def is_cacheable(request: GenerationRequest) -> bool:
    """Sampling without a seed should differ from call to call: caching it would freeze one sample."""
    return request.params.temperature == 0.0 or request.params.seed is not None
