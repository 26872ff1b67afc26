"""Adaptive draft length (gateway/adaptive.py): the cost fit, the acceptance
estimate and the planner, on hand-made numbers. The end-to-end tests run
with the adaptive policy on (the gateway's default) and check that output is
unchanged."""
from __future__ import annotations

import random

import pytest

from specdec.gateway.adaptive import AcceptanceEstimate, CostModel, plan_draft_lengths


def test_cost_model_recovers_a_linear_cost():
    model = CostModel(forget=0.99, min_samples=8)
    rng = random.Random(0)
    for _ in range(200):
        tokens = rng.randint(8, 200)
        model.observe(tokens, 0.030 + 0.0004 * tokens + rng.gauss(0, 0.0005))
    fixed, per_token = model.estimate()
    assert fixed == pytest.approx(0.030, abs=0.002)
    assert per_token == pytest.approx(0.0004, rel=0.05)


def test_cost_model_waits_for_samples_and_for_varied_token_counts():
    model = CostModel(min_samples=8)
    for _ in range(7):
        model.observe(40, 0.05)
    assert model.estimate() is None  # too few rounds
    model.observe(40, 0.05)
    assert model.estimate() is None  # every round fed the same count: the slope is unknown
    model.observe(0, 1.0)  # ignored: nothing was fed
    model.observe(10, float("nan"))  # ignored
    assert model.samples == 8


def test_cost_model_forgets_old_rounds():
    model = CostModel(forget=0.9)
    for t in range(1, 60):
        model.observe(t % 7 + 1, 0.01 * (t % 7 + 1))  # 10 ms per token, no fixed part
    for t in range(1, 80):
        model.observe(t % 7 + 1, 0.05 + 0.001 * (t % 7 + 1))  # the machine changed
    fixed, per_token = model.estimate()
    assert fixed == pytest.approx(0.05, abs=0.003) and per_token == pytest.approx(0.001, abs=0.0005)


def test_acceptance_learns_from_the_output_that_followed_each_draft():
    est = AcceptanceEstimate(prior=0.5, prior_weight=2.0, decay=1.0)
    tokens = [1, 2, 3]
    est.proposed(3, [4, 5, 6, 7])  # will match 2 of 4
    est.proposed(3, [9])  # wrong at once
    tokens += [4]
    est.resolve(tokens)  # first draft not decided yet, second rejected at its first token
    assert (est.first_hit, est.first_miss, est.cont_hit, est.cont_miss) == (0, 1, 0, 0)
    tokens += [5, 8, 6]
    est.resolve(tokens)  # first token right, then one continuation right, one wrong
    assert (est.first_hit, est.first_miss, est.cont_hit, est.cont_miss) == (1, 1, 1, 1)
    est.proposed(len(tokens), [1, 1])
    tokens += [1, 1, 0]
    est.resolve(tokens)  # fully matched
    assert (est.first_hit, est.first_miss, est.cont_hit, est.cont_miss) == (2, 1, 2, 1)
    assert est.first == pytest.approx((2 + 1) / (3 + 2)) and est.cont == pytest.approx((2 + 1) / (3 + 2))
    assert est.gains(3) == pytest.approx([0.6, 0.36, 0.216])
    assert not est._pending


def test_copying_proposer_learns_a_high_continuation_rate():
    """Wrong about where a copy starts half the time, right once inside it:
    deep draft positions are worth more than a single rate would say."""
    est = AcceptanceEstimate()
    for i in range(200):
        est.record(0 if i % 2 else 5, 5)
    assert 0.4 < est.first < 0.6 and est.cont > 0.9
    g = est.gains(5)
    assert g[4] > 0.35 and all(a >= b for a, b in zip(g, g[1:]))


def test_acceptance_estimate_stays_strictly_between_zero_and_one():
    good, bad = AcceptanceEstimate(), AcceptanceEstimate()
    tokens = []
    for i in range(100):
        good.proposed(len(tokens), [i % 5] * 3)
        bad.proposed(len(tokens), [99])
        tokens += [i % 5] * 3
        good.resolve(tokens)
        bad.resolve(tokens)
    assert 0.9 < good.first < 1.0 and 0.9 < good.cont < 1.0
    assert 0.0 < bad.first < 0.1


def test_young_sequences_lean_on_their_methods_estimate():
    method = AcceptanceEstimate(decay=0.995)
    for _ in range(300):
        AcceptanceEstimate(parent=method).record(4, 4)  # other sequences: always right
    young = AcceptanceEstimate(parent=method)
    assert young.first > 0.95 and young.cont > 0.95
    for _ in range(30):
        young.record(0, 4)  # this one's drafts are always wrong
    assert young.first < 0.1
    assert method.first > 0.8  # 30 bad drafts among ~200 remembered move it a little


