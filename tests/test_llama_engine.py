"""LlamaEngine: logits and greedy tokens against transformers on the real
models, ragged batches, rollback, chunked prefill, pool exhaustion, the row
invariance that keeps speculation lossless, the architecture variants (on
small random models) and the build_engine factory."""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import hf_greedy, hf_layer_states, hf_model, random_model

from specdec.engine import gguf_layers
from specdec.engine.base import ForwardItem, PoolExhausted
from specdec.engine.checkpoint import gguf_file_of
from specdec.engine.config import EngineConfig
from specdec.engine.factory import build_engine
from specdec.engine.gemm_select import GEMM_PATHS, UNAVAILABLE, UNSUPPORTED, GemmRefused
from specdec.engine.kv_pool import default_num_threads
from specdec.engine.llama import Checkpoint, LlamaEngine, unsupported_reason

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside with her dog. One day"
CHAT = ("The scorer verifies the guesses of many sequences in one batched forward pass, so speculation "
        "pays only when checking several tokens costs about as much as one. In short,")


def as_ids(tokens) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def feed(engine, items: list[tuple[str, list[int], int]]) -> list[torch.Tensor]:
    """One forward over (seq_id, new tokens, num_logits) items after ensuring
    capacity; returns each item's logits rows."""
    for seq, tokens, _ in items:
        engine.ensure_capacity(seq, engine.cached_len(seq) + len(tokens))
    out = engine.forward([ForwardItem(seq, as_ids(tokens), k) for seq, tokens, k in items])
    return list(out.logits.split([k for _, _, k in items]))


