"""Explicit float32 vectors for numba kernels whose order of operations must
not depend on the compiler's choices (``gemm_simd``, the paged attention's
scores), and a bit-exact power of two that keeps the exponential of
``kv_pool`` vectorisable.

A ``lanes`` value is LANES float32 values in one LLVM vector (a register, or
two on AVX2). Arithmetic on it is written lane by lane (``fma``: one
rounding, the same bits on every CPU) and reduced in a fixed order
(``total``), and no fast-math flag is set on it, so LLVM may not reorder it:
a kernel built from these computes every output alike whatever else it
computes beside it.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, models, register_model

#: float32 lanes of the explicit vectors: fixes every output's summation order.
LANES = 16

_VECTOR = ir.VectorType(ir.FloatType(), LANES)
_I32 = ir.IntType(32)
_BF16_BITS = ir.VectorType(ir.IntType(16), LANES)
_WIDE_BITS = ir.VectorType(_I32, LANES)


class _Lanes(types.Type):
    """LANES float32 values in one LLVM vector (a register, or two on AVX2)."""

    def __init__(self) -> None:
        super().__init__(name=f"float32x{LANES}")


lanes = _Lanes()


@register_model(_Lanes)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VECTOR)


def _element(context, builder, array_type, array, index):
    """Pointer to the flat element `index` of a C-contiguous array."""
    return builder.gep(context.make_array(array_type)(context, builder, array).data, [index])


@intrinsic
def zeros(typingctx):
    """LANES zeros."""
    def codegen(context, builder, signature, args):
        return ir.Constant(_VECTOR, [0.0] * LANES)
    return lanes(), codegen


@intrinsic
def load(typingctx, array, index):
    """The flat elements index .. index + LANES - 1 of a C-contiguous array as
    float32 lanes: float32 as they are; uint16 read as bfloat16 bit patterns
    and widened exactly (the 16 bits become the high half of a float32)."""
    if array.dtype not in (types.float32, types.uint16):
        return None

    def codegen(context, builder, signature, args):
        pointer = _element(context, builder, signature.args[0], args[0], args[1])
        if signature.args[0].dtype == types.float32:
            return builder.load(builder.bitcast(pointer, _VECTOR.as_pointer()), align=4)
        bits = builder.load(builder.bitcast(pointer, _BF16_BITS.as_pointer()), align=2)
        wide = builder.shl(builder.zext(bits, _WIDE_BITS), ir.Constant(_WIDE_BITS, [16] * LANES))
        return builder.bitcast(wide, _VECTOR)
    return lanes(array, index), codegen


@intrinsic
def fma(typingctx, acc, a, b):
    """acc + a * b lane by lane, rounded once (llvm.fma: the same bits on every CPU)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VECTOR, [_VECTOR] * 3),
                                            f"llvm.fma.v{LANES}f32")
        return builder.call(fn, [args[1], args[2], args[0]])
    return lanes(lanes, lanes, lanes), codegen


@intrinsic
def total(typingctx, v):
    """The sum of the lanes in a fixed order: the upper half added to the
    lower half until one lane is left."""
    def codegen(context, builder, signature, args):
        v, width = args[0], LANES
        while width > 1:
            half = width // 2
            low = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half))))
            high = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half, width))))
            v, width = builder.fadd(low, high), half
        return builder.extract_element(v, _I32(0))
    return types.float32(lanes), codegen


@intrinsic
def prefetch_l2(typingctx, array, index):
    """Hint the CPU to bring the float32 array's flat element `index` into L2
    (a read, changes no value, never faults, beyond the end too)."""
    def codegen(context, builder, signature, args):
        address = builder.bitcast(_element(context, builder, signature.args[0], args[0], args[1]),
                                  ir.IntType(8).as_pointer())
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [address.type, _I32, _I32, _I32]), "llvm.prefetch.p0")
        builder.call(fn, [address, _I32(0), _I32(2), _I32(1)])  # read, locality 2 (prefetcht1), data
        return context.get_dummy_value()
    return types.void(array, index), codegen



@intrinsic
def splat(typingctx, x):
    """x (a float32) in every lane."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        one = builder.insert_element(ir.Constant(_VECTOR, ir.Undefined), args[0], _I32(0))
        return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))
    return lanes(x), codegen


@intrinsic
def store(typingctx, array, index, v):
    """The flat elements index .. index + LANES - 1 of a C-contiguous float32 array = v's lanes."""
    if array.dtype != types.float32:
        return None

    def codegen(context, builder, signature, args):
        pointer = _element(context, builder, signature.args[0], args[0], args[1])
        builder.store(args[2], builder.bitcast(pointer, _VECTOR.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(array, index, lanes), codegen


@intrinsic
def add(typingctx, a, b):
    """a + b lane by lane."""
    def codegen(context, builder, signature, args):
        return builder.fadd(args[0], args[1])
    return lanes(lanes, lanes), codegen


@intrinsic
def mul(typingctx, a, b):
    """a * b lane by lane."""
    def codegen(context, builder, signature, args):
        return builder.fmul(args[0], args[1])
    return lanes(lanes, lanes), codegen


@intrinsic
def pow2(typingctx, k):
    """2^k, float32, for an int32 k in [-126, 127], built from its exponent
    bits (exact, and unlike a table lookup it vectorises)."""
    if k != types.int32:
        return None

    def codegen(context, builder, signature, args):
        bits = builder.shl(builder.add(args[0], _I32(127)), _I32(23))
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(k), codegen
