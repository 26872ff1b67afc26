"""The committed generated protobuf code is what protos/generate.py makes."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "generator wrote nothing"
    for rel in generated:
        committed = ROOT / "protos" / rel
        assert committed.exists(), f"{rel} is not committed; run python protos/generate.py"
        assert committed.read_text() == (tmp_path / rel).read_text(), \
            f"protos/{rel} is stale; run python protos/generate.py"


def test_every_rpc_field_and_enum_value_is_commented():
    """The contract documents every rpc, field and enum value (a comment line
    right above it)."""
    lines = (ROOT / "protos" / "v1" / "specdec.proto").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        s = line.strip()
        is_field = s.endswith(";") and "=" in s and not s.startswith(("//", "syntax", "package", "option"))
        if (is_field or s.startswith("rpc ")) and not lines[i - 1].strip().startswith("//"):
            undocumented.append(f"line {i + 1}: {s}")
    assert not undocumented, undocumented
