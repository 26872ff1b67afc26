"""The Llama engine on its GPU kernels (engine.gpu_ops, engine.cuda_graph).

Here (no GPU) the Triton kernels run on CPU tensors under TRITON_INTERPRET=1,
float32 only (the interpreter mis-reads bfloat16 loads). On a machine with
CUDA, ``TRITON_INTERPRET=0 pytest tests/test_gpu_engine.py`` runs the same
tests on the GPU, compiled, in float32 and bfloat16, plus the CUDA-graph
tests: the kernels against torch, transformers' logits and greedy tokens,
and the invariance that keeps speculation lossless (decoding token by token
and verifying 6- or 17-row chunks give bitwise equal logits)."""
from __future__ import annotations

import asyncio
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before specdec.engine.gpu_ops defines any @triton.jit

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import hf_greedy, hf_model, random_model
from test_llama_engine import STORY, check_invariance, engine_of, feed, greedy, hf_logits

from specdec.engine import gpu_ops
from specdec.engine.base import ForwardItem
from specdec.engine.cuda_graph import MAX_ROWS, ForwardGraphs, bucket, graph_keys
from specdec.engine.kv_pool import KVPool
from specdec.engine.llama import LlamaEngine, apply_rope, rms_norm, rope_inv_freq, rope_tables

INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
DTYPES = ["float32"] if INTERPRETED else ["float32", "bfloat16"]
cuda_only = pytest.mark.skipif(INTERPRETED, reason="CUDA graphs need a CUDA device")
#: whole decodes through the interpreter take a minute each: selected with -m slow here, always on a GPU
slow_here = pytest.mark.slow if INTERPRETED else (lambda test: test)


def gpu_engine(model, dtype: str = "float32", **kwargs) -> LlamaEngine:
    return engine_of(model, dtype, device=DEVICE, gemm="auto" if DEVICE == "cuda" else "triton",
                     attention="triton", **kwargs)


class StepsAsGraphs(ForwardGraphs):
    """ForwardGraphs whose "graph" is the captured step itself, run again at
    each replay: everything of the graph path but the CUDA capture (static
    buffers, padding rows, keys, the shared logits and features buffers) runs
    here, on CPU under the interpreter."""

    def _record(self, step):
        return step


def graph_engine(model, dtype: str = "float32", **kwargs) -> LlamaEngine:
    """gpu_engine with its forward passes of up to MAX_ROWS tokens through
    graphs: CUDA graphs on a GPU, StepsAsGraphs here."""
    engine = gpu_engine(model, dtype, **kwargs)
    if INTERPRETED:
        engine.graphs = StepsAsGraphs(engine)
    assert engine.graphs is not None
    return engine


@pytest.fixture(scope="module")
def stories(stories_path):
    model, tok = hf_model(stories_path)
    return model, list(tok(STORY)["input_ids"])


# ---- the kernels ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_and_rms_norm_match_torch_and_rows_never_depend_on_the_row_count(dtype):
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    x = torch.randn(40, 200, generator=gen).to(DEVICE, dt)
    w = torch.randn(130, 200, generator=gen).to(DEVICE, dt)
    b = torch.randn(130, generator=gen).to(DEVICE, dt)
    y = gpu_ops.linear(x, w, b, out_dtype=torch.float32)
    expected = F.linear(x.double(), w.double(), b.double())
    assert torch.allclose(y.double(), expected, rtol=1e-2 if dtype == "bfloat16" else 1e-5, atol=1e-3)
    for n in (1, 2, 6, 17, 40):  # every row as computed alone, bit for bit
        alone = torch.cat([gpu_ops.linear(x[i:i + 1], w, b, out_dtype=torch.float32) for i in range(n)])
        assert torch.equal(gpu_ops.linear(x[:n], w, b, out_dtype=torch.float32), alone), n
    norm_w = torch.rand(200, generator=gen).to(DEVICE, dt) + 0.5
    normed = gpu_ops.rms_norm(x, norm_w, 1e-5)
    assert normed.dtype == dt
    tol = 1e-2 if dtype == "bfloat16" else 1e-5
    assert torch.allclose(normed.float(), rms_norm(x, norm_w, 1e-5).float(), rtol=tol, atol=tol)
    assert torch.equal(torch.cat([gpu_ops.rms_norm(x[i:i + 1], norm_w, 1e-5) for i in range(7)]), normed[:7])


