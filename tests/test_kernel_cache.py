"""engine.kernel_cache: numba keys a cached kernel by its own file only, so a
change to a kernel another file calls or inlines must flush the callers'
cached machine code (the one-call layers would otherwise run an edited
attention's old code)."""
from __future__ import annotations

import importlib
import sys

import pytest

from specdec.engine import cpu_ops, gemm_gguf, gemm_numba, gemm_simd, gguf_layers, kernel_cache, kv_pool

KERNEL_MODULES = (kv_pool, cpu_ops, gemm_numba, gemm_simd, gemm_gguf, gguf_layers)


def test_every_kernel_module_records_the_sources_its_cache_was_built_from():
    for module in KERNEL_MODULES:
        namespace = vars(module)
        assert kernel_cache.cached_kernels(namespace), module.__name__
        record = kernel_cache.record_path(namespace)
        assert record is not None and record.read_text().strip() == kernel_cache.fingerprint(), module.__name__
    assert {m.__name__.rsplit(".", 1)[-1] + ".py" for m in KERNEL_MODULES} <= set(kernel_cache.SOURCES)
    assert gguf_layers.decode_layers in kernel_cache.cached_kernels(vars(gguf_layers))
    assert kv_pool.exp_nonpositive not in kernel_cache.cached_kernels(vars(cpu_ops))  # imported, not defined there


@pytest.fixture
def kernel_module(tmp_path, monkeypatch):
    """A module with one disk-cached numba function, its cache in tmp_path, called once (so its index holds it)."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cache"))
    from numba.core import config
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "kc_probe.py").write_text(
        "import numba\n\n\n@numba.njit(cache=True)\ndef twice(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("kc_probe")
    yield module
    sys.modules.pop("kc_probe", None)


def test_changed_sources_flush_the_modules_cached_kernels_once(kernel_module, monkeypatch):
    namespace = vars(kernel_module)
    assert kernel_module.twice(21) == 42
    index = kernel_module.twice._cache._cache_file
    assert len(index._load_index()) == 1  # the compiled overload is on disk
    monkeypatch.setattr(kernel_cache, "fingerprint", lambda: "sources A")
    assert kernel_cache.refresh(namespace)  # nothing recorded yet: flushed
    assert index._load_index() == {}
    assert kernel_cache.record_path(namespace).read_text().strip() == "sources A"
    kernel_module.twice.recompile()  # compiled and saved again, as the next start would
    assert len(index._load_index()) == 1
    assert not kernel_cache.refresh(namespace)  # the same sources: kept
    assert len(index._load_index()) == 1
    monkeypatch.setattr(kernel_cache, "fingerprint", lambda: "sources B")
    assert kernel_cache.refresh(namespace)  # another file changed: flushed again
    assert index._load_index() == {}


def test_a_module_without_cached_kernels_is_left_alone():
    assert kernel_cache.record_path({"__name__": "nothing", "x": 1}) is None
    assert not kernel_cache.refresh({"__name__": "nothing", "x": 1})
