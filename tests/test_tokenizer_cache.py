"""``specdec.models.load_tokenizer`` remembers the class AutoTokenizer chose
for a model directory and later calls that class directly (no torch, ~2 s
instead of ~7 of CPU). What it gives must be AutoTokenizer's tokenizer: the
same class, tokens, text, special tokens and chat template, on both shared
models; a stale entry, a changed directory or a cache turned off falls back
to AutoTokenizer. (The gateway process that never maps torch:
test_gateway_processes.py.)"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from specdec.models import TOKENIZER_CACHE_ENV, ModelSource, load_tokenizer, resolve_model, tokenizer_cache_entry

#: text that exercises what tokenizers differ on: leading and repeated
#: spaces, newlines and tabs, digits, punctuation, accents, CJK, emoji,
#: special tokens written as text
TEXTS = [
    "Once upon a time", " leading space", "two  spaces\tand a tab\n\nnew lines\n",
    "Hello, world! 12345 3.14159", "café naïve Ångström", "日本語のテキスト", "emoji 🙂🚀 end",
    "<s> not a bos </s><|im_start|>user\nhi<|im_end|>", "",
]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "tokenizers"
    monkeypatch.setenv(TOKENIZER_CACHE_ENV, str(root))
    return root


def _no_auto(monkeypatch) -> None:
    """AutoTokenizer refuses: a load that still succeeds came from the entry."""
    def refuse(*args, **kwargs):
        raise AssertionError("AutoTokenizer was asked")
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)


def _same(got, want) -> None:
    assert type(got) is type(want)
    assert len(got) == len(want)
    assert got.all_special_ids == want.all_special_ids and got.eos_token_id == want.eos_token_id
    assert got.bos_token_id == want.bos_token_id and got.pad_token_id == want.pad_token_id
    for text in TEXTS:
        for special in (True, False):
            ids = got(text, add_special_tokens=special)["input_ids"]
            assert ids == want(text, add_special_tokens=special)["input_ids"], (text, special)
            for skip in (True, False):
                assert got.decode(ids, skip_special_tokens=skip) == want.decode(ids, skip_special_tokens=skip)
    assert got.chat_template == want.chat_template
    if want.chat_template:
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]
        for tokenize in (False, True):
            assert got.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize) == \
                want.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize)


@pytest.mark.parametrize("model", ["stories260K", "smollm2-135m-instruct-q4_1"])
def test_a_remembered_class_gives_autotokenizer_s_tokenizer(model, cache, monkeypatch):
    source = resolve_model(model)
    want = AutoTokenizer.from_pretrained(source.path)
    first = load_tokenizer(source)  # asks AutoTokenizer, remembers its choice
    entry = tokenizer_cache_entry(source)
    assert entry is not None and entry.parent == cache
    assert json.loads(entry.read_text()) == {"module": type(want).__module__, "class": type(want).__qualname__,
                                            "gguf": False}
    _same(first, want)
    _no_auto(monkeypatch)
    _same(load_tokenizer(source), want)


def _copy(stories_path, tmp_path) -> ModelSource:
    d = tmp_path / "model"
    shutil.copytree(stories_path, d)
    return ModelSource(str(d))


def test_a_stale_entry_asks_autotokenizer_again_and_is_rewritten(stories_path, cache, tmp_path, monkeypatch):
    source = _copy(stories_path, tmp_path)
    entry = tokenizer_cache_entry(source)
    entry.parent.mkdir(parents=True)
    entry.write_text(json.dumps({"module": "transformers", "class": "NoSuchTokenizer", "gguf": False}))
    _same(load_tokenizer(source), AutoTokenizer.from_pretrained(source.path))
    assert json.loads(entry.read_text())["class"] == "LlamaTokenizer"
    entry.write_text("not json")
    assert type(load_tokenizer(source)).__name__ == "LlamaTokenizer"
    # an entry naming a module outside transformers is never imported (a shared cache volume could be written
    # by anyone with access to it)
    entry.write_text(json.dumps({"module": "tokenizer_cache_probe", "class": "Tok", "gguf": False}))
    probe = tmp_path / "tokenizer_cache_probe.py"
    probe.write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert type(load_tokenizer(source)).__name__ == "LlamaTokenizer"
    assert not (tmp_path / "imported").exists()
    assert json.loads(entry.read_text())["class"] == "LlamaTokenizer"
    _no_auto(monkeypatch)
    assert type(load_tokenizer(source)).__name__ == "LlamaTokenizer"  # rewritten again, then read


def test_a_changed_directory_is_a_new_entry_and_off_keeps_none(stories_path, cache, tmp_path, monkeypatch):
    source = _copy(stories_path, tmp_path)
    load_tokenizer(source)
    before = tokenizer_cache_entry(source)
    assert before.is_file()
    config = Path(source.path) / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"model_max_length": 512', '"model_max_length": 256'))
    after = tokenizer_cache_entry(source)
    assert after != before and not after.exists()
    assert load_tokenizer(source).model_max_length == 256
    assert after.is_file()
    assert tokenizer_cache_entry(ModelSource("HuggingFaceTB/SmolLM2-135M-Instruct")) is None  # a hub id
    monkeypatch.setenv(TOKENIZER_CACHE_ENV, "off")
    assert tokenizer_cache_entry(source) is None
    assert load_tokenizer(source).model_max_length == 256
    assert sorted(p.name for p in cache.iterdir()) == sorted([before.name, after.name])


def test_a_gguf_only_directory_remembers_that_its_tokenizer_is_in_the_file(stories_path, cache, tmp_path,
                                                                        monkeypatch):
    """No tokenizer files beside the GGUF file: AutoTokenizer reads it from the
    file (``gguf_file``), and the entry says so. transformers' GGUF reading
    is replaced by loading stories260K (there is no small GGUF offline); the
    code around it is real."""
    d = tmp_path / "gguf-only"
    d.mkdir()
    (d / "tiny.Q4_1.gguf").write_bytes(b"GGUF" + bytes(100))
    source = ModelSource(str(d), "tiny.Q4_1.gguf")
    real = AutoTokenizer.from_pretrained
    calls = []

    def from_file(path, **kwargs):
        calls.append(kwargs)
        if kwargs.get("gguf_file") != "tiny.Q4_1.gguf":
            raise OSError("no tokenizer files")
        return real(stories_path)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_file)
    assert type(load_tokenizer(source)).__name__ == "LlamaTokenizer"
    assert calls == [{}, {"gguf_file": "tiny.Q4_1.gguf"}]
    assert json.loads(tokenizer_cache_entry(source).read_text())["gguf"] is True


def test_a_cache_that_cannot_be_written_still_loads_and_leaves_nothing_half_written(stories_path, cache):
    source = ModelSource(stories_path)
    entry = tokenizer_cache_entry(source)
    entry.mkdir(parents=True)  # the entry's name is taken by a directory: the rename into place fails
    assert type(load_tokenizer(source)).__name__ == "LlamaTokenizer"
    assert entry.is_dir() and [p.name for p in cache.iterdir()] == [entry.name]
