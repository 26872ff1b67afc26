"""An Engine over any `transformers` causal LM: one DynamicCache per sequence,
one model call per item. The fallback for architectures the project's own
Llama runner does not cover; correct, not fast."""
from __future__ import annotations

import logging

import numpy as np
import torch

from specdec.models import resolve_model
from specdec.scorer_svc.engine import Engine, ForwardItem, ForwardOutput, ModelFacts, PoolExhausted

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def eos_ids_of(config, generation_config) -> tuple[int, ...]:
    """End-of-sequence ids from the generation config, else the model config."""
    for cfg in (generation_config, config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()


class HFEngine(Engine):
    def __init__(self, model: str, dtype: str = "float32", kv_capacity_tokens: int = 65536,
                 max_model_len: int | None = None, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, DynamicCache

        src = resolve_model(model)
        self.model = AutoModelForCausalLM.from_pretrained(
            src.path, dtype=_DTYPES[dtype], **src.hf_kwargs()).to(device).eval()
        self.device = device
        self._cache_cls = DynamicCache
        cfg = self.model.config
        limit = getattr(cfg, "max_position_embeddings", None) or 2048
        self.facts = ModelFacts(
            model=model, vocab_size=int(self.model.get_output_embeddings().weight.shape[0]),
            max_model_len=min(limit, max_model_len or limit),
            eos_token_ids=eos_ids_of(cfg, getattr(self.model, "generation_config", None)),
            hidden_size=int(cfg.hidden_size), dtype=dtype, kv_capacity_tokens=kv_capacity_tokens)
        self._caches: dict[str, object] = {}
        self._lens: dict[str, int] = {}  # tokens in each sequence's cache
        self._reserved: dict[str, int] = {}  # capacity promised to each sequence

    def ensure_capacity(self, seq_id, total_len):
        extra = total_len - self._reserved.get(seq_id, 0)
        if extra > 0:
            if extra > self.free_tokens():
                raise PoolExhausted(f"{seq_id}: needs {extra} more KV tokens, {self.free_tokens()} free")
            self._reserved[seq_id] = total_len
        if seq_id not in self._caches:
            self._caches[seq_id] = self._cache_cls()
            self._lens[seq_id] = 0

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem], return_hidden_states: bool = False) -> ForwardOutput:
        logits, hidden = [], []
        for item in items:
            n = len(item.token_ids)
            start = self._lens[item.seq_id]
            assert start + n <= self._reserved[item.seq_id], "capacity not ensured"
            ids = torch.as_tensor(np.asarray(item.token_ids, dtype=np.int64), device=self.device)[None]
            positions = torch.arange(start, start + n, device=self.device)[None]
            out = self.model(input_ids=ids, past_key_values=self._caches[item.seq_id],
                             position_ids=positions, cache_position=positions[0], use_cache=True,
                             output_hidden_states=return_hidden_states)
            self._lens[item.seq_id] = start + n
            if item.num_logits:
                logits.append(out.logits[0, n - item.num_logits:].float())
                if return_hidden_states:
                    hidden.append(out.hidden_states[-1][0, n - item.num_logits:])
        vocab = self.facts.vocab_size
        return ForwardOutput(
            logits=torch.cat(logits) if logits else torch.empty(0, vocab),
            hidden_states=torch.cat(hidden) if hidden else None)

    def cached_len(self, seq_id):
        return self._lens.get(seq_id, 0)

    def truncate(self, seq_id, length):
        if self._lens.get(seq_id, 0) > length:
            self._caches[seq_id].crop(length - self._lens[seq_id])  # negative: tokens to drop
            self._lens[seq_id] = length

    def release(self, seq_id):
        self._lens.pop(seq_id, None)
        self._reserved.pop(seq_id, None)
        return self._caches.pop(seq_id, None) is not None

    def free_tokens(self):
        return self.facts.kv_capacity_tokens - sum(self._reserved.values())
