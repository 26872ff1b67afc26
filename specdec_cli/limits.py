"""Limits and defaults that more than one service applies: decided here once,
imported by the gateway, the proposers and the scorer.

The draft budget is called ``num_speculative_tokens`` everywhere (the most
draft tokens a proposer may return for one sequence in one round; the gRPC
field of the same name carries it). A count of drafts actually proposed or
verified is ``num_drafts``.

Pure Python: no torch, no gRPC, so every layer can import it.
"""
from __future__ import annotations

import random

#: Largest draft budget per sequence and round, checked by the gateway (client
#: requests), the proposer servicer (updates) and the scorer (drafts to verify).
MAX_SPECULATIVE_TOKENS = 16
#: Most branches per draft position a Propose message may ask for
#: (RoundUpdates.branch_width), checked by the proposer servicer.
MAX_BRANCH_WIDTH = 64
#: Branches per draft position the gateway asks for when it drafts ahead
#: (gateway ``--ahead-branches``; 0: none): the tokens the method finds
#: likeliest where the target's tokens leave the draft, each with the draft
#: that follows it, so a round whose draft ahead the outcome contradicts
#: still finds one. Along SmolLM2's greedy answers to bench_overlap's
#: prompts (ngram k=5, every round drafted ahead, the real proposer's
#: drafts and branches; docs/architecture.md): 1.85 tokens a round without
#: branches, 2.03 with 8, 2.06 with 16, 2.11 with 32, 2.14 with 64, 2.15
#: with 200, as lock-step. 64 cost the proposer ~0.12 ms and ~5 kB of
#: answer a sequence there (16: ~0.06 ms, ~1.2 kB; AMD EPYC).
DEFAULT_AHEAD_BRANCH_WIDTH = 64
#: The gateway asks for branches only in messages with at most this many
#: sequences drafting ahead, ``AHEAD_BRANCH_BUDGET // sequences`` per
#: position at most. A branch costs the proposer an ngram lookup and its
#: answer a few bytes (on one machine, the scorer's cores), and a branch
#: draft verified costs the Verify its rows while it is accepted less often
#: than a draft made after the round (the draft planner cannot tell them
#: apart yet). bench_overlap (SmolLM2, 2 cores of an AMD EPYC, against the
#: gateway without branches in the same run): one stream gained (the chat
#: mix 1.09x / 1.07x at 5 / 20 ms), 8 streams lost (0.94x at 5 and 20 ms
#: with 16 branches each, 0.98x / 0.93x with 64; their Verify 3-5 ms longer
#: for 0.83 drafts a round against 0.59, accepted 1.49 tokens against 1.44).
AHEAD_BRANCH_MAX_SEQUENCES = 2
#: Branches per draft position a Propose message asks for, over all its
#: sequences (two get DEFAULT_AHEAD_BRANCH_WIDTH each).
AHEAD_BRANCH_BUDGET = 128
#: Draft budget when a request names none (gateway ``--default-k``).
DEFAULT_NUM_SPECULATIVE_TOKENS = 5
#: Most tokens one Verify may decode for a sequence without drafts
#: (VerifySequence.decode_steps), checked by the scorer.
MAX_DECODE_STEPS = 16
#: Most tokens the gateway asks one Verify to decode for a sequence that
#: never drafts (method "none"), gateway ``--decode-steps``: the per-token
#: round trip (gRPC calls, the gateway's and the client's work) is paid once
#: per call, and the client gets a call's tokens together. How many a call
#: takes below this is set by time (DEFAULT_DECODE_CHUNK_MS).
DEFAULT_DECODE_STEPS = MAX_DECODE_STEPS
#: Plain decoding's calls aim at this much of the scorer's time each
#: (gateway ``--decode-chunk-ms``; 0: always ``--decode-steps`` tokens): as
#: many tokens as its passes take in this time, 1 to ``--decode-steps``,
#: from the passes of the calls before (FIRST_DECODE_STEPS until one is
#: timed). A fixed count of tokens suits one speed only: 4 a call left the
#: stack at 0.85x the engine alone with SmolLM2's ~5 ms passes on 2 cores
#: of an Intel Xeon (0.89x at 8, 0.92x at 16: ``bench_forward.py
#: --stack-decode-steps 1,4,8,16``, fifty-eighth session), and would stream
#: a model with 100 ms passes in 0.4 s groups. 50 ms a call keeps a stream's
#: groups below what a reader notices; a call's round trip costs ~2.3-2.8 ms
#: of CPU across the scorer's gRPC thread, the gateway and the client (the
#: per-call columns of bench_forward's stack rows, sixty-first session): on
#: 2 cores, which the three share with the passes, ~5 % of 50 ms.
DEFAULT_DECODE_CHUNK_MS = 50.0
#: Plain decoding's tokens a call until one call's passes are timed.
FIRST_DECODE_STEPS = 4
#: Rounds in a row a request may make no progress (KV pool full, no scorer
#: replica) before it fails, gateway ``--max-stalled-rounds``; the gateway
#: pauses STALL_SLEEP_S after each (200 x 50 ms: about 10 s of waiting for room).
DEFAULT_MAX_STALLED_ROUNDS = 200
STALL_SLEEP_S = 0.05
#: Output tokens when a request names no ``max_tokens`` (capped by the context).
DEFAULT_MAX_TOKENS = 256
#: Most choices (``n``) one OpenAI-API request may ask for: each is its own
#: sequence with its own KV cache, so a larger n is a larger load.
MAX_HTTP_CHOICES = 4

