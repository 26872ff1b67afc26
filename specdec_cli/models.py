"""Finding and loading models: a local directory (safetensors / bin / GGUF) or
a Hugging Face model id. Shared by the scorer, the gateway (tokenizer) and the
CLI; no model math lives here."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from importlib import metadata
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


#: Where dequantised GGUF models are kept (``gguf_cache_entry``); "off" keeps none.
GGUF_CACHE_ENV = "SPECDEC_GGUF_CACHE_DIR"
#: Largest dequantised model (float32 bytes) kept there: an 8B GGUF would take ~32 GB.
GGUF_CACHE_MAX_ENV = "SPECDEC_GGUF_CACHE_MAX_GB"
GGUF_CACHE_MAX_GB = 4.0
#: Bumped when what an entry holds changes: older entries are then never read.
GGUF_CACHE_FORMAT = 1


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: ``path`` is a directory or a hub id;
    ``gguf_file`` names the GGUF weights inside it, if any; ``gguf_cache``
    where its dequantised copy should be written (``gguf_cache_entry``:
    loading a GGUF dequantises every tensor, ~18 s for SmolLM2 on 2 cores,
    reading the copy ~0.3 s), None where caching is off."""

    path: str
    gguf_file: str | None = None
    gguf_cache: str | None = None

    def hf_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def _cache_root(env_name: str, name: str) -> Path | None:
    """``$env_name`` ("off": no cache), else ~/.cache/specdec/<name>."""
    env = os.environ.get(env_name, "")
    if env.lower() == "off":
        return None
    return Path(env) if env else Path.home() / ".cache" / "specdec" / name


def gguf_cache_root() -> Path | None:
    """``$SPECDEC_GGUF_CACHE_DIR`` ("off": no cache), else ~/.cache/specdec/gguf."""
    return _cache_root(GGUF_CACHE_ENV, "gguf")


def gguf_cache_max_bytes() -> int:
    """The largest dequantised model the cache keeps (``$SPECDEC_GGUF_CACHE_MAX_GB``)."""
    raw = os.environ.get(GGUF_CACHE_MAX_ENV, "")
    try:
        gb = float(raw) if raw else GGUF_CACHE_MAX_GB
    except ValueError:
        raise ValueError(f"{GGUF_CACHE_MAX_ENV} must be a number of GB, got {raw!r}") from None
    return int(gb * 2**30)


def gguf_cache_entry(gguf: Path) -> Path | None:
    """The directory a GGUF file's dequantised copy lives in (None: caching
    off): a standard Hugging Face checkpoint (config, float32 safetensors,
    tokenizer files). Keyed by the file's path, size and modification time
    and by the versions of the code that dequantises it, so a changed file or
    a new transformers / gguf never reads an old copy."""
    root = gguf_cache_root()
    if root is None:
        return None
    st = gguf.stat()
    versions: list[str | None] = []
    for dist in ("transformers", "gguf"):
        try:
            versions.append(metadata.version(dist))
        except metadata.PackageNotFoundError:
            versions.append(None)
    key = json.dumps([str(gguf.resolve()), st.st_size, st.st_mtime_ns, versions, GGUF_CACHE_FORMAT])
    return root / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _gguf_source(directory: Path, name: str, cached: bool) -> ModelSource:
    """The GGUF file's dequantised copy when there is one (and ``cached``),
    else the file itself, naming where its copy should go."""
    entry = gguf_cache_entry(directory / name) if cached else None
    if entry is not None and (entry / "model.safetensors").is_file():
        log.info("%s: reading its dequantised copy %s", directory / name, entry)
        return ModelSource(str(entry))
    return ModelSource(str(directory), name, str(entry) if entry is not None else None)


def resolve_model(model: str, cached: bool = True) -> ModelSource:
    """Accepts a directory, a path to a ``.gguf`` file, a name under the shared
    models directory, or a Hugging Face id (returned unchanged). A GGUF model
    resolves to its dequantised copy once one exists (``gguf_cache_entry``;
    ``cached=False``: the GGUF file itself, e.g. for a reference that must
    not depend on the copy)."""
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return _gguf_source(p.parent, p.name, cached)
    if not p.is_dir():
        base = shared_models_dir()
        if base is not None and (base / model).is_dir():
            p = base / model
    if p.is_dir():
        has_weights = any(p.glob("*.safetensors")) or any(p.glob("*.bin"))
        ggufs = sorted(p.glob("*.gguf"))
        if ggufs and not has_weights:
            return _gguf_source(p, ggufs[0].name, cached)
        return ModelSource(str(p))
    return ModelSource(model)  # a hub id: transformers resolves (and may fetch) it


#: Where ``load_tokenizer`` remembers the tokenizer class AutoTokenizer chose
#: for a model directory ("off": nowhere).
TOKENIZER_CACHE_ENV = "SPECDEC_TOKENIZER_CACHE_DIR"
#: Bumped when what an entry holds changes: older entries are then never read.
TOKENIZER_CACHE_FORMAT = 1
#: Where ``engine.checkpoint`` remembers what transformers loaded from a model
#: directory (the config's values, which tensors of which files, in which
#: dtype), so later loads read the files without importing transformers ("off": nowhere).
CHECKPOINT_CACHE_ENV = "SPECDEC_CHECKPOINT_CACHE_DIR"
#: Bumped when what a checkpoint entry holds changes.
CHECKPOINT_CACHE_FORMAT = 1


