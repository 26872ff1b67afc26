"""Explicit float32 vectors for numba kernels whose order of operations must
not depend on the compiler's choices (``gemm_simd``, the paged attention's
scores), and a bit-exact power of two that keeps the exponential of
``kv_pool`` vectorisable.

A ``lanes`` value is LANES float32 values in one LLVM vector (a register, or
two on AVX2); a ``pairs`` value is 2 LANES bfloat16 values, the operand of
AVX512-BF16's dot product (``mac`` on pairs: ``vdpbf16ps``), which only a
CPU with that extension may compile (``has_dpbf16``). Arithmetic on it is written lane by lane (``fma``: one
rounding, the same bits on every CPU) and reduced in a fixed order
(``total``), and no fast-math flag is set on it, so LLVM may not reorder it:
a kernel built from these computes every output alike whatever else it
computes beside it.

A ``halves`` value is LANES / 2 float32 lanes (one AVX2 register): the lanes
0..7 or 8..15 of a ``lanes`` sum, which never meet until ``total``. A kernel
may run each half of its sums in a pass of its own (half the registers a
sum takes) and join them with ``total_of_halves``: the same operations on
every lane, so the same bits.

Scalars: ``element`` reads one value of a float32 or bfloat16-bits array as
float32 (``load``'s widening), ``bits`` gives a float32's bit pattern.
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


class _BFloat(ir.Type):
    """LLVM's bfloat (llvmlite names no such type)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


_PAIRS = ir.VectorType(_BFloat(), 2 * LANES)
_HALF = ir.VectorType(ir.FloatType(), LANES // 2)
_PAIR_BITS = ir.VectorType(ir.IntType(16), 2 * LANES)


class _Lanes(types.Type):
    """LANES float32 values in one LLVM vector (a register, or two on AVX2)."""

    def __init__(self) -> None:
        super().__init__(name=f"float32x{LANES}")


class _Pairs(types.Type):
    """2 LANES bfloat16 values in one LLVM vector: LANES pairs, one per float32 lane of a dot product."""

    def __init__(self) -> None:
        super().__init__(name=f"bfloat16x{2 * LANES}")


class _Halves(types.Type):
    """LANES / 2 float32 values in one LLVM vector: one half of a ``lanes`` sum (one AVX2 register)."""

    def __init__(self) -> None:
        super().__init__(name=f"float32x{LANES // 2}")


lanes = _Lanes()
pairs = _Pairs()
halves = _Halves()


@register_model(_Lanes)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VECTOR)


@register_model(_Halves)
class _HalvesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _HALF)


@register_model(_Pairs)
class _PairsModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _PAIRS)


def has_dpbf16() -> bool:
    """Whether numba compiles for a CPU with AVX512-BF16 (``mac`` on pairs):
    the host's features as LLVM sees them, no other target forced
    (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES), and an LLVM whose dot-product
    intrinsic takes bfloat vectors (17 and later; before, it took i32 vectors)."""
    from llvmlite import binding
    return binding.llvm_version_info >= (17,) and bool(_host_features().get("avx512bf16"))


def _host_features() -> dict:
    """The host CPU's features as LLVM sees them, or none where another
    target is forced (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES): numba then
    compiles for that target, whose features are not the host's."""
    from llvmlite import binding
    from numba.core import config
    if getattr(config, "CPU_NAME", None) or getattr(config, "CPU_FEATURES", None):
        return {}
    return dict(binding.get_host_cpu_features())


def _element(context, builder, array_type, array, index):
    """Pointer to the flat element `index` of a C-contiguous array."""
    return builder.gep(context.make_array(array_type)(context, builder, array).data, [index])


@intrinsic
def zeros(typingctx):
    """LANES zeros."""
    def codegen(context, builder, signature, args):
        return ir.Constant(_VECTOR, [0.0] * LANES)
    return lanes(), codegen


