"""`specdec serve`: starts every service as its own process, reports the
gateway's gRPC and HTTP addresses, answers a generation on each, and leaves
no process behind on SIGTERM or SIGINT (Ctrl-C)."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from specdec.client import make_request, stream
from specdec.engine.config import EngineConfig
from specdec.engine.factory import build_engine
from specdec.launcher import free_port


@pytest.mark.parametrize("signum", [pytest.param(signal.SIGTERM, marks=pytest.mark.slow), signal.SIGINT],
                         ids=["SIGTERM", "SIGINT"])  # both take the same path in serve; SIGTERM in the slow suite
def test_serve_starts_all_and_stops_cleanly(stories_path, signum):
    port, http_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--model", stories_path, "--port", str(port),
         "--http-port", str(http_port), "--methods", "naive,ngram", "--decode-steps", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # Ctrl-C's default even when pytest runs as a background job (which ignores SIGINT)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "serve exited early:\n" + "".join(lines)
            lines.append(line)
            if "HTTP API ready at" in line:
                break
        assert f"127.0.0.1:{port}" in lines[-3] and "gateway ready at" in lines[-3]
        assert f"http://127.0.0.1:{http_port}/v1" in lines[-1]
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert len(children) >= 3 and all(s in names for s in ("scorer", "proposer", "gateway"))
        gateway = next(c.cmdline() for c in children if "gateway" in c.cmdline())
        assert gateway[gateway.index("--decode-steps") + 1] == "2"  # serve passes it on
        scorer = next(c.cmdline() for c in children if "scorer" in c.cmdline())
        assert scorer[scorer.index("--device") + 1] == "cpu"
        gen = stream(f"127.0.0.1:{port}", make_request("Once upon a time", max_tokens=8, method="ngram"))
        assert len(gen.token_ids) == 8
        body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        answer = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["text"] == gen.text
        proc.send_signal(signum)
        assert proc.wait(60) == 0
        _, alive = psutil.wait_procs(children, timeout=60)  # the children were stopped, not orphaned
        assert not [c for c in alive if c.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("flag,value,message",
                         [("--decode-steps", "0", "serve: --decode-steps must be in 1..16, got 0"),
                          ("--decode-chunk-ms", "nan", "serve: --decode-chunk-ms must be >= 0")])
def test_serve_refuses_decode_steps_out_of_range(flag, value, message):
    done = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", flag, value],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr


def test_serve_refuses_draft_threads_below_one_before_starting_anything():
    done = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", "--draft-threads", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "serve: --draft-threads must be >= 1, got 0" in done.stderr
    assert "listening" not in done.stdout + done.stderr  # no service was started


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_serve_and_the_engine_refuse_cuda_without_a_cuda_device(stories_path):
    done = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", "--device", "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "serve: --device: device 'cuda': torch" in done.stderr
    assert "sees no CUDA device" in done.stderr
    with pytest.raises(ValueError, match="device 'cuda'.*sees no CUDA device"):
        build_engine(EngineConfig(stories_path, device="cuda"))


def test_serve_on_a_gpu_names_the_eagle3_heads_layers_to_the_scorer(stories_path, tmp_path):
    """`specdec serve --device cuda --eagle3 DIR` starts the scorer with the
    head's layers as --feature-layers (its start-up captures those graphs):
    the config's, else EAGLE-3's default for the target; sorted, each once;
    none where the head cannot be read (the proposer reports that)."""
    from feature_heads import write_eagle3_head

    from specdec.launcher import head_feature_layers

    named = write_eagle3_head(tmp_path / "named", Path(stories_path), [4, 1, 3])
    assert head_feature_layers(str(named), stories_path) == (1, 3, 4)
    default = write_eagle3_head(tmp_path / "default", Path(stories_path), None)
    assert head_feature_layers(str(default), stories_path) == (2,)  # (2, 5 // 2, 5 - 3) for 5 layers
    assert head_feature_layers(str(tmp_path / "missing"), stories_path) == ()
    assert head_feature_layers(str(named), str(tmp_path / "no-model")) == ()
