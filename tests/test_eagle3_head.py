"""The feature-head loaders and the eagle3/mtp proposer in-process on
stories260K (no gRPC): what the public layouts may vary (default layers,
``layers.0.`` naming, MiMo MTP naming), what they may not (missing tensors,
wrong shapes, d2t outside the vocabulary), and how features are taken (a
window, overlapping rows by position, gaps refused)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from feature_heads import target_features, write_eagle3_head, write_mtp_target
from safetensors.torch import load_file, save_file

from specdec.proposer_svc.base import SeqOptions
from specdec.proposer_svc.eagle3 import load_eagle3, load_mtp
from specdec.proposer_svc.feature_draft import FeatureDraftProposer, FeatureGap

CONTEXT = [1, 403, 407, 261, 378, 285, 429, 267, 376, 433, 261, 300, 275]
NO_CUT = SeqOptions(min_token_prob=0.0)


@pytest.fixture(scope="module")
def head_dir(stories_path, tmp_path_factory) -> Path:
    return write_eagle3_head(tmp_path_factory.mktemp("head") / "h", Path(stories_path), [1, 3, 4])


def _drafts(proposer, target, context, k=4, start=0, seq="s") -> list[int]:
    proposer.start(seq, np.asarray(context, dtype=np.int32), NO_CUT)
    rows = target_features(target, context, list(proposer.feature_layers))
    proposer.add_features(seq, start, rows[start:len(context) - 1])
    return proposer.propose([(seq, k)])[0].token_ids.tolist()


def test_a_config_naming_no_layers_reads_vllms_default(stories_path, tmp_path):
    head = load_eagle3(str(write_eagle3_head(tmp_path / "h", Path(stories_path), None)), stories_path)
    assert head.spec.feature_layers == (2, 5 // 2, 5 - 3)


def test_layers_0_naming_with_a_model_prefix_loads_the_same_head(head_dir, stories_path, tmp_path, target):
    """vLLM maps midlayer. to layers.0. and adds model. to non-head names: a
    checkpoint written either way is the same head."""
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    w = load_file(str(head_dir / "model.safetensors"))
    save_file({("model.layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v
               for k, v in w.items()}, str(renamed / "model.safetensors"))
    (renamed / "config.json").write_text((head_dir / "config.json").read_text())
    a = FeatureDraftProposer("eagle3", load_eagle3(str(head_dir), stories_path))
    b = FeatureDraftProposer("eagle3", load_eagle3(str(renamed), stories_path))
    assert _drafts(a, target, CONTEXT) == _drafts(b, target, CONTEXT)


@pytest.mark.parametrize("change, message", [
    (lambda w, c: w.pop("fc.weight"), "missing fc.weight"),
    (lambda w, c: w.__setitem__("fc.weight", w["fc.weight"][:, :-1]), "fc.weight"),
    (lambda w, c: w.__setitem__("d2t", w["d2t"] + 600), "d2t"),
    (lambda w, c: c.__setitem__("target_hidden_size", 32), "target_hidden_size"),
    (lambda w, c: c.__setitem__("eagle_config", {"eagle_aux_hidden_state_layer_ids": [1, 9, 4]}),
     "eagle_aux_hidden_state_layer_ids"),
    (lambda w, c: c.__setitem__("num_hidden_layers", 2), "num_hidden_layers"),
])
def test_a_head_that_does_not_fit_is_refused_naming_why(head_dir, stories_path, tmp_path, change, message):
    w = load_file(str(head_dir / "model.safetensors"))
    config = json.loads((head_dir / "config.json").read_text())
    change(w, config)
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({k: v.contiguous() for k, v in w.items()}, str(bad / "model.safetensors"))
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_eagle3(str(bad), stories_path)


def test_mimo_mtp_naming_loads_and_drafts(stories_path, tmp_path, target):
    head = load_mtp(str(write_mtp_target(tmp_path / "mimo", Path(stories_path), naming="mimo")))
    assert head.spec.kind == "mimo_mtp" and head.spec.feature_layers == (5,)
    drafts = _drafts(FeatureDraftProposer("mtp", head), target, CONTEXT)
    assert len(drafts) == 4 and all(0 <= t < 512 for t in drafts)


def test_a_target_without_mtp_layers_is_refused(stories_path):
    with pytest.raises(ValueError, match="carries no MTP layer"):
        load_mtp(stories_path)


def test_features_are_taken_by_position(head_dir, stories_path, target):
    head = load_eagle3(str(head_dir), stories_path)
    proposer = FeatureDraftProposer("eagle3", head)
    whole = _drafts(proposer, target, CONTEXT, seq="whole")
    rows = target_features(target, CONTEXT, [1, 3, 4])
    # rows resent from 0 (a re-prefill) are skipped where already held
    proposer.add_features("whole", 0, rows[:len(CONTEXT) - 1])
    assert proposer.features_from("whole") == len(CONTEXT) - 1
    assert proposer.propose([("whole", 4)])[0].token_ids.tolist() == whole
    # a gap or rows past the context are refused, naming the field
    with pytest.raises(FeatureGap, match="features.start"):
        proposer.extend("whole", np.asarray([5, 6, 7], dtype=np.int32))
        proposer.add_features("whole", len(CONTEXT) + 1, rows[:1])
    with pytest.raises(FeatureGap, match="features.rows"):
        proposer.add_features("whole", len(CONTEXT) - 1, np.repeat(rows[:1], 6, axis=0))
    # a window (the first rows start late) still drafts, from the positions it has
    windowed = _drafts(proposer, target, CONTEXT, start=6, seq="window")
    assert len(windowed) == 4


def test_features_lagging_behind_the_tokens_give_no_drafts(head_dir, stories_path, target):
    proposer = FeatureDraftProposer("eagle3", load_eagle3(str(head_dir), stories_path))
    proposer.start("lag", np.asarray(CONTEXT, dtype=np.int32), NO_CUT)
    rows = target_features(target, CONTEXT, [1, 3, 4])
    proposer.add_features("lag", 0, rows[:len(CONTEXT) - 3])  # two rows short
    assert len(proposer.propose([("lag", 4)])[0]) == 0
    proposer.add_features("lag", len(CONTEXT) - 3, rows[len(CONTEXT) - 3:len(CONTEXT) - 1])
    assert len(proposer.propose([("lag", 4)])[0]) == 4


def test_the_launcher_gives_proposers_the_head_and_the_target():
    from specdec.cli import build_parser, replica_settings
    from specdec.launcher import Stack
    from specdec.limits import HEAD_PROJECTION_DTYPE

    def proposer_args(stack: Stack) -> list[str]:  # the copying proposers' (eagle3 and mtp run there)
        copy_methods, _ = stack._split_methods()
        return stack._proposer_args(copy_methods)

    args = proposer_args(Stack(model="M", methods="ngram,eagle3", eagle3="/heads/h"))
    assert args[args.index("--eagle3") + 1] == "/heads/h" and args[args.index("--target-model") + 1] == "M"
    args = proposer_args(Stack(model="M", methods="mtp"))
    assert args[args.index("--target-model") + 1] == "M" and "--eagle3" not in args
    assert "--target-model" not in proposer_args(Stack(model="M", methods="ngram"))
    with_draft = Stack(model="M", methods="ngram,draft,eagle3", eagle3="/heads/h", draft_model="D")
    copy_methods, draft_methods = with_draft._split_methods()
    assert "eagle3" in copy_methods and draft_methods == ["draft"]
    assert with_draft._draft_proposer_args(draft_methods).count("--target-model") == 1
    assert build_parser().parse_args(["serve", "--eagle3", "/heads/h"]).eagle3 == "/heads/h"
    # draft_dtype reaches the heads and the draft model; the draft model follows dtype without it
    bf16 = Stack(model="M", methods="ngram,draft,eagle3", eagle3="/heads/h", draft_model="D", dtype="float32",
                 draft_dtype="bfloat16")
    for args in (proposer_args(bf16), bf16._draft_proposer_args(["draft"])):
        parsed = build_parser().parse_args(args)
        assert parsed.draft_dtype == "bfloat16"
    assert build_parser().parse_args(with_draft._draft_proposer_args(["draft"])).draft_dtype == "float32"
    # without it the heads' projections are q8_0 blocks (HEAD_PROJECTION_DTYPE: fewer bytes a draft step reads)
    assert build_parser().parse_args(proposer_args(with_draft)).draft_dtype == "q8_0" == HEAD_PROJECTION_DTYPE
    bare = build_parser().parse_args(["proposer", "--methods", "eagle3,draft", "--eagle3", "/heads/h",
                                      "--draft-model", "D", "--target-model", "M"])
    settings = replica_settings(bare)
    assert settings.heads.projection_dtype == "q8_0" and settings.draft.engine.dtype == "float32"
    assert build_parser().parse_args(["serve", "--draft-dtype", "bfloat16"]).draft_dtype == "bfloat16"
    # draft_threads reaches the proposer that runs the heads (COLOCATED_DRAFT_THREADS by default), as the draft's
    assert build_parser().parse_args(proposer_args(with_draft)).draft_threads == 1
    assert build_parser().parse_args(proposer_args(Stack(model="M", methods="mtp", draft_threads=2))).draft_threads == 2
    assert build_parser().parse_args(proposer_args(Stack(model="M", methods="eagle3", eagle3="/heads/h",
                                                         draft_threads=None))).draft_threads is None
    assert "--draft-threads" not in proposer_args(Stack(model="M", methods="ngram"))


def test_the_heads_fused_projections_compute_the_checkpoints_linears(head_dir, stories_path):
    """q/k/v and gate/up run fused through the engine's GEMM path on this
    CPU: each slice equals F.linear with the checkpoint's own weight."""
    import torch
    import torch.nn.functional as F

    head = load_eagle3(str(head_dir), stories_path)
    w = head.w
    x2 = torch.randn(3, w["self_attn.q_proj.weight"].shape[1], generator=torch.Generator().manual_seed(0))
    parts = [w[f"self_attn.{n}_proj.weight"] for n in "qkv"]
    want = torch.cat([F.linear(x2, p) for p in parts], dim=-1)
    torch.testing.assert_close(head.proj["qkv"](x2), want, rtol=1e-5, atol=1e-5)
    x = torch.randn(3, w["mlp.gate_proj.weight"].shape[1], generator=torch.Generator().manual_seed(1))
    want = torch.cat([F.linear(x, w["mlp.gate_proj.weight"]), F.linear(x, w["mlp.up_proj.weight"])], dim=-1)
    torch.testing.assert_close(head.proj["gate_up"](x), want, rtol=1e-5, atol=1e-5)
    for role in ("o", "down", "lm_head", "fc"):
        weight = w[{"o": "self_attn.o_proj.weight", "down": "mlp.down_proj.weight"}.get(role, role)]
        xr = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(head.proj[role](xr), F.linear(xr, weight), rtol=1e-5, atol=1e-5)