def test_write_kv_puts_each_row_in_its_slot():
    pool = KVPool(1, 2, 8, 64, block_size=16, device=DEVICE)
    pool.ensure_capacity("a", 20)
    pool.ensure_capacity("b", 3)
    batch = pool.plan(["a", "b"], [20, 3])
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(23, 2, 8, generator=gen).to(DEVICE) for _ in range(2))
    rows = batch.rows(torch.device(DEVICE))
    gpu_ops.write_kv(k, v, pool.key_cache[0], pool.value_cache[0], rows.slot_block, rows.slot_offset)
    for t, (b, o) in enumerate(zip(batch.slot_block, batch.slot_offset)):
        assert torch.equal(pool.key_cache[0, b, :, :, o], k[t]) and torch.equal(pool.value_cache[0, b, :, o], v[t])
    assert int((pool.key_cache != 0).sum()) == k.numel()  # nothing else written


@pytest.mark.parametrize("window", [0, 7])
def test_paged_attention_matches_sdpa_and_rows_never_depend_on_the_batch(window):
    pool = KVPool(2, 2, 8, 256, block_size=16, device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    lengths = {"a": 37, "b": 5, "c": 16}
    for seq, n in lengths.items():
        pool.ensure_capacity(seq, n)
    batch = pool.plan(list(lengths), list(lengths.values()))
    T = sum(lengths.values())
    k, v = (torch.randn(T, 2, 8, generator=gen).to(DEVICE) for _ in range(2))
    pool.write(1, k, v, batch)
    q = torch.randn(T, 6, 8, generator=gen).to(DEVICE)
    out = pool.attend_triton(1, q, batch, window)
    assert torch.allclose(out, pool.attend_sdpa(1, q, batch, window), atol=1e-5)
    pool.commit(list(lengths), list(lengths.values()))
    # sequence a's last row, as a one-row decode of its own: the same bits
    pool.truncate("a", 36)
    alone = pool.plan(["a"], [1])
    assert torch.equal(pool.attend_triton(1, q[36:37], alone, window), out[36:37])


@pytest.mark.parametrize("rope", [True, False])
def test_rope_write_rotates_scales_and_writes_like_the_separate_steps(rope):
    """The fused RoPE + scale + KV write against apply_rope and write_kv."""
    H, Hkv, D, T = 6, 2, 8, 23
    gen = torch.Generator().manual_seed(4)
    cos, sin = (t.to(DEVICE) for t in rope_tables(rope_inv_freq({"rope_theta": 10000.0, "rope_type": "default"}, D),
                                                  64))
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen).to(DEVICE)
    fused, separate = (KVPool(1, Hkv, D, 64, block_size=16, device=DEVICE) for _ in range(2))
    for pool in (fused, separate):
        pool.ensure_capacity("a", 20)
        pool.ensure_capacity("b", 3)
    batch = fused.plan(["a", "b"], [20, 3])
    rows = batch.rows(torch.device(DEVICE))
    q = gpu_ops.rope_write(qkv, cos, sin, rows.row_pos, fused.key_cache[0], fused.value_cache[0], rows.slot_block,
                           rows.slot_offset, H, Hkv, D, 0.125, rope)
    heads = qkv.view(T, H + 2 * Hkv, D)
    qk = apply_rope(heads[:, :H + Hkv], cos[rows.row_pos.long()], sin[rows.row_pos.long()]) if rope \
        else heads[:, :H + Hkv]
    gpu_ops.write_kv(qk[:, H:].contiguous(), heads[:, H + Hkv:].contiguous(), separate.key_cache[0],
                     separate.value_cache[0], rows.slot_block, rows.slot_offset)
    assert torch.allclose(q, qk[:, :H] * 0.125, atol=1e-6)
    assert torch.allclose(fused.key_cache, separate.key_cache, atol=1e-6)
    assert torch.equal(fused.value_cache, separate.value_cache)


def test_silu_mul_and_add_rms_norm_match_the_torch_steps():
    gen = torch.Generator().manual_seed(5)
    gate_up = torch.randn(9, 2 * 300, generator=gen).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(gpu_ops.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6)
    h, delta = (torch.randn(9, 200, generator=gen).to(DEVICE) for _ in range(2))
    weight = torch.rand(200, generator=gen).to(DEVICE) + 0.5
    summed, normed = gpu_ops.add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(summed, h + delta)
    assert torch.allclose(normed, rms_norm(h + delta, weight, 1e-5), atol=1e-5)
    assert torch.equal(torch.cat([gpu_ops.add_rms_norm(h[i:i + 1], delta[i:i + 1], weight, 1e-5)[1]
                                  for i in range(9)]), normed)


