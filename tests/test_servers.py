"""Every server speaks grpc.health.v1 and server reflection and serves
Prometheus metrics (checked on a real proposer process)."""
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
                             "--port", str(port), "--metrics-port", str(metrics)])
    try:
        addr = f"127.0.0.1:{port}"
        wait_serving(addr, proc, 120, "proposer")
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
    finally:
        proc.terminate()
        proc.wait(30)
