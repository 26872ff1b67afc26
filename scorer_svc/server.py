"""The Scorer gRPC servicer: validates calls, converts them to scheduler jobs
and back. All model work happens in the scheduler's worker thread."""
from __future__ import annotations

import asyncio
import logging

import grpc
import numpy as np
from prometheus_client import Gauge, Info

from specdec.engine.base import Engine, PoolExhausted, check_feature_layers, numerics_fingerprint
from specdec.engine.config import EngineConfig
from specdec.engine.factory import build_engine
from specdec.limits import (
    MAX_DECODE_STEPS,
    MAX_FEATURE_LAYERS,
    MAX_SPECULATIVE_TOKENS,
    default_verify_strategy,
    resolve_seed,
)
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc
from specdec.scorer_svc.scheduler import BUSY, INVALID, OK, RESOURCE_EXHAUSTED, UNKNOWN_SEQUENCE, JobSpec, Scheduler
from specdec.validation import InvalidArgument, sampling_fields

log = logging.getLogger(__name__)

ENGINE_GEMM = Info("specdec_engine_gemm", "CPU GEMM path the engine runs (chosen by measuring on this machine, or "
                   "forced), with the dtype and the CPU model")
ENGINE_GEMM_MS = Gauge("specdec_engine_gemm_ms", "Measured ms of all of a forward pass's GEMMs per path and row "
                       "count (invariant paths only)", ["path", "rows"])
SCORER_NUMERICS = Info("specdec_scorer_numerics", "Fingerprint of this replica's arithmetic (ModelInfo.numerics): "
                       "replicas with the same value compute the same bits")

_STATUS = {OK: pb.SEQUENCE_STATUS_OK, UNKNOWN_SEQUENCE: pb.SEQUENCE_STATUS_UNKNOWN_SEQUENCE,
           RESOURCE_EXHAUSTED: pb.SEQUENCE_STATUS_RESOURCE_EXHAUSTED, INVALID: pb.SEQUENCE_STATUS_INVALID,
           BUSY: pb.SEQUENCE_STATUS_BUSY}


def _check_ids(ids: np.ndarray, vocab_size: int, field: str) -> None:
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if len(bad):
        raise InvalidArgument(f"{field}[{bad[0]}]: token id {ids[bad[0]]} outside the vocabulary [0, {vocab_size})")


def _feature_layers(seq: pb.VerifySequence, f: str, num_layers: int) -> tuple[int, ...]:
    """The validated feature_layers of a VerifySequence (and its max_context_features)."""
    layers = tuple(seq.feature_layers)
    if len(layers) > MAX_FEATURE_LAYERS:
        raise InvalidArgument(f"{f}.feature_layers: at most {MAX_FEATURE_LAYERS} layers, got {len(layers)}")
    if len(set(layers)) != len(layers):
        raise InvalidArgument(f"{f}.feature_layers: a layer appears twice in {list(layers)}")
    for j, layer in enumerate(layers):
        if not 0 <= layer <= num_layers:
            raise InvalidArgument(f"{f}.feature_layers[{j}]: layer {layer} outside 0..{num_layers} "
                                  f"(0: embeddings, {num_layers}: the last decoder layer)")
    if seq.max_context_features < 0:
        raise InvalidArgument(f"{f}.max_context_features: must be >= 0, got {seq.max_context_features}")
    return layers


