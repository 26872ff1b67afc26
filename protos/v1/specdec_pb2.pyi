from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyStrategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFY_STRATEGY_UNSPECIFIED: _ClassVar[VerifyStrategy]
    VERIFY_STRATEGY_GREEDY: _ClassVar[VerifyStrategy]
    VERIFY_STRATEGY_REJECTION: _ClassVar[VerifyStrategy]
    VERIFY_STRATEGY_TARGET_MATCH: _ClassVar[VerifyStrategy]
    VERIFY_STRATEGY_TOPP: _ClassVar[VerifyStrategy]

class AcceptPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACCEPT_POLICY_NORMAL: _ClassVar[AcceptPolicy]
    ACCEPT_POLICY_ACCEPT_ALL: _ClassVar[AcceptPolicy]
    ACCEPT_POLICY_REJECT_ALL: _ClassVar[AcceptPolicy]

class DraftLength(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_LENGTH_UNSPECIFIED: _ClassVar[DraftLength]
    DRAFT_LENGTH_ADAPTIVE: _ClassVar[DraftLength]
    DRAFT_LENGTH_FIXED: _ClassVar[DraftLength]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]

class SequenceStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEQUENCE_STATUS_OK: _ClassVar[SequenceStatus]
    SEQUENCE_STATUS_UNKNOWN_SEQUENCE: _ClassVar[SequenceStatus]
    SEQUENCE_STATUS_INVALID: _ClassVar[SequenceStatus]
    SEQUENCE_STATUS_RESOURCE_EXHAUSTED: _ClassVar[SequenceStatus]
    SEQUENCE_STATUS_BUSY: _ClassVar[SequenceStatus]
