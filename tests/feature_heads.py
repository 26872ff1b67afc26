"""Test helpers for the feature-head methods (eagle3, mtp): checkpoints
written by hand in the public layouts, and target features computed with
transformers and packed as the wire carries them. Independent of the code
under test (no specdec imports)."""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

#: EAGLE-3 layer tensors under ``midlayer.`` (the public layout)
_LAYER = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")


def _rand(gen: torch.Generator, *shape: int, scale: float = 0.2) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def write_eagle3_head(out: Path, target_dir: Path, layers: list[int] | None, draft_vocab: int = 160,
                      heads: int = 4, kv_heads: int = 2, seed: int = 0) -> Path:
    """A randomly initialised one-layer EAGLE-3 head for the target in
    target_dir, in the layout vLLM/SGLang load: config.json (draft_vocab_size,
    target_hidden_size, eagle_config) and model.safetensors (fc, midlayer.*,
    norm, lm_head, d2t offsets, t2d mask; no embed_tokens: shared with the
    target, so the head is as wide as the target). layers None: the config
    names none (the loader's default)."""
    cfg = json.loads((target_dir / "config.json").read_text())
    vocab, t_hidden = cfg["vocab_size"], cfg["hidden_size"]
    hidden = t_hidden
    gen = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    hot = torch.sort(torch.randperm(vocab, generator=gen)[:draft_vocab]).values  # draft id -> target id
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    w = {
        "fc.weight": _rand(gen, hidden, 3 * t_hidden),
        "midlayer.self_attn.q_proj.weight": _rand(gen, heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": _rand(gen, kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": _rand(gen, kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": _rand(gen, hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": _rand(gen, 96, hidden),
        "midlayer.mlp.up_proj.weight": _rand(gen, 96, hidden),
        "midlayer.mlp.down_proj.weight": _rand(gen, hidden, 96),
        "norm.weight": 1 + _rand(gen, hidden, scale=0.05),
        "lm_head.weight": _rand(gen, draft_vocab, hidden, scale=1.0),
        "d2t": (hot - torch.arange(draft_vocab)).long(),
        "t2d": t2d,
    }
    w.update({f"midlayer.{n}": 1 + _rand(gen, hidden, scale=0.05) for n in _LAYER})
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": 96, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "hidden_act": "silu", "vocab_size": vocab,
              "draft_vocab_size": draft_vocab, "target_hidden_size": t_hidden, "max_position_embeddings": 512,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32"}
    if layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_mtp_target(out: Path, target_dir: Path, naming: str = "deepseek", seed: int = 0) -> Path:
    """A copy of the target checkpoint with one random next-token-prediction
    layer added: DeepSeek naming (model.layers.{L}.{enorm, hnorm, eh_proj,
    shared_head.norm, shared_head.head, ...}, num_nextn_predict_layers 1) or
    MiMo naming (model.mtp_layers.0.{token_layernorm, hidden_layernorm,
    input_proj, final_layernorm, ...})."""
    shutil.copytree(target_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    h, L, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q_out = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_out = cfg["num_key_value_heads"] * cfg["head_dim"]
    ffn = cfg["intermediate_size"]
    gen = torch.Generator().manual_seed(seed)
    p = f"model.layers.{L}." if naming == "deepseek" else "model.mtp_layers.0."
    layer = {"self_attn.q_proj.weight": _rand(gen, q_out, h), "self_attn.k_proj.weight": _rand(gen, kv_out, h),
             "self_attn.v_proj.weight": _rand(gen, kv_out, h), "self_attn.o_proj.weight": _rand(gen, h, q_out),
             "mlp.gate_proj.weight": _rand(gen, ffn, h), "mlp.up_proj.weight": _rand(gen, ffn, h),
             "mlp.down_proj.weight": _rand(gen, h, ffn), "input_layernorm.weight": 1 + _rand(gen, h, scale=0.05),
             "post_attention_layernorm.weight": 1 + _rand(gen, h, scale=0.05)}
    if naming == "deepseek":
        layer.update({"enorm.weight": torch.ones(h), "hnorm.weight": torch.ones(h),
                      "eh_proj.weight": _rand(gen, h, 2 * h), "shared_head.norm.weight": torch.ones(h),
                      "shared_head.head.weight": _rand(gen, vocab, h, scale=1.0)})
    else:
        layer.update({"token_layernorm.weight": torch.ones(h), "hidden_layernorm.weight": torch.ones(h),
                      "input_proj.weight": _rand(gen, h, 2 * h), "final_layernorm.weight": torch.ones(h)})
    cfg["num_nextn_predict_layers"] = 1
    weights = load_file(str(out / "model.safetensors"))
    weights.update({p + n: t.contiguous() for n, t in layer.items()})
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


_HOOKS = threading.Lock()  # forward hooks on a shared model: one caller at a time


@torch.inference_mode()
def target_features(model, token_ids: list[int], layers: list[int]) -> np.ndarray:
    """Hidden states of ``layers`` (0: embeddings, i: output of decoder layer
    i, before the final norm) at every position of token_ids, side by side:
    float32 [n, hidden * len(layers)], rounded through bfloat16 as on the wire."""
    with _HOOKS:
        return _target_features(model, token_ids, layers)


def _target_features(model, token_ids: list[int], layers: list[int]) -> np.ndarray:
    outputs: dict[int, torch.Tensor] = {}
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, i, o: outputs.__setitem__(0, o))]
    for idx, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(
            lambda m, i, o, idx=idx: outputs.__setitem__(idx + 1, o[0] if isinstance(o, tuple) else o)))
    try:
        model(torch.tensor([token_ids]))
    finally:
        for hook in hooks:
            hook.remove()
    rows = torch.cat([outputs[i][0] for i in layers], dim=-1)
    return rows.to(torch.bfloat16).float().numpy()


def bf16_bytes(rows: np.ndarray) -> bytes:
    """float32 rows as the wire's bfloat16 bit patterns (little-endian)."""
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).to(torch.bfloat16).view(
        torch.int16).numpy().astype("<i2").tobytes()
