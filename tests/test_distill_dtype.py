"""--train-dtype auto (specdec.distill_dtype): bfloat16 only where it measures
faster on the machine, the verdict cached, a resumed run kept in its dtype."""
from __future__ import annotations

import json
import time

import pytest
import torch

import specdec.distill_dtype as distill_dtype
import specdec.engine.gemm_select as gemm_select


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(distill_dtype.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(gemm_select, "native_bf16", lambda: True)
    return tmp_path / "cache"


def _student() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))


def _sleeping_step(float32_s: float, bfloat16_s: float, calls: list[str]):
    """A loss that takes the given seconds in each dtype (autocast is on for the loss only)."""
    def loss_of(model):
        bf16 = torch.is_autocast_enabled("cpu")
        calls.append("bfloat16" if bf16 else "float32")
        time.sleep(bfloat16_s if bf16 else float32_s)
        return model(torch.ones(2, 16)).sum(), 2
    return loss_of


@pytest.mark.parametrize("float32_s,bfloat16_s,expected", [
    (0.02, 0.01, torch.bfloat16),   # bfloat16 twice as fast
    (0.012, 0.02, torch.float32),   # bfloat16 slower (an Intel Xeon without AMX)
    (0.04, 0.039, torch.float32),   # a near-tie goes to float32
])
def test_auto_keeps_the_dtype_whose_steps_measure_faster_and_caches_it(cache, float32_s, bfloat16_s, expected):
    calls: list[str] = []
    lines: list[str] = []
    student = _student()
    chosen = distill_dtype.choose(student, _sleeping_step(float32_s, bfloat16_s, calls), {"kind": "t"}, lines.append)
    assert chosen == expected
    per_dtype = distill_dtype.ROUNDS * (distill_dtype.WARM + distill_dtype.TIMED)
    assert calls.count("float32") == calls.count("bfloat16") == per_dtype
    assert "measured in" in lines[-1] and str(expected).removeprefix("torch.") in lines[-1]
    [cached] = cache.glob("*.json")
    assert json.loads(cached.read_text())["dtype"] == str(expected).removeprefix("torch.")
    calls.clear()
    # the next run on this machine and shape takes the verdict without measuring, whatever it would measure now
    again = distill_dtype.choose(student, _sleeping_step(bfloat16_s, float32_s, calls), {"kind": "t"}, lines.append)
    assert again == expected and not calls and "measured before" in lines[-1]
    # another shape is measured afresh
    other = distill_dtype.choose(student, _sleeping_step(float32_s, bfloat16_s, calls), {"kind": "u"}, lines.append)
    assert other == expected and calls


def test_without_native_bfloat16_auto_is_float32_unmeasured(cache, monkeypatch):
    monkeypatch.setattr(gemm_select, "native_bf16", lambda: False)
    calls: list[str] = []
    assert distill_dtype.choose(_student(), _sleeping_step(0.02, 0.001, calls), {}, print) == torch.float32
    assert not calls and not cache.exists()


def test_measuring_leaves_the_student_and_the_random_state_as_they_were(cache):
    student = _student()
    before = {k: v.clone() for k, v in student.state_dict().items()}
    optimizer_free = [p.grad for p in student.parameters()]
    torch.manual_seed(5)
    expected_next = torch.rand(3)
    torch.manual_seed(5)

    def loss_of(model):
        torch.rand(7)  # draws from the global generator
        return model(torch.randn(4, 16)).square().mean(), 4

    seconds = distill_dtype.measure(student, loss_of)
    assert set(seconds) == {"float32", "bfloat16"} and all(s > 0 for s in seconds.values())
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())
    assert [p.grad for p in student.parameters()] == optimizer_free
    assert torch.equal(torch.rand(3), expected_next)


def test_a_resumed_run_keeps_its_checkpoints_dtype_and_a_given_dtype_is_kept():
    def never() -> torch.dtype:
        raise AssertionError("measured")

    assert distill_dtype.resolved("auto", {"train_dtype": "bfloat16"}, never) == torch.bfloat16
    assert distill_dtype.resolved("auto", {"train_dtype": "float32"}, never) == torch.float32
    assert distill_dtype.resolved("float32", {"train_dtype": "bfloat16"}, never) == torch.float32
    assert distill_dtype.resolved("bfloat16", None, never) == torch.bfloat16
    assert distill_dtype.resolved("auto", {}, lambda: torch.bfloat16) == torch.bfloat16  # a checkpoint from before


