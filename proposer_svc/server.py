"""The Proposer gRPC servicer: translates the batched bidi stream into plain
calls on the proposer algorithms (which never see protobuf messages)."""
from __future__ import annotations

import logging
import time

import grpc
import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from specdec.proposer_svc.base import Proposer, SeqOptions, UnknownSequence
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_SPECULATIVE_TOKENS = 16

PROPOSE_BATCHES = Counter("specdec_proposer_batches_total", "Propose messages handled")
DRAFT_TOKENS = Counter("specdec_proposer_draft_tokens_total", "Draft tokens returned", ["method"])
LIVE_SEQUENCES = Gauge("specdec_proposer_live_sequences", "Sequences with proposer state")
BATCH_SECONDS = Histogram("specdec_proposer_batch_seconds", "Compute time per Propose message")
PROPOSER_STATE = Gauge("specdec_proposer_state", "Proposer gauges: memory_bytes, tree_nodes, "
                       "cached_requests, live_sequences", ["method", "key"])
STATE_EVERY_S = 1.0  # how often the proposer gauges are refreshed


class InvalidUpdate(ValueError):
    """A sequence update is malformed; the message names the field."""


def _options(msg: pb.ProposerOptions, methods: dict[str, Proposer]) -> SeqOptions:
    """Zero means "default" for the knobs that cannot be zero; min_token_prob
    is taken as sent (the gateway always fills it)."""
    if msg.method not in methods:
        raise InvalidUpdate(f"options.method: unknown or not served here: {msg.method!r} "
                            f"(served: {sorted(methods)})")
    min_n, max_n = msg.min_n or 1, msg.max_n or 4
    if not 1 <= min_n <= max_n:
        raise InvalidUpdate(f"options.min_n/max_n: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
    depth = msg.max_tree_depth or 64
    if depth < 1:
        raise InvalidUpdate(f"options.max_tree_depth: must be >= 1, got {depth}")
    factor = msg.max_spec_factor or 1.0
    prob = msg.min_token_prob
    if factor <= 0 or not 0.0 <= prob <= 1.0:
        raise InvalidUpdate("options.max_spec_factor must be > 0 and min_token_prob in [0, 1]")
    return SeqOptions(min_n=min_n, max_n=max_n, max_tree_depth=depth,
                      max_spec_factor=factor, min_token_prob=prob,
                      reference_token_ids=np.asarray(msg.reference_token_ids, dtype=np.int32))


class ProposerServicer(pb_grpc.ProposerServicer):
    """Serves the methods in `proposers`; per-sequence state lives in them."""

    def __init__(self, proposers: dict[str, Proposer]) -> None:
        self.proposers = proposers
        self._method_of: dict[str, str] = {}  # seq_id -> method name
        self._owner: dict[str, object] = {}  # seq_id -> the stream that opened it
        self._state_at = float("-inf")  # when the proposer gauges were last refreshed

    async def Propose(self, request_iterator, context):
        """Sequences belong to the stream that opened them: when the stream
        ends (the gateway went away or reset it) their state is freed."""
        owner = object()
        try:
            async for request in request_iterator:
                start = time.perf_counter()
                response = self.handle(request, owner)
                response.compute_s = time.perf_counter() - start
                BATCH_SECONDS.observe(response.compute_s)
                PROPOSE_BATCHES.inc()
                self._refresh_state()
                yield response
        finally:
            for seq_id in [s for s, o in self._owner.items() if o is owner]:
                self._stop(seq_id, completed=False)
            LIVE_SEQUENCES.set(len(self._method_of))

    def handle(self, request: pb.ProposeRequest, owner: object = None) -> pb.ProposeResponse:
        """Applies releases, then updates, then drafts all sequences of one
        message (one `propose` call per method)."""
        for release in request.releases:
            self._stop(release.seq_id, release.completed)
        drafts = [pb.Draft(seq_id=u.seq_id) for u in request.sequences]
        wanted: dict[str, list[tuple[int, str, int]]] = {}  # method -> (index, seq_id, k)
        for i, update in enumerate(request.sequences):
            try:
                method = self._apply_update(update, owner)
            except InvalidUpdate as e:
                drafts[i].status, drafts[i].message = pb.SEQUENCE_STATUS_INVALID, str(e)
                continue
            except UnknownSequence:
                drafts[i].status = pb.SEQUENCE_STATUS_UNKNOWN_SEQUENCE
                drafts[i].message = "no proposer state for this sequence; re-open it"
                continue
            if update.num_speculative_tokens > 0:
                wanted.setdefault(method, []).append((i, update.seq_id, update.num_speculative_tokens))
        for method, items in wanted.items():
            results = self.proposers[method].propose([(seq_id, k) for _, seq_id, k in items])
            for (i, _, k), draft in zip(items, results):
                drafts[i].token_ids.extend(draft.token_ids[:k].tolist())
                if draft.probs is not None:
                    for ids, probs in zip(draft.prob_token_ids[:k], draft.probs[:k]):
                        drafts[i].probs.add(token_ids=ids.tolist(), probs=probs.tolist())
                DRAFT_TOKENS.labels(method).inc(len(drafts[i].token_ids))
        LIVE_SEQUENCES.set(len(self._method_of))
        return pb.ProposeResponse(batch_id=request.batch_id, drafts=drafts)

    def _refresh_state(self) -> None:
        """Exports each proposer's stats() (bounded memory, tree size) at most
        once per STATE_EVERY_S."""
        now = time.monotonic()
        if now - self._state_at < STATE_EVERY_S:
            return
        self._state_at = now
        for method, proposer in self.proposers.items():
            for key, value in proposer.stats().items():
                PROPOSER_STATE.labels(method, key).set(value)

    def _stop(self, seq_id: str, completed: bool) -> None:
        method = self._method_of.pop(seq_id, None)
        self._owner.pop(seq_id, None)
        if method is not None:
            self.proposers[method].stop(seq_id, completed)

    def _apply_update(self, update: pb.SequenceUpdate, owner: object) -> str:
        if not update.seq_id:
            raise InvalidUpdate("seq_id: must not be empty")
        if not 0 <= update.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidUpdate(f"num_speculative_tokens: must be in 0..{MAX_SPECULATIVE_TOKENS}, "
                                f"got {update.num_speculative_tokens}")
        tokens = np.asarray(update.token_ids, dtype=np.int32)
        if len(tokens) and tokens.min() < 0:
            raise InvalidUpdate("token_ids: negative token id")
        if update.open:
            options = _options(update.options, self.proposers)
            self._stop(update.seq_id, completed=False)
            method = update.options.method
            self.proposers[method].start(update.seq_id, tokens, options)
            self._method_of[update.seq_id] = method
            self._owner[update.seq_id] = owner
        else:
            method = self._method_of.get(update.seq_id)
            if method is None:
                raise UnknownSequence(update.seq_id)
            if len(tokens):
                self.proposers[method].extend(update.seq_id, tokens)
        if update.context_len and self.proposers[method].context_len(update.seq_id) != update.context_len:
            self._stop(update.seq_id, completed=False)
            raise UnknownSequence(update.seq_id)
        return method


async def serve(host: str, port: int, methods: list[str], metrics_port: int = 0,
                max_cached_requests: int = 1000) -> None:
    from specdec.proposer_svc.registry import build_proposers
    from specdec.proposer_svc.suffix import SuffixConfig
    from specdec.servers import Server, start_metrics

    try:
        proposers = build_proposers(methods, SuffixConfig(max_cached_requests=max_cached_requests))
    except ValueError as e:
        raise SystemExit(f"--methods: {e}") from None
    server = Server(host, port, ["Proposer"])
    pb_grpc.add_ProposerServicer_to_server(ProposerServicer(proposers), server.server)
    start_metrics(metrics_port)
    log.info("proposer serving %s on %s:%d", sorted(proposers), host, server.port)
    print(f"proposer listening on {host}:{server.port}", flush=True)
    await server.run_until_signal()
