"""Benchmarks that measure another copy of ``specdec.proposer_svc`` (e.g.
main's, ``git archive main proposer_svc | tar -x -C /tmp/main-src``) in the
same run start a child with ``python -c LOAD_PROPOSER_SVC + <their own
tail> DIR ...``: the prologue pops DIR from argv and installs the package
found there as ``specdec.proposer_svc`` before anything imports it."""

LOAD_PROPOSER_SVC = """
import importlib.util, sys
src = sys.argv.pop(1)
spec = importlib.util.spec_from_file_location("specdec.proposer_svc", src + "/__init__.py",
                                              submodule_search_locations=[src])
mod = importlib.util.module_from_spec(spec)
sys.modules["specdec.proposer_svc"] = mod
spec.loader.exec_module(mod)
"""
