"""The peer rows of bench_draft.py: vllm_draft.py runs plain, draft-model and
EAGLE-3 speculation each on its own and records what vLLM said when it
refused one (a stand-in ``vllm`` module: this tests the runner, not vLLM),
and bench_draft's report sets each peer row beside specdec's row of the
same method."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

FAKE_VLLM = textwrap.dedent('''
    """A stand-in for vLLM's LLM API: generates max_tokens copies of the
    prompt's last token; counts drafts; refuses EAGLE-3 as a CPU build might."""
    from types import SimpleNamespace

    class SamplingParams:
        def __init__(self, temperature, max_tokens):
            self.max_tokens = max_tokens

    class LLM:
        def __init__(self, model, speculative_config=None, **kwargs):
            if speculative_config and speculative_config["method"] == "eagle3":
                try:
                    raise KeyError("LlamaForCausalLMEagle3")
                except KeyError as error:
                    raise ValueError("EAGLE-3 is not supported on this platform\\nsee the docs") from error
            self.spec, self.rounds = speculative_config, 0

        def generate(self, prompts, params, use_tqdm=True):
            ids = prompts[0]["prompt_token_ids"]
            self.rounds += 1
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[ids[-1]] * params.max_tokens)])]

        def get_metrics(self):
            if not self.spec:
                return []
            return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=4.0 * self.rounds),
                    SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=3.0 * self.rounds)]

    def TokensPrompt(prompt_token_ids):
        return {"prompt_token_ids": prompt_token_ids}
''')


def test_vllm_runner_runs_each_method_and_records_a_refusal(tmp_path):
    pkg = tmp_path / "vllm"
    (pkg / "inputs").mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs" / "__init__.py").write_text("from vllm import TokensPrompt\n")
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"target": "T", "draft": "D", "eagle3": "H", "prompts": [[1, 2, 3], [4, 5]], "k": 5,
                               "max_tokens": 7}))
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "vllm_draft.py"), str(job)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"vllm_plain", "vllm_draft_model", "vllm_eagle3"}
    for name in ("vllm_plain", "vllm_draft_model"):
        assert result[name]["tokens"] == 14 and result[name]["tok_s"] > 0  # two prompts, 7 tokens each
    assert "mean_accepted_length" not in result["vllm_plain"]
    # 2 timed prompts after the warm-up: 8 drafts, 6 accepted tokens -> 1 + 6 / 8
    assert result["vllm_draft_model"]["mean_accepted_length"] == 1.75
    assert result["vllm_eagle3"] == {
        "error": "ValueError: see the docs (from KeyError: 'LlamaForCausalLMEagle3')"}
    # no eagle3 head given: no eagle3 row
    job.write_text(json.dumps({"target": "T", "draft": "D", "eagle3": None, "prompts": [[1]], "k": 5,
                               "max_tokens": 2}))
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "vllm_draft.py"), str(job)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin"})
    assert set(json.loads(proc.stdout.strip().splitlines()[-1])) == {"vllm_plain", "vllm_draft_model"}


def test_report_sets_peers_beside_specdec_rows_of_the_same_method(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_draft

    def row(tok_s):
        return {"tok_s": tok_s, "mean_accepted_length": 1.5, "ms_per_draft_step": None, "ms_per_propose": 0.0,
                "ms_per_verify": 5.0, "feature_bytes_per_round": 0, "prompt_tokens": 10, "tokens": 96,
                "identical_to_plain": True, "runs_tok_s": [tok_s]}

    results = {"single": {"chat/none": row(180.0), "chat/draft": row(90.0), "chat/eagle3": row(120.0)},
               "mixed": {}, "concurrent": {}, "streams": 0,
               "hf": {"hf_plain": {"tok_s": 30.0}, "hf_assisted": {"tok_s": 30.0}},
               "vllm": {"vllm_plain": {"tok_s": 24.0},
                        "vllm_draft_model": {"tok_s": 18.0, "mean_accepted_length": 1.68},
                        "vllm_eagle3": {"error": "ValueError: no"}}}
    bench_draft.report(results)
    out = capsys.readouterr().out
    assert "chat/hf_plain" in out and "specdec chat/none 6.00x" in out
    assert "specdec chat/draft 3.00x" in out  # against hf_assisted
    assert "mean acc len 1.68  specdec chat/draft 5.00x" in out
    assert "chat/vllm_eagle3" in out and "refused: ValueError: no" in out
