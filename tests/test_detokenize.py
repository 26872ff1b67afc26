"""The gateway's incremental decoder gives, after every round, the text of
decoding the whole output, on both real tokenizers (SentencePiece Llama with
byte fallback, and byte-level BPE), for real text with multi-byte characters
and for random token ids that cut characters in half. Where the full decode
holds U+FFFD (invalid bytes), only that garbled text may differ."""
from __future__ import annotations

import random

import pytest

from specdec.gateway.sequence import IncrementalDecoder
from specdec.models import load_tokenizer, resolve_model

TEXT = ("Once upon a time, Lily went to the park. \"Hello!\" she said. The café served crème brûlée; "
        "日本語のテキスト and emoji 🙂🚀 side by side.\n\n  Indented   spaces\tand tabs. def f(x):\n"
        "    return x ** 2  # ünïcödé\n" * 6)


def check_stream(tokenizer, ids: list[int], seed: int) -> int:
    """Feeds ids in random chunks (a round's output); returns how many
    rounds were checked."""
    rng = random.Random(seed)
    decoder = IncrementalDecoder(tokenizer)
    n, rounds = 0, 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 6))
        want = tokenizer.decode(ids[:n], skip_special_tokens=True)
        got = decoder.text(ids[:n])
        if "\ufffd" in want:  # exact up to the first garbled character
            assert got.startswith(want[:want.index("\ufffd")]), f"after {n} tokens"
        else:
            assert got == want, f"after {n} tokens"
            rounds += 1
    return rounds


def streams(tokenizer, vocab: int):
    real = list(tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    rng = random.Random(0)
    yield "real text", real
    yield "random ids", [rng.randrange(vocab) for _ in range(400)]
    yield "mixed", real[:60] + [rng.randrange(vocab) for _ in range(50)] + real[60:200]


@pytest.mark.parametrize("which", ["stories", "smollm"])
def test_incremental_text_equals_full_decode(which, stories_path, request):
    if which == "smollm":
        path = request.getfixturevalue("smollm_path")
    else:
        path = stories_path
    tokenizer = load_tokenizer(resolve_model(path))
    for name, ids in streams(tokenizer, len(tokenizer)):
        for seed in range(3):
            exact = check_stream(tokenizer, ids, seed)
            assert exact > (30 if name == "real text" else 0), name


def test_taking_tokens_back_starts_over(stories_path):
    """A stop string removes tokens the decoder may have checkpointed past."""
    tokenizer = load_tokenizer(resolve_model(stories_path))
    ids = list(tokenizer(TEXT, add_special_tokens=False)["input_ids"])[:120]
    decoder = IncrementalDecoder(tokenizer)
    for n in range(1, len(ids) + 1):
        decoder.text(ids[:n])
    for n in (100, 40, 3, 0):
        assert decoder.text(ids[:n]) == tokenizer.decode(ids[:n], skip_special_tokens=True)


@pytest.mark.parametrize("text, bound", [("Tom and Lily played with the red ball in the park. " * 40, 5),
                                         (TEXT, 12)])
def test_each_round_decodes_a_bounded_window(stories_path, text, bound):
    """The point of it: a round decodes a window of a few CONTEXTs, not the
    whole output (byte-fallback runs of CJK and emoji widen it a little)."""
    tokenizer = load_tokenizer(resolve_model(stories_path))
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    seen = []

    class Counting:
        def decode(self, part, **kw):
            seen.append(len(part))
            return tokenizer.decode(part, **kw)

    decoder = IncrementalDecoder(Counting())
    for n in range(1, len(ids) + 1):
        assert decoder.text(ids[:n]) == tokenizer.decode(ids[:n], skip_special_tokens=True)
    assert len(ids) > 300
    assert max(seen) <= bound * IncrementalDecoder.CONTEXT
