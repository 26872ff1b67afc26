"""Finding models, and the dequantised copy a GGUF model is read from after
its first load (``specdec.models.gguf_cache_entry``,
``engine.checkpoint.write_gguf_copy``).

The copy's mechanics are unit-tested on stories260K standing in for a
dequantised GGUF (there is no small GGUF offline: transformers' GGUF load is
replaced by loading stories260K, the code around it is real). The copy of
the real SmolLM2 GGUF is checked against transformers' own GGUF load, bit
for bit, in float32 and bfloat16, with the tokenizer."""
from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specdec.engine import checkpoint
from specdec.engine.checkpoint import load_hf_model, write_gguf_copy
from specdec.models import ModelSource, gguf_cache_entry, load_tokenizer, resolve_model

TEXTS = ["Once upon a time", "Hello, world! 123", "Lily and Ben ran to the park.\n\nThe end."]


@pytest.fixture
def fake(tmp_path, stories_path, monkeypatch):
    """A directory holding a .gguf file (whose bytes nobody reads) and
    stories260K's tokenizer files; transformers' load of that file gives
    stories260K's model. The cache goes to tmp_path / "cache". ``dir``: the
    directory; ``loads``: the dtype of each GGUF load; ``while_loading``:
    callables run during each GGUF load."""
    from transformers import AutoModelForCausalLM

    d = tmp_path / "model"
    d.mkdir()
    (d / "tiny.Q4_1.gguf").write_bytes(b"GGUF" + bytes(1000))
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(Path(stories_path) / name, d / name)
    real = AutoModelForCausalLM.from_pretrained
    loads, while_loading = [], []

    def from_pretrained(path, *args, **kwargs):
        if kwargs.pop("gguf_file", None):
            loads.append(kwargs.get("dtype"))
            path = stories_path
            for hook in while_loading:
                hook()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setenv("SPECDEC_GGUF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDEC_GGUF_CACHE_MAX_GB", raising=False)
    return SimpleNamespace(dir=d, loads=loads, while_loading=while_loading)


def _same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_first_load_writes_the_copy_and_later_ones_read_it(fake, stories_path, tmp_path, caplog):
    src = resolve_model(str(fake.dir))
    entry = gguf_cache_entry(fake.dir / "tiny.Q4_1.gguf")
    assert src == ModelSource(str(fake.dir), "tiny.Q4_1.gguf", str(entry))
    assert entry.parent == tmp_path / "cache" and entry.name.startswith("tiny.Q4_1-")
    with caplog.at_level(logging.INFO):
        first = load_hf_model(str(fake.dir))
    assert fake.loads == [torch.float32]  # dequantised once, in float32
    assert "kept a copy" in caplog.text and str(entry) in caplog.text
    assert {p.name for p in entry.iterdir()} >= {"config.json", "model.safetensors", "tokenizer_config.json"}
    assert list(entry.parent.iterdir()) == [entry]  # no half-written copy left beside it
    # the file too resolves to the copy now, and loading reads it: no GGUF load
    assert resolve_model(str(fake.dir / "tiny.Q4_1.gguf")) == ModelSource(str(entry))
    again = load_hf_model(str(fake.dir))
    assert fake.loads == [torch.float32]
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()
    _same_weights(first, reference)
    _same_weights(again, reference)
    assert not hasattr(again.config, "quantization_config")
    for dtype in ("bfloat16",):  # a cast of the copy is the cast of the model
        _same_weights(load_hf_model(str(fake.dir), dtype), reference.to(torch.bfloat16))
    tok, ref_tok = load_tokenizer(ModelSource(str(entry))), load_tokenizer(resolve_model(stories_path))
    for text in TEXTS:
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]


def test_cached_false_and_off_neither_read_nor_write_a_copy(fake, monkeypatch, tmp_path):
    load_hf_model(str(fake.dir))
    entry = gguf_cache_entry(fake.dir / "tiny.Q4_1.gguf")
    assert resolve_model(str(fake.dir), cached=False) == ModelSource(str(fake.dir), "tiny.Q4_1.gguf")
    load_hf_model(str(fake.dir), cached=False)
    assert fake.loads == [torch.float32, torch.float32]
    monkeypatch.setenv("SPECDEC_GGUF_CACHE_DIR", "off")
    assert gguf_cache_entry(fake.dir / "tiny.Q4_1.gguf") is None
    assert resolve_model(str(fake.dir)) == ModelSource(str(fake.dir), "tiny.Q4_1.gguf")
    load_hf_model(str(fake.dir), "bfloat16")
    assert fake.loads == [torch.float32, torch.float32, torch.bfloat16]  # as asked, no float32 copy
    assert list((tmp_path / "cache").iterdir()) == [entry]


