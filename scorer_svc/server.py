"""The Scorer gRPC servicer: validates calls, converts them to scheduler jobs
and back. All model work happens in the scheduler's worker thread."""
from __future__ import annotations

import asyncio
import logging
import random

import grpc
import numpy as np

from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc
from specdec.scorer_svc.engine import Engine
from specdec.scorer_svc.scheduler import INVALID, OK, RESOURCE_EXHAUSTED, UNKNOWN_SEQUENCE, JobSpec, Scheduler
from specdec.validation import InvalidArgument, sampling_fields

log = logging.getLogger(__name__)

MAX_DRAFT_TOKENS = 16
_STATUS = {OK: pb.SEQUENCE_STATUS_OK, UNKNOWN_SEQUENCE: pb.SEQUENCE_STATUS_UNKNOWN_SEQUENCE,
           RESOURCE_EXHAUSTED: pb.SEQUENCE_STATUS_RESOURCE_EXHAUSTED, INVALID: pb.SEQUENCE_STATUS_INVALID}


def _check_ids(ids: np.ndarray, vocab_size: int, field: str) -> None:
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if len(bad):
        raise InvalidArgument(f"{field}[{bad[0]}]: token id {ids[bad[0]]} outside the vocabulary [0, {vocab_size})")


def job_spec(seq: pb.VerifySequence, i: int, vocab_size: int, max_model_len: int) -> JobSpec:
    """Validates one VerifySequence (field names as `sequences[i].field`)."""
    f = f"sequences[{i}]"
    if not seq.seq_id:
        raise InvalidArgument(f"{f}.seq_id: must not be empty")
    drafts = np.asarray(seq.draft_token_ids, dtype=np.int64)
    if len(drafts) > MAX_DRAFT_TOKENS:
        raise InvalidArgument(f"{f}.draft_token_ids: at most {MAX_DRAFT_TOKENS} drafts, got {len(drafts)}")
    _check_ids(drafts, vocab_size, f"{f}.draft_token_ids")
    context = None
    if len(seq.context_token_ids):
        context = np.asarray(seq.context_token_ids, dtype=np.int64)
        _check_ids(context, vocab_size, f"{f}.context_token_ids")
        if seq.context_len and seq.context_len != len(context):
            raise InvalidArgument(f"{f}.context_len: {seq.context_len} != len(context_token_ids) {len(context)}")
        context_len = len(context)
    elif seq.context_len < 1:
        raise InvalidArgument(f"{f}.context_len: must be >= 1 when context_token_ids is empty")
    else:
        context_len = seq.context_len
    if context_len + len(drafts) > max_model_len:
        raise InvalidArgument(f"{f}: context_len {context_len} + {len(drafts)} drafts exceeds the "
                              f"model's context of {max_model_len} tokens")
    draft_probs = None
    if len(seq.draft_probs):
        if len(seq.draft_probs) != len(drafts):
            raise InvalidArgument(f"{f}.draft_probs: need one entry per draft token "
                                  f"({len(drafts)}), got {len(seq.draft_probs)}")
        draft_probs = []
        for j, sp in enumerate(seq.draft_probs):
            ids = np.asarray(sp.token_ids, dtype=np.int64)
            probs = np.asarray(sp.probs, dtype=np.float32)
            if len(ids) != len(probs) or len(ids) == 0:
                raise InvalidArgument(f"{f}.draft_probs[{j}]: token_ids and probs must be non-empty and aligned")
            _check_ids(ids, vocab_size, f"{f}.draft_probs[{j}].token_ids")
            if (probs < 0).any() or not np.isfinite(probs).all() or abs(probs.sum() - 1) > 1e-3:
                raise InvalidArgument(f"{f}.draft_probs[{j}].probs: must be >= 0 and sum to 1")
            draft_probs.append((ids.astype(np.int32), probs))
    sp = seq.sampling
    temperature, top_k, top_p = sampling_fields(sp.temperature, sp.top_k, sp.top_p, f"{f}.sampling")
    strategy = seq.verify_strategy or (pb.VERIFY_STRATEGY_GREEDY if temperature == 0
                                       else pb.VERIFY_STRATEGY_REJECTION)
    if strategy not in pb.VerifyStrategy.values():
        raise InvalidArgument(f"{f}.verify_strategy: unknown value {strategy}")
    if seq.accept_policy not in pb.AcceptPolicy.values():
        raise InvalidArgument(f"{f}.accept_policy: unknown value {seq.accept_policy}")
    seed = seq.sampling.seed if seq.sampling.HasField("seed") else random.getrandbits(63)
    return JobSpec(
        seq_id=seq.seq_id, context=None if context is None else context.astype(np.int32),
        context_len=context_len, draft_token_ids=drafts.astype(np.int32), draft_probs=draft_probs,
        temperature=temperature, top_k=top_k, top_p=top_p, seed=int(seed) & (2**63 - 1),
        strategy=int(strategy), accept_policy=int(seq.accept_policy),
        return_hidden_states=seq.return_hidden_states)