def _load_codegen(context, builder, signature, args):
    pointer = _element(context, builder, signature.args[0], args[0], args[1])
    if signature.args[0].dtype == types.float32:
        return builder.load(builder.bitcast(pointer, _VECTOR.as_pointer()), align=4)
    bits = builder.load(builder.bitcast(pointer, _BF16_BITS.as_pointer()), align=2)
    wide = builder.shl(builder.zext(bits, _WIDE_BITS), ir.Constant(_WIDE_BITS, [16] * LANES))
    return builder.bitcast(wide, _VECTOR)


def _load_signature(array, *rest):
    """``load``'s typing (the codegen reads only the first two arguments)."""
    if array.dtype not in (types.float32, types.uint16):
        return None
    return lanes(array, *rest), _load_codegen


def _fma_of(vector: ir.VectorType):
    """The codegen of acc + a * b (args acc, a, b) lane by lane on `vector`s, rounded once (llvm.fma)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                            f"llvm.fma.v{vector.count}f32")
        return builder.call(fn, [args[1], args[2], args[0]])
    return codegen


_fma_codegen = _fma_of(_VECTOR)


@intrinsic
def load(typingctx, array, index):
    """The flat elements index .. index + LANES - 1 of a C-contiguous array as
    float32 lanes: float32 as they are; uint16 read as bfloat16 bit patterns
    and widened exactly (the 16 bits become the high half of a float32)."""
    return _load_signature(array, index)


@intrinsic
def width(typingctx, like):
    """How many input values one ``mac`` step takes for inputs like `like`
    (an array): 2 LANES bfloat16 pairs when it holds bfloat16 bits (uint16),
    else LANES float32 lanes."""
    step = 2 * LANES if like.dtype == types.uint16 else LANES

    def codegen(context, builder, signature, args):
        return context.get_constant(types.intp, step)
    return types.intp(like), codegen


@intrinsic
def operand(typingctx, array, index, like):
    """The flat elements index .. of a C-contiguous array as a ``mac``
    operand for inputs like `like`: when `like` holds bfloat16 bits (the
    inputs rounded to bfloat16), 2 LANES bfloat16 values as they are
    (``pairs``: `array` must hold bfloat16 bits too); else ``load``'s LANES
    float32 lanes."""
    if like.dtype != types.uint16:
        return _load_signature(array, index, like)
    if array.dtype != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        pointer = _element(context, builder, signature.args[0], args[0], args[1])
        bits = builder.load(builder.bitcast(pointer, _PAIR_BITS.as_pointer()), align=2)
        return builder.bitcast(bits, _PAIRS)
    return pairs(array, index, like), codegen


@intrinsic
def mac(typingctx, acc, a, b):
    """acc plus a times b: on ``lanes``, ``fma``; on ``pairs``, AVX512-BF16's
    dot product (``vdpbf16ps``: each float32 lane adds the two products of
    its pair of bfloat16 values, exact products, float32 sums in the
    instruction's fixed order; only where ``has_dpbf16``)."""
    if a == lanes and b == lanes:
        return lanes(lanes, lanes, lanes), _fma_codegen
    if not (a == pairs and b == pairs):
        return None

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VECTOR, [_VECTOR, _PAIRS, _PAIRS]),
                                            f"llvm.x86.avx512bf16.dpbf16ps.{32 * LANES}")
        return builder.call(fn, [args[0], args[1], args[2]])
    return lanes(lanes, pairs, pairs), codegen


@intrinsic
def fma(typingctx, acc, a, b):
    """acc + a * b lane by lane, rounded once (llvm.fma: the same bits on every CPU)."""
    return lanes(lanes, lanes, lanes), _fma_codegen


@intrinsic
def total(typingctx, v):
    """The sum of the lanes in a fixed order: the upper half added to the
    lower half until one lane is left."""
    def codegen(context, builder, signature, args):
        return _halving(builder, args[0], LANES)
    return types.float32(lanes), codegen


def _halving(builder, v, width: int):
    """The sum of v's `width` lanes: the upper half added to the lower half until one lane is left."""
    while width > 1:
        half = width // 2
        low = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half))))
        high = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half, width))))
        v, width = builder.fadd(low, high), half
    return builder.extract_element(v, _I32(0))


