"""The counter-based random stream: torch words == Python integers == Triton words."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is defined

import pytest
import torch
import triton
import triton.language as tl

from specdec.kernels import rng
from specdec.kernels.rng_triton import stream_key, uniform

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
MASK = 0xFFFFFFFF
SAMPLE = tl.constexpr(rng.SAMPLE)


def py_fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & MASK
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & MASK
    return x ^ (x >> 16)


def py_stream_key(seed: int, position: int, purpose: int) -> int:
    seed &= (1 << 64) - 1
    h = py_fmix32((seed & MASK) ^ 0x9E3779B9)
    h = py_fmix32(h ^ (seed >> 32))
    h = py_fmix32(h ^ (position & MASK))
    return py_fmix32(h ^ purpose)


def py_uniform(key: int, index: int) -> float:
    bits = py_fmix32((key + (index + 1) * 0x9E3779B9) & MASK)
    return ((bits >> 9) + 0.5) * 2.0**-23


def words(x: torch.Tensor) -> list[int]:
    """int32 words as unsigned Python ints."""
    return [v & MASK for v in x.tolist()]


SEEDS = [0, 1, 12345, 2**31 - 1, 2**31, 2**32 + 5, 2**63 - 1, -1, -(2**63), -987654321]


def test_torch_stream_matches_python_integers():
    positions = [0, 1, 7, 2**31 + 3, 123456789]
    for purpose in (rng.ACCEPT, rng.SAMPLE):
        seed = torch.tensor([s for s in SEEDS for _ in positions], dtype=torch.int64)
        position = torch.tensor([p for _ in SEEDS for p in positions], dtype=torch.int64)
        keys = rng.stream_key(seed, position, purpose)
        expected = [py_stream_key(s, p, purpose) for s in SEEDS for p in positions]
        assert words(keys) == expected
        index = torch.arange(keys.numel(), dtype=torch.int32) * 977
        u = rng.uniform(keys, index)
        assert u.tolist() == [py_uniform(k, int(i)) for k, i in zip(expected, index.tolist())]


def test_fmix32_wraps_like_uint32():
    x = torch.randint(-(2**31), 2**31 - 1, (4096,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    assert words(rng.fmix32(x)) == [py_fmix32(v) for v in words(x)]


@triton.jit
def _draw_kernel(seed_ptr, position_ptr, key_ptr, u_ptr, num_index, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    key = stream_key(tl.load(seed_ptr + i), tl.load(position_ptr + i), SAMPLE)
    tl.store(key_ptr + i, key.to(tl.int64))
    offs = tl.arange(0, BLOCK)
    tl.store(u_ptr + i * num_index + offs, uniform(key, offs), mask=offs < num_index)


def test_triton_stream_matches_torch():
    seed = torch.tensor(SEEDS, dtype=torch.int64, device=DEVICE)
    position = torch.arange(len(SEEDS), dtype=torch.int64, device=DEVICE) * 1000003
    num_index = 37
    keys = torch.empty(len(SEEDS), dtype=torch.int64, device=DEVICE)
    u = torch.empty(len(SEEDS), num_index, dtype=torch.float32, device=DEVICE)
    _draw_kernel[(len(SEEDS),)](seed, position, keys, u, num_index, BLOCK=64)
    expected_keys = rng.stream_key(seed, position, rng.SAMPLE)
    assert [k & MASK for k in keys.tolist()] == words(expected_keys)
    index = torch.arange(num_index, dtype=torch.int32, device=DEVICE)
    assert torch.equal(u, rng.uniform(expected_keys[:, None], index[None, :]))


def test_uniforms_are_uniform_and_open():
    keys = rng.stream_key(torch.arange(200, dtype=torch.int64), torch.zeros(200, dtype=torch.int64), rng.SAMPLE)
    u = rng.uniform(keys[:, None], torch.arange(1000, dtype=torch.int32)[None, :]).flatten()
    assert bool(((u > 0) & (u < 1)).all())
    counts = torch.histc(u, bins=20, min=0, max=1)
    expected = u.numel() / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    p_value = float(torch.special.gammaincc(torch.tensor(19 / 2), torch.tensor(chi2 / 2)))
    assert p_value > 1e-3, (chi2, p_value)
    noise = rng.exponential_noise(keys, torch.arange(1000)[None, :])
    assert abs(float(noise.mean()) - 1.0) < 0.01  # Exp(1): mean 1, sd 1 / sqrt(2e5)


@pytest.mark.parametrize("field", ["seed", "position", "purpose"])
def test_draw_sites_are_independent(field):
    """Changing any one coordinate of a draw site gives uncorrelated uniforms."""
    n = 20000
    seed = torch.arange(n, dtype=torch.int64)
    position = torch.full((n,), 5, dtype=torch.int64)
    base = rng.uniform(rng.stream_key(seed, position, rng.ACCEPT), torch.zeros(n, dtype=torch.int32))
    if field == "seed":
        seed = seed + n
    elif field == "position":
        position = position + 1
    purpose = rng.SAMPLE if field == "purpose" else rng.ACCEPT
    other = rng.uniform(rng.stream_key(seed, position, purpose), torch.zeros(n, dtype=torch.int32))
    correlation = torch.corrcoef(torch.stack([base, other]))[0, 1]
    assert abs(float(correlation)) < 4 / n**0.5
