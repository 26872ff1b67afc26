"""``build_engine``: the one way to get an Engine, from one ``EngineConfig``.

Llama-family models run on the project's own runner (``llama.LlamaEngine``);
anything else, or ``engine="hf"``, on the transformers engine
(``hf_engine.HFEngine``), with one warning saying why when it was not asked
for. The model is read once (``checkpoint.load_hf_model``, or without
transformers from the record of an earlier load:
``checkpoint.remembered_checkpoint``) and its config decides. Every option
reaches the engine that runs, or is refused with a message naming it:
options of the Llama runner are refused on the transformers engine.
"""
from __future__ import annotations

import logging

from specdec.engine.base import Engine
from specdec.engine.checkpoint import Checkpoint, load_hf_model, remembered_checkpoint, torch_dtype
from specdec.engine.config import DEFAULT_KV_CAPACITY_TOKENS, EngineConfig
from specdec.engine.kv_pool import KVPool

log = logging.getLogger(__name__)

def check_device(device: str) -> None:
    """Raises ValueError when this machine cannot run ``device``."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"device 'cuda': torch {torch.__version__} ({build}) sees no CUDA device")


def build_engine(config: EngineConfig) -> Engine:
    """Loads config.model once and builds the engine that runs it."""
    from specdec.engine.llama import LlamaEngine, unsupported_reason

    config.check()
    check_device(config.device)
    checkpoint = remembered_checkpoint(config.model, config.dtype) if config.engine != "hf" else None
    if checkpoint is None or unsupported_reason(checkpoint.config):
        hf_model = load_hf_model(config.model, config.dtype)
        reason = unsupported_reason(hf_model.config)
        if config.engine == "llama" and reason:
            raise ValueError(f"engine 'llama' cannot run {config.model}: {reason}")
        if config.engine == "hf" or reason:
            if reason:
                log.warning("build_engine: %s runs on the transformers fallback engine (HFEngine), not the "
                            "Llama runner: %s", config.model, reason)
            return _hf_engine(hf_model, config)
        checkpoint = Checkpoint.of_model(hf_model, config.model)
    return LlamaEngine(
        checkpoint, config.dtype,
        kv_capacity_tokens=config.kv_capacity_tokens, kv_memory_fraction=config.kv_memory_fraction,
        max_model_len=config.max_model_len, device=config.device, gemm=config.gemm,
        attention=config.attention, num_threads=config.num_threads, block_size=config.block_size,
        head_token_ids=config.head_token_ids, kv_dtype=config.kv_dtype)


def _hf_engine(hf_model, config: EngineConfig) -> Engine:
    from specdec.engine.hf_engine import HFEngine

    ignored = config.llama_only_options_set()
    if ignored:
        raise ValueError(f"{', '.join(ignored)}: options of the Llama runner; {config.model} runs on the "
                         f"transformers engine, which has none")
    capacity = config.kv_capacity_tokens
    if config.kv_memory_fraction is not None:
        capacity = KVPool.tokens_for_memory_fraction(
            config.kv_memory_fraction, _kv_bytes_per_token(hf_model.config, config.dtype), config.device)
    return HFEngine(hf_model, config.model, config.dtype, capacity or DEFAULT_KV_CAPACITY_TOKENS,
                    max_model_len=config.max_model_len, device=config.device)


def _kv_bytes_per_token(config, dtype: str) -> int:
    """Keys + values one token takes in a transformers cache of ``dtype``."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch_dtype(dtype).itemsize