#: Largest gRPC message every server and client here sends or accepts.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Most target layers one sequence may ask features (hidden states) of:
#: EAGLE-3 uses 3, MTP 1.
MAX_FEATURE_LAYERS = 4
#: Feature bytes one Verify answer or one Propose message carries at most
#: (half the message limit; the rest is room for tokens and probabilities).
#: The scorer cuts first touches' context rows to fit (the last positions
#: are kept), the gateway holds back relays beyond it to the next round.
FEATURE_BYTES_PER_MESSAGE = MAX_MESSAGE_BYTES // 2
#: Bytes of one feature value on the wire (bfloat16).
FEATURE_VALUE_BYTES = 2

# Per-method proposer knobs, used when a request leaves them unset.
DEFAULT_MIN_N = 1  # n-gram: shortest match length
DEFAULT_MAX_N = 4  # n-gram: longest match length (raised to min_n when smaller)
DEFAULT_MAX_TREE_DEPTH = 64  # suffix: longest suffix matched against the trees
DEFAULT_MAX_SPEC_FACTOR = 1.0  # suffix: drafts <= ceil(match_len * factor)
DEFAULT_MIN_TOKEN_PROB = 0.1  # suffix: stop a draft below this estimated probability
#: draft: a sampled draft token comes from the draft model's K most likely
#: tokens (renormalised); its sparse probabilities travel with it.
DEFAULT_DRAFT_TOP_K = 8
#: draft: a Propose message with more sequences than this gets no model drafts
#: (plain decoding for that round): at high batch the scorer's forward is
#: compute-bound and the draft model's steps cost more than they save.
DEFAULT_DRAFT_MAX_BATCH = 64
#: The draft proposer's CPU threads in a stack on one machine (launcher.Stack.draft_threads,
#: ``specdec serve --draft-threads``): the scorer there uses every core and
#: keeps OpenMP's active wait (its forward runs hundreds of parallel regions
#: back to back), so its threads likely still spin when the draft runs, right
#: after a Verify, and a draft on two threads waits for a core at each of its
#: parallel regions. SmolLM2 + a 4-layer bfloat16 draft, chat, AMD EPYC, 2
#: cores, stacks alternating twice: the draft proposer's compute per call
#: 3.9 / 3.7 ms at 1 thread against 5.4 / 5.3 ms at 2 for one draft token,
#: 8.8 / 7.4 against 10.8 / 10.4 for five; draft k=5 37.3 / 41.9 tok/s against
#: 35.4 / 35.8. A draft proposer on a machine or pod of its own keeps the
#: engine's default.
COLOCATED_DRAFT_THREADS = 1

# Verification strategies: the numbers of the proto's VerifyStrategy (a test
# checks that they agree), used by kernels/verify.py.
GREEDY, REJECTION, TARGET_MATCH, TOPP = 1, 2, 3, 4
# Debugging overrides: the numbers of the proto's AcceptPolicy.
POLICY_NORMAL, POLICY_ACCEPT_ALL, POLICY_REJECT_ALL = 0, 1, 2

#: Seeds are kept to 63 bits (they travel as int64 tensors to the kernels).
SEED_MASK = (1 << 63) - 1


def is_greedy(temperature: float) -> bool:
    """Temperature 0 means greedy decoding (argmax), whatever else is set."""
    return temperature == 0


def default_verify_strategy(temperature: float) -> int:
    """The strategy of a request that names none: GREEDY at temperature 0
    (lossless and cheapest), REJECTION (lossless for any sampling) otherwise."""
    return GREEDY if is_greedy(temperature) else REJECTION


def resolve_seed(seed: int | None) -> int:
    """The seed a sequence samples with: the client's (masked to 63 bits), or
    a random one drawn once, so that every round of the request uses it."""
    return (random.getrandbits(63) if seed is None else int(seed)) & SEED_MASK


#: The eagle3/mtp heads' projection weights when no --draft-dtype is given
#: (``specdec proposer``, ``specdec serve``, ``launcher.Stack``): q8_0 blocks
#: quantised at load (HEAD_PROJECTION_DTYPES), about half the bytes
#: bfloat16 reads and a quarter of float32's; the drafts may differ slightly
#: from float32 projections', the output never does. SmolLM2's 30-minute head
#: on 2 cores of an Intel Xeon (CPU model 207), greedy speculation simulated
#: in one process with the real proposer (throwaway
#: ``/work/exp/s59/accept.py``, one thread, k=5): mean accepted length
#: 1.988 / 1.795 (held-out / bench_draft's chat prompts) against bfloat16's
#: 1.951 / 1.789 and float32's 1.951 / 1.795 (q4_1: 1.907 / 1.685, dropped),
#: 4.0 ms a propose call against 4.8 (bfloat16) and 7.2 (float32). Before,
#: bfloat16 halved float32's bytes (AMD EPYC, family 25: a chain step 1.02
#: / 2.10 ms warm / cold against 2.18 / 2.98 in float32).
HEAD_PROJECTION_DTYPE = "q8_0"
#: What a head's projection weights may be (``--draft-dtype`` of a proposer
#: serving eagle3/mtp; ``eagle3.FeatureHead``): float32, bfloat16 (the simd
#: path widens them), or quantised at load into GGUF-style blocks, q8_0 (8.5
#: bits a weight) or q4_1 (5), read by the simd-gguf path. Float32
#: arithmetic in every case; the drafts may differ, the output never. A
#: draft model takes float32 or bfloat16 only.
HEAD_PROJECTION_DTYPES = ("float32", "bfloat16", "q8_0", "q4_1")
