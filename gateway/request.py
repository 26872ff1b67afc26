"""Validation of client requests: a GenerateRequest becomes plain GenParams,
or an InvalidArgument naming the offending field."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.limits import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_SPEC_FACTOR,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MAX_TREE_DEPTH,
    DEFAULT_MIN_N,
    DEFAULT_MIN_TOKEN_PROB,
    MAX_SPECULATIVE_TOKENS,
    default_verify_strategy,
    is_greedy,
    resolve_seed,
)
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.validation import InvalidArgument, sampling_fields


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]


@dataclass
class GenParams:
    prompt_ids: list[int]
    max_tokens: int
    stop: list[str]
    ignore_eos: bool
    temperature: float
    top_k: int
    top_p: float  # 1.0 = disabled
    seed: int  # always set: the gateway draws one when the client does not
    method: str  # "none" = plain decoding, no proposer
    num_speculative_tokens: int  # draft budget per round (0 for method "none")
    min_n: int
    max_n: int
    max_tree_depth: int
    max_spec_factor: float
    min_token_prob: float
    verify_strategy: int
    accept_policy: int
    reference_ids: list[int] = field(default_factory=list)
    adaptive: bool = True  # trim each round's drafts to what pays off (gateway/costs.py)


def _prompt_ids(request: pb.GenerateRequest, tokenizer, limits: ModelLimits) -> list[int]:
    which = request.WhichOneof("prompt")
    if which is None:
        raise InvalidArgument("prompt: one of text, token_ids or chat is required")
    if which == "text":
        if not request.text:
            raise InvalidArgument("text: the prompt must not be empty")
        ids = list(tokenizer(request.text)["input_ids"])
    elif which == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidArgument("token_ids: the prompt must not be empty")
        for i, t in enumerate(ids):
            if not 0 <= t < limits.vocab_size:
                raise InvalidArgument(f"token_ids.ids[{i}]: token id {t} outside the vocabulary "
                                      f"[0, {limits.vocab_size})")
    else:
        messages = request.chat.messages
        if not messages:
            raise InvalidArgument("chat.messages: must not be empty")
        for i, m in enumerate(messages):
            if m.role not in ("system", "user", "assistant"):
                raise InvalidArgument(f"chat.messages[{i}].role: must be system, user or assistant")
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        if getattr(tokenizer, "chat_template", None) is None:
            raise InvalidArgument("chat: the model has no chat template; send text instead")
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) >= limits.max_model_len:
        raise InvalidArgument(f"prompt: {len(ids)} tokens leave no room in the model's context "
                              f"of {limits.max_model_len} tokens")
    return ids


def parse_request(request: pb.GenerateRequest, tokenizer, limits: ModelLimits,
                  methods: tuple[str, ...], default_method: str, default_num_speculative_tokens: int,
                  default_adaptive: bool = True) -> GenParams:
    """Validates a request against the model and the methods the gateway serves.

    This is where a request's draft length policy is decided: the request's
    own ``speculation.draft_length``, else ``default_adaptive`` (the gateway's
    ``--draft-length``) for greedy requests and fixed for sampled ones."""
    prompt_ids = _prompt_ids(request, tokenizer, limits)
    room = limits.max_model_len - len(prompt_ids)
    if request.HasField("max_tokens"):
        max_tokens = request.max_tokens
        if max_tokens < 1:
            raise InvalidArgument(f"max_tokens: must be >= 1, got {max_tokens}")
        if max_tokens > room:
            raise InvalidArgument(f"max_tokens: {max_tokens} exceeds the room left in the model's "
                                  f"context ({limits.max_model_len} - {len(prompt_ids)} prompt tokens "
                                  f"= {room})")
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    for i, s in enumerate(request.stop):
        if not s:
            raise InvalidArgument(f"stop[{i}]: stop strings must not be empty")

    s = request.sampling
    temperature, top_k, top_p = sampling_fields(s.temperature, s.top_k, s.top_p, "sampling")

    sp = request.speculation
    method = sp.method or default_method
    if method not in methods:
        raise InvalidArgument(f"speculation.method: unknown method {method!r} "
                              f"(available: {', '.join(methods)})")
    num_speculative_tokens = (sp.num_speculative_tokens if sp.HasField("num_speculative_tokens")
                              else default_num_speculative_tokens)
    if not 0 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise InvalidArgument(f"speculation.num_speculative_tokens: must be in "
                              f"0..{MAX_SPECULATIVE_TOKENS}, got {num_speculative_tokens}")
    min_n = sp.min_n if sp.HasField("min_n") else DEFAULT_MIN_N
    max_n = sp.max_n if sp.HasField("max_n") else max(DEFAULT_MAX_N, min_n)
    if min_n < 1:
        raise InvalidArgument(f"speculation.min_n: must be >= 1, got {min_n}")
    if min_n > max_n:
        raise InvalidArgument(f"speculation.min_n: {min_n} is greater than speculation.max_n {max_n}")
    depth = sp.max_tree_depth if sp.HasField("max_tree_depth") else DEFAULT_MAX_TREE_DEPTH
    if depth < 1:
        raise InvalidArgument(f"speculation.max_tree_depth: must be >= 1, got {depth}")
    factor = sp.max_spec_factor if sp.HasField("max_spec_factor") else DEFAULT_MAX_SPEC_FACTOR
    if not (factor > 0 and math.isfinite(factor)):
        raise InvalidArgument(f"speculation.max_spec_factor: must be > 0, got {factor}")
    min_prob = sp.min_token_prob if sp.HasField("min_token_prob") else DEFAULT_MIN_TOKEN_PROB
    if not 0 <= min_prob <= 1:
        raise InvalidArgument(f"speculation.min_token_prob: must be in [0, 1], got {min_prob}")
    if sp.verify_strategy not in pb.VerifyStrategy.values():
        raise InvalidArgument(f"speculation.verify_strategy: unknown value {sp.verify_strategy}")
    if sp.accept_policy not in pb.AcceptPolicy.values():
        raise InvalidArgument(f"speculation.accept_policy: unknown value {sp.accept_policy}")
    if sp.draft_length not in pb.DraftLength.values():
        raise InvalidArgument(f"speculation.draft_length: unknown value {sp.draft_length}")
    strategy = sp.verify_strategy or default_verify_strategy(temperature)
    # Greedy output does not depend on the drafts at all. A sampled output is
    # exact in distribution for any draft length, but which sample a seed
    # gives depends on the drafts: by default sampled requests keep the fixed
    # length, so a seed reproduces the output whatever the load.
    if sp.draft_length == pb.DRAFT_LENGTH_UNSPECIFIED:
        adaptive = default_adaptive and is_greedy(temperature)
    else:
        adaptive = sp.draft_length == pb.DRAFT_LENGTH_ADAPTIVE
    reference_ids = (list(tokenizer(sp.reference_text, add_special_tokens=False)["input_ids"])
                     if sp.reference_text else [])
    return GenParams(
        prompt_ids=prompt_ids, max_tokens=max_tokens, stop=list(request.stop),
        ignore_eos=request.ignore_eos, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=resolve_seed(s.seed if s.HasField("seed") else None),
        method=method, num_speculative_tokens=0 if method == "none" else num_speculative_tokens,
        min_n=min_n, max_n=max_n,
        max_tree_depth=depth, max_spec_factor=float(factor), min_token_prob=float(min_prob),
        verify_strategy=int(strategy), accept_policy=int(sp.accept_policy),
        reference_ids=reference_ids, adaptive=adaptive)
