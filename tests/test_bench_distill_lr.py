"""benchmarks/bench_distill_lr.py on stories260K: each rate trains as
``specdec distill`` does (the same head, weight for weight, as the command
at that rate, batch size and step count on the same answers), the held-out
figure is the command's, a smaller batch size reads as many answers in more
steps, and the table and JSON name every rate and size."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_distill_lr.py"
COMMON = ["--draft-vocab", "200", "--seed", "3", "--threads", "1"]


def test_bench_distill_lr_trains_as_the_command_does_at_each_rate_and_batch_size(stories_path, tmp_path):
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "specdec.cli", "distill", "--kind", "eagle3", "--target",
                           stories_path, "--out", str(run), "--steps", "6", "--samples", "8", "--max-new-tokens",
                           "16", "--lr", "2e-3", "--train-dtype", "float32", "--batch-size", "4", *COMMON],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    card = json.loads(done.stdout.strip().splitlines()[-1])
    out, heads = tmp_path / "lr.json", tmp_path / "heads"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--data", str(run), "--model", stories_path,
                           "--steps", "6", "--lrs", "2e-3,1e-3", "--batch-sizes", "4,2", "--held-out-tokens", "16",
                           "--more-held-out", "5",
                           "--save", str(heads),
                           "--out", str(out), *COMMON],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["batch_size"], r["lr"]) for r in result["rows"]] == [(4, 2e-3), (4, 1e-3), (2, 2e-3), (2, 1e-3)]
    assert result["answers"] == 8 and result["batch_sizes"] == [4, 2]
    # batch 2 reads as many answers as batch 4: twice the steps
    assert [r["steps"] for r in result["rows"]] == [6, 6, 12, 12] and all(r["s_per_step"] > 0 for r in result["rows"])
    # the command's head at 2e-3, weight for weight, and its held-out figure; 1e-3 trains another head
    ref = load_file(run / "model.safetensors")
    same, other, halves = (load_file(heads / name / "model.safetensors")
                           for name in ("batch-4-lr-0.002", "batch-4-lr-0.001", "batch-2-lr-0.002"))
    assert same.keys() == ref.keys() and all(torch.equal(same[k], ref[k]) for k in ref)
    assert not torch.equal(other["fc.weight"], ref["fc.weight"]) and not torch.equal(halves["fc.weight"],
                                                                                      ref["fc.weight"])
    assert result["rows"][0]["held_out_accepted_k5"] == round(card["mean_accepted_length_k5"], 4)
    # --more-held-out: the 5 held-out prompts after the command's 8, measured apart with the same head
    from specdec.distill import ACCEPTANCE_K, HELD_OUT_TOPICS, prompts
    from specdec.distill_eagle3 import eagle3_accepted_length
    from specdec.engine.checkpoint import load_hf_model
    from specdec.models import load_tokenizer, resolve_model

    more = prompts(load_tokenizer(resolve_model(stories_path)), HELD_OUT_TOPICS)[8:13]
    assert result["more_held_out_prompts"] == 5 and len(more) == 5
    again = eagle3_accepted_length(load_hf_model(stories_path), heads / "batch-4-lr-0.002", stories_path, more,
                                   ACCEPTANCE_K, 16)
    assert result["rows"][0]["more_held_out_accepted_k5"] == round(again, 4)
    assert all(r["more_held_out_accepted_k5"] >= 1 for r in result["rows"])
    assert "CPU:" in proc.stdout and "held-out k=5" in proc.stdout and "step 6/6" in proc.stdout
    for bad, flag in ((["--lrs", "1e-3,0"], "--lrs"), (["--lrs", "1e-3,fast"], "--lrs"), (["--steps", "0"], "--steps"),
                      (["--batch-sizes", "4,0"], "--batch-sizes"), (["--batch-sizes", "four"], "--batch-sizes"),
                      (["--more-held-out", "-1"], "--more-held-out"), (["--more-held-out", "13"], "--more-held-out"),
                      (["--data", str(tmp_path / "none")], "--data")):
        fail = subprocess.run([sys.executable, str(SCRIPT), "--model", stories_path, *(["--data", str(run)]
                               if "--data" not in bad else []), *bad], capture_output=True, text=True, timeout=300)
        assert fail.returncode != 0 and flag in fail.stderr
