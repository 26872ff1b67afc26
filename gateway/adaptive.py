"""Adaptive draft length: how many of a round's proposed draft tokens are
worth verifying.

A draft token is worth its place in the scorer's forward pass when the output
it is expected to add outweighs what it costs. Both sides are measured while
serving:

- Cost. Each scorer replica's Verify time is fitted online as
  ``fixed + per_token * tokens`` (``CostModel``). On a GPU, or on a CPU with a
  small batch, ``per_token`` is small next to ``fixed`` (reading the weights)
  and every draft is nearly free; with many sequences in the batch the pass
  becomes compute bound and each extra row costs.
- Gain. Each sequence keeps an estimate of the chance that each of its draft
  tokens is accepted (``AcceptanceEstimate``: a first-token rate and a
  continuation rate, leaning on its method's rate while young). It learns
  from every proposed draft, also the tokens that were not verified: once the
  sequence's later output is known, the gateway checks how far the whole
  draft matched it. So a sequence whose drafts were trimmed to nothing still
  finds out when its proposer starts guessing well again. A model draft
  brings better: its own probability of each token, which knows the context
  at hand; its j-th token's chance is the product of those up to j
  (``costs.draft_gains``).

``plan_draft_lengths`` then maximises the expected output tokens per second
of the round: draft tokens are taken in decreasing order of that chance while
each one raises ``(expected tokens) / (expected time)``. With one sequence
and a cheap pass that keeps every draft; with a large batch it keeps only the
drafts likely to be accepted, down to plain decoding. Speculation stays
lossless whatever length is chosen: this changes speed, never tokens.
"""
from __future__ import annotations

import math


class CostModel:
    """Verify time of one scorer replica, ``fixed + per_token * tokens``, fitted
    by least squares with exponential forgetting (recent rounds weigh most);
    beside the fit, the mean time of each token count seen (``measured``),
    which a line cannot follow where the cost is a staircase: the CPU
    engine runs 2 or 3 rows as 3 and 4 to 6 as 6 (SmolLM2 on 2 AVX2 cores of
    an AMD EPYC, eagle3 rounds: 9.5 ms at 1 row, 12.0 at 2, 11.6 at 3, which
    fitted as 14 ms + 0 per token: rows that cost nothing, and a plain
    round 4 ms dearer than it is)."""

    #: a token count's mean is used once it has this many samples
    MIN_MEASURED = 3
    #: weight of a token count's newest sample in its mean
    MEASURED_DECAY = 0.8

    def __init__(self, forget: float = 0.97, min_samples: int = 8) -> None:
        self.forget = forget
        self.min_samples = min_samples
        self.samples = 0
        self._w = self._x = self._xx = self._y = self._xy = 0.0
        self._at: dict[int, tuple[int, float]] = {}  # tokens -> (samples, moving mean seconds)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        f = self.forget
        self._w = f * self._w + 1.0
        self._x = f * self._x + tokens
        self._xx = f * self._xx + tokens * tokens
        self._y = f * self._y + seconds
        self._xy = f * self._xy + tokens * seconds
        self.samples += 1
        n, mean = self._at.get(tokens, (0, seconds))
        self._at[tokens] = (n + 1, self.MEASURED_DECAY * mean + (1 - self.MEASURED_DECAY) * seconds if n else seconds)

    def measured(self) -> dict[int, float]:
        """The mean seconds of each token count seen at least MIN_MEASURED times."""
        return {tokens: mean for tokens, (n, mean) in self._at.items() if n >= self.MIN_MEASURED}

    def proportional(self) -> tuple[float, float] | None:
        """(0, mean seconds per token) once there are min_samples: all the
        time counted per token, for samples whose token counts hardly vary
        (``estimate`` cannot split them); right at the count they share."""
        if self.samples < self.min_samples or self._x <= 0.0:
            return None
        return 0.0, self._y / self._x

    def estimate(self) -> tuple[float, float] | None:
        """(fixed_s, per_token_s), or None until the rounds seen so far had
        enough different token counts to tell the two apart."""
        if self.samples < self.min_samples:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < 1e-9 * max(1.0, mean_x * mean_x) or var_x < 0.25:
            return None
        per_token = (self._xy / self._w - mean_x * mean_y) / var_x
        per_token = max(0.0, per_token)
        fixed = max(0.0, mean_y - per_token * mean_x)
        if fixed == 0.0 and per_token == 0.0:
            return None
        return fixed, per_token