def greedy(engine, seq: str, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding: prefill, then one token per forward."""
    out = []
    logits = feed(engine, [(seq, prompt, 1)])[0]
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = feed(engine, [(seq, [out[-1]], 1)])[0]
    return out


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def engine_of(model, dtype: str = "float32", gguf: str | None = None, **kwargs) -> LlamaEngine:
    """gguf: the GGUF file the model was loaded from (gemm "simd-gguf" reads its blocks)."""
    kwargs.setdefault("kv_capacity_tokens", 2048)
    return LlamaEngine(Checkpoint.of_model(model, "test-model", gguf=gguf), dtype, **kwargs)


def check_invariance(engine, prompt: list[int]):
    """Plain decoding (one row per forward) and verification of the same
    tokens as a 6-row or 17-row chunk, alone or next to another sequence's
    chunk, give bitwise identical logits."""
    prefix, chunk = prompt[:-17], prompt[-17:]
    feed(engine, [("plain", prefix, 0)])
    plain = torch.cat([feed(engine, [("plain", [t], 1)])[0] for t in chunk])  # [17, vocab]
    for n in (6, 17):
        feed(engine, [(f"verify{n}", prefix, 0)])
        assert torch.equal(feed(engine, [(f"verify{n}", chunk[:n], n)])[0], plain[:n])
    feed(engine, [("other", prompt[:9], 0), ("mixed", prefix, 0)])
    mixed = feed(engine, [("other", prompt[9:26], 17), ("mixed", chunk[:6], 6)])[1]
    assert torch.equal(mixed, plain[:6])


def engine_or_refusal(model, dtype: str, gemm: str, auto: Callable[[], LlamaEngine],
                      gguf: str | None = None) -> LlamaEngine | None:
    """The engine on a forced GEMM path, or None when this machine's check
    rejects the path: then the refusal names the shape and row count that
    broke invariance (or why the CPU or the weights cannot take the path),
    and auto() (the "auto" engine of the same model) records the same
    verdict and never chose the path."""
    try:
        return engine_of(model, dtype, gguf=gguf, gemm=gemm)
    except GemmRefused as e:
        assert gemm != "auto", f"no GEMM path keeps row-count invariance on this machine: {e}"
        unsupported = f"gemm={gemm!r} cannot run on this CPU" in str(e) and UNSUPPORTED in str(e)
        unavailable = f"gemm={gemm!r} cannot run for this model" in str(e) and UNAVAILABLE in str(e)
        if unavailable:  # only simd-gguf, for weights that are not a GGUF file's blocks (or not float32)
            assert gemm == "simd-gguf" and (gguf is None or dtype != "float32"), str(e)
            return None
        assert unsupported or (f"gemm={gemm!r} breaks row-count invariance" in str(e)
                               and "-row input differs" in str(e))
        chosen = auto()
        assert chosen.gemm != gemm and chosen.gemm_report["paths"][gemm]["failure"] in str(e)
        return None


# ---- stories260K (tiny, real) ---------------------------------------------------


@pytest.fixture(scope="module")
def stories(stories_path):
    model, tok = hf_model(stories_path)
    return model, list(tok(STORY)["input_ids"])


def test_logits_match_transformers(stories):
    model, prompt = stories
    want = hf_logits(model, prompt)
    engine = engine_of(model)
    prefill = feed(engine, [("s", prompt[:20], 20)])[0]
    decode = [feed(engine, [("s", [t], 1)])[0][0] for t in prompt[20:]]
    got = torch.cat([prefill, torch.stack(decode)])
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_layers_not_read_from_gguf_blocks_take_the_python_loop_and_say_why(stories, caplog):
    """stories260K's float32 weights come from safetensors: its engine runs
    the layers as a Python loop of kernel calls (the one-call path reads
    GGUF blocks only), logs why, and moves no weight."""
    model, prompt = stories
    engine = engine_of(model, gemm="simd")
    assert gguf_layers.not_taken(engine.layers) == "qkv: not read from GGUF blocks (GEMM path simd)"
    weight = engine.layers[0].qkv._padded
    with caplog.at_level(logging.INFO, logger="specdec.engine.llama"):
        feed(engine, [("s", prompt[:4], 1)])
    assert engine._gguf_layers() is None and engine.layers[0].qkv._padded is weight
    assert "decoder layers in a Python loop of kernel calls (qkv: not read from GGUF blocks" in caplog.text


def test_bfloat16_is_close_to_float32(stories_path, stories):
    from transformers import AutoModelForCausalLM

    fp32, prompt = stories
    hf_bf16 = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.bfloat16).eval()
    want = hf_logits(fp32, prompt)
    hf_err = (hf_logits(hf_bf16, prompt) - want).abs().max()
    got = feed(engine_of(fp32, "bfloat16"), [("s", prompt, len(prompt))])[0]
    assert (got - want).abs().max() < 2 * hf_err + 0.05  # no worse than transformers' own bf16
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_unfused_small_steps_run_the_small_steps_as_torch_ops_in_the_weights_dtype(stories):
    """fuse_small_steps=False (the benchmarks' "before the numba steps" engine):
    bfloat16 through simd then keeps a bfloat16 stream between torch ops,
    and computes the same model as the fused engine, up to bfloat16's
    rounding of the activations."""
    model, prompt = stories
    fused = engine_of(model, "bfloat16", gemm="simd")
    plain = engine_of(model, "bfloat16", gemm="simd", fuse_small_steps=False)
    assert not plain.fused and plain.act_dtype == torch.bfloat16 and plain.gemm == "simd"
    got = feed(plain, [("s", prompt, len(prompt))])[0]
    want = feed(fused, [("s", prompt, len(prompt))])[0]
    assert not torch.equal(got, want)  # really another pipeline
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert (got - want).abs().max() < 0.5


#: What a fused forward may still run through torch: wrapping numpy arrays
#: and the token ids' device check; nothing that computes.
WRAPPING_OPS = {"aten::lift_fresh", "aten::detach", "aten::to", "aten::alias", "aten::view", "aten::as_strided",
                "aten::resolve_conj", "aten::resolve_neg"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_fused_forward_computes_nothing_through_torch(stories, dtype):
    """On the fused CPU path the embedding, the layers, the final norm and
    the LM head all run on numpy arrays: a decode row, a verification chunk
    and a prefill chunk in one forward run no torch op that computes."""
    from torch.profiler import ProfilerActivity, profile
    model, prompt = stories
    engine = engine_of(model, dtype, gemm="simd")
    assert engine.fused
    feed(engine, [("a", prompt[:8], 1), ("b", prompt[:5], 1)])
    items = [("a", prompt[8:9], 1), ("b", prompt[5:11], 6), ("c", prompt[:7], 0)]
    for seq, tokens, _ in items:
        engine.ensure_capacity(seq, engine.cached_len(seq) + len(tokens))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = engine.forward([ForwardItem(seq, as_ids(tokens), k) for seq, tokens, k in items],
                             return_hidden_states=True)
    assert out.logits.shape[0] == 7 and out.hidden_states.shape[0] == 7
    assert {event.name for event in prof.events()} <= WRAPPING_OPS


def test_bfloat16_through_simd_is_the_float32_pipeline_on_bfloat16_weights(stories):
    """bfloat16 through simd keeps the projection weights in bfloat16 and
    runs the float32 kernels between them (act_dtype float32): its logits
    are bitwise those of a float32 engine on the weights rounded to
    bfloat16 with the same (bfloat16) KV cache, prefill and decode; features
    still come out in bfloat16."""
    import copy

    model, prompt = stories
    bf16 = engine_of(model, "bfloat16", gemm="simd")
    assert bf16.fused and bf16.act_dtype == torch.float32
    assert bf16.layers[0].qkv.weight.dtype == torch.bfloat16 and bf16.lm_head.weight.dtype == torch.bfloat16
    f32 = engine_of(copy.deepcopy(model).to(torch.bfloat16).float(), "float32", gemm="simd", kv_dtype="bfloat16")
    for engine in (bf16, f32):
        engine.ensure_capacity("s", len(prompt) + 1)
    outs = [e.forward([ForwardItem("s", as_ids(prompt), 2)], feature_layers=(1, 3)) for e in (bf16, f32)]
    assert torch.equal(outs[0].logits, outs[1].logits)
    assert outs[0].features.dtype == torch.bfloat16
    assert torch.equal(outs[0].features, outs[1].features.to(torch.bfloat16))
    step = [feed(e, [("s", [int(outs[1].logits[-1].argmax())], 1)])[0] for e in (bf16, f32)]
    assert torch.equal(step[0], step[1])
    # without the numba steps (torch's attention here) the stream stays bfloat16
    assert engine_of(model, "bfloat16", gemm="simd", attention="sdpa").act_dtype == torch.bfloat16


@pytest.mark.parametrize("gemm", ["auto", *GEMM_PATHS])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_count_invariance(stories, dtype, gemm):
    """Every path this machine's check accepts keeps decode, verification
    and batched rows bitwise equal; every path it rejects is refused."""
    model, prompt = stories
    engine = engine_or_refusal(model, dtype, gemm, lambda: engine_of(model, dtype))
    if engine is not None:
        check_invariance(engine, prompt)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_prefill_equals_token_by_token_decoding(stories, dtype):
    """421 rows on two threads: torch splits the elementwise ops inside a row
    (an odd row count), where an unpadded SwiGLU width (172 here) breaks
    invariance. Decoding runs on one thread (fast on a busy machine)."""
    model, _ = stories
    tokens = torch.randint(3, 512, (421,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = engine_of(model, dtype, num_threads=2)
    assert torch.get_num_threads() == 2
    one_thread = engine_of(model, dtype, num_threads=1, gemm=engine.gemm)
    decode = torch.cat([feed(one_thread, [("decode", [t], 1)])[0] for t in tokens])
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    assert torch.equal(feed(engine, [("prefill", tokens, 421)])[0], decode)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bfloat16_kv_cache_keeps_row_invariance_and_stays_close(stories, dtype):
    """kv_dtype bfloat16: decode, verify and batched rows stay bitwise equal
    (the scalar value path: head_dim 8), the pool holds twice the tokens per
    byte, and the logits stay close to the float32 cache's."""
    model, prompt = stories
    engine = engine_of(model, dtype, kv_dtype="bfloat16")
    assert engine.pool.key_cache.dtype == engine.pool.value_cache.dtype == torch.bfloat16
    check_invariance(engine, prompt)
    exact = feed(engine_of(model, dtype, kv_dtype="float32"), [("s", prompt, len(prompt))])[0]
    got = feed(engine, [("s", prompt, len(prompt))])[0]
    # whichever path the selector takes: the largest difference on this prompt was 0.126 (simd-dpbf16),
    # 0.160 (simd, simd-l1) and 0.219 (onednn), logits spanning about -12 .. 9 (AMD EPYC)
    assert (got - exact).abs().max() < 0.25
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


def test_kv_dtype_is_checked_and_named(stories, monkeypatch):
    import types

    import psutil

    model, _ = stories
    with pytest.raises(ValueError, match="kv_dtype 'float16': one of auto, float32, bfloat16"):
        engine_of(model, kv_dtype="float16")
    auto = {dtype: engine_of(model, dtype) for dtype in ("float32", "bfloat16")}
    assert {d: e.pool.key_cache.dtype for d, e in auto.items()} == {"float32": torch.float32,
                                                                    "bfloat16": torch.bfloat16}  # the model's dtype
    assert {d: e.facts.kv_dtype for d, e in auto.items()} == {"float32": "float32", "bfloat16": "bfloat16"}
    with pytest.raises(ValueError, match="kv_dtype 'bfloat16': the CPU attention kernels only"):
        engine_of(model, kv_dtype="bfloat16", attention="triton")
    # the same available memory for both pools (it moves between two reads by more than a tolerance would allow)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=16 * 2**30))
    per_token = {kv: engine_of(model, kv_dtype=kv, kv_capacity_tokens=None, kv_memory_fraction=0.001)
                 .pool.capacity_tokens for kv in ("float32", "bfloat16")}
    assert abs(per_token["bfloat16"] - 2 * per_token["float32"]) <= 2 * 16  # whole blocks of 16


def test_ragged_batch_equals_each_sequence_alone(stories):
    """Decode, verify (k=5), a prefill chunk and a first prefill in one pass."""
    model, prompt = stories
    engine = engine_of(model)
    prefixes = {"dec": prompt[:10], "ver": prompt[:7], "chunk": prompt[:4], "new": []}
    new = {"dec": prompt[10:11], "ver": prompt[7:13], "chunk": prompt[4:20], "new": prompt[3:15]}
    logits_rows = {"dec": 1, "ver": 6, "chunk": 0, "new": 12}
    alone = {}
    for seq in prefixes:
        if prefixes[seq]:
            feed(engine, [("alone-" + seq, prefixes[seq], 0)])
        alone[seq] = feed(engine, [("alone-" + seq, new[seq], logits_rows[seq])])[0]
        if prefixes[seq]:
            feed(engine, [(seq, prefixes[seq], 0)])
    batched = feed(engine, [(seq, new[seq], logits_rows[seq]) for seq in prefixes])
    for seq, got in zip(prefixes, batched):
        assert torch.equal(got, alone[seq]), seq
    want = hf_logits(model, prompt[3:15])
    assert (batched[3] - want).abs().max() < 1e-4


def test_zero_drafts_beside_sixteen_drafts(stories):
    model, prompt = stories
    engine = engine_of(model)
    feed(engine, [("a", prompt[:12], 0), ("b", prompt[:5], 0)])
    a, b = feed(engine, [("a", prompt[12:13], 1), ("b", prompt[5:22], 17)])
    want = hf_logits(model, prompt[:22])
    assert a.shape == (1, 512) and b.shape == (17, 512)
    assert (a[0] - want[12]).abs().max() < 1e-4
    assert (b - want[5:22]).abs().max() < 1e-4
    assert torch.equal(b.argmax(-1), want[5:22].argmax(-1))


def test_rollback_is_as_if_rejected_tokens_were_never_seen(stories):
    model, prompt = stories
    engine = engine_of(model)
    feed(engine, [("s", prompt[:10], 0)])
    rejected = [7, 99, 300, 12, 5, 41, 250, 8]  # 8 drafts, 3 accepted below
    feed(engine, [("s", prompt[10:11] + rejected, 9)])
    engine.truncate("s", 14)
    assert engine.cached_len("s") == 14
    continued = feed(engine, [("s", prompt[20:25], 5)])[0]
    fresh = feed(engine, [("fresh", prompt[:11] + rejected[:3] + prompt[20:25], 5)])[0]
    assert torch.equal(continued, fresh)


def test_chunked_prefill_equals_one_prefill(stories):
    model, prompt = stories
    engine = engine_of(model)
    whole = feed(engine, [("one", prompt, 3)])[0]
    for lo, hi in ((0, 7), (7, 20)):
        feed(engine, [("chunks", prompt[lo:hi], 0)])
    chunked = feed(engine, [("chunks", prompt[20:], 3)])[0]
    assert torch.equal(whole, chunked)
    assert torch.equal(feed(engine, [("one", [42], 1)])[0], feed(engine, [("chunks", [42], 1)])[0])


def test_pool_exhaustion_release_and_reuse(stories):
    model, prompt = stories
    engine = engine_of(model, kv_capacity_tokens=64, block_size=16)  # 4 blocks
    assert engine.facts.kv_capacity_tokens == 64
    engine.ensure_capacity("a", 40)  # 3 blocks
    before = (engine.free_tokens(), engine.cached_len("a"))
    with pytest.raises(PoolExhausted):
        engine.ensure_capacity("b", 17)  # 2 blocks, 1 free
    with pytest.raises(PoolExhausted):
        engine.ensure_capacity("a", 65)
    assert (engine.free_tokens(), engine.cached_len("a"), engine.cached_len("b")) == (*before, 0)
    a = engine.forward([ForwardItem("a", as_ids(prompt[:40]), 1)]).logits
    assert engine.release("a") and not engine.release("a")
    assert engine.free_tokens() == 64
    engine.ensure_capacity("b", 64)
    b = engine.forward([ForwardItem("b", as_ids(prompt[:40]), 1)]).logits
    assert torch.equal(a, b)  # reused blocks hold no trace of "a"


def test_greedy_matches_transformers_generate(stories_path, stories):
    model, prompt = stories
    assert greedy(engine_of(model), "g", prompt, 32) == hf_greedy(stories_path, tuple(prompt), 32)


def test_hidden_states_are_the_final_norm_output(stories):
    model, prompt = stories
    engine = engine_of(model)
    engine.ensure_capacity("h", 12)
    out = engine.forward([ForwardItem("h", as_ids(prompt[:8]), 0)], return_hidden_states=True)
    assert out.logits.shape == (0, 512) and out.hidden_states.shape == (0, 64)
    out = engine.forward([ForwardItem("h", as_ids(prompt[8:12]), 4)], return_hidden_states=True)
    with torch.inference_mode():
        want = model(torch.tensor([prompt[:12]]), output_hidden_states=True).hidden_states[-1][0, -4:]
    assert out.hidden_states.dtype == torch.float32 and out.hidden_states.shape == (4, 64)
    assert (out.hidden_states - want).abs().max() < 1e-4


@pytest.mark.parametrize("which", ["llama", "hf"])
def test_feature_layers_are_transformers_hidden_states_for_every_row_fed(stories_path, stories, which):
    """Layer states of all rows fed (a prefill chunk without logits, then a
    verification-sized item next to another sequence), in the order asked,
    equal transformers' output_hidden_states; asking for none returns none."""
    model, prompt = stories
    engine = engine_of(model) if which == "llama" else build_engine(
        EngineConfig(stories_path, kv_capacity_tokens=512, engine="hf"))
    n = engine.facts.num_layers
    assert n == model.config.num_hidden_layers == 5
    layers = (5, 0, 3, 1)  # any order, the last layer's output included
    want = hf_layer_states(model, prompt[:20])
    for seq in ("f", "other"):
        engine.ensure_capacity(seq, 20)
    chunk = engine.forward([ForwardItem("f", as_ids(prompt[:13]), 0)], feature_layers=layers).features
    out = engine.forward([ForwardItem("other", as_ids(prompt[:3]), 1), ForwardItem("f", as_ids(prompt[13:20]), 7)],
                         feature_layers=layers)
    assert chunk.shape == (13, 4 * 64) and out.features.shape == (3 + 7, 4 * 64)
    got = torch.cat([chunk, out.features[3:]]).float().view(20, 4, 64)  # [rows, layer, hidden]
    for j, layer in enumerate(layers):
        assert (got[:, j] - want[layer]).abs().max() < 1e-4, layer
    assert (out.features[:3].float().view(3, 4, 64)[:, 1] - want[0][:3]).abs().max() < 1e-6
    engine.ensure_capacity("plain", 4)
    assert engine.forward([ForwardItem("plain", as_ids(prompt[:4]), 1)]).features is None
    with pytest.raises(ValueError, match="feature layer 6"):
        engine.forward([ForwardItem("plain", as_ids(prompt[4:5]), 1)], feature_layers=(1, n + 1))


def test_facts_and_input_validation(stories):
    model, prompt = stories
    engine = engine_of(model, max_model_len=100, kv_capacity_tokens=500)
    f = engine.facts
    assert (f.vocab_size, f.max_model_len, f.eos_token_ids, f.hidden_size, f.num_layers, f.dtype) == \
        (512, 100, (2,), 64, 5, "float32")
    assert f.kv_capacity_tokens == 496  # whole blocks of 16
    assert engine.num_threads == 1 == torch.get_num_threads()  # a tiny model: no thread hand-offs
    assert engine.forward([]).logits.shape == (0, 512)
    with pytest.raises(ValueError):
        engine.ensure_capacity("x", 101)  # past max_model_len
    with pytest.raises(KeyError):
        engine.forward([ForwardItem("x", as_ids([1, 2]), 1)])  # capacity never ensured
    engine.ensure_capacity("x", 10)
    for bad in ([ForwardItem("x", as_ids([1]), 1), ForwardItem("x", as_ids([2]), 1)],  # same seq twice
                [ForwardItem("x", as_ids([1, 2]), 3)],  # more logits than tokens
                [ForwardItem("x", as_ids([512]), 1)],  # outside the vocabulary
                [ForwardItem("x", as_ids(range(17)), 1)]):  # past the reserved block of 16
        with pytest.raises(ValueError):
            engine.forward(bad)
    assert engine.cached_len("x") == 0  # a refused batch changes nothing


# ---- architecture variants on small random models ------------------------------------


SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=100, max_position_embeddings=128, rms_norm_eps=1e-5)


def variant_configs():
    """name -> (config, the same architecture with the feature under test off, or None)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, SmolLM3Config

    llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    llama = dict(**SMALL, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    smollm3 = dict(**{**SMALL, "num_hidden_layers": 4}, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return {
        "llama3-rope-untied-biases": (LlamaConfig(**llama, rope_parameters=llama3), LlamaConfig(**llama)),
        "linear-rope": (LlamaConfig(**SMALL, rope_parameters={"rope_type": "linear", "rope_theta": 500.0,
                                                              "factor": 4.0}),
                        LlamaConfig(**SMALL, rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        "qwen2-bias-sliding-layers": (Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=6,
                                                  max_window_layers=1), Qwen2Config(**SMALL)),
        "qwen3-qk-norm": (Qwen3Config(**SMALL, head_dim=32), None),
        "mistral-sliding-window": (MistralConfig(**SMALL, sliding_window=8),
                                   MistralConfig(**SMALL, sliding_window=None)),
        "smollm3-nope-layers": (SmolLM3Config(**smollm3, no_rope_layer_interval=2),
                                SmolLM3Config(**smollm3, no_rope_layer_interval=100)),
    }


@pytest.mark.parametrize("name", list(variant_configs()))
def test_architecture_variant_matches_transformers(name):
    config, feature_off = variant_configs()[name]
    assert unsupported_reason(config) is None
    model = random_model(config)
    tokens = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    want = hf_logits(model, tokens)
    engine = engine_of(model)
    got = torch.cat([feed(engine, [("v", tokens[:25], 25)])[0]] +
                    [feed(engine, [("v", [t], 1)])[0] for t in tokens[25:]])
    assert (got - want).abs().max() < 1e-4
    if feature_off is not None:  # the feature moves these logits far more than the tolerance
        plain = type(model)(feature_off).eval()
        plain.load_state_dict(model.state_dict())
        assert (hf_logits(plain, tokens) - want).abs().max() > 1e-2


def test_unsupported_configs_are_named():
    from transformers import GPT2Config, LlamaConfig

    assert "gpt2" in unsupported_reason(GPT2Config())
    assert "dynamic" in unsupported_reason(
        LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}))
    assert "gelu" in unsupported_reason(LlamaConfig(**SMALL, hidden_act="gelu"))


# ---- build_engine --------------------------------------------------------------------


def test_build_engine_runs_llama_models_on_the_llama_engine(stories_path, stories, caplog):
    _, prompt = stories
    with caplog.at_level(logging.WARNING):
        engine = build_engine(EngineConfig(stories_path, max_model_len=256, kv_memory_fraction=0.001))
    assert isinstance(engine, LlamaEngine) and not caplog.records
    assert engine.facts.max_model_len == 256 and engine.facts.kv_capacity_tokens > 0
    engine.ensure_capacity("s", 8)
    assert engine.forward([ForwardItem("s", as_ids(prompt[:8]), 1)]).logits.shape == (1, 512)


def test_build_engine_falls_back_for_other_architectures(tmp_path, caplog):
    from transformers import GPT2Config

    from specdec.engine.hf_engine import HFEngine

    random_model(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        engine = build_engine(EngineConfig(str(tmp_path), kv_capacity_tokens=128))
    assert isinstance(engine, HFEngine) and engine.facts.kv_capacity_tokens == 128
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "fallback" in r.getMessage()]
    assert len(warnings) == 1 and "gpt2" in warnings[0].getMessage()
    # options of the Llama runner are refused, not silently dropped, on the fallback
    with pytest.raises(ValueError, match="gemm.*transformers engine"):
        build_engine(EngineConfig(str(tmp_path), gemm="onednn"))
    with pytest.raises(ValueError, match="engine 'llama' cannot run"):
        build_engine(EngineConfig(str(tmp_path), engine="llama"))


@pytest.mark.parametrize("bad,field", [(dict(dtype="float16"), "dtype"), (dict(engine="vllm"), "engine"),
                                       (dict(kv_capacity_tokens=64, kv_memory_fraction=0.1), "kv_capacity_tokens"),
                                       (dict(kv_memory_fraction=1.5), "kv_memory_fraction"),
                                       (dict(device="tpu"), "device"), (dict(gemm="mkl"), "gemm"),
                                       (dict(kv_dtype="float16"), "kv_dtype"),
                                       (dict(kv_dtype="bfloat16", device="cuda"), "kv_dtype"),
                                       (dict(num_threads=0), "num_threads")])
def test_engine_config_names_the_bad_option(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig("any-model", **bad).check()


def test_scorer_threads_flag_reaches_the_engine(stories_path):
    from specdec.cli import build_parser
    from specdec.scorer_svc.server import engine_config

    parse = build_parser().parse_args
    assert engine_config(parse(["scorer", "--model", stories_path, "--threads", "1"])).num_threads == 1
    assert engine_config(parse(["scorer", "--model", stories_path])).num_threads is None  # the cores it may use
    assert engine_config(parse(["scorer", "--model", stories_path])).kv_dtype == "auto"
    assert engine_config(parse(["scorer", "--model", stories_path, "--kv-dtype", "bfloat16"])).kv_dtype == "bfloat16"
    with pytest.raises(ValueError, match="--threads"):
        engine_config(parse(["scorer", "--model", stories_path, "--threads", "0"])).check()
    threads = torch.get_num_threads()
    try:
        engine = build_engine(engine_config(parse(["scorer", "--model", stories_path, "--threads", "1",
                                                   "--kv-tokens", "64"])))
        assert isinstance(engine, LlamaEngine) and engine.num_threads == 1 and torch.get_num_threads() == 1
        engine = build_engine(engine_config(parse(["scorer", "--model", stories_path, "--threads", "1",
                                                   "--kv-tokens", "64", "--kv-dtype", "bfloat16"])))
        assert isinstance(engine, LlamaEngine) and engine.pool.key_cache.dtype == torch.bfloat16
    finally:
        torch.set_num_threads(threads)


# ---- SmolLM2-135M (real, GGUF) ---------------------------------------------------------


@pytest.fixture(scope="module")
def smollm(smollm_path):
    """(HF float32 model, prompt ids, engine(dtype, gemm) -> LlamaEngine or
    None where this machine refuses the path), engines built once."""
    model, tok = hf_model(smollm_path)
    prompt = list(tok(CHAT)["input_ids"])
    gguf = gguf_file_of(smollm_path)  # the file hf_model loaded: simd-gguf reads its blocks
    engines: dict[tuple[str, str], LlamaEngine | None] = {}

    def engine(dtype: str, gemm: str = "auto") -> LlamaEngine | None:
        if (dtype, gemm) not in engines:
            engines[dtype, gemm] = engine_or_refusal(model, dtype, gemm, lambda: engine(dtype), gguf=gguf)
        return engines[dtype, gemm]

    return model, prompt, engine


@pytest.mark.smollm
@pytest.mark.parametrize("gemm,tolerance", [("aten", 1e-4), ("auto", 2.5e-4)])
def test_smollm_logits_match_transformers(smollm, gemm, tolerance):
    """MKL float32 ("aten") sums like transformers does: within 1e-4 (where
    the machine lets it run). oneDNN float32 sums in another order, off by up
    to 1.5e-4 here; both are about 1e-4 from a float64 reference (llama.py
    module doc)."""
    model, prompt, engines = smollm
    engine = engines("float32", gemm)
    if engine is None:
        pytest.skip(f"gemm={gemm!r} breaks row-count invariance on this CPU (test_smollm_row_count_invariance)")
    want = hf_logits(model, prompt)
    n = len(prompt)
    got = torch.cat([feed(engine, [("m", prompt[:n - 4], n - 4)])[0]] +
                    [feed(engine, [("m", [t], 1)])[0] for t in prompt[n - 4:]])
    assert (got - want).abs().max() < tolerance
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.smollm
def test_smollm_bfloat16_is_close_to_float32(smollm):
    model, prompt, engines = smollm
    want = hf_logits(model, prompt)
    got = feed(engines("bfloat16"), [("m", prompt, len(prompt))])[0]
    assert (got - want).abs().max() < 3.0  # transformers' own bf16 differs by ~1.3 here
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.smollm
@pytest.mark.parametrize("gemm", ["auto", *GEMM_PATHS])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm_row_count_invariance(smollm, dtype, gemm):
    """As test_row_count_invariance, on SmolLM2's shapes: on an Intel Xeon
    without native bfloat16 MKL ("aten") fails here and must be refused."""
    _, prompt, engines = smollm
    engine = engines(dtype, gemm)
    if engine is not None:
        check_invariance(engine, prompt)


@pytest.mark.smollm
def test_smollm_bfloat16_keeps_a_bfloat16_kv_cache_close_to_a_float32_one(smollm):
    """A bfloat16 engine's KV cache is bfloat16 ("auto"), so
    test_smollm_row_count_invariance[bfloat16-*] checks it (the vector value
    path, head_dim 64, the attention on every core); its logits stay close
    to those of a float32 cache."""
    model, prompt, engines = smollm
    engine = engines("bfloat16")
    assert engine.kv_dtype == "bfloat16" and engine.pool.key_cache.dtype == torch.bfloat16
    exact = feed(engine_of(model, "bfloat16", kv_dtype="float32"), [("kv", prompt, len(prompt))])[0]
    got = feed(engine, [("kv", prompt, len(prompt))])[0]
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9
    assert (got - exact).abs().max() < 1.5


@pytest.mark.smollm
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_smollm_layers_in_one_numba_call_compute_the_python_loops_bits(smollm_path, smollm, kv_dtype):
    """simd-gguf engines run the layers in one numba call (engine.gguf_layers)
    where each GEMM is one launch (always for one row; on AVX2 for any
    rows); the Python loop runs them otherwise. Both compute the same
    logits and feature rows, bit for bit: one row, two, three, six and
    seventeen rows of a sequence, and one row each of two sequences (mixed
    into the same pass), with feature layers asked for and without."""
    model, prompt, _ = smollm
    engine = engine_of(model, kv_dtype=kv_dtype, gguf=gguf_file_of(smollm_path), gemm="simd-gguf")
    free = engine.pool.free_tokens()
    engine.prepare(4)  # the scorer's start-up: loads (or compiles) the one call with a step it then forgets
    assert engine.pool.free_tokens() == free
    arrays = engine._gguf_layers()
    assert arrays is not None and gguf_layers.not_taken(engine.layers) is None
    layers = (0, 3, 15, 30)
    assert gguf_layers.layout(1) is not None
    feed(engine, [("a", prompt[:-31], 0), ("b", prompt[:-5], 0)])
    batches = [[("a", prompt[-31:-14], 17)], [("a", prompt[-14:-8], 6)], [("a", prompt[-8:-7], 1)],
               [("a", prompt[-7:-5], 2)], [("a", prompt[-5:-2], 3)], [("a", prompt[-2:-1], 1), ("b", prompt[-5:-4], 1)]]
    runs = {}
    for fused in (True, False):
        engine._gguf_arrays = arrays if fused else None
        out = []
        for batch in batches:
            for fl in ((), layers):
                for seq, tokens, _ in batch:
                    engine.ensure_capacity(seq, engine.cached_len(seq) + len(tokens))
                got = engine.forward([ForwardItem(s, as_ids(t), k) for s, t, k in batch], feature_layers=fl)
                out.append(got.logits)
                if fl:
                    out.append(got.features.float())
                for seq, tokens, _ in batch:  # the next pass (and the other run) feeds the same rows again
                    engine.truncate(seq, engine.cached_len(seq) - len(tokens))
            for seq, tokens, _ in batch:  # then on to the next batch
                feed(engine, [(seq, tokens, 0)])
        for seq, n in (("a", 31), ("b", 5)):
            engine.truncate(seq, len(prompt) - n)
        runs[fused] = out
    assert len(runs[True]) == len(runs[False]) == 18
    for got, want in zip(runs[True], runs[False]):
        assert torch.equal(got, want)


@pytest.mark.smollm
def test_smollm_uses_every_core(smollm):
    assert smollm[2]("float32").num_threads == default_num_threads()


@pytest.mark.smollm
def test_smollm_greedy_matches_transformers_generate(smollm_path, smollm):
    _, prompt, engines = smollm
    assert greedy(engines("float32"), "g", prompt, 32) == hf_greedy(smollm_path, tuple(prompt), 32)


def test_scorer_feature_layers_flag_prepares_those_graphs_and_names_a_bad_layer(stories_path):
    """--feature-layers: sorted, each once; the scorer's start-up prepares the
    plain graphs and then those of passes returning these layers' states
    (on a GPU; Engine.prepare, recorded here); a layer the model lacks stops
    the start naming the flag, on any device."""
    from specdec.cli import build_parser
    from specdec.scorer_svc.server import prepare

    parse = build_parser().parse_args
    base = ["scorer", "--model", stories_path, "--max-batch-size", "4", "--max-tokens-per-forward", "32"]
    args = parse([*base, "--feature-layers", "5,1,3"])
    assert args.feature_layers == (1, 3, 5) and parse(base).feature_layers == ()
    for bad in ("1,1", "1,x"):
        with pytest.raises(SystemExit):
            parse([*base, "--feature-layers", bad])
    engine = build_engine(EngineConfig(stories_path, kv_capacity_tokens=64))
    calls = []
    engine.prepare = lambda *a: calls.append(a)  # records what start-up asks for
    prepare(engine, args)
    assert calls == [(4, 32), (4, 32, (1, 3, 5))]
    calls.clear()
    prepare(engine, parse(base))
    assert calls == [(4, 32)]
    with pytest.raises(ValueError, match=r"--feature-layers: feature layer 6 outside 0\.\.5"):
        prepare(engine, parse([*base, "--feature-layers", "1,6"]))
    assert calls == [(4, 32)]  # nothing prepared
