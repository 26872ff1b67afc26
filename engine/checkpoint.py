"""Loading a causal LM's weights and the facts every engine needs from them.

Weights come through ``transformers`` (safetensors, .bin or GGUF, which it
dequantises), which also standardises the config. ``load_hf_model`` is the
one place a model is read from disk or the hub; both engines start from it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.models import resolve_model

#: Engine dtypes by name (config.DTYPE_NAMES): weights and activations.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an engine dtype name; ValueError naming the choices."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_hf_model(model: str, dtype: str = "float32"):
    """A transformers causal LM in eval mode, on the CPU, from a directory,
    a .gguf file, a shared-models name or a hub id."""
    from transformers import AutoModelForCausalLM

    src = resolve_model(model)
    return AutoModelForCausalLM.from_pretrained(src.path, dtype=torch_dtype(dtype), **src.hf_kwargs()).eval()


@dataclass
class Checkpoint:
    """A causal LM's config and weights, as transformers loaded them."""

    name: str  # id or path as given
    config: object  # transformers PretrainedConfig
    generation_config: object | None
    state_dict: dict[str, torch.Tensor]  # HF names: model.layers.{i}.self_attn.q_proj.weight, ...

    @classmethod
    def load(cls, model: str, dtype: str = "float32") -> "Checkpoint":
        """Loads through transformers in ``dtype`` (GGUF weights are dequantised)."""
        return cls.of_model(load_hf_model(model, dtype), model)

    @classmethod
    def of_model(cls, hf_model, name: str) -> "Checkpoint":
        """Takes (shares, does not copy) the tensors of a loaded transformers model."""
        return cls(name, hf_model.config, getattr(hf_model, "generation_config", None),
                   dict(hf_model.state_dict()))


def eos_token_ids(config, generation_config) -> tuple[int, ...]:
    """EOS ids from the generation config, else the model config (an int or a list)."""
    for cfg in (generation_config, config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()