def _prefetch(locality: int):
    """An intrinsic: hint the CPU to bring the array's flat element `index`
    into cache (a read, changes no value, never faults, beyond the end too);
    LLVM's locality 2 is x86's prefetcht1 (into L2), 3 prefetcht0 (into L1)."""
    def typer(typingctx, array, index):
        def codegen(context, builder, signature, args):
            address = builder.bitcast(_element(context, builder, signature.args[0], args[0], args[1]),
                                      ir.IntType(8).as_pointer())
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [address.type, _I32, _I32, _I32]), "llvm.prefetch.p0")
            builder.call(fn, [address, _I32(0), _I32(locality), _I32(1)])  # read, locality, data
            return context.get_dummy_value()
        return types.void(array, index), codegen
    typer.__name__ = typer.__qualname__ = f"prefetch_l{4 - locality}"  # the intrinsic's name
    return typer


#: prefetch into L2 / into L1 (``_prefetch``)
prefetch_l2 = intrinsic(_prefetch(2))
prefetch_l1 = intrinsic(_prefetch(3))


@intrinsic
def splat(typingctx, x):
    """x (a float32) in every lane."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        one = builder.insert_element(ir.Constant(_VECTOR, ir.Undefined), args[0], _I32(0))
        return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))
    return lanes(x), codegen


def _store_of(vector: ir.VectorType):
    """The codegen of storing a `vector` (args array, index, v) at a float32 array's flat element index."""
    def codegen(context, builder, signature, args):
        pointer = _element(context, builder, signature.args[0], args[0], args[1])
        builder.store(args[2], builder.bitcast(pointer, vector.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


@intrinsic
def store(typingctx, array, index, v):
    """The flat elements index .. index + LANES - 1 of a C-contiguous float32 array = v's lanes."""
    if array.dtype != types.float32:
        return None
    return types.void(array, index, lanes), _store_of(_VECTOR)


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


@intrinsic
def element(typingctx, array, index):
    """The flat element `index` of a C-contiguous array as float32: float32
    as it is; uint16 read as a bfloat16 bit pattern and widened exactly
    (``load``'s rule, one value)."""
    if array.dtype not in (types.float32, types.uint16):
        return None

    def codegen(context, builder, signature, args):
        pointer = _element(context, builder, signature.args[0], args[0], args[1])
        if signature.args[0].dtype == types.float32:
            return builder.load(pointer)
        wide = builder.shl(builder.zext(builder.load(pointer), _I32), _I32(16))
        return builder.bitcast(wide, ir.FloatType())
    return types.float32(array, index), codegen


_BYTES = ir.VectorType(ir.IntType(8), LANES)


def _small_ints(high: bool | None):
    """An intrinsic: LANES bytes of a C-contiguous array from flat element
    `index` as float32 lanes (exact): for a uint8 array their low (high is
    False) or high (True) 4 bits, 0..15; for an int8 array (high None) the
    signed values. GGUF's Q4_0, Q4_1 and Q8_0 quants (``gemm_gguf``). The
    bytes are widened to 32 bits before their 4 bits are split: on AVX2 two
    ``vpmovzxbd`` from memory (shared by the low and the high half) and a
    32-bit mask or shift, where splitting the bytes first took a 16-bit
    shift, a byte mask and a shuffle more per half."""
    def typer(typingctx, array, index):
        if array.dtype != (types.int8 if high is None else types.uint8):
            return None

        def codegen(context, builder, signature, args):
            pointer = _element(context, builder, signature.args[0], args[0], args[1])
            b = builder.load(builder.bitcast(pointer, _BYTES.as_pointer()), align=1)
            if high is None:
                return builder.sitofp(builder.sext(b, _WIDE_BITS), _VECTOR)
            b = builder.zext(b, _WIDE_BITS)
            b = builder.lshr(b, ir.Constant(_WIDE_BITS, [4] * LANES)) if high else \
                builder.and_(b, ir.Constant(_WIDE_BITS, [15] * LANES))
            return builder.sitofp(b, _VECTOR)
        return lanes(array, index), codegen
    typer.__name__ = typer.__qualname__ = {None: "signed_bytes", False: "low_nibbles", True: "high_nibbles"}[high]
    return typer


#: uint8 bytes' low / high 4 bits, int8 bytes, as float32 lanes (``_small_ints``)
low_nibbles = intrinsic(_small_ints(False))
high_nibbles = intrinsic(_small_ints(True))
signed_bytes = intrinsic(_small_ints(None))


def has_permute() -> bool:
    """Whether numba compiles for a CPU with AVX-512 (``pick_low`` /
    ``pick_high``: a 16-entry table lookup per lane, ``vpermps``): the host's
    features as LLVM sees them, no other target forced (``_host_features``)."""
    return bool(_host_features().get("avx512f"))


@intrinsic
def iota(typingctx):
    """0, 1, .., LANES - 1 as float32 lanes."""
    def codegen(context, builder, signature, args):
        return ir.Constant(_VECTOR, [float(i) for i in range(LANES)])
    return lanes(), codegen


def _pick(high: bool):
    """An intrinsic: LANES bytes of a uint8 array from flat element `index`,
    each byte's low (high False) or high 4 bits choosing a lane of `table`
    (LANES float32 lanes): lane j = table[nibble j], the table's values as
    they are (only where ``has_permute``: AVX-512's ``vpermps``, whose
    index is the low 4 bits of each 32-bit lane)."""
    def typer(typingctx, table, array, index):
        if table != lanes or array.dtype != types.uint8:
            return None

        def codegen(context, builder, signature, args):
            pointer = _element(context, builder, signature.args[1], args[1], args[2])
            wide = builder.zext(builder.load(builder.bitcast(pointer, _BYTES.as_pointer()), align=1), _WIDE_BITS)
            if high:
                wide = builder.lshr(wide, ir.Constant(_WIDE_BITS, [4] * LANES))
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VECTOR, [_VECTOR, _WIDE_BITS]),
                                                "llvm.x86.avx512.permvar.sf.512")
            return builder.call(fn, [args[0], wide])
        return lanes(table, array, index), codegen
    typer.__name__ = typer.__qualname__ = "pick_high" if high else "pick_low"
    return typer