def test_a_changed_file_gets_a_new_copy(fake):
    gguf = fake.dir / "tiny.Q4_1.gguf"
    before = gguf_cache_entry(gguf)
    load_hf_model(str(fake.dir))
    gguf.write_bytes(b"GGUF" + bytes(2000))
    after = gguf_cache_entry(gguf)
    assert after != before
    assert resolve_model(str(fake.dir)).gguf_cache == str(after)  # the old copy is not read
    os.utime(gguf, ns=(1, 1))  # same size, another modification time
    assert gguf_cache_entry(gguf) not in (before, after)


def test_a_model_over_the_size_limit_is_loaded_without_a_copy(fake, monkeypatch, caplog):
    monkeypatch.setenv("SPECDEC_GGUF_CACHE_MAX_GB", str(1000 * checkpoint.GGUF_EXPANSION / 2**30))  # under 1004 B
    with caplog.at_level(logging.INFO):
        model = load_hf_model(str(fake.dir), "bfloat16")
    assert "not keeping a dequantised copy" in caplog.text and "SPECDEC_GGUF_CACHE_MAX_GB" in caplog.text
    assert fake.loads == [torch.bfloat16] and model.dtype == torch.bfloat16
    assert not gguf_cache_entry(fake.dir / "tiny.Q4_1.gguf").exists()
    monkeypatch.setenv("SPECDEC_GGUF_CACHE_MAX_GB", "lots")
    with pytest.raises(ValueError, match="SPECDEC_GGUF_CACHE_MAX_GB"):
        load_hf_model(str(fake.dir))


def test_a_copy_another_process_finished_first_is_kept_and_stale_halves_are_removed(fake):
    src = resolve_model(str(fake.dir))
    entry = Path(src.gguf_cache)
    entry.parent.mkdir(parents=True)
    stale, fresh = (entry.with_name(f"{entry.name}.tmp-{pid}") for pid in (999991, 999992))
    for d in (stale, fresh):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    os.utime(stale, (time.time() - 2 * checkpoint.GGUF_STALE_TMP_S,) * 2)

    def theirs():  # "another process": its finished copy appears while this one dequantises
        shutil.copytree(fake.dir, entry)
        (entry / "model.safetensors").write_bytes(b"theirs")

    fake.while_loading.append(theirs)
    assert write_gguf_copy(src) == entry
    assert fake.loads == [torch.float32]
    assert (entry / "model.safetensors").read_bytes() == b"theirs"
    assert not stale.exists() and fresh.exists()  # a writer that may still be running keeps its half
    assert not entry.with_name(f"{entry.name}.tmp-{os.getpid()}").exists()
    fake.while_loading.clear()
    assert write_gguf_copy(src) == entry and fake.loads == [torch.float32]  # there now: not dequantised again


def test_an_unwritable_cache_loads_the_gguf_and_says_why(fake, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SPECDEC_GGUF_CACHE_DIR", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING):
        model = load_hf_model(str(fake.dir))
    assert "could not keep a dequantised copy" in caplog.text
    assert fake.loads == [torch.float32] and model.dtype == torch.float32


@pytest.mark.smollm
def test_the_smollm_copy_is_transformers_gguf_load_bit_for_bit(smollm_path, monkeypatch, tmp_path):
    """The real GGUF: its copy (the one every service reads, written here if
    no earlier load wrote it) loads to the very tensors transformers' GGUF
    load gives, in float32 and bfloat16, with the same config and tokenizer."""
    from conftest import hf_model

    if os.environ.get("SPECDEC_GGUF_CACHE_DIR", "").lower() == "off":
        monkeypatch.setenv("SPECDEC_GGUF_CACHE_DIR", str(tmp_path / "cache"))
    reference, ref_tok = hf_model(smollm_path)  # the GGUF file itself (cached=False), float32
    gguf = resolve_model(smollm_path, cached=False)
    copy = load_hf_model(smollm_path)
    entry = resolve_model(smollm_path)
    assert entry == ModelSource(str(gguf_cache_entry(Path(gguf.path) / gguf.gguf_file)))
    _same_weights(copy, reference)
    assert not hasattr(copy.config, "quantization_config")  # plain float32 weights
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
                "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(copy.config, key, None) == getattr(reference.config, key, None), key
    _same_weights(load_hf_model(smollm_path, "bfloat16"), reference.to(torch.bfloat16))
    tok = load_tokenizer(entry)
    assert (tok.eos_token_id, tok.bos_token_id, len(tok)) == (ref_tok.eos_token_id, ref_tok.bos_token_id, len(ref_tok))
    chat = [{"role": "user", "content": "Write a poem about the sea."}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        ref_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>"]:
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]


@pytest.mark.slow
@pytest.mark.smollm
def test_the_smollm_copy_in_bfloat16_is_transformers_bfloat16_gguf_load(smollm_path):
    """transformers' GGUF load straight into bfloat16 (13 s more) gives the
    copy's tensors cast to bfloat16."""
    _same_weights(load_hf_model(smollm_path, "bfloat16"), load_hf_model(smollm_path, "bfloat16", cached=False))
