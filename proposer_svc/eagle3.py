"""Feature heads: one decoder layer that drafts from the target's own hidden
states, loaded from the public checkpoint layouts that vLLM and SGLang load.

Alignment (as EAGLE trains it). ``f_i`` is the target's feature at context
position i (computed from tokens 0..i); the head's row at position i reads
the token *after* it, ``x_{i+1}``, together with ``f_i`` and predicts
``x_{i+2}``. A chain continues past the context by feeding the head's own
output hidden state of row i as the feature of row i + 1.

Kinds (``HeadSpec.kind``):

- ``eagle3`` (vLLM ``llama_eagle3.py``, SGLang ``llama_eagle3.py``): the
  target's low/mid/high hidden states side by side, fused by ``fc`` [hidden,
  3 * target_hidden]; the layer attends over ``[input_layernorm(embed(x));
  hidden_norm(g)]`` (q/k/v take 2 * hidden), its residual is ``g``; logits
  over a reduced draft vocabulary (``lm_head`` [draft_vocab, hidden]) whose
  id d means target id ``d + d2t[d]``; the row's pre-norm output is fed back.
- ``deepseek_mtp`` (vLLM ``deepseek_mtp.py``): ``eh_proj([enorm(e);
  hnorm(h)])`` into a standard decoder layer, logits by
  ``shared_head.head(shared_head.norm(out))``, pre-norm output fed back.
- ``mimo_mtp`` (vLLM ``mimo_mtp.py``): ``input_proj([hidden_layernorm(h);
  token_layernorm(e)])``, a standard decoder layer, ``final_layernorm``; the
  normed output goes to the target's LM head and is fed back.

MTP layers read the target's last hidden state after its final norm (what
the target's forward returns in vLLM); the wire carries it before the norm
(layer index num_layers), so the head applies the target's final norm itself.
Both MTP kinds zero the token embedding at position 0, as vLLM does.

Feature layer indices are the proto's: 0 = embeddings, i = output of decoder
layer i (the hidden state entering 0-based layer i), which is vLLM's
``aux_hidden_state_layers`` convention (``hidden_states + residual`` captured
before layer i); the default (2, L // 2, L - 3) is vLLM's
``get_eagle3_aux_hidden_state_layers``. A config's
``eagle_aux_hidden_state_layer_ids`` is taken as vLLM takes it (SGLang adds 1).
"""
from __future__ import annotations

import json
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specdec.engine import cpu_ops, gemm_gguf
from specdec.engine.gemm_select import GEMM_PATHS, Linear, select, set_torch_threads
from specdec.engine.llama import rope_inv_freq, rope_parameters
from specdec.limits import HEAD_PROJECTION_DTYPES
from specdec.proposer_svc import draft_ops

EAGLE3 = "eagle3"
DEEPSEEK_MTP = "deepseek_mtp"
MIMO_MTP = "mimo_mtp"
#: the layer tensors every kind shares (Llama naming, under the kind's prefix)
LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight")
#: optional biases (Qwen2-style q/k/v, attention_bias configs)
ATTENTION_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                    "self_attn.o_proj.bias")
#: HEAD_PROJECTION_DTYPES quantised at load -> their GGUF block kind (``gemm_gguf.quantize``)
QUANTIZED_PROJECTIONS = {"q8_0": "Q8_0", "q4_1": "Q4_1"}
#: Most rows a head's projections are checked on when their GEMM path is
#: chosen (a draft step feeds one row per sequence; more is correct anyway).
HEAD_CHECK_ROWS = 16


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default low/mid/high layers of a target with num_layers layers."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class HeadSpec:
    """Shapes and the kind of a feature head (from its config)."""

    kind: str  # EAGLE3, DEEPSEEK_MTP or MIMO_MTP (module doc)
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict  # flat rope parameters (engine.llama.rope_parameters)
    vocab_size: int  # the target's vocabulary (token embedding rows)
    feature_layers: tuple[int, ...]  # target layers read, in wire order
    target_hidden_size: int
    norm_before_residual: bool = False  # eagle3 variant: residual is hidden_norm(g)

    @property
    def feature_dim(self) -> int:
        """Values per wire row: target_hidden_size per feature layer."""
        return self.target_hidden_size * len(self.feature_layers)


