"""The draft proposer in-process on stories260K (the engine is real, no
gRPC): KV catch-up and rollback keep the cache equal to what a fresh
proposer would build, seeded sampling is reproducible and q is the
renormalised top-K at the request temperature, a large round falls back to
no drafts, the confidence cut shortens drafts, and a reduced draft head maps
its rows to target ids (draft_vocab.json) while a smaller head without one is
refused."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.engine.config import EngineConfig
from specdec.models import resolve_model
from specdec.proposer_svc.base import SeqOptions
from specdec.proposer_svc.draft import DraftConfig, DraftModelProposer, choose_tokens, seeded_uniform
from specdec.proposer_svc.hybrid import ngram_score

PROMPT = np.array([1, 403, 261, 429, 407, 261, 378], dtype=np.int32)
NO_CUT = SeqOptions(min_token_prob=0.0)


@pytest.fixture(scope="module")
def engine(stories_path):
    from specdec.engine.factory import build_engine

    return build_engine(EngineConfig(stories_path, kv_capacity_tokens=4096))


def _proposer(engine, **kw) -> DraftModelProposer:
    return DraftModelProposer(engine, DraftConfig(vocab_limit=512, **kw))


def test_incremental_drafts_equal_fresh_drafts(engine):
    """After accepting some drafts and a correction, the incrementally
    updated cache drafts exactly what a proposer opened on the whole context does."""
    inc = _proposer(engine)
    inc.start("inc", PROMPT, NO_CUT)
    context = PROMPT.copy()
    for accept, correction in [(2, 5), (0, 9), (4, 30), (1, 77)]:
        d = inc.propose([("inc", 4)])[0].token_ids
        new = np.concatenate([d[:accept], [correction]]).astype(np.int32)
        inc.extend("inc", new)
        context = np.concatenate([context, new])
        fresh = _proposer(engine)
        fresh.start(f"fresh{len(context)}", context, NO_CUT)
        expect = fresh.propose([(f"fresh{len(context)}", 4)])[0].token_ids
        got = inc.propose([("inc", 4)])[0].token_ids
        assert got.tolist() == expect.tolist()
        assert engine.cached_len("inc") == len(context) + len(got) - 1
        fresh.stop(f"fresh{len(context)}", completed=False)
        inc.extend("inc", np.zeros(0, dtype=np.int32))
    inc.stop("inc", completed=True)
    assert engine.cached_len("inc") == 0


def test_sampled_drafts_are_seeded_and_carry_top_k_q():
    logits = torch.randn(3, 50)
    a = choose_tokens(logits, [0.7, 0.7, 0.0], [5, 5, 5], [10, 11, 12], top_k=6)
    b = choose_tokens(logits, [0.7, 0.7, 0.0], [5, 5, 5], [10, 11, 12], top_k=6)
    assert [c.token for c in a] == [c.token for c in b]
    # the rows are chosen in one call: each row's choice is the one it gets alone
    alone = [choose_tokens(logits[i:i + 1], [t], [5], [10 + i], top_k=6)[0] for i, t in enumerate([0.7, 0.7, 0.0])]
    assert [(c.token, c.prob, c.sparse_ids.tolist(), c.sparse_probs.tolist()) for c in alone] == \
        [(c.token, c.prob, c.sparse_ids.tolist(), c.sparse_probs.tolist()) for c in a]
    q = torch.softmax(logits[0].double() / 0.7, -1)
    top = q.topk(6)
    assert a[0].sparse_ids.tolist() == top.indices.tolist()
    np.testing.assert_allclose(a[0].sparse_probs, (top.values / top.values.sum()).numpy(), rtol=1e-5)
    assert a[0].token in a[0].sparse_ids and a[2].token == int(logits[2].argmax())
    # a greedy draft carries its top-K at temperature 1 too: the confidence the gateway plans with
    greedy_top = torch.softmax(logits[2].double(), -1).topk(6)
    assert a[2].sparse_ids.tolist() == greedy_top.indices.tolist() and a[2].sparse_ids[0] == a[2].token
    np.testing.assert_allclose(a[2].sparse_probs, (greedy_top.values / greedy_top.values.sum()).numpy(), rtol=1e-5)
    # the sample follows q: many positions, one seed
    draws = [choose_tokens(logits[:1], [0.7], [9], [p], top_k=6)[0].token for p in range(4000)]
    freq = np.bincount(draws, minlength=50)[top.indices.numpy()] / 4000
    np.testing.assert_allclose(freq, (top.values / top.values.sum()).numpy(), atol=0.03)
    assert seeded_uniform(1, 2) != seeded_uniform(2, 2) and 0 <= seeded_uniform(1, 2) < 1


def test_cpu_top_k_matches_torch_s_keeps_the_lower_column_among_equals_and_takes_every_width():
    """``choose_tokens``' CPU top-K (one numba pass, ``draft_ops.top_k``)
    against torch.topk over the scaled float64 logits: the values and their
    order; among equal logits the lower column first; k up to the whole
    vocabulary; the greedy probability is the softmax's largest; bfloat16
    logits are read too."""
    from specdec.proposer_svc.draft import _top_k

    gen = torch.Generator().manual_seed(3)
    for vocab, k in ((4096, 8), (9, 9), (5, 1)):
        logits = torch.randn(3, vocab, generator=gen) * 4
        logits[1] = 0.5  # all equal
        scale = [1.0, 0.7, 1.3]
        greedy, values, ids = _top_k(logits, scale, k)
        ref = torch.topk(logits.double() / torch.tensor(scale, dtype=torch.float64)[:, None], k, dim=-1)
        np.testing.assert_array_equal(values, ref.values.numpy())
        np.testing.assert_array_equal(ids[[0, 2]], ref.indices[[0, 2]].numpy())
        assert ids[1].tolist() == list(range(k))
        np.testing.assert_allclose(greedy, torch.softmax(logits.double(), -1).max(-1).values.numpy(), rtol=1e-5)
    half = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    _, values, ids = _top_k(half, [1.0, 1.0], 4)
    assert ids[:, 0].tolist() == half.float().argmax(-1).tolist() and (np.diff(values, axis=1) <= 0).all()


def test_a_round_larger_than_max_batch_gets_no_drafts(engine):
    prop = _proposer(engine, max_batch=2)
    for i in range(3):
        prop.start(f"b{i}", PROMPT, NO_CUT)
    assert all(len(d.token_ids) == 0 for d in prop.propose([(f"b{i}", 4) for i in range(3)]))
    assert all(len(d.token_ids) == 4 for d in prop.propose([(f"b{i}", 4) for i in range(2)]))
    for i in range(3):
        prop.stop(f"b{i}", completed=False)


def test_confidence_cut_shortens_drafts(engine):
    prop = _proposer(engine)
    prop.start("all", PROMPT, NO_CUT)
    prop.start("cut", PROMPT, SeqOptions(min_token_prob=0.7))
    full, cut = prop.propose_scored([("all", 8), ("cut", 8)])
    assert len(full.draft.token_ids) == 8 and len(cut.draft.token_ids) < 8
    assert cut.draft.token_ids.tolist() == full.draft.token_ids[:len(cut.draft.token_ids)].tolist()
    assert 0 < full.score <= 8


# ------------------------------------------------------- reduced draft vocabulary
def _draft_dir(stories_path, tmp_path, name: str, target_ids=None, head_rows: int | None = None):
    """stories260K as a draft directory, with a draft_vocab.json mapping and/or
    a head cut to head_rows rows (its tokenizer stays the target's)."""
    import shutil

    from transformers import AutoModelForCausalLM

    from specdec.proposer_svc.draft_model import DRAFT_VOCAB_FILE

    out = tmp_path / name
    shutil.copytree(stories_path, out)
    if head_rows is not None:
        model = AutoModelForCausalLM.from_pretrained(stories_path)
        model.resize_token_embeddings(head_rows)
        model.save_pretrained(out)
    if target_ids is not None:
        (out / DRAFT_VOCAB_FILE).write_text(json.dumps({"target_ids": [int(i) for i in target_ids]}))
    return str(out)


def _built(draft: str, target: str) -> DraftModelProposer:
    from specdec.proposer_svc.draft_model import DraftModelSettings, build_draft_proposer

    return build_draft_proposer(DraftModelSettings(EngineConfig(draft, kv_capacity_tokens=1024), target))


def _drafts(prop: DraftModelProposer, options: SeqOptions = NO_CUT, k: int = 6):
    prop.start("s", PROMPT, options)
    draft = prop.propose([("s", k)])[0]
    prop.stop("s", completed=False)
    return draft


def test_a_reduced_draft_head_maps_its_rows_to_target_ids(stories_path, tmp_path):
    full = _drafts(_built(stories_path, stories_path))
    # every row kept, in another order: the mapping alone decides, drafts are unchanged
    order = np.random.default_rng(0).permutation(512)
    permuted = _built(_draft_dir(stories_path, tmp_path, "perm", order), stories_path)
    assert permuted.engine.facts.vocab_size == 512
    got = _drafts(permuted)
    assert got.token_ids.tolist() == full.token_ids.tolist()
    np.testing.assert_allclose(got.confidence(), full.confidence(), rtol=1e-5)
    # a head of 100 rows: drafts are target ids, all inside the kept set, sampled ones too
    keep = np.concatenate([full.token_ids[:2], np.setdiff1d(np.arange(3, 200), full.token_ids[:2])[:98]])
    small = _built(_draft_dir(stories_path, tmp_path, "small", keep), stories_path)
    assert small.engine.facts.vocab_size == 100
    greedy = _drafts(small)
    sampled = _drafts(small, SeqOptions(min_token_prob=0.0, temperature=0.8, seed=3))
    assert greedy.token_ids[:2].tolist() == full.token_ids[:2].tolist()
    for draft in (greedy, sampled):
        assert set(draft.token_ids.tolist()) <= set(keep.tolist())
        assert all(set(ids.tolist()) <= set(keep.tolist()) for ids in draft.prob_token_ids)


def test_a_small_head_without_mapping_and_a_bad_mapping_are_refused(stories_path, tmp_path):
    with pytest.raises(ValueError, match="head has 500 rows.*512 tokens.*draft_vocab.json"):
        _built(_draft_dir(stories_path, tmp_path, "cut", head_rows=500), stories_path)
    with pytest.raises(ValueError, match="draft_vocab.json: target_ids must be distinct ids in"):
        _built(_draft_dir(stories_path, tmp_path, "dup", [5, 5, 6]), stories_path)
    with pytest.raises(ValueError, match="draft_vocab.json: target_ids must be distinct ids in"):
        _built(_draft_dir(stories_path, tmp_path, "out", [5, 512]), stories_path)


def test_a_matching_tokenizer_pair_is_remembered_and_a_changed_one_checked_again(stories_path, smollm_path,
                                                                                  tmp_path, monkeypatch):
    """A draft found to share its target's tokenizer is remembered: later
    starts load neither tokenizer (no transformers import for it), with the
    same vocabulary limit and drafts; a change to the target's files checks
    again; a pair that differs is refused every time and never remembered."""
    import os

    from specdec.models import TOKENIZER_CACHE_ENV
    from specdec.proposer_svc import draft_model

    monkeypatch.setenv(TOKENIZER_CACHE_ENV, str(tmp_path / "tokenizers"))
    draft, target = _draft_dir(stories_path, tmp_path, "draft"), _draft_dir(stories_path, tmp_path, "target")
    first = _built(draft, target)
    entry = draft_model.tokenizer_pair_entry(resolve_model(draft), resolve_model(target))
    assert entry is not None and json.loads(entry.read_text()) == {"target_vocab": 512}

    def no_tokenizer(*args, **kwargs):
        raise AssertionError("loaded a tokenizer")

    monkeypatch.setattr(draft_model, "load_tokenizer", no_tokenizer)
    again = _built(draft, target)
    assert again.config.vocab_limit == first.config.vocab_limit == 512
    assert _drafts(again).token_ids.tolist() == _drafts(first).token_ids.tolist()
    stat = (Path(target) / "tokenizer.json").stat()
    os.utime(Path(target) / "tokenizer.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    with pytest.raises(AssertionError, match="loaded a tokenizer"):  # another key: checked again
        _built(draft, target)
    monkeypatch.undo()
    monkeypatch.setenv(TOKENIZER_CACHE_ENV, str(tmp_path / "tokenizers"))
    for _ in range(2):
        with pytest.raises(ValueError, match="does not share the tokenizer.*vocabulary size 512 .draft. vs 49152"):
            draft_model.shared_target_vocab(draft, smollm_path)
    assert not draft_model.tokenizer_pair_entry(resolve_model(draft), resolve_model(smollm_path)).exists()


def test_draft_threads_flag_reaches_the_draft_engine():
    """`specdec proposer --draft-threads N` sets the draft engine's threads;
    0 is refused, naming the flag."""
    from specdec.cli import build_parser, replica_settings

    def settings(*extra: str):
        return replica_settings(build_parser().parse_args(
            ["proposer", "--methods", "draft", "--draft-model", "some/draft", *extra]))

    assert settings("--draft-threads", "1").draft.engine.num_threads == 1
    assert settings().draft.engine.num_threads is None  # the engine decides
    with pytest.raises(ValueError, match="--draft-threads"):
        settings("--draft-threads", "0").draft.engine.check()  # (checked when the engine is built)


def test_draft_hybrid_runs_the_model_only_where_no_copy_fills_the_budget(engine):
    """A sequence whose n-gram copy fills its k drafts gets that copy and no
    model forward; one without gets the model's draft (the same as draft's),
    from a cache that catches up over the rounds it was skipped."""
    from specdec.proposer_svc.draft_hybrid import DraftHybridProposer
    from specdec.proposer_svc.hybrid import HybridConfig

    hybrid = DraftHybridProposer(_proposer(engine), HybridConfig())
    alone = _proposer(engine)
    repeated = np.concatenate([PROMPT, PROMPT[:3]]).astype(np.int32)  # the copy continues with PROMPT[3:7]
    hybrid.start("copy", repeated, NO_CUT)
    hybrid.start("fresh", PROMPT, NO_CUT)
    alone.start("fresh", PROMPT, NO_CUT)
    copy, fresh = hybrid.propose([("copy", 4), ("fresh", 4)])
    assert copy.token_ids.tolist() == PROMPT[3:7].tolist() and hybrid.model_skipped == 1
    assert engine.cached_len("copy") == 0  # the model never ran for it
    assert fresh.token_ids.tolist() == alone.propose([("fresh", 4)])[0].token_ids.tolist()
    assert len(fresh.token_ids) and hybrid.stats()["model_skipped"] == 1
    # the copy runs out (a token that breaks it): the model drafts from the whole context
    hybrid.extend("copy", np.array([PROMPT[3], 77], dtype=np.int32))
    context = np.concatenate([repeated, [PROMPT[3], 77]]).astype(np.int32)
    alone.start("whole", context, NO_CUT)
    got = hybrid.propose([("copy", 4)])[0].token_ids
    assert hybrid.model_skipped == 1 and len(got)
    assert got.tolist() == alone.propose([("whole", 4)])[0].token_ids.tolist()
    assert engine.cached_len("copy") == len(context) + len(got) - 1
    for seq_id in ("copy", "fresh"):
        hybrid.stop(seq_id, completed=False)
    for seq_id in ("fresh", "whole"):
        alone.stop(seq_id, completed=False)


def test_draft_hybrid_keeps_a_short_copy_worth_more_than_the_models_recent_drafts(engine):
    """A copy shorter than k is kept without a model forward once the
    model's drafts of that sequence have been worth less (model_expect, a
    running mean of their scores); while they are worth more, or before the
    model has drafted for the sequence, the model runs; a sequence without a
    copy always asks the model."""
    from specdec.proposer_svc.draft_hybrid import MODEL_EXPECT_WEIGHT, DraftHybridProposer
    from specdec.proposer_svc.hybrid import HybridConfig

    hybrid = DraftHybridProposer(_proposer(engine), HybridConfig())
    alone = _proposer(engine)
    repeated = np.concatenate([PROMPT, PROMPT[:3]]).astype(np.int32)  # a copy of 7 tokens, k = 12
    hybrid.start("copy", repeated, NO_CUT)
    alone.start("copy", repeated, NO_CUT)
    model_score = alone.propose_scored([("copy", 12)])[0].score
    hybrid.propose([("copy", 12)])  # no running mean yet: the model drafts
    assert hybrid.model_skipped == 0 and engine.cached_len("copy") > 0
    assert hybrid.model_expect["copy"] == pytest.approx(model_score)
    copy_score = max(hybrid.suffix.propose_scored([("copy", 12)])[0][1],
                     ngram_score(7, HybridConfig().ngram_token_prob))
    assert 0 < copy_score < 12

    hybrid.model_expect["copy"] = copy_score - 0.01  # the model's drafts were worth a little less: skipped
    cached = engine.cached_len("copy")
    copy = hybrid.propose([("copy", 12)])[0]
    assert hybrid.model_skipped == 1 and engine.cached_len("copy") == cached
    assert copy.token_ids.tolist() == repeated[3:].tolist() and copy.probs == ()  # one-hot: the copy
    hybrid.model_expect["copy"] = copy_score + 0.01  # worth a little more: the model runs and updates the mean
    hybrid.propose([("copy", 12)])
    assert hybrid.model_skipped == 1
    assert hybrid.model_expect["copy"] == pytest.approx(
        MODEL_EXPECT_WEIGHT * model_score + (1 - MODEL_EXPECT_WEIGHT) * (copy_score + 0.01))

    hybrid.start("fresh", PROMPT, NO_CUT)  # no copy: the model drafts whatever its running mean
    hybrid.model_expect["fresh"] = 0.0
    assert len(hybrid.propose([("fresh", 4)])[0].token_ids) and hybrid.model_skipped == 1
    for seq_id in ("copy", "fresh"):
        hybrid.stop(seq_id, completed=False)
    assert not hybrid.model_expect
    alone.stop("copy", completed=False)


def test_draft_hybrid_model_steps_cap_the_model_and_leave_the_copies_whole(engine):
    """limit_model_steps (SequenceUpdate.model_steps): 0 runs no model
    forward (a sequence without a copy gets no draft, one with a copy its
    whole copy); n > 0 gives the model's n-token draft; a copy at least n
    long is kept without the model. A cap is for one round: advance drops
    the caps of sequences it did not draft for."""
    from specdec.proposer_svc.draft_hybrid import DraftHybridProposer
    from specdec.proposer_svc.hybrid import HybridConfig

    hybrid = DraftHybridProposer(_proposer(engine), HybridConfig())
    alone = _proposer(engine)
    repeated = np.concatenate([PROMPT, PROMPT[:3]]).astype(np.int32)  # a copy of PROMPT[3:]
    hybrid.start("copy", repeated, NO_CUT)
    hybrid.start("fresh", PROMPT, NO_CUT)
    alone.start("fresh", PROMPT, NO_CUT)
    hybrid.limit_model_steps("copy", 0)
    hybrid.limit_model_steps("fresh", 0)
    copy, fresh = hybrid.propose([("copy", 4), ("fresh", 4)])
    assert copy.token_ids.tolist() == PROMPT[3:7].tolist()  # the copy keeps its whole budget
    assert len(fresh.token_ids) == 0 and engine.cached_len("fresh") == 0 and engine.cached_len("copy") == 0
    assert hybrid.model_skipped == 2
    hybrid.limit_model_steps("fresh", 2)
    fresh = hybrid.propose([("fresh", 4)])[0]
    assert fresh.token_ids.tolist() == alone.propose([("fresh", 2)])[0].token_ids.tolist()
    assert len(fresh.token_ids) == 2 and len(fresh.probs) == 2
    hybrid.propose([("fresh", 4)])  # the cap was for one call: the model may make 4 again
    assert engine.cached_len("fresh") == len(PROMPT) + 3
    hybrid.extend("copy", PROMPT[3:4].astype(np.int32))  # the copy continues: 3 tokens left at least
    hybrid.limit_model_steps("copy", 3)
    copy = hybrid.propose([("copy", 6)])[0]
    assert len(copy.token_ids) >= 3 and copy.probs == () and engine.cached_len("copy") == 0
    hybrid.limit_model_steps("fresh", 1)
    hybrid.advance(["fresh"], np.zeros(0, dtype=np.int32), np.zeros(2, dtype=np.int64),
                   np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))  # k = 0: no draft
    assert not hybrid._model_steps
    for seq_id in ("copy", "fresh"):
        hybrid.stop(seq_id, completed=False)
    alone.stop("fresh", completed=False)



def test_an_open_with_model_steps_caps_the_hybrids_model_in_its_first_round(engine):
    """SequenceUpdate.model_steps on an open (the gateway's plan for a
    replica whose model does not pay): the servicer caps the open's first
    draft like any round's, so 0 runs no forward over the prompt, while an
    open without it drafts with the model; out of 0..k it is refused, named."""
    from specdec.proposer_svc.draft_hybrid import DraftHybridProposer
    from specdec.proposer_svc.hybrid import HybridConfig
    from specdec.proposer_svc.server import ProposerServicer
    from specdec.protos.v1 import specdec_pb2 as pb

    hybrid = DraftHybridProposer(_proposer(engine), HybridConfig())
    handle = ProposerServicer({"draft_hybrid": hybrid}).handle
    options = pb.ProposerOptions(method="draft_hybrid")

    def open_(seq_id: str, **steps) -> pb.Draft:
        return handle(pb.ProposeRequest(sequences=[pb.SequenceUpdate(
            seq_id=seq_id, open=True, token_ids=PROMPT.tolist(), context_len=len(PROMPT),
            num_speculative_tokens=3, options=options, **steps)])).drafts[0]

    capped = open_("capped", model_steps=0)
    assert capped.status == pb.SEQUENCE_STATUS_OK and len(capped.token_ids) == 0  # no copy, no model
    assert engine.cached_len("capped") == 0 and hybrid.model_skipped == 1
    whole = open_("whole")
    assert whole.status == pb.SEQUENCE_STATUS_OK and len(whole.token_ids) > 0 and engine.cached_len("whole") > 0
    refused = open_("refused", model_steps=4)
    assert refused.status == pb.SEQUENCE_STATUS_INVALID and refused.message.startswith("model_steps")
    for seq_id in ("capped", "whole"):
        hybrid.stop(seq_id, completed=False)
