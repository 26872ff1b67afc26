"""The package's shape: every module imports, imports run one way between
the parts, and the pure layers never touch gRPC or generated protobuf code
(docs/architecture.md)."""
from __future__ import annotations

import ast
import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import specdec

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]

#: Layers that must not import grpc or generated *_pb2 code: algorithms and
#: kernels are called by servicers, which translate messages at the edge.
PURE = ["specdec.kernels", "specdec.engine", "specdec.limits", "specdec.drafts"]
#: Proposer algorithm modules (the servicer is the one place that converts).
PROPOSER_ALGORITHMS = ["base", "ngram", "suffix", "suffix_reference", "hybrid", "registry", "draft",
                       "draft_model", "draft_hybrid", "eagle3", "feature_draft"]


def all_modules() -> list[str]:
    names = []
    for package in sorted(PACKAGE_DIRS):
        names.append(package)
        path = ROOT / PACKAGE_DIRS[package]
        for info in pkgutil.iter_modules([str(path)]):
            if not info.ispkg:
                names.append(f"{package}.{info.name}")
    return sorted(set(names))


def source_of(module: str) -> Path:
    """The file of a module in the checkout, through the package-dir mapping."""
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        package = ".".join(parts[:cut])
        if package in PACKAGE_DIRS:
            base = ROOT / PACKAGE_DIRS[package] / Path(*parts[cut:])
            return base / "__init__.py" if (base / "__init__.py").exists() else base.with_suffix(".py")
    raise KeyError(module)


def imported_modules(module: str) -> set[str]:
    """Absolute names a module imports (at any depth of the file)."""
    tree = ast.parse(source_of(module).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_module_list_is_not_empty():
    modules = all_modules()
    assert "specdec.gateway.loop" in modules and "specdec.engine.llama" in modules
    assert len(modules) > 40


@pytest.mark.parametrize("module", all_modules())
def test_every_module_imports(module):
    importlib.import_module(module)


def _pure_modules() -> list[str]:
    pure = [m for m in all_modules() if any(m == p or m.startswith(p + ".") for p in PURE)]
    pure += [f"specdec.proposer_svc.{name}" for name in PROPOSER_ALGORITHMS]
    return [m for m in pure if source_of(m).exists()]


@pytest.mark.parametrize("module", _pure_modules())
def test_pure_layers_never_import_grpc_or_protobuf_code(module):
    bad = {name for name in imported_modules(module)
           if name == "grpc" or name.startswith("grpc.") or name.startswith("grpc_")
           or "_pb2" in name or name.startswith("specdec.protos")}
    assert not bad, f"{module} imports {sorted(bad)}"


def test_the_grpc_check_sees_a_violation(tmp_path, monkeypatch):
    """The rule above would fail on a module that imports generated code."""
    fake = tmp_path / "fake.py"
    fake.write_text("from specdec.protos.v1 import specdec_pb2 as pb\nimport grpc\n")
    monkeypatch.setitem(PACKAGE_DIRS, "specdec.fakepkg", str(tmp_path))
    assert {"specdec.protos.v1", "grpc"} <= imported_modules("specdec.fakepkg.fake")


# Which part may import which (one way). A part not listed may import none of
# the others. specdec's root modules (limits, drafts, models, validation,
# servers, client, cli, launcher) sit outside this table.
ALLOWED = {
    "specdec.kernels": set(),
    "specdec.engine": set(),
    "specdec.proposer_svc": {"specdec.engine", "specdec.kernels", "specdec.protos"},
    "specdec.scorer_svc": {"specdec.engine", "specdec.kernels", "specdec.protos"},
    "specdec.gateway": {"specdec.protos"},
}


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_parts_import_one_way(part):
    others = set(ALLOWED) | {"specdec.protos"}
    for module in all_modules():
        if not module.startswith(part + ".") and module != part:
            continue
        for name in imported_modules(module):
            target = next((o for o in others if name == o or name.startswith(o + ".")), None)
            if target is not None and target != part:
                assert target in ALLOWED[part], f"{module} imports {name}: {part} may not import {target}"


def test_package_root_is_the_cli_folder():
    assert Path(specdec.__file__).resolve().parent == (ROOT / PACKAGE_DIRS["specdec"]).resolve()


CHECKOUT_NAMES = sorted({PACKAGE_DIRS[p] for p in PACKAGE_DIRS if "/" not in PACKAGE_DIRS[p]} - {"specdec_cli"})


@pytest.mark.parametrize("launch", ["-c", "-m"])
def test_the_checkouts_folders_never_hide_pypi_packages_of_their_name(launch, tmp_path):
    """From the checkout's root, `python -c`/`python -m` put the root first on
    sys.path, where `kernels/` hid the PyPI `kernels` package that transformers
    >= 5.25 imports (every model load failed). Once specdec is imported, no
    top-level folder of the checkout answers to its bare name, and
    transformers' own modules import."""
    probe = ("import importlib.util, json, specdec; "
             f"names = {CHECKOUT_NAMES!r}; "
             "specs = {n: importlib.util.find_spec(n) for n in names}; "
             "import transformers.activations; "
             "print(json.dumps({n: s.origin if s else None for n, s in specs.items()}))")
    if launch == "-c":
        argv = [sys.executable, "-c", probe]
    else:
        (tmp_path / "probe_main.py").write_text(probe)
        argv = [sys.executable, "-m", "probe_main"]
        # -m puts the current folder first; the probe module comes from tmp_path on PYTHONPATH
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    origins = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(origins) == set(CHECKOUT_NAMES) and "kernels" in origins
    for name, origin in origins.items():
        assert origin is None or not Path(origin).resolve().is_relative_to(ROOT / name), (name, origin)
