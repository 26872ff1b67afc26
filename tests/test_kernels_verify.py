"""verify(): hand-written cases, seeded determinism, Triton kernels == torch reference."""
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before specdec.kernels defines any @triton.jit

import pytest
import torch

from specdec.kernels import (
    GREEDY,
    POLICY_ACCEPT_ALL,
    POLICY_NORMAL,
    POLICY_REJECT_ALL,
    REJECTION,
    TARGET_MATCH,
    TOPP,
    SamplingTensors,
    SparseDraftProbs,
    filter_stats_reference,
    filtered_probs,
    sample,
    verify,
    verify_reference,
)

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
BACKENDS = ["torch", "triton"]
SEQS = {"torch": 64, "triton": 12}  # many seeds; fewer under the (slow) interpreter
SAMPLED = [REJECTION, TARGET_MATCH, TOPP]


def run(backend: str, logits, drafts, cu, sampling, draft_probs=None):
    return verify(logits, drafts, cu, sampling, draft_probs, use_triton=backend == "triton")


def make_sampling(num_seqs: int, temperature=0.0, top_k=0, top_p=0.0, seed=0, position=0,
                  strategy=GREEDY, policy=POLICY_NORMAL, device: str = DEVICE) -> SamplingTensors:
    """Per-sequence parameters; each argument is a scalar or a list of num_seqs values."""
    def column(value, dtype):
        values = value if isinstance(value, list) else [value] * num_seqs
        return torch.tensor(values, dtype=dtype, device=device)

    return SamplingTensors(temperature=column(temperature, torch.float32), top_k=column(top_k, torch.int32),
                           top_p=column(top_p, torch.float32), seed=column(seed, torch.int64),
                           position=column(position, torch.int64), strategy=column(strategy, torch.int32),
                           accept_policy=column(policy, torch.int32))


