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
  as chain drafting does at serving time); a chained step computes only the
  rows some loss reads (``Pack.keep``: not the prompt's), the same loss.
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

    def forward(self, pack: "Pack", steps: int) -> list[torch.Tensor]:
        """Chained steps over a batch of sequences packed row after row (see
        ``Pack``): step s row i of a sequence reads x_{i+1+s} and predicts
        x_{i+2+s}; returns per step the final-normed outputs [N, hidden] of
        every packed row (``logits`` turns the rows a loss needs into
        draft-vocabulary logits). A row past its sequence's end at step s
        computes on a padding token and is never read."""
        g = F.linear(pack.features, self.p("fc.weight"))  # [N, hidden]
        keys: list[torch.Tensor] = []  # per step: [B, H, L, D] (GQA expanded, padded)
        values: list[torch.Tensor] = []
        normed = []
        for s in range(steps):
            keep = pack.keep[s]  # the rows this step computes (None: all; ``Pack.keep``)
            tokens, positions = pack.tokens[s], pack.local + s
            if keep is not None:
                tokens, positions, g = tokens[keep], positions[keep], g[keep]
            out = self._layer(F.embedding(tokens, self.embed), g, positions, pack, keys, values, keep)
            if keep is not None:  # back to every packed row (zeros where not computed: never read)
                out = out.new_zeros(len(pack.local), out.shape[1]).index_copy(0, keep, out)
            normed.append(rms_norm(out, self.p("norm.weight"), self.eps))
            g = out  # the next step feeds this step's own output (row i stays row i)
        return normed

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [m, draft_vocab] of final-normed rows [m, hidden]."""
        return F.linear(normed, self.p("lm_head.weight"))

    def _layer(self, e, g, positions, pack: "Pack", keys, values, keep=None) -> torch.Tensor:
        """The EAGLE-3 layer (residual g) over the packed rows ``keep`` (None:
        all) at once; attention per sequence (padded to [B, H, L, L]) of step
        s over step 0's rows causally and over rows 1..s of its own chain
        (the diagonal). Padding sits after each sequence's rows, so the
        causal mask alone keeps a real row from reading it; rows a step does
        not compute hold zeros there, read by no computed row (a row's chain
        is computed at every step before one that computes it)."""
        rows, H, Hkv, D = len(e), self.num_heads, self.num_kv_heads, self.head_dim
        gn = rms_norm(g, self.p("midlayer.hidden_norm.weight"), self.eps)
        x = torch.cat([rms_norm(e, self.p("midlayer.input_layernorm.weight"), self.eps), gn], dim=-1)
        q = F.linear(x, self.p("midlayer.self_attn.q_proj.weight")).view(rows, H, D)
        k = F.linear(x, self.p("midlayer.self_attn.k_proj.weight")).view(rows, Hkv, D)
        v = F.linear(x, self.p("midlayer.self_attn.v_proj.weight")).view(rows, Hkv, D)
        cos, sin = rope_cos_sin(positions.float()[:, None] * self.inv_freq[None, :])  # [rows, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if keep is not None:  # every packed row again, zeros where not computed
            q, k, v = (t.new_zeros(len(pack.local), *t.shape[1:]).index_copy(0, keep, t) for t in (q, k, v))
        keys.append(pack.padded(k.repeat_interleave(H // Hkv, 1)))  # [B, H, L, D]
        values.append(pack.padded(v.repeat_interleave(H // Hkv, 1)))
        qh = pack.padded(q * D ** -0.5)  # [B, H, L, D]
        L = qh.shape[2]
        base = (qh @ keys[0].transpose(2, 3)).masked_fill(~pack.causal, float("-inf"))  # [B, H, L, L]
        diag = [(qh * kk).sum(-1, keepdim=True) for kk in keys[1:]]  # own chain rows
        att = torch.softmax(torch.cat([base, *diag], dim=-1), dim=-1)
        out = att[..., :L] @ values[0]
        for j, vv in enumerate(values[1:]):
            out = out + att[..., L + j:L + j + 1] * vv
        attended = pack.unpadded(out).reshape(len(pack.local), H * D)
        o = F.linear(attended if keep is None else attended[keep], self.p("midlayer.self_attn.o_proj.weight"))
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


class Pack:
    """A batch of training sequences packed row after row for the head's
    linear layers (row i of a sequence of n tokens reads feature f_i; n - 1
    rows), with their lengths and offsets that pad them to [B, L] for attention; per
    chained step the token each row reads, and the rows a loss needs with
    their teacher rows."""

    def __init__(self, data: dict, rows: list[int], steps: int, every_row: bool = False) -> None:
        lengths = [len(data["tokens"][r]) - 1 for r in rows]
        L = max(lengths)
        offsets = np.cumsum([0, *lengths])
        self.lengths, self.offsets = lengths, [int(o) for o in offsets[:-1]]
        self.features = torch.cat([data["features"][r][:m].float() for r, m in zip(rows, lengths)])
        self.local = torch.cat([torch.arange(m) for m in lengths])  # row i's index in its sequence
        self.shape = (len(rows), L)
        self.causal = torch.ones(L, L, dtype=torch.bool).tril()
        self.tokens: list[torch.Tensor] = []  # per step: int64 [N], x_{i+1+s} (0 past the end)
        self.loss_rows: list[torch.Tensor] = []  # per step: packed rows whose position the teacher has
        self.top_ids: list[torch.Tensor] = []  # per step: the teacher's rows of those
        self.top_logp: list[torch.Tensor] = []
        # per step: the packed rows it computes, None for all. Step 0 computes every row (chained steps
        # attend to all of its keys); step s > 0 only rows whose output a loss reads, at that step or
        # through their own chain later: start - steps <= i <= start + answer rows - 2 - s. The prompt's
        # rows are a quarter of the rows (SmolLM2's chat recipe): ~11 % of a training step's GEMMs.
        self.keep: list[torch.Tensor | None] = [None] * steps
        for s in range(1, steps if not every_row else 1):
            kept = []
            for b, (r, m) in enumerate(zip(rows, lengths)):
                start, teacher = data["start"][r], len(data["top_ids"][r])
                lo, hi = max(start - steps, 0), min(start + teacher - 2 - s, m - 1)
                kept.append(torch.arange(int(offsets[b]) + lo, int(offsets[b]) + max(hi + 1, lo)))
            self.keep[s] = torch.cat(kept)
        for s in range(steps):
            tokens, loss_rows, top_ids, top_logp = [], [], [], []
            for b, (r, m) in enumerate(zip(rows, lengths)):
                seq, start, teacher = data["tokens"][r], data["start"][r], len(data["top_ids"][r])
                ids = torch.zeros(m, dtype=torch.long)
                alive = max(m - s, 0)  # rows whose step-s token exists
                ids[:alive] = torch.tensor(seq[1 + s:1 + s + alive], dtype=torch.long)
                tokens.append(ids)
                i = torch.arange(alive)
                t = i + 1 + s  # teacher position of row i: i + 1 + s
                keep = (t >= start) & (t < start + teacher)
                at = t[keep] - start  # teacher_data's rows start at the last prompt position
                loss_rows.append(int(offsets[b]) + i[keep])
                top_ids.append(data["top_ids"][r][at])
                top_logp.append(data["top_logp"][r][at])
            self.tokens.append(torch.cat(tokens))
            self.loss_rows.append(torch.cat(loss_rows))
            self.top_ids.append(torch.cat(top_ids))
            self.top_logp.append(torch.cat(top_logp))

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """[N, H, D] packed rows -> [B, H, L, D], zeros after each sequence.
        Slices and pads, not a gather (as before): a gather's
        backward is an accumulating index_put, which took ~8.5 % of a
        training step (SmolLM2, batch 8, 2 cores of an Intel Xeon)."""
        L = self.shape[1]
        parts = [F.pad(x[o:o + m], (0, 0, 0, 0, 0, L - m)) for o, m in zip(self.offsets, self.lengths)]
        return torch.stack(parts).transpose(1, 2)

    def unpadded(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, L, D] -> the packed rows [N, H, D] (slices, as ``padded``)."""
        rows = x.transpose(1, 2)  # [B, L, H, D]
        return torch.cat([rows[b, :m] for b, m in enumerate(self.lengths)])


def eagle3_loss(student: Eagle3Student, data: dict, rows: list[int], t2d_index: torch.Tensor,
                steps: int = TTT_STEPS, every_row: bool = False) -> tuple[torch.Tensor, int]:
    """Cross-entropy of every chained step against the teacher's top-K
    distribution restricted to the draft vocabulary (renormalised), on the
    answer positions of ``rows`` (all sequences in one packed forward);
    (mean loss, positions). t2d_index: int64 [vocab], the draft id of each
    target id or -1."""
    pack = Pack(data, rows, steps, every_row)
    total, count = torch.zeros(()), 0
    for s, normed in enumerate(student(pack, steps)):
        d_ids, t_p, ok = head_targets(pack.top_ids[s], pack.top_logp[s], t2d_index)
        logits = student.logits(normed[pack.loss_rows[s][ok]])  # the head over answer rows only
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
