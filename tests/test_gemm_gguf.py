"""engine.gemm_gguf: GGUF Q4_1 / Q8_0 blocks read as they are, dequantised in
registers to exactly the float32 weights gguf-py (and so transformers)
gives, summed as engine.gemm_simd sums: the same bits as simd on the
dequantised weights at every row count; a weight's blocks found again
through fusion, permuted and zero rows, and refused when they are not there."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from specdec.engine import gemm_gguf, gemm_simd
from specdec.engine.gemm_gguf import GgufBlocks, NoBlocks
from specdec.engine.simd import has_permute

ROWS = (1, 2, 3, 4, 5, 6, 7, 13, 19, 32)


def values(out: int, width: int, seed: int) -> np.ndarray:
    """Weights with outliers and a negative block minimum (Q4_1's m < 0)."""
    w = np.random.default_rng(seed).standard_normal((out, width)).astype(np.float32)
    w[0, :32] *= 40.0
    w[1, 32:64] -= 3.0
    return w


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A GGUF file with a Q4_1, a Q8_0 and a Q4_0 tensor, and an F32 one (not read)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "héllo"])  # strings in an array: skipped
    writer.add_array("tokenizer.ggml.scores", [0.5, 1.0, 2.0])
    writer.add_uint32("llama.block_count", 1)
    writer.add_tensor("blk.0.ffn_up.weight", quantize(values(40, 96, 0), QT.Q4_1), raw_dtype=QT.Q4_1)
    writer.add_tensor("token_embd.weight", quantize(values(24, 96, 1), QT.Q8_0), raw_dtype=QT.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", quantize(values(16, 64, 2), QT.Q4_0), raw_dtype=QT.Q4_0)
    writer.add_tensor("output_norm.weight", np.ones(96, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized(blocks: GgufBlocks, index: int) -> np.ndarray:
    """What transformers loads for a tensor of the file: gguf-py's dequantisation."""
    blocks.find(torch.zeros(8, 96))  # reads the file
    kind, raw = blocks.tensors[index]
    return dequantize(raw, QT[kind]).astype(np.float32)


@pytest.mark.parametrize("index", [0, 1, 2], ids=["q4_1", "q8_0", "q4_0"])
def test_blocks_give_simd_s_bits_on_the_dequantised_weight_at_every_row_count(gguf_file, index):
    blocks = GgufBlocks(gguf_file)
    w = dequantized(blocks, index)
    quant = blocks.find(torch.from_numpy(w))
    assert quant.kind == ("Q4_1", "Q8_0", "Q4_0")[index] and quant.nbytes < w.nbytes / 3
    assert np.array_equal(quant.dequantized().view(np.uint32), w.view(np.uint32))  # gguf-py's bits, zeros' signs too
    padded = gemm_simd.pad_weight(w)
    rng = np.random.default_rng(2)
    for rows in ROWS:
        x = rng.standard_normal((rows, w.shape[1])).astype(np.float32)
        got = gemm_gguf.gemm(x, quant, 2)[:, :len(w)]
        assert np.array_equal(got, gemm_simd.gemm(x, padded, 2)[:, :len(w)]), rows
        assert np.allclose(got, x @ w.T, rtol=1e-4, atol=1e-3)
    one = gemm_gguf.gemm(x[:1], quant, 1)  # one thread, one row: the same bits as the batch's first row
    assert np.array_equal(one, gemm_gguf.gemm(x, quant, 2)[:1])


@pytest.mark.parametrize("index", [0, 1, 2], ids=["q4_1", "q8_0", "q4_0"])
def test_every_layout_gives_the_same_bits(gguf_file, index):
    """Every kernel layout this CPU can run computes simd's bits: by table
    (AVX-512 only), wide (multiply-add, four outputs at a time) and narrow
    (AVX2's 16 registers: one or two outputs at a time). The
    one this CPU's gemm takes is tested above; this checks the others too."""
    blocks = GgufBlocks(gguf_file)
    w = dequantized(blocks, index)
    quant = blocks.find(torch.from_numpy(w))
    assert set(gemm_gguf.RUNNABLE) == ({"table", "wide", "narrow"} if has_permute() else {"wide", "narrow"})
    padded = gemm_simd.pad_weight(w)
    rng = np.random.default_rng(3)
    for rows in range(1, 14):  # every tail: three, two, one, three and one, three and two
        x = rng.standard_normal((rows, w.shape[1])).astype(np.float32)
        want = gemm_simd.gemm(x, padded, 2)[:, :len(w)]
        for layout in gemm_gguf.RUNNABLE:
            for chunks in (1, 2):
                out = np.empty((rows, quant.d.shape[0]), np.float32)
                gemm_gguf.LAYOUTS[layout][quant.kind](x, quant.qs, quant.d, quant.m, out, chunks)
                assert np.array_equal(out[:, :len(w)], want), (layout, rows, chunks)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_0"])
def test_many_rows_run_from_a_scratch_of_dequantised_weights_with_simd_s_bits(tmp_path, kind):
    """From SCRATCH_ROWS rows in groups of six the narrow layout dequantises
    each block of outputs once and runs the groups from that scratch, each
    half of a sum in a pass of its own, the inputs SCRATCH_K at a time
    (``_scratch_groups``): simd's bits at any row count and tail, over
    inputs that span several of those chunks and end inside one."""
    width = 2 * gemm_gguf.SCRATCH_K + 3 * gemm_gguf.BLOCK  # three chunks, the last of 96 inputs
    path = tmp_path / "wide.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", quantize(values(24, width, 5), QT[kind]), raw_dtype=QT[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    blocks = GgufBlocks(path)
    blocks.find(torch.zeros(8, width))  # reads the file
    w = dequantize(blocks.tensors[0][1], QT[kind]).astype(np.float32)
    quant = blocks.find(torch.from_numpy(w))
    padded = gemm_simd.pad_weight(w)
    rng = np.random.default_rng(6)
    for rows in (gemm_gguf.SCRATCH_ROWS - 1, gemm_gguf.SCRATCH_ROWS, 13, 17, 18, 31):
        x = rng.standard_normal((rows, width)).astype(np.float32)
        want = gemm_simd.gemm(x, padded, 2)[:, :len(w)]
        for chunks in (1, 2):
            out = np.empty((rows, quant.d.shape[0]), np.float32)
            gemm_gguf.LAYOUTS["narrow"][kind](x, quant.qs, quant.d, quant.m, out, chunks)
            assert np.array_equal(out[:, :len(w)], want), (rows, chunks)


@pytest.fixture
def row_layouts():
    """Restores the process-wide layouts a test changes."""
    saved = dict(gemm_gguf.ROW_LAYOUTS)
    yield gemm_gguf.ROW_LAYOUTS
    gemm_gguf.ROW_LAYOUTS.update(saved)


def test_groups_and_rows_left_by_different_layouts_give_the_same_bits(gguf_file, row_layouts):
    """gemm() runs the groups of six and the rows left over by the layouts
    chosen for each (two launches where they differ): simd's bits whatever
    the combination."""
    blocks = GgufBlocks(gguf_file)
    rng = np.random.default_rng(4)
    for index in (0, 1, 2):
        w = dequantized(blocks, index)
        quant = blocks.find(torch.from_numpy(w))
        padded = gemm_simd.pad_weight(w)
        for groups in gemm_gguf.RUNNABLE:
            for left, two in itertools.product(gemm_gguf.RUNNABLE, repeat=2):
                gemm_gguf.use_layouts({6: groups, 1: left, 3: left, 2: two, 4: two, 5: left})
                for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 17, 20):
                    x = rng.standard_normal((rows, w.shape[1])).astype(np.float32)
                    got = gemm_gguf.gemm(x, quant, 2)[:, :len(w)]
                    assert np.array_equal(got, gemm_simd.gemm(x, padded, 2)[:, :len(w)]), (index, groups, left, rows)


def test_rows_left_after_the_groups_run_as_one_launch_of_their_count_without_zero_rows(row_layouts):
    """The rows after the groups of six (one to five) are one launch of the
    layout chosen for their count (no kernel runs zero rows); parts of one
    layout are one launch."""
    other = next(n for n in gemm_gguf.RUNNABLE if n != gemm_gguf.LAYOUT)
    gemm_gguf.use_layouts(dict.fromkeys(gemm_gguf.LAYOUT_ROWS, gemm_gguf.LAYOUT))
    assert gemm_gguf.pieces(11) == [(0, 11, gemm_gguf.LAYOUT)]
    assert gemm_gguf.pieces(4) == [(0, 4, gemm_gguf.LAYOUT)]
    gemm_gguf.use_layouts({2: other, 5: other})
    assert gemm_gguf.pieces(2) == [(0, 2, other)]
    assert gemm_gguf.pieces(4) == [(0, 4, gemm_gguf.LAYOUT)]
    assert gemm_gguf.pieces(11) == [(0, 6, gemm_gguf.LAYOUT), (6, 11, other)]
    assert gemm_gguf.pieces(8) == [(0, 6, gemm_gguf.LAYOUT), (6, 8, other)]
    gemm_gguf.use_layouts({4: other})
    assert gemm_gguf.pieces(16) == [(0, 12, gemm_gguf.LAYOUT), (12, 16, other)]
    assert gemm_gguf.pieces(6) == [(0, 6, gemm_gguf.LAYOUT)]
    assert [sum(hi - lo for lo, hi, _ in gemm_gguf.pieces(n)) for n in range(20)] == list(range(20))


def test_the_fastest_layout_is_chosen_per_row_count_and_a_tie_keeps_the_cpu_s_default(row_layouts):
    other = next(n for n in gemm_gguf.LAYOUTS if n != gemm_gguf.LAYOUT)
    ms = {gemm_gguf.LAYOUT: {1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0, 5: 10.0, 6: 10.0},
          other: {1: 5.0, 2: 11.0, 3: 9.9, 4: 8.0, 5: 10.5, 6: 20.0}}
    assert gemm_gguf.choose_layouts(ms) == {1: other, 2: gemm_gguf.LAYOUT, 3: gemm_gguf.LAYOUT, 4: other,
                                            5: gemm_gguf.LAYOUT, 6: gemm_gguf.LAYOUT}
    with pytest.raises(ValueError, match="layouts this CPU runs"):
        gemm_gguf.use_layouts({1: "sideways"})
    with pytest.raises(ValueError, match="row counts are"):
        gemm_gguf.use_layouts({7: gemm_gguf.LAYOUT})
    if not has_permute():
        with pytest.raises(ValueError, match="'table'"):
            gemm_gguf.use_layouts({1: "table"})


def test_fused_permuted_sliced_and_zero_padded_rows_are_found(gguf_file):
    blocks = GgufBlocks(gguf_file)
    up, embd = dequantized(blocks, 0), dequantized(blocks, 1)
    # transformers permutes q/k rows; the engine fuses projections and pads with zero rows
    fused = np.concatenate([up[::-1], up[:5], np.zeros((3, 96), np.float32)])
    quant = blocks.find(torch.from_numpy(fused))
    assert quant.out_features == len(fused) and quant.d.shape[0] % gemm_gguf.OUT_BLOCK == 0
    assert np.array_equal(quant.dequantized(), fused)
    x = np.random.default_rng(3).standard_normal((6, 96)).astype(np.float32)
    assert np.array_equal(gemm_gguf.gemm(x, quant, 2)[:, :len(fused)],
                          gemm_simd.gemm(x, gemm_simd.pad_weight(fused), 2)[:, :len(fused)])
    assert np.array_equal(blocks.find(torch.from_numpy(embd[3:11])).dequantized(), embd[3:11])  # a slice


def test_the_tensor_table_is_read_as_gguf_reads_it(gguf_file, smollm_path):
    from gguf import GGUFReader

    from specdec.engine.checkpoint import gguf_file_of

    for path in (gguf_file, gguf_file_of(smollm_path)):
        theirs = [(t.name, t.tensor_type.name, np.asarray(t.data)) for t in GGUFReader(str(path)).tensors
                  if t.tensor_type.name in gemm_gguf.KINDS]
        mine = gemm_gguf.quantized_tensors(path)
        assert [(n, k) for n, k, _ in mine] == [(n, k) for n, k, _ in theirs] and len(mine) >= 2
        assert all(np.array_equal(a, b) for (_, _, a), (_, _, b) in zip(mine, theirs))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gemm_gguf.quantized_tensors(__file__)


def test_weights_that_are_not_the_file_s_blocks_are_refused_with_the_reason(gguf_file):
    blocks = GgufBlocks(gguf_file)
    up, embd = dequantized(blocks, 0), dequantized(blocks, 1)
    changed = up.copy()
    changed[7, 50] = np.nextafter(changed[7, 50], np.float32(np.inf))  # one bit off
    with pytest.raises(NoBlocks, match=r"row 7 of a weight \(40, 96\) is not a Q4_1 or Q8_0 row of tiny.gguf"):
        blocks.find(torch.from_numpy(changed))
    with pytest.raises(NoBlocks, match="mixes quantisations"):
        blocks.find(torch.from_numpy(np.concatenate([up[:2], embd[:2]])))
    with pytest.raises(NoBlocks, match="float32 weights"):
        blocks.find(torch.from_numpy(up).to(torch.bfloat16))
    with pytest.raises(NoBlocks, match="whole 32-value blocks"):
        blocks.find(torch.zeros(4, 40))


def test_simd_gguf_is_refused_by_name_for_weights_from_no_gguf_file(tmp_path, monkeypatch):
    from specdec.engine import gemm_select

    monkeypatch.setenv(gemm_select.CACHE_ENV, str(tmp_path))
    w = [("up", torch.randn(16, 64), None)]
    with pytest.raises(gemm_select.GemmRefused, match=r"gemm='simd-gguf' cannot run for this model: "
                                                      r"not available for these weights"):
        gemm_select.select(w, torch.float32, 1, "simd-gguf", max_rows=32)
    chosen = gemm_select.select(w, torch.float32, 1, "auto", max_rows=32)
    assert chosen.path.name != "simd-gguf"
    assert chosen.report["paths"]["simd-gguf"]["failure"].startswith(gemm_select.UNAVAILABLE)


def test_simd_gguf_is_selected_checked_and_keyed_by_its_file(gguf_file, tmp_path, monkeypatch, row_layouts):
    from specdec.engine import gemm_select

    monkeypatch.setenv(gemm_select.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(gemm_select, "machine_busy", lambda: False)  # timings cached whatever else runs
    blocks = GgufBlocks(gguf_file)
    w = [("up", torch.from_numpy(dequantized(blocks, 0)), None), ("lm_head", torch.from_numpy(dequantized(blocks, 1)),
                                                                  None)]
    forced = gemm_select.select(w, torch.float32, 1, "simd-gguf", max_rows=64, quantized=blocks)
    assert forced.path.name == "simd-gguf" and forced.report["paths"]["simd-gguf"]["failure"] is None
    assert forced.report["key"]["gguf"] == blocks.identity()
    assert forced.linears[0].nbytes == blocks.find(w[0][1]).nbytes < w[0][1].nbytes / 3  # what a pass reads
    x = torch.randn(3, 96)
    assert torch.equal(forced.linears[0](x), gemm_select.Linear(w[0][1], None, gemm_select.GEMM_PATHS["simd"])(x))
    # its kernel layouts timed on these weights, chosen per row count, used, and cached with the verdicts
    layouts = forced.report["gguf_layouts"]
    assert set(layouts["ms"]) == set(gemm_gguf.RUNNABLE)
    assert set(layouts["choice"]) == {str(n) for n in gemm_gguf.LAYOUT_ROWS} == {"1", "2", "3", "4", "5", "6"}
    assert all(t > 0 for times in layouts["ms"].values() for t in times.values())
    assert gemm_gguf.ROW_LAYOUTS == {int(n): name for n, name in layouts["choice"].items()}
    monkeypatch.setattr(gemm_gguf, "time_layouts", lambda *a, **k: pytest.fail("timed again"))
    again = gemm_select.select(w, torch.float32, 1, "simd-gguf", max_rows=64, quantized=blocks)
    assert again.report["gguf_layouts"] == layouts
    # a cache timed before a row count had its own kernel (no "2") is timed again
    cache = next(tmp_path.rglob("*.json"))
    stale = json.loads(cache.read_text())
    for times in stale["gguf_layouts"]["ms"].values():
        del times["2"]
    del stale["gguf_layouts"]["choice"]["2"]
    cache.write_text(json.dumps(stale))
    monkeypatch.setattr(gemm_gguf, "time_layouts", lambda *a, **k: {n: dict.fromkeys(gemm_gguf.LAYOUT_ROWS, 1.0)
                                                                     for n in gemm_gguf.RUNNABLE})
    timed = gemm_select.select(w, torch.float32, 1, "simd-gguf", max_rows=64, quantized=blocks)
    assert set(timed.report["gguf_layouts"]["choice"]) == {str(n) for n in gemm_gguf.LAYOUT_ROWS}


def test_weights_the_file_holds_in_other_types_read_their_float32_values_and_a_file_holding_none_is_refused(
        gguf_file, tmp_path, monkeypatch):
    """A GGUF file often keeps some tensors in a type the path does not read
    (F16, K-quants: llama.cpp's Q4_0 files keep the output in Q6_K): those
    weights go through simd-l1 on their float32 values, the same bits, and
    the others through their blocks."""
    from specdec.engine import gemm_select

    monkeypatch.setenv(gemm_select.CACHE_ENV, str(tmp_path))
    blocks = GgufBlocks(gguf_file)
    other = torch.randn(24, 96)  # not in the file
    w = [("up", torch.from_numpy(dequantized(blocks, 0)), None), ("down", other, None)]
    chosen = gemm_select.select(w, torch.float32, 1, "simd-gguf", max_rows=64, quantized=blocks)
    assert chosen.linears[0].nbytes < w[0][1].nbytes / 3 and chosen.linears[1].nbytes == other.nbytes
    x = torch.randn(5, 96)
    simd = gemm_select.GEMM_PATHS["simd"]
    for linear, (_, weight, _) in zip(chosen.linears, w):
        assert torch.equal(linear(x), gemm_select.Linear(weight, None, simd)(x))
    with pytest.raises(gemm_select.GemmRefused, match="tiny.gguf holds none of these weights"):
        gemm_select.select([("down", other, None)], torch.float32, 1, "simd-gguf", max_rows=64, quantized=blocks)


def test_a_checkpoint_knows_the_gguf_file_its_weights_came_from(smollm_path, stories_path):
    from specdec.engine.checkpoint import gguf_file_of

    gguf = gguf_file_of(smollm_path)
    assert gguf is not None and gguf.endswith(".gguf") and gguf_file_of(gguf) == gguf  # a directory or the file
    assert gguf_file_of(stories_path) is None and gguf_file_of("no/such-model") is None  # not a GGUF: none


def _numpy_dequantized(kind: str, qs: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """gguf-py's formulas written out in numpy (float32, product then sum)."""
    n = len(d)
    scale = np.repeat(d, gemm_gguf.BLOCK, axis=1)
    if kind == "Q8_0":
        return qs.astype(np.float32) * scale
    b = qs.reshape(n, -1, 16)
    q = np.concatenate([b & 15, b >> 4], axis=2).reshape(n, -1).astype(np.float32)
    if kind == "Q4_0":
        return scale * (q - np.float32(8))
    return scale * q + np.repeat(m, gemm_gguf.BLOCK, axis=1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_dequantising_kernels_give_the_formulas_bits_and_find_a_changed_bit(kind):
    """``_dequantize`` (what ``find`` checks a weight against), the keys of
    dequantised blocks and ``_first_difference``, on random blocks with
    negative, zero and negative-zero scales (the signs of zeros count)."""
    rng = np.random.default_rng(5)
    rows, nb = 37, 5
    d = rng.standard_normal((rows, nb)).astype(np.float16).astype(np.float32)
    d[0, 0], d[1, 1], d[2, :] = 0.0, -0.0, -1.5
    m = rng.standard_normal((rows, nb)).astype(np.float16).astype(np.float32) if kind == "Q4_1" else \
        np.zeros((1, 1), np.float32)
    if kind == "Q4_1":
        m[3, 2] = -0.0
    qs = rng.integers(0, 256, (rows, nb * (32 if kind == "Q8_0" else 16)), dtype=np.uint8)
    if kind == "Q8_0":
        qs = qs.view(np.int8)
    want = _numpy_dequantized(kind, qs, d, m)
    assert np.signbit(want).any() and (want == 0).any()
    quant = gemm_gguf.QuantWeight(kind, qs, d, m, rows)
    got = quant.dequantized()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    code = gemm_gguf.KIND_CODES[kind]
    changed, later = want.copy(), want.copy()
    changed[29, 77] = -changed[29, 77] if changed[29, 77] else np.float32(1.0)
    later[35, 3] = np.nextafter(later[35, 3], np.float32(np.inf))
    changed[35] = later[35]
    salt = GgufBlocks("unread.gguf")._salt  # the index's salt (the file is read on the first lookup only)
    for chunks in (1, 3, rows + 2):  # the rows' ranges on the threads: the same answers at any split
        assert gemm_gguf._first_difference(code, qs, d, m, want, chunks) == -1
        assert gemm_gguf._first_difference(code, qs, d, m, changed, chunks) == 29  # the first, not 35
        assert gemm_gguf._first_difference(code, qs, d, m, later, chunks) == 35
        keys = np.empty((rows, 2), np.uint64)
        gemm_gguf._keys_of_blocks(code, qs, d, m, salt, keys, chunks)
        assert np.array_equal(keys, gemm_gguf._row_keys(want, salt))
        assert not np.array_equal(keys[29], gemm_gguf._row_keys(changed, salt)[29])


def test_a_lookup_takes_a_keys_first_row_in_file_order_where_first_halves_collide():
    """``_locate`` on an index whose keys share first halves (identical rows,
    or a 64-bit collision of the first sums): the row whose whole key
    matches, the first in file order among equal keys, and none for a key
    the index lacks."""
    blocks = GgufBlocks("unread.gguf")
    blocks._index = (np.array([1, 5, 5, 5, 9], np.uint64), np.array([0, 2, 7, 7, 1], np.uint64),
                     np.array([0, 1, 2, 3, 4]), np.array([10, 11, 12, 13, 14]))
    keys = np.array([[5, 7], [5, 2], [5, 3], [9, 1], [4, 0], [10, 0], [1, 0]], np.uint64)
    tensor, row = blocks._locate(keys)
    assert tensor.tolist() == [2, 1, -1, 4, -1, -1, 0]
    assert row[tensor >= 0].tolist() == [12, 11, 14, 10]
    blocks._index = tuple(np.empty(0, dt) for dt in (np.uint64, np.uint64, np.int64, np.int64))
    assert blocks._locate(keys)[0].tolist() == [-1] * len(keys)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantize_gives_gguf_s_blocks_and_the_gemm_computes_with_their_values(kind):
    """``quantize`` (a feature head's projections at load): the blocks
    dequantise to what gguf-py dequantises its own quantisation of the weight
    to (llama.cpp's reference), within half a quantisation step of the
    weight; out padded to OUT_BLOCK with zero rows; the simd-gguf GEMM on them
    gives simd's bits on those values at every row count."""
    w = values(21, 96, 7)  # 21 outputs: padded to 24
    q = gemm_gguf.quantize(w, kind)
    want = dequantize(quantize(w, QT[kind]), QT[kind]).astype(np.float32)
    np.testing.assert_array_equal(q.dequantized(), want)
    assert q.out_features == 21 and q.d.shape == (24, 3) and not q.d[21:].any()
    step = np.repeat(np.abs(q.d[:21]), gemm_gguf.BLOCK, axis=1)
    assert (np.abs(want - w) <= step * (0.5 if kind == "Q8_0" else 1.0) + 1e-3 * np.abs(w)).all()
    padded = gemm_simd.pad_weight(want)
    for rows in ROWS:
        x = np.random.default_rng(rows).standard_normal((rows, 96)).astype(np.float32)
        np.testing.assert_array_equal(gemm_gguf.gemm(x, q, 2)[:, :21], gemm_simd.gemm(x, padded, 2)[:, :21])


def test_quantize_refuses_what_it_cannot_block_naming_why():
    with pytest.raises(ValueError, match="one of Q4_0, Q4_1, Q8_0, not 'Q5_K'"):
        gemm_gguf.quantize(np.zeros((8, 32), np.float32), "Q5_K")
    with pytest.raises(ValueError, match="whole 32-value blocks"):
        gemm_gguf.quantize(np.zeros((8, 40), np.float32), "Q8_0")