@dataclass
class HeadCache:
    """One sequence's KV cache of the head's layer.

    Invariant: ``k[:, :length]`` / ``v[:, :length]`` hold the rows of
    positions ``base .. base + length - 1``."""

    num_kv_heads: int
    head_dim: int
    base: int = 0  # context position of the first cached row
    length: int = 0
    k: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0), np.float32))  # float32 [Hkv, cap, D]
    v: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0), np.float32))

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """k, v: float32 [m, Hkv, D] rows after the cached ones."""
        m = k.shape[0]
        if self.length + m > self.k.shape[1]:
            cap = max(64, 2 * (self.length + m))
            grown_k = np.zeros((self.num_kv_heads, cap, self.head_dim), np.float32)
            grown_v = np.zeros_like(grown_k)
            if self.length:
                grown_k[:, :self.length] = self.k[:, :self.length]
                grown_v[:, :self.length] = self.v[:, :self.length]
            self.k, self.v = grown_k, grown_v
        self.k[:, self.length:self.length + m] = k.transpose(1, 0, 2)
        self.v[:, self.length:self.length + m] = v.transpose(1, 0, 2)
        self.length += m

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass
class HeadItem:
    """Rows one sequence feeds the head in one forward: positions
    ``cache.base + cache.length ..`` (consecutive after its cached rows)."""

    cache: HeadCache
    token_ids: torch.Tensor  # int64 [m]: target ids, x_{i+1} for row i
    features: torch.Tensor  # float32 [m, hidden]: fused target features or the head's own output


