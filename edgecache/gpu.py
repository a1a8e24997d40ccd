"""GPU utilisation and memory from NVML, read at scrape time: the box's GPU busy share beside what the cache saved.

:class:`GpuCollector` is a ``prometheus_client`` collector. On each scrape it asks NVML (``pynvml``, from the
``nvidia-ml-py`` package in the ``gpu`` extra) for every GPU on the box, by NVML index (what ``nvidia-smi`` lists,
whatever ``CUDA_VISIBLE_DEVICES`` says):

- ``edgecache_gpu_utilization_ratio{gpu}``: the share of the last sample period (1/6 s to 1 s, by model) in which
  a kernel ran, 0-1.
- ``edgecache_gpu_memory_used_bytes{gpu}`` and ``edgecache_gpu_memory_total_bytes{gpu}``.

Where NVML is absent (the package is not installed, or ``nvmlInit`` fails: no NVIDIA driver) the collector yields
nothing, so a CPU box exports no GPU series rather than zeros, and :func:`nvml_status` says why for
``edgecache doctor``. A GPU NVML cannot read at scrape time (lost, or the figure not supported, as on a MIG slice)
is left out of that scrape.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from types import ModuleType

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

UTILIZATION = "edgecache_gpu_utilization_ratio"
MEMORY_USED = "edgecache_gpu_memory_used_bytes"
MEMORY_TOTAL = "edgecache_gpu_memory_total_bytes"


def load_nvml() -> tuple[ModuleType | None, str]:
    """(pynvml, "") once ``nvmlInit`` has succeeded, else (None, why not). NVML counts its inits, so each caller
    may init it again."""
    try:
        pynvml = importlib.import_module("pynvml")
    except ImportError:
        return None, "NVML not found (nvidia-ml-py not installed)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError and its per-code subclasses: no driver, no libnvidia-ml.so
        return None, f"no NVIDIA driver (nvmlInit: {exc})"
    return pynvml, ""


def nvml_status() -> tuple[bool, str]:
    """Whether the GPU gauges are on, and a line saying so: "on: ..." with the GPUs NVML sees, or "off: ..." with
    why (what ``edgecache doctor`` prints)."""
    pynvml, why = load_nvml()
    if pynvml is None:
        return False, f"off: {why}"
    try:
        count = pynvml.nvmlDeviceGetCount()
        names = [_text(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
    except Exception as exc:
        return False, f"off: NVML started but cannot list the GPUs ({exc})"
    finally:
        _shutdown(pynvml)
    if not count:
        return False, f"off: NVML (driver {driver}) sees no GPU"
    return True, f"on: {UTILIZATION}, {MEMORY_USED}, {MEMORY_TOTAL} for {count} GPU(s) (driver {driver}): " + "; ".join(
        f"{i}: {name}" for i, name in enumerate(names))


class GpuCollector(Collector):
    """Registered on an app's registry; reads NVML when scraped, and nothing at all where NVML is absent."""

    def __init__(self) -> None:
        self._nvml, self.why_off = load_nvml()

    @property
    def on(self) -> bool:
        return self._nvml is not None

    def describe(self) -> Iterable[Metric]:
        # The names this collector may export, whether or not NVML is here (the registry checks them for clashes).
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        nvml = self._nvml
        if nvml is None:
            return []
        utilization, used, total = self._families()
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception as exc:
            log.debug("NVML: no device count: %s", exc)
            return []
        for i in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
            except Exception as exc:
                log.debug("NVML: GPU %d: %s", i, exc)
                continue
            gpu = [str(i)]
            try:
                utilization.add_metric(gpu, nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
            except Exception as exc:  # NotSupported on a MIG slice; GPU lost
                log.debug("NVML: GPU %d utilisation: %s", i, exc)
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                used.add_metric(gpu, float(memory.used))
                total.add_metric(gpu, float(memory.total))
            except Exception as exc:
                log.debug("NVML: GPU %d memory: %s", i, exc)
        return [family for family in (utilization, used, total) if family.samples]

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(UTILIZATION, "Share of the last NVML sample period in which the GPU ran a kernel (0-1).",
                              labels=["gpu"]),
            GaugeMetricFamily(MEMORY_USED, "GPU memory in use, all processes, in bytes.", labels=["gpu"]),
            GaugeMetricFamily(MEMORY_TOTAL, "GPU memory in all, in bytes.", labels=["gpu"]),
        )


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _shutdown(pynvml: ModuleType) -> None:
    try:
        pynvml.nvmlShutdown()
    except Exception:  # an init that is not ours to undo
        pass
