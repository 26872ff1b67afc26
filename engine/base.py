"""The target-model engine protocol used by the scorer's scheduler.

An engine holds one KV cache per sequence. A forward pass takes a ragged
batch: every item appends its own new tokens (a prefill chunk, or the pending
token followed by drafts) after its own cached prefix and asks for logits of
its last ``num_logits`` new tokens. Rejected tokens are rolled back by length
with ``truncate``.

    engine.ensure_capacity(seq_id, total_len)  # reserve KV for total_len tokens
    out = engine.forward([ForwardItem(...), ...])
    engine.truncate(seq_id, new_len)
    engine.release(seq_id)

Implementations: ``llama.LlamaEngine`` (the project's own forward pass for the
Llama family) and ``hf_engine.HFEngine`` (any ``transformers`` causal LM,
the fallback for other architectures); ``factory.build_engine`` picks one.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch


class PoolExhausted(RuntimeError):
    """The KV pool cannot hold the requested tokens; nothing was changed."""


def check_feature_layers(feature_layers: tuple[int, ...], num_layers: int) -> None:
    """Raises ValueError unless every index is in 0..num_layers."""
    bad = [i for i in feature_layers if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"feature layer {bad[0]} outside 0..{num_layers}")


@dataclass(frozen=True)
class ModelFacts:
    model: str  # id or path as given
    vocab_size: int  # rows of the LM head (logits width)
    max_model_len: int  # longest context in tokens
    eos_token_ids: tuple[int, ...]
    hidden_size: int
    num_layers: int  # decoder layers; feature layer indices go 0..num_layers
    dtype: str  # "float32" | "bfloat16"
    kv_capacity_tokens: int  # pool size in tokens
    kv_dtype: str  # the KV cache's storage: "float32" | "bfloat16"


@dataclass
class ForwardItem:
    seq_id: str
    token_ids: np.ndarray  # int32 [n], n >= 1: appended after the cached prefix
    num_logits: int  # 0 <= num_logits <= n: logits of the last num_logits tokens


@dataclass
class ForwardOutput:
    # float32 [sum(num_logits), vocab]: the items' logits rows, in item order
    logits: torch.Tensor
    # [sum(num_logits), hidden] final-norm hidden states, when asked for
    hidden_states: torch.Tensor | None = None
    # [T, len(feature_layers) * hidden]: for every row fed (all items' new
    # tokens, in item order) the asked layers' hidden states side by side, in
    # the order asked, in the engine's activation dtype; None when none asked
    features: torch.Tensor | None = None


class Engine(abc.ABC):
    facts: ModelFacts
    #: how the engine chose its CPU GEMM path (gemm_select.select's report:
    #: "chosen", per-path verdicts and ms), or None where it chose none
    gemm_report: dict | None = None

    @abc.abstractmethod
    def ensure_capacity(self, seq_id: str, total_len: int) -> None:
        """Reserves KV space so seq_id can hold total_len tokens (creating the
        sequence if new). Raises PoolExhausted and changes nothing if the pool
        cannot hold it."""

    @abc.abstractmethod
    def forward(self, items: list[ForwardItem], return_hidden_states: bool = False,
                feature_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """One forward pass over a ragged batch; each item's tokens attend to
        its own cached prefix and causally among themselves. Capacity must
        have been ensured. Item seq_ids are distinct.

        feature_layers: layers whose hidden states to return for every row
        (``ForwardOutput.features``): 0 = the token embeddings, i = the output
        of decoder layer i (the residual stream after i layers), num_layers =
        the last layer's output *before* the final norm. transformers'
        ``output_hidden_states`` uses the same indices, except that its last
        entry is taken after the final norm."""

    @abc.abstractmethod
    def cached_len(self, seq_id: str) -> int:
        """Tokens in seq_id's KV cache; 0 for an unknown sequence."""

    @abc.abstractmethod
    def truncate(self, seq_id: str, length: int) -> None:
        """Rolls the KV cache back to its first `length` tokens."""

    @abc.abstractmethod
    def release(self, seq_id: str) -> bool:
        """Frees seq_id's KV cache; False if it was unknown."""

    @abc.abstractmethod
    def free_tokens(self) -> int:
        """Tokens that can still be reserved."""

    def prepare(self, max_batch_size: int, max_tokens_per_forward: int | None = None,  # noqa: B027
                feature_layers: tuple[int, ...] = ()) -> None:
        """Readies the engine for forward passes of up to max_batch_size
        sequences and max_tokens_per_forward new tokens (None: any number)
        before the first one comes, those asking for feature_layers' states
        too when named (LlamaEngine on a GPU: compiles its kernels and
        captures its CUDA graphs); by default nothing."""


#: the probe of ``numerics_fingerprint``: a prefill of this many tokens, then one decode step
PROBE_TOKENS = 16


@torch.inference_mode()
def numerics_fingerprint(engine: Engine) -> str:
    """A short hash of the logits the engine gives for a fixed probe (a
    prefill of PROBE_TOKENS token ids spread over the vocabulary, every row's
    logits, then one decode step): 16 hex digits.

    Replicas of one model whose fingerprints are equal computed the probe
    bit for bit alike, so they have the same arithmetic (GEMM path, kernels,
    instruction set, dtypes); replicas whose fingerprints differ do not, and
    a near-tie can go to another token on each. The gateway keeps a sequence
    on replicas of its first replica's fingerprint when it moves one
    (``ModelInfo.numerics``). The probe uses a scratch sequence, released
    after it: the engine's KV cache is as before."""
    import hashlib

    scratch = "\0numerics"
    ids = ((np.arange(PROBE_TOKENS + 1, dtype=np.int64) * 7919 + 1) % engine.facts.vocab_size).astype(np.int32)
    engine.ensure_capacity(scratch, len(ids))
    try:
        prefill = engine.forward([ForwardItem(scratch, ids[:-1], PROBE_TOKENS)]).logits
        decode = engine.forward([ForwardItem(scratch, ids[-1:], 1)]).logits
    finally:
        engine.release(scratch)
    digest = hashlib.blake2b(digest_size=8)
    for logits in (prefill, decode):
        digest.update(np.ascontiguousarray(logits.float().cpu().numpy()).tobytes())
    return digest.hexdigest()
