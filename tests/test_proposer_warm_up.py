"""A fresh proposer compiles nothing in its first rounds: every numba
function its rounds call was compiled (or loaded from numba's cache) for the
very argument types and layouts the rounds pass, when the proposer was built.
A first round that compiles takes hundreds of milliseconds to seconds, longer
than the gateway waits for drafts (its proposer deadline, 0.5 s): against a
fast scorer a whole short request then went without drafts."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec.proposer_svc.registry import COPY_METHODS

#: runs in a fresh interpreter (numba's dispatchers are process-wide: another
#: test's calls must not have compiled what the warm-up should)
ROUNDS = r"""
import json, sys
from numba.core.registry import CPUDispatcher
from specdec.proposer_svc.registry import build_proposers
from specdec.proposer_svc.server import ProposerServicer
from specdec.protos.v1 import specdec_pb2 as pb

method = sys.argv[1]
servicer = ProposerServicer(build_proposers([method]))

def compiled():
    return {f"{name}.{attr}": len(f.signatures) for name, mod in list(sys.modules.items())
            if name.startswith("specdec.") for attr, f in vars(mod).items() if isinstance(f, CPUDispatcher)}

before = compiled()
opens = pb.ProposeRequest()
for j in range(3):
    u = opens.sequences.add(seq_id=f"s{j}", open=True, context_len=8, num_speculative_tokens=3,
                            token_ids=[5, 6, 7, 5, 6, 7, 5, 6])
    u.options.method = method
one = pb.ProposeRequest()
one.sequences.add(seq_id="s0", context_len=9, num_speculative_tokens=3, token_ids=[7])
columns = pb.ProposeRequest(releases=[pb.SequenceRelease(seq_id="s0", completed=True)])
cols = columns.round
cols.seq_ids.extend(["s1", "s2"]); cols.token_counts.extend([2, 1]); cols.token_ids.extend([7, 5, 7])
cols.context_lens.extend([10, 9]); cols.num_speculative_tokens.extend([4, 2])
drafted = [sum(len(d.token_ids) for d in servicer.handle(m).drafts) for m in (opens, one, columns)]
after = compiled()
print(json.dumps({"new": {k: [before.get(k, 0), v] for k, v in after.items() if before.get(k, 0) != v},
                  "drafted": drafted}))
"""


@pytest.mark.parametrize("method", [m for m in COPY_METHODS if m != "naive"])
def test_first_rounds_compile_nothing(method):
    out = subprocess.run([sys.executable, "-c", ROUNDS, method], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["drafted"][0] > 0  # the rounds really drafted (the matchers ran)
    assert result["new"] == {}, f"{method}: the first rounds compiled {result['new']}"
