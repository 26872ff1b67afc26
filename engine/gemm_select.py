"""Which GEMM path the Llama runner's projections take on CPU, chosen on the
machine it runs on: only a path whose rows do not depend on the row count
may be used, and among those the fastest.

Row-count invariance. Plain decoding feeds one row, verification k + 1
rows, a batch many sequences' rows, a prefill chunk hundreds: speculation is
lossless only if every row of a GEMM comes out bitwise the same whatever the
number of rows beside it. Whether a BLAS kernel gives that depends on the
CPU (MKL's float32 sgemm does for >= 12 rows on AMD EPYC with native
bfloat16, and not on an Intel Xeon without it), so it is checked, not
assumed: ``invariance_failure`` runs each distinct weight shape of the model
on ``CHECK_BASE_ROWS`` rows one at a time and on inputs of every row count in
``check_row_counts`` (the rows tiled), padded as ``Linear`` pads, on the
engine's thread count, and names the first row that differs. Inputs larger
than a batch of verifications (prefill chunks) meet the LM head through a
slice of its vocabulary (``checked_weight``), which keeps the check's cost
at start-up in seconds, not tens of seconds, in float32.

Selection (``select``): a forced path (``gemm`` other than "auto") is used
only if it passes the check, else the engine refuses to start
(``GemmRefused``, naming the shape and the row count). "auto" checks every
path in ``GEMM_PATHS``, times the invariant ones on the model's own weights
(every projection of a forward pass at 1, k + 1 and a batch of rows,
``TIMED_ROWS``, weighted toward batch-1 decoding by ``TIME_WEIGHTS``) and
keeps the fastest; paths within ``TIE_MARGIN`` of it are a tie, broken by a
fixed order (``fastest``), so that noise does not decide between paths that
compute different bits. A caller that runs faster around some kinds of path
than the GEMM timings show names them (``prefer_kinds``), and the fastest
of those is kept while one is invariant: the Llama runner on CPU runs its
small steps in numpy between numba or simd GEMMs (``LlamaEngine.fused``:
no torch op in a layer) and through torch around the others. On 2 cores of
an AMD EPYC oneDNN's bfloat16 GEMMs once scored 3 % under simd-dpbf16's;
the engine then took 13.3 ms a SmolLM2 decode step against 10.1 and 20.7
against 11.9 for a 6-row verification (``python benchmarks/bench_forward.py
--configs bfloat16:onednn,bfloat16:simd-dpbf16 --batches 1 --queries 1,6
--reps 3 --no-stack``, same run). Verdicts, and timings taken while the machine was not
busy (``machine_busy``), are cached as JSON under
``cache_dir()`` (``$SPECDEC_GEMM_CACHE_DIR``, default
``~/.cache/specdec/gemm``), keyed by CPU model, torch version, dtype, thread
count, shapes and row counts, so a second start costs a file read.

bfloat16 through oneDNN or MKL runs at the speed of a float32 GEMM or worse
on a CPU without native bfloat16 (``native_bf16``: the avx512_bf16 or
amx_bf16 flag); "simd" reads bfloat16 weights as they are (half the bytes of
float32) and widens them in registers, which any CPU does at full speed. The
engine warns when bfloat16 takes another path on such a CPU. Where the CPU
has AVX512-BF16, "simd-dpbf16" competes too: the same kernels on bfloat16
activations with native dot products (half the arithmetic instructions: a
verification's six rows are no longer bound by multiply-adds).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numba
import numpy as np
import torch
import torch.nn.functional as F

from specdec.engine import gemm_gguf, gemm_numba, gemm_simd, kernel_cache
from specdec.engine.config import GEMM_PATH_NAMES
from specdec.engine.simd import has_dpbf16
from specdec.limits import DEFAULT_NUM_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS

log = logging.getLogger(__name__)

CACHE_ENV = "SPECDEC_GEMM_CACHE_DIR"
#: Bumped when the check or the cache layout changes (old entries are ignored). A change of the engine's
#: kernel sources needs no bump: their fingerprint (``kernel_cache.fingerprint``) is part of the key, so a
#: kernel changed by an upgrade is checked for invariance again before it may be chosen.
CACHE_VERSION = 11
#: Environment variables that cap the instruction sets the GEMM paths' code
#: uses (numba's target, oneDNN's and MKL's dispatch, ATen's kernels): the
#: same CPU then runs other kernels, so those that are set join the cache key
#: (a verdict cached without the cap may name a path the capped process
#: cannot build: simd-dpbf16 under NUMBA_CPU_NAME=cascadelake).
ISA_CAP_ENV = ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
               "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
#: oneDNN ISA caps (ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA) below its native
#: bfloat16 kernels (AVX512_CORE_BF16 and up): with one of them set, oneDNN
#: emulates bfloat16 whatever the CPU has.
ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
#: Distinct input rows whose one-row results every larger input is compared with.
CHECK_BASE_ROWS = 32
#: Inputs of more rows than this are checked on at most SLICE_OUT_FEATURES
#: output rows of a weight (``checked_weight``): covers a decode step, every
#: verification (up to MAX_SPECULATIVE_TOKENS + 1 rows) and batches of them
#: on the whole LM head.
SLICE_FROM_ROWS = 64
#: Distinct input rows of a weight wider than SLICE_OUT_FEATURES checked
#: whole (each costs a one-row pass over the LM head's weight): every row
#: position of every input is still compared with its own one-row result,
#: only fewer distinct values are tiled.
WIDE_BASE_ROWS = 8
#: Output rows of the slice (of the vocabulary, for the LM head) that the
#: largest inputs are checked on.
SLICE_OUT_FEATURES = 4096
#: Row counts timed: a decode step, a verification of the default k drafts, a batch.
TIMED_ROWS = (1, DEFAULT_NUM_SPECULATIVE_TOKENS + 1, 32)
#: Weight of each timed row count in a path's score (ms): batch-1 decoding first.
TIME_WEIGHTS = (0.6, 0.3, 0.1)
#: The serving workload ``select`` scores paths for unless told another
#: (``timed_rows``): row count -> weight.
SERVING_ROWS = dict(zip(TIMED_ROWS, TIME_WEIGHTS))
#: Scores within this fraction of the fastest are a tie (``fastest``): the
#: timings of two paths a few per cent apart change order between starts on
#: one machine (SmolLM2 float32 on 2 cores of an AMD EPYC: simd-l1 17.42 ms,
#: numba1 17.50 in one cache; 18.21 and 21.12 in another), and paths of
#: different arithmetic give different bits, so without it two replicas on
#: machines of one kind could serve different greedy text.
TIE_MARGIN = 0.05
#: The tie margin where some candidate's timings were taken on a busy
#: machine (``machine_busy``): there two paths' order swaps by far more than
#: 5 % between starts (clean-clone CI beside a busy process: two engines of
#: one stories260K process took numba1 and simd-l1, ~3 % apart idle), so
#: replicas started under load mostly agree on the fixed order's path. Busy
#: timings are not cached: the next start on an idle machine chooses by 5 %.
BUSY_TIE_MARGIN = 0.25
#: Paths that compute the same bits: the same instructions in the same order
#: (simd-l1 prefetches the weight into L1 instead of L2; simd-gguf
#: dequantises a GGUF model's blocks in registers to the float32 weights
#: simd reads), or a lone row through a loop the check has proved sums as
#: the pairs do (numba1).
SAME_BITS = (("simd", "simd-l1", "simd-gguf"), ("numba", "numba1"))
#: How a tie between paths of different arithmetic is broken, first wins:
#: our own kernels, whose order of summation is written out (simd), then
#: those a compiler vectorises (numba), then the libraries'; bfloat16
#: activations (simd-dpbf16) last, the least precise. Among paths of the same
#: bits the fastest is kept.
TIE_ORDER = ("simd", "simd-l1", "simd-gguf", "numba", "numba1", "numba6", "onednn", "onednn-unpadded", "aten",
             "simd-dpbf16")


@dataclass(frozen=True)
class GemmPath:
    """A way to compute x W^T + b on CPU.

    kind: "aten" (F.linear: MKL for float32) or "onednn" (weights prepacked
      in oneDNN's blocked layout) or "numba" (engine.gemm_numba) or "simd"
      (engine.gemm_simd); min_rows:
      inputs with fewer rows are zero-padded to this many (a lone row or a
      short tail takes kernels that sum in another order on some CPUs); for
      "numba", the rows per kernel pass (gemm_numba.GROUP_ROWS)."""

    name: str
    kind: str
    min_rows: int


#: Every path the selector knows, by the name ``gemm`` takes. The unpadded
#: oneDNN path is the fastest decode step where a lone row sums like the
#: others; on AMD EPYC it does not (GEMV kernel), and the check rejects it.
#: "numba" and "numba6" are our own float32 kernels for few rows
#: (engine.gemm_numba), row-invariant by construction: one compiled loop
#: takes the rows min_rows at a time (2 or 6), the last ones beside zero rows
#: (it pads them itself). "numba1" is "numba" with a lone row through a
#: one-row loop (no zero row: a faster decode step); it sums like the pairs
#: only where the compiler vectorises both loops alike, and the check
#: rejects it where it does not. "simd" (engine.gemm_simd) writes its vector
#: arithmetic out, so no compiler can reorder a sum: one row and six sum alike
#: on every CPU, the fastest decode and verification steps measured so far;
#: it also takes bfloat16 weights (float32 arithmetic, bfloat16 out).
#: "simd-dpbf16" is "simd" for bfloat16 weights on a CPU with AVX512-BF16:
#: the activations rounded to bfloat16 and every step one ``vdpbf16ps`` (32
#: products), half the instructions, so a verification's rows cost little
#: more than a decode step's; the check refuses it elsewhere (UNSUPPORTED).
#: "simd-l1" is "simd" prefetching the weight into L1, a shorter way ahead,
#: instead of L2 (``gemm_simd.PREFETCH_AHEAD_L1``): the same instructions
#: otherwise, so the same bits; which streams faster depends on the CPU
#: (module doc of gemm_simd), and the timing decides. "simd-gguf"
#: (engine.gemm_gguf) is "simd" reading a GGUF model's Q4_0 / Q4_1 / Q8_0
#: blocks as they are in the file (4.5 to 8.5 bits a weight instead of 32)
#: and dequantising them in registers to exactly the float32 weights the
#: model loaded with: the same bits as "simd", a fraction of the bytes (a
#: weight the file keeps in another type goes through simd-l1's kernel);
#: only for float32 engines of a GGUF model (``select``'s ``quantized``),
#: unavailable (UNAVAILABLE) where the file holds none of the weights.
GEMM_PATHS = {p.name: p for p in (GemmPath("onednn", "onednn", 2), GemmPath("aten", "aten", 12),
                                   GemmPath("onednn-unpadded", "onednn", 1),
                                   *(GemmPath(name, "numba", rows) for name, rows in gemm_numba.GROUP_ROWS.items()),
                                   GemmPath("simd", "simd", gemm_simd.GROUP),
                                   GemmPath("simd-dpbf16", "simd", gemm_simd.GROUP),
                                   GemmPath("simd-l1", "simd", gemm_simd.GROUP),
                                   GemmPath("simd-gguf", "gguf", gemm_gguf.GROUP))}
assert tuple(GEMM_PATHS) == GEMM_PATH_NAMES
assert sorted(TIE_ORDER) == sorted(GEMM_PATHS) and all(set(g) <= set(GEMM_PATHS) for g in SAME_BITS)


class GemmRefused(ValueError):
    """A GEMM path that breaks row-count invariance on this machine was forced
    (or no path keeps it)."""


class Linear:
    """y = x W^T + b computed through one GemmPath, padding small inputs.

    weight: [out, in]; bias: [out] or None. Its rows are independent of the
    row count when ``invariance_failure`` accepted the path on this machine."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, path: GemmPath,
                 quantized: gemm_gguf.GgufBlocks | gemm_gguf.QuantWeight | None = None) -> None:
        self.path = path
        self.min_rows = path.min_rows
        self.bias = bias
        self._bias_array = None if bias is None or bias.device.type != "cpu" else bias.float().contiguous().numpy()
        self.out_features, self.in_features = weight.shape
        self.onednn = path.kind == "onednn"
        self.numba = path.kind in ("numba", "simd", "gguf")
        #: simd-dpbf16: bfloat16 activations times bfloat16 weights in AVX512-BF16 dot products
        self.pairs = path.name == "simd-dpbf16"
        #: simd-l1: the weight prefetched into L1 instead of L2
        self.l1 = path.name == "simd-l1"
        self._quant: gemm_gguf.QuantWeight | None = None
        if path.kind == "gguf" and isinstance(quantized, gemm_gguf.QuantWeight):  # blocks given (quantize)
            shape = (quantized.out_features, quantized.d.shape[1] * gemm_gguf.BLOCK)
            if shape != (self.out_features, self.in_features):
                raise ValueError(f"blocks of a {shape} weight for a weight {tuple(weight.shape)}")
            self._quant = quantized
        elif path.kind == "gguf":  # the weight's GGUF blocks; a weight the file holds otherwise reads as simd-l1
            if not isinstance(quantized, gemm_gguf.GgufBlocks):
                raise gemm_gguf.NoBlocks(f"the {path.name} GEMM reads a GGUF model's Q4_0 / Q4_1 / Q8_0 blocks; "
                                         "these weights come from none")
            try:
                self._quant = quantized.find(weight)
            except gemm_gguf.NoBlocks:
                if weight.dtype != torch.float32:
                    raise
                self.l1 = True  # another type in the file (F16, a K-quant): its float32 values, the same bits
        if self._quant is not None:
            self.threads = torch.get_num_threads()
            # the float32 weight is not kept here: a pass reads the blocks
            self.weight = weight.new_empty(0)
        elif self.numba:
            # simd reads bfloat16 weights too (widened in registers, float32 arithmetic); numba float32 only
            dtypes = ((torch.bfloat16,) if self.pairs else (torch.float32, torch.bfloat16)) if path.kind == "simd" \
                else (torch.float32,)  # numba, and gguf's weights without blocks
            if weight.dtype not in dtypes or weight.device.type != "cpu":
                raise RuntimeError(f"the {path.name} GEMM takes {' or '.join(map(str, dtypes))} weights on CPU "
                                   f"only, not {weight.dtype} on {weight.device.type}")
            if self.pairs and not has_dpbf16():
                raise RuntimeError(f"the {path.name} GEMM needs AVX512-BF16 (vdpbf16ps), which this CPU lacks")
            self.threads = torch.get_num_threads()  # its output blocks split over as many threads
            bf16 = weight.dtype == torch.bfloat16
            raw = weight.view(torch.int16).numpy().view(np.uint16) if bf16 else weight.numpy()
            # the weight itself unless its shape needs padding
            self._padded = gemm_simd.pad_weight(raw, self.pairs) if path.kind in ("simd", "gguf") else \
                gemm_numba.pad_weight(raw)
            padded = torch.from_numpy(self._padded.view(np.int16)).view(torch.bfloat16) if bf16 else \
                torch.from_numpy(self._padded)
            self.weight = padded[:self.out_features, :self.in_features]
        else:
            # oneDNN keeps the weight in its own blocked layout, packed for `min_rows` rows
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, path.min_rows) if self.onednn else weight

    @property
    def nbytes(self) -> int:
        """Bytes of weight one pass reads: the GGUF blocks (simd-gguf), else
        out x in values of the weight's dtype."""
        if self._quant is not None:
            return self._quant.nbytes
        return self.out_features * self.in_features * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]"""
        T = x.shape[0]
        if self.numba:
            return self._numba(x)
        if T < self.min_rows:
            # cat + new_zeros: ~15 us a call, F.pad (constant_pad_nd) ~47 us (torch.profiler, batch-1 decode)
            return self._gemm(torch.cat([x, x.new_zeros(self.min_rows - T, x.shape[1])]))[:T]
        return self._gemm(x.contiguous())

    def _numba(self, x: torch.Tensor) -> torch.Tensor:
        # bfloat16 inputs widen exactly (simd); the output is rounded back to their dtype
        y = torch.from_numpy(self._numba_product(x.float().contiguous().numpy()))
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def on_array(self, x: np.ndarray) -> np.ndarray:
        """``__call__`` on a C-contiguous float32 numpy input, returning float32
        numpy: the numba paths without a torch op (the engine's fused CPU
        path); the others through torch (float32 weights)."""
        if not self.numba:
            return self(torch.from_numpy(x)).numpy()
        y = np.ascontiguousarray(self._numba_product(x))
        return y if self._bias_array is None else y + self._bias_array

    def _numba_product(self, x: np.ndarray) -> np.ndarray:
        """x @ W^T through the numba/simd kernel, float32 [T, out] (a view
        when the padded weight has more outputs), bias not added."""
        if self._quant is not None:
            y = gemm_gguf.gemm(x, self._quant, self.threads)
        elif self.path.kind in ("simd", "gguf"):
            y = gemm_simd.gemm(x, self._padded, self.threads, self.pairs, self.l1)
        else:
            y = gemm_numba.gemm(x, self._padded, self.threads, self.path.name)
        return y if y.shape[1] == self.out_features else y[:, :self.out_features]

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


#: (role, weight [out, in], bias [out] or None): the projections of a model.
Weights = list[tuple[str, torch.Tensor, "torch.Tensor | None"]]
MakeLinear = Callable[[torch.Tensor, "torch.Tensor | None"], Callable[[torch.Tensor], torch.Tensor]]


# ---- the machine -----------------------------------------------------------------


def set_torch_threads(threads: int) -> None:
    """torch.set_num_threads(threads), after starting numba's thread pool
    (numba.get_num_threads starts it; a no-op once started): the pool's
    start resets the process's OpenMP thread count, so an engine built with
    --threads 1 ran torch's ops on every core once its KV pool first set a
    numba team (torch.get_num_threads() went 1 -> 2 in KVPool's warm-up,
    2 cores)."""
    numba.get_num_threads()
    torch.set_num_threads(threads)


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def native_bf16() -> bool:
    """Whether the CPU computes bfloat16 products natively (AVX512-BF16 or
    AMX) and oneDNN is not capped below them (ONEDNN_ISAS_WITHOUT_BF16)."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"}) and cap not in ONEDNN_ISAS_WITHOUT_BF16