VERIFY_STRATEGY_UNSPECIFIED: VerifyStrategy
VERIFY_STRATEGY_GREEDY: VerifyStrategy
VERIFY_STRATEGY_REJECTION: VerifyStrategy
VERIFY_STRATEGY_TARGET_MATCH: VerifyStrategy
VERIFY_STRATEGY_TOPP: VerifyStrategy
ACCEPT_POLICY_NORMAL: AcceptPolicy
ACCEPT_POLICY_ACCEPT_ALL: AcceptPolicy
ACCEPT_POLICY_REJECT_ALL: AcceptPolicy
DRAFT_LENGTH_UNSPECIFIED: DraftLength
DRAFT_LENGTH_ADAPTIVE: DraftLength
DRAFT_LENGTH_FIXED: DraftLength
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
SEQUENCE_STATUS_OK: SequenceStatus
SEQUENCE_STATUS_UNKNOWN_SEQUENCE: SequenceStatus
SEQUENCE_STATUS_INVALID: SequenceStatus
SEQUENCE_STATUS_RESOURCE_EXHAUSTED: SequenceStatus
SEQUENCE_STATUS_BUSY: SequenceStatus

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SparseProbs(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("start", "rows", "dim", "data")
    START_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start: int
    rows: int
    dim: int
    data: bytes
    def __init__(self, start: _Optional[int] = ..., rows: _Optional[int] = ..., dim: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("method", "num_speculative_tokens", "min_n", "max_n", "verify_strategy", "accept_policy", "reference_text", "max_tree_depth", "max_spec_factor", "min_token_prob", "draft_length")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_N_FIELD_NUMBER: _ClassVar[int]
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_POLICY_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_TEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_SPEC_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKEN_PROB_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    method: str
    num_speculative_tokens: int
    min_n: int
    max_n: int
    verify_strategy: VerifyStrategy
    accept_policy: AcceptPolicy
    reference_text: str
    max_tree_depth: int
    max_spec_factor: float
    min_token_prob: float
    draft_length: DraftLength
    def __init__(self, method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., min_n: _Optional[int] = ..., max_n: _Optional[int] = ..., verify_strategy: _Optional[_Union[VerifyStrategy, str]] = ..., accept_policy: _Optional[_Union[AcceptPolicy, str]] = ..., reference_text: _Optional[str] = ..., max_tree_depth: _Optional[int] = ..., max_spec_factor: _Optional[float] = ..., min_token_prob: _Optional[float] = ..., draft_length: _Optional[_Union[DraftLength, str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "max_tokens", "stop", "ignore_eos", "sampling", "speculation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatPrompt
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    sampling: SamplingParams
    speculation: SpeculationParams
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "output_tokens", "rounds", "draft_tokens", "accepted_tokens", "acceptance_by_position", "mean_accepted_length", "propose_s", "verify_s", "network_s", "wall_s", "ttft_s", "feature_bytes", "scorer_numerics_changes")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    NETWORK_S_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    FEATURE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCORER_NUMERICS_CHANGES_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    output_tokens: int
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_by_position: _containers.RepeatedScalarFieldContainer[float]
    mean_accepted_length: float
    propose_s: float
    verify_s: float
    network_s: float
    wall_s: float
    ttft_s: float
    feature_bytes: int
    scorer_numerics_changes: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_by_position: _Optional[_Iterable[float]] = ..., mean_accepted_length: _Optional[float] = ..., propose_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., network_s: _Optional[float] = ..., wall_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., feature_bytes: _Optional[int] = ..., scorer_numerics_changes: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "stats")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ...) -> None: ...

class ProposerOptions(_message.Message):
    __slots__ = ("method", "min_n", "max_n", "reference_token_ids", "max_tree_depth", "max_spec_factor", "min_token_prob", "temperature", "seed")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MIN_N_FIELD_NUMBER: _ClassVar[int]
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_SPEC_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKEN_PROB_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    method: str
    min_n: int
    max_n: int
    reference_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tree_depth: int
    max_spec_factor: float
    min_token_prob: float
    temperature: float
    seed: int
    def __init__(self, method: _Optional[str] = ..., min_n: _Optional[int] = ..., max_n: _Optional[int] = ..., reference_token_ids: _Optional[_Iterable[int]] = ..., max_tree_depth: _Optional[int] = ..., max_spec_factor: _Optional[float] = ..., min_token_prob: _Optional[float] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SequenceUpdate(_message.Message):
    __slots__ = ("seq_id", "open", "token_ids", "context_len", "num_speculative_tokens", "options", "features", "model_steps")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    MODEL_STEPS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    open: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    context_len: int
    num_speculative_tokens: int
    options: ProposerOptions
    features: Features
    model_steps: int
    def __init__(self, seq_id: _Optional[str] = ..., open: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ..., context_len: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., options: _Optional[_Union[ProposerOptions, _Mapping]] = ..., features: _Optional[_Union[Features, _Mapping]] = ..., model_steps: _Optional[int] = ...) -> None: ...

class SequenceRelease(_message.Message):
    __slots__ = ("seq_id", "completed")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    completed: bool
    def __init__(self, seq_id: _Optional[str] = ..., completed: _Optional[bool] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("batch_id", "sequences", "releases", "round")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceUpdate]
    releases: _containers.RepeatedCompositeFieldContainer[SequenceRelease]
    round: RoundUpdates
    def __init__(self, batch_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceUpdate, _Mapping]]] = ..., releases: _Optional[_Iterable[_Union[SequenceRelease, _Mapping]]] = ..., round: _Optional[_Union[RoundUpdates, _Mapping]] = ...) -> None: ...

class RoundUpdates(_message.Message):
    __slots__ = ("seq_ids", "token_counts", "token_ids", "context_lens", "num_speculative_tokens", "branch_width", "branch_depths", "ahead_ks")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_WIDTH_FIELD_NUMBER: _ClassVar[int]
    BRANCH_DEPTHS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_KS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    context_lens: _containers.RepeatedScalarFieldContainer[int]
    num_speculative_tokens: _containers.RepeatedScalarFieldContainer[int]
    branch_width: int
    branch_depths: _containers.RepeatedScalarFieldContainer[int]
    ahead_ks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., token_counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., context_lens: _Optional[_Iterable[int]] = ..., num_speculative_tokens: _Optional[_Iterable[int]] = ..., branch_width: _Optional[int] = ..., branch_depths: _Optional[_Iterable[int]] = ..., ahead_ks: _Optional[_Iterable[int]] = ...) -> None: ...

