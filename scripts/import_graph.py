"""Prints which part of the package imports which (from the source, through
pyproject's package-dir mapping), and optionally the module-level graph
inside one part: ``python scripts/import_graph.py [--inside specdec.gateway]``."""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
#: specdec's root modules shown as parts of their own; edges between the other
#: root modules (the CLI's own wiring) are left out.
ROOT_PARTS = ("specdec.limits", "specdec.drafts")


def modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the installed package."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for package, folder in dirs.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out[name] = path
    return out


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update({node.module} | {f"{node.module}.{a.name}" for a in node.names})
    return found


def part_of(module: str, parts: list[str]) -> str | None:
    """The longest part name that is module or a package containing it;
    specdec's root modules count as the part ``specdec.<module>``."""
    for part in sorted(parts, key=len, reverse=True):
        if module == part or module.startswith(part + "."):
            return part
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inside", help="also print the module graph inside this part")
    args = ap.parse_args()
    mods = modules()
    packages = [m for m in mods if m != "specdec" and mods[m].name == "__init__.py"]
    parts = [p for p in packages if not any(p.startswith(q + ".") for q in packages)]
    parts += [m for m in mods if m.count(".") == 1 and m not in packages]  # specdec's root modules
    edges: dict[str, set[str]] = {}
    inner: dict[str, set[str]] = {}
    for module, path in mods.items():
        src = part_of(module, parts)
        for name in imports(path):
            dst = part_of(name, parts)
            if src and dst and dst != src and (src in packages or dst in packages or src in ROOT_PARTS
                                               or dst in ROOT_PARTS):
                edges.setdefault(src, set()).add(dst)
            if args.inside and src == args.inside and name in mods and part_of(name, parts) == args.inside:
                inner.setdefault(module, set()).add(name)
    for src in sorted(edges):
        print(f"{src} -> {', '.join(sorted(edges[src]))}")
    if args.inside:
        print(f"\ninside {args.inside}:")
        for src in sorted(inner):
            print(f"{src} -> {', '.join(sorted(inner[src]))}")


if __name__ == "__main__":
    main()