def geometric(n: int, a: float) -> list[float]:
    return [a ** j for j in range(1, n + 1)]


def test_plan_keeps_every_draft_while_the_cost_is_unknown_or_flat():
    gains = [geometric(5, 0.1), [], geometric(3, 0.5)]
    assert plan_draft_lengths(gains, [1, 1, 40], None) == [5, 0, 3]
    assert plan_draft_lengths(gains, [1, 1, 40], (0.03, 0.0)) == [5, 0, 3]


def test_plan_one_sequence_on_a_weight_bound_pass_keeps_good_drafts():
    # 25 ms to read the weights, 0.2 ms per extra row: drafts are almost free
    assert plan_draft_lengths([geometric(5, 0.5)], [1], (0.025, 0.0002)) == [5]
    # a hopeless proposer is not worth even a cheap row at some depth
    take = plan_draft_lengths([geometric(8, 0.05)], [1], (0.025, 0.0002))
    assert 0 < take[0] < 8


def test_plan_large_compute_bound_batch_keeps_only_likely_drafts():
    n = 32
    rates = [0.9] * 8 + [0.3] * 24
    take = plan_draft_lengths([geometric(5, r) for r in rates], [1] * n, (0.025, 0.002))
    assert all(t == 0 for t in take[8:])  # unlikely drafts fall back to plain decoding
    assert all(t > 0 for t in take[:8])
    fewer = plan_draft_lengths([geometric(5, r) for r in rates], [1] * n, (0.025, 0.01))
    assert sum(fewer) <= sum(take)


def _throughput(take, gains, base, cost):
    fixed, per_token = cost
    gain = sum(1 + sum(g[:t]) for t, g in zip(take, gains))
    return gain / (fixed + per_token * (sum(base) + sum(take)))


@pytest.mark.parametrize("seed", range(20))
def test_plan_is_at_least_as_good_as_all_or_nothing(seed):
    """On the planner's own model, its choice beats verifying every draft and
    verifying none, and no single-token change improves it."""
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    proposed = [rng.randint(0, 8) for _ in range(n)]
    gains = [AcceptanceEstimate(prior=rng.uniform(0.02, 0.98)).gains(p) for p in proposed]
    base = [1 if rng.random() < 0.8 else rng.randint(2, 100) for _ in range(n)]
    cost = (rng.uniform(0.005, 0.05), rng.uniform(0.00001, 0.005))
    take = plan_draft_lengths(gains, base, cost)
    assert all(0 <= t <= p for t, p in zip(take, proposed))
    best = _throughput(take, gains, base, cost)
    assert best >= _throughput(proposed, gains, base, cost) - 1e-12
    assert best >= _throughput([0] * n, gains, base, cost) - 1e-12
    for i in range(n):
        for delta in (-1, 1):
            other = list(take)
            other[i] += delta
            if 0 <= other[i] <= proposed[i]:
                assert _throughput(other, gains, base, cost) <= best + 1e-12


# ---- in the gateway's loop, against real scorer and proposer processes ------------------

PROMPTS = ["Once upon a time", "Tom had a red ball.", "The sun was hot. The sun was hot. The",
           "Lily went to the park with her mom.", "Ben and his dog ran fast.", "A little bird sang."]


@pytest.fixture(scope="module")
def processes(stories_path, tmp_path_factory):
    from conftest import start_stack

    stack = start_stack(stories_path, tmp_path_factory, "adaptive", methods="ngram")
    yield stack
    stack.stop()


