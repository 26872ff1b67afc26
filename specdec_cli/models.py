"""Finding and loading models: a local directory (safetensors / bin / GGUF) or
a Hugging Face model id. Shared by the scorer, the gateway (tokenizer) and the
CLI; no model math lives here."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: The demo / benchmark model (a directory beside the repo) and its hub id.
DEFAULT_LOCAL_MODEL = "smollm2-135m-instruct-q4_1"
DEFAULT_HUB_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def shared_models_dir() -> Path | None:
    """``$SPECDEC_MODELS_DIR``, else the first ``shared/models`` found walking up
    from this file and from the working directory."""
    env = os.environ.get("SPECDEC_MODELS_DIR")
    if env:
        return Path(env) if Path(env).is_dir() else None
    for start in (Path(__file__).resolve(), Path.cwd().resolve()):
        for parent in [start, *start.parents]:
            cand = parent / "shared" / "models"
            if cand.is_dir():
                return cand
    return None


def default_model() -> str:
    """SmolLM2 from the shared models directory when present, else the hub id."""
    base = shared_models_dir()
    if base is not None and (base / DEFAULT_LOCAL_MODEL).is_dir():
        return str(base / DEFAULT_LOCAL_MODEL)
    return DEFAULT_HUB_MODEL


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: ``path`` is a directory or a hub id;
    ``gguf_file`` names the GGUF weights inside it, if any."""

    path: str
    gguf_file: str | None = None

    def hf_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model(model: str) -> ModelSource:
    """Accepts a directory, a path to a ``.gguf`` file, a name under the shared
    models directory, or a Hugging Face id (returned unchanged)."""
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(str(p.parent), p.name)
    if not p.is_dir():
        base = shared_models_dir()
        if base is not None and (base / model).is_dir():
            p = base / model
    if p.is_dir():
        has_weights = any(p.glob("*.safetensors")) or any(p.glob("*.bin"))
        ggufs = sorted(p.glob("*.gguf"))
        if ggufs and not has_weights:
            return ModelSource(str(p), ggufs[0].name)
        return ModelSource(str(p))
    return ModelSource(model)  # a hub id: transformers resolves (and may fetch) it


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.path)
    except Exception:  # a GGUF-only directory: the tokenizer lives in the file
        if not source.gguf_file:
            raise
        return AutoTokenizer.from_pretrained(source.path, **source.hf_kwargs())