def ragged(draft_lists: list[list[int]], device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened drafts (int32 [N]) and inclusive offsets (int32 [B])."""
    flat = [x for drafts in draft_lists for x in drafts]
    counts = torch.tensor([len(d) for d in draft_lists])
    return (torch.tensor(flat, dtype=torch.int32, device=device),
            counts.cumsum(0).to(torch.int32).to(device))


def peaked_logits(argmaxes: list[int], vocab: int, device: str = DEVICE) -> torch.Tensor:
    """One row per entry, with a clear argmax there."""
    logits = torch.zeros(len(argmaxes), vocab, device=device)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def outputs(result) -> list[list[int]]:
    """Output tokens per sequence without the -1 padding."""
    return [[t for t in row if t >= 0] for row in result.output_token_ids.tolist()]


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_accepts_the_matching_prefix(backend):
    # Sequence 0: 4 drafts, third wrong. Sequence 1: no drafts. Sequence 2: all right.
    logits = peaked_logits([3, 1, 4, 1] + [5] + [9] + [2, 6, 5], vocab=10)
    drafts, cu = ragged([[3, 1, 7, 1], [], [2, 6]])
    result = run(backend, logits, drafts, cu, make_sampling(3))
    assert result.num_accepted.tolist() == [2, 0, 2]
    assert result.output_token_ids.tolist() == [[3, 1, 4, -1, -1], [9, -1, -1, -1, -1], [2, 6, 5, -1, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_all_accepted_outputs_the_bonus_token(backend):
    logits = peaked_logits([8, 0, 2, 7], vocab=11)
    drafts, cu = ragged([[8, 0, 2]])
    result = run(backend, logits, drafts, cu, make_sampling(1))
    assert outputs(result) == [[8, 0, 2, 7]] and result.num_accepted.tolist() == [3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_ties_go_to_the_lowest_token_id(backend):
    logits = torch.zeros(2, 6, device=DEVICE)
    logits[:, 2] = logits[:, 4] = 1.0
    drafts, cu = ragged([[4]])
    assert outputs(run(backend, logits, drafts, cu, make_sampling(1))) == [[2]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strategy", SAMPLED)
def test_temperature_zero_is_greedy_for_every_strategy(backend, strategy):
    logits = peaked_logits([3, 1, 4] + [1, 5], vocab=7)
    drafts, cu = ragged([[3, 1], [2]])
    result = run(backend, logits, drafts, cu, make_sampling(2, strategy=strategy, top_k=2, top_p=0.5))
    assert outputs(result) == [[3, 1, 4], [1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_policies(backend):
    logits = peaked_logits([3, 1, 4] + [1, 5, 9], vocab=10)
    drafts, cu = ragged([[0, 0], [1, 5]])  # sequence 0 all wrong, sequence 1 all right
    accept_all = run(backend, logits, drafts, cu, make_sampling(2, policy=POLICY_ACCEPT_ALL))
    assert outputs(accept_all) == [[0, 0, 4], [1, 5, 9]]
    reject_all = run(backend, logits, drafts, cu, make_sampling(2, policy=POLICY_REJECT_ALL))
    assert outputs(reject_all) == [[3], [1]] and reject_all.num_accepted.tolist() == [0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    drafts, cu = ragged([])
    result = run(backend, torch.zeros(0, 5, device=DEVICE), drafts, cu, make_sampling(0))
    assert result.output_token_ids.shape == (0, 1) and result.num_accepted.shape == (0,)


# --------------------------------------------------------------- sampled


def random_logits(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


def target_probs(logits, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    rows = logits.shape[0]
    t = torch.full((rows,), temperature, device=DEVICE)
    k = torch.full((rows,), top_k, dtype=torch.int32, device=DEVICE)
    p = torch.full((rows,), top_p, device=DEVICE)
    return filtered_probs(logits, t, filter_stats_reference(logits, t, k, p))


def repeated(num_seqs: int, logits: torch.Tensor, drafts: list[int]):
    """num_seqs copies of one sequence (its k + 1 logits rows and its drafts)."""
    draft_ids, cu = ragged([drafts] * num_seqs)
    return logits.repeat(num_seqs, 1), draft_ids, cu


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strategy", SAMPLED)
def test_sampled_policies(backend, strategy):
    """accept_all: drafts then the bonus token drawn at position + k; reject_all:
    plain decoding of row 0. Both equal sample() at the same position and seed."""
    num_seqs, vocab, k, position = 6, 13, 3, 40
    logits, drafts, cu = repeated(num_seqs, random_logits(k + 1, vocab, seed=1), [5, 7, 9])
    seeds = list(range(100, 100 + num_seqs))
    common = dict(temperature=0.9, top_k=6, top_p=0.95, seed=seeds, position=position, strategy=strategy)
    accept_all = run(backend, logits, drafts, cu, make_sampling(num_seqs, policy=POLICY_ACCEPT_ALL, **common))
    reject_all = run(backend, logits, drafts, cu, make_sampling(num_seqs, policy=POLICY_REJECT_ALL, **common))
    rows = torch.arange(num_seqs, device=DEVICE) * (k + 1)
    bonus = sample(logits[rows + k], make_sampling(num_seqs, **{**common, "position": position + k}),
                   use_triton=backend == "triton")
    plain = sample(logits[rows], make_sampling(num_seqs, **common), use_triton=backend == "triton")
    assert accept_all.num_accepted.tolist() == [k] * num_seqs
    assert accept_all.output_token_ids.tolist() == [[5, 7, 9, b] for b in bonus.tolist()]
    assert reject_all.num_accepted.tolist() == [0] * num_seqs
    assert reject_all.output_token_ids[:, 0].tolist() == plain.tolist()
    assert len(set(plain.tolist())) > 1  # the seeds do draw different tokens


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_zero_probability_drafts_are_always_rejected(backend, sparse):
    """Drafts outside top-k, with a -inf logit, or outside the vocabulary."""
    num_seqs, vocab = SEQS[backend], 12
    row = random_logits(2, vocab, seed=2)
    row[0, 11] = float("-inf")
    outside_top_k = int(torch.argsort(row[0])[0])  # least likely finite token
    probs = target_probs(row, 1.0, 4, 0.0)
    assert float(probs[0, outside_top_k]) == 0 and float(probs[0, 11]) == 0
    for bad in (outside_top_k, 11, vocab + 3):
        logits, drafts, cu = repeated(num_seqs, row, [bad])
        draft_probs = None
        if sparse:
            ids = torch.tensor([[bad, 0, 1]] * num_seqs, dtype=torch.int32, device=DEVICE)
            draft_probs = SparseDraftProbs(ids, torch.tensor([[0.8, 0.1, 0.1]] * num_seqs, device=DEVICE))
        result = run(backend, logits, drafts, cu,
                     make_sampling(num_seqs, temperature=1.0, top_k=4, seed=list(range(num_seqs)),
                                   strategy=REJECTION), draft_probs)
        assert result.num_accepted.tolist() == [0] * num_seqs
        recovered = result.output_token_ids[:, 0].long()
        assert bool((probs[0, recovered] > 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_rejection_with_q_equal_to_p_accepts_everything(backend):
    num_seqs, vocab, k = SEQS[backend], 9, 3
    row = random_logits(k + 1, vocab, seed=3)
    probs = target_probs(row, 0.8, 5, 0.0)
    drafts = [int(torch.argsort(probs[i], descending=True)[i + 1]) for i in range(k)]  # not the argmax
    logits, draft_ids, cu = repeated(num_seqs, row, drafts)
    q = SparseDraftProbs(torch.arange(vocab, dtype=torch.int32, device=DEVICE).repeat(num_seqs * k, 1),
                         probs[:k].repeat(num_seqs, 1))
    result = run(backend, logits, draft_ids, cu,
                 make_sampling(num_seqs, temperature=0.8, top_k=5, seed=list(range(num_seqs)),
                               strategy=REJECTION), q)
    assert result.num_accepted.tolist() == [k] * num_seqs
    assert bool((result.output_token_ids[:, :k] == torch.tensor(drafts, device=DEVICE)).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_recovered_tokens_come_from_the_residual(backend, sparse):
    """After a rejection the token is drawn from max(p - q, 0): never a token
    with p <= q (for a one-hot draft: never the draft itself), although the
    draft is the likeliest token under p, so a draw from p would often pick it."""
    num_seqs = 40
    row = torch.tensor([[3.0, 2.5, 1.0, 0.0, -1.0]] * 2, device=DEVICE)  # p ~ [.55, .34, .07, .03, .01]
    logits, drafts, cu = repeated(num_seqs, row, [0])
    draft_probs, residual_support = None, {1, 2, 3, 4}
    if sparse:  # q(0) = .9, q(2) = .1: p - q > 0 only at ids 1, 3, 4
        draft_probs = SparseDraftProbs(torch.tensor([[0, 2, 3, 1]] * num_seqs, dtype=torch.int32, device=DEVICE),
                                       torch.tensor([[0.9, 0.1, 0.0, 0.0]] * num_seqs, device=DEVICE))
        residual_support = {1, 3, 4}
    result = run(backend, logits, drafts, cu, make_sampling(num_seqs, temperature=1.0, seed=list(range(num_seqs)),
                                                            strategy=REJECTION), draft_probs)
    rejected = result.num_accepted == 0
    assert 5 <= int(rejected.sum()) < num_seqs
    assert set(result.output_token_ids[rejected, 0].tolist()) <= residual_support


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_hot_rejection_accepts_a_sure_draft(backend):
    """p(x) == 1 (top-k 1) accepts a one-hot draft whatever the uniform."""
    logits, drafts, cu = repeated(20, peaked_logits([4, 2], vocab=8), [4])
    result = run(backend, logits, drafts, cu, make_sampling(20, temperature=1.0, top_k=1, seed=list(range(20)),
                                                            strategy=REJECTION))
    assert outputs(result) == [[4, 2]] * 20


@pytest.mark.parametrize("backend", BACKENDS)
def test_target_match_equals_plain_sampling_token_for_token(backend):
    """Whatever the drafts, output token i is the target's own draw at position + i."""
    num_seqs, vocab, k = 8, 10, 4
    g = torch.Generator().manual_seed(4)
    logits = random_logits(num_seqs * (k + 1), vocab, seed=5, scale=3.0)
    common = dict(temperature=1.0, top_p=0.9, seed=list(range(7, 7 + num_seqs)), position=100)
    # The target's own draws, row by row, from sample() at position + i.
    own = torch.stack([
        sample(logits[i::k + 1], make_sampling(num_seqs, **{**common, "position": 100 + i}),
               use_triton=backend == "triton") for i in range(k + 1)], dim=1)
    # Drafts: the target's draws up to a random point, then a guaranteed miss.
    stop = torch.randint(0, k + 1, (num_seqs,), generator=g)
    draft_lists = [[int(own[b, i]) if i < stop[b] else (int(own[b, i]) + 1) % vocab for i in range(k)]
                   for b in range(num_seqs)]
    drafts, cu = ragged(draft_lists)
    result = run(backend, logits, drafts, cu, make_sampling(num_seqs, strategy=TARGET_MATCH, **common))
    assert result.num_accepted.tolist() == stop.tolist()
    for b in range(num_seqs):
        n = int(stop[b])
        assert result.output_token_ids[b, :n + 1].tolist() == own[b, :n + 1].tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_topp_accepts_exactly_the_drafts_inside_the_top_p_set(backend):
    # softmax([2, 1, 0, -1]) ~ [.64, .24, .09, .03]: top-p 0.5 is {0}, 0.8 is {0, 1}.
    row = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 2, device=DEVICE)
    logits, drafts, cu = repeated(4, row, [1])
    result = run(backend, logits, drafts, cu,
                 make_sampling(4, temperature=1.0, top_p=[0.5, 0.8, 0.0, 1.0], seed=[1, 2, 3, 4], strategy=TOPP))
    assert result.num_accepted.tolist() == [0, 1, 1, 1]
    assert int(result.output_token_ids[0, 0]) == 0  # the only token of the top-p set


