"""The GPU gauges (edgecache/gpu.py): absent without NVML, with doctor saying why; read from NVML at scrape time
where it reports GPUs (a double of pynvml stands in for a GPU box). That the app's registry carries them is checked
by tests/test_deploy.py, whose exported names come from Metrics() on such a box."""

from __future__ import annotations

import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edgecache import doctor
from edgecache.gpu import GpuCollector, nvml_status
from tests.nvml_double import FakeGpu, nvml_module

GIB = 2**30
T4 = FakeGpu("Tesla T4", utilization=35, used=9 * GIB, total=15 * GIB)
A100 = FakeGpu("NVIDIA A100-SXM4-40GB", utilization=78, used=31 * GIB, total=40 * GIB)


def scrape(collector: GpuCollector) -> dict[tuple[str, str], float]:
    """(series name, gpu label) -> value, as Prometheus would parse /metrics."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {(s.name, s.labels.get("gpu", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def no_gpu_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "visible_gpu_memory_gb", lambda: 0.0)


def test_without_nvidia_ml_py_the_gauges_are_absent_and_doctor_says_why(monkeypatch: pytest.MonkeyPatch,
                                                                         no_gpu_visible: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    collector = GpuCollector()
    assert not collector.on and scrape(collector) == {}
    assert nvml_status() == (False, "off: NVML not found (nvidia-ml-py not installed)")
    check = doctor.check_gpu_metrics()
    assert (check.name, check.status, check.detail) == \
        ("gpu_metrics", "ok", "off: NVML not found (nvidia-ml-py not installed)")


def test_without_a_driver_the_gauges_are_absent_and_doctor_quotes_nvml(monkeypatch: pytest.MonkeyPatch,
                                                                       no_gpu_visible: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", nvml_module([T4], init_error="Driver Not Loaded"))
    assert scrape(GpuCollector()) == {}
    check = doctor.check_gpu_metrics()
    assert check.status == "ok" and check.detail == "off: no NVIDIA driver (nvmlInit: Driver Not Loaded)"


def test_doctor_warns_when_a_gpu_is_visible_but_the_gauges_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(doctor, "visible_gpu_memory_gb", lambda: 15.0)
    check = doctor.check_gpu_metrics()
    assert check.status == "warn" and check.detail.startswith("off: NVML not found")
    assert "edgecache[gpu]" in check.detail


def test_with_nvml_each_gpu_has_its_utilisation_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = nvml_module([T4, A100])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert scrape(GpuCollector()) == {
        ("edgecache_gpu_utilization_ratio", "0"): 0.35, ("edgecache_gpu_utilization_ratio", "1"): 0.78,
        ("edgecache_gpu_memory_used_bytes", "0"): 9 * GIB, ("edgecache_gpu_memory_used_bytes", "1"): 31 * GIB,
        ("edgecache_gpu_memory_total_bytes", "0"): 15 * GIB, ("edgecache_gpu_memory_total_bytes", "1"): 40 * GIB,
    }
    on, detail = nvml_status()
    assert on and detail.startswith("on: edgecache_gpu_utilization_ratio") and "2 GPU(s) (driver 550.54.15)" in \
        detail and "0: Tesla T4; 1: NVIDIA A100-SXM4-40GB" in detail
    check = doctor.check_gpu_metrics()
    assert check.status == "ok" and check.detail == detail


def test_each_scrape_reads_nvml_again(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGpu("Tesla T4", utilization=35, used=GIB, total=15 * GIB)
    monkeypatch.setitem(sys.modules, "pynvml", nvml_module([gpu]))
    collector = GpuCollector()
    assert scrape(collector)[("edgecache_gpu_utilization_ratio", "0")] == 0.35
    gpu.utilization, gpu.used = 78, 12 * GIB
    second = scrape(collector)
    assert second[("edgecache_gpu_utilization_ratio", "0")] == 0.78
    assert second[("edgecache_gpu_memory_used_bytes", "0")] == 12 * GIB


def test_a_gpu_without_a_utilisation_figure_keeps_its_memory_and_the_others_theirs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mig = FakeGpu("NVIDIA A100 MIG 1g.5gb", utilization=None, used=GIB, total=5 * GIB)
    monkeypatch.setitem(sys.modules, "pynvml", nvml_module([mig, T4]))
    values = scrape(GpuCollector())
    assert ("edgecache_gpu_utilization_ratio", "0") not in values
    assert values[("edgecache_gpu_utilization_ratio", "1")] == 0.35
    assert values[("edgecache_gpu_memory_total_bytes", "0")] == 5 * GIB

