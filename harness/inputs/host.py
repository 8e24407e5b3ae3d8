"""Where a run happened: the host fingerprint a report carries.

Verdicts must not depend on the host, but margins do (a stock floor can be exactly zero on one CPU and not on
another), so a report says which dispatch lane produced its numbers: torch's CPU capability, what MKL and
oneDNN were asked to use, the CPU model and its vector extensions, the thread count and the accelerator.
Everything here is fixed for a host and an environment, so the same command on the same host still gives
the same report bytes.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["fingerprint", "summary"]

# The CPU flags that decide which GEMM and SDPA kernels a CPU build of torch dispatches to.
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                "amx_tile", "amx_bf16", "asimd", "sve")


@functools.cache
def _cpu() -> tuple[str, tuple[str, ...]]:
    """(CPU model name, its vector flags among VECTOR_FLAGS) from /proc/cpuinfo where there is one."""
    text = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        text = cpuinfo.read_text(errors="replace")
    model = re.search(r"^(?:model name|Model|cpu model)\s*:\s*(.+)$", text, re.MULTILINE)
    flags = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", text, re.MULTILINE)
    present = set(flags.group(1).split()) if flags else set()
    return (model.group(1).strip() if model else platform.processor() or platform.machine(),
            tuple(flag for flag in VECTOR_FLAGS if flag in present))


@functools.cache
def _library_versions() -> tuple[str, str]:
    """(MKL version, oneDNN version) as torch's build configuration states them ("" when not built in)."""
    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([^\s]+)", config)
    onednn = re.search(r"MKL-DNN (v[^\s]+)", config)
    return (mkl.group(1) if mkl else "", onednn.group(1) if onednn else "")


def _device() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"type": "cpu"}
    return {"type": "cuda", "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda or "", "capability": ".".join(map(str, torch.cuda.get_device_capability(0)))}


THREADS_ENV = "PARITY_THREADS"
DEFAULT_THREADS = 1


def threads_from_environment() -> int:
    """The CPU tier's intra-op thread count, ``PARITY_THREADS`` (default 1): measured floors depend on the
    reduction split, so it is fixed per run. One thread by default: the tiny models' ops are too small to share, and
    on 2 cores two threads took twice the CPU time of one in the AR checks (each op waking the other thread), while
    a run split over workers uses the cores. Anything but a positive integer is a ValueError naming the variable."""
    return positive_int_from_environment(THREADS_ENV, DEFAULT_THREADS,
                                         f"the CPU tier's intra-op threads; default {DEFAULT_THREADS}")


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
# Allocations up to this size come from the heap, freed memory is kept there for the next one
HEAP_ALLOCATIONS_UP_TO = 1 << 30


def keep_freed_memory() -> bool:
    """Has glibc's malloc serve tensors up to ``HEAP_ALLOCATIONS_UP_TO`` from its heap and keep what is freed.

    The CPU tier allocates and frees the same tensors thousands of times (a mask, a latent, a rollout per check
    and per kill item). By default each one over 128 KiB is a fresh ``mmap``, zero-filled page by page on first
    touch and unmapped on free: measured on 2 cores, a fifth of the gate's CPU time was the kernel's. Where the
    memory comes from changes no value. Forked ranks inherit the setting. False where the C library has no
    ``mallopt`` (not glibc), which changes nothing but the time."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(option, value) == 1 for option, value in (
        (_M_MMAP_THRESHOLD, HEAP_ALLOCATIONS_UP_TO), (_M_TRIM_THRESHOLD, 2 * HEAP_ALLOCATIONS_UP_TO - 1),
        (_M_TOP_PAD, 64 << 20)))


def freeze_what_collection_built() -> None:
    """Moves every object alive after collection (modules, the catalogue, tiny models) out of the garbage
    collector's reach for the rest of the run: they live that long anyway. Each full collection otherwise walks all
    of them again (about 450,000 objects: 0.4 s on idle cores, over 3 s on loaded ones, and pytest runs one in its
    cleanup after an interrupt, which made a stopped split run's workers slow to exit), and each walk writes to
    pages that forked ranks share with their parent."""
    gc.freeze()


def positive_int_from_environment(name: str, default: int, what: str) -> int:
    """``name``'s value as a positive integer, ``default`` when unset; anything else is a ValueError naming the
    variable, its value and ``what`` it sets."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={os.environ[name]!r}: expected a positive integer ({what})")
    return value


def fingerprint() -> dict[str, Any]:
    """The host as JSON-ready data: library builds, the ISA each was told to use, CPU, threads, device."""
    model, flags = _cpu()
    mkl, onednn = _library_versions()
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", "auto"),
        "mkl": {"version": mkl, "cbwr": os.environ.get("MKL_CBWR", "auto")},
        "onednn": {"version": onednn,
                   "max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "auto"))},
        "cpu": {"model": model, "vector_flags": list(flags), "machine": platform.machine()},
        "threads": torch.get_num_threads(),
        "device": _device(),
        "python": platform.python_version(),
    }


def summary(host: dict[str, Any]) -> str:
    """One line for the terminal and the markdown report."""
    device = host.get("device", {})
    where = device.get("name") or device.get("type", "?")
    return (f"torch {host.get('torch')} on {host.get('cpu', {}).get('model', '?')} ({where}); CPU capability "
            f"{host.get('cpu_capability')}, MKL {host.get('mkl', {}).get('version')} CBWR="
            f"{host.get('mkl', {}).get('cbwr')}, oneDNN {host.get('onednn', {}).get('version')} max ISA "
            f"{host.get('onednn', {}).get('max_cpu_isa')}, {host.get('threads')} threads")
