"""Shared fixtures: real models from ../shared/models, real service processes
on loopback, and Hugging Face `transformers` greedy references."""
from __future__ import annotations

import functools
import os
import shlex
from pathlib import Path

import pytest

from specdec.models import shared_models_dir

MODELS = shared_models_dir()
STORIES = str(MODELS / "stories260K") if MODELS else None
SMOLLM = str(MODELS / "smollm2-135m-instruct-q4_1") if MODELS else None
#: which scorer engine the integration tests run ("auto": own Llama runner)
ENGINE = os.environ.get("SPECDEC_TEST_ENGINE", "auto")
#: more arguments for the scorers the integration tests start, e.g. "--device cuda"
#: (scripts/gpu_checks.sh runs the stories260K end-to-end tests so)
SCORER_ARGS = shlex.split(os.environ.get("SPECDEC_TEST_SCORER_ARGS", ""))
#: more arguments for the draft-model proposers they start, e.g. "--draft-device cuda"
DRAFT_ARGS = shlex.split(os.environ.get("SPECDEC_TEST_DRAFT_ARGS", ""))


#: The triton release whose interpreter ``_device_calls_patch_once`` was read against.
_TRITON_READ = "3.9.0"


def _device_calls_patch_once() -> None:
    """Triton's interpreter (TRITON_INTERPRET=1) patches triton.language
    again at every call of a device function (tl.sum, tl.max, ...: each a
    scan of the language's modules, ~3 ms), a third of an interpreted
    kernel's time (test_gpu_engine's feature-graph test: 70 of 194 s under
    cProfile). A device call's patches are not undone until its kernel's
    launch ends (``GridExecutor.__call__`` restores what it and they changed;
    ``InterpretedFunction.__call__`` drops their scope), so within one launch
    a function's later calls only repeat what is in place: here they skip
    it, and each launch starts afresh. The kernels run the same code on the
    same values. Only for the triton release this was read against; on any
    other the interpreter runs as shipped."""
    import sys

    triton = sys.modules.get("triton")  # never imported here: TRITON_INTERPRET must be set before it is
    if triton is None or triton.__version__ != _TRITON_READ:
        return
    from triton.runtime import interpreter

    patched: set = set()  # device functions patched in the launch running now
    launch = interpreter.GridExecutor.__call__

    def run(self, *args, **kwargs):
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    def call(self, *args, **kwargs):
        if self.fn not in patched:
            interpreter._patch_lang(self.fn)
            patched.add(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = run
    interpreter.InterpretedFunction.__call__ = call


def pytest_collection_finish(session) -> None:
    """After the test modules are imported (those testing Triton kernels set
    TRITON_INTERPRET before importing triton)."""
    _device_calls_patch_once()


def _need(path: str | None) -> str:
    """The model directory; skips without it, but fails under ``CI=true`` so a CI
    machine that lost the models cannot pass by skipping every integration test."""
    if path is None or not Path(path).is_dir():
        reason = "shared models directory not found (set SPECDEC_MODELS_DIR)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason}; CI=true requires it", pytrace=False)
        pytest.skip(reason)
    return path


@pytest.fixture(scope="session")
def stories_path() -> str:
    return _need(STORIES)


@pytest.fixture(scope="session")
def smollm_path() -> str:
    return _need(SMOLLM)


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    """A transformers model + tokenizer, float32, loaded once per process; a
    GGUF model from the file itself, not its dequantised copy (the reference
    must not depend on the code under test)."""
    from transformers import AutoModelForCausalLM

    from specdec.models import load_tokenizer, resolve_model

    src = resolve_model(path, cached=False)
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


def hf_layer_states(model, tokens: list[int]):
    """transformers' hidden states of layers 0..num_layers of ``tokens``
    (float32 [len(tokens), hidden] each) as specdec numbers them: index i <
    num_layers is transformers' hidden_states[i]; index num_layers is the
    last layer's output *before* the final norm (transformers' last entry
    is after it)."""
    import torch

    caught = []
    hook = model.model.norm.register_forward_pre_hook(lambda _, args: caught.append(args[0]))
    try:
        with torch.inference_mode():
            states = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return [s[0] for s in states[:-1]] + [caught[0][0]]


def bf16_values(bits):
    """float32 tensor of bfloat16 bit patterns (numpy uint16 or raw bytes)."""
    import numpy as np
    import torch

    raw = np.frombuffer(bits, dtype="<i2") if isinstance(bits, bytes) else bits.view(np.int16)
    return torch.from_numpy(raw.astype(np.int16)).view(torch.bfloat16).float()


def assert_features_match(rows, want) -> None:
    """rows: decoded bfloat16 features; want: the float32 reference of the
    same shape: equal within bfloat16 rounding (8 significant bits)."""
    assert rows.shape == want.shape
    assert ((rows - want).abs() <= want.abs() * 2.0 ** -7 + 1e-4).all(), (rows - want).abs().max()


def hf_eos_ids(path: str) -> set[int]:
    """The token ids that end transformers' greedy `generate` for this model."""
    model, tok = hf_model(path)
    eos = model.generation_config.eos_token_id
    eos = tok.eos_token_id if eos is None else eos
    return set(eos) if isinstance(eos, list) else {eos}


def assert_same_as_greedy(path: str, gen, expected: list[int], max_tokens: int) -> None:
    """A generation equals transformers greedy in full: every token, and the
    finish reason ("stop" exactly when transformers emitted EOS, which both keep)."""
    assert gen.token_ids == expected
    stopped = len(expected) < max_tokens or expected[-1] in hf_eos_ids(path)
    assert gen.finish_reason == ("stop" if stopped else "length")


def random_model(config):
    """A transformers model of ``config`` with seeded random weights."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # weights large enough that every feature moves the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    return model


def start_stack(model: str, tmp_path_factory, name: str, **kwargs):
    from specdec.launcher import Stack

    kwargs.setdefault("engine", ENGINE)
    kwargs["extra_scorer_args"] = [*SCORER_ARGS, *kwargs.get("extra_scorer_args", ())]
    kwargs["extra_draft_args"] = [*DRAFT_ARGS, *kwargs.get("extra_draft_args", ())]
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
    """Scorer + one proposer (all copy methods) + gateway on stories260K, each
    with a Prometheus port."""
    from specdec.proposer_svc.registry import COPY_METHODS

    stack = start_stack(stories_path, tmp_path_factory, "stories", methods=",".join(COPY_METHODS),
                        metrics=True)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def target(stories_path):
    """stories260K in transformers for the feature-head tests, on one thread
    (a tiny model: more threads only wait on a busy machine)."""
    import torch
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield AutoModelForCausalLM.from_pretrained(stories_path).eval()
    torch.set_num_threads(threads)