def test_trimmed_drafts_never_change_tokens(processes, stories_path):
    """A scorer made (on paper) expensive per token: the adaptive sequences'
    drafts get trimmed, and most of their rounds decode plainly, asking the
    proposer for nothing (CopyGates: four plain tokens a call beat any
    draft there); fixed-length ones beside them verify every draft, and
    every output equals plain greedy decoding."""
    import asyncio

    from specdec.client import make_request
    from specdec.gateway import metrics
    from specdec.gateway.discovery import ReplicaSet, StaticDiscovery
    from specdec.gateway.loop import LoopConfig, SpecLoop
    from specdec.gateway.request import ModelLimits, parse_request
    from specdec.gateway.sequence import Delta, Sequence
    from specdec.models import load_tokenizer, resolve_model
    from specdec.protos.v1 import specdec_pb2 as pb

    scorer = processes.by_name("scorer")[0].addr
    proposer = processes.by_name("proposer")[0].addr
    tokenizer = load_tokenizer(resolve_model(stories_path))
    limits = ModelLimits(512, 512, (2,))

    def sequence(prompt, method, draft_length):
        request = make_request(prompt, max_tokens=40, method=method, k=6, draft_length=draft_length)
        params = parse_request(request, tokenizer, limits, ("none", "ngram"), "ngram", 6)
        return Sequence("t", params, tokenizer, limits.eos_token_ids, limits.max_model_len)

    async def run_all(loop, seqs):
        async def one(seq):
            loop.submit(seq)
            while True:
                item = await seq.out.get()
                assert isinstance(item, Delta), item
                if item.finish_reason:
                    return seq.tokens[seq.num_prompt:]
        return await asyncio.gather(*(one(s) for s in seqs))

    def trimmed():
        return metrics.TRIMMED_DRAFTS.labels("ngram")._value.get()

    def plain_rounds():
        return metrics.PLAIN_ROUNDS.labels("ngram")._value.get()

    async def run():
        scorers, ngram = ReplicaSet("scorer"), ReplicaSet("proposer-ngram")
        StaticDiscovery({"scorer": (scorers, [scorer]), "ngram": (ngram, [proposer])}).start()
        # a generous propose timeout: on a loaded machine one timed-out Propose marks the proposer down
        # and the sequences run without drafts, leaving nothing to trim
        loop = SpecLoop(scorers, {"ngram": ngram}, vocab_size=512, config=LoopConfig(propose_timeout_s=30.0))
        # 1 ms per pass plus 200 ms per token, as if fitted over many rounds: a draft token pays only
        # at an acceptance rate above ~0.995, which the estimates (decay 0.9, prior 0.6) never reach
        # (at 20 ms per token the threshold was ~0.95, within their reach on copying prompts: flaky)
        loop.costs.models[scorer] = paper = CostModel(forget=1.0, min_samples=1)
        for t in range(1, 10_001):
            paper.observe(t % 50 + 1, 0.001 + 0.2 * (t % 50 + 1))
        loop.start()
        try:
            plain = await run_all(loop, [sequence(p, "none", pb.DRAFT_LENGTH_FIXED) for p in PROMPTS])
            before, plain_before = trimmed(), plain_rounds()
            adaptive = [sequence(p, "ngram", pb.DRAFT_LENGTH_ADAPTIVE) for p in PROMPTS]
            fixed = [sequence(p, "ngram", pb.DRAFT_LENGTH_FIXED) for p in PROMPTS]
            outs = await run_all(loop, adaptive + fixed)
            gated = plain_rounds() - plain_before
            return plain, outs, trimmed() - before, adaptive, fixed, gated
        finally:
            await loop.stop()

    plain, outs, cut, adaptive, fixed, gated = asyncio.run(run())
    assert outs == plain + plain
    assert gated > 0
    assert sum(s.stats.draft_tokens for s in fixed) > 0  # the proposer drafted
    assert cut > 0
    # fixed-length sequences verified every draft their proposer returned
    assert sum(s.stats.draft_tokens for s in fixed) > sum(s.stats.draft_tokens for s in adaptive)
    for seq in fixed:
        assert seq.params.adaptive is False