class ScorerServicer(pb_grpc.ScorerServicer):
    def __init__(self, engine: Engine, scheduler: Scheduler) -> None:
        self.engine = engine
        self.scheduler = scheduler

    async def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        facts = self.engine.facts
        try:
            specs = [job_spec(s, i, facts.vocab_size, facts.max_model_len)
                     for i, s in enumerate(request.sequences)]
            ids = [s.seq_id for s in specs]
            if len(set(ids)) != len(ids):
                raise InvalidArgument("sequences.seq_id: a sequence appears twice in one call")
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        results, compute_s, queue_s = await self.scheduler.verify(specs)
        response = pb.VerifyResponse(compute_s=compute_s, queue_s=queue_s)
        for spec, r in zip(specs, results):
            out = response.results.add(seq_id=spec.seq_id, status=_STATUS[r.status],
                                       output_token_ids=r.output_token_ids,
                                       num_accepted=r.num_accepted, message=r.message)
            if r.hidden_states is not None:
                out.hidden_states = np.ascontiguousarray(r.hidden_states, dtype=np.float32).tobytes()
                out.hidden_size = r.hidden_states.shape[1]
        return response

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=await self.scheduler.release(list(request.seq_ids)))

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        f = self.engine.facts
        return pb.ModelInfo(model=f.model, vocab_size=f.vocab_size, max_model_len=f.max_model_len,
                            eos_token_ids=list(f.eos_token_ids), hidden_size=f.hidden_size,
                            dtype=f.dtype, kv_capacity_tokens=f.kv_capacity_tokens,
                            kv_free_tokens=self.engine.free_tokens(),
                            live_sequences=self.scheduler.live_sequences)


def serve(args) -> None:
    """Runs the scorer from the `specdec scorer` arguments: the model and the
    scheduler's worker on the main thread, the gRPC server on an asyncio
    loop in a background thread."""
    import signal
    import threading

    from specdec.servers import Server, start_metrics

    engine = build_engine(args.model, args.dtype, args.kv_tokens, args.device, args.engine,
                          kv_memory_fraction=args.kv_memory_fraction, gemm=args.gemm)
    scheduler = Scheduler(engine, args.max_batch_size, args.max_tokens_per_forward, background=False,
                          idle_timeout_s=args.idle_timeout_s)
    started = threading.Event()
    state: dict = {}

    async def grpc_main() -> None:
        server = Server(args.host, args.port, ["Scorer"])
        pb_grpc.add_ScorerServicer_to_server(ScorerServicer(engine, scheduler), server.server)
        state["loop"], state["stop"] = asyncio.get_running_loop(), asyncio.Event()
        await server.server.start()
        await server.set_serving(True)
        f = engine.facts
        log.info("scorer: %s (%s, %s), vocab %d, context %d, KV %d tokens", args.model, f.dtype,
                 type(engine).__name__, f.vocab_size, f.max_model_len, f.kv_capacity_tokens)
        print(f"scorer listening on {args.host}:{server.port}", flush=True)
        started.set()
        await state["stop"].wait()
        await server.set_serving(False)
        await server.server.stop(5)

    def grpc_thread() -> None:
        try:
            asyncio.run(grpc_main())
        except BaseException as e:  # e.g. the port is taken
            state["error"] = e
        finally:
            started.set()
            scheduler.stop()  # a server that failed to start ends the process

    thread = threading.Thread(target=grpc_thread, name="scorer-grpc", daemon=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: scheduler.stop())
    thread.start()
    start_metrics(args.metrics_port)
    scheduler.run()  # until SIGINT / SIGTERM
    log.info("stopping")
    if "loop" in state:
        state["loop"].call_soon_threadsafe(state["stop"].set)
    thread.join(10)
    if "error" in state:
        raise SystemExit(f"scorer failed: {state['error']}")


def build_engine(model: str, dtype: str, kv_tokens: int | None, device: str, engine_kind: str,
                 kv_memory_fraction: float | None = None, gemm: str = "auto") -> Engine:
    """`auto`: the project's Llama runner for Llama-family models, else the
    transformers fallback (load_engine logs why); `hf`: always transformers."""
    if engine_kind == "hf":
        from specdec.scorer_svc.hf_engine import HFEngine

        return HFEngine(model, dtype, kv_capacity_tokens=kv_tokens or 65536, device=device)
    from specdec.scorer_svc.loader import load_engine

    return load_engine(model, dtype=dtype, kv_capacity_tokens=kv_tokens,
                       kv_memory_fraction=kv_memory_fraction, device=device, gemm=gemm)
