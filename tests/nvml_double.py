"""A stand-in for ``pynvml`` (the ``nvidia-ml-py`` package), for the GPU gauges' tests on a box without a GPU.

It has the calls :mod:`edgecache.gpu` makes, with nvidia-ml-py's shapes: ``nvmlInit()`` raises an ``NVMLError``
when there is no driver (its text is NVML's, e.g. "Driver Not Loaded"); ``nvmlDeviceGetName`` and
``nvmlSystemGetDriverVersion`` return ``str``; ``nvmlDeviceGetUtilizationRates`` has ``gpu`` and ``memory`` in
percent; ``nvmlDeviceGetMemoryInfo`` has ``total``, ``free`` and ``used`` in bytes. A GPU with ``utilization=None``
raises "Not Supported" for its utilisation, as a MIG slice does.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from types import SimpleNamespace


class NVMLError(Exception):
    pass


@dataclass
class FakeGpu:
    name: str
    utilization: int | None  # percent; None: NVML says "Not Supported"
    used: int
    total: int


def nvml_module(gpus: list[FakeGpu], *, driver: str = "550.54.15", init_error: str | None = None) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    module.NVMLError = NVMLError  # type: ignore[attr-defined]
    state = {"inits": 0}
    module.state = state  # type: ignore[attr-defined]

    def init() -> None:
        if init_error is not None:
            raise NVMLError(init_error)
        state["inits"] += 1

    def shutdown() -> None:
        if state["inits"] == 0:
            raise NVMLError("Uninitialized")
        state["inits"] -= 1

    def live() -> None:
        if state["inits"] == 0:
            raise NVMLError("Uninitialized")

    def count() -> int:
        live()
        return len(gpus)

    def handle(index: int) -> FakeGpu:
        live()
        if not 0 <= index < len(gpus):
            raise NVMLError("Invalid Argument")
        return gpus[index]

    def utilization(gpu: FakeGpu) -> SimpleNamespace:
        if gpu.utilization is None:
            raise NVMLError("Not Supported")
        return SimpleNamespace(gpu=gpu.utilization, memory=0)

    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlShutdown = shutdown  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = count  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = handle  # type: ignore[attr-defined]
    module.nvmlDeviceGetName = lambda gpu: gpu.name  # type: ignore[attr-defined]
    module.nvmlSystemGetDriverVersion = lambda: driver  # type: ignore[attr-defined]
    module.nvmlDeviceGetUtilizationRates = utilization  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = lambda gpu: SimpleNamespace(  # type: ignore[attr-defined]
        total=gpu.total, used=gpu.used, free=gpu.total - gpu.used)
    return module