def directory_cache_entry(source: ModelSource, env_name: str, name: str, *key: object) -> Path | None:
    """The JSON file under ``$env_name`` (default ~/.cache/specdec/<name>;
    "off": None) that remembers something of a local model directory (None:
    a hub id). Keyed by the directory, the name, size and modification time
    of every file in it, the GGUF file named, the transformers version and
    `key`: any change there reads the model again."""
    root = _cache_root(env_name, name)
    if root is None or not Path(source.path).is_dir():
        return None
    directory = Path(source.path).resolve()
    try:
        files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in directory.iterdir() if f.is_file())
        version = metadata.version("transformers")
    except (OSError, metadata.PackageNotFoundError):
        return None
    digest = json.dumps([str(directory), files, source.gguf_file, version, *key])
    return root / f"{directory.name}-{hashlib.sha256(digest.encode()).hexdigest()[:16]}.json"


def tokenizer_cache_entry(source: ModelSource) -> Path | None:
    """The file that names the class AutoTokenizer chose for a local model
    directory (``directory_cache_entry`` under ``$SPECDEC_TOKENIZER_CACHE_DIR``,
    default ~/.cache/specdec/tokenizers)."""
    return directory_cache_entry(source, TOKENIZER_CACHE_ENV, "tokenizers", TOKENIZER_CACHE_FORMAT)


def checkpoint_cache_entry(source: ModelSource, dtype: str) -> Path | None:
    """The file that remembers what transformers loaded from a local model
    directory in `dtype` (``directory_cache_entry`` under
    ``$SPECDEC_CHECKPOINT_CACHE_DIR``, default ~/.cache/specdec/checkpoints)."""
    return directory_cache_entry(source, CHECKPOINT_CACHE_ENV, "checkpoints", dtype, CHECKPOINT_CACHE_FORMAT)


def write_json_atomically(entry: Path, value: object) -> None:
    """Writes `value` as JSON to `entry` beside it, then renames it into
    place (a reader never sees half of it); raises OSError."""
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(value))
        os.replace(tmp, entry)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _cached_tokenizer(entry: Path, source: ModelSource):
    """The tokenizer from the class ``entry`` names, loaded as AutoTokenizer
    loads it once it has chosen (``cls.from_pretrained(path, _from_auto=True)``,
    from the GGUF file where that is where it was found), or None (no
    entry, or it no longer loads)."""
    import importlib

    try:
        chosen = json.loads(entry.read_text())
        if not str(chosen["module"]).startswith("transformers."):  # never import what the cache names elsewhere
            raise ValueError(f"module {chosen['module']!r} is not one of transformers'")
        cls = getattr(importlib.import_module(chosen["module"]), chosen["class"])
        return cls.from_pretrained(source.path, _from_auto=True, **(source.hf_kwargs() if chosen["gguf"] else {}))
    except FileNotFoundError:
        return None
    except Exception as e:  # a stale or broken entry: choose again
        log.info("the tokenizer class remembered in %s did not load (%s); asking AutoTokenizer", entry, e)
        return None


def _remember_tokenizer(entry: Path, tokenizer, gguf: bool) -> None:
    """Writes the class AutoTokenizer chose (one of transformers' own, never
    remote code) to ``entry``, atomically; a cache that cannot be written is
    only logged."""
    cls = type(tokenizer)
    if not cls.__module__.startswith("transformers."):
        return
    try:
        write_json_atomically(entry, {"module": cls.__module__, "class": cls.__qualname__, "gguf": gguf})
    except OSError as e:
        log.info("could not remember the tokenizer class in %s (%s)", entry, e)


def load_tokenizer(source: ModelSource):
    """The model's tokenizer, as ``AutoTokenizer.from_pretrained`` gives it.

    AutoTokenizer chooses the class by reading the model's config, which
    imports torch and most of transformers: ~7 s of CPU on 2 cores of an AMD
    EPYC, where the gateway needs only the tokenizer. So the class it chose
    for a local directory is remembered (``tokenizer_cache_entry``), and
    later loads call that class as AutoTokenizer calls it: ~2 s, no torch
    (tested: the same tokens, text and chat template; the gateway process
    never maps torch)."""
    entry = tokenizer_cache_entry(source)
    tokenizer = _cached_tokenizer(entry, source) if entry is not None else None
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    try:
        tokenizer, gguf = AutoTokenizer.from_pretrained(source.path), False
    except Exception:  # a GGUF-only directory: the tokenizer lives in the file
        if not source.gguf_file:
            raise
        tokenizer, gguf = AutoTokenizer.from_pretrained(source.path, **source.hf_kwargs()), True
    if entry is not None:
        _remember_tokenizer(entry, tokenizer, gguf)
    return tokenizer
