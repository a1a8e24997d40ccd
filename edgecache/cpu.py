"""What this box's CPU is, as far as the native code co-hosted here cares: its model name and instruction-set flags.

llama.cpp chooses kernels and weight layouts by these flags. One choice matters for not crashing: on CPUs with
AMX (Intel Sapphire Rapids and later: AWS m7i/c7i/r7i, GCP C3/C4, Azure v6) llama.cpp repacks the weights into its
AMX extra buffer type, and llama.cpp 0.3.x's AMX matmul faults on the first decode (reported on llama.cpp's tracker as #20824). So the
``engine.extra_buffer_types`` setting defaults to ``auto``: off where the CPU has AMX, on elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

ExtraBufferTypes = Literal["auto", "on", "off"]

CPUINFO = Path("/proc/cpuinfo")
# Any of these flags means llama.cpp may repack weights into its AMX buffer type.
AMX_FLAGS = frozenset({"amx_int8", "amx_tile", "amx_bf16"})
# The flags llama.cpp's x86 kernels choose by, in the order `doctor` shows them.
LLAMACPP_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                  "amx_tile", "amx_int8", "amx_bf16")


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first processor's ``flags`` from /proc/cpuinfo (empty where there is no such file: not Linux x86)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The first processor's ``model name`` ("unknown" where /proc/cpuinfo does not say)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return "unknown"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return "unknown"


def has_amx(flags: Iterable[str]) -> bool:
    return not AMX_FLAGS.isdisjoint(flags)


def extra_buffer_types_on(choice: ExtraBufferTypes, flags: Iterable[str]) -> bool:
    """Whether llama.cpp may use its extra buffer types (weight repacking): ``auto`` is off where the CPU has AMX."""
    if choice == "auto":
        return not has_amx(flags)
    return choice == "on"


def llamacpp_flags(flags: Iterable[str]) -> list[str]:
    """Of :data:`LLAMACPP_FLAGS`, those this CPU has."""
    have = set(flags)
    return [flag for flag in LLAMACPP_FLAGS if flag in have]
