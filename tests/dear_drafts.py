"""The gateway's loop in the test's process against a real scorer and a real
model proposer (a draft model or a feature head), with a draft step made (on
paper) far dearer than a Verify, so that DraftBudgets asks the model for
nothing but in its explorations: what the draft-budget tests of
test_e2e_draft and test_e2e_eagle3 run. Counts what went over the wire."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from specdec.limits import DEFAULT_DECODE_STEPS
from specdec.protos.v1 import specdec_pb2 as pb


@dataclass
class DearRun:
    seqs: list  # the finished Sequences, in the order of the prompts
    model_drafts: dict[str, int] = field(default_factory=dict)  # prompt text -> non-empty model-made drafts
    messages: list[pb.ProposeRequest] = field(default_factory=list)  # Propose messages sent
    verify_calls: int = 0
    failures: list[Exception] = field(default_factory=list)  # the proposer's failures the loop saw


def run_dear_drafts(scorer: str, proposer: str, method: str, requests: dict[str, pb.GenerateRequest], tokenizer,
                    decode_steps: int = DEFAULT_DECODE_STEPS) -> DearRun:
    """Runs each request (prompt text -> request) alone, one after another,
    through a SpecLoop whose cost fits say: a Verify 10 ms + 1 ms a row, a
    draft step 1 s (kept whatever the real calls say)."""
    from specdec.gateway.adaptive import CostModel
    from specdec.gateway.costs import DraftBudgets
    from specdec.gateway.discovery import ReplicaSet, StaticDiscovery
    from specdec.gateway.loop import LoopConfig, SpecLoop
    from specdec.gateway.request import ModelLimits, parse_request
    from specdec.gateway.sequence import Delta, Sequence

    limits = ModelLimits(512, 512, (2,))
    out = DearRun([])

    def sequence(text: str, request: pb.GenerateRequest) -> Sequence:
        k = request.speculation.num_speculative_tokens
        params = parse_request(request, tokenizer, limits, (method,), method, k)
        seq = Sequence(text, params, tokenizer, limits.eos_token_ids, limits.max_model_len)
        proposed = seq.model_acceptance.proposed

        def model_draft(start: int, draft: list[int]) -> None:  # counts the model-made drafts
            if draft:
                out.model_drafts[text] = out.model_drafts.get(text, 0) + 1
            proposed(start, draft)

        seq.model_acceptance.proposed = model_draft  # type: ignore[method-assign]
        return seq

    async def run() -> list[Sequence]:
        scorers, proposers = ReplicaSet("scorer"), ReplicaSet("proposer")
        StaticDiscovery({"scorer": (scorers, [scorer]), method: (proposers, [proposer])}).start()
        loop = SpecLoop(scorers, {method: proposers}, vocab_size=512,
                        config=LoopConfig(propose_timeout_s=30.0, decode_steps=decode_steps))
        loop.costs.models[scorer] = verify = CostModel(forget=1.0, min_samples=1)
        for t in range(1, 1001):
            verify.observe(t % 8 + 1, 0.010 + 0.001 * (t % 8 + 1))
        loop.budgets = budgets = DraftBudgets()
        budgets.observe = lambda addr, steps, seconds: None  # type: ignore[method-assign]
        budgets._fits[proposer] = (0.001, 1.0)
        failed, opened, verify_on = loop.failures.proposer_failed, loop.conns.proposer_stream, loop._verify_on

        def proposer_failed(addr, seqs, error):
            out.failures.append(error)
            return failed(addr, seqs, error)

        def counting(addr: str):  # counts the Propose messages sent
            stream = opened(addr)
            if not hasattr(stream, "counted"):
                exchange = stream.exchange

                async def counted(request, timeout):
                    out.messages.append(request)
                    return await exchange(request, timeout)

                stream.exchange, stream.counted = counted, True
            return stream

        async def counted_verify(addr, verified, drafts):  # counts the Verify calls
            out.verify_calls += 1
            return await verify_on(addr, verified, drafts)

        loop.failures.proposer_failed = proposer_failed  # type: ignore[method-assign]
        loop.conns.proposer_stream = counting  # type: ignore[method-assign]
        loop._verify_on = counted_verify  # type: ignore[method-assign]
        seqs = [sequence(text, request) for text, request in requests.items()]
        loop.start()
        try:
            for seq in seqs:  # one at a time: each output is compared alone
                loop.submit(seq)
                while not (isinstance(item := await seq.out.get(), Delta) and item.finish_reason):
                    assert isinstance(item, Delta), item
        finally:
            await loop.stop()
        return seqs

    out.seqs = asyncio.run(run())
    return out
