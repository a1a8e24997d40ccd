"""Engines and an embedder that fault natively, for the start-up canary's tests (tests/test_canary.py).

They are named by ``engine.kind = "tests.canary_fakes:..."`` and ``semantic.embedder = "tests.canary_fakes:..."``,
the import-path form both registries take for a factory of one's own, so the canary's child process and the server
build them exactly as they would a real engine or embedder.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator, Sequence

import numpy as np

from edgecache.semantic.embedders import EmbedderOptions
from edgecache.engines.base import Chunk, GenerationRequest
from edgecache.settings import Settings
from tests.fakes import FakeEngine


class SegfaultingEngine(FakeEngine):
    """Kills its own process with SIGSEGV on its first generation, as llama.cpp's AMX matmul does, unless
    ``survives`` (the fault depends on the settings)."""

    def __init__(self, *, survives: bool) -> None:
        super().__init__(model_id="canary-fake")
        self.survives = survives

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        if not self.survives:
            os.kill(os.getpid(), signal.SIGSEGV)
        async for chunk in super().generate(request):
            yield chunk


def segfaults_unless_one_thread(settings: Settings) -> SegfaultingEngine:
    """Faults with the configured settings, works with the canary's safe ones (one engine thread)."""
    return SegfaultingEngine(survives=settings.engine.threads == 1)


def segfaults_always(settings: Settings) -> SegfaultingEngine:
    return SegfaultingEngine(survives=False)


class HangingEmbedder:
    """Never returns from its first embedding (a native call stuck in a spin or a deadlock)."""

    dim = 4
    version = "hanging-1"
    max_input_tokens = 64

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        while True:
            time.sleep(60)

    def fits(self, text: str) -> bool:
        return True


def hanging_embedder(options: EmbedderOptions) -> HangingEmbedder:
    return HangingEmbedder()


SLEEPER = "import time; time.sleep(300)"


class OrphaningEngine(SegfaultingEngine):
    """Starts a helper process that outlives it (as SGLang's scheduler processes would), then faults. The helper's
    command line ends with the test's data dir, so the test finds its own helpers and no other suite's."""

    def __init__(self, *, survives: bool, marker: str) -> None:
        super().__init__(survives=survives)
        self.marker = marker

    async def start(self) -> None:
        import subprocess
        import sys

        # inherits the canary child's stdout and stderr, and would hold them open for five minutes
        subprocess.Popen([sys.executable, "-c", SLEEPER, self.marker])
        await super().start()


def segfaults_leaving_a_process(settings: Settings) -> OrphaningEngine:
    return OrphaningEngine(survives=settings.engine.threads == 1, marker=settings.data_dir)
