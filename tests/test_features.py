"""Target features (EAGLE-3 / MTP drafting) from the scorer through the
gateway to a proposer: real scorer and gateway processes on stories260K, and
a recording Proposer gRPC server in this process that asks for layers 1, 3
and 5 (the eagle3 proposer itself lives on another branch)."""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from conftest import assert_features_match, bf16_values, hf_layer_states, hf_model, start_stack
from test_faults import _busiest, _moves, _run_all

from specdec.client import make_request, stream
from specdec.gateway.sequence import FeatureBlock, FeatureRelay
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc

LAYERS = (1, 3, 5)  # stories260K has 5 layers: 5 is the last layer's output, before the final norm
HIDDEN = 64


# ---- the gateway's per-sequence relay state (pure) --------------------------------


def block(start: int, rows: int, dim: int = 2) -> FeatureBlock:
    """Rows whose every value is its position (as one byte pair)."""
    return FeatureBlock(start, rows, dim, b"".join(bytes([p, 0]) * dim for p in range(start, start + rows)))


def test_relay_keeps_one_contiguous_block_from_what_the_proposer_needs():
    relay = FeatureRelay()
    relay.opened((1, 3), features_from=2)
    assert relay.context_rows(10) == 8  # a prefill returns positions 2..9
    relay.receive(block(0, 12))  # rows 0, 1 were not asked for
    relay.receive(block(11, 3))  # overlaps row 11: kept once
    relay.receive(None)
    assert relay.received == 14 and relay.context_rows(15) == 1
    assert relay.take(10**6, alone=False) == block(2, 12)
    assert relay.take(10**6, alone=False) is None
    relay.receive(block(20, 2))  # a gap (a cut window): the newer rows stand alone
    relay.receive(block(22, 1))
    assert relay.take(5, alone=False) is None  # 12 bytes: waits for the next message
    assert relay.take(8, alone=True) == block(21, 2)  # alone in a message: its last rows that fit
    relay.opened((1, 3), features_from=0)
    assert relay.pending is None and relay.context_rows(30) == 30


def test_propose_messages_relay_rows_within_their_byte_budget(monkeypatch):
    """Rows ride the updates of a Propose message up to the budget; what does
    not fit waits for the next message; an open carries none; the relayed
    bytes are counted in the sequence's stats."""
    from test_gateway_round import _params, _Tokenizer

    from specdec.gateway import wire
    from specdec.gateway.sequence import Sequence

    monkeypatch.setattr(wire, "FEATURE_BYTES_PER_MESSAGE", 40)
    seqs = [Sequence(name, _params("eagle3", 4), _Tokenizer(), (), 100) for name in "abc"]
    for seq, rows in zip(seqs, (6, 5, 2)):
        seq.proposer_len = len(seq.tokens)  # opened: updates carry rows
        seq.proposer_opened((1, 3), 0)
        seq.features.receive(block(0, rows))  # 4 bytes a row
    seqs[2].proposer_len = 0  # c must re-open
    first = wire.propose_request(seqs, []).request
    assert [u.features.rows for u in first.sequences] == [6, 0, 0]  # b's 20 bytes do not fit in 16
    assert not first.sequences[2].HasField("features") and first.sequences[2].open
    second = wire.propose_request(seqs[1:2], []).request
    assert second.sequences[0].features == pb.Features(start=0, rows=5, dim=2, data=block(0, 5).data)
    assert [s.stats.feature_bytes for s in seqs] == [24, 20, 0]


# ---- a recording proposer ---------------------------------------------------------