# ---- the engine on stories260K (real) --------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_match_transformers(stories_path, stories, dtype):
    from transformers import AutoModelForCausalLM

    model, prompt = stories
    if INTERPRETED:  # 20 tokens still fill two KV blocks; the interpreted attention's time grows with rows x context
        prompt = prompt[:20]
    logits = feed(gpu_engine(model, dtype), [("s", prompt, len(prompt))])[0]
    assert logits.device.type == DEVICE and len(logits) == len(prompt)
    want = hf_logits(model, prompt)  # float32, CPU
    if dtype == "float32":
        assert (logits.cpu() - want).abs().max() < 2e-4
    else:  # no worse than transformers' own bfloat16
        hf_bf16 = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.bfloat16).eval()
        assert (logits.cpu() - want).abs().max() < 2 * (hf_logits(hf_bf16, prompt) - want).abs().max() + 0.05


@slow_here
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_count_invariance(stories, dtype):
    model, prompt = stories
    engine = gpu_engine(model, dtype)
    assert engine.gemm == "triton" and engine.attention == "triton"
    check_invariance(engine, prompt)


@slow_here
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_small_steps_give_the_separate_steps_logits(stories, dtype):
    """float32: the fused steps (the default) compute the separate steps'
    function; bfloat16: they round fewer intermediates to bfloat16 (RoPE and
    the scale in float32), so the bits differ, but they stand no further
    from the float32 logits than the separate steps do."""
    model, prompt = stories
    fused, separate = gpu_engine(model, dtype), gpu_engine(model, dtype, fuse_gpu_steps=False)
    assert fused.gpu_fused and not separate.gpu_fused
    got, want = (feed(engine, [("s", prompt, len(prompt))])[0] for engine in (fused, separate))
    if dtype == "float32":
        assert (got - want).abs().max() < 1e-4
    else:
        exact = feed(gpu_engine(model, "float32", fuse_gpu_steps=False), [("s", prompt, len(prompt))])[0]
        assert (got - exact).abs().mean() <= 1.25 * (want - exact).abs().mean()


@slow_here
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_count_invariance_with_separate_small_steps(stories, dtype):
    model, prompt = stories
    check_invariance(gpu_engine(model, dtype, fuse_gpu_steps=False), prompt)


@slow_here
def test_greedy_matches_transformers_generate(stories_path, stories):
    model, prompt = stories
    engine = gpu_engine(model)
    assert greedy(engine, "g", prompt, 24) == hf_greedy(stories_path, tuple(prompt), 24)
    if not INTERPRETED:
        assert engine.graphs is not None and (1, 1) in engine.graphs.captured()  # the decode steps ran as a graph


@slow_here
def test_the_scheduler_on_the_gpu_engine_gives_plain_greedy(stories_path):
    """The scorer's scheduler over the GPU engine: its logits stay on the
    device and the verification kernels run there; drafts right and wrong
    give transformers' greedy tokens."""
    from test_scheduler import greedy_with_drafts, prompt_ids  # gRPC modules: imported by this test only

    from specdec.scorer_svc.scheduler import Scheduler

    model, _ = hf_model(stories_path)
    prompt = prompt_ids(stories_path)
    expected = hf_greedy(stories_path, tuple(prompt), 16)
    oracle = lambda tokens: expected[len(tokens) - len(prompt):][:5]  # always right
    wrong = lambda tokens: [(t + 1) % 512 for t in oracle(tokens)]  # always wrong

    async def run():
        sched = Scheduler(gpu_engine(model), max_batch_size=8, max_tokens_per_forward=64)
        try:
            return (await greedy_with_drafts(sched, "r", prompt, 16, oracle),
                    await greedy_with_drafts(sched, "w", prompt, 16, wrong))
        finally:
            sched.stop()

    right, bad = asyncio.run(run())
    assert right == expected and bad == expected


def test_the_triton_paths_are_refused_on_cpu_without_the_interpreter(stories, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="run on CUDA"):
        engine_of(stories[0], gemm="triton")
    with pytest.raises(ValueError, match="run on CUDA"):
        engine_of(stories[0], attention="triton")


# ---- CUDA graphs and real shapes (GPU only) ------------------------------------------


