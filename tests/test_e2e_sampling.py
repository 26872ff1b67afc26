"""Sampling end to end over gRPC with stories260K: a seed makes the output
reproducible whatever batch it lands in, and the tokens sampled through
n-gram speculation follow the target's distribution exactly (chi-square
against the exact marginals computed with transformers)."""
from __future__ import annotations

import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import hf_model
from specdec.client import make_request, stream

# the story repeats itself, so the n-gram proposer drafts from the first round
PROMPT = "Once upon a time, there was a little girl named Lily. Once upon a time, there was a little"
TEMPERATURE, TOP_K = 1.0, 6


def test_seed_reproducible_whatever_the_batch(stories_stack):
    addr = stories_stack.gateway_addr
    req = lambda seed, **kw: make_request(PROMPT, max_tokens=24, method="ngram", k=4, temperature=0.9,
                                          top_p=0.95, seed=seed, **kw)
    alone = stream(addr, req(1234)).token_ids
    assert stream(addr, req(1234)).token_ids == alone
    others = [make_request("Once upon a time", max_tokens=30, method=m, k=3, temperature=1.0, seed=s)
              for s, m in enumerate(["none", "ngram", "suffix", "ngram", "none"])]
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, addr, r) for r in others]
        crowded = pool.submit(stream, addr, req(1234)).result().token_ids
        [f.result() for f in futures]
    assert crowded == alone
    assert len({tuple(stream(addr, req(s)).token_ids) for s in range(5)}) > 1  # seeds matter


def _filtered_probs(logits: torch.Tensor) -> torch.Tensor:
    """Target distribution after temperature and top-k, float64 [..., V]."""
    logits = logits.double() / TEMPERATURE
    kth = logits.topk(TOP_K, dim=-1).values[..., -1:]
    return torch.softmax(logits.masked_fill(logits < kth, -math.inf), dim=-1)


def _exact_marginals(path: str, prompt_ids: list[int]) -> tuple[dict, dict]:
    """p(x1) and p(x2) = sum_x1 p(x1) p(x2 | x1) for the target model."""
    model, _ = hf_model(path)
    with torch.inference_mode():
        p1 = _filtered_probs(model(torch.tensor([prompt_ids])).logits[0, -1])
        support = p1.nonzero().flatten()
        batch = torch.tensor([prompt_ids + [int(x)] for x in support])
        p2_given = _filtered_probs(model(batch).logits[:, -1])  # [support, V]
        p2 = (p1[support, None] * p2_given).sum(0)
    as_dict = lambda p: {int(i): float(p[i]) for i in p.nonzero().flatten()}
    return as_dict(p1), as_dict(p2)


def chi_square_p_value(counts: Counter, probs: dict, n: int) -> float:
    """Pearson chi-square goodness of fit; bins with expected count < 5 are
    pooled. p-value by the Wilson-Hilferty normal approximation."""
    bins, pooled_obs, pooled_exp = [], 0, 0.0
    for token, p in probs.items():
        if n * p >= 5:
            bins.append((counts.get(token, 0), n * p))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts.get(token, 0), pooled_exp + n * p
    outside = n - sum(counts.get(t, 0) for t in probs)
    assert outside == 0, f"{outside} samples outside the target's support"
    if pooled_exp > 0:
        bins.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    df = len(bins) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("method", ["ngram", pytest.param("none", marks=pytest.mark.slow)])
def test_sampled_tokens_follow_the_target_distribution(stories_stack, stories_path, method):
    prompt_ids = list(hf_model(stories_path)[1](PROMPT)["input_ids"])
    p1, p2 = _exact_marginals(stories_path, prompt_ids)
    n = 600

    def sample(seed):
        gen = stream(stories_stack.gateway_addr, make_request(
            prompt_ids, max_tokens=3, method=method, k=4, temperature=TEMPERATURE, top_k=TOP_K, seed=seed))
        return gen.token_ids, gen.stats

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(sample, range(10_000, 10_000 + n)))
    firsts = Counter(r[0][0] for r in results)
    seconds = Counter(r[0][1] for r in results)
    if method == "ngram":  # speculation really happened and was sometimes rejected
        drafted = sum(s.draft_tokens for _, s in results)
        accepted = sum(s.accepted_tokens for _, s in results)
        assert drafted >= n and 0 < accepted < drafted
    assert chi_square_p_value(firsts, p1, n) > 1e-3
    assert chi_square_p_value(seconds, p2, n) > 1e-3


def test_chi_square_detects_a_wrong_distribution():
    """The check above has power: samples from a skewed distribution fail it."""
    probs = {0: 0.4, 1: 0.3, 2: 0.2, 3: 0.1}
    n = 600
    skewed = Counter({0: 300, 1: 150, 2: 100, 3: 50})  # 0.5/0.25/0.167/0.083
    exact = Counter({0: 240, 1: 180, 2: 120, 3: 60})
    assert chi_square_p_value(skewed, probs, n) < 1e-3
    assert chi_square_p_value(exact, probs, n) > 0.5
