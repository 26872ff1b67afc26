"""The project's own target-model runner for the Llama family (llama, mistral,
qwen2, qwen3, smollm3): one forward pass over a ragged batch, paged KV cache.

A forward pass concatenates every item's new tokens into one [T, hidden]
activation; norms, projections and the MLP run once over all T rows;
attention lets each row see its own sequence's cached prefix and the earlier
new rows of its item (``kv_pool.KVPool.attend``); the LM head runs only on the
rows whose logits were asked for.

Row invariance. Plain decoding (one query row) and verification (k + 1 rows,
next to other sequences) must compute the same function, or a near-tie could
flip a greedy token. Every step here gives each row a result that depends on
that row alone, bit for bit:
- GEMMs: whether a BLAS path gives a row the same result for every row
  count depends on the CPU (on AMD EPYC oneDNN does for >= 2 rows, MKL's
  float32 sgemm for >= 12; on an Intel Xeon without native bfloat16 MKL does
  not at all), so ``gemm_select`` checks every path on the machine, on this
  model's weight shapes, and uses only one that passes (``Linear`` pads
  small inputs to the path's ``min_rows``).
- Elementwise ops and last-dimension reductions are per row, with one
  catch: torch finishes a vectorised loop's ragged tail with a scalar
  formula (for ``silu`` it differs in the last bit), and with several
  threads a loop over [T, width] may be split inside a row, at a point that
  depends on T. SwiGLU widths are therefore zero-padded to a multiple of
  ``FFN_ALIGN``, which keeps every split and every row a whole number of
  vectors. (The other elementwise ops here - add, mul, rsqrt, casts - are
  correctly rounded on either path.)
- Attention is row-invariant by construction (see kv_pool).
- On CUDA, cuBLAS picks its kernel by the row count, and torch's reductions
  split a row by the tensor's shape: the GEMMs, norms, KV write and attention
  there are engine.gpu_ops's Triton kernels, invariant by construction (one
  tile shape and summation order for every row count), and passes of up to
  512 tokens replay CUDA graphs of those same kernels (engine.cuda_graph).
``tests/test_llama_engine.py`` checks that decoding token by token and
verifying 6-, 17- or 421-row chunks give bitwise equal logits;
``tests/test_gpu_engine.py`` the same on the GPU kernels.

GEMM paths (``gemm``), SmolLM2-135M on 2 cores of AMD EPYC
(benchmarks/bench_forward.py): "auto" picks our own float32 kernel
(``gemm_simd``: explicit 16-lane fused multiply-adds per output, rows six
at a time or one alone, the same order either way; ``gemm_numba``'s
compiler-vectorised loops are the other candidates; outputs split over the
threads) in float32 and oneDNN prepacked in bfloat16 where
the CPU computes it natively. A float32 decode step's GEMMs take ~16-21 ms
there (six rows ~17-19 ms) against ~45-50 ms through oneDNN (a decode step is a matrix-vector
product, bound by memory bandwidth, for which BLAS libraries are not
tuned); bfloat16 through oneDNN about 28 ms. MKL float32 (``"aten"``)
needs 12 rows for invariance, so even a decode step costs 90-100 ms. For
a GGUF model in float32, "simd-gguf" (``gemm_gguf``) reads the file's Q4_0
/ Q4_1 / Q8_0 blocks and computes gemm_simd's bits on the dequantised weights
(README: 203 tok/s against 62 through simd-l1, one run). All
float32 paths give logits within ~1.5e-4 of transformers on SmolLM2 (which
runs MKL): float32 rounding over 30 layers, each path summing in its own
order, not an error.

In float32 on CPU the small steps between the GEMMs (RMSNorm, RoPE with the
softmax scale and the KV write, SiLU times up) are single numba calls
(``cpu_ops``), not eight torch ops each: on one row torch spends more on
dispatch than on arithmetic. Where every projection is read from GGUF
blocks, the whole stack of layers is one numba call (``gguf_layers``: the
same kernels in the same order, without ~1.6 ms of Python a SmolLM2 step).

Weights come from ``transformers`` (safetensors, .bin or GGUF, dequantised),
which also standardises the config; the transformers model is dropped after
its tensors are taken.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from specdec.engine import cpu_ops, gguf_layers, kv_pool
from specdec.engine.base import Engine, ForwardItem, ForwardOutput, ModelFacts, check_feature_layers
from specdec.engine.checkpoint import Checkpoint, eos_token_ids, torch_dtype
from specdec.engine.config import DEFAULT_KV_CAPACITY_TOKENS
from specdec.engine.cuda_graph import MAX_ROWS, ForwardGraphs
from specdec.engine.gemm_gguf import GgufBlocks
from specdec.engine.gemm_numba import LAUNCH_LOCK, set_team
from specdec.engine.gemm_select import (
    GEMM_PATHS,
    SERVING_ROWS,
    GemmPath,
    GemmRefused,
    Linear,
    Weights,
    check_row_counts,
    invariance_failure,
    native_bf16,
    select,
    set_torch_threads,
)
from specdec.engine.kv_pool import KV_DTYPES, DeviceRows, KVPool, PagedBatch, default_num_threads

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
#: SwiGLU hidden width is zero-padded to a multiple of this (see module doc).
FFN_ALIGN = 128
#: Default threading: with fewer weight bytes per decoder layer than this, a
#: decode step's GEMMs take microseconds and a second thread costs more than
#: it saves (on a busy machine far more: each parallel region waits for a
#: free core), so the engine runs on one thread.
MULTITHREAD_MIN_LAYER_BYTES = 4 << 20


# ---- architecture ---------------------------------------------------------------


def rope_parameters(config) -> dict:
    """The RoPE settings as one flat dict with ``rope_type`` and
    ``rope_theta``: transformers 5 keeps them in ``rope_parameters``, older
    configs in ``rope_theta`` + ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = {**(getattr(config, "rope_scaling", None) or {}),
                  "rope_theta": getattr(config, "rope_theta", 10000.0)}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def unsupported_reason(config) -> str | None:
    """Why LlamaEngine cannot run this config, or None if it can."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    params = rope_parameters(config)
    if "rope_theta" not in params:
        return "per-layer-type rope_parameters"
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        return f"rope_type {params['rope_type']!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    if params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        return "partial rotary embeddings"
    layer_types = getattr(config, "layer_types", None) or ()
    odd = set(layer_types) - {"full_attention", "sliding_attention"}
    if odd:
        return f"layer types {sorted(odd)}"
    if config.num_attention_heads % (getattr(config, "num_key_value_heads", None) or config.num_attention_heads):
        return "num_attention_heads is not a multiple of num_key_value_heads"
    return None


@dataclass(frozen=True)
class LlamaSpec:
    """What the forward pass needs from a (supported) HF config."""

    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict  # flat rope parameters (``rope_parameters``)
    layer_windows: tuple[int, ...]  # per layer: 0 = full causal attention, else sliding window
    layer_rope: tuple[bool, ...]  # per layer: apply RoPE (SmolLM3 has NoPE layers)

    @classmethod
    def from_config(cls, config) -> "LlamaSpec":
        reason = unsupported_reason(config)
        if reason:
            raise ValueError(f"LlamaEngine cannot run this model: {reason}")
        n_layers = config.num_hidden_layers
        window = getattr(config, "sliding_window", None) or 0
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types)
        else:  # mistral: one window for every layer
            windows = (window if config.model_type == "mistral" else 0,) * n_layers
        no_rope = getattr(config, "no_rope_layers", None)  # SmolLM3: 1 = RoPE, 0 = NoPE
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
            rope=rope_parameters(config), layer_windows=windows,
            layer_rope=tuple(bool(x) for x in no_rope) if no_rope else (True,) * n_layers)


def rope_inv_freq(rope: dict, head_dim: int) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies theta^(-2i/d), computed in
    float32 like transformers so both rotate positions identically, then
    scaled per ``rope_type``:
    - linear: every frequency divided by ``factor`` (positions stretched);
    - llama3: wavelengths longer than original_context / low_freq_factor are
      stretched by ``factor``, those shorter than original_context /
      high_freq_factor kept, and the band between blends the two linearly in
      original_context / wavelength."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope["rope_theta"] ** exponents)
    if rope["rope_type"] == "linear":
        return inv_freq / rope["factor"]
    if rope["rope_type"] == "llama3":
        context = rope["original_max_position_embeddings"]
        low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
        wavelen = 2 * math.pi / inv_freq
        blend = ((context / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # 0: stretch, 1: keep
        return (1 - blend) * inv_freq / factor + blend * inv_freq
    return inv_freq


def rope_tables(inv_freq: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [max_len, head_dim] of position * inv_freq, each
    frequency twice (for both halves of a head), sin negated on the first
    half: what ``apply_rope`` multiplies by."""
    return rope_cos_sin(torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :])