def job_spec(seq: pb.VerifySequence, i: int, vocab_size: int, max_model_len: int, num_layers: int) -> JobSpec:
    """Validates one VerifySequence (field names as `sequences[i].field`)."""
    f = f"sequences[{i}]"
    if not seq.seq_id:
        raise InvalidArgument(f"{f}.seq_id: must not be empty")
    drafts = np.asarray(seq.draft_token_ids, dtype=np.int64)
    if len(drafts) > MAX_SPECULATIVE_TOKENS:
        raise InvalidArgument(f"{f}.draft_token_ids: at most {MAX_SPECULATIVE_TOKENS} drafts, got {len(drafts)}")
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
    strategy = seq.verify_strategy or default_verify_strategy(temperature)
    if strategy not in pb.VerifyStrategy.values():
        raise InvalidArgument(f"{f}.verify_strategy: unknown value {strategy}")
    if seq.accept_policy not in pb.AcceptPolicy.values():
        raise InvalidArgument(f"{f}.accept_policy: unknown value {seq.accept_policy}")
    feature_layers = _feature_layers(seq, f, num_layers)
    _check_decode_steps(seq, f, len(drafts))
    return JobSpec(
        seq_id=seq.seq_id, context=None if context is None else context.astype(np.int32),
        context_len=context_len, draft_token_ids=drafts.astype(np.int32), draft_probs=draft_probs,
        temperature=temperature, top_k=top_k, top_p=top_p,
        seed=resolve_seed(sp.seed if sp.HasField("seed") else None),
        strategy=int(strategy), accept_policy=int(seq.accept_policy),
        return_hidden_states=seq.return_hidden_states,
        feature_layers=feature_layers, max_context_features=seq.max_context_features,
        decode_steps=max(1, seq.decode_steps), skip_decode_ahead=seq.skip_decode_ahead)


def _check_decode_steps(seq: pb.VerifySequence, f: str, num_drafts: int) -> None:
    """decode_steps: 0..MAX_DECODE_STEPS, and more than one only for a
    sequence asking no drafts verified and no hidden states (target
    features may be asked: the call answers the rows of every pass)."""
    steps = seq.decode_steps
    if not 0 <= steps <= MAX_DECODE_STEPS:
        raise InvalidArgument(f"{f}.decode_steps: must be in 0..{MAX_DECODE_STEPS}, got {steps}")
    if steps > 1:
        asked = [name for name, on in (("draft_token_ids", num_drafts), ("return_hidden_states",
                                        seq.return_hidden_states)) if on]
        if asked:
            raise InvalidArgument(f"{f}.decode_steps: {steps} tokens in one call only without {asked[0]}")


class ScorerServicer(pb_grpc.ScorerServicer):
    def __init__(self, engine: Engine, scheduler: Scheduler, numerics: str = "") -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.numerics = numerics  # numerics_fingerprint(engine), sent with every answer

    async def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        facts = self.engine.facts
        try:
            specs = [job_spec(s, i, facts.vocab_size, facts.max_model_len, facts.num_layers)
                     for i, s in enumerate(request.sequences)]
            ids = [s.seq_id for s in specs]
            if len(set(ids)) != len(ids):
                raise InvalidArgument("sequences.seq_id: a sequence appears twice in one call")
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        results, compute_s, queue_s = await self.scheduler.verify(specs)
        response = pb.VerifyResponse(compute_s=compute_s, queue_s=queue_s, numerics=self.numerics)
        for spec, r in zip(specs, results):
            out = response.results.add(seq_id=spec.seq_id, status=_STATUS[r.status],
                                       output_token_ids=r.output_token_ids,
                                       num_accepted=r.num_accepted, message=r.message)
            if r.hidden_states is not None:
                out.hidden_states = np.ascontiguousarray(r.hidden_states, dtype=np.float32).tobytes()
                out.hidden_size = r.hidden_states.shape[1]
            if r.features is not None:
                rows, dim = r.features.bits.shape
                out.features.CopyFrom(pb.Features(start=r.features.start, rows=rows, dim=dim,
                                                  data=r.features.bits.astype("<u2", copy=False).tobytes()))
        return response

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=await self.scheduler.release(list(request.seq_ids)))

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        f = self.engine.facts
        return pb.ModelInfo(model=f.model, vocab_size=f.vocab_size, max_model_len=f.max_model_len,
                            eos_token_ids=list(f.eos_token_ids), hidden_size=f.hidden_size,
                            num_layers=f.num_layers, dtype=f.dtype, kv_capacity_tokens=f.kv_capacity_tokens,
                            kv_dtype=f.kv_dtype, numerics=self.numerics,
                            kv_free_tokens=self.engine.free_tokens(),
                            live_sequences=self.scheduler.live_sequences)