def test_one_row_chain_steps_attend_as_a_whole_chunk_does(head_dir, stories_path):
    """A chain step (one row) takes the head's one-query attention (no
    mask); the same rows fed as one chunk, or as two, take the masked form
    (query heads grouped over their kv head in both): every row's output
    and the logits agree, so each form attends to exactly the rows it
    should."""
    import torch

    from specdec.proposer_svc.eagle3 import HeadCache, HeadItem

    head = load_eagle3(str(head_dir), stories_path)
    s = head.spec
    assert s.num_heads != s.num_kv_heads  # grouped-query attention: the grouping is exercised
    gen = torch.Generator().manual_seed(0)
    tokens = torch.tensor(CONTEXT[:7])
    feats = torch.randn(len(tokens), s.hidden_size, generator=gen)
    whole_cache, step_cache = HeadCache(s.num_kv_heads, s.head_dim), HeadCache(s.num_kv_heads, s.head_dim)
    whole_out, whole_logits = head.forward([HeadItem(whole_cache, tokens, feats)])
    steps = [head.forward([HeadItem(step_cache, tokens[i:i + 1], feats[i:i + 1])]) for i in range(len(tokens))]
    torch.testing.assert_close(torch.cat([o for o, _ in steps]), whole_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(steps[-1][1], whole_logits, rtol=1e-5, atol=1e-5)
    # a chunk after cached rows (a round's catch-up: 4 rows over 7 cached) sees the cache and its own
    # earlier rows, not its later ones
    split_cache = HeadCache(s.num_kv_heads, s.head_dim)
    head.forward([HeadItem(split_cache, tokens[:3], feats[:3])])
    tail_out, tail_logits = head.forward([HeadItem(split_cache, tokens[3:], feats[3:])])
    torch.testing.assert_close(tail_out, whole_out[3:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail_logits, whole_logits, rtol=1e-5, atol=1e-5)
    # a second item in the same forward keeps its own rows
    other = HeadCache(s.num_kv_heads, s.head_dim)
    both, _ = head.forward([HeadItem(other, tokens[:1], feats[:1]),
                            HeadItem(HeadCache(s.num_kv_heads, s.head_dim), tokens[:1], -feats[:1])])
    torch.testing.assert_close(both[:1], steps[0][0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(both[1:], both[:1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "q8_0"])
def test_draft_threads_sets_the_heads_threads_before_its_gemms_split_work(head_dir, stories_path, target, dtype):
    """`--draft-threads N` runs the head on N threads: torch's and every
    projection's GEMM (a GEMM keeps the count it was built with, so the head
    rebuilds them); without the flag a head this small runs on one thread;
    0 is refused naming the flag. The drafts do not depend on the count."""
    import torch

    from specdec.cli import build_parser, replica_settings
    from specdec.proposer_svc.registry import build_proposers

    def built(*extra: str):
        args = build_parser().parse_args(["proposer", "--methods", "eagle3", "--eagle3", str(head_dir),
                                          "--target-model", stories_path, "--draft-dtype", dtype, *extra])
        return build_proposers(["eagle3"], replica_settings(args))["eagle3"]

    threads = torch.get_num_threads()
    try:
        drafts = {}
        for flag, want in ((["--draft-threads", "2"], 2), ([], 1), (["--draft-threads", "1"], 1)):
            torch.set_num_threads(2 if want == 1 else 1)  # the other count: the proposer must set it
            proposer = built(*flag)
            assert torch.get_num_threads() == want and proposer.head.threads == want
            assert {getattr(linear, "threads", want) for linear in proposer.head.proj.values()} == {want}  # numba GEMMs
            drafts[tuple(flag)] = _drafts(proposer, target, CONTEXT)
        assert len(set(map(tuple, drafts.values()))) == 1 and len(drafts[()]) == 4
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="--draft-threads"):
        built("--draft-threads", "0")


def test_bfloat16_projections_keep_half_the_bytes_and_stay_close(head_dir, stories_path):
    """`specdec proposer --methods eagle3 --draft-dtype bfloat16`: every
    projection's weight is kept as bfloat16 (read by the simd path) and
    computes the checkpoint's linear on those rounded values, float32 in and
    out; the served proposer is built with it."""
    import torch
    import torch.nn.functional as F

    from specdec.cli import build_parser, replica_settings
    from specdec.proposer_svc.registry import build_proposers

    args = build_parser().parse_args(["proposer", "--methods", "eagle3", "--eagle3", str(head_dir),
                                      "--target-model", stories_path, "--draft-dtype", "bfloat16"])
    settings = replica_settings(args)
    assert settings.heads.projection_dtype == "bfloat16"
    threads = torch.get_num_threads()
    try:
        head = build_proposers(["eagle3"], settings)["eagle3"].head
    finally:
        torch.set_num_threads(threads)  # a small head sets the process to one thread, as a server would
    w = head.w
    for role, name in (("o", "self_attn.o_proj.weight"), ("down", "mlp.down_proj.weight"), ("lm_head", "lm_head"),
                       ("fc", "fc")):
        linear = head.proj[role]
        assert linear.weight.dtype == torch.bfloat16 and linear.path.name == "simd"
        x = torch.randn(3, w[name].shape[1], generator=torch.Generator().manual_seed(3))
        y = linear(x)
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, F.linear(x, w[name].to(torch.bfloat16).float()), rtol=1e-5, atol=1e-5)
    assert load_eagle3(str(head_dir), stories_path).proj["o"].weight.dtype == torch.float32  # the default


@pytest.mark.parametrize("dtype", ["q8_0", "q4_1"])
def test_quantised_projections_read_fewer_bytes_compute_with_their_blocks_and_draft(head_dir, stories_path, target,
                                                                                    dtype):
    """`specdec proposer --methods eagle3 --draft-dtype q8_0|q4_1`: every
    projection is quantised at load into GGUF blocks (gguf-py's quantiser)
    read by the simd-gguf path, fewer bytes than bfloat16; it computes the
    linear of the blocks' values, within a quantisation step of the
    checkpoint's; the head drafts a full chain."""
    import torch
    import torch.nn.functional as F

    from specdec.cli import build_parser, replica_settings
    from specdec.proposer_svc.registry import build_proposers

    args = build_parser().parse_args(["proposer", "--methods", "eagle3", "--eagle3", str(head_dir),
                                      "--target-model", stories_path, "--draft-dtype", dtype])
    threads = torch.get_num_threads()
    try:
        proposer = build_proposers(["eagle3"], replica_settings(args))["eagle3"]
    finally:
        torch.set_num_threads(threads)
    head = proposer.head
    w = head.w
    for role, name in (("o", "self_attn.o_proj.weight"), ("down", "mlp.down_proj.weight"), ("lm_head", "lm_head"),
                       ("fc", "fc")):
        linear = head.proj[role]
        assert linear.path.name == "simd-gguf" and linear._quant.kind == dtype.upper()
        assert linear.nbytes < w[name].numel() * 2 * (0.6 if dtype == "q8_0" else 0.4)  # float32 scales in memory
        x = torch.randn(3, w[name].shape[1], generator=torch.Generator().manual_seed(4))
        values = torch.from_numpy(linear._quant.dequantized())
        torch.testing.assert_close(linear(x), F.linear(x, values), rtol=1e-5, atol=1e-5)
        step = torch.from_numpy(linear._quant.d[:len(values)]).abs().repeat_interleave(32, dim=1)
        assert ((values - w[name]).abs() <= step + 1e-6).all()
    assert len(_drafts(proposer, target, CONTEXT, k=4)) == 4
    with pytest.raises(ValueError, match="head projection weights: one of float32, bfloat16, q8_0, q4_1, not 'q5_k'"):
        load_eagle3(str(head_dir), stories_path, "q5_k")


def test_a_draft_model_refuses_a_dtype_only_heads_take_naming_the_flag():
    from specdec.cli import build_parser, replica_settings
    from specdec.launcher import serve_command

    args = build_parser().parse_args(["proposer", "--methods", "draft", "--draft-model", "D", "--target-model", "M",
                                      "--draft-dtype", "q8_0"])
    with pytest.raises(SystemExit, match="proposer: --draft-dtype q8_0 quantises an eagle3/mtp head's projections; "
                                         "a draft model .--draft-model. runs in float32 or bfloat16"):
        replica_settings(args)
    with pytest.raises(SystemExit, match="serve: --draft-dtype q4_1 quantises"):
        serve_command(build_parser().parse_args(["serve", "--draft-model", "D", "--draft-dtype", "q4_1"]))


def _reference_forward(head, tokens, feats):
    """The head's layer written out in torch, every row at once from an empty
    cache (module doc of eagle3: the kinds' inputs, causal attention with
    query heads grouped over their kv heads, SwiGLU, the fed-back state)."""
    import torch
    import torch.nn.functional as F

    s, w, eps = head.spec, head.w, head.spec.rms_norm_eps

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    T, H, Hkv, D = len(tokens), s.num_heads, s.num_kv_heads, s.head_dim
    e, g = w["embed"][tokens], feats
    if s.kind == "eagle3":
        gn = norm(g, w["hidden_norm"])
        x, residual = torch.cat([norm(e, w["input_layernorm.weight"]), gn], -1), (gn if s.norm_before_residual else g)
    else:
        e = e.clone()
        e[0] = 0.0  # position 0: MTP zeroes the token embedding
        en, gn = norm(e, w["token_norm"]), norm(g, w["feature_norm"])
        residual = F.linear(torch.cat([en, gn] if s.kind == "deepseek_mtp" else [gn, en], -1), w["input_proj"])
        x = norm(residual, w["input_layernorm.weight"])
    q = F.linear(x, w["self_attn.q_proj.weight"]).view(T, H, D)
    k = F.linear(x, w["self_attn.k_proj.weight"]).view(T, Hkv, D)
    v = F.linear(x, w["self_attn.v_proj.weight"]).view(T, Hkv, D)
    angles = torch.arange(T).float()[:, None] * head.inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]

    def rotate(t):
        return t * cos + torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1) * sin

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    h = residual + F.linear(att.transpose(0, 1).reshape(T, H * D), w["self_attn.o_proj.weight"])
    x = norm(h, w["post_attention_layernorm.weight"])
    out = h + F.linear(F.silu(F.linear(x, w["mlp.gate_proj.weight"])) * F.linear(x, w["mlp.up_proj.weight"]),
                       w["mlp.down_proj.weight"])
    normed = norm(out, w["final_norm"])
    return (normed if s.kind == "mimo_mtp" else out), F.linear(normed[-1:], w["lm_head"])


