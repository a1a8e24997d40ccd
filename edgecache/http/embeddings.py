"""``POST /v1/embeddings``, served by the sentence embedder the box already hosts for its semantic layer.

OpenAI's request and response shapes: ``input`` a string or a list of strings, ``encoding_format`` ``float`` or
``base64`` (little-endian float32, what the openai SDK decodes), ``dimensions`` accepted only when it equals the
model's width (these models cannot shorten their vectors). Token-id input is refused: the ids would be another
tokenizer's.

Each text's vector has an exact cache of its own in the tenant's result store, keyed by the embedder's version
and the text: an embedding never goes stale for a fixed model, so it is kept for :data:`EMBEDDING_TTL_S`. The
vector is stored as base64 float32 in a :class:`~edgecache.stores.CachedAnswer`'s text, so every store backend
keeps it without a schema of its own. The response's ``X-EdgeCache`` is ``exact`` when every text was a hit.

``usage.prompt_tokens`` counts words (whitespace-separated): not every embedder here exposes its tokenizer.
"""

from __future__ import annotations

import base64
import hashlib
import time
from typing import Annotated, Literal

import msgspec
import numpy as np
from msgspec import Meta

from edgecache.errors import BadRequest
from edgecache.semantic.cache import SemanticCache
from edgecache.stores import CachedAnswer, ResultStore

EMBEDDING_TTL_S = 30 * 24 * 3600.0
MAX_INPUTS = 256
MAX_INPUT_CHARS = 32_768


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    # A string or a list of strings; OpenAI's token-id forms decode too, to be refused with a clear message.
    input: str | list[str | int | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


def texts_of(request: EmbeddingRequest, dim: int) -> list[str]:
    """The request's texts, checked: 400s name the field."""
    if request.dimensions is not None and request.dimensions != dim:
        raise BadRequest(f"dimensions must be {dim} (or absent): this embedder cannot shorten its vectors",
                         param="dimensions")
    value = request.input
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise BadRequest("input is empty; send a string or a list of strings", param="input")
    if not all(isinstance(t, str) for t in texts):
        raise BadRequest("token-id input is not supported: send text", param="input")
    if len(texts) > MAX_INPUTS:
        raise BadRequest(f"at most {MAX_INPUTS} inputs per request", param="input")
    for i, text in enumerate(texts):
        assert isinstance(text, str)
        if not text:
            raise BadRequest("an input is empty", param=f"input[{i}]" if not isinstance(value, str) else "input")
        if len(text) > MAX_INPUT_CHARS:
            raise BadRequest(f"an input is longer than {MAX_INPUT_CHARS} characters",
                             param=f"input[{i}]" if not isinstance(value, str) else "input")
    return texts  # type: ignore[return-value]


def embedding_key(embedder_version: str, text: str) -> str:
    return "emb:" + hashlib.blake2b(msgspec.json.encode((embedder_version, text)), digest_size=16).hexdigest()


async def embed(request: EmbeddingRequest, *, model_id: str, semantic: SemanticCache,
                store: ResultStore) -> tuple[bytes, bool]:
    """The response body, and whether every vector came from the cache."""
    embedder = semantic.embedder
    texts = texts_of(request, embedder.dim)
    keys = [embedding_key(embedder.version, t) for t in texts]
    vectors: list[np.ndarray | None] = []
    for key in keys:
        hit = store.get_memory(key) or await store.get(key)
        vectors.append(np.frombuffer(base64.b64decode(hit.text), dtype="<f4") if hit is not None else None)
    missing = [i for i, v in enumerate(vectors) if v is None]
    if missing:
        fresh = await semantic.embed_many([texts[i] for i in missing])
        now = time.time()
        for row, i in enumerate(missing):
            vector = np.ascontiguousarray(fresh[row], dtype="<f4")
            vectors[i] = vector
            await store.put(keys[i], CachedAnswer(text=base64.b64encode(vector.tobytes()).decode(),
                                                  finish_reason="embedding", prompt_tokens=len(texts[i].split()),
                                                  completion_tokens=0, created_at=now,
                                                  expires_at=now + EMBEDDING_TTL_S), tag="embeddings")
    data = []
    for i, vector in enumerate(vectors):
        assert vector is not None
        encoded: list[float] | str = (base64.b64encode(vector.astype("<f4").tobytes()).decode()
                                      if request.encoding_format == "base64" else vector.astype(float).tolist())
        data.append(Embedding(index=i, embedding=encoded))
    words = sum(len(t.split()) for t in texts)
    body = msgspec.json.encode(EmbeddingList(data=data, model=model_id,
                                             usage=EmbeddingUsage(prompt_tokens=words, total_tokens=words)))
    return body, not missing
