"""``specdec distill --kind eagle3``: train an EAGLE-3 head for a target, on
the draft recipe's data (``distill.teacher_data``), and save it in the
public layout vLLM and SGLang load (and ``proposer_svc.eagle3.load_eagle3``).

- features: the target's hidden states at vLLM's default low/mid/high
  layers (``eagle3.default_eagle3_layers``; index i = output of decoder
  layer i, before the final norm), rounded through bfloat16 as the wire
  carries them;
- draft vocabulary: the ``draft_vocab`` target tokens seen most often in the
  training data (tokens and the teacher's top-K), ``d2t[d] = target_id - d``;
- head: one decoder layer started from the target's last layer (q/k/v read
  [embedding; feature], both halves from the target's), ``fc`` starting as
  "take the high layer", norm and lm_head from the target's (hot rows);
  the token embedding stays the target's (not saved: shared);
- loss: cross-entropy against the teacher's top-K distribution restricted to
  the draft vocabulary and renormalised, summed over ``TTT_STEPS`` chained
  steps (EAGLE-3's training-time test: step s feeds the head's own output of
  step s - 1, attending to the real rows up to its origin and its own chain,
  as chain drafting does at serving time).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdec.distill import head_targets
from specdec.engine.llama import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq, rope_parameters
from specdec.proposer_svc.eagle3 import LAYER_TENSORS, default_eagle3_layers

#: chained steps per training row (EAGLE-3's training-time test)
TTT_STEPS = 3


@torch.inference_mode()
def hidden_features(target, token_ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The target's hidden states of ``layers`` at every position, side by
    side, rounded through bfloat16: [n, hidden * len(layers)]. Hooks, since
    transformers' output_hidden_states gives the last layer after the norm."""
    outputs: dict[int, torch.Tensor] = {}
    hooks = [target.model.embed_tokens.register_forward_hook(lambda m, i, o: outputs.__setitem__(0, o))]
    for idx, layer in enumerate(target.model.layers):
        hooks.append(layer.register_forward_hook(
            lambda m, i, o, idx=idx: outputs.__setitem__(idx + 1, o[0] if isinstance(o, tuple) else o)))
    try:
        target(torch.tensor([token_ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat([outputs[i][0] for i in layers], dim=-1).to(torch.bfloat16).float()


def hot_tokens(data: dict, vocab: int, draft_vocab: int) -> torch.Tensor:
    """The draft vocabulary: int64 [min(draft_vocab, vocab)] target ids, the
    most frequent in the data's tokens and teacher top-K, sorted by id."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for seq, top in zip(data["tokens"], data["top_ids"]):
        counts += torch.bincount(torch.tensor(seq), minlength=vocab)
        counts += torch.bincount(top.long().flatten(), minlength=vocab)
    keep = min(draft_vocab, vocab)
    return torch.sort(torch.argsort(counts, descending=True, stable=True)[:keep]).values


class Eagle3Student(torch.nn.Module):
    """The trainable head; parameters carry the public names (``.`` as ``__``)."""

    embed: torch.Tensor  # [vocab, hidden]: the target's token embeddings (frozen, not saved)
    hot: torch.Tensor  # int64 [draft_vocab]: target id of each draft id

    def __init__(self, target, layers: tuple[int, ...], hot: torch.Tensor) -> None:
        super().__init__()
        cfg = target.config
        sd = {k: v.detach().float() for k, v in target.state_dict().items()}
        last = f"model.layers.{cfg.num_hidden_layers - 1}."
        h = cfg.hidden_size
        w = {f"midlayer.{n}": sd[last + n].clone() for n in LAYER_TENSORS}
        for proj in ("q_proj", "k_proj", "v_proj"):
            w[f"midlayer.self_attn.{proj}.weight"] = torch.cat([sd[f"{last}self_attn.{proj}.weight"]] * 2, 1) / 2
        w["midlayer.hidden_norm.weight"] = sd[last + "input_layernorm.weight"].clone()
        fc = torch.zeros(h, h * len(layers))
        fc[:, -h:] = torch.eye(h)  # start as "the high layer"
        w["fc.weight"] = fc
        w["norm.weight"] = sd["model.norm.weight"].clone()
        head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        w["lm_head.weight"] = head[hot].clone()
        self.params = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v) for k, v in w.items()})
        self.register_buffer("embed", sd["model.embed_tokens.weight"], persistent=False)
        self.register_buffer("hot", hot, persistent=False)
        self.config = cfg
        self.layers = layers
        heads = cfg.num_attention_heads
        self.num_heads, self.num_kv_heads = heads, getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = getattr(cfg, "head_dim", None) or h // heads
        self.eps = cfg.rms_norm_eps
        self.inv_freq = rope_inv_freq(rope_parameters(cfg), self.head_dim)

    def p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def forward(self, token_ids: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Chained steps over one sequence: token_ids int64 [n], features
        [n - 1, feature_dim] (f_0 .. f_{n-2}). Step s row i reads x_{i+1+s}
        and predicts x_{i+2+s}; returns per step the final-normed outputs
        [n - 1 - s, hidden] (``logits`` turns the rows a loss needs into
        draft-vocabulary logits)."""
        m = len(features)
        g = F.linear(features, self.p("fc.weight"))  # [m, hidden]
        keys: list[torch.Tensor] = []  # per step: [H, rows, D] (GQA expanded)
        values: list[torch.Tensor] = []
        normed = []
        for s in range(steps):
            rows = m - s
            if rows < 1:
                break
            e = F.embedding(token_ids[1 + s:1 + s + rows], self.embed)
            positions = torch.arange(s, s + rows)
            out = self._layer(e, g[:rows], positions, keys, values)
            normed.append(rms_norm(out, self.p("norm.weight"), self.eps))
            g = out  # the next step feeds this step's own output (row i stays row i)
        return normed

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [m, draft_vocab] of final-normed rows [m, hidden]."""
        return F.linear(normed, self.p("lm_head.weight"))

    def _layer(self, e, g, positions, keys, values) -> torch.Tensor:
        """The EAGLE-3 layer (residual g); attention of step s over step 0's
        rows causally and over rows 1..s of its own chain (the diagonal)."""
        rows, H, Hkv, D = len(e), self.num_heads, self.num_kv_heads, self.head_dim
        gn = rms_norm(g, self.p("midlayer.hidden_norm.weight"), self.eps)
        x = torch.cat([rms_norm(e, self.p("midlayer.input_layernorm.weight"), self.eps), gn], dim=-1)
        q = F.linear(x, self.p("midlayer.self_attn.q_proj.weight")).view(rows, H, D)
        k = F.linear(x, self.p("midlayer.self_attn.k_proj.weight")).view(rows, Hkv, D)
        v = F.linear(x, self.p("midlayer.self_attn.v_proj.weight")).view(rows, Hkv, D)
        cos, sin = rope_cos_sin(positions.float()[:, None] * self.inv_freq[None, :])  # [rows, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys.append(k.transpose(0, 1).repeat_interleave(H // Hkv, 0))  # [H, rows, D]
        values.append(v.transpose(0, 1).repeat_interleave(H // Hkv, 0))
        qh = q.transpose(0, 1) * D ** -0.5  # [H, rows, D]
        base = qh @ keys[0][:, :rows].transpose(1, 2)  # [H, rows, rows0]: step-0 rows
        causal = torch.arange(rows)[None, :] <= torch.arange(rows)[:, None]  # [rows, rows]
        base = base.masked_fill(~causal, float("-inf"))
        diag = [(qh * kk[:, :rows]).sum(-1, keepdim=True) for kk in keys[1:]]  # own chain rows
        att = torch.softmax(torch.cat([base, *diag], dim=-1), dim=-1)
        out = att[..., :rows] @ values[0][:, :rows]
        for j, vv in enumerate(values[1:]):
            out = out + att[..., base.shape[-1] + j:base.shape[-1] + j + 1] * vv[:, :rows]
        o = F.linear(out.transpose(0, 1).reshape(rows, H * D), self.p("midlayer.self_attn.o_proj.weight"))
        h = g + o
        hn = rms_norm(h, self.p("midlayer.post_attention_layernorm.weight"), self.eps)
        mlp = F.linear(F.silu(F.linear(hn, self.p("midlayer.mlp.gate_proj.weight"))) *
                       F.linear(hn, self.p("midlayer.mlp.up_proj.weight")), self.p("midlayer.mlp.down_proj.weight"))
        return h + mlp

    def save(self, out: Path) -> None:
        """config.json + model.safetensors in the public EAGLE-3 layout."""
        from safetensors.torch import save_file

        cfg, vocab = self.config, self.embed.shape[0]
        tensors = {k.replace("__", "."): v.detach().contiguous() for k, v in self.params.items()}
        draft_vocab = len(self.hot)
        tensors["d2t"] = (self.hot - torch.arange(draft_vocab)).long()
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[self.hot] = True
        tensors["t2d"] = t2d
        save_file(tensors, str(out / "model.safetensors"))
        rope = rope_parameters(cfg)
        config = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": cfg.hidden_size,
            "intermediate_size": self.p("midlayer.mlp.gate_proj.weight").shape[0],
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "num_hidden_layers": 1, "rms_norm_eps": self.eps, "hidden_act": "silu",
            "vocab_size": vocab, "draft_vocab_size": draft_vocab, "target_hidden_size": cfg.hidden_size,
            "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": rope["rope_theta"],
            "rope_scaling": None if rope["rope_type"] == "default" else rope, "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.layers), "use_aux_hidden_state": True},
        }
        (out / "config.json").write_text(json.dumps(config, indent=2))


def eagle3_loss(student: Eagle3Student, data: dict, rows: list[int], t2d_index: torch.Tensor,
                steps: int = TTT_STEPS) -> tuple[torch.Tensor, int]:
    """Cross-entropy of every chained step against the teacher's top-K
    distribution restricted to the draft vocabulary (renormalised), on the
    answer positions of ``rows``; (mean loss, positions). t2d_index: int64
    [vocab], the draft id of each target id or -1."""
    total, count = torch.zeros(()), 0
    for r in rows:
        seq, start = data["tokens"][r], data["start"][r]
        ids = torch.tensor(seq)
        feats = data["features"][r][:len(seq) - 1].float()
        for s, normed in enumerate(student(ids, feats, steps)):
            t = torch.arange(len(normed)) + 1 + s  # teacher position of row i: i + 1 + s
            keep = (t >= start) & (t < start + len(data["top_ids"][r]))  # rows the teacher has
            if not keep.any():
                continue
            at = t[keep] - start  # teacher_data's rows start at the last prompt position
            d_ids, t_p, ok = head_targets(data["top_ids"][r][at], data["top_logp"][r][at], t2d_index)
            logits = student.logits(normed[keep][ok])  # the head over answer rows only (a prompt row has no teacher)
            logp = torch.log_softmax(logits.float(), -1).gather(1, d_ids)
            total = total - (t_p * logp).sum()
            count += int(ok.sum())
    return total / max(count, 1), count


@torch.inference_mode()
def eagle3_accepted_length(target, head_dir: Path, target_name: str, prompt_ids: list[list[int]], k: int,
                           max_new_tokens: int) -> float:
    """Greedy speculation simulated with the saved head served by the real
    proposer code (``load_eagle3`` + ``FeatureDraftProposer``): per round the
    head drafts k tokens from the features of the context so far, the
    accepted ones are its longest prefix agreeing with the target's greedy
    answer, plus one target token; mean of accepted + 1 over all rounds."""
    from specdec.proposer_svc.base import SeqOptions
    from specdec.proposer_svc.eagle3 import load_eagle3
    from specdec.proposer_svc.feature_draft import FeatureDraftProposer

    head = load_eagle3(str(head_dir), target_name)
    proposer = FeatureDraftProposer("eagle3", head)
    lengths = []
    for n, p in enumerate(prompt_ids):
        ids = torch.tensor([p])
        answer = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0)[0, len(p):].tolist()
        feats = hidden_features(target, p + answer, head.spec.feature_layers).numpy()
        seq = f"held-out-{n}"
        proposer.start(seq, np.asarray(p, dtype=np.int32), SeqOptions(min_token_prob=0.0))
        pos = 0
        while pos < len(answer):
            context_len = len(p) + pos
            start = proposer.features_from(seq)
            proposer.add_features(seq, start, feats[start:context_len - 1])
            draft = proposer.propose([(seq, k)])[0].token_ids.tolist()
            accepted = 0
            while accepted < len(draft) and pos + accepted < len(answer) and draft[accepted] == answer[pos + accepted]:
                accepted += 1
            lengths.append(accepted + 1)
            new = answer[pos:pos + accepted + 1]
            proposer.extend(seq, np.asarray(new, dtype=np.int32))
            pos += len(new)
        proposer.stop(seq, completed=True)
    return sum(lengths) / len(lengths)


def eagle3_layers(target) -> tuple[int, ...]:
    """The target layers the distilled head reads (vLLM's default)."""
    return default_eagle3_layers(target.config.num_hidden_layers)
