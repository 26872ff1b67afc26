"""Benchmarks that measure another copy of a ``specdec`` subpackage (e.g.
main's ``specdec.proposer_svc``: ``git archive main proposer_svc | tar -x -C
/tmp/main-src``) in the same run start a child with ``python -c
load_package(NAME) + <their own tail> DIR ...``: the prologue pops DIR from
argv and installs the package found there as ``specdec.NAME`` before
anything imports it (its modules then import each other from DIR, and the
rest of specdec from the installed copy)."""

#: a tail that runs the ``specdec`` command line with the arguments left
RUN_CLI = """
from specdec.cli import main
sys.argv[0] = "specdec"
main()
"""


def load_package(name: str) -> str:
    """The prologue installing DIR (argv[1], popped) as ``specdec.<name>``."""
    return f"""
import importlib.util, sys
src = sys.argv.pop(1)
spec = importlib.util.spec_from_file_location("specdec.{name}", src + "/__init__.py",
                                              submodule_search_locations=[src])
mod = importlib.util.module_from_spec(spec)
sys.modules["specdec.{name}"] = mod
spec.loader.exec_module(mod)
"""


LOAD_PROPOSER_SVC = load_package("proposer_svc")
