"""benchmarks/bench_distill_lr.py on stories260K: each rate trains as
``specdec distill`` does (the same head, weight for weight, as the command
at that rate and step count on the same answers), the held-out figure is
the command's, and the table and JSON name every rate."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_distill_lr.py"
COMMON = ["--draft-vocab", "200", "--batch-size", "4", "--seed", "3", "--threads", "1"]


def test_bench_distill_lr_trains_as_the_command_does_at_each_rate(stories_path, tmp_path):
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "specdec.cli", "distill", "--kind", "eagle3", "--target",
                           stories_path, "--out", str(run), "--steps", "6", "--samples", "8", "--max-new-tokens",
                           "16", "--lr", "2e-3", "--train-dtype", "float32", *COMMON],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    card = json.loads(done.stdout.strip().splitlines()[-1])
    out, heads = tmp_path / "lr.json", tmp_path / "heads"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--data", str(run), "--model", stories_path,
                           "--steps", "6", "--lrs", "2e-3,1e-3", "--held-out-tokens", "16", "--save", str(heads),
                           "--out", str(out), *COMMON],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["lr"] for r in result["rows"]] == [2e-3, 1e-3] and result["answers"] == 8
    assert all(r["steps"] == 6 and r["s_per_step"] > 0 for r in result["rows"])
    # the command's head at 2e-3, weight for weight, and its held-out figure; 1e-3 trains another head
    ref = load_file(run / "model.safetensors")
    same, other = (load_file(heads / f"lr-{lr}" / "model.safetensors") for lr in ("0.002", "0.001"))
    assert same.keys() == ref.keys() and all(torch.equal(same[k], ref[k]) for k in ref)
    assert not torch.equal(other["fc.weight"], ref["fc.weight"])
    assert result["rows"][0]["held_out_accepted_k5"] == round(card["mean_accepted_length_k5"], 4)
    assert "CPU:" in proc.stdout and "held-out k=5" in proc.stdout and "step 6/6" in proc.stdout
    for bad, flag in ((["--lrs", "1e-3,0"], "--lrs"), (["--lrs", "1e-3,fast"], "--lrs"), (["--steps", "0"], "--steps"),
                      (["--data", str(tmp_path / "none")], "--data")):
        fail = subprocess.run([sys.executable, str(SCRIPT), "--model", stories_path, *(["--data", str(run)]
                               if "--data" not in bad else []), *bad], capture_output=True, text=True, timeout=300)
        assert fail.returncode != 0 and flag in fail.stderr
