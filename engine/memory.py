"""Keep freed memory in the process (glibc malloc settings).

glibc hands a freed block back to the kernel when it was mmap'ed (over a
threshold that starts at 128 KiB and follows the largest block freed) or
when the top of the heap holds more than the trim threshold. A training
step or a forward frees its activations at its end, so the next one takes
every page again through a page fault: the kernel zeroes it, and in a
virtual machine the host may have to map it too. On the 2-core AMD EPYC
machine (CPU family 26) a packed distill training step of an EAGLE-3 head
took a median 33,390 page faults and 0.355 s with glibc's defaults, and 0
faults and 0.320 s with the settings below (``python
benchmarks/bench_distill_step.py``: 64 answers, 3 rounds of 20 steps, both
in the same run).

The process keeps its peak heap instead of returning it between steps,
which long-running servers and training loops reach anyway at every step.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

#: glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: the largest mmap threshold glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX):
#: blocks up to it come from the heap and are reused
MMAP_THRESHOLD = 32 * 1024 * 1024
#: never trim the heap's top back to the kernel below this much free memory
#: (2 GiB, the largest value mallopt's int takes)
TRIM_THRESHOLD = 2**31 - 1

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Sets glibc's mmap and trim thresholds so freed blocks stay in the
    heap for the next step; True when applied (once per process), False
    where the C library is not glibc (e.g. musl, macOS): nothing changes."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