@cuda_only
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_graphs_give_the_eager_logits_bitwise(stories, dtype, fused):
    """Prefills, three sequences decoding together (a graph padded to 4 rows,
    one of them padding), verification chunks of 6 rows and a ragged batch,
    against the same passes run eagerly."""
    model, prompt = stories
    graphs, eager = (gpu_engine(model, dtype, cuda_graphs=on, fuse_gpu_steps=fused) for on in (True, False))
    assert eager.graphs is None
    starts = {"a": prompt[:30], "b": prompt[:11], "c": prompt[:23]}
    got, want = (feed(engine, [(s, p, 1) for s, p in starts.items()]) for engine in (graphs, eager))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    nxt = {s: int(w[-1].argmax()) for s, w in zip(starts, want)}
    for _ in range(12):
        step = [(s, [t], 1) for s, t in nxt.items()]
        got, want = feed(graphs, step), feed(eager, step)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        nxt = {s: int(w[-1].argmax()) for s, w in zip(nxt, want)}
    one = [("a", [nxt["a"]], 1)]
    assert torch.equal(feed(graphs, one)[0], feed(eager, one)[0])
    chunk = [("b", prompt[11:17], 6)]  # a verification of 5 drafts: 6 rows, every row's logits
    assert torch.equal(feed(graphs, chunk)[0], feed(eager, chunk)[0])
    ragged = [("a", prompt[:3], 3), ("b", prompt[5:6], 1), ("c", prompt[1:10], 2)]  # 13 rows -> 16
    for g, w in zip(feed(graphs, ragged), feed(eager, ragged)):
        assert torch.equal(g, w)
    assert graphs.graphs.captured() == [(1, 1), (4, 4), (8, 1), (16, 4), (64, 4)]


@pytest.mark.parametrize("fused", [pytest.param(False, id="separate"),  # the fused kernels: slower interpreted
                                   pytest.param(True, id="fused", marks=pytest.mark.slow if INTERPRETED else ())])
@pytest.mark.parametrize("dtype", DTYPES)
def test_feature_graphs_give_the_eager_features_and_logits_bitwise(stories, dtype, fused):
    """Passes asking for feature layers (the scorer's EAGLE-3 / MTP rounds)
    replay graphs of their own: a prefill, decode steps of three sequences,
    a 6-row verification and a ragged batch give the eager pass's logits and
    every row's features bitwise; graphs with and without features share the
    logits buffer, so a plain pass between two feature passes must not leak
    into either; prepare captures the feature graphs it is told of. (Here
    through StepsAsGraphs, on a GPU through CUDA graphs.)"""
    model, prompt = stories
    layers = (1, 3, 5)  # a low, a middle and the last layer's output, as EAGLE-3 asks

    def both(engine, items):
        for seq, tokens, _ in items:
            engine.ensure_capacity(seq, engine.cached_len(seq) + len(tokens))
        out = engine.forward([ForwardItem(seq, np.asarray(tokens, np.int32), k) for seq, tokens, k in items],
                             feature_layers=layers)
        return out.logits, out.features

    graphs, eager = graph_engine(model, dtype, fuse_gpu_steps=fused), gpu_engine(model, dtype, cuda_graphs=False,
                                                                                  fuse_gpu_steps=fused)
    assert eager.graphs is None
    # 26 prompt rows replay the 32-row graph on a GPU; under the interpreter 14 rows, the 16-row graph
    # (its attention runs a program per padded row: the 32-row prefill took a third of the test's 2 minutes)
    lengths = (6, 3, 5) if INTERPRETED else (12, 5, 9)
    starts = {s: prompt[:n] for s, n in zip("abc", lengths)}
    prefill = [(s, p, 1) for s, p in starts.items()]
    got, want = [both(graphs, prefill)], [both(eager, prefill)]
    nxt = {s: int(w.argmax()) for s, w in zip(starts, want[0][0])}
    for _ in range(2 if INTERPRETED else 6):
        step = [(s, [t], 1) for s, t in nxt.items()]
        got.append(both(graphs, step))
        want.append(both(eager, step))
        nxt = {s: int(w.argmax()) for s, w in zip(nxt, want[-1][0])}
    plain = [("c", [nxt["c"]], 1)]
    plain_got, plain_want = feed(graphs, plain)[0], feed(eager, plain)[0]
    for items in ([("b", prompt[5:11], 6)], [("a", prompt[:3], 3), ("b", prompt[5:6], 1), ("c", prompt[1:10], 2)]):
        got.append(both(graphs, items))
        want.append(both(eager, items))
    assert torch.equal(plain_got, plain_want)
    for (g_logits, g_feats), (w_logits, w_feats) in zip(got, want):  # all kept until the end: none overwritten
        assert torch.equal(g_logits, w_logits)
        assert g_feats.dtype == w_feats.dtype == graphs.dtype and g_feats.shape == w_feats.shape
        assert torch.equal(g_feats, w_feats)
    assert got[-1][1].shape == (3 + 1 + 9, 3 * 64)
    assert graphs.graphs.captured(layers) == [(4, 4), (8, 1), (16, 4)] + ([] if INTERPRETED else [(32, 4)])
    assert graphs.graphs.captured() == [(1, 1)]  # the plain pass
    fresh = graph_engine(model, dtype, fuse_gpu_steps=fused)
    fresh.prepare(2, 4, feature_layers=layers)
    assert fresh.graphs.captured(layers) == sorted(graph_keys(2, 4)) and fresh.graphs.captured() == []