@pytest.mark.parametrize("kind", ["eagle3", "deepseek", "mimo"])
def test_the_heads_numpy_forward_computes_the_layer_as_torch_writes_it(head_dir, stories_path, tmp_path, kind):
    """``FeatureHead.forward`` (numpy between the GEMMs, numba kernels for
    RoPE and attention) against the layer written out in torch, for each
    kind's inputs: every row's fed-back state and the last row's logits,
    float32 projections, whole prompt then one chain step."""
    import torch

    from specdec.proposer_svc.eagle3 import HeadCache, HeadItem

    head = load_eagle3(str(head_dir), stories_path) if kind == "eagle3" else \
        load_mtp(str(write_mtp_target(tmp_path / kind, Path(stories_path), naming=kind)))
    gen = torch.Generator().manual_seed(1)
    tokens = torch.tensor(CONTEXT)
    feats = torch.randn(len(tokens), head.spec.hidden_size, generator=gen)
    if kind != "eagle3":  # MTP reads the target's last state before its final norm: fused by the head
        feats = head.fuse(torch.randn(len(tokens), head.spec.feature_dim, generator=gen))
    want_out, want_logits = _reference_forward(head, tokens, feats)
    cache = HeadCache(head.spec.num_kv_heads, head.spec.head_dim)
    out, logits = head.forward([HeadItem(cache, tokens[:-1], feats[:-1])])
    step_out, step_logits = head.forward([HeadItem(cache, tokens[-1:], feats[-1:])])
    torch.testing.assert_close(torch.cat([out, step_out]), want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step_logits, want_logits, rtol=1e-4, atol=1e-4)