def rope_cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """angles float32 [T, head_dim // 2] -> cos, sin [T, head_dim] as
    ``apply_rope`` takes them (each frequency twice, sin negated on the first half)."""
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the half-split pairs (x[i], x[i + d/2]) of every head:
    [x1 c - x2 s, x2 c + x1 s], as x * cos + [x2, x1] * sin with rope_tables'
    signed sin (bitwise the same: negation is exact). Four ops, not seven.

    x: float32 [T, heads, head_dim]; cos, sin: float32 [T, head_dim]"""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + swapped * sin[:, None, :]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in transformers' order of operations:
    normalise in float32, cast back to x's dtype, then scale. (torch's
    F.rms_norm computes the same in float32 but is no faster on CPU: a
    composite of the same ops plus casts, torch.profiler at batch 1.)

    x: [..., n] (float32 or bfloat16); weight: [n]"""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@dataclass
class DecoderLayer:
    """One decoder layer's weights, ready for the forward pass."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (heads + 2 kv_heads) * head_dim
    q_norm: torch.Tensor | None  # [head_dim] (qwen3)
    k_norm: torch.Tensor | None
    o: Linear  # heads * head_dim -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * ffn_padded ([gate | up], zero-padded)
    down: Linear  # ffn_padded -> hidden
    window: int
    rope: bool


def _pad_dim0(t: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pads dim 0 of t to size rows."""
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, size - t.shape[0]))


