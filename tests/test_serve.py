"""`specdec serve`: starts every service as its own process, reports the
gateway, answers a generation, and leaves no process behind on SIGTERM."""
import signal
import subprocess
import sys
import time

import psutil

from specdec.client import make_request, stream
from specdec.launcher import free_port


def test_serve_starts_all_and_stops_cleanly(stories_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--model", stories_path, "--port", str(port),
         "--methods", "naive,ngram"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "serve exited early:\n" + "".join(lines)
            lines.append(line)
            if "gateway ready at" in line:
                break
        assert f"127.0.0.1:{port}" in lines[-1]
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert len(children) >= 3 and all(s in names for s in ("scorer", "proposer", "gateway"))
        gen = stream(f"127.0.0.1:{port}", make_request("Once upon a time", max_tokens=8, method="ngram"))
        assert len(gen.token_ids) == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        time.sleep(0.5)
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            proc.kill()
