"""The gateway's Prometheus metrics (served with ``--metrics-port``).

Request-level figures (finish reasons, tokens, acceptance, time to first
token, latency) and the placement of work: live sequences per replica and
how often a sequence had to move because its replica failed or went away.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

REQUESTS = Counter("specdec_gateway_requests_total",
                   "Requests ended, by outcome: stop, length, cancelled, or the gRPC code of a failure",
                   ["outcome"])
PROMPT_TOKENS = Counter("specdec_gateway_prompt_tokens_total", "Prompt tokens of ended requests")
OUTPUT_TOKENS = Counter("specdec_gateway_output_tokens_total", "Output tokens committed", ["method"])
ROUNDS = Counter("specdec_gateway_sequence_rounds_total",
                 "Sequence-rounds that committed tokens (output / rounds = mean accepted length)", ["method"])
DRAFT_TOKENS = Counter("specdec_gateway_draft_tokens_total", "Draft tokens sent for verification", ["method"])
ACCEPTED_TOKENS = Counter("specdec_gateway_accepted_tokens_total", "Draft tokens accepted", ["method"])
TTFT = Histogram("specdec_gateway_ttft_seconds", "Time from request to its first output token",
                 buckets=_LATENCY_BUCKETS)
LATENCY = Histogram("specdec_gateway_request_seconds", "Time from request to its end", buckets=_LATENCY_BUCKETS)
LIVE = Gauge("specdec_gateway_live_sequences", "Sequences being generated")
ON_REPLICA = Gauge("specdec_gateway_replica_sequences",
                   "Live sequences placed on a replica in the last round", ["kind", "replica"])
ROUND_SECONDS = Histogram("specdec_gateway_round_seconds",
                          "Wall time of one lock-step round (propose + verify + commit) or overlapped step "
                          "(one cohort verified while the other is proposed, then committed)",
                          buckets=_LATENCY_BUCKETS)
PHASE_SECONDS = Histogram("specdec_gateway_phase_seconds",
                          "Wall time of a round's phase (overlapped steps run propose and verify at once; "
                          "propose_ahead: drafting ahead, alongside the round's verify)",
                          ["phase"], buckets=_LATENCY_BUCKETS)
OVERLAPPED_STEPS = Counter("specdec_gateway_overlapped_steps_total",
                           "Overlapped steps: one cohort verified while the other is proposed "
                           "(the rest of the loop's steps are lock-step rounds)")
AHEAD_ROUNDS = Counter("specdec_gateway_ahead_rounds_total",
                       "Rounds that drafted the next round ahead while they were verified (--overlap ahead, "
                       "or on while the proposer's time is worth hiding)")
AHEAD_DRAFTS = Counter("specdec_gateway_ahead_drafts_total",
                       "Drafts verified that were proposed ahead, during the round before, and still held "
                       "(--overlap ahead, or on drafting ahead), by method", ["method"])
AHEAD_BRANCH_DRAFTS = Counter("specdec_gateway_ahead_branch_drafts_total",
                              "Drafts verified that came from a branch of a draft proposed ahead (the round's "
                              "outcome left the draft; --ahead-branches), by method; also counted in "
                              "specdec_gateway_ahead_drafts_total", ["method"])
REPLICA_FAILURES = Counter("specdec_gateway_replica_failures_total",
                           "Calls to a replica that failed or timed out", ["kind", "replica"])
MOVES = Counter("specdec_gateway_sequence_moves_total",
                "Sequences that left their replica (failure or removal) and re-opened on another", ["kind"])
SCORER_NUMERICS_KINDS = Gauge("specdec_gateway_scorer_numerics_kinds",
                              "Distinct arithmetics (ModelInfo.numerics) among the scorer replicas known; above 1, a "
                              "sequence moved between replicas of different ones may take another token at a near-tie")
NUMERICS_MOVES = Counter("specdec_gateway_scorer_numerics_moves_total",
                         "Sequences that moved to another scorer replica, by whether it computes as the one that "
                         "made their tokens: same, or changed (no replica of the same numerics was up)", ["outcome"])
VERIFY_COST = Gauge("specdec_gateway_verify_cost_seconds",
                    "Fitted Verify time of a scorer replica: fixed + per_token * tokens fed", ["replica", "part"])
TRIMMED_DRAFTS = Counter("specdec_gateway_trimmed_draft_tokens_total",
                         "Proposed draft tokens not verified because the adaptive draft length "
                         "judged them not worth their cost", ["method"])
PLAIN_ROUNDS = Counter("specdec_gateway_plain_copy_rounds_total",
                       "Rounds a copy method's sequence decoded plainly, asking its proposer for nothing: its "
                       "drafts were not expected to pay (costs.CopyGates)", ["method"])
PLAIN_DECODE_STEPS = Gauge("specdec_gateway_plain_decode_steps",
                           "Tokens a plain decoding Verify call asks for now: as many as the scorer's passes take "
                           "in --decode-chunk-ms, at most --decode-steps (SpecLoop._decode_steps)")
PLANNED_DRAFT_STEPS = Gauge("specdec_gateway_planned_draft_steps",
                            "Draft tokens the adaptive draft length last asked a model proposer replica for "
                            "(gateway/costs.DraftBudgets; 0: plain decoding)", ["proposer"])
FEATURE_BYTES = Counter("specdec_gateway_feature_bytes_total",
                        "Target feature bytes (bfloat16 hidden states) relayed from scorers to proposers "
                        "(eagle3, mtp)", ["method"])
INVALID_DRAFTS = Counter("specdec_gateway_invalid_drafts_total",
                         "Drafts dropped because a proposer sent garbage", ["replica"])


class PlacementGauge:
    """Keeps ``specdec_gateway_replica_sequences`` to the replicas seen in the
    last round, removing the series of replicas that are gone."""

    def __init__(self) -> None:
        self._shown: set[tuple[str, str]] = set()

    def update(self, counts: dict[tuple[str, str], int]) -> None:
        for key in self._shown - counts.keys():
            ON_REPLICA.remove(*key)
        for key, n in counts.items():
            ON_REPLICA.labels(*key).set(n)
        self._shown = set(counts)