class RoundDrafts(_message.Message):
    __slots__ = ("draft_counts", "token_ids", "statuses", "messages", "branch_counts", "branch_positions", "branch_tokens", "branch_lens", "branch_token_ids")
    DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    BRANCH_COUNTS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_LENS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    draft_counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    statuses: _containers.RepeatedScalarFieldContainer[SequenceStatus]
    messages: _containers.RepeatedScalarFieldContainer[str]
    branch_counts: _containers.RepeatedScalarFieldContainer[int]
    branch_positions: _containers.RepeatedScalarFieldContainer[int]
    branch_tokens: _containers.RepeatedScalarFieldContainer[int]
    branch_lens: _containers.RepeatedScalarFieldContainer[int]
    branch_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, draft_counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., statuses: _Optional[_Iterable[_Union[SequenceStatus, str]]] = ..., messages: _Optional[_Iterable[str]] = ..., branch_counts: _Optional[_Iterable[int]] = ..., branch_positions: _Optional[_Iterable[int]] = ..., branch_tokens: _Optional[_Iterable[int]] = ..., branch_lens: _Optional[_Iterable[int]] = ..., branch_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Draft(_message.Message):
    __slots__ = ("seq_id", "status", "token_ids", "probs", "message", "feature_layers", "features_from")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FROM_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    status: SequenceStatus
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedCompositeFieldContainer[SparseProbs]
    message: str
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    features_from: int
    def __init__(self, seq_id: _Optional[str] = ..., status: _Optional[_Union[SequenceStatus, str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[_Union[SparseProbs, _Mapping]]] = ..., message: _Optional[str] = ..., feature_layers: _Optional[_Iterable[int]] = ..., features_from: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("batch_id", "drafts", "compute_s", "round")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    drafts: _containers.RepeatedCompositeFieldContainer[Draft]
    compute_s: float
    round: RoundDrafts
    def __init__(self, batch_id: _Optional[int] = ..., drafts: _Optional[_Iterable[_Union[Draft, _Mapping]]] = ..., compute_s: _Optional[float] = ..., round: _Optional[_Union[RoundDrafts, _Mapping]] = ...) -> None: ...

class VerifySequence(_message.Message):
    __slots__ = ("seq_id", "context_token_ids", "context_len", "draft_token_ids", "draft_probs", "sampling", "verify_strategy", "accept_policy", "return_hidden_states", "feature_layers", "max_context_features", "decode_steps", "skip_decode_ahead")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_POLICY_FIELD_NUMBER: _ClassVar[int]
    RETURN_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    SKIP_DECODE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    context_token_ids: _containers.RepeatedScalarFieldContainer[int]
    context_len: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[SparseProbs]
    sampling: SamplingParams
    verify_strategy: VerifyStrategy
    accept_policy: AcceptPolicy
    return_hidden_states: bool
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    max_context_features: int
    decode_steps: int
    skip_decode_ahead: bool
    def __init__(self, seq_id: _Optional[str] = ..., context_token_ids: _Optional[_Iterable[int]] = ..., context_len: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[SparseProbs, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., verify_strategy: _Optional[_Union[VerifyStrategy, str]] = ..., accept_policy: _Optional[_Union[AcceptPolicy, str]] = ..., return_hidden_states: _Optional[bool] = ..., feature_layers: _Optional[_Iterable[int]] = ..., max_context_features: _Optional[int] = ..., decode_steps: _Optional[int] = ..., skip_decode_ahead: _Optional[bool] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[VerifySequence]
    def __init__(self, sequences: _Optional[_Iterable[_Union[VerifySequence, _Mapping]]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("seq_id", "status", "output_token_ids", "num_accepted", "hidden_states", "hidden_size", "message", "features")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    status: SequenceStatus
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    hidden_states: bytes
    hidden_size: int
    message: str
    features: Features
    def __init__(self, seq_id: _Optional[str] = ..., status: _Optional[_Union[SequenceStatus, str]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., hidden_states: _Optional[bytes] = ..., hidden_size: _Optional[int] = ..., message: _Optional[str] = ..., features: _Optional[_Union[Features, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results", "compute_s", "queue_s", "numerics")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    compute_s: float
    queue_s: float
    numerics: str
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ..., compute_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., numerics: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_model_len", "eos_token_ids", "hidden_size", "dtype", "num_layers", "kv_capacity_tokens", "kv_free_tokens", "live_sequences", "kv_dtype", "numerics")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    dtype: str
    num_layers: int
    kv_capacity_tokens: int
    kv_free_tokens: int
    live_sequences: int
    kv_dtype: str
    numerics: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., kv_free_tokens: _Optional[int] = ..., live_sequences: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., numerics: _Optional[str] = ...) -> None: ...