class FeatureHead:
    """The head's forward over a ragged batch of ``HeadItem``s (module doc)."""

    def __init__(self, spec: HeadSpec, weights: dict[str, torch.Tensor], draft_to_target: torch.Tensor,
                 projection_dtype: str | torch.dtype = "float32") -> None:
        """weights: float32 tensors by role (``LAYER_TENSORS`` names plus
        embed, final_norm, lm_head and the kind's input tensors);
        draft_to_target: int64 [draft_vocab] target id of each logits column;
        projection_dtype: one of HEAD_PROJECTION_DTYPES (or a torch dtype):
        bfloat16 keeps the projections' weights in bfloat16 (half the bytes a
        draft step reads), q8_0 / q4_1 as GGUF blocks (``_projections``)."""
        self.spec = spec
        self.w = weights
        self.draft_to_target = draft_to_target
        self.inv_freq = rope_inv_freq(spec.rope, spec.head_dim)  # float32 [D / 2]
        self._inv_freq = self.inv_freq.float().numpy()
        self._embed = weights["embed"].float().numpy()  # [vocab, hidden]
        self._vectors = {name: t.float().numpy() for name, t in weights.items() if t.dim() == 1}  # the norms
        draft_ops.warm_up()
        cpu_ops.warm_up()
        self.scale = spec.head_dim ** -0.5
        self.projection_dtype = projection_dtype_name(projection_dtype)
        self.threads = torch.get_num_threads()  # the projections' GEMMs split over as many (set_threads)
        self.proj = _projections(weights, self.projection_dtype)

    def set_threads(self, threads: int) -> None:
        """Runs the head on ``threads`` CPU threads: torch's (process-wide)
        and its projections' GEMMs, rebuilt when the count changes (a GEMM
        keeps the thread count it was built with)."""
        set_torch_threads(threads)
        if threads != self.threads:
            self.threads = threads
            self.proj = _projections(self.w, self.projection_dtype)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_to_target.shape[0])

    def weight_bytes(self) -> int:
        """Bytes of the weights one draft step reads (the token embedding excluded)."""
        return sum(t.nbytes for name, t in self.w.items() if name != "embed")

    def fuse(self, rows: torch.Tensor) -> torch.Tensor:
        """Target features as the layer reads them: float32 [T, feature_dim]
        -> [T, hidden] (eagle3: fc; MTP: the target's final norm)."""
        x = np.ascontiguousarray(rows.float().numpy())
        if self.spec.kind == EAGLE3:
            return torch.from_numpy(self.proj["fc"].on_array(x))
        return torch.from_numpy(cpu_ops.rms_norm(x, self._vectors["target_norm"], np.float32(self.spec.rms_norm_eps)))

    @torch.inference_mode()
    def forward(self, items: list[HeadItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends every item's rows to its cache. Returns the fed-back
        hidden states float32 [T, hidden] of all rows (in item order) and the
        draft-vocabulary logits float32 [len(items), draft_vocab] of each
        item's last row. Between the GEMMs the rows stay in numpy and each
        small step is one numba call (``draft_ops``, ``engine.cpu_ops``)."""
        eps, w = np.float32(self.spec.rms_norm_eps), self._vectors
        tokens = np.concatenate([np.asarray(it.token_ids) for it in items])  # [T]
        g = np.concatenate([np.asarray(it.features, dtype=np.float32) for it in items])  # [T, hidden]
        positions = np.concatenate([np.arange(it.cache.base + it.cache.length,
                                              it.cache.base + it.cache.length + len(it.token_ids))
                                    for it in items])  # [T]
        x, residual = self._layer_input(self._embed[tokens], g, positions)
        h, x = cpu_ops.add_rms_norm(residual, self._attention(x, positions, items),
                                    w["post_attention_layernorm.weight"], eps)
        out = h + self.proj["down"].on_array(cpu_ops.silu_mul(self.proj["gate_up"].on_array(x)))
        last = np.cumsum([len(it.token_ids) for it in items]) - 1  # [len(items)]
        if self.spec.kind == MIMO_MTP:
            normed = cpu_ops.rms_norm(out, w["final_norm"], eps)  # [T, hidden], fed back
            logits = self.proj["lm_head"].on_array(np.ascontiguousarray(normed[last]))
            return torch.from_numpy(normed), torch.from_numpy(logits)
        logits = self.proj["lm_head"].on_array(cpu_ops.rms_norm(np.ascontiguousarray(out[last]), w["final_norm"], eps))
        return torch.from_numpy(out), torch.from_numpy(logits)  # [len(items), draft_vocab]

    def _layer_input(self, e: np.ndarray, g: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The attention input and the residual of the kind; e: token
        embeddings [T, hidden], g: features [T, hidden]."""
        eps, w = np.float32(self.spec.rms_norm_eps), self._vectors
        if self.spec.kind == EAGLE3:
            gn = cpu_ops.rms_norm(g, w["hidden_norm"], eps)
            x = np.concatenate([cpu_ops.rms_norm(e, w["input_layernorm.weight"], eps), gn], axis=1)  # [T, 2 hidden]
            return x, (gn if self.spec.norm_before_residual else g)
        e = np.where((positions == 0)[:, None], np.float32(0.0), e)
        en, gn = cpu_ops.rms_norm(e, w["token_norm"], eps), cpu_ops.rms_norm(g, w["feature_norm"], eps)
        fused = self.proj["input_proj"].on_array(
            np.concatenate([en, gn] if self.spec.kind == DEEPSEEK_MTP else [gn, en], axis=1))
        return cpu_ops.rms_norm(fused, w["input_layernorm.weight"], eps), fused

    def _attention(self, x: np.ndarray, positions: np.ndarray, items: list[HeadItem]) -> np.ndarray:
        """Causal attention of every item's rows over its cache and its own
        earlier rows (the new rows are cached first); x: [T, in] -> [T, hidden]."""
        s = self.spec
        T, H, Hkv, D = x.shape[0], s.num_heads, s.num_kv_heads, s.head_dim
        qkv = self.proj["qkv"].on_array(x)
        q = np.ascontiguousarray(qkv[:, :H * D]).reshape(T, H, D)
        k = np.ascontiguousarray(qkv[:, H * D:(H + Hkv) * D]).reshape(T, Hkv, D)
        draft_ops.rope(q, positions, self._inv_freq)
        draft_ops.rope(k, positions, self._inv_freq)
        v = qkv[:, (H + Hkv) * D:].reshape(T, Hkv, D)
        out = np.empty((T, H, D), np.float32)
        row = 0
        for it in items:
            m, c = len(it.token_ids), it.cache
            c.append(k[row:row + m], v[row:row + m])
            out[row:row + m] = draft_ops.attend(q[row:row + m], c.k, c.v, c.length, self.scale)
            row += m
        return self.proj["o"].on_array(out.reshape(T, H * D))


def projection_dtype_name(dtype: str | torch.dtype) -> str:
    """A head's projection weights as named in HEAD_PROJECTION_DTYPES (a
    torch dtype by its name); ValueError naming the choices."""
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    if name not in HEAD_PROJECTION_DTYPES:
        raise ValueError(f"head projection weights: one of {', '.join(HEAD_PROJECTION_DTYPES)}, not {name!r}")
    return name


def _projections(w: dict[str, torch.Tensor], dtype: str = "float32") -> dict:
    """The head's projections (q/k/v and gate/up fused) as callables [T, in]
    -> [T, out] (float32 in and out) through the GEMM path the engine would
    take on this CPU (gemm_select: checked, timed once, cached): a draft step
    is a few one-row products, where MKL (F.linear) is several times slower.
    dtype bfloat16: the weights rounded to bfloat16 and read as such by the
    simd path (the one that widens bfloat16 weights in registers; a step is
    bound by the bytes it reads, so about half the time); q8_0 / q4_1: the
    weights quantised into GGUF blocks at load (``gemm_gguf.quantize``), read
    by the simd-gguf path. Drafts may differ slightly, never the output:
    verification decides."""
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    qkv_w = [w[f"{n}.weight"] for n in qkv]
    qkv_b = [w.get(f"{n}.bias") for n in qkv]
    roles = [("qkv", torch.cat(qkv_w), None if all(b is None for b in qkv_b) else
              torch.cat([b if b is not None else torch.zeros(len(t)) for b, t in zip(qkv_b, qkv_w)])),
             ("o", w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias")),
             ("gate_up", torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]), None),
             ("down", w["mlp.down_proj.weight"], None), ("lm_head", w["lm_head"], None),
             *((name, w[name], None) for name in ("fc", "input_proj") if name in w)]

    def bfloat16(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        return Linear(weight.to(torch.bfloat16), bias, GEMM_PATHS["simd"])

    if dtype == "bfloat16":
        return {role: bfloat16(weight, bias) for role, weight, bias in roles}
    if dtype in QUANTIZED_PROJECTIONS:  # a width that is not whole blocks (stories260K's 172) stays bfloat16
        kind = QUANTIZED_PROJECTIONS[dtype]
        return {role: Linear(weight, bias, GEMM_PATHS["simd-gguf"], gemm_gguf.quantize(weight.numpy(), kind))
                if weight.shape[1] % gemm_gguf.BLOCK == 0 else bfloat16(weight, bias) for role, weight, bias in roles}
    chosen = select(roles, torch.float32, torch.get_num_threads(), max_rows=HEAD_CHECK_ROWS)
    return {role: linear for (role, _, _), linear in zip(roles, chosen.linears)}


# ---- checkpoints -------------------------------------------------------------------


def read_tensors(directory: Path, keep=lambda name: True) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint directory (``*.safetensors``, else
    ``pytorch_model*.bin``) whose names pass ``keep``, as stored."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            out.update({name: st.get_tensor(name) for name in st.keys() if keep(name)})
    if files:
        return out
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"{directory}: no *.safetensors or pytorch_model*.bin weights")
    for f in bins:
        out.update({k: v for k, v in torch.load(f, map_location="cpu", weights_only=True).items() if keep(k)})
    return out


def target_tensors(target: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Named tensors of the target (HF names), as its files store them: by
    the target's checkpoint record where one holds them (engine.checkpoint:
    tied names too, e.g. the embeddings of a GGUF model's copy, saved as its
    LM head only), else read straight from its safetensors, else through
    transformers (GGUF, hub)."""
    from specdec.engine.checkpoint import load_hf_model, remembered_tensors
    from specdec.models import resolve_model

    remembered = remembered_tensors(target, names)
    if remembered is not None:
        return remembered
    src = resolve_model(target)
    path = Path(src.path)
    if path.is_dir() and not src.gguf_file:
        found = read_tensors(path, lambda n: n in names)
        if "lm_head.weight" in names and "lm_head.weight" not in found and "model.embed_tokens.weight" in found:
            found["lm_head.weight"] = found["model.embed_tokens.weight"]  # tied embeddings
        if all(n in found for n in names):
            return found
    sd = load_hf_model(target).state_dict()
    return {n: sd[n] for n in names}


def target_config(target: str):
    """The target's config: its checkpoint record's values where one is
    written (engine.checkpoint; no transformers import), else transformers'."""
    from specdec.engine.checkpoint import remembered_config

    remembered = remembered_config(target)
    if remembered is not None:
        return remembered
    from transformers import AutoConfig

    from specdec.models import resolve_model

    src = resolve_model(target)
    return AutoConfig.from_pretrained(src.path, **src.hf_kwargs())


def _spec(kind: str, cfg, feature_layers: tuple[int, ...], target_hidden: int, vocab: int) -> HeadSpec:
    heads = cfg.num_attention_heads
    return HeadSpec(kind=kind, hidden_size=cfg.hidden_size, num_heads=heads,
                    num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                    head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                    rms_norm_eps=cfg.rms_norm_eps, rope=rope_parameters(cfg), vocab_size=vocab,
                    feature_layers=feature_layers, target_hidden_size=target_hidden,
                    norm_before_residual=bool(getattr(cfg, "norm_before_residual", False)))


def eagle3_layer_ids(config: dict, target_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 config reads: ``eagle_aux_hidden_state_layer_ids``
    at the top level or in ``eagle_config`` (vLLM's lookup), else vLLM's default."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    layers = tuple(int(i) for i in ids) if ids else default_eagle3_layers(target_layers)
    if len(layers) != 3 or not all(0 <= i <= target_layers for i in layers):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids: need 3 layers in 0..{target_layers}, got {list(layers)}")
    return layers


def load_eagle3(head_dir: str, target: str, projection_dtype: str | torch.dtype = "float32") -> FeatureHead:
    """An EAGLE-3 head in the public layout (config.json + model.safetensors
    or pytorch_model.bin: fc, midlayer.*, norm, lm_head, d2t, t2d, optional
    embed_tokens) for ``target``, whose embeddings it shares when it has
    none. ValueError naming what does not fit."""
    path = Path(head_dir)
    config = json.loads((path / "config.json").read_text())
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{head_dir}: num_hidden_layers {config['num_hidden_layers']}: only one-layer EAGLE-3 "
                         f"heads are supported")
    cfg = types.SimpleNamespace(**config)
    tcfg = target_config(target)
    vocab = int(config.get("vocab_size") or tcfg.vocab_size)
    if vocab != tcfg.vocab_size:
        raise ValueError(f"{head_dir}: vocab_size {vocab} differs from the target's {tcfg.vocab_size}")
    target_hidden = int(config.get("target_hidden_size") or cfg.hidden_size)
    if target_hidden != tcfg.hidden_size:
        raise ValueError(f"{head_dir}: target_hidden_size {target_hidden} differs from the target's "
                         f"{tcfg.hidden_size}")
    if (config.get("eagle_config") or {}).get("use_aux_hidden_state", True) is False:
        raise ValueError(f"{head_dir}: eagle_config.use_aux_hidden_state false (an EAGLE-1/2 head): not supported")
    layers = eagle3_layer_ids(config, tcfg.num_hidden_layers)
    raw = {_eagle3_name(n): t for n, t in read_tensors(path).items()}
    missing = [n for n in ["fc.weight", "midlayer.hidden_norm.weight", "norm.weight",
                           *(f"midlayer.{t}" for t in LAYER_TENSORS)] if n not in raw]
    if missing:
        raise ValueError(f"{head_dir}: not an EAGLE-3 head: missing {', '.join(missing)}")
    w = {n: raw[f"midlayer.{n}"].float() for n in LAYER_TENSORS + ATTENTION_BIASES if f"midlayer.{n}" in raw}
    w["fc"], w["hidden_norm"], w["final_norm"] = (raw["fc.weight"].float(), raw["midlayer.hidden_norm.weight"].float(),
                                                  raw["norm.weight"].float())
    w["embed"] = (raw["embed_tokens.weight"] if "embed_tokens.weight" in raw else
                  target_tensors(target, ["model.embed_tokens.weight"])["model.embed_tokens.weight"]).float()
    w["lm_head"] = raw.get("lm_head.weight", w["embed"]).float()
    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    if w["lm_head"].shape[0] != draft_vocab:
        raise ValueError(f"{head_dir}: lm_head has {w['lm_head'].shape[0]} rows, draft_vocab_size is {draft_vocab}")
    d2t = raw.get("d2t", torch.zeros(draft_vocab, dtype=torch.long)).long()
    spec = _spec(EAGLE3, cfg, layers, target_hidden, vocab)
    _check_shapes(spec, w, head_dir, attention_in=2 * spec.hidden_size)
    if w["fc"].shape != (spec.hidden_size, spec.feature_dim):
        raise ValueError(f"{head_dir}: fc.weight {tuple(w['fc'].shape)}, expected "
                         f"{(spec.hidden_size, spec.feature_dim)}")
    return FeatureHead(spec, w, draft_ids_to_target(d2t, vocab, head_dir), projection_dtype)


def _eagle3_name(name: str) -> str:
    """Checkpoint names without a ``model.`` prefix, ``layers.0.`` read as ``midlayer.`` (vLLM accepts both)."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def draft_ids_to_target(d2t: torch.Tensor, vocab: int, where: str) -> torch.Tensor:
    """Target id of every draft id: ``d + d2t[d]`` (d2t stores offsets, as
    vLLM's compute_logits and SGLang's hot_token_id read it)."""
    ids = torch.arange(len(d2t)) + d2t
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{where}: d2t maps draft ids outside the target vocabulary [0, {vocab})")
    return ids


def load_mtp(target: str, projection_dtype: str | torch.dtype = "float32") -> FeatureHead:
    """The first next-token-prediction layer a target checkpoint carries:
    DeepSeek naming (``model.layers.{num_hidden_layers}.{enorm, hnorm,
    eh_proj, shared_head.*}``, ``num_nextn_predict_layers``) or MiMo naming
    (``model.mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj,
    final_layernorm}``), with Llama/Qwen2-style attention and MLP."""
    from specdec.models import resolve_model

    tcfg = target_config(target)
    src = resolve_model(target)
    if not Path(src.path).is_dir() or src.gguf_file:
        raise ValueError(f"mtp: {target} is not a safetensors checkpoint directory (MTP layers are read from it)")
    L = tcfg.num_hidden_layers
    prefixes = {DEEPSEEK_MTP: f"model.layers.{L}.", MIMO_MTP: "model.mtp_layers.0."}
    raw = read_tensors(Path(src.path), lambda n: n.startswith(tuple(prefixes.values())) or n in (
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"))
    kind = next((k for k, p in prefixes.items() if f"{p}input_layernorm.weight" in raw), None)
    if kind is None:
        raise ValueError(f"mtp: {target} carries no MTP layer (looked for model.layers.{L}.* and model.mtp_layers.0.*)")
    p = prefixes[kind]
    if f"{p}self_attn.q_proj.weight" not in raw:
        raise ValueError(f"mtp: {target}'s MTP layer has no self_attn.q_proj (MLA attention is not supported)")
    w = {n: raw[p + n].float() for n in LAYER_TENSORS + ATTENTION_BIASES if p + n in raw}
    names = ({"token_norm": "enorm.weight", "feature_norm": "hnorm.weight", "input_proj": "eh_proj.weight",
              "final_norm": "shared_head.norm.weight"} if kind == DEEPSEEK_MTP else
             {"token_norm": "token_layernorm.weight", "feature_norm": "hidden_layernorm.weight",
              "input_proj": "input_proj.weight", "final_norm": "final_layernorm.weight"})
    w.update({role: raw[p + n].float() for role, n in names.items()})
    w["embed"] = raw.get(p + "embed_tokens.weight", raw["model.embed_tokens.weight"]).float()
    head = raw.get(p + "shared_head.head.weight", raw.get("lm_head.weight", raw["model.embed_tokens.weight"]))
    w["lm_head"], w["target_norm"] = head.float(), raw["model.norm.weight"].float()
    spec = _spec(kind, tcfg, (L,), tcfg.hidden_size, tcfg.vocab_size)
    _check_shapes(spec, w, target, attention_in=spec.hidden_size)
    return FeatureHead(spec, w, torch.arange(w["lm_head"].shape[0]), projection_dtype)


def _check_shapes(spec: HeadSpec, w: dict[str, torch.Tensor], where: str, attention_in: int) -> None:
    """ValueError naming the first projection whose shape the config contradicts."""
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    want = {"self_attn.q_proj.weight": (q_out, attention_in), "self_attn.k_proj.weight": (kv_out, attention_in),
            "self_attn.v_proj.weight": (kv_out, attention_in), "self_attn.o_proj.weight": (spec.hidden_size, q_out),
            "embed": (spec.vocab_size, spec.hidden_size)}
    for name, shape in want.items():
        if tuple(w[name].shape) != shape:
            raise ValueError(f"{where}: {name} has shape {tuple(w[name].shape)}, the config implies {shape}")
