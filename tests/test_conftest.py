"""The suite's own guard rails: without the shared models an integration test
is skipped on a workstation but fails under ``CI=true``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

#: an integration test that needs stories260K (via the stories_path fixture)
NEEDS_MODELS = "tests/test_e2e_stories.py::test_token_id_prompt_equals_text_prompt"


def _run_without_models(tmp_path, ci: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["SPECDEC_MODELS_DIR"] = str(tmp_path / "no-models-here")
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", NEEDS_MODELS],
                          cwd=Path(__file__).resolve().parent.parent, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("ci", ["true", "TRUE"])
def test_missing_models_fail_the_run_under_ci(tmp_path, ci):
    run = _run_without_models(tmp_path, ci)
    assert run.returncode != 0, run.stdout
    assert "1 error" in run.stdout and "CI=true requires it" in run.stdout, run.stdout


@pytest.mark.parametrize("ci", [None, "false"])
def test_missing_models_skip_outside_ci(tmp_path, ci):
    run = _run_without_models(tmp_path, ci)
    assert run.returncode == 0, run.stdout
    assert "1 skipped" in run.stdout, run.stdout
