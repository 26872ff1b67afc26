"""Loading a draft model for the ``draft`` proposer: the draft engine on the
shared model runtime, after checking that the draft speaks the target's
tokenizer (a draft token must mean the same text to the target)."""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from specdec.models import (
    TOKENIZER_CACHE_ENV,
    ModelSource,
    directory_cache_entry,
    load_tokenizer,
    resolve_model,
    tokenizer_cache_entry,
    write_json_atomically,
)
from specdec.proposer_svc.draft import DraftModelProposer
from specdec.proposer_svc.model_settings import DraftModelSettings

#: how many differing token strings a mismatch message shows
MISMATCH_EXAMPLES = 3
#: in a draft's directory: {"target_ids": [...]}, the target token id of each
#: row of a reduced draft head (the head keeps only those rows)
DRAFT_VOCAB_FILE = "draft_vocab.json"
#: Bumped when what a remembered tokenizer check holds changes.
TOKENIZER_PAIR_FORMAT = 1

log = logging.getLogger(__name__)


def tokenizer_mismatch(draft_tok, target_tok) -> str | None:
    """What differs between two tokenizers (vocabulary size, token strings,
    special tokens), or None when a draft with ``draft_tok`` may serve a
    target with ``target_tok``."""
    dv, tv = draft_tok.get_vocab(), target_tok.get_vocab()
    if len(dv) != len(tv):
        return f"vocabulary size {len(dv)} (draft) vs {len(tv)} (target)"
    by_id = {i: t for t, i in tv.items()}
    differ = sorted((i, t) for t, i in dv.items() if by_id.get(i) != t)
    if differ:
        shown = ", ".join(f"id {i}: {t!r} vs {by_id.get(i)!r}" for i, t in differ[:MISMATCH_EXAMPLES])
        return f"{len(differ)} of {len(dv)} token ids map to different strings ({shown})"
    for name in ("bos_token_id", "eos_token_id"):
        d, t = getattr(draft_tok, name, None), getattr(target_tok, name, None)
        if d != t:
            return f"{name} {d} (draft) vs {t} (target)"
    return None


def read_draft_vocab(model: str, target_vocab: int) -> tuple[int, ...] | None:
    """The reduced draft head's target ids from the draft's DRAFT_VOCAB_FILE,
    or None when it has none; ValueError naming the file when they are not
    distinct ids of the target's vocabulary."""
    path = Path(resolve_model(model).path) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = tuple(int(i) for i in json.loads(path.read_text())["target_ids"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: need {{\"target_ids\": [int, ...]}} ({e})") from e
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= target_vocab:
        raise ValueError(f"{path}: target_ids must be distinct ids in [0, {target_vocab}), at least one")
    return ids


def tokenizer_pair_entry(draft: ModelSource, target: ModelSource) -> Path | None:
    """Where a draft directory found to share a target directory's tokenizer
    is remembered (beside the tokenizer cache's entries; keyed by both
    directories' files, so a change to either checks again), or None (a hub
    id, or the cache is off)."""
    target_entry = tokenizer_cache_entry(target)
    if target_entry is None:
        return None
    return directory_cache_entry(draft, TOKENIZER_CACHE_ENV, "tokenizers", "pair", target_entry.name,
                                 TOKENIZER_PAIR_FORMAT)


def shared_target_vocab(draft: str, target: str) -> int:
    """The target's vocabulary size, once the draft's tokenizer is found to
    be the target's (``tokenizer_mismatch``; ValueError saying what differs).
    A pair found to match is remembered (``tokenizer_pair_entry``): later
    starts read the size there instead of loading both tokenizers, which
    imports transformers' tokenizer machinery (~2 s on 2 cores)."""
    draft_src, target_src = resolve_model(draft), resolve_model(target)
    entry = tokenizer_pair_entry(draft_src, target_src)
    if entry is not None and entry.is_file():
        try:
            return int(json.loads(entry.read_text())["target_vocab"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.info("%s: the remembered tokenizer check did not read (%s); checking again", entry, e)
    draft_tok, target_tok = load_tokenizer(draft_src), load_tokenizer(target_src)
    why = tokenizer_mismatch(draft_tok, target_tok)
    if why:
        raise ValueError(f"draft model {draft} does not share the tokenizer of target {target}: {why}")
    if entry is not None:
        try:
            write_json_atomically(entry, {"target_vocab": len(target_tok)})
        except OSError as e:
            log.info("could not remember the tokenizer check in %s (%s)", entry, e)
    return len(target_tok)


def build_draft_proposer(settings: DraftModelSettings) -> DraftModelProposer:
    """The draft proposer; ValueError saying what differs when the draft's
    tokenizer is not the target's, or when its head is smaller than the
    target's vocabulary without an explicit mapping (DRAFT_VOCAB_FILE)."""
    from specdec.engine.factory import build_engine

    target_vocab = shared_target_vocab(settings.engine.model, settings.target_model)
    head_ids = read_draft_vocab(settings.engine.model, target_vocab)
    if head_ids is not None:  # a reduced head, its rows mapped to target ids
        engine = build_engine(replace(settings.engine, head_token_ids=head_ids))
        return DraftModelProposer(engine, replace(settings.draft, head_token_ids=head_ids))
    engine = build_engine(settings.engine)
    if engine.facts.vocab_size < target_vocab:
        raise ValueError(f"draft model {settings.engine.model}: its head has {engine.facts.vocab_size} rows, the "
                         f"target's vocabulary {target_vocab} tokens; a reduced draft head needs "
                         f"{DRAFT_VOCAB_FILE} mapping its rows to target ids")
    config = settings.draft
    if config.vocab_limit is None:
        config = replace(config, vocab_limit=target_vocab)
    return DraftModelProposer(engine, config)
