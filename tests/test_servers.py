"""Every server speaks grpc.health.v1 and server reflection and serves
Prometheus metrics (checked on a real proposer process)."""
import json
import os
import subprocess
import sys
import urllib.request

import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec.launcher import free_port, wait_serving
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc


def test_health_reflection_and_metrics_on_a_real_server():
    port, metrics = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "proposer", "--methods", "ngram,suffix",
                             "--port", str(port), "--metrics-port", str(metrics), "--log-level", "INFO"],
                            stderr=subprocess.PIPE, text=True)
    try:
        addr = f"127.0.0.1:{port}"
        wait_serving(addr, proc, 120, "proposer")
        # copying methods only: torch never loads (proposer_svc/model_settings.py; it took ~2 s of the start)
        assert "libtorch" not in open(f"/proc/{proc.pid}/maps").read()
        with grpc.insecure_channel(addr) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            (answer,) = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                list_services="")])))
            services = {s.name for s in answer.list_services_response.service}
            assert {"specdec.v1.Proposer", "grpc.health.v1.Health"} <= services
            call = pb_grpc.ProposerStub(ch).Propose(iter([pb.ProposeRequest(batch_id=7, sequences=[
                pb.SequenceUpdate(seq_id="a", open=True, token_ids=[1, 2, 3, 1, 2], context_len=5,
                                  num_speculative_tokens=2, options=pb.ProposerOptions(method="ngram"))])]))
            (response,) = list(call)
            assert response.batch_id == 7 and list(response.drafts[0].token_ids) == [3, 1]
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
        assert "specdec_proposer_batches_total 1.0" in text
        assert 'specdec_proposer_draft_tokens_total{method="ngram"} 2.0' in text
        # bounded proposer memory is reported (suffix trees included)
        assert 'specdec_proposer_state{key="live_sequences",method="ngram"} 1.0' in text
        assert 'specdec_proposer_state{key="memory_bytes",method="suffix"}' in text
        proc.terminate()
        _, log = proc.communicate(timeout=30)
        # stopped, it ends without the interpreter's teardown (cli._exit_without_teardown): successfully, its
        # log written out to the last line
        assert proc.returncode == 0 and log.rstrip().endswith("stopping"), log[-500:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _openmp_env_of(command: str, preset: dict[str, str]) -> dict:
    """What ``specdec <command> --help`` leaves in OMP_WAIT_POLICY, run as a
    process's entry point with `preset` in its environment, and whether torch
    was loaded before (OpenMP reads the variable when torch loads it)."""
    script = ("import json, os, sys\n"
              "from specdec.cli import main\n"
              "sys.argv = ['specdec', sys.argv[1], '--help']\n"
              "torch_before = 'torch' in sys.modules\n"
              "try:\n    main()\nexcept SystemExit:\n    pass\n"
              "print(json.dumps({'policy': os.environ.get('OMP_WAIT_POLICY'), 'torch_before': torch_before}))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | preset
    out = subprocess.run([sys.executable, "-c", script, command], env=env, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_proposer_process_lets_its_openmp_threads_sleep_unless_told_otherwise():
    """PROPOSER_OPENMP_ENV: set before torch loads, for proposers only; a
    value in the environment wins."""
    from specdec.cli import PROPOSER_OPENMP_ENV

    assert PROPOSER_OPENMP_ENV == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert _openmp_env_of("proposer", {}) == {"policy": "PASSIVE", "torch_before": False}
    assert _openmp_env_of("proposer", {"OMP_WAIT_POLICY": "ACTIVE"})["policy"] == "ACTIVE"
    assert _openmp_env_of("scorer", {})["policy"] is None


def test_a_stack_on_one_machine_runs_its_draft_proposer_on_one_thread_unless_told_otherwise():
    """COLOCATED_DRAFT_THREADS reaches the draft proposer's own parser;
    Stack.draft_threads and serve's flag change it; None leaves the engine's
    default (the proposer's own default, for a pod of its own)."""
    from specdec.cli import build_parser
    from specdec.launcher import Stack
    from specdec.limits import COLOCATED_DRAFT_THREADS

    parser = build_parser()

    def threads(**kwargs) -> int | None:
        stack = Stack(model="M", methods="ngram,draft", draft_model="D", **kwargs)
        return parser.parse_args(stack._draft_proposer_args(["draft"])).draft_threads

    assert COLOCATED_DRAFT_THREADS == 1
    assert threads() == 1
    assert threads(draft_threads=2) == 2
    assert threads(draft_threads=None) is None
    assert threads(extra_draft_args=["--draft-threads", "2"]) == 2  # a caller's own flag comes last and wins
    assert parser.parse_args(["proposer", "--methods", "draft", "--draft-model", "D"]).draft_threads is None
    assert parser.parse_args(["serve"]).draft_threads == 1
    assert parser.parse_args(["serve", "--draft-threads", "2"]).draft_threads == 2
