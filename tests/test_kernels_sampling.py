"""Sampling filters: the reference against a naive definition, the kernel against the reference."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before specdec.kernels defines any @triton.jit

import pytest
import torch

from specdec.kernels import filter_stats, filter_stats_reference, filtered_probs, filtered_probs_at, sampling_triton

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"


def naive_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The definition in sampling.py, one row, float64, by sorting."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    vocab = probs.numel()
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep &= probs >= torch.sort(probs, descending=True).values[top_k - 1]
    if 0 < top_p < 1:
        kept = torch.sort(torch.where(keep, probs, 0.0), descending=True).values
        cumulative = torch.cumsum(kept, 0) / kept.sum()
        keep &= probs >= kept[int((cumulative < top_p).sum())]
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def reference_probs(logits, temperature, top_k, top_p):
    stats = filter_stats_reference(logits, temperature, top_k, top_p)
    return filtered_probs(logits, temperature, stats)


def random_rows(vocab: int, settings: list[tuple[float, int, float]], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(settings), vocab, generator=g) * torch.tensor([0.5, 2.0, 4.0])[
        torch.arange(len(settings)) % 3][:, None]
    temperature = torch.tensor([s[0] for s in settings], dtype=torch.float32)
    top_k = torch.tensor([s[1] for s in settings], dtype=torch.int32)
    top_p = torch.tensor([s[2] for s in settings], dtype=torch.float32)
    return logits, temperature, top_k, top_p


SETTINGS = [(1.0, 0, 0.0), (0.7, 3, 0.0), (1.3, 0, 0.8), (0.5, 5, 0.9), (2.0, 1, 0.5),
            (1.0, 0, 1.0), (0.9, 40, 0.3), (1.1, 2, 0.999)]


@pytest.mark.parametrize("vocab", [7, 100, 2048])
def test_reference_matches_naive_definition(vocab):
    logits, temperature, top_k, top_p = random_rows(vocab, SETTINGS, seed=vocab)
    got = reference_probs(logits, temperature, top_k, top_p)
    for r, (t, k, p) in enumerate(SETTINGS):
        expected = naive_probs(logits[r], t, k, p)
        assert torch.equal(got[r] > 0, expected > 0), (r, t, k, p)
        torch.testing.assert_close(got[r].double(), expected, rtol=1e-5, atol=1e-7)


def test_top_k_and_top_p_keep_ties_at_the_edge():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, -1.0]] * 2)
    temperature = torch.ones(2)
    top_k = torch.tensor([2, 0], dtype=torch.int32)
    # softmax ~ [.68, .09, .09, .09, .03, .01]: 0.75 needs token 0 plus one of the tied trio.
    top_p = torch.tensor([0.0, 0.75])
    probs = reference_probs(logits, temperature, top_k, top_p)
    assert (probs > 0).tolist() == [[True, True, True, True, False, False]] * 2
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


def test_top_k_one_is_argmax_and_disabled_filters_keep_everything():
    logits, temperature, _, _ = random_rows(50, [(1.0, 0, 0.0)] * 4)
    top_k = torch.tensor([1, 0, 50, 0], dtype=torch.int32)
    top_p = torch.tensor([0.0, 1.0, 0.0, 0.0])
    probs = reference_probs(logits, temperature, top_k, top_p)
    assert (probs[0] > 0).nonzero().flatten().tolist() == [int(logits[0].argmax())]
    for r in (1, 2, 3):
        torch.testing.assert_close(probs[r], torch.softmax(logits[r], -1))


def test_temperature_zero_rows_get_neutral_stats():
    logits = torch.randn(2, 9)
    stats = filter_stats_reference(logits, torch.tensor([0.0, 1.0]), torch.tensor([3, 3], dtype=torch.int32),
                                   torch.tensor([0.5, 0.5]))
    assert (float(stats.row_max[0]), float(stats.threshold[0]), float(stats.norm[0])) == (0.0, 0.0, 1.0)
    assert float(stats.threshold[1]) > 0


def test_wide_nucleus_widens_the_candidate_window():
    """A flat row whose nucleus exceeds the first 64 candidates."""
    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(3)) * 0.1
    probs = reference_probs(logits, torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.tensor([0.6]))
    expected = naive_probs(logits[0], 1.0, 0, 0.6)
    assert int((probs > 0).sum()) > 2000
    assert torch.equal(probs[0] > 0, expected > 0)


KERNEL_SETTINGS = SETTINGS + [(0.0, 3, 0.5), (1.0, 10**6, 0.0), (0.8, -1, 1.5)]


@pytest.mark.parametrize("vocab", [1, 7, 511, 32000])
def test_triton_kernel_stats_match_reference(vocab):
    """The Triton kernel itself (by the interpreter on CPU), never the dispatcher,
    against the torch reference."""
    logits, temperature, top_k, top_p = (t.to(DEVICE) for t in random_rows(vocab, KERNEL_SETTINGS, seed=vocab))
    got = sampling_triton.filter_stats(logits, temperature, top_k, top_p)
    expected = filter_stats_reference(logits, temperature, top_k, top_p)
    assert torch.equal(got.row_max, expected.row_max)
    # exp differs between backends by an ulp, so thresholds (an e value) may too.
    torch.testing.assert_close(got.threshold, expected.threshold, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.norm, expected.norm, rtol=1e-5, atol=0)


def test_filter_stats_dispatches_cpu_to_reference_and_use_triton_to_the_kernel(monkeypatch):
    """Which implementation `filter_stats` runs (their agreement is the test above):
    CPU tensors get the reference unless use_triton=True asks for the kernel."""
    calls = []
    kernel = sampling_triton.filter_stats
    monkeypatch.setattr(sampling_triton, "filter_stats", lambda *a: calls.append("kernel") or kernel(*a))
    logits, temperature, top_k, top_p = random_rows(33, SETTINGS)
    expected = filter_stats_reference(logits, temperature, top_k, top_p)
    on_cpu = filter_stats(logits, temperature, top_k, top_p)
    assert calls == []
    for name in ("row_max", "threshold", "norm"):
        assert torch.equal(getattr(on_cpu, name), getattr(expected, name))
    filter_stats(*(t.to(DEVICE) for t in (logits, temperature, top_k, top_p)), use_triton=True)
    assert calls == ["kernel"]


def test_filtered_probs_at_reads_single_tokens():
    logits, temperature, top_k, top_p = random_rows(40, SETTINGS, seed=9)
    stats = filter_stats_reference(logits, temperature, top_k, top_p)
    probs = filtered_probs(logits, temperature, stats)
    ids = torch.tensor([0, 5, 39, 17, -1, 40, 3, 2])
    got = filtered_probs_at(logits, temperature, stats, ids)
    inside = (ids >= 0) & (ids < 40)
    assert torch.equal(got[inside], probs[inside.nonzero().squeeze(1), ids[inside]])
    assert got[~inside].tolist() == [0.0, 0.0]