@cuda_only
def test_the_garbage_collector_waits_while_a_graph_is_captured(stories):
    """An engine and its graphs form a reference cycle, freed whenever the
    garbage collector runs; destroying a graph while another is captured
    invalidates that capture (seen on an H100). So the collector is off
    during every capture, and on again after it."""
    import gc

    model, prompt = stories
    engine = gpu_engine(model)
    seen = []  # (capturing, collector on) at each pass through the model
    final_rows = engine._final_rows

    def spy(*args, **kwargs):
        seen.append((torch.cuda.is_current_stream_capturing(), gc.isenabled()))
        return final_rows(*args, **kwargs)

    engine._final_rows = spy
    assert gc.isenabled()
    feed(engine, [("a", prompt[:5], 1)])
    assert engine.graphs.captured() == [(8, 1)]
    assert (True, False) in seen and (True, True) not in seen  # the warm-up runs it too, uncaptured
    assert gc.isenabled()


@pytest.mark.parametrize("max_seqs,max_tokens", [(1, 1), (3, 6), (8, 64), (256, 512), (300, 4096)])
def test_graph_keys_are_exactly_the_shapes_batches_can_take(max_seqs, max_tokens):
    """Every batch of B <= max_seqs sequences and T <= max_tokens new tokens
    (B <= T, T <= MAX_ROWS: the graphed ones) pads to one of the keys, and
    every key is the padding of some such batch."""
    reachable = {(bucket(T), bucket(B)) for T in range(1, min(max_tokens, MAX_ROWS) + 1)
                 for B in range(1, min(T, max_seqs) + 1)}
    keys = graph_keys(max_seqs, max_tokens)
    assert len(keys) == len(set(keys)) and set(keys) == reachable


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_prepare_captures_every_graph_before_the_first_pass(stories, dtype):
    """After prepare (the scorer's start-up) no pass captures; every graph
    writes its logits into one shared buffer, so a pass's result must stay
    its own after later passes overwrite that buffer."""
    model, prompt = stories
    graphs, eager = (gpu_engine(model, dtype, cuda_graphs=on) for on in (True, False))
    graphs.prepare(4, 32)
    keys = graphs.graphs.captured()
    assert keys == sorted(graph_keys(4, 32)) and (32, 4) in keys
    passes = [[("a", prompt[:20], 2)], [("b", prompt[:7], 7), ("c", prompt[:3], 1)], [("a", prompt[20:21], 1)],
              [("a", prompt[21:27], 6), ("b", prompt[7:8], 1), ("c", prompt[3:9], 6), ("d", prompt[:11], 1)]]
    got = [feed(graphs, items) for items in passes]  # all kept until the end
    want = [feed(eager, items) for items in passes]
    for g_pass, w_pass in zip(got, want):
        for g, w in zip(g_pass, w_pass):
            assert torch.equal(g, w)
    assert graphs.graphs.captured() == keys


@cuda_only
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_count_invariance_at_smollm2_shapes(dtype, fused):
    """SmolLM2-135M's widths (hidden 576, 9 / 3 heads, FFN 1536, vocab 49152;
    4 of its 30 layers, random weights): the GEMM tiles and the LM head at the
    real sizes, where cuBLAS would pick kernels by the row count."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    model = random_model(config)
    prompt = torch.randint(0, 49152, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    check_invariance(gpu_engine(model, dtype, fuse_gpu_steps=fused), prompt)