def test_draft_steps_weigh_a_model_proposer_against_the_verify():
    from specdec.gateway.adaptive import plan_draft_steps

    verify = (0.020, 0.0004)  # a 2-core CPU's SmolLM2 Verify: 20 ms, 0.4 ms per row
    good, poor = [0.9, 0.8, 0.7, 0.6, 0.5], [0.3, 0.1, 0.03, 0.01, 0.003]
    # a proposer with no cost per step: every position worth its Verify row
    # (0.01 * 20 ms < 0.4 ms * the 1.4 tokens expected: not the 4th)
    assert plan_draft_steps([good], 1, verify, (0.001, 0.0)) == 5
    assert plan_draft_steps([poor], 1, verify, (0.001, 0.0)) == 3
    # a draft model at 6.6 ms per step (2 cores shared with the scorer):
    # E/T at K = 4: 4.0 / 49.4 ms; at 5: 4.5 / 56.4 ms
    assert plan_draft_steps([good], 1, verify, (0.001, 0.0066)) == 4
    assert plan_draft_steps([poor], 1, verify, (0.001, 0.0066)) == 0  # plain decoding pays more
    # K = 1: 1.9 / 28.4 ms, 2: 2.5 / 35.4, 3: 2.7 / 42.4
    assert plan_draft_steps([[0.9, 0.6, 0.2, 0.05, 0.01]], 1, verify, (0.001, 0.0066)) == 2
    assert plan_draft_steps([[0.5, 0.4]], 1, verify, (0.001, 0.0066)) == 2  # a shorter budget: at most its length
    assert plan_draft_steps([[0.45, 0.2]], 1, verify, (0.001, 0.0066)) == 1
    # the steps serve every sequence of the round: eight share them (K = 1: 12 / 44 ms, 0: 8 / 33.2)
    assert plan_draft_steps([[0.5, 0.2, 0.05]] * 8, 8, (0.030, 0.0004), (0.001, 0.0066)) == 1
    assert plan_draft_steps([poor] * 8, 8, (0.030, 0.0004), (0.001, 0.0066)) == 0
    assert plan_draft_steps([], 1, verify, (0.001, 0.0066)) == 0
    # asked for nothing, the proposer costs nothing: a fixed part (the catch-up forward, the call) weighs
    # against drafting at all (as fitted for a 4-layer SmolLM2 draft beside its scorer)
    assert plan_draft_steps([[0.45, 0.2]], 1, verify, (0.008, 0.003)) == 0
    assert plan_draft_steps([[0.6, 0.3]], 1, verify, (0.008, 0.003)) == 2


def test_measured_verify_times_take_the_place_of_the_line_where_the_cost_is_a_staircase():
    """A CPU engine runs 2 or 3 rows as 3: a Verify of 1 row 9.5 ms, of 2 or
    3 rows ~12 ms. Fitted over rounds of mostly 2 and 3 rows, the line says
    rows cost nothing and a plain round costs as much as a drafted one; the
    measured mean of each row count seen (CostModel.measured) says what a
    plain round costs, and the plan then decodes plainly where a head's
    drafts do not pay."""
    from specdec.gateway.adaptive import plan_draft_steps

    model = CostModel(min_samples=4)
    for rows in [2, 3] * 40 + [1] * 3 + [2, 3] * 5:
        model.observe(rows, {1: 0.0095, 2: 0.0120, 3: 0.0116}[rows])
    fixed, per_token = model.estimate()
    assert per_token < 0.0005 and fixed + per_token > 0.011  # the line: a 1-row round near 12 ms
    measured = model.measured()
    assert measured.keys() == {1, 2, 3} and abs(measured[1] - 0.0095) < 1e-9 and abs(measured[3] - 0.0116) < 1e-9
    gains, head = [[0.33, 0.12]], (0.0, 0.003)  # a feature head: 3 ms a step, its catch-up included
    # by the line, K = 1: 1.33 / ~14.5 ms beats K = 0: 1 / ~11.2 ms; by the measured times (1 / 9.5 ms
    # against 1.33 / 15 ms) it does not
    assert plan_draft_steps(gains, 1, (fixed, per_token), head) == 1
    assert plan_draft_steps(gains, 1, (fixed, per_token), head, measured) == 0
    # a count seen fewer than MIN_MEASURED times is not used
    model.observe(7, 0.02)
    assert 7 not in model.measured()


def test_a_cost_of_one_length_only_is_counted_per_token():
    """Calls of one draft length (a head asked for k every round) cannot
    split a call's time from a step's: ``estimate`` has none, and
    ``proportional`` counts all of it per step, right at that length."""
    model = CostModel(min_samples=8)
    for _ in range(7):
        model.observe(2, 0.006)
    assert model.estimate() is None and model.proportional() is None  # too few samples
    model.observe(2, 0.006)
    assert model.estimate() is None
    fixed, per_step = model.proportional()
    assert fixed == 0.0 and abs(per_step - 0.003) < 1e-12


def test_the_verify_costs_give_the_measured_wall_times_with_the_rpc_overhead():
    from specdec.gateway.costs import DraftPlan, VerifyCosts

    costs = VerifyCosts()
    assert costs.wall_measured("s:1") == {}
    for _ in range(3):
        costs.observe("s:1", DraftPlan({}, 1, True), 0.0095, 0.0115)  # 2 ms of RPC beyond the compute
        costs.observe("s:1", DraftPlan({}, 3, False), 0.0400, 0.0420)  # a prefill: not a round's cost
    assert costs.wall_measured("s:1").keys() == {1}
    assert abs(costs.wall_measured("s:1")[1] - 0.0115) < 1e-9