#: table[low 4 bits] / table[high 4 bits] of LANES uint8 bytes (``_pick``)
pick_low = intrinsic(_pick(False))
pick_high = intrinsic(_pick(True))


@intrinsic
def bits(typingctx, x):
    """A float32's bit pattern as uint32 (no conversion)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _I32)
    return types.uint32(x), codegen


# ---- halves: one half of a lanes sum at a time -----------------------------------


@intrinsic
def half_load(typingctx, array, index):
    """The flat elements index .. index + LANES / 2 - 1 of a C-contiguous float32 array."""
    if array.dtype != types.float32:
        return None

    def codegen(context, builder, signature, args):
        pointer = _element(context, builder, signature.args[0], args[0], args[1])
        return builder.load(builder.bitcast(pointer, _HALF.as_pointer()), align=4)
    return halves(array, index), codegen


@intrinsic
def half_store(typingctx, array, index, v):
    """The flat elements index .. index + LANES / 2 - 1 of a C-contiguous float32 array = v's lanes."""
    if array.dtype != types.float32:
        return None
    return types.void(array, index, halves), _store_of(_HALF)


@intrinsic
def half_fma(typingctx, acc, a, b):
    """acc + a * b lane by lane, rounded once (``fma`` on halves)."""
    return halves(halves, halves, halves), _fma_of(_HALF)


@intrinsic
def total_of_halves(typingctx, low, high):
    """``total`` of the LANES lanes whose lanes 0 .. LANES / 2 - 1 are `low`
    and the rest `high`: total's first step adds the upper half to the lower
    one, which is low + high; then the same halving. The same bits."""
    def codegen(context, builder, signature, args):
        return _halving(builder, builder.fadd(args[0], args[1]), LANES // 2)
    return types.float32(halves, halves), codegen