class FeatureRecorder(pb_grpc.ProposerServicer):
    """Answers opens with feature_layers LAYERS from position 0 and drafts by
    a trivial lookup (the tokens after the last earlier occurrence of the
    newest token). Records every relayed row and checks at every update
    that brings tokens or rows that the rows it holds cover exactly
    positions features_from .. context_len - 2.

    forget_after > 0: after that many updates of a sequence it loses the
    sequence once (answers UNKNOWN_SEQUENCE, as a restarted replica would)
    and, re-opened, asks only for the last ``window`` positions."""

    def __init__(self, forget_after: int = 0, window: int = 0) -> None:
        self.forget_after, self.window = forget_after, window
        self.tokens: dict[str, list[int]] = {}
        self.method: dict[str, str] = {}
        self.rows: dict[str, dict[int, bytes]] = {}  # seq_id -> position -> row
        self.first: dict[str, int] = {}  # seq_id -> features_from of its last open
        self.updates: dict[str, int] = {}
        self.forgotten: set[str] = set()
        self.bytes: dict[str, int] = {}
        self.unchanged = 0  # updates with neither tokens nor rows (after a failed Verify)
        self.problems: list[str] = []

    async def Propose(self, request_iterator, context):
        async for request in request_iterator:
            yield pb.ProposeResponse(batch_id=request.batch_id,
                                     drafts=[self._update(u) for u in request.sequences])

    def _update(self, u: pb.SequenceUpdate) -> pb.Draft:
        if u.open:
            if u.HasField("features"):
                self.problems.append(f"{u.seq_id}: features sent with an open")
            self.tokens[u.seq_id], self.method[u.seq_id] = list(u.token_ids), u.options.method
            self.rows[u.seq_id] = {}
            self.bytes.setdefault(u.seq_id, 0)
            first = max(0, len(u.token_ids) - self.window) if u.seq_id in self.forgotten else 0
            self.first[u.seq_id] = first
            return pb.Draft(seq_id=u.seq_id, feature_layers=LAYERS, features_from=first)
        self.updates[u.seq_id] = self.updates.get(u.seq_id, 0) + 1
        if self.updates[u.seq_id] == self.forget_after:
            self.forgotten.add(u.seq_id)
            return pb.Draft(seq_id=u.seq_id, status=pb.SEQUENCE_STATUS_UNKNOWN_SEQUENCE)
        tokens = self.tokens[u.seq_id]
        tokens += u.token_ids
        if u.HasField("features"):
            f = u.features
            row = f.dim * 2
            if f.dim != HIDDEN * len(LAYERS) or len(f.data) != f.rows * row:
                self.problems.append(f"{u.seq_id}: features of shape {f.rows}x{f.dim}, {len(f.data)} bytes")
            for r in range(f.rows):
                self.rows[u.seq_id][f.start + r] = f.data[r * row:(r + 1) * row]
            self.bytes[u.seq_id] += len(f.data)
        if not u.token_ids and not u.HasField("features"):
            # the sequence's last Verify failed (its scorer died before the first rows came):
            # the gateway asks again for the same context, whose rows no scorer has made yet
            self.unchanged += 1
        elif sorted(self.rows[u.seq_id]) != list(range(self.first[u.seq_id], len(tokens) - 1)):
            self.problems.append(f"{u.seq_id}: context_len {len(tokens)}, rows at "
                                 f"{sorted(self.rows[u.seq_id])[-3:]} ({len(self.rows[u.seq_id])} rows)")
        return pb.Draft(seq_id=u.seq_id, token_ids=lookup_drafts(tokens, u.num_speculative_tokens))

    def assert_rows_are_the_targets_hidden_states(self, path: str) -> None:
        """Every recorded row equals transformers' states of its position in
        the context the proposer holds, layer by layer, within bfloat16 rounding."""
        model = hf_model(path)[0]
        for seq_id, tokens in self.tokens.items():
            first, n = self.first[seq_id], len(tokens) - 1
            rows = b"".join(self.rows[seq_id][p] for p in range(first, n))
            got = bf16_values(rows).view(n - first, len(LAYERS), HIDDEN)
            want = hf_layer_states(model, tokens[:n])
            for j, layer in enumerate(LAYERS):
                assert_features_match(got[:, j], want[layer][first:])


def lookup_drafts(tokens: list[int], k: int) -> list[int]:
    for i in range(len(tokens) - 2, -1, -1):
        if tokens[i] == tokens[-1]:
            return tokens[i + 1:i + 1 + k]
    return []


class RecordingProposerServer:
    """A real gRPC Proposer server (own event loop thread) around a FeatureRecorder."""

    def __init__(self, recorder: FeatureRecorder) -> None:
        self.recorder = recorder
        ready = threading.Event()

        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            server = grpc.aio.server()
            pb_grpc.add_ProposerServicer_to_server(self.recorder, server)
            self.port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self._stop = asyncio.Event()
            ready.set()
            await self._stop.wait()
            await server.stop(0)

        self._thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
        self._thread.start()
        assert ready.wait(30)
        self.addr = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture
def proposer(request):
    """A recording proposer server; ``@pytest.mark.parametrize("proposer", [kwargs], indirect=True)``
    passes FeatureRecorder arguments."""
    server = RecordingProposerServer(FeatureRecorder(**getattr(request, "param", {})))
    yield server
    server.stop()


def feature_stack(path, tmp_path_factory, proposer, name, **kwargs):
    """Scorer(s) + gateway serving eagle3 and mtp from the recording proposer."""
    return start_stack(path, tmp_path_factory, name, num_proposers=0, metrics=True, default_method="eagle3",
                       extra_gateway_args=["--proposer", f"eagle3={proposer.addr}",
                                           "--proposer", f"mtp={proposer.addr}", "--propose-timeout-ms", "5000"],
                       **kwargs)


