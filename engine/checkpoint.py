"""Loading a causal LM's weights and the facts every engine needs from them.

Weights come through ``transformers`` (safetensors, .bin or GGUF, which it
dequantises), which also standardises the config. ``load_hf_model`` is the
one place a model is read from disk or the hub; both engines start from it.

Remembered checkpoints. Importing transformers and building its model takes
~4.5 s of a service's start on 2 cores (its config classes import
torch.distributed and its modeling torch._dynamo), for a runner that needs
only the config's values and the tensors. So after transformers has loaded a
local directory's safetensors, ``remember_checkpoint`` writes down what it
gave (``models.checkpoint_cache_entry``, keyed by every file of the
directory, the transformers version and the dtype): the config's values, and
for each tensor of its state dict the file tensor it is, bit for bit once
cast to the dtype transformers gave it (checked then, tensor by tensor), or
the tensor it is tied to. ``remembered_checkpoint`` reads the files by that
record, without transformers; a directory whose tensors transformers renames
or changes, a .bin checkpoint, a GGUF file not yet dequantised or a hub id
are never remembered and load through transformers as before.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.models import (
    ModelSource,
    checkpoint_cache_entry,
    gguf_cache_max_bytes,
    load_tokenizer,
    resolve_model,
    write_json_atomically,
)

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
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch_dtype(dtype), **src.hf_kwargs()).eval()
    if not src.gguf_file:
        remember_checkpoint(src, dtype, model)
    return model


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


#: The config values LlamaEngine reads (``llama.LlamaSpec``, ``unsupported_reason``,
#: ``eos_token_ids``), remembered as transformers gives them (``getattr``: properties too).
ENGINE_CONFIG_FIELDS = (
    "model_type", "hidden_act", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
    "layer_types", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "sliding_window",
    "no_rope_layers", "vocab_size", "hidden_size", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings",
)


class RememberedConfig:
    """A config's values as ``remember_checkpoint`` wrote them down, read as
    attributes (one it did not hold raises AttributeError, as a transformers
    config does)."""

    def __init__(self, values: dict) -> None:
        self.__dict__.update(values)

    def __repr__(self) -> str:
        return f"RememberedConfig({self.__dict__!r})"


def _config_values(config) -> dict:
    """A transformers config's values as JSON types: its dict, and the
    ENGINE_CONFIG_FIELDS as ``getattr`` gives them (raises TypeError where
    one is not a JSON value)."""
    values = json.loads(config.to_json_string(use_diff=False))
    for name in ENGINE_CONFIG_FIELDS:
        if hasattr(config, name):
            values[name] = json.loads(json.dumps(getattr(config, name)))
    return values


def _weight_files(directory: Path) -> list[str] | None:
    """The safetensors files transformers reads from `directory` (the
    index's, else model.safetensors), or None where it reads others (.bin)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"] if (directory / "model.safetensors").is_file() else None


def remember_checkpoint(src: ModelSource, dtype: str, model) -> None:
    """Writes down what transformers loaded from `src` (a local directory of
    safetensors) in `dtype` as `model`, when every tensor of its state dict is
    a file tensor cast to its dtype, bit for bit, or tied to one of them
    (module doc). Anything else, or a cache that cannot be written, is only
    logged: the model then loads through transformers every time."""

    entry = checkpoint_cache_entry(src, dtype)
    files = _weight_files(Path(src.path)) if entry is not None else None
    if entry is None or files is None or entry.is_file():
        return
    try:
        state = model.state_dict()
        where: dict[str, str] = {}
        tensors: dict[str, list] = {}
        for name in files:
            with safe_open(str(Path(src.path) / name), framework="pt") as f:
                for key in f.keys():
                    if key in state:
                        value = f.get_tensor(key)
                        if value.shape != state[key].shape or not torch.equal(value.to(state[key].dtype), state[key]):
                            log.info("%s: %s is not the file's tensor as loaded; not remembered", src.path, key)
                            return
                        where[key] = name
        owners = {t.data_ptr(): key for key, t in state.items() if key in where}
        for key, t in state.items():
            owner = key if key in where else owners.get(t.data_ptr())
            if owner is None:
                log.info("%s: %s is in no file of it; not remembered", src.path, key)
                return
            tensors[key] = [owner, where[owner], str(t.dtype).removeprefix("torch.")]
        facts = {"config": _config_values(model.config), "tensors": tensors,
                 "generation_config": (json.loads(model.generation_config.to_json_string(use_diff=False))
                                       if getattr(model, "generation_config", None) is not None else None)}
        write_json_atomically(entry, facts)
    except (OSError, TypeError, ValueError) as e:
        log.info("%s: could not remember what transformers loaded (%s)", src.path, e)


def _record(model: str, dtype: str) -> tuple[ModelSource, Path] | None:
    """`model`'s source and its record in `dtype`, where one is written."""
    src = resolve_model(model)
    entry = checkpoint_cache_entry(src, dtype) if not src.gguf_file else None
    return (src, entry) if entry is not None and entry.is_file() else None


def _stored_tensors(src: ModelSource, facts: dict, keys) -> dict[str, torch.Tensor]:
    """The state-dict tensors `keys` as the record's files store them (not
    cast): each read once, a tied key given its owner's tensor object."""
    owners: dict[str, set[str]] = {}
    for key in keys:
        owner, name, _ = facts["tensors"][key]
        owners.setdefault(name, set()).add(owner)
    loaded = {}
    for name, wanted in owners.items():
        with safe_open(str(Path(src.path) / name), framework="pt") as f:
            for owner in wanted:
                loaded[owner] = f.get_tensor(owner)
    return {key: loaded[facts["tensors"][key][0]] for key in keys}


def remembered_checkpoint(model: str, dtype: str = "float32") -> "Checkpoint | None":
    """The Checkpoint transformers gave for `model` in `dtype`, read from
    its files by ``remember_checkpoint``'s record without transformers, or
    None where there is none (or it no longer reads: the caller loads through
    transformers, which writes it again)."""
    found = _record(model, dtype)
    if found is None:
        return None
    src, entry = found
    try:
        facts = json.loads(entry.read_text())
        stored = _stored_tensors(src, facts, facts["tensors"])
        cast: dict[str, torch.Tensor] = {}  # by owner: a tie stays one tensor
        state = {}
        for key, (owner, _, kind) in facts["tensors"].items():
            if owner not in cast:
                cast[owner] = stored[key].to(getattr(torch, kind))
            state[key] = cast[owner]
        generation = facts["generation_config"]
        return Checkpoint(model, RememberedConfig(facts["config"]),
                          RememberedConfig(generation) if generation is not None else None, state, gguf_file_of(model))
    except Exception as e:  # any record that does not read (the safetensors reader raises its own errors)
        log.info("%s: the record in %s did not read (%s); loading through transformers", model, entry, e)
        return None


def remembered_config(model: str) -> RememberedConfig | None:
    """`model`'s config values from a record of any dtype (the values are
    the same but for the dtype's own), without transformers; None where no
    record reads."""
    for dtype in DTYPES:
        found = _record(model, dtype)
        if found is not None:
            try:
                return RememberedConfig(json.loads(found[1].read_text())["config"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.info("%s: the record in %s did not read (%s)", model, found[1], e)
    return None


def remembered_tensors(model: str, names: list[str]) -> dict[str, torch.Tensor] | None:
    """The state-dict tensors `names` of `model` as its files store them (not
    cast to a dtype; a tied name, e.g. embeddings saved only as the LM head,
    as its owner), by a record of any dtype, without transformers; None where
    no record holds them all or reads."""
    for dtype in DTYPES:
        found = _record(model, dtype)
        if found is None:
            continue
        src, entry = found
        try:
            facts = json.loads(entry.read_text())
            if all(n in facts["tensors"] for n in names):
                return _stored_tensors(src, facts, names)
        except Exception as e:  # as remembered_checkpoint
            log.info("%s: the record in %s did not read (%s)", model, entry, e)
    return None


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
        """Loads in ``dtype`` as transformers does (GGUF weights are
        dequantised): by its record where one is remembered
        (``remembered_checkpoint``), else through transformers."""
        return remembered_checkpoint(model, dtype) or cls.of_model(load_hf_model(model, dtype), model)

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
