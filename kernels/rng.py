"""Counter-based random numbers for verification, in torch (the reference).

Every random number a verification draws is a pure function of
``(seed, position, purpose, index)``, never of the batch a sequence shares
or the row it occupies, so a request's seed reproduces its output in any
batch::

    key  = stream_key(seed, position, purpose)   # one 32-bit key per draw site
    bits = fmix32(key + (index + 1) * GOLDEN)     # index: vocabulary id, 0 for a scalar
    u    = ((bits >> 9) + 0.5) * 2**-23          # uniform, strictly inside (0, 1)

``position`` is the absolute position of the token being decided (the
sequence's context length before the round plus the draft index), and
``purpose`` separates the draws made at one position:

    ACCEPT  the uniform of the acceptance test of the draft at that position;
    SAMPLE  the exponential noise of the race that draws the output token at
            that position (recovered, bonus, or the target's own sample).

``fmix32`` is the MurmurHash3 32-bit finaliser. Sampling over the vocabulary
uses the exponential race: ``argmax_v p[v] / E[v]`` with ``E[v] = -log(u[v])``
is distributed as ``p`` (no cumulative sum over the vocabulary needed).

The Triton twin is ``rng_triton.py`` (uint32 arithmetic). Here the 32-bit
words are held in int32 tensors whose multiplications wrap modulo 2**32 and
whose right shifts are made logical with a mask, so both compute the same
bits; ``tests/test_kernels_rng.py`` checks this against Python integers.
"""
from __future__ import annotations

import torch

ACCEPT = 1  # purpose: acceptance uniform of a draft
SAMPLE = 2  # purpose: exponential race for an output token

GOLDEN = 0x9E3779B9  # odd constant of the per-index Weyl sequence (2**32 / phi)
FMIX_M1 = 0x85EBCA6B
FMIX_M2 = 0xC2B2AE35
UNIFORM_SCALE = 2.0**-23


def _as_int32(word: int) -> int:
    """The int32 with the same 32 bits as the unsigned word."""
    return word - (1 << 32) if word >= (1 << 31) else word


def _low_word(x: torch.Tensor) -> torch.Tensor:
    """int64 [...] -> int32 [...] holding the low 32 bits."""
    return (x & 0xFFFFFFFF).to(torch.int32)


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 finaliser on 32-bit words held in an int32 tensor [...]."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _as_int32(FMIX_M1)
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * _as_int32(FMIX_M2)
    return x ^ ((x >> 16) & 0xFFFF)


def stream_key(seed: torch.Tensor, position: torch.Tensor, purpose: int) -> torch.Tensor:
    """Key of one draw site.

    seed: int64 [...] (all 64 bits are used); position: int64 [...] (low 32
    bits used); returns int32 [...].
    """
    h = fmix32(_low_word(seed) ^ _as_int32(GOLDEN))
    h = fmix32(h ^ _low_word(seed >> 32))
    h = fmix32(h ^ _low_word(position))
    return fmix32(h ^ purpose)


def uniform(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1): key int32 [...] and index int32 [...] broadcast -> float32."""
    bits = fmix32(key + (index.to(torch.int32) + 1) * _as_int32(GOLDEN))
    return (((bits >> 9) & 0x7FFFFF).to(torch.float32) + 0.5) * UNIFORM_SCALE


def exponential_noise(key: torch.Tensor,  # int32 [M], one race per key
                      index: torch.Tensor,  # int [M or 1, C], the vocabulary ids raced
                      ) -> torch.Tensor:  # float32 [M, C]
    """Exp(1) noise E = -log(u) of the given vocabulary ids of each race."""
    return uniform(key[:, None], index).log_().neg_()