class AcceptanceEstimate:
    """How likely a sequence's draft tokens are to be accepted, learnt from how
    far each proposed draft matched the output that followed it.

    Two rates: ``first``, that a draft's first token is accepted, and
    ``cont``, that a token is accepted given the one before it was (a proposer
    that copies a passage is often wrong about where a copy starts and rarely
    once it is in one). The j-th token of a draft is then accepted with
    probability ``first * cont ** (j - 1)``. A sequence with little history
    leans on ``parent``, the running estimate of all sequences of its method.
    """

    def __init__(self, parent: "AcceptanceEstimate | None" = None, prior: float = 0.6,
                 prior_weight: float = 1.0, decay: float = 0.9) -> None:
        self.parent = parent
        self.prior = prior
        self.prior_weight = prior_weight
        self.decay = decay  # per resolved draft: recent drafts weigh most
        self.first_hit = self.first_miss = 0.0
        self.cont_hit = self.cont_miss = 0.0
        self._pending: list[tuple[int, list[int]]] = []  # (start, draft tokens)

    @property
    def first(self) -> float:
        prior = self.parent.first if self.parent is not None else self.prior
        return (self.first_hit + prior * self.prior_weight) / (
            self.first_hit + self.first_miss + self.prior_weight)

    @property
    def cont(self) -> float:
        prior = self.parent.cont if self.parent is not None else self.prior
        return (self.cont_hit + prior * self.prior_weight) / (
            self.cont_hit + self.cont_miss + self.prior_weight)

    def gains(self, n: int) -> list[float]:
        """Acceptance probability of draft positions 1..n."""
        first, cont = self.first, self.cont
        return [first * cont ** j for j in range(n)]

    def proposed(self, start: int, draft: list[int]) -> None:
        """A draft proposed to continue the context at token index ``start``."""
        if draft:
            self._pending.append((start, list(draft)))

    def resolve(self, tokens: list[int]) -> None:
        """Scores pending drafts against the context as it now stands; a draft
        is resolved at its first mismatch or once it is fully covered."""
        keep = []
        for start, draft in self._pending:
            known = tokens[start:start + len(draft)]
            matched = 0
            while matched < len(known) and known[matched] == draft[matched]:
                matched += 1
            if matched < len(known) or len(known) == len(draft):
                self.record(matched, len(draft))
            else:
                keep.append((start, draft))
        self._pending = keep

    def record(self, matched: int, length: int) -> None:
        """One resolved draft of ``length`` tokens whose first ``matched`` were right."""
        d = self.decay
        self.first_hit, self.first_miss = d * self.first_hit + (matched > 0), d * self.first_miss + (matched == 0)
        if matched > 0:  # positions 2..length, each given its predecessor was right
            missed = matched < length
            self.cont_hit = d * self.cont_hit + (matched - 1)
            self.cont_miss = d * self.cont_miss + missed
        if self.parent is not None:
            self.parent.record(matched, length)


def plan_draft_lengths(gains: list[list[float]], base_tokens: list[int],
                       cost: tuple[float, float] | None) -> list[int]:
    """Draft tokens to verify per sequence.

    gains: per sequence, the acceptance probability of each proposed draft
    token (non-increasing); base_tokens: tokens each sequence feeds anyway
    (1, or a prefill); cost: the scorer replica's (fixed_s, per_token_s),
    None when not known yet (everything proposed is verified)."""
    if cost is None or cost[1] <= 0.0:
        return [len(g) for g in gains]
    fixed, per_token = cost
    expected = float(len(gains))  # every sequence outputs one token per round
    time = fixed + per_token * sum(base_tokens)
    take = [0] * len(gains)
    # candidates in decreasing expected gain; each sequence's come in order
    candidates = sorted(((g, i) for i, seq in enumerate(gains) for g in seq), key=lambda c: -c[0])
    for g, i in candidates:
        if g * time <= per_token * expected:  # would not raise expected / time
            break
        take[i] += 1
        expected += g
        time += per_token
    return take


def plan_draft_steps(gains: list[list[float]], base_tokens: int, verify: tuple[float, float],
                     propose: tuple[float, float], measured: dict[int, float] | None = None) -> int:
    """Draft tokens to ask a model proposer for, per sequence, this round.

    A model proposer pays one forward per draft token (its sequences draft
    together, so a round costs as many steps as the longest draft asked),
    before the Verify can start: ask for K tokens where the expected output
    per second of the round is highest,

        E(K) = n + sum over sequences of their gains up to K
        T(K) = [K > 0] (propose_fixed + propose_per_step K) + verify_fixed + verify_per_token (base + drafts)

    (asked for nothing, a model proposer runs no forward: the tokens it
    missed are fed with the next draft it makes, in that draft's first one).

    gains: per sequence, the expected acceptance of each draft position up to
    its budget (non-increasing, from its history: the draft's own confidence
    only exists once drafted); base_tokens: rows the Verify feeds anyway;
    verify / propose: (fixed_s, per_token_s) and (fixed_s, per_step_s);
    measured: a Verify's seconds by the rows it feeds where seen
    (``CostModel.measured``), which take the place of the fit's.
    K = 0 asks for nothing (plain decoding this round)."""
    v_fixed, v_token = verify
    p_fixed, p_step = propose
    best_k, best_rate = 0, 0.0
    expected, fed = float(len(gains)), base_tokens
    for k in range(max((len(g) for g in gains), default=0) + 1):
        if k:
            expected += sum(g[k - 1] for g in gains if len(g) >= k)
            fed += sum(1 for g in gains if len(g) >= k)
        verify_s = (measured or {}).get(fed, v_fixed + v_token * fed)
        rate = expected / ((p_fixed + p_step * k if k else 0.0) + verify_s)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
