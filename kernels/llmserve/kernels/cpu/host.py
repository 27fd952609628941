"""What this machine's CPU is, read once from /proc/cpuinfo's first processor: its model
name, flags (instruction sets), family and model number. The one reader for everything
that keys on the CPU or names it: the kernels' build directory, the remembered GEMM
layouts, the CPU dtype choice and the benchmarks' machine facts. And its last-level
cache's size (sysfs), which timings of cold weights must exceed."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuFacts:
    model_name: str  # "AMD EPYC" (a virtual machine may name only the vendor); the platform's name without cpuinfo
    flags: frozenset[str]  # cpuinfo's flags: "avx512_bf16", "amx_tile", ...; empty without cpuinfo
    family: str | None  # cpuinfo's "cpu family" (AMD 25 = Zen 3/4, 26 = Zen 5), None where unknown
    model: str | None  # cpuinfo's "model"

    @property
    def key(self) -> str:
        """Model name and flags in one string, for keys of what is only valid on this CPU
        (-march=native code, timings)."""
        return f"{self.model_name}|{' '.join(sorted(self.flags))}"


def parse_cpuinfo(text: str) -> CpuFacts:
    """The facts of the first processor listed in `text` (/proc/cpuinfo's format)."""
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        fields.setdefault(key, value)
    return CpuFacts(model_name=fields.get("model name") or platform.processor() or platform.machine(),
                    flags=frozenset(fields.get("flags", "").split()), family=fields.get("cpu family"),
                    model=fields.get("model"))


@functools.cache
def cpu_facts() -> CpuFacts:
    """This machine's CPU (no flags where /proc/cpuinfo cannot be read)."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return parse_cpuinfo("")


def last_level_cache_bytes(cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache of this host (sysfs), 32 MiB where sysfs does not say."""
    sizes = []
    for path in cache_dir.glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 * 2**20)
