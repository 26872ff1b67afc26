"""Triton twin of ``rng.py``: the same counter-based draws in uint32 arithmetic.

Imported only when a Triton kernel is launched (see ``verify.py``), so that
``TRITON_INTERPRET`` may be set by a test before any ``@triton.jit`` runs.
"""
import triton
import triton.language as tl


@triton.jit
def fmix32(x):
    """MurmurHash3 finaliser; x: uint32 (scalar or block)."""
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    x ^= x >> 16
    return x


@triton.jit
def stream_key(seed, position, purpose: tl.constexpr):
    """Key of one draw site; seed, position: int64 scalars -> uint32 scalar."""
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    h = fmix32(lo ^ 0x9E3779B9)
    h = fmix32(h ^ hi)
    h = fmix32(h ^ (position & 0xFFFFFFFF).to(tl.uint32))
    return fmix32(h ^ tl.full((), purpose, tl.uint32))


@triton.jit
def uniform(key, index):
    """Uniforms in (0, 1); key: uint32 scalar, index: int32 block -> float32 block.

    fmix32 is written out inline: this runs once per vocabulary block, and the
    interpreter re-patches triton.language on every device-function call.
    """
    bits = key + (index.to(tl.uint32) + 1) * 0x9E3779B9
    bits ^= bits >> 16
    bits *= 0x85EBCA6B
    bits ^= bits >> 13
    bits *= 0xC2B2AE35
    bits ^= bits >> 16
    return ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07


@triton.jit
def exponential_noise(key, index):
    """Exp(1) noise of a race; key: uint32 scalar, index: int32 block."""
    return -tl.log(uniform(key, index))