def export_gemm_choice(engine: Engine) -> None:
    """Publishes the engine's GEMM choice and its timings as metrics
    (nothing for an engine that chose none)."""
    report = engine.gemm_report
    if report is None:
        return
    ENGINE_GEMM.info({"path": report["chosen"], "dtype": report["key"]["dtype"].removeprefix("torch."),
                      "cpu": report["key"]["cpu"], "threads": str(report["key"]["threads"]),
                      "forced": str(report["forced"]).lower(),
                      # simd-gguf's kernel layout per row count, as timed here ("" for other paths)
                      "gguf_layouts": ",".join(f"{n}:{name}" for n, name in
                                               report.get("gguf_layouts", {}).get("choice", {}).items())})
    for path, entry in report["paths"].items():
        for rows, ms in entry.get("ms", {}).items():
            ENGINE_GEMM_MS.labels(path, rows).set(ms)


def replica_numerics(engine: Engine) -> str:
    """The engine's ``numerics_fingerprint``, or "" (the replica does not
    say: gateways treat it as unknown) where the KV pool cannot hold the
    probe's tokens."""
    try:
        return numerics_fingerprint(engine)
    except PoolExhausted as e:
        log.warning("scorer: no numerics fingerprint (the KV pool cannot hold its probe: %s)", e)
        return ""


def prepare(engine: Engine, args) -> None:
    """Readies the engine before serving (Engine.prepare: on a GPU, every
    CUDA graph the batch limits can need), with --feature-layers those of
    passes returning these layers' states too; ValueError naming the flag
    for a layer the model lacks (on any device)."""
    layers = tuple(args.feature_layers)
    try:
        check_feature_layers(layers, engine.facts.num_layers)
    except ValueError as e:
        raise ValueError(f"--feature-layers: {e}") from None
    engine.prepare(args.max_batch_size, args.max_tokens_per_forward)
    if layers:
        engine.prepare(args.max_batch_size, args.max_tokens_per_forward, layers)


def serve(args) -> None:
    """Runs the scorer from the `specdec scorer` arguments: the model and the
    scheduler's worker on the main thread, the gRPC server on an asyncio
    loop in a background thread."""
    import signal
    import threading

    from specdec.servers import Server, server_security, start_metrics

    try:
        engine = build_engine(engine_config(args))
    except ValueError as e:
        raise SystemExit(f"scorer: {e}") from None
    export_gemm_choice(engine)
    try:
        prepare(engine, args)
    except ValueError as e:
        raise SystemExit(f"scorer: {e}") from None
    numerics = replica_numerics(engine)
    SCORER_NUMERICS.info({"fingerprint": numerics})
    scheduler = Scheduler(engine, args.max_batch_size, args.max_tokens_per_forward, background=False,
                          idle_timeout_s=args.idle_timeout_s, decode_ahead=args.decode_ahead == "on")
    started = threading.Event()
    state: dict = {}

    async def grpc_main() -> None:
        server = Server(args.host, args.port, ["Scorer"], server_security(args))
        pb_grpc.add_ScorerServicer_to_server(ScorerServicer(engine, scheduler, numerics), server.server)
        state["loop"], state["stop"] = asyncio.get_running_loop(), asyncio.Event()
        await server.server.start()
        await server.set_serving(True)
        f = engine.facts
        log.info("scorer: %s (%s, %s), vocab %d, context %d, KV %d tokens, numerics %s", args.model, f.dtype,
                 type(engine).__name__, f.vocab_size, f.max_model_len, f.kv_capacity_tokens, numerics)
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
    # Every port is bound before the health service can say SERVING: a metrics port that another socket took
    # ends the process before a launcher (or a readiness probe) sees it serve and goes on without it. Bound
    # after the gRPC thread's start, the scorer served for a moment, then died (a gateway waited for it 300 s).
    start_metrics(args.metrics_port)
    thread.start()
    scheduler.run()  # until SIGINT / SIGTERM
    log.info("stopping")
    if "loop" in state:
        state["loop"].call_soon_threadsafe(state["stop"].set)
    thread.join(10)
    if "error" in state:
        raise SystemExit(f"scorer failed: {state['error']}")


def engine_config(args) -> EngineConfig:
    """The engine the `specdec scorer` flags ask for."""
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, engine=args.engine,
                        kv_capacity_tokens=args.kv_tokens, kv_memory_fraction=args.kv_memory_fraction,
                        max_model_len=args.max_model_len, gemm=args.gemm, num_threads=args.threads,
                        kv_dtype=args.kv_dtype)
