"""The request key: a canonical hash of everything that decides what the model writes.

Two requests get the same key exactly when the engine would be asked the same thing: same model version, same
tenant and scenario namespace, same salt (the tenant plus a caller's own ``cache_salt``), same messages (system
prompt included) or prompt, same output-affecting parameters, tools, tool choice, response format, logprobs, n and
template variables: the whole :class:`~edgecache.engines.base.GenerationRequest`, which holds exactly the fields
that can change the output (:mod:`edgecache.http.request_surface` decides which those are), less the client's
prefix-cache hints, which change what the engine keeps and never what it writes.
Fields that only change the framing of the answer (``stream``, ``stream_options``, ``user``) are left out, so a
streaming request can be answered from a non-streaming one and the other way round.

``max_tokens`` is left out too where it cannot change the answer's beginning (:func:`prefix_stable`): then a stored
answer serves any ``max_tokens`` it covers, cut at its token ends where the request asks for fewer
(:func:`edgecache.stores.serve_within`). Such a key is made with ``max_tokens`` 0, which no request has, so it never
equals a key that holds ``max_tokens``; answers that cannot be cut (no token ends) stay under the key with it.
"""

from __future__ import annotations

import hashlib

import msgspec

from edgecache.engines.base import GenerationRequest, answer_fields

# Bump when the layout below changes, so old entries can never be read under a new meaning. 3: keys without
# max_tokens (an entry under a schema-2 key is never looked up again, so never read as covering other max_tokens).
KEY_SCHEMA = 3

_encoder = msgspec.json.Encoder()


def request_key(request: GenerationRequest, *, model_version: str, tenant: str, scenario: str,
                any_max_tokens: bool = False) -> str:
    """A 32-hex-digit key. Built from a JSON array, so no field can run into its neighbour. ``any_max_tokens``: the
    key of every ``max_tokens`` of the request (only for a :func:`prefix_stable` one)."""
    fields = answer_fields(request)
    if any_max_tokens:
        fields = msgspec.structs.replace(fields, params=msgspec.structs.replace(fields.params, max_tokens=0))
    # The request struct omits its defaults when encoded, so a field nobody set never changes a key.
    canonical = (KEY_SCHEMA, model_version, tenant, scenario, fields)
    return hashlib.blake2b(_encoder.encode(canonical), digest_size=16).hexdigest()


def is_cacheable(request: GenerationRequest) -> bool:
    """Sampling without a seed should differ from call to call: caching it would freeze one sample."""
    return request.params.temperature == 0.0 or request.params.seed is not None


def prefix_stable(request: GenerationRequest, engine_rule: str) -> bool:
    """Whether the request's answer for a smaller ``max_tokens`` is the beginning of its answer for a larger one, and
    the engine reports the token ends a stored answer is cut at, so ``max_tokens`` can leave the key.

    ``engine_rule`` is the engine's :attr:`~edgecache.engines.base.Engine.prefix_stable`: "" (it reports no token
    ends: ``max_tokens`` stays in every key), ``greedy`` (temperature 0 decodes the same tokens whatever the limit)
    or ``seeded`` (so does sampling with a seed: the sampler's draws depend on the position, not on the limit).
    Answers that come whole rather than as text (active tools, ``n`` > 1, logprobs) and ``echo`` keep
    ``max_tokens`` in the key: no engine reports token ends for them."""
    if not engine_rule or request.n != 1 or request.logprobs is not None or request.echo \
            or (request.tools and request.tool_choice != "none"):
        return False
    if request.params.temperature == 0.0:
        return True
    return engine_rule == "seeded" and request.params.seed is not None
