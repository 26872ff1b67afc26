"""Keeps numba's on-disk kernel cache in step with the engine's sources.

numba keys a cached function by its own source file only (the file's
modification time and size). A kernel that calls or inlines kernels and
intrinsics of another file (``gguf_layers.decode_layers`` runs
``kv_pool._paged_attention``, ``cpu_ops`` and ``gemm_gguf`` kernels; every
kernel inlines ``simd``'s vectors) keeps its old machine code after that other
file changes: an edited attention would run in the Python loop and not in the
one-call layers, whose bits would then differ, and a benchmark would time the
old code. So every module of the engine's kernels ends with ``refresh(globals())``:
it fingerprints the sources of all of them (``SOURCES``) and, when the
fingerprint differs from the one recorded beside that module's cache (or none
is recorded), flushes the module's cached kernels once before any of them is
loaded. Editing any kernel file thus recompiles all of them on the next start
(tens of seconds, once); an unchanged tree loads them as before.
"""
from __future__ import annotations

import hashlib
import logging
from functools import cache
from pathlib import Path
from typing import Any

from numba.core.dispatcher import Dispatcher

log = logging.getLogger(__name__)

#: The engine's files whose numba code other kernels call or inline.
SOURCES = ("simd.py", "gemm_numba.py", "gemm_simd.py", "gemm_gguf.py", "cpu_ops.py", "kv_pool.py",
           "gguf_layers.py")
#: Suffix of the file, beside a module's cache index files, that records the fingerprint its kernels were built from.
RECORD_SUFFIX = ".kernel-sources"


@cache
def fingerprint() -> str:
    """sha256 over SOURCES' names and bytes, in order."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    return digest.hexdigest()


def _disk_cache(kernel: Dispatcher) -> Any:
    """numba's cache object of a dispatcher (a FunctionCache where cache=True)."""
    return getattr(kernel, "_cache", None)


def cached_kernels(namespace: dict) -> list[Dispatcher]:
    """The disk-cached numba functions defined in the module whose globals are `namespace`."""
    return [v for v in namespace.values()
            if isinstance(v, Dispatcher) and v.py_func.__module__ == namespace["__name__"]
            and hasattr(_disk_cache(v), "_cache_path")]


def record_path(namespace: dict) -> Path | None:
    """Where the fingerprint of the module's cached kernels is recorded (None: it has none)."""
    kernels = cached_kernels(namespace)
    if not kernels:
        return None
    return Path(_disk_cache(kernels[0])._cache_path) / (namespace["__name__"].rsplit(".", 1)[-1] + RECORD_SUFFIX)


def refresh(namespace: dict) -> bool:
    """Flushes the cached kernels of the module whose globals are `namespace`
    when the engine's kernel sources differ from those recorded for them, and
    records the current ones. Returns whether it flushed. Call it at the end
    of the module, before any of its kernels runs."""
    record = record_path(namespace)
    if record is None:
        return False
    now = fingerprint()
    try:
        if record.exists() and record.read_text().strip() == now:
            return False
        for kernel in cached_kernels(namespace):
            _disk_cache(kernel).flush()
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(now + "\n")
    except OSError as e:  # a cache numba cannot write either: nothing is kept to go stale
        log.debug("kernel cache of %s not refreshed: %s", namespace["__name__"], e)
        return False
    log.debug("kernel cache of %s flushed: the engine's kernel sources changed", namespace["__name__"])
    return True
