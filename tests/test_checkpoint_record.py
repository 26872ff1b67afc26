"""Remembered checkpoints (engine/checkpoint.py module doc): after one load
through transformers, a model runner reads a local directory's safetensors
by a record of what transformers gave, without importing transformers. The
record must give exactly that: the same tensors bit for bit, in the same
dtypes, tied where transformers tied them, and the config values the
runner reads; anything it cannot vouch for loads through transformers."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from feature_heads import write_eagle3_head

from specdec.engine import checkpoint
from specdec.engine.base import ForwardItem
from specdec.engine.checkpoint import (
    ENGINE_CONFIG_FIELDS,
    Checkpoint,
    eos_token_ids,
    load_hf_model,
    remember_checkpoint,
    remembered_checkpoint,
    remembered_config,
    remembered_tensors,
)
from specdec.engine.config import EngineConfig
from specdec.engine.factory import build_engine
from specdec.models import CHECKPOINT_CACHE_ENV, checkpoint_cache_entry, resolve_model
from specdec.proposer_svc.eagle3 import load_eagle3


@pytest.fixture
def records(tmp_path, monkeypatch) -> Path:
    """The records go to tmp_path / "records" (children inherit it)."""
    monkeypatch.setenv(CHECKPOINT_CACHE_ENV, str(tmp_path / "records"))
    return tmp_path / "records"


@pytest.fixture
def model_dir(tmp_path, stories_path) -> Path:
    """A writable copy of stories260K."""
    d = tmp_path / "stories"
    shutil.copytree(stories_path, d)
    for f in d.iterdir():
        f.chmod(0o644)
    return d


def _assert_same(got: Checkpoint, want: Checkpoint) -> None:
    assert got.state_dict.keys() == want.state_dict.keys()
    for key, t in want.state_dict.items():
        assert got.state_dict[key].dtype == t.dtype and torch.equal(got.state_dict[key], t), key
    ties = {k: v.data_ptr() for k, v in want.state_dict.items()}
    for a in ties:
        for b in ties:
            assert (ties[a] == ties[b]) == (got.state_dict[a].data_ptr() == got.state_dict[b].data_ptr()), (a, b)
    for name in ENGINE_CONFIG_FIELDS:
        assert getattr(got.config, name, None) == getattr(want.config, name, None), name
    assert eos_token_ids(got.config, got.generation_config) == eos_token_ids(want.config, want.generation_config)
    assert got.gguf == want.gguf


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", ["stories", pytest.param("smollm", marks=pytest.mark.smollm)])
def test_a_remembered_checkpoint_is_what_transformers_loaded(which, dtype, records, stories_path, smollm_path):
    """stories260K's safetensors, and SmolLM2's GGUF through its dequantised
    copy (whose LM head is tied to the embeddings)."""
    model = stories_path if which == "stories" else smollm_path
    assert remembered_checkpoint(model, dtype) is None  # nothing remembered yet
    want = Checkpoint.of_model(load_hf_model(model, dtype), model)
    got = remembered_checkpoint(model, dtype)
    assert got is not None and isinstance(got.config, checkpoint.RememberedConfig)
    _assert_same(got, want)
    assert Checkpoint.load(model, dtype).config.__class__ is checkpoint.RememberedConfig
    other = "bfloat16" if dtype == "float32" else "float32"
    assert remembered_checkpoint(model, other) is None  # a record is kept per dtype


@pytest.mark.parametrize("which", ["stories", pytest.param("smollm", marks=pytest.mark.smollm)])
def test_any_dtypes_record_gives_the_config_and_the_files_tensors(which, records, stories_path, smollm_path):
    """What a proposer reads of its target (an EAGLE-3 head's config checks
    and shared embeddings): the config values and named tensors as the files
    store them, by a record of either dtype; SmolLM2's copy stores its tied
    embeddings as the LM head only."""
    from transformers import AutoConfig

    model = stories_path if which == "stories" else smollm_path
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    assert remembered_config(model) is None and remembered_tensors(model, names) is None
    load_hf_model(model, "bfloat16")  # a bfloat16 record only
    src = resolve_model(model)
    want_config = AutoConfig.from_pretrained(src.path, **src.hf_kwargs())
    got_config = remembered_config(model)
    assert isinstance(got_config, checkpoint.RememberedConfig)
    for name in ENGINE_CONFIG_FIELDS:
        assert getattr(got_config, name, None) == getattr(want_config, name, None), name
    got = remembered_tensors(model, names)
    want = load_hf_model(model, "float32").state_dict()
    assert got is not None
    for name in names:
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), name  # the files: float32
    assert remembered_tensors(model, [*names, "model.missing.weight"]) is None


@pytest.mark.smollm
def test_an_eagle3_head_of_a_remembered_target_loads_as_through_transformers_without_it(records, smollm_path,
                                                                                          tmp_path, monkeypatch):
    load_hf_model(smollm_path)  # the scorer's first start: writes the record
    head = write_eagle3_head(tmp_path / "head", Path(resolve_model(smollm_path).path), None)
    code = ("import sys, torch\n"
            "from specdec.proposer_svc.eagle3 import load_eagle3\n"
            f"head = load_eagle3({str(head)!r}, {smollm_path!r})\n"
            f"torch.save({{'w': head.w, 'spec': repr(head.spec)}}, {str(tmp_path / 'head.pt')!r})\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout
    got = torch.load(tmp_path / "head.pt")
    monkeypatch.setenv(CHECKPOINT_CACHE_ENV, "off")  # through transformers: AutoConfig and the whole model
    want = load_eagle3(str(head), smollm_path)
    assert got["spec"] == repr(want.spec)
    assert got["w"].keys() == want.w.keys()
    for name, t in want.w.items():
        assert torch.equal(got["w"][name], t), name


def test_an_engine_from_the_record_computes_the_same_bits_without_transformers(records, model_dir, monkeypatch):
    config = EngineConfig(model=str(model_dir), kv_capacity_tokens=256)
    first = build_engine(config)  # through transformers: writes the record

    def no_transformers(*args, **kwargs):
        raise AssertionError("loaded through transformers")

    monkeypatch.setattr(checkpoint, "load_hf_model", no_transformers)
    import specdec.engine.factory as factory
    monkeypatch.setattr(factory, "load_hf_model", no_transformers)
    # the first engine's GEMM path: "auto" times the paths again where the machine was busy at the first start
    # (gemm_select.machine_busy: such timings are not cached), and two paths of different bits may then swap
    second = build_engine(dataclasses.replace(config, gemm=first.gemm))
    prompt = np.array([1, 300, 42, 17, 99, 5], np.int32)
    logits = []
    for engine in (first, second):
        engine.ensure_capacity("s", len(prompt))
        logits.append(engine.forward([ForwardItem("s", prompt, len(prompt))]).logits)
    assert torch.equal(logits[0], logits[1])
    assert second.facts == first.facts


def test_a_runner_started_from_the_record_never_imports_transformers(records, model_dir):
    code = ("import sys\n"
            "import specdec.scorer_svc.server\n"
            "from specdec.engine.config import EngineConfig\n"
            "from specdec.engine.factory import build_engine\n"
            f"engine = build_engine(EngineConfig(model={str(model_dir)!r}, kv_capacity_tokens=256))\n"
            "print(type(engine).__name__, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    run = [sys.executable, "-c", code]
    first = subprocess.run(run, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("LlamaEngine ['transformers'"), first.stdout  # the first load: through it
    later = subprocess.run(run, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert later.returncode == 0, later.stderr
    assert later.stdout.strip() == "LlamaEngine []", later.stdout


def test_tensors_that_are_not_the_files_are_never_remembered(records, model_dir, caplog):
    src = resolve_model(str(model_dir))
    model = load_hf_model(str(model_dir))
    entry = checkpoint_cache_entry(src, "float32")
    entry.unlink()
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # what a load that converts a tensor would give
    caplog.set_level("INFO", logger="specdec.engine.checkpoint")
    remember_checkpoint(src, "float32", model)
    assert not entry.exists() and "model.norm.weight is not the file's tensor as loaded" in caplog.text
    assert remembered_checkpoint(str(model_dir)) is None


def test_a_bin_checkpoint_is_never_remembered(records, tmp_path, stories_path):
    from safetensors.torch import load_file

    d = tmp_path / "bin"
    d.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(stories_path) / name, d / name)
    torch.save(load_file(str(Path(stories_path) / "model.safetensors")), d / "pytorch_model.bin")
    want = load_hf_model(stories_path).state_dict()
    got = load_hf_model(str(d)).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)  # transformers read the .bin
    assert not checkpoint_cache_entry(resolve_model(str(d)), "float32").exists()
    assert remembered_checkpoint(str(d)) is None


def test_a_changed_directory_or_a_broken_record_loads_through_transformers(records, model_dir, caplog):
    load_hf_model(str(model_dir))
    entry = checkpoint_cache_entry(resolve_model(str(model_dir)), "float32")
    assert remembered_checkpoint(str(model_dir)) is not None
    stat = (model_dir / "model.safetensors").stat()
    os.utime(model_dir / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert remembered_checkpoint(str(model_dir)) is None  # another key: not that record
    load_hf_model(str(model_dir))  # remembered again under the new key
    entry = checkpoint_cache_entry(resolve_model(str(model_dir)), "float32")
    facts = json.loads(entry.read_text())
    del facts["tensors"]["model.norm.weight"]
    facts["tensors"]["model.missing.weight"] = ["model.missing.weight", "model.safetensors", "float32"]
    entry.write_text(json.dumps(facts))
    caplog.set_level("INFO", logger="specdec.engine.checkpoint")
    assert remembered_checkpoint(str(model_dir)) is None
    assert "did not read" in caplog.text and "loading through transformers" in caplog.text
    entry.write_text("{not json")
    assert remembered_checkpoint(str(model_dir)) is None
    engine = build_engine(EngineConfig(model=str(model_dir), kv_capacity_tokens=256))
    assert type(engine).__name__ == "LlamaEngine"


def test_off_keeps_no_record(monkeypatch, model_dir, tmp_path):
    monkeypatch.setenv(CHECKPOINT_CACHE_ENV, "off")
    monkeypatch.setattr(Path, "home", lambda: tmp_path / "home")
    load_hf_model(str(model_dir))
    assert remembered_checkpoint(str(model_dir)) is None and not (tmp_path / "home").exists()