def test_distill_auto_trains_in_the_measured_dtype_and_its_resume_keeps_it(stories_path, tmp_path, cache,
                                                                          monkeypatch):
    """Through ``specdec distill``: auto measures real steps of the run's
    student (a fake clock makes bfloat16 win), trains and writes the card in
    that dtype, and records it in the checkpoint, which a resumed run keeps
    even where a new measurement would now say otherwise."""
    import specdec.distill as distill_mod
    from specdec.distill import CHECKPOINT_FILE
    from specdec.distill_args import DistillConfig

    measured: list[dict] = []
    real_measure = distill_dtype.measure

    def measure(student, loss_of):
        seconds = real_measure(student, loss_of)  # the run's real steps, timed
        measured.append(seconds)
        return {"float32": 1.0, "bfloat16": 0.5}

    monkeypatch.setattr(distill_dtype, "measure", measure)
    cfg = DistillConfig(stories_path, str(tmp_path / "run"), layers=2, steps=2, samples=8, max_new_tokens=16,
                        batch_size=4, seed=3, teacher_dtype="float32")
    lines: list[str] = []
    card = distill_mod.distill(cfg, log=lines.append)
    assert len(measured) == 1 and card["train_dtype_used"] == "bfloat16"
    assert any(line.startswith("training in bfloat16 (--train-dtype auto)") for line in lines)
    assert torch.load(tmp_path / "run" / CHECKPOINT_FILE, weights_only=False)["train_dtype"] == "bfloat16"
    for f in cache.glob("*.json"):
        f.unlink()  # a new measurement would be taken, and would now say float32
    monkeypatch.setattr(distill_dtype, "measure", lambda *_: {"float32": 0.5, "bfloat16": 1.0})
    resumed = distill_mod.distill(cfg, resume=True, log=lines.append)
    assert resumed["train_dtype_used"] == "bfloat16" and not list(cache.glob("*.json"))


@pytest.mark.parametrize("float32_s,bfloat16_s,expected", [
    (0.02, 0.01, "bfloat16"),   # an AMD EPYC: bfloat16 answers faster
    (0.012, 0.015, "float32"),  # an Intel Xeon with AVX512-BF16, no AMX: float32 answers faster
    (0.02, 0.0195, "float32"),  # a near-tie goes to float32
])
def test_the_teacher_dtype_is_the_one_whose_decode_steps_measure_faster(cache, float32_s, bfloat16_s, expected):
    """choose_teacher: ROUNDS rounds in turns of TEACHER_WARM + TEACHER_TIMED
    decode steps, the warm ones not counted; cached per key."""
    calls: list[tuple[str, int]] = []

    def step_seconds(dtype: str, n: int) -> list[float]:
        calls.append((dtype, n))
        warm = [10.0 if dtype == "float32" else 0.0]  # a slow first call, which must not count
        return (warm + [float32_s if dtype == "float32" else bfloat16_s] * n)[:n]

    lines: list[str] = []
    assert distill_dtype.choose_teacher({"target": "t"}, step_seconds, lines.append) == expected
    n = distill_dtype.TEACHER_WARM + distill_dtype.TEACHER_TIMED
    assert calls == [("float32", n), ("bfloat16", n)] * distill_dtype.ROUNDS
    assert lines[-1].startswith(f"teacher dtype: {expected} (--teacher-dtype auto; a decode step float32 "
                                f"{1e3 * float32_s:.1f} ms")
    calls.clear()
    assert distill_dtype.choose_teacher({"target": "t"}, step_seconds, lines.append) == expected and not calls
    assert distill_dtype.choose_teacher({"target": "u"}, step_seconds, lines.append) == expected and calls


def test_without_native_bfloat16_the_teacher_answers_in_float32_unmeasured(cache, monkeypatch):
    monkeypatch.setattr(gemm_select, "native_bf16", lambda: False)

    def never(*_):
        raise AssertionError("measured")

    assert distill_dtype.choose_teacher({"target": "t"}, never, print) == "float32" and not cache.exists()
