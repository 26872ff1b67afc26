"""engine.memory.keep_freed_memory: a step that allocates and frees the
same blocks again takes no page faults the second time (glibc returns them
to the kernel by default, and every step faults them in again)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

STEP = """
import ctypes, json, resource, sys
if sys.argv[1] == "keep":
    from specdec.engine.memory import keep_freed_memory
    assert keep_freed_memory() and keep_freed_memory()  # applied, and once is enough
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.memset.argtypes, libc.free.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t], [ctypes.c_void_p]
faults = []
for _ in range(4):  # a training step's activations: blocks of a few MiB, all freed at its end
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    sizes = [mib << 20 for mib in (8, 12, 6, 10, 4, 9)]
    blocks = [libc.malloc(n) for n in sizes]
    for p, n in zip(blocks, sizes):
        libc.memset(p, 1, n)
    for p in blocks:
        libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps(faults))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_kept_memory_is_reused_without_page_faults():
    def faults(mode: str) -> list[int]:
        done = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    pages = (8 + 12 + 6 + 10 + 4 + 9) << 20 >> 12
    kept, default = faults("keep"), faults("default")
    assert all(f < pages // 20 for f in kept[1:]), kept  # after the first step: reused, not faulted in
    assert all(f > pages // 2 for f in default[1:]), default  # the defaults give the blocks back every step
