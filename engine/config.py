"""What engine to build: ``EngineConfig`` and the engine options' choices and
defaults. Plain Python (no torch), so command lines can import it cheaply."""
from __future__ import annotations

from dataclasses import dataclass, fields

#: KV pool size in tokens when neither a token count nor a memory fraction is given.
DEFAULT_KV_CAPACITY_TOKENS = 32768
DTYPE_NAMES = ("float32", "bfloat16")
#: The KV pool's storage dtypes (``kv_dtype``, kv_pool.KV_DTYPES): bfloat16 halves
#: the bytes per cached token, on CPU.
KV_DTYPE_NAMES = ("float32", "bfloat16")
#: ``kv_dtype`` choices: "auto" is the model's dtype where the engine's
#: attention reads that dtype (CPU), else float32 (LlamaEngine.kv_dtype).
KV_DTYPE_CHOICES = ("auto", *KV_DTYPE_NAMES)
ENGINE_KINDS = ("auto", "llama", "hf")
DEVICES = ("cpu", "cuda")
#: CPU GEMM paths ``gemm`` may force (gemm_select.GEMM_PATHS); "auto" measures.
GEMM_PATH_NAMES = ("onednn", "aten", "onednn-unpadded", "numba", "numba1", "numba6", "simd", "simd-dpbf16",
                   "simd-l1", "simd-gguf")
#: The GPU's GEMM path (engine.gpu_ops: "auto" on CUDA); "aten" runs there too.
GPU_GEMM_PATH_NAMES = ("triton",)
GEMM_CHOICES = ("auto", *GEMM_PATH_NAMES, *GPU_GEMM_PATH_NAMES)


@dataclass(frozen=True)
class EngineConfig:
    """What to run and how; the scorer's and the draft proposer's flags map
    onto it one to one."""

    model: str  # directory, .gguf file, shared-models name or hub id
    dtype: str = "float32"  # "float32" | "bfloat16": weights and activations
    device: str = "cpu"  # "cpu" | "cuda"
    engine: str = "auto"  # "auto" (llama when supported, else hf) | "llama" | "hf"
    kv_capacity_tokens: int | None = None  # KV pool size; default DEFAULT_KV_CAPACITY_TOKENS
    kv_memory_fraction: float | None = None  # or: this fraction of free memory (not both)
    max_model_len: int | None = None  # caps the model's context
    # Llama runner only (see llama.LlamaEngine):
    gemm: str = "auto"  # "auto" (checked and timed on this CPU, gemm_select; "triton" on CUDA) | a GEMM_CHOICES entry
    attention: str = "auto"
    num_threads: int | None = None
    block_size: int = 16
    kv_dtype: str = "auto"  # the KV pool's storage, a KV_DTYPE_CHOICES entry (bfloat16: CPU only)
    # the LM head computes the logits of these token ids only, column j for
    # token head_token_ids[j] (a draft's reduced vocabulary); None: all
    head_token_ids: tuple[int, ...] | None = None

    def check(self) -> None:
        """Raises ValueError naming the first bad option."""
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"engine must be one of {', '.join(ENGINE_KINDS)}, got {self.engine!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.kv_dtype not in KV_DTYPE_CHOICES:
            raise ValueError(f"kv_dtype (--kv-dtype) must be one of {', '.join(KV_DTYPE_CHOICES)}, "
                             f"got {self.kv_dtype!r}")
        if self.kv_dtype == "bfloat16" and self.device != "cpu":
            raise ValueError(f"kv_dtype (--kv-dtype) {self.kv_dtype!r} runs on CPU only (the GPU kernels read "
                             f"float32 caches), not on {self.device!r}")
        if self.gemm not in GEMM_CHOICES:
            raise ValueError(f"gemm must be one of {', '.join(GEMM_CHOICES)}, got {self.gemm!r}")
        if self.kv_capacity_tokens is not None and self.kv_memory_fraction is not None:
            raise ValueError("kv_capacity_tokens and kv_memory_fraction: give one, not both")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be >= 1, got {self.kv_capacity_tokens}")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.head_token_ids is not None and (not self.head_token_ids or min(self.head_token_ids) < 0
                                                or len(set(self.head_token_ids)) != len(self.head_token_ids)):
            raise ValueError("head_token_ids must be distinct token ids >= 0, at least one")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads (--threads, --draft-threads) must be >= 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def llama_only_options_set(self) -> list[str]:
        """Names of Llama-runner options that differ from their defaults."""
        defaults = EngineConfig(self.model)
        llama_only = ("gemm", "attention", "num_threads", "block_size", "head_token_ids", "kv_dtype")
        return [f.name for f in fields(self) if f.name in llama_only
                and getattr(self, f.name) != getattr(defaults, f.name)]
