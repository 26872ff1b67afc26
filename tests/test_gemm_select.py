"""The GEMM selector: its row-count invariance check rejects GEMMs whose rows
depend on the row count (fakes that do so on purpose) and accepts one that
does not; forcing a rejected path refuses; "auto" skips it; the choice is
cached on disk. The real paths on real models: test_llama_engine.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specdec.engine import gemm_select, llama
from specdec.engine.checkpoint import Checkpoint
from specdec.engine.gemm_select import GemmRefused, check_row_counts, invariance_failure, select
from specdec.engine.llama import LlamaEngine


def weights(dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    return [("qkv", torch.randn(24, 16, generator=gen).to(dtype), torch.randn(24, generator=gen).to(dtype)),
            ("down", torch.randn(16, 40, generator=gen).to(dtype), None),
            ("qkv", torch.randn(24, 16, generator=gen).to(dtype), torch.randn(24, generator=gen).to(dtype))]


def rowwise(w, b):
    """Exactly row-invariant: each row is computed by itself, the same way."""
    def f(x):
        y = torch.stack([(w * row).sum(1) for row in x])
        return y + b if b is not None else y
    return f


def epsilon_per_row_count(w, b):
    """x W^T plus an epsilon that grows with the row count."""
    return lambda x: rowwise(w, b)(x) + x.shape[0] * 1e-3


def other_order_from(n_min):
    """Sums in another order (float64, rounded once) from n_min rows on, the
    way a BLAS switches kernels for large inputs."""
    def make(w, b):
        def f(x):
            if x.shape[0] < n_min:
                return rowwise(w, b)(x)
            y = (x.double() @ w.double().T).float()
            return y + b if b is not None else y
        return f
    return make


def test_row_counts_cover_decode_every_verification_and_prefill_chunks():
    counts = check_row_counts(512)
    assert set(range(1, 18)) <= set(counts) and 512 in counts and any(n % 2 for n in counts if n > 32)
    assert max(check_row_counts(64)) == 64 and max(check_row_counts(33)) == 33


def test_check_accepts_a_row_invariant_gemm():
    assert invariance_failure(rowwise, weights(), check_row_counts(128), torch.float32) is None


def test_check_rejects_a_row_count_dependent_epsilon():
    failure = invariance_failure(epsilon_per_row_count, weights(), check_row_counts(128), torch.float32)
    assert failure == ("qkv weight 24x16 (torch.float32): row 0 of a 2-row input differs from the same row "
                       "computed alone")


def test_check_rejects_a_kernel_switch_at_large_row_counts():
    failure = invariance_failure(other_order_from(60), weights(), check_row_counts(512), torch.float32)
    assert failure is not None and "of a 64-row input" in failure
    # the same GEMM passes when the engine never feeds it that many rows
    assert invariance_failure(other_order_from(60), weights(), check_row_counts(33), torch.float32) is None


def test_wide_weights_are_checked_whole_up_to_batches_and_on_a_slice_beyond(monkeypatch):
    """An LM head wider than SLICE_OUT_FEATURES: every row count up to
    SLICE_FROM_ROWS runs on the whole weight, larger ones on a slice; a
    kernel switch is caught on either."""
    monkeypatch.setattr(gemm_select, "SLICE_OUT_FEATURES", 16)
    head = [("lm_head", torch.randn(40, 16, generator=torch.Generator().manual_seed(5)), None)]
    seen: dict[int, set[int]] = {}

    def recording(w, b):
        f = other_order_from(100)(w, b)

        def g(x):
            seen.setdefault(w.shape[0], set()).add(x.shape[0])
            return f(x)
        return g

    failure = invariance_failure(recording, head, check_row_counts(512), torch.float32)
    assert failure == ("lm_head weight 40x16 (its first 16 output rows) (torch.float32): row 0 of a 128-row input "
                       "differs from the same row computed alone")
    assert max(seen[40]) == gemm_select.SLICE_FROM_ROWS and seen[16] == {1, 128}
    failure = invariance_failure(other_order_from(60), head, check_row_counts(512), torch.float32)
    assert failure is not None and failure.startswith("lm_head weight 40x16 (torch.float32)") and "64-row" in failure
    assert invariance_failure(rowwise, head, check_row_counts(512), torch.float32) is None


def serving_ms(ms: float) -> dict[str, float]:
    """A cached path's timings: ms at every row count serving scores (its score: ms)."""
    return {str(n): ms for n in gemm_select.TIMED_ROWS}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory, on a machine taken as idle (timings cached)."""
    monkeypatch.setenv(gemm_select.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(gemm_select, "machine_busy", lambda: False)
    return tmp_path


@pytest.fixture
def aten_breaks(monkeypatch):
    """The real check, except that "aten" fails it (as MKL does on some CPUs);
    counts the checks run."""
    calls = []
    real = gemm_select.invariance_failure

    def check(make_linear, w, row_counts, dtype):
        path = make_linear(w[0][1], w[0][2]).path  # a Linear
        calls.append(path.name)
        if path.name == "aten":
            return "qkv weight 24x16 (torch.float32): row 3 of a 6-row input differs from the same row computed alone"
        return real(make_linear, w, row_counts, dtype)

    monkeypatch.setattr(gemm_select, "invariance_failure", check)
    return calls


def test_forcing_a_path_that_breaks_invariance_refuses_with_the_shape_and_row_count(cache, aten_breaks):
    with pytest.raises(GemmRefused, match=r"gemm='aten' breaks row-count invariance .*qkv weight 24x16.*6-row input"):
        select(weights(), torch.float32, 1, "aten", max_rows=64)


def test_auto_never_selects_a_rejected_path_and_caches_its_choice(cache, aten_breaks):
    chosen = select(weights(), torch.float32, 1, "auto", max_rows=64)
    assert chosen.path.name != "aten" and len(chosen.linears) == 3
    report = chosen.report
    assert report["paths"]["aten"]["failure"] and "ms" not in report["paths"]["aten"]
    timed = [n for n, e in report["paths"].items() if e["failure"] is None]
    assert chosen.path.name == gemm_select.fastest({n: report["scores"][n] for n in timed})
    assert report["scores"][chosen.path.name] == pytest.approx(
        sum(w * report["paths"][chosen.path.name]["ms"][str(n)] for n, w in gemm_select.SERVING_ROWS.items()), abs=2e-3)
    assert all(set(report["paths"][n]["ms"]) == {str(r) for r in gemm_select.TIMED_ROWS} for n in timed)
    (file,) = cache.glob("*.json")
    stored = json.loads(file.read_text())
    assert stored["choice"] == chosen.path.name
    assert stored["key"]["cpu"] == gemm_select.cpu_model() and stored["key"]["torch"] == torch.__version__
    assert stored["key"]["shapes"] == {"qkv:24x16+b": 2, "down:16x40": 1} and stored["key"]["threads"] == 1

    checks = len(aten_breaks)
    again = select(weights(), torch.float32, 1, "auto", max_rows=64)
    assert again.path == chosen.path and len(aten_breaks) == checks  # from the cache: nothing re-checked
    with pytest.raises(GemmRefused):  # a cached verdict refuses a forced path too
        select(weights(), torch.float32, 1, "aten", max_rows=64)
    select(weights(), torch.float32, 2, "auto", max_rows=64)  # another thread count: checked anew
    assert len(aten_breaks) > checks and len(list(cache.glob("*.json"))) == 2


def test_a_near_tie_between_paths_of_different_bits_is_broken_by_a_fixed_order():
    fastest = gemm_select.fastest
    margin = gemm_select.TIE_MARGIN
    # numba1 1 % ahead of simd-l1 (different bits): the order decides, whichever the noise favoured
    assert fastest({"numba1": 17.3, "simd-l1": 17.5, "onednn": 18.7}) == "simd-l1"
    assert fastest({"numba1": 17.5, "simd-l1": 17.3, "onednn": 18.7}) == "simd-l1"
    # beyond the margin speed decides
    assert fastest({"numba1": 15.0, "simd-l1": 15.0 * (1 + 2 * margin)}) == "numba1"
    assert fastest({"simd-dpbf16": 10.0, "simd-l1": 10.0 * (1 + 2 * margin)}) == "simd-dpbf16"
    # a tie with bfloat16 activations goes to float32 ones
    assert fastest({"simd-dpbf16": 10.0, "simd-l1": 10.0 * (1 + margin / 2)}) == "simd-l1"
    # among paths of the same bits the fastest: simd comes first in the order, simd-l1 is faster
    assert fastest({"simd": 10.3, "simd-l1": 10.0, "numba": 10.1}) == "simd-l1"
    assert fastest({"simd": 10.0, "simd-l1": 10.3, "numba": 10.1}) == "simd"
    # a same-bits sibling is kept only where it is a candidate
    assert fastest({"numba1": 10.0, "onednn": 10.2}) == "numba1"
    assert fastest({"aten": 10.0}) == "aten"


def test_timings_taken_on_a_busy_machine_are_not_cached(cache, monkeypatch):
    monkeypatch.setattr(gemm_select, "machine_busy", lambda: True)
    chosen = select(weights(), torch.float32, 1, "auto", max_rows=32)
    assert chosen.report["paths"][chosen.path.name]["busy"]
    (file,) = cache.glob("*.json")
    stored = json.loads(file.read_text())
    assert "choice" not in stored and all("ms" not in e and "failure" in e for e in stored["paths"].values())
    monkeypatch.setattr(gemm_select, "machine_busy", lambda: False)
    again = select(weights(), torch.float32, 1, "auto", max_rows=32)  # times again, now cached
    assert json.loads(file.read_text())["choice"] == again.path.name


@pytest.mark.parametrize("busy", [False, True])
def test_timings_of_a_busy_machine_call_a_wider_near_tie(cache, monkeypatch, busy):
    """Timed idle, a path 10 % ahead of the others wins; timed busy, where
    paths swap order by more than that between starts, the fixed order decides
    within BUSY_TIE_MARGIN, so replicas started under load mostly agree."""
    ok = [n for n, e in select(weights(), torch.float32, 1, "auto", max_rows=32).report["paths"].items()
          if e["failure"] is None]
    first = min(ok, key=gemm_select.TIE_ORDER.index)
    same = next((g for g in gemm_select.SAME_BITS if first in g), (first,))
    others = [n for n in ok if n not in same]  # paths of other bits than the fixed order's choice
    if not others:
        pytest.skip(f"the invariant paths on this CPU compute one arithmetic: {ok}")
    last = max(others, key=gemm_select.TIE_ORDER.index)  # 10 % ahead of the rest
    for f in cache.glob("*.json"):
        f.unlink()  # time again

    def timed(paths, weights, dtype, rows, **kwargs):
        return {p.name: {n: (1.0 if p.name == last else 1.1) * n for n in rows} for p in paths}
    monkeypatch.setattr(gemm_select, "time_paths", timed)
    monkeypatch.setattr(gemm_select, "machine_busy", lambda: busy)
    chosen = select(weights(), torch.float32, 1, "auto", max_rows=32)
    margin = gemm_select.BUSY_TIE_MARGIN if busy else gemm_select.TIE_MARGIN
    assert chosen.report["tie_margin"] == margin
    assert (chosen.path.name == last) != busy
    assert chosen.path.name == gemm_select.fastest(chosen.report["scores"], margin)


def test_forced_linears_compute_x_wt_plus_b(cache):
    w = weights()
    chosen = select(w, torch.float32, 1, "onednn", max_rows=32)
    x = torch.randn(5, 16)
    assert torch.allclose(chosen.linears[0](x), x @ w[0][1].T + w[0][2], atol=1e-5)


def test_unknown_path_is_named():
    with pytest.raises(ValueError, match="gemm must be"):
        select(weights(), torch.float32, 1, "mkl")


def test_scorer_exports_the_engine_choice(stories_path, cache):
    from prometheus_client import REGISTRY

    from specdec.engine.config import EngineConfig
    from specdec.engine.factory import build_engine
    from specdec.scorer_svc.server import export_gemm_choice

    engine = build_engine(EngineConfig(stories_path, kv_capacity_tokens=64))
    export_gemm_choice(engine)
    labels = {"path": engine.gemm, "dtype": "float32", "cpu": gemm_select.cpu_model(),
              "threads": str(engine.num_threads), "forced": "false", "gguf_layouts": ""}  # not a GGUF model
    assert REGISTRY.get_sample_value("specdec_engine_gemm_info", labels) == 1.0
    timed = engine.gemm_report["paths"][engine.gemm]["ms"]
    assert REGISTRY.get_sample_value("specdec_engine_gemm_ms", {"path": engine.gemm, "rows": "1"}) == timed["1"]


def test_a_path_the_cpu_cannot_run_is_refused_by_name_and_skipped_by_auto(cache, monkeypatch):
    """oneDNN's bfloat16 kernels raise on a CPU without AVX512-BW/VL/DQ (an
    AVX2-only AMD EPYC): that is the path's verdict, not a crash of the engine;
    the CPU's flags are part of the cache key (the model name "AMD EPYC"
    covers CPUs with and without AVX-512)."""
    real_init = gemm_select.Linear.__init__

    def init(self, weight, bias, path, quantized=None):
        if path.kind == "onednn":
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw\nmore")
        real_init(self, weight, bias, path, quantized)

    monkeypatch.setattr(gemm_select.Linear, "__init__", init)
    with pytest.raises(GemmRefused, match=r"gemm='onednn' cannot run on this CPU .*not supported by this CPU "
                                          r"\(torch.float32\): mkldnn_reorder_linear_weight: bf16 path needs"):
        select(weights(), torch.float32, 1, "onednn", max_rows=32)
    chosen = select(weights(), torch.float32, 1, "auto", max_rows=32)
    assert chosen.path.kind != "onednn" and chosen.path.name in ("aten", "numba", "numba1", "numba6")
    assert chosen.report["paths"]["onednn-unpadded"]["failure"].startswith(gemm_select.UNSUPPORTED)
    stored = json.loads(next(cache.glob("*.json")).read_text())["key"]
    assert gemm_select.cache_key(weights(), torch.float32, 1, check_row_counts(32)) == stored
    monkeypatch.setattr(gemm_select, "cpu_flags", lambda: {"avx2", "avx512f"})
    assert gemm_select.cache_key(weights(), torch.float32, 1, check_row_counts(32)) != stored


def test_an_onednn_isa_cap_below_bf16_means_no_native_bf16(monkeypatch):
    monkeypatch.setattr(gemm_select, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    assert gemm_select.native_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_bf16")
    assert gemm_select.native_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")  # what an Intel Xeon without bfloat16 runs
    assert not gemm_select.native_bf16()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    assert not gemm_select.native_bf16()
    monkeypatch.setattr(gemm_select, "cpu_flags", lambda: {"avx512f"})
    monkeypatch.delenv("DNNL_MAX_CPU_ISA")
    assert not gemm_select.native_bf16()


def test_the_kernels_sources_join_the_cache_key(monkeypatch):
    """A verdict cached before a kernel changed (an upgrade) is not reused:
    the changed kernel is checked for invariance again before it may be chosen."""
    before = gemm_select.cache_key(weights(), torch.float32, 1, check_row_counts(32))
    assert before["kernels"] == gemm_select.kernel_cache.fingerprint()[:16]
    monkeypatch.setattr(gemm_select.kernel_cache, "fingerprint", lambda: "f" * 64)
    assert gemm_select.cache_key(weights(), torch.float32, 1, check_row_counts(32)) != before


def test_isa_caps_join_the_cache_key(monkeypatch):
    for name in gemm_select.ISA_CAP_ENV:
        monkeypatch.delenv(name, raising=False)
    plain = gemm_select.cache_key(weights(), torch.float32, 1, check_row_counts(32))
    assert "isa_caps" not in plain  # the keys cached before caps were counted stay valid
    keys = []
    for name in gemm_select.ISA_CAP_ENV:
        monkeypatch.setenv(name, "x")
        keys.append(json.dumps(gemm_select.cache_key(weights(), torch.float32, 1, check_row_counts(32))))
        monkeypatch.delenv(name)
    assert len(set(keys)) == len(keys) and json.dumps(plain) not in keys


CAPPED_SELECT = """
import json, sys, torch
from specdec.engine.gemm_select import check_row_counts, select
gen = torch.Generator().manual_seed(3)
w = [("qkv", torch.randn(48, 64, generator=gen).to(torch.bfloat16), None)]
print(json.dumps(select(w, torch.bfloat16, 1, "auto", max_rows=32).path.name))
"""


def test_a_verdict_cached_without_an_isa_cap_is_not_used_under_it(cache, monkeypatch):
    """A cache written without a cap says simd-dpbf16 is fastest (as on an
    AMD EPYC with AVX512-BF16); a process started with numba compiling for an
    Intel Xeon without it (NUMBA_CPU_NAME=cascadelake) cannot build that path:
    it must select again, not take the cached verdict and fail to start."""
    for name in gemm_select.ISA_CAP_ENV:
        monkeypatch.delenv(name, raising=False)
    gen = torch.Generator().manual_seed(3)
    w = [("qkv", torch.randn(48, 64, generator=gen).to(torch.bfloat16), None)]
    key = gemm_select.cache_key(w, torch.bfloat16, 1, check_row_counts(32))
    paths = {name: {"failure": None, "ms": serving_ms(0.5 if name == "simd-dpbf16" else 1.0)}
             for name in gemm_select.GEMM_PATHS}
    gemm_select._save({"key": key, "paths": paths})
    env = {**os.environ, "NUMBA_CPU_NAME": "cascadelake", gemm_select.CACHE_ENV: str(cache)}
    done = subprocess.run([sys.executable, "-c", CAPPED_SELECT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) != "simd-dpbf16"
    assert len(list(cache.glob("*.json"))) == 2  # the capped process's own entry beside the uncapped one


def test_preferred_kinds_win_while_one_is_invariant_and_the_engine_prefers_its_fused_ones(cache, monkeypatch,
                                                                                          stories_path):
    """A cache where oneDNN scores best: "auto" takes it, but a caller that
    runs faster around simd and numba GEMMs (the Llama runner's fused CPU
    steps) gets the fastest of those; with none of them invariant, the
    fastest of all again. A forced path is never overridden."""
    w = weights()
    key = gemm_select.cache_key(w, torch.float32, 1, check_row_counts(32))
    scores = {"onednn": 1.0, "aten": 1.5, "numba1": 3.0, "simd": 2.5, "simd-l1": 2.0}
    paths = {name: {"failure": None if name in scores else "no", "ms": serving_ms(scores.get(name, 9.0))}
             for name in gemm_select.GEMM_PATHS}
    gemm_select._save({"key": key, "paths": paths})
    assert gemm_select.select(w, torch.float32, 1, max_rows=32).path.name == "onednn"
    chosen = gemm_select.select(w, torch.float32, 1, max_rows=32, prefer_kinds=("numba", "simd"))
    assert chosen.path.name == "simd-l1" and chosen.report["prefer_kinds"] == ["numba", "simd"]
    assert gemm_select.select(w, torch.float32, 1, max_rows=32, prefer_kinds=("numba",)).path.name == "numba1"
    assert gemm_select.select(w, torch.float32, 1, "aten", max_rows=32, prefer_kinds=("simd",)).path.name == "aten"
    for name in ("numba1", "simd", "simd-l1"):
        paths[name]["failure"] = "row 3 differs"
    gemm_select._save({"key": key, "paths": paths})
    assert gemm_select.select(w, torch.float32, 1, max_rows=32, prefer_kinds=("numba", "simd")).path.name == "onednn"
    # the Llama runner asks for its fused kinds on CPU with paged attention, none otherwise
    asked = []
    real = gemm_select.select

    def spy(*args, **kwargs):
        asked.append(kwargs.get("prefer_kinds"))
        return real(*args, **kwargs)

    monkeypatch.setattr(llama, "select", spy)
    stories = Checkpoint.load(stories_path)
    for dtype, attention in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "sdpa")):
        LlamaEngine(stories, dtype, kv_capacity_tokens=256, num_threads=1, attention=attention)
    # a batch job's own rows (distill's teacher): the timings decide, no kind preferred
    LlamaEngine(stories, "float32", kv_capacity_tokens=256, num_threads=1, gemm_rows={128: 1.0})
    assert asked == [("numba", "simd", "gguf"), ("simd",), (), ()]


def test_a_batch_workload_scores_paths_at_its_own_rows_and_times_only_the_rows_missing(cache, monkeypatch):
    """Serving weighs batch-1 decoding most; a batch job (distill's teacher,
    128 answers in flight) passes its own rows: the path fastest there wins
    for it, serving's cached choice stays, and a row count not yet timed is
    timed (that count only) and cached beside the others."""
    w = weights()
    key = gemm_select.cache_key(w, torch.float32, 1, check_row_counts(256))
    fast_alone = {**serving_ms(1.0), "128": 40.0}  # fastest for few rows, slow in a batch
    fast_batched = {**serving_ms(2.0), "128": 20.0}
    paths = {name: {"failure": None if name in ("simd-l1", "onednn") else "no"} for name in gemm_select.GEMM_PATHS}
    paths["simd-l1"]["ms"], paths["onednn"]["ms"] = fast_alone, fast_batched
    gemm_select._save({"key": key, "paths": paths, "choice": "simd-l1"})  # as a serving start wrote it
    timed = []
    monkeypatch.setattr(gemm_select, "time_paths",
                        lambda ps, ws, dtype, rows, quantized=None:
                        timed.append(list(rows)) or {p.name: {n: 5.0 for n in rows} for p in ps})
    assert select(w, torch.float32, 1, max_rows=256).path.name == "simd-l1"
    batch = select(w, torch.float32, 1, max_rows=256, timed_rows={128: 1.0})
    assert batch.path.name == "onednn" and batch.report["scores"] == {"simd-l1": 40.0, "onednn": 20.0}
    assert batch.report["timed_rows"] == {"128": 1.0} and timed == []  # all cached: nothing timed
    mixed = select(w, torch.float32, 1, max_rows=256, timed_rows={1: 0.5, 64: 0.5})
    assert timed == [[64]] and mixed.report["scores"] == {"simd-l1": 3.0, "onednn": 3.5}
    (file,) = cache.glob("*.json")
    stored = json.loads(file.read_text())
    assert stored["paths"]["onednn"]["ms"] == {**fast_batched, "64": 5.0}  # merged, none lost
    assert stored["choice"] == "simd-l1"  # serving's, whatever a batch job chose since
    for bad in ({}, {0: 1.0}, {4: 0.0}, {4: -1.0}):
        with pytest.raises(ValueError, match="timed_rows"):
            select(w, torch.float32, 1, max_rows=256, timed_rows=bad)