def _cat_or_none(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Concatenation of parts, or None when the checkpoint has none of them."""
    present = [t for t in parts if t is not None]
    if present and len(present) != len(parts):
        raise ValueError("checkpoint has biases for some fused projections but not all")
    return torch.cat(present) if present else None


def layer_projections(sd: dict[str, torch.Tensor], i: int) -> Weights:
    """Decoder layer i's projections from an HF Llama-style state dict, in
    DecoderLayer's order (qkv, o, gate_up, down): q/k/v and gate/up fused
    into one GEMM each, the SwiGLU width zero-padded to FFN_ALIGN."""
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    qkv = [attn + "q_proj", attn + "k_proj", attn + "v_proj"]
    width = -(-sd[mlp + "gate_proj.weight"].shape[0] // FFN_ALIGN) * FFN_ALIGN
    gate_up = [_pad_dim0(sd[mlp + name], width) for name in ("gate_proj.weight", "up_proj.weight")]
    gate_up_bias = [None if b is None else _pad_dim0(b, width)
                    for b in (sd.get(mlp + "gate_proj.bias"), sd.get(mlp + "up_proj.bias"))]
    down = sd[mlp + "down_proj.weight"]
    return [("qkv", torch.cat([sd[n + ".weight"] for n in qkv]), _cat_or_none([sd.get(n + ".bias") for n in qkv])),
            ("o", sd[attn + "o_proj.weight"], sd.get(attn + "o_proj.bias")),
            ("gate_up", torch.cat(gate_up), _cat_or_none(gate_up_bias)),
            ("down", F.pad(down, (0, width - down.shape[1])), sd.get(mlp + "down_proj.bias"))]


def build_layer(sd: dict[str, torch.Tensor], i: int, window: int, rope: bool, linears: list[Linear]) -> DecoderLayer:
    """Decoder layer i: its norms from sd, its projections' Linears (built
    from ``layer_projections(sd, i)``) given."""
    p = f"model.layers.{i}."
    qkv, o, gate_up, down = linears
    return DecoderLayer(
        input_norm=sd[p + "input_layernorm.weight"], qkv=qkv,
        q_norm=sd.get(p + "self_attn.q_norm.weight"), k_norm=sd.get(p + "self_attn.k_norm.weight"), o=o,
        post_norm=sd[p + "post_attention_layernorm.weight"], gate_up=gate_up, down=down,
        window=window, rope=rope)


# ---- engine -----------------------------------------------------------------------


class LlamaEngine(Engine):
    """Engine (see engine.py) running a Llama-family model with its own
    forward pass and a paged KV pool.

    dtype: weights and activations ("float32" | "bfloat16"); attention and
      returned logits / hidden states are float32; the KV cache is dtype's
      on CPU, float32 on a GPU (kv_dtype). bfloat16
      through the simd GEMM paths keeps the weights in bfloat16 and the
      activations in float32 (``act_dtype``: simd computes in float32,
      simd-dpbf16 rounds each GEMM's input to bfloat16 inside the kernel, and
      the small steps then run as the float32 numba kernels).
    kv_capacity_tokens / kv_memory_fraction: pool size (at most one), else
      DEFAULT_KV_CAPACITY_TOKENS.
    gemm: "auto" (on CPU the fastest path that keeps rows row-count
      invariant on this machine, gemm_select.select) | a name in
      gemm_select.GEMM_PATHS, refused (GemmRefused) where it breaks that
      invariance.
      On CUDA "auto" is "triton" (engine.gpu_ops: one tile shape for every
      row count); "aten" (cuBLAS) is checked like a CPU path and refused
      where it breaks invariance.
    attention: "auto" ("paged" on CPU, "triton" on CUDA) | "paged" (numba,
      row-invariant) | "triton" (engine.gpu_ops, row-invariant; CUDA, or CPU
      under TRITON_INTERPRET=1) | "sdpa" (torch, any device, not row-invariant).
    num_threads: torch and attention threads (process-wide for torch);
      default: the CPU cores this process may use, or 1 for small models
      (MULTITHREAD_MIN_LAYER_BYTES).
    fuse_small_steps: on CPU with paged attention, run the small steps (RMSNorm,
      RoPE and the KV write, SiLU) as engine.cpu_ops's numba kernels; False
      runs them as torch ops in the weights' dtype, as the engine did before
      those kernels (benchmarks compare the two).
    cuda_graphs: on CUDA with the Triton kernels, passes of up to
      cuda_graph.MAX_ROWS tokens (decode steps, verifications, short
      prefills), with or without feature layers, replay CUDA graphs
      captured per padded shape (engine.cuda_graph): no per-layer host
      work.
    fuse_gpu_steps: with the Triton kernels, run the small steps as
      gpu_ops's fused kernels (RoPE + scale + KV write, SiLU x up, residual
      add + RMSNorm: about half the kernels per layer; SmolLM2 bfloat16
      decode steps with graphs 1.50 ms against 2.08 on an H200,
      benchmarks/bench_gpu.py --fused); not for layers that normalise
      queries and keys (qwen3), which keep the separate steps.
    kv_dtype: the KV pool's storage, "auto" (dtype on CPU with the paged or
      sdpa attention, else float32) | "float32" | "bfloat16" (kv_pool.KV_DTYPES;
      bfloat16 on CPU with the paged or sdpa attention only): bfloat16 keeps
      each key and value rounded to bfloat16 and widens it exactly on every
      read, half the bytes a decode step's attention reads and twice the
      tokens per byte of pool, with the same row invariance (SmolLM2 in
      bfloat16 on 2 cores of an AMD EPYC: a decode step after 2000 tokens
      took 0.76-0.80x the float32 cache's time; benchmarks/bench_kv_dtype.py).
    gemm_rows: the rows per forward "auto" is fastest for on CPU (row count
      -> weight, gemm_select.select's timed_rows): serving's by default
      (batch-1 decoding first); a batch job passes its own (distill's
      teacher: distill.TEACHER_GEMM_ROWS, 128 rows a forward), and then
      the fastest invariant path wins outright: the preference for the
      kinds the fused steps run around applies to serving's rows only."""

    def __init__(self, checkpoint: Checkpoint, dtype: str = "float32", kv_capacity_tokens: int | None = None,
                 kv_memory_fraction: float | None = None, max_model_len: int | None = None,
                 device: str = "cpu", gemm: str = "auto", attention: str = "auto",
                 num_threads: int | None = None, block_size: int = 16,
                 head_token_ids: tuple[int, ...] | None = None, fuse_small_steps: bool = True,
                 cuda_graphs: bool = True, fuse_gpu_steps: bool = True, kv_dtype: str = "auto",
                 gemm_rows: Mapping[int, float] = SERVING_ROWS) -> None:
        if kv_capacity_tokens is not None and kv_memory_fraction is not None:
            raise ValueError("give kv_capacity_tokens or kv_memory_fraction, not both")
        self.device = torch.device(device)
        on_cpu = self.device.type == "cpu"
        if attention == "auto":
            attention = "paged" if on_cpu else "triton"
        if kv_dtype not in ("auto", *KV_DTYPES):
            raise ValueError(f"kv_dtype {kv_dtype!r}: one of auto, {', '.join(KV_DTYPES)}")
        cpu_attention = on_cpu and attention != "triton"  # the kernels that read a bfloat16 cache
        if kv_dtype == "auto":
            kv_dtype = dtype if cpu_attention and dtype in KV_DTYPES else "float32"
        #: the KV pool's storage ("float32" | "bfloat16")
        self.kv_dtype = kv_dtype
        if kv_dtype != "float32" and not cpu_attention:
            raise ValueError(f"kv_dtype {kv_dtype!r}: the CPU attention kernels only (not on {self.device.type} "
                             f"with attention {attention!r}, whose kernels read float32 caches)")
        if gemm == "auto" and not on_cpu:
            gemm = "triton"
        if attention not in ("paged", "sdpa", "triton"):
            raise ValueError(f"unknown attention {attention!r}")
        if not on_cpu and (gemm not in ("triton", "aten") or attention == "paged"):
            raise ValueError(f"on {self.device.type} the GEMMs run as 'triton' or 'aten' and attention as 'triton' "
                             f"or 'sdpa', not gemm={gemm!r}, attention={attention!r} (CPU paths)")
        if on_cpu and "triton" in (gemm, attention) and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("gemm='triton' and attention='triton' run on CUDA (on CPU only under "
                             "TRITON_INTERPRET=1, for tests)")
        #: the row-invariant GPU kernels (engine.gpu_ops) for GEMMs and norms
        self.triton = gemm == "triton"
        self.attention = attention
        self.dtype = torch_dtype(dtype)
        self.spec = spec = LlamaSpec.from_config(checkpoint.config)

        sd = {k: v.to(self.device, self.dtype) for k, v in checkpoint.state_dict.items()}
        layer_bytes = sum(v.nbytes for k, v in sd.items() if k.startswith("model.layers.")) / len(spec.layer_rope)
        if num_threads is None:
            num_threads = default_num_threads() if layer_bytes >= MULTITHREAD_MIN_LAYER_BYTES else 1
        self.num_threads = num_threads
        self.embed = sd["model.embed_tokens.weight"]  # [vocab, hidden]
        self.final_norm = sd["model.norm.weight"]
        n_layers = len(spec.layer_rope)
        projections = [p for i in range(n_layers) for p in layer_projections(sd, i)]
        head = sd.get("lm_head.weight", self.embed)  # [vocab, hidden]
        if head_token_ids is not None:  # a reduced head: [len(head_token_ids), hidden]
            if max(head_token_ids) >= head.shape[0]:
                raise ValueError(f"head_token_ids: id {max(head_token_ids)} outside the head's {head.shape[0]} rows")
            head = head[torch.tensor(head_token_ids, device=self.device)].contiguous()
        projections.append(("lm_head", head, None))
        self.gemm_report = None  # off CPU: no choice made (Engine.gemm_report)
        if self.triton:
            from specdec.engine.gpu_ops import TritonLinear  # Triton: imported only where it runs

            linears: list[Linear] = [TritonLinear(w, b) for _, w, b in projections]
            self.gemm = "triton"
        elif on_cpu:
            set_torch_threads(num_threads)
            # the fused CPU path (below) runs around numba/simd GEMMs only: worth more than their timings show
            # at serving's few rows. A batch job's own rows (distill's teacher: 128) let the timings decide: the
            # costs around a GEMM call are per call, small beside a 128-row GEMM (SmolLM2's teacher on 2 AVX2
            # cores: oneDNN 275 answer tokens/s against the preferred simd-gguf's 197)
            fusable = fuse_small_steps and attention == "paged"
            serving = dict(gemm_rows) == dict(SERVING_ROWS)
            prefer = (("numba", "simd", "gguf") if self.dtype == torch.float32 else ("simd",)) \
                if fusable and serving else ()
            # a float32 model dequantised from GGUF blocks: simd-gguf reads the blocks (the same bits, fewer bytes)
            quantized = GgufBlocks(checkpoint.gguf) if checkpoint.gguf and (
                gemm == "simd-gguf" or (gemm == "auto" and self.dtype == torch.float32)) else None
            selection = select(projections, self.dtype, num_threads, gemm, prefer_kinds=prefer, timed_rows=gemm_rows,
                               quantized=quantized)
            linears, self.gemm, self.gemm_report = selection.linears, selection.path.name, selection.report
            if self.dtype == torch.bfloat16 and not native_bf16() and selection.path.kind != "simd":
                log.warning("LlamaEngine: bfloat16 through %s on a CPU without native bfloat16 (no avx512_bf16 / "
                            "amx_bf16): expect float32 speed or worse (simd widens bfloat16 weights on any CPU)",
                            self.gemm)
        else:  # aten (cuBLAS) on a GPU: only where it keeps row-count invariance for these shapes
            aten = GemmPath("aten", "aten", 1)
            failure = invariance_failure(functools.partial(Linear, path=aten), projections, check_row_counts(),
                                         self.dtype)
            if failure is not None:
                raise GemmRefused(f"gemm='aten' breaks row-count invariance on {self.device.type} "
                                  f"({torch.cuda.get_device_name(self.device)}): {failure}; use gemm='auto'")
            linears, self.gemm = [Linear(w, b, aten) for _, w, b in projections], "aten"
        self.lm_head = linears[-1]
        self.layers = [build_layer(sd, i, window, rope, linears[4 * i:4 * i + 4])
                       for i, (window, rope) in enumerate(zip(spec.layer_windows, spec.layer_rope))]
        del sd, projections
        limit = spec.max_position_embeddings
        self.max_model_len = min(limit, max_model_len) if max_model_len else limit
        cos, sin = rope_tables(rope_inv_freq(spec.rope, spec.head_dim), self.max_model_len)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        self.scale = spec.head_dim ** -0.5
        # on CPU with paged attention the small steps run as numba calls (cpu_ops), on float32
        # activations: float32 models, and bfloat16 weights read by simd (its arithmetic is float32
        # anyway, so a bfloat16 stream between the steps would only add a cast per step)
        self.fused = (fuse_small_steps and on_cpu and attention == "paged"
                      and (self.dtype == torch.float32 or GEMM_PATHS[self.gemm].kind == "simd"))
        self.act_dtype = torch.float32 if self.fused else self.dtype  # the residual stream's dtype
        if self.fused:
            self._cos_np, self._sin_np = self.cos.numpy(), self.sin.numpy()
            cpu_ops.warm_up(np.uint16 if kv_dtype == "bfloat16" else np.float32)
            if self.dtype != torch.float32:  # the numba steps take float32 norm weights (exact copies)
                self.layers = [replace(layer, input_norm=layer.input_norm.float(), post_norm=layer.post_norm.float(),
                                       q_norm=None if layer.q_norm is None else layer.q_norm.float(),
                                       k_norm=None if layer.k_norm is None else layer.k_norm.float())
                               for layer in self.layers]
                self.final_norm = self.final_norm.float()
            self._norm_arrays = [(layer.input_norm.numpy(), layer.post_norm.numpy()) for layer in self.layers]
            self._final_norm_np = self.final_norm.numpy()
            self._eps_np = np.float32(self.spec.rms_norm_eps)
            self._scale_np = np.float32(self.scale)
            self._gguf_arrays: gguf_layers.LayerArrays | None = None
            self._gguf_built = False
            # the embedding rows as the stream's float32 (bfloat16 bits widened exactly: a shift)
            self._embed_np = self.embed.view(torch.int16).numpy().view(np.uint16) \
                if self.embed.dtype == torch.bfloat16 else self.embed.float().numpy()

        if kv_memory_fraction is not None:
            per_token = KVPool.bytes_per_token(n_layers, spec.num_kv_heads, spec.head_dim, KV_DTYPES[kv_dtype])
            kv_capacity_tokens = KVPool.tokens_for_memory_fraction(kv_memory_fraction, per_token, device)
        self.pool = KVPool(n_layers, spec.num_kv_heads, spec.head_dim,
                           kv_capacity_tokens or DEFAULT_KV_CAPACITY_TOKENS,
                           block_size=block_size, device=device, num_threads=num_threads,
                           kv_dtype=KV_DTYPES[kv_dtype])
        self.gpu_fused = (fuse_gpu_steps and self.triton and attention == "triton"
                          and all(layer.q_norm is None for layer in self.layers))
        #: forward passes of up to cuda_graph.MAX_ROWS tokens replayed as CUDA graphs (engine.cuda_graph)
        self.graphs = ForwardGraphs(self) if (cuda_graphs and self.device.type == "cuda" and self.triton
                                             and attention == "triton") else None
        self.facts = ModelFacts(
            model=checkpoint.name, vocab_size=self.lm_head.out_features, max_model_len=self.max_model_len,
            eos_token_ids=eos_token_ids(checkpoint.config, checkpoint.generation_config),
            hidden_size=spec.hidden_size, num_layers=n_layers, dtype=dtype,
            kv_capacity_tokens=self.pool.capacity_tokens, kv_dtype=kv_dtype)
        log.info("LlamaEngine: %s, %d layers, %s, gemm=%s, attention=%s, KV %d tokens (%s), %d threads",
                 checkpoint.name, n_layers, dtype, self.gemm, attention, self.pool.capacity_tokens, kv_dtype,
                 num_threads)

    # ---- Engine protocol -----------------------------------------------------------

    def ensure_capacity(self, seq_id: str, total_len: int) -> None:
        if total_len > self.max_model_len:
            raise ValueError(f"{seq_id!r}: {total_len} tokens exceed max_model_len {self.max_model_len}")
        self.pool.ensure_capacity(seq_id, total_len)

    def cached_len(self, seq_id: str) -> int:
        return self.pool.cached_len(seq_id)

    def truncate(self, seq_id: str, length: int) -> None:
        self.pool.truncate(seq_id, length)

    def release(self, seq_id: str) -> bool:
        return self.pool.release(seq_id)

    def free_tokens(self) -> int:
        return self.pool.free_tokens()

    @torch.inference_mode()
    def prepare(self, max_batch_size: int, max_tokens_per_forward: int | None = None,
                feature_layers: tuple[int, ...] = ()) -> None:
        """Captures every CUDA graph batches of these sizes can need (on a GPU
        with graphs; ForwardGraphs.capture_all, which compiles the kernels on
        the way), so no request waits for a compile or a capture; with
        feature_layers, the graphs of passes asking for those layers' states
        (the others are captured the first time a batch needs them). On the
        fused CPU path, one decode step of a scratch sequence loads (or, the
        first time on a machine, compiles: ~10 s) the one-call layers
        (``gguf_layers``) where the model takes them."""
        if self.graphs is None:
            if self.fused and self._gguf_layers() is not None:
                scratch = "\0prepare"
                self.ensure_capacity(scratch, 1)
                try:
                    self.forward([ForwardItem(scratch, np.zeros(1, np.int32), 1)])
                finally:
                    self.release(scratch)
            return
        check_feature_layers(feature_layers, len(self.layers))
        start = time.perf_counter()
        keys = self.graphs.capture_all(max_batch_size, max_tokens_per_forward or MAX_ROWS, feature_layers)
        log.info("LlamaEngine: %d CUDA graphs captured in %.1f s (up to %d rows, %d sequences%s)", len(keys),
                 time.perf_counter() - start, max(k[0] for k in keys), max(k[1] for k in keys),
                 f", feature layers {list(feature_layers)}" if feature_layers else "")

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem], return_hidden_states: bool = False,
                feature_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """One pass over all items' new tokens; logits (and final-norm hidden
        states, float32) of each item's last ``num_logits`` rows, in item
        order; the feature_layers' states of every row (Engine.forward)."""
        check_feature_layers(feature_layers, len(self.layers))
        if not items:
            width = len(feature_layers) * self.spec.hidden_size
            return ForwardOutput(torch.empty(0, self.facts.vocab_size),
                                 torch.empty(0, self.spec.hidden_size) if return_hidden_states else None,
                                 torch.empty(0, width, dtype=self.dtype) if feature_layers else None)
        tokens = self._check(items)
        seq_ids = [it.seq_id for it in items]
        counts = [len(it.token_ids) for it in items]
        batch = self.pool.plan(seq_ids, counts)
        ends = np.cumsum(counts)
        rows = np.concatenate([np.arange(e - it.num_logits, e) for e, it in zip(ends, items)])
        if self.graphs is not None and not return_hidden_states and self.graphs.takes(items):
            logits, features = self.graphs.run(tokens, batch, rows, feature_layers)
            self.pool.commit(seq_ids, counts)
            return ForwardOutput(logits, None, features)
        if self.fused:  # numpy from the embedding to the logits (``_decoder_arrays``)
            _, final_np, states = self._decoder_arrays(tokens, batch, feature_layers)
            normed_np = final_np[rows]
            normed = torch.from_numpy(normed_np)
            logits = torch.from_numpy(self.lm_head.on_array(normed_np)) if len(rows) else \
                torch.empty(0, self.facts.vocab_size)  # a prefill chunk: no LM head
        else:
            positions = torch.from_numpy(batch.row_pos).to(self.device).long()
            normed, states = self._final_rows(torch.from_numpy(tokens).to(self.device), positions, batch,
                                              feature_layers, torch.from_numpy(rows).to(self.device))
            if len(rows):
                logits = self.lm_head(normed).float()
            else:  # a prefill chunk: skip the LM head
                logits = torch.empty(0, self.facts.vocab_size, device=self.device)
        self.pool.commit(seq_ids, counts)
        return ForwardOutput(logits, normed.float() if return_hidden_states else None,
                             torch.cat(states, dim=1).to(self.dtype) if feature_layers else None)

    # ---- the model ---------------------------------------------------------------

    def _check(self, items: list[ForwardItem]) -> np.ndarray:
        """Validates a batch; returns its token ids, int64 [T]."""
        if len({it.seq_id for it in items}) != len(items):
            raise ValueError("a forward batch holds the same seq_id twice")
        for it in items:
            n = len(it.token_ids)
            if n < 1 or not 0 <= it.num_logits <= n:
                raise ValueError(f"{it.seq_id!r}: {n} tokens with num_logits {it.num_logits}")
            if self.pool.reserved_len(it.seq_id) == 0:
                raise KeyError(f"{it.seq_id!r}: no KV capacity ensured")
            if self.pool.cached_len(it.seq_id) + n > self.max_model_len:
                raise ValueError(f"{it.seq_id!r}: exceeds max_model_len {self.max_model_len}")
        tokens = np.concatenate([np.asarray(it.token_ids, dtype=np.int64) for it in items])
        if tokens.min() < 0 or tokens.max() >= self.spec.vocab_size:
            raise ValueError(f"token id outside [0, {self.spec.vocab_size})")
        return tokens

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim: the row-invariant GPU kernel with the
        Triton GEMMs (torch's reductions split a row by the tensor's shape on
        a GPU), else the torch ops."""
        if not self.triton:
            return rms_norm(x, weight, self.spec.rms_norm_eps)
        from specdec.engine import gpu_ops  # Triton: imported only where it runs

        return gpu_ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, self.spec.rms_norm_eps).view(x.shape)

    def _final_rows(self, tokens: torch.Tensor, positions: torch.Tensor, batch: PagedBatch | DeviceRows,
                    feature_layers: tuple[int, ...],
                    rows: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The final-normed stream of ``rows`` (None: every row) and the
        feature_layers' states of every row (``_decoder``'s)."""
        if self.gpu_fused:
            normed, states = self._decoder_fused(tokens, batch, feature_layers)
            return (normed if rows is None else normed[rows]), states
        h, states = self._decoder(tokens, positions, batch, feature_layers)
        return self._norm(h if rows is None else h[rows], self.final_norm), states

    def _decoder_fused(self, tokens: torch.Tensor, batch: PagedBatch | DeviceRows,
                       feature_layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``_decoder`` through gpu_ops's fused small steps (fuse_gpu_steps),
        returning the final-normed stream of every row (the last residual
        add and the final norm are one kernel)."""
        from specdec.engine import gpu_ops  # Triton: imported only where it runs

        eps, H, Hkv, D = self.spec.rms_norm_eps, self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        rows = self.pool.device_rows(batch)
        h = F.embedding(tokens, self.embed).to(self.act_dtype)
        T = h.shape[0]
        kept = {0: h} if 0 in feature_layers else {}
        x = gpu_ops.rms_norm(h, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            keys, values = self.pool.key_cache[i], self.pool.value_cache[i]
            q = gpu_ops.rope_write(layer.qkv(x), self.cos, self.sin, rows.row_pos, keys, values, rows.slot_block,
                                   rows.slot_offset, H, Hkv, D, self.scale, layer.rope)
            attn = gpu_ops.paged_attention(q, keys, values, rows.tables, rows.row_seq, rows.row_pos, layer.window,
                                           out_dtype=self.act_dtype)
            h, x = gpu_ops.add_rms_norm(h, layer.o(attn.view(T, H * D)), layer.post_norm, eps)
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            h, x = gpu_ops.add_rms_norm(h, layer.down(gpu_ops.silu_mul(layer.gate_up(x))), following, eps)
            if i + 1 in feature_layers:
                kept[i + 1] = h
        return x, [kept[i] for i in feature_layers]

    def _decoder(self, tokens: torch.Tensor, positions: torch.Tensor, batch: PagedBatch | DeviceRows,
                 feature_layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The residual stream after the last decoder layer, [T, hidden], and
        the stream after each of feature_layers layers (0: the embeddings),
        in their order. The stream is never updated in place, so keeping a
        reference to it is keeping its value."""
        h = F.embedding(tokens, self.embed).to(self.act_dtype)
        kept = {0: h} if 0 in feature_layers else {}
        cos, sin = self.cos[positions], self.sin[positions]  # [T, head_dim]
        for i, layer in enumerate(self.layers):
            h = h + self._attention(i, layer, self._norm(h, layer.input_norm), cos, sin, batch)
            h = h + self._mlp(layer, self._norm(h, layer.post_norm))
            if i + 1 in feature_layers:
                kept[i + 1] = h
        return h, [kept[i] for i in feature_layers]

    def _decoder_arrays(self, tokens: np.ndarray, batch,
                        feature_layers: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, list[torch.Tensor]]:
        """``_decoder`` on the fused CPU path, the stream returned as a numpy
        array, with its final norm (every row's; ``add_rms_norm`` computes it
        with the last residual add): the float32 stream as numpy arrays from one numba call to the
        next (cpu_ops, the numba GEMMs, the paged attention), no torch op
        inside a layer (each costs about a microsecond of dispatch, ~20 of
        them per layer), nor around the layers (``forward`` takes the final
        norm and the LM head on arrays too). Layers that normalise queries
        and keys take ``_attention``'s torch steps."""
        eps = self._eps_np
        T, H, Hkv, D = len(tokens), self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        slots = (batch.slot_block, batch.slot_offset)
        h = self._embed_np[tokens]  # [T, hidden]
        if h.dtype == np.uint16:  # bfloat16 bits -> float32, exactly
            h = (h.astype(np.uint32) << 16).view(np.float32)
        kept = {0: h} if 0 in feature_layers else {}
        rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [T, head_dim], once, for torch steps
        x = cpu_ops.rms_norm(h, self._norm_arrays[0][0], eps)
        layout = gguf_layers.layout(T) if self._gguf_layers() is not None else None
        if layout is not None:  # every layer in one numba call
            return self._decoder_gguf(h, x, batch, feature_layers, kept, layout)
        last = len(self.layers) - 1
        for i, (layer, (_, post_norm)) in enumerate(zip(self.layers, self._norm_arrays)):
            if layer.q_norm is None:  # RoPE, scale and the KV write in one call
                qkv = layer.qkv.on_array(x).reshape(T, H + 2 * Hkv, D)
                q = cpu_ops.rope_scale_write(qkv, H, Hkv, self._cos_np, self._sin_np, batch.row_pos, layer.rope,
                                             self.scale, *self.pool.layer_arrays(i), *slots)
                attn = layer.o.on_array(self.pool.attend_array(i, q, batch, layer.window).reshape(T, H * D))
            else:
                if rope is None:
                    positions = torch.from_numpy(batch.row_pos).long()
                    rope = self.cos[positions], self.sin[positions]
                attn = self._attention(i, layer, torch.from_numpy(x), *rope, batch).numpy()
            # each residual add with the norm after it, in one call: the next layer's input norm, or the final
            h, x = cpu_ops.add_rms_norm(h, attn, post_norm, eps)
            following = self._norm_arrays[i + 1][0] if i < last else self._final_norm_np
            h, x = cpu_ops.add_rms_norm(h, layer.down.on_array(cpu_ops.silu_mul(layer.gate_up.on_array(x))),
                                        following, eps)
            if i + 1 in feature_layers:
                kept[i + 1] = h
        return h, x, [torch.from_numpy(kept[i]) for i in feature_layers]

    def _gguf_layers(self) -> gguf_layers.LayerArrays | None:
        """The layers as ``gguf_layers.decode_layers`` takes them (built on
        the first call), or None where they cannot go that way."""
        if not self._gguf_built:
            self._gguf_arrays, self._gguf_built = gguf_layers.layer_arrays(self.layers), True
            self._cache_np = self.pool.cache_arrays()
            why = gguf_layers.not_taken(self.layers) if self._gguf_arrays is None else None
            log.info("LlamaEngine: decoder layers %s", "in one numba call (gguf_layers)" if why is None
                     else f"in a Python loop of kernel calls ({why})")
        return self._gguf_arrays

    def _decoder_gguf(self, h: np.ndarray, x: np.ndarray, batch, feature_layers: tuple[int, ...],
                      kept: dict[int, np.ndarray],
                      layout: int) -> tuple[np.ndarray, np.ndarray, list[torch.Tensor]]:
        """``_decoder_arrays``' layers in one numba call (``gguf_layers``):
        h the embedded rows, x their first input norm, layout the GEMMs'
        (``gguf_layers.layout``)."""
        arrays = self._gguf_arrays
        assert arrays is not None
        T, H, Hkv = h.shape[0], self.spec.num_heads, self.spec.num_kv_heads
        later = [i for i in feature_layers if i > 0]
        feature_at = np.full(len(self.layers), -1, dtype=np.int64)
        for n, i in enumerate(later):
            feature_at[i - 1] = n
        features = np.empty((len(later), T, h.shape[1]), np.float32)
        units = batch.units(H // Hkv, Hkv)
        threads = self.pool.num_threads
        attention_chunks = 1 if threads == 1 or batch.attention_work * H < kv_pool.PARALLEL_MIN_WORK else threads
        chunks = self.layers[0].qkv.threads
        with LAUNCH_LOCK:
            set_team(max(chunks, attention_chunks))
            h, x = gguf_layers.decode_layers(
                h, x, self._eps_np, arrays.input_norms, arrays.post_norms, self._final_norm_np, arrays.qkv, arrays.o,
                arrays.gate_up, arrays.down, arrays.kinds, layout, arrays.out_features, chunks, H, Hkv,
                self.spec.head_dim, self._cos_np, self._sin_np, batch.row_pos, arrays.rope, self._scale_np,
                *self._cache_np, batch.slot_block, batch.slot_offset, batch.block_tables,
                batch.row_seq, arrays.window, units, attention_chunks, feature_at, features)
        kept.update({i: features[n] for n, i in enumerate(later)})
        return h, x, [torch.from_numpy(kept[i]) for i in feature_layers]

    def _attention(self, i: int, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, batch: PagedBatch | DeviceRows) -> torch.Tensor:
        """x: [T, hidden] normed -> [T, hidden] attention output (before the residual)."""
        T = x.shape[0]
        H, Hkv, D = self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        qkv = layer.qkv(x).view(T, H + 2 * Hkv, D)
        qk, v = qkv[:, :H + Hkv], qkv[:, H + Hkv:]  # queries and keys rotate together: one RoPE call
        if layer.q_norm is not None and layer.k_norm is not None:
            qk = torch.cat([self._norm(qk[:, :H], layer.q_norm), self._norm(qk[:, H:], layer.k_norm)], dim=1)
        qk = qk.float()
        if layer.rope:
            qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :H], qk[:, H:]
        self.pool.write(i, k, v.float(), batch)
        query = (q * self.scale).contiguous()
        if self.attention == "triton":
            out = self.pool.attend_triton(i, query, batch, layer.window)  # float32 [T, H, D]
        else:
            assert isinstance(batch, PagedBatch)  # DeviceRows come from CUDA graphs, which run the Triton kernels
            attend = self.pool.attend if self.attention == "paged" else self.pool.attend_sdpa
            out = attend(i, query, batch, layer.window)
        return layer.o(out.view(T, H * D).to(self.act_dtype))

    def _mlp(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU: down(silu(gate x) * up x); x: [T, hidden] normed."""
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)
