"""Shared fixtures: real models from ../shared/models, real service processes
on loopback, and Hugging Face `transformers` greedy references."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from specdec.models import shared_models_dir

MODELS = shared_models_dir()
STORIES = str(MODELS / "stories260K") if MODELS else None
SMOLLM = str(MODELS / "smollm2-135m-instruct-q4_1") if MODELS else None
#: which scorer engine the integration tests run ("auto": own Llama runner)
ENGINE = os.environ.get("SPECDEC_TEST_ENGINE", "auto")


def _need(path: str | None) -> str:
    if path is None or not Path(path).is_dir():
        pytest.skip("shared models directory not found (set SPECDEC_MODELS_DIR)")
    return path


@pytest.fixture(scope="session")
def stories_path() -> str:
    return _need(STORIES)


@pytest.fixture(scope="session")
def smollm_path() -> str:
    return _need(SMOLLM)


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    """A transformers model + tokenizer, float32, loaded once per process."""
    from transformers import AutoModelForCausalLM

    from specdec.models import load_tokenizer, resolve_model

    src = resolve_model(path)
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype="float32", **src.hf_kwargs()).eval()
    return model, load_tokenizer(src)


@functools.lru_cache(maxsize=256)
def hf_greedy(path: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding of the target with transformers `generate`."""
    import torch

    model, tok = hf_model(path)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             pad_token_id=tok.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def start_stack(model: str, tmp_path_factory, name: str, **kwargs):
    from specdec.launcher import Stack

    kwargs.setdefault("engine", ENGINE)
    log_dir = str(tmp_path_factory.mktemp(f"logs-{name}"))
    stack = Stack(model=model, log_dir=log_dir, **kwargs)
    try:
        return stack.start()
    except BaseException:
        for f in sorted(Path(log_dir).glob("*.log")):
            print(f"--- {f.name}\n{f.read_text()[-3000:]}")
        raise


@pytest.fixture(scope="module")
def stories_stack(stories_path, tmp_path_factory):
    """Scorer + one proposer (all CPU methods) + gateway on stories260K."""
    from specdec.proposer_svc.registry import SUPPORTED_METHODS

    stack = start_stack(stories_path, tmp_path_factory, "stories", methods=",".join(SUPPORTED_METHODS))
    yield stack
    stack.stop()
