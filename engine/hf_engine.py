"""An Engine over any `transformers` causal LM: one DynamicCache per sequence,
one model call per item. The fallback for architectures the project's own
Llama runner does not cover; correct, not fast."""
from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch

from specdec.engine.base import Engine, ForwardItem, ForwardOutput, ModelFacts, PoolExhausted, check_feature_layers
from specdec.engine.checkpoint import eos_token_ids

log = logging.getLogger(__name__)


class HFEngine(Engine):
    """hf_model: a loaded transformers causal LM (``checkpoint.load_hf_model``),
    moved to ``device``; dtype: its dtype's name, for ModelFacts."""

    def __init__(self, hf_model, name: str, dtype: str, kv_capacity_tokens: int,
                 max_model_len: int | None = None, device: str = "cpu") -> None:
        from transformers import DynamicCache

        self.model = hf_model.to(device).eval()
        self.device = device
        self._cache_cls = DynamicCache
        cfg = self.model.config
        limit = getattr(cfg, "max_position_embeddings", None) or 2048
        self.facts = ModelFacts(
            model=name, vocab_size=int(self.model.get_output_embeddings().weight.shape[0]),
            max_model_len=min(limit, max_model_len or limit),
            eos_token_ids=eos_token_ids(cfg, getattr(self.model, "generation_config", None)),
            hidden_size=int(cfg.hidden_size), num_layers=int(cfg.num_hidden_layers), dtype=dtype,
            kv_capacity_tokens=kv_capacity_tokens, kv_dtype=dtype)  # transformers caches in the model's dtype
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
    def forward(self, items: list[ForwardItem], return_hidden_states: bool = False,
                feature_layers: tuple[int, ...] = ()) -> ForwardOutput:
        check_feature_layers(feature_layers, self.facts.num_layers)
        # the last layer's output is the final norm's input (refused before any item runs if there is none)
        norm = self._final_norm() if self.facts.num_layers in feature_layers else None
        logits, hidden, features = [], [], []
        for item in items:
            n = len(item.token_ids)
            start = self._lens[item.seq_id]
            assert start + n <= self._reserved[item.seq_id], "capacity not ensured"
            ids = torch.as_tensor(np.asarray(item.token_ids, dtype=np.int64), device=self.device)[None]
            positions = torch.arange(start, start + n, device=self.device)[None]
            with _inputs_of(norm) as last:
                out = self.model(input_ids=ids, past_key_values=self._caches[item.seq_id],
                                 position_ids=positions, cache_position=positions[0], use_cache=True,
                                 output_hidden_states=return_hidden_states or bool(feature_layers))
            self._lens[item.seq_id] = start + n
            if feature_layers:  # transformers' last entry is after the final norm: ours is before it
                states = [*out.hidden_states[:-1], *last]
                features.append(torch.cat([states[i][0] for i in feature_layers], dim=1))
            if item.num_logits:
                logits.append(out.logits[0, n - item.num_logits:].float())
                if return_hidden_states:
                    hidden.append(out.hidden_states[-1][0, n - item.num_logits:])
        vocab = self.facts.vocab_size
        width = len(feature_layers) * self.facts.hidden_size
        return ForwardOutput(
            logits=torch.cat(logits) if logits else torch.empty(0, vocab),
            hidden_states=torch.cat(hidden) if hidden else None,
            features=(torch.cat(features) if features else torch.empty(0, width)) if feature_layers else None)

    def _final_norm(self) -> torch.nn.Module:
        """The decoder's final norm, whose input is feature layer num_layers."""
        try:
            norm = getattr(self.model.get_decoder(), "norm", None)
        except (AttributeError, NotImplementedError):
            norm = None
        if norm is None:
            raise ValueError(f"{self.facts.model}: no final norm named 'norm' to take the last layer's "
                             f"output (feature layer {self.facts.num_layers}) from")
        return norm

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


@contextlib.contextmanager
def _inputs_of(module: torch.nn.Module | None):
    """A list that collects module's first input during the block (stays
    empty for None)."""
    caught: list[torch.Tensor] = []
    if module is None:
        yield caught
        return
    hook = module.register_forward_pre_hook(lambda _, args: caught.append(args[0]))
    try:
        yield caught
    finally:
        hook.remove()