PROMPTS = ["Once upon a time", "Tom had a red ball. Tom had a red ball. Tom", "Lily went to the park."]


def test_features_reach_the_proposer_for_every_position_and_change_no_token(stories_path, tmp_path_factory,
                                                                            proposer):
    stack = feature_stack(stories_path, tmp_path_factory, proposer, "features")
    recorder = proposer.recorder
    try:
        gens = {}
        for method in ("eagle3", "mtp"):
            for prompt in PROMPTS:
                request = make_request(prompt, max_tokens=60, method=method, k=4)
                request.ignore_eos = True
                before = set(recorder.tokens)
                gen = stream(stack.gateway_addr, request)
                (seq_id,) = set(recorder.tokens) - before
                plain = make_request(prompt, max_tokens=60, method="none")
                plain.ignore_eos = True
                assert gen.token_ids == stream(stack.gateway_addr, plain).token_ids
                assert recorder.method[seq_id] == method
                assert gen.stats.feature_bytes == recorder.bytes[seq_id] > 0
                gens[seq_id] = gen
        assert not recorder.problems, recorder.problems[:5]
        assert recorder.unchanged == 0  # without a failure every update brings tokens
        assert sum(g.stats.accepted_tokens for g in gens.values()) > 0  # some rounds ran several rows
        recorder.assert_rows_are_the_targets_hidden_states(stories_path)
        samples = stack.by_name("gateway")[0].metrics()
        relayed = sum(samples.get(f'specdec_gateway_feature_bytes_total{{method="{m}"}}', 0.0)
                      for m in ("eagle3", "mtp"))
        assert relayed == sum(recorder.bytes.values())
        # an unknown method is still refused by name
        with pytest.raises(grpc.RpcError) as info:
            stream(stack.gateway_addr, make_request("Once", max_tokens=4, method="medusa"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "speculation.method" in info.value.details()
        # the scorer names a bad feature layer
        with grpc.insecure_channel(stack.by_name("scorer")[0].addr) as ch:
            bad = pb.VerifySequence(seq_id="bad", context_token_ids=[1, 2], feature_layers=[1, 9])
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.ScorerStub(ch).Verify(pb.VerifyRequest(sequences=[bad]), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sequences[0].feature_layers[1]" in info.value.details()
            assert pb_grpc.ScorerStub(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=30).num_layers == 5
    finally:
        stack.stop()


def test_killing_a_scorer_replica_keeps_full_and_correct_features(stories_path, tmp_path_factory, proposer):
    """The killed scorer's sequences re-prefill on the other replica, which
    returns the rows the proposer still lacks: coverage stays exact, rows
    stay the target's, and output is identical to an undisturbed run."""
    stack = feature_stack(stories_path, tmp_path_factory, proposer, "features-two-scorers", num_scorers=2)
    try:
        undisturbed = _run_all(stack.gateway_addr, method="eagle3", k=4, max_tokens=100)
        killed = []
        disturbed = _run_all(stack.gateway_addr, method="eagle3", k=4, max_tokens=100,
                             on_first=lambda: killed.append(_busiest(stack, "scorer")) or killed[0].kill())
        assert killed and killed[0].proc.poll() is not None
        assert _moves(stack, "scorer") > 0
        assert disturbed == undisturbed
        assert not proposer.recorder.problems, proposer.recorder.problems[:5]
        proposer.recorder.assert_rows_are_the_targets_hidden_states(stories_path)
    finally:
        stack.stop()


@pytest.mark.parametrize("proposer", [{"forget_after": 6, "window": 8}], indirect=True)
def test_a_reopened_proposer_gets_the_features_it_asks_for(stories_path, tmp_path_factory, proposer):
    """A proposer that lost its sequences (as a restarted replica) re-opens
    them asking for the last 8 positions only: the gateway re-prefills them on
    the scorer for those rows, the proposer holds exactly features_from ..
    context_len - 2 from then on, and no token changes."""
    stack = feature_stack(stories_path, tmp_path_factory, proposer, "features-reopen")
    recorder = proposer.recorder
    try:
        got = _run_all(stack.gateway_addr, method="eagle3", k=4, max_tokens=60)
        plain = _run_all(stack.gateway_addr, method="none", max_tokens=60)
        assert got == plain
        assert len(recorder.forgotten) == len(got)  # every sequence was lost once ...
        assert all(first > 0 for first in recorder.first.values())  # ... and re-opened with a window
        assert not recorder.problems, recorder.problems[:5]
        recorder.assert_rows_are_the_targets_hidden_states(stories_path)
    finally:
        stack.stop()