def isa_caps() -> dict[str, str]:
    """The ISA_CAP_ENV variables this process runs with."""
    return {name: os.environ[name] for name in ISA_CAP_ENV if os.environ.get(name)}


def cpu_model() -> str:
    """The CPU's model name (lscpu's 'Model name')."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specdec" / "gemm")


# ---- the check -------------------------------------------------------------------


def check_row_counts(max_rows: int = 512) -> tuple[int, ...]:
    """Row counts the engine's GEMMs see and the check covers: every count up
    to a full verification (MAX_SPECULATIVE_TOKENS + 1), then batches and
    prefill chunks of a few sizes, odd ones included, up to max_rows."""
    small = range(1, MAX_SPECULATIVE_TOKENS + 2)
    return tuple(sorted({*small, *(n for n in (24, 33, 64, 128, 421, 512) if n <= max_rows)}))


def distinct_shapes(weights: Weights) -> Weights:
    """The first weight of each (role, shape, has-bias): what the check runs."""
    seen: dict[tuple, tuple] = {}
    for role, w, b in weights:
        seen.setdefault((role, tuple(w.shape), b is not None), (role, w, b))
    return list(seen.values())


def checked_weight(w: torch.Tensor, b: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight (and bias) an n-row input is checked on: the whole weight up
    to SLICE_FROM_ROWS rows; beyond, at most SLICE_OUT_FEATURES of its output
    rows (the LM head: a slice of the vocabulary)."""
    if n <= SLICE_FROM_ROWS or w.shape[0] <= SLICE_OUT_FEATURES:
        return w, b
    return w[:SLICE_OUT_FEATURES], None if b is None else b[:SLICE_OUT_FEATURES]


