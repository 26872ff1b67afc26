"""Loading a causal LM's weights and the facts every engine needs from them.

Weights come through ``transformers`` (safetensors, .bin or GGUF, which it
dequantises), which also standardises the config. ``load_hf_model`` is the
one place a model is read from disk or the hub; both engines start from it.
"""
from __future__ import annotations

import copy
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.models import ModelSource, gguf_cache_max_bytes, load_tokenizer, resolve_model

log = logging.getLogger(__name__)

#: float32 bytes a GGUF file's weights take per byte of the file, at most for
#: the quantisations served here (4.5 bits a weight: q4_1 7.1x; q8_0 3.8x),
#: to decide before dequantising whether its copy would be kept
GGUF_EXPANSION = 8
#: free space left on the cache's disk after writing a copy
GGUF_CACHE_SPARE_BYTES = 1 << 30
#: a half-written copy (its writer died) older than this is removed
GGUF_STALE_TMP_S = 3600.0

#: Engine dtypes by name (config.DTYPE_NAMES): weights and activations.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an engine dtype name; ValueError naming the choices."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_hf_model(model: str, dtype: str = "float32", cached: bool = True):
    """A transformers causal LM in eval mode, on the CPU, from a directory,
    a .gguf file, a shared-models name or a hub id. A GGUF model is read from
    its dequantised copy, written on its first load (``write_gguf_copy``;
    ``cached=False``: from the GGUF file, no copy read or written)."""
    from transformers import AutoModelForCausalLM

    src = resolve_model(model, cached)
    if src.gguf_file and src.gguf_cache:
        entry = write_gguf_copy(src)
        if entry is not None:
            src = ModelSource(str(entry))
    return AutoModelForCausalLM.from_pretrained(src.path, dtype=torch_dtype(dtype), **src.hf_kwargs()).eval()


def write_gguf_copy(src: ModelSource) -> Path | None:
    """Dequantises ``src``'s GGUF file in float32 and writes it, with its
    config and tokenizer, as a standard Hugging Face checkpoint to
    ``src.gguf_cache`` (written beside it, then renamed into place: a reader
    never sees half a copy, and of several processes writing at once one
    copy stays). The loaded tensors are the ones the GGUF load gives, bit
    for bit, in float32 and in any dtype they are cast to. Returns the
    copy's directory, or None where it is not kept (said in the log: too
    large for ``$SPECDEC_GGUF_CACHE_MAX_GB``, too little disk, unwritable);
    the caller then loads the GGUF file as before."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    assert src.gguf_file and src.gguf_cache
    gguf, entry = Path(src.path) / src.gguf_file, Path(src.gguf_cache)
    if (entry / "model.safetensors").is_file():  # another process wrote it since ``src`` was resolved
        return entry
    estimate = gguf.stat().st_size * GGUF_EXPANSION
    if estimate > gguf_cache_max_bytes():
        log.info("%s: not keeping a dequantised copy (up to ~%.1f GB, over $SPECDEC_GGUF_CACHE_MAX_GB)",
                 gguf, estimate / 2**30)
        return None
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        for old in entry.parent.glob(f"{entry.name}.tmp-*"):
            if time.time() - old.stat().st_mtime > GGUF_STALE_TMP_S:
                shutil.rmtree(old, ignore_errors=True)
        if shutil.disk_usage(entry.parent).free < estimate + GGUF_CACHE_SPARE_BYTES:
            log.warning("%s: not keeping a dequantised copy: less than %.1f GB free in %s", gguf,
                        (estimate + GGUF_CACHE_SPARE_BYTES) / 2**30, entry.parent)
            return None
        started = time.perf_counter()
        hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32, **src.hf_kwargs()).eval()
        tmp.mkdir()
        config = copy.deepcopy(hf.config)
        if hasattr(config, "quantization_config"):  # the weights are plain float32 now
            del config.quantization_config
        config.save_pretrained(tmp)
        if getattr(hf, "generation_config", None) is not None:
            hf.generation_config.save_pretrained(tmp)
        load_tokenizer(src).save_pretrained(tmp)
        save_model(hf, str(tmp / "model.safetensors"), metadata={"format": "pt", "gguf": str(gguf)})
        os.rename(tmp, entry)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if (entry / "model.safetensors").is_file():  # another process put its copy in place first
            return entry
        log.warning("%s: could not keep a dequantised copy in %s (%s); loading the GGUF file", gguf, entry, e)
        return None
    size = (entry / "model.safetensors").stat().st_size
    log.info("%s: dequantised in %.1f s; kept a copy (%.2f GB) in %s: later loads read it "
             "($SPECDEC_GGUF_CACHE_DIR=off: none)", gguf, time.perf_counter() - started, size / 2**30, entry)
    return entry


@dataclass
class Checkpoint:
    """A causal LM's config and weights, as transformers loaded them."""

    name: str  # id or path as given
    config: object  # transformers PretrainedConfig
    generation_config: object | None
    state_dict: dict[str, torch.Tensor]  # HF names: model.layers.{i}.self_attn.q_proj.weight, ...
    gguf: str | None = None  # the GGUF file the weights were dequantised from, if any (gemm "simd-gguf")

    @classmethod
    def load(cls, model: str, dtype: str = "float32") -> "Checkpoint":
        """Loads through transformers in ``dtype`` (GGUF weights are dequantised)."""
        return cls.of_model(load_hf_model(model, dtype), model)

    @classmethod
    def of_model(cls, hf_model, name: str, gguf: str | None = None) -> "Checkpoint":
        """Takes (shares, does not copy) the tensors of a loaded transformers
        model; gguf: the file they came from (default: the one ``name``
        resolves to, if any; the engine checks each weight against it bit for
        bit before reading its blocks)."""
        return cls(name, hf_model.config, getattr(hf_model, "generation_config", None),
                   dict(hf_model.state_dict()), gguf if gguf is not None else gguf_file_of(name))


def gguf_file_of(model: str) -> str | None:
    """The GGUF file a model name resolves to (a .gguf path, or a directory
    or shared-models name holding one and no other weights), else None."""
    src = resolve_model(model, cached=False)
    return str(Path(src.path) / src.gguf_file) if src.gguf_file else None


def eos_token_ids(config, generation_config) -> tuple[int, ...]:
    """EOS ids from the generation config, else the model config (an int or a list)."""
    for cfg in (generation_config, config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()
