"""``load_engine``: the scorer's engine factory. Llama-family models run on the
project's own runner (``llama.LlamaEngine``); anything else falls back to the
transformers engine (``hf_engine.HFEngine``) with one warning saying why."""
from __future__ import annotations

import logging

from specdec.models import resolve_model
from specdec.scorer_svc.engine import Engine
from specdec.scorer_svc.kv_pool import KVPool
from specdec.scorer_svc.llama import DEFAULT_KV_CAPACITY_TOKENS, LlamaEngine, unsupported_reason

log = logging.getLogger(__name__)


def load_engine(model: str, dtype: str = "float32", kv_capacity_tokens: int | None = None,
                kv_memory_fraction: float | None = None, max_model_len: int | None = None,
                device: str = "cpu", **llama_options) -> Engine:
    """An Engine for ``model`` (directory, .gguf file, shared-models name or hub id).

    dtype: "float32" | "bfloat16"; kv_capacity_tokens / kv_memory_fraction:
    KV pool size, at most one of them; max_model_len caps the config's
    context; llama_options (gemm, attention, num_threads, block_size) go to
    LlamaEngine only."""
    from transformers import AutoConfig

    src = resolve_model(model)
    config = AutoConfig.from_pretrained(src.path, **src.hf_kwargs())
    reason = unsupported_reason(config)
    if reason is None:
        return LlamaEngine.from_pretrained(
            model, dtype, kv_capacity_tokens=kv_capacity_tokens, kv_memory_fraction=kv_memory_fraction,
            max_model_len=max_model_len, device=device, **llama_options)
    log.warning("load_engine: %s runs on the transformers fallback engine (HFEngine), not the Llama "
                "runner: %s", model, reason)
    if kv_memory_fraction is not None:
        kv_capacity_tokens = KVPool.tokens_for_memory_fraction(
            kv_memory_fraction, _kv_bytes_per_token(config, dtype), device)
    from specdec.scorer_svc.hf_engine import HFEngine

    return HFEngine(model, dtype, kv_capacity_tokens=kv_capacity_tokens or DEFAULT_KV_CAPACITY_TOKENS,
                    max_model_len=max_model_len, device=device)


def _kv_bytes_per_token(config, dtype: str) -> int:
    """Keys + values one token takes in a transformers cache of ``dtype``."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)