@torch.inference_mode()
def invariance_failure(make_linear: MakeLinear, weights: Weights, row_counts: tuple[int, ...],
                       dtype: torch.dtype) -> str | None:
    """None if, for every distinct weight shape, each row of an n-row input
    (n in row_counts) equals bitwise the same row computed alone; else a
    message naming the first shape, row count and row that differ.

    The n-row inputs tile CHECK_BASE_ROWS random rows (WIDE_BASE_ROWS for
    the LM head), so every row has a one-row reference and every position in
    the kernels' blocking is seen.
    Inputs of more than SLICE_FROM_ROWS rows meet a weight with more than
    SLICE_OUT_FEATURES output rows (the LM head) through a slice of it, with
    one-row references computed on that slice (``checked_weight``): a
    kernel's dependence on the row count lies in how it blocks and splits the
    rows of x, which a slice thousands of outputs wide, of the same
    in_features, still meets at every row count checked; the full LM head's
    largest inputs would cost most of the check's time. (The LM head only
    meets such inputs in batches of many verifications.)"""
    gen = torch.Generator().manual_seed(0)
    for role, w, b in distinct_shapes(weights):
        base = torch.randn(CHECK_BASE_ROWS, w.shape[1], generator=gen).to(w.device, dtype)  # [R, in]
        references: dict[int, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = {}
        for n in row_counts:
            checked, bias = checked_weight(w, b, n)
            out = checked.shape[0]
            if out not in references:
                linear = make_linear(checked, bias)
                rows = CHECK_BASE_ROWS if out <= SLICE_OUT_FEATURES else WIDE_BASE_ROWS
                references[out] = linear, torch.cat([linear(base[i:i + 1]) for i in range(rows)])  # [rows, out]
            linear, alone = references[out]
            tiles = -(-n // len(alone))
            x = base[:len(alone)].repeat(tiles, 1)[:n]  # [n, in]
            same = (linear(x) == alone.repeat(tiles, 1)[:n]).all(dim=1)  # [n]
            if not bool(same.all()):
                row = int((~same).nonzero()[0])
                what = "" if checked is w else f" (its first {out} output rows)"
                return (f"{role} weight {w.shape[0]}x{w.shape[1]}{what} ({dtype}): row {row} of a {n}-row input "
                        f"differs from the same row computed alone")
    return None


#: How a path's verdict starts when the CPU cannot run it at all.
UNSUPPORTED = "not supported by this CPU"
#: How a path's verdict starts when the weights cannot take it (simd-gguf: not a GGUF model's blocks).
UNAVAILABLE = "not available for these weights"


def path_failure(path: GemmPath, weights: Weights, row_counts: tuple[int, ...], dtype: torch.dtype,
                 quantized: gemm_gguf.GgufBlocks | None = None) -> str | None:
    """invariance_failure for one path; a path the CPU cannot run (oneDNN's
    bfloat16 kernels need AVX512-BW/VL/DQ or AVX-NE-CONVERT: an AMD EPYC
    with AVX2 only has neither) fails with UNSUPPORTED and torch's reason;
    simd-gguf without a GGUF model's blocks for every weight with
    UNAVAILABLE and what is missing."""
    try:
        if path.kind == "gguf" and (quantized is None or not quantized.covers_any([w for _, w, _ in weights])):
            raise gemm_gguf.NoBlocks(f"the {path.name} GEMM reads a GGUF model's Q4_0 / Q4_1 / Q8_0 blocks; "
                                     + ("these weights come from none" if quantized is None else
                                        f"{quantized.path.name} holds none of these weights"))
        return invariance_failure(functools.partial(Linear, path=path, quantized=quantized), weights, row_counts,
                                  dtype)
    except gemm_gguf.NoBlocks as e:
        return f"{UNAVAILABLE} ({dtype}): {e}"
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"{UNSUPPORTED} ({dtype}): {reason}"


# ---- timing ------------------------------------------------------------------------


@torch.inference_mode()
def time_paths(paths: list[GemmPath], weights: Weights, dtype: torch.dtype, rows: Iterable[int] = TIMED_ROWS,
               reps: int = 2, quantized: gemm_gguf.GgufBlocks | None = None) -> dict[str, dict[int, float]]:
    """ms for all of a forward pass's projections (every weight given, in
    order), per path and row count in rows: the fastest of reps runs after a
    warm-up, the paths taking turns within each rep so that load from other
    processes falls on all of them alike (it only ever adds time)."""
    rows = tuple(rows)
    built = {p.name: [Linear(w, b, p, quantized) for _, w, b in weights] for p in paths}
    xs = {n: {d: torch.randn(n, d).to(dtype) for d in {w.shape[1] for _, w, _ in weights}} for n in rows}
    best = {p.name: {n: float("inf") for n in rows} for p in paths}
    for _ in range(reps + 1):
        for name, linears in built.items():
            for n in rows:
                t0 = time.perf_counter()
                for linear in linears:
                    linear(xs[n][linear.in_features])
                best[name][n] = min(best[name][n], (time.perf_counter() - t0) * 1e3)
    return best


def machine_busy() -> bool:
    """Whether other processes keep the cores busy (1-minute load average
    above the core count): timings taken then are used but not cached."""
    return os.getloadavg()[0] > (os.cpu_count() or 1)


def score_ms(timings: Mapping[str, float], timed_rows: Mapping[int, float] = SERVING_ROWS) -> float:
    """One number per path: its ms per row count (keys as cached: "1", "6",
    ...) weighted as timed_rows weighs the row counts."""
    return sum(weight * timings[str(n)] for n, weight in timed_rows.items())


def fastest(scores: Mapping[str, float], margin: float = TIE_MARGIN) -> str:
    """The path to take given each candidate's score (ms): among those within
    margin of the lowest score, the first in TIE_ORDER, or a faster path of
    the same bits (SAME_BITS). A near-tie between paths of different
    arithmetic is then decided by a fixed rule, not by which timing the
    machine's noise favoured."""
    best = min(scores.values())
    tied = [name for name, ms in scores.items() if ms <= best * (1 + margin)]
    first = min(tied, key=TIE_ORDER.index)
    same = next((group for group in SAME_BITS if first in group), (first,))
    return min((name for name in same if name in scores), key=scores.__getitem__)


# ---- selection ---------------------------------------------------------------------


@dataclass
class Selection:
    """The chosen path, the linears built with it (in the order of the
    weights given), and the report logged, cached and exported."""

    path: GemmPath
    linears: list[Linear]
    report: dict


def cache_key(weights: Weights, dtype: torch.dtype, num_threads: int, row_counts: tuple[int, ...],
              quantized: gemm_gguf.GgufBlocks | None = None) -> dict:
    shapes: dict[str, int] = {}
    for role, w, b in weights:
        name = f"{role}:{w.shape[0]}x{w.shape[1]}{'+b' if b is not None else ''}"
        shapes[name] = shapes.get(name, 0) + 1
    # the model name alone does not tell CPUs apart ("AMD EPYC" with and without AVX-512): the flags do
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    # numba compiles the numba/simd paths through its own LLVM (simd-dpbf16 needs LLVM 17)
    key = {"version": CACHE_VERSION, "cpu": cpu_model(), "cpu_flags": flags, "torch": torch.__version__,
           "numba": numba.__version__, "dtype": str(dtype), "threads": num_threads, "shapes": shapes,
           "row_counts": list(row_counts), "kernels": kernel_cache.fingerprint()[:16]}
    if quantized is not None:  # whether simd-gguf finds the weights' blocks depends on the file
        key["gguf"] = quantized.identity()
    caps = isa_caps()
    return {**key, "isa_caps": caps} if caps else key


def _cache_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"{digest}.json"


def _load(key: dict) -> dict:
    """The cached report for key, or a fresh one."""
    try:
        report = json.loads(_cache_file(key).read_text())
        if report.get("key") == key:
            return report
    except (OSError, ValueError):
        pass
    return {"key": key, "paths": {}}


def _save(report: dict) -> None:
    path = _cache_file(report["key"])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(path)  # atomic: concurrent engines never read half a file
    except OSError as e:
        log.warning("gemm selection: cannot cache in %s: %s", path.parent, e)


def select(weights: Weights, dtype: torch.dtype, num_threads: int, gemm: str = "auto",
           max_rows: int = 512, prefer_kinds: tuple[str, ...] = (),
           timed_rows: Mapping[int, float] = SERVING_ROWS,
           quantized: gemm_gguf.GgufBlocks | None = None) -> Selection:
    """The GEMM path for these weights on this machine (module doc): gemm is
    "auto" or a name in GEMM_PATHS. Raises GemmRefused when the forced path,
    or every path, breaks row-count invariance. prefer_kinds: "auto" keeps
    the fastest path of these kinds while one is invariant (the caller runs
    faster around them than the GEMM timings show), the fastest of all
    otherwise. timed_rows: the workload "fastest" means (row count ->
    weight; serving's by default, where batch-1 decoding weighs most; a
    batch job such as distill's teacher passes its own: at 128 rows another
    path can be ~1.5x faster); row counts not yet timed are timed and cached
    beside the others."""
    if gemm != "auto" and gemm not in GEMM_PATHS:
        raise ValueError(f"gemm must be 'auto' or one of {', '.join(GEMM_PATHS)}, got {gemm!r}")
    if not timed_rows or any(n < 1 or w <= 0 for n, w in timed_rows.items()):
        raise ValueError(f"timed_rows: positive row counts with positive weights, got {dict(timed_rows)!r}")
    row_counts = check_row_counts(max_rows)
    report = _load(cache_key(weights, dtype, num_threads, row_counts, quantized))
    verdicts, dirty = report["paths"], False
    names = list(GEMM_PATHS) if gemm == "auto" else [gemm]
    t0 = time.perf_counter()
    for name in names:
        entry = verdicts.setdefault(name, {})
        if "failure" not in entry:
            t = time.perf_counter()
            entry["failure"] = path_failure(GEMM_PATHS[name], weights, row_counts, dtype, quantized)
            entry["check_s"] = round(time.perf_counter() - t, 3)
            dirty = True
    missing_rows = {name: [n for n in timed_rows if str(n) not in verdicts[name].get("ms", {})]
                    for name in names if verdicts[name]["failure"] is None}  # row counts each invariant path lacks
    untimed = [GEMM_PATHS[name] for name, rows in missing_rows.items() if rows]
    missing = sorted({n for rows in missing_rows.values() for n in rows})
    if gemm == "auto" and untimed:
        t = time.perf_counter()
        busy = machine_busy()
        for name, ms in time_paths(untimed, weights, dtype, missing, quantized=quantized).items():
            entry = verdicts[name]
            entry["ms"] = {**entry.get("ms", {}), **{str(n): round(v, 3) for n, v in ms.items()}}
            entry["busy"] = entry.get("busy", False) or busy
        report["time_s"] = round(time.perf_counter() - t, 3)
        dirty = True
    margin = TIE_MARGIN
    if gemm != "auto":
        failure = verdicts[gemm]["failure"]
        if failure is not None:
            if failure.startswith(UNAVAILABLE):
                raise GemmRefused(f"gemm={gemm!r} cannot run for this model: {failure}; use gemm='auto'")
            what = "cannot run" if failure.startswith(UNSUPPORTED) else "breaks row-count invariance"
            raise GemmRefused(f"gemm={gemm!r} {what} on this CPU ({cpu_model()}): {failure}; use gemm='auto'")
        chosen = gemm
    else:
        ok = [n for n in names if verdicts[n]["failure"] is None]
        if not ok:
            raise GemmRefused("no GEMM path keeps row-count invariance on this CPU (" + cpu_model() + "): "
                              + "; ".join(f"{n}: {verdicts[n]['failure']}" for n in names))
        scores = {n: round(score_ms(verdicts[n]["ms"], timed_rows), 3) for n in ok}
        preferred = [n for n in ok if GEMM_PATHS[n].kind in prefer_kinds]
        margin = BUSY_TIE_MARGIN if any(verdicts[n].get("busy") for n in preferred or ok) else TIE_MARGIN
        chosen = fastest({n: scores[n] for n in preferred or ok}, margin)
        if timed_rows == SERVING_ROWS:
            report["choice"] = chosen  # cached for the record: what serving takes here
    if dirty:
        report["select_s"] = round(time.perf_counter() - t0, 3)
        _save(_without_busy_timings(report))
    linears = [Linear(w, b, GEMM_PATHS[chosen], quantized) for _, w, b in weights]
    if GEMM_PATHS[chosen].kind == "gguf":
        _gguf_layouts(report, linears, num_threads)
    log.info("gemm: %s (%s) for %s on %s, %d threads; %s", chosen, "forced" if gemm != "auto" else "auto",
             dtype, report["key"]["cpu"], num_threads, summary(report))
    if margin != TIE_MARGIN:
        log.info("gemm: timed on a busy machine: scores within %.0f %% of the fastest were a tie (not cached; an "
                 "idle start chooses within %.0f %%)", margin * 100, TIE_MARGIN * 100)
    return Selection(GEMM_PATHS[chosen], linears, {**report, "chosen": chosen, "forced": gemm != "auto",
                                                   "prefer_kinds": list(prefer_kinds),
                                                   "timed_rows": {str(n): w for n, w in timed_rows.items()},
                                                   **({"scores": scores, "tie_margin": margin} if gemm == "auto"
                                                      else {})})


def _gguf_layouts(report: dict, linears: list[Linear], num_threads: int) -> None:
    """simd-gguf's kernel layout per row count (``gemm_gguf.LAYOUTS``: the
    same bits, registers used differently), timed on these weights on this
    machine once and cached in the report ("gguf_layouts"; not on a busy
    machine), then used (process-wide)."""
    entry = report.get("gguf_layouts")
    if entry is None or set(entry["ms"]) != set(gemm_gguf.RUNNABLE) or \
            any(set(t) != {str(n) for n in gemm_gguf.LAYOUT_ROWS} for t in entry["ms"].values()):
        quants = [lin._quant for lin in linears if lin._quant is not None]
        busy = machine_busy()
        ms = gemm_gguf.time_layouts(quants, num_threads)
        entry = {"ms": {name: {str(n): v for n, v in t.items()} for name, t in ms.items()},
                 "choice": {str(n): name for n, name in gemm_gguf.choose_layouts(ms).items()}}
        report["gguf_layouts"] = entry
        if not busy:
            _save(_without_busy_timings(report))
    choice = {int(n): name for n, name in entry["choice"].items()}
    gemm_gguf.use_layouts(choice)
    log.info("gemm: simd-gguf layouts %s (ms of a pass: %s)", choice, entry["ms"])


def _without_busy_timings(report: dict) -> dict:
    """The report to cache: timings taken on a busy machine are dropped (the
    next start times again), verdicts kept (they do not depend on load)."""
    paths = {n: {k: v for k, v in e.items() if not e.get("busy") or k not in ("ms", "busy")}
             for n, e in report["paths"].items()}
    busy = any(e.get("busy") for e in report["paths"].values())
    choice = {} if busy or report.get("choice") is None else {"choice": report["choice"]}
    return {**{k: v for k, v in report.items() if k != "choice"}, "paths": paths, **choice}


def summary(report: dict) -> str:
    """One line per the report's paths: verdict and timings."""
    parts = []
    for name, e in report["paths"].items():
        if e.get("failure"):
            parts.append(f"{name}: rejected ({e['failure']})")
        elif "ms" in e:
            parts.append(f"{name}: " + ", ".join(f"{n} rows {v:.2f} ms" for n, v in e["ms"].items()))
        else:
            parts.append(f"{name}: invariant")
    return "; ".join(parts)
