"""specdec: speculative decoding for LLMs, served as gRPC microservices."""

import os
import sys

__version__ = "0.1.0"


def _leave_the_checkout_off_sys_path() -> None:
    """The checkout's top-level folders (``kernels/``, ``engine/``, ...) are
    installed as ``specdec.kernels``, ``specdec.engine``, ...; under their own
    names they would hide PyPI packages of the same name. transformers >= 5.25
    requires and imports the PyPI ``kernels`` package, so with the checkout's
    root on ``sys.path`` (``python -m ...`` or ``pytest`` run from it) importing
    any model failed: "cannot import name 'CUDAProperties' from 'kernels'".

    Only a checkout is touched (this file in ``specdec_cli/``, the editable
    install): there the import hook finds ``specdec.*`` without the root on
    ``sys.path``. An installed copy (``site-packages/specdec/``) is left alone.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.basename(here) != "specdec_cli":
        return
    root = os.path.dirname(here)
    if not os.path.isfile(os.path.join(root, "kernels", "__init__.py")):
        return
    keep = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    if len(keep) != len(sys.path):
        sys.path[:] = keep
    kernels = sys.modules.get("kernels")  # imported from the root before this ran
    if kernels is not None and os.path.abspath(getattr(kernels, "__file__", None) or "").startswith(root + os.sep):
        del sys.modules["kernels"]


_leave_the_checkout_off_sys_path()
