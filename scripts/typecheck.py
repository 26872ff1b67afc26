"""Runs mypy on the package as it is installed: the top-level folders are
mapped into the ``specdec`` namespace by pyproject.toml (``package-dir``),
which static tools cannot follow in the checkout. This builds that layout
from symlinks under ``.typecheck/`` (read from pyproject.toml, so it never
drifts) and checks ``-p specdec`` there.

    python scripts/typecheck.py [extra mypy args]
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / ".typecheck"


def build_tree() -> Path:
    """.typecheck/specdec/... with one symlink per mapped package folder."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(TREE, ignore_errors=True)
    # parents before children, so a child's link lands inside its parent's real folder copy
    for package, folder in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):
        target = TREE.joinpath(*package.split("."))
        if target.is_symlink() or target.exists():
            continue  # a sub-package inside an already linked folder (protos/v1)
        target.parent.mkdir(parents=True, exist_ok=True)
        if package == "specdec":  # the root: a real folder holding the root modules and the links
            target.mkdir()
            for entry in (ROOT / folder).iterdir():
                os.symlink(entry, target / entry.name)
        else:
            os.symlink(ROOT / folder, target)
    return TREE


def main() -> int:
    tree = build_tree()
    env = {**os.environ, "MYPYPATH": str(tree)}
    # the cache beside the tree, not in it (build_tree empties the tree): later runs are incremental
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "--cache-dir", str(ROOT / ".mypy_cache"), "-p", "specdec",
           *sys.argv[1:]]
    return subprocess.call(cmd, cwd=tree, env=env)


if __name__ == "__main__":
    sys.exit(main())