# ----------------------------------------------- determinism and batch invariance


def random_batch(num_seqs: int, vocab: int, max_k: int, seed: int, sparse: bool = False, width: int = 4,
                 strategies=(GREEDY, REJECTION, TARGET_MATCH, TOPP), policies=True):
    """A mixed ragged batch: strategies, temperatures (some 0), top-k / top-p
    mixes, policies, drafts that are right (argmax), plausible, or random."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, max_k + 1, (num_seqs,), generator=g)
    logits = torch.randn(int(k.sum()) + num_seqs, vocab, generator=g) * torch.empty(1).uniform_(0.5, 4, generator=g)
    draft_rows = torch.cat([torch.arange(s, s + n) for s, n in zip((k + 1).cumsum(0) - k - 1, k.tolist())])
    choice = torch.randint(0, 3, (draft_rows.numel(),), generator=g)
    drafts = torch.where(choice == 0, logits[draft_rows].argmax(-1),
                         torch.where(choice == 1, torch.multinomial(torch.softmax(logits[draft_rows], -1), 1,
                                                                    generator=g).squeeze(1),
                                     torch.randint(0, vocab, (draft_rows.numel(),), generator=g)))
    pick = lambda options: [options[int(i)] for i in torch.randint(0, len(options), (num_seqs,), generator=g)]
    sampling = make_sampling(
        num_seqs, temperature=pick([0.0, 0.6, 1.0, 1.7]), top_k=pick([0, 0, 1, 3, vocab - 1, vocab + 2]),
        top_p=pick([0.0, 1.0, 0.5, 0.9]), seed=torch.randint(-2**62, 2**62, (num_seqs,), generator=g).tolist(),
        position=torch.randint(0, 5000, (num_seqs,), generator=g).tolist(), strategy=pick(list(strategies)),
        policy=pick([POLICY_NORMAL] * 6 + ([POLICY_ACCEPT_ALL, POLICY_REJECT_ALL] if policies else [])))
    draft_probs = None
    if sparse:
        ids = torch.randint(0, vocab, (drafts.numel(), width), generator=g)
        ids[:, 0] = drafts
        probs = torch.rand(drafts.numel(), width, generator=g)
        probs[:, width - 1] = 0  # a padding entry
        draft_probs = SparseDraftProbs(ids.to(torch.int32).to(DEVICE), (probs / probs.sum(-1, keepdim=True)).to(DEVICE))
    return (logits.to(DEVICE), drafts.to(torch.int32).to(DEVICE), k.cumsum(0).to(torch.int32).to(DEVICE),
            sampling, draft_probs)


def take_sequence(batch, b: int):
    """Sequence b of a batch, alone."""
    logits, drafts, cu, sampling, draft_probs = batch
    start = int(cu[b - 1]) if b else 0
    end = int(cu[b])
    rows = slice(start + b, end + b + 1)
    q = (None if draft_probs is None
         else SparseDraftProbs(draft_probs.token_ids[start:end], draft_probs.probs[start:end]))
    index = torch.tensor([b], device=DEVICE)
    return (logits[rows], drafts[start:end], torch.tensor([end - start], dtype=torch.int32, device=DEVICE),
            sampling.select(index), q)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_a_sequence_gives_the_same_tokens_alone_or_in_any_batch(backend, sparse):
    batch = random_batch(9, 23, 5, seed=6, sparse=sparse, policies=False)
    together = run(backend, *batch)
    assert together.output_token_ids.tolist() == run(backend, *batch).output_token_ids.tolist()  # same seed
    for b in range(9):
        alone = run(backend, *take_sequence(batch, b))
        width = alone.output_token_ids.shape[1]
        assert alone.output_token_ids[0].tolist() == together.output_token_ids[b, :width].tolist(), b
        assert alone.num_accepted.tolist() == together.num_accepted[b:b + 1].tolist()


def test_different_seeds_draw_different_tokens():
    logits, drafts, cu = repeated(40, random_logits(3, 50, seed=7, scale=0.5), [1, 2])
    first = verify_reference(logits, drafts, cu, make_sampling(40, temperature=1.0, seed=list(range(40)),
                                                               strategy=REJECTION))
    second = verify_reference(logits, drafts, cu, make_sampling(40, temperature=1.0, seed=list(range(40, 80)),
                                                                strategy=REJECTION))
    assert first.output_token_ids.tolist() != second.output_token_ids.tolist()
    assert len(set(first.output_token_ids[:, 0].tolist())) > 10


def test_position_changes_the_draws():
    logits, drafts, cu = repeated(40, random_logits(1, 50, seed=8, scale=0.5), [])
    at = lambda position: verify_reference(logits, drafts, cu, make_sampling(
        40, temperature=1.0, seed=3, position=position, strategy=REJECTION)).output_token_ids[:, 0]
    assert at(10).tolist() == at(10).tolist() and at(10).tolist() != at(11).tolist()


# -------------------------------------------------------- Triton == torch


def assert_backends_agree(batch):
    expected = verify_reference(*batch)
    got = verify(*batch, use_triton=True)
    assert got.output_token_ids.tolist() == expected.output_token_ids.tolist()
    assert got.num_accepted.tolist() == expected.num_accepted.tolist()
    return expected


@pytest.mark.parametrize("vocab", [1, 7, 511])
@pytest.mark.parametrize("sparse", [False, True])
def test_triton_matches_reference_up_to_16_drafts(vocab, sparse):
    expected = assert_backends_agree(random_batch(10, vocab, 16, seed=vocab, sparse=sparse))
    assert expected.output_token_ids.shape[1] >= 12  # long drafts were exercised


@pytest.mark.parametrize("sparse", [False, True])
def test_triton_matches_reference_large_vocab(sparse):
    assert_backends_agree(random_batch(4, 32000, 3, seed=11, sparse=sparse, width=8))


@pytest.mark.parametrize("strategy", [GREEDY, REJECTION, TARGET_MATCH, TOPP])
def test_triton_matches_reference_per_strategy(strategy):
    expected = assert_backends_agree(random_batch(8, 37, 6, seed=strategy, strategies=(strategy,)))
    assert expected.num_accepted.sum() > 0


def test_triton_matches_reference_without_drafts():
    batch = random_batch(6, 100, 0, seed=12)
    assert batch[1].numel() == 0
    assert_backends_agree(batch)


# ------------------------------------------------- greedy batches on the host


@pytest.mark.parametrize("seed", range(6))
def test_greedy_batches_on_the_host_equal_the_torch_reference(seed):
    """verify() scans all-greedy CPU batches on the host (so the batch is on
    CPU on any machine); the tokens must be the reference's: ties (few
    distinct logit values), out-of-range drafts, sequences without drafts and
    drafts that are all right."""
    gen = torch.Generator().manual_seed(seed)
    vocab, num_seqs = 13, 9
    draft_lists = []
    for _ in range(num_seqs):
        k = int(torch.randint(0, 7, (1,), generator=gen))
        draft_lists.append(torch.randint(-1, vocab + 2, (k,), generator=gen).tolist())
    drafts, cu = ragged(draft_lists, device="cpu")
    rows = sum(len(d) + 1 for d in draft_lists)
    logits = torch.randint(0, 3, (rows, vocab), generator=gen).float()  # many ties
    # the first two sequences' drafts are the argmaxes, so that long acceptances occur
    for b in range(2):
        start = sum(len(d) + 1 for d in draft_lists[:b])
        for i in range(len(draft_lists[b])):
            drafts[sum(len(d) for d in draft_lists[:b]) + i] = int(logits[start + i].argmax())
    sampling = make_sampling(num_seqs, temperature=[0.0] * num_seqs, strategy=[GREEDY, REJECTION, TARGET_MATCH] * 3,
                             device="cpu")
    expected = verify_reference(logits, drafts, cu, sampling)
    got = verify(logits, drafts, cu, sampling, use_triton=False)
    assert got.output_token_ids.dtype == expected.output_token_ids.dtype == torch.int32
    assert got.output_token_ids.tolist() == expected.output_token_ids.tolist()
    assert got.num_accepted.tolist() == expected.num_accepted.tolist()
    assert expected.num_accepted[:2].tolist() == [len(d) for d in draft_lists[:2]]


def test_greedy_on_the_host_is_taken_only_when_every_sequence_is_greedy(monkeypatch):
    verify_module = importlib.import_module("specdec.kernels.verify")  # the package exports the function
    taken = []
    real = verify_module._verify_greedy_on_host
    monkeypatch.setattr(verify_module, "_verify_greedy_on_host", lambda *a: taken.append(1) or real(*a))
    logits = peaked_logits([3, 1, 4] + [1, 5], vocab=7, device="cpu")  # the host path takes CPU batches
    drafts, cu = ragged([[3, 1], [2]], device="cpu")
    verify(logits, drafts, cu, make_sampling(2, device="cpu"), use_triton=False)
    assert taken == [1]
    for sampled in (make_sampling(2, temperature=[0.0, 1.0], strategy=REJECTION, device="cpu"),
                    make_sampling(2, policy=[POLICY_NORMAL, POLICY_ACCEPT_ALL], device="cpu")):
        verify(logits, drafts, cu, sampled, use_triton=False)
    assert taken == [1]
    verify(logits, drafts, cu, make_sampling(2, temperature=0.7, strategy=GREEDY, device="cpu"), use_triton=False)
    assert taken == [1, 1]  # the GREEDY strategy ignores the temperature
