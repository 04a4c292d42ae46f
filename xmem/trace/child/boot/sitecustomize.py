"""Start-up of every Python process of a traced job: this directory is first on the job's PYTHONPATH.

Makes the `xmem` package importable from where it lies without putting the installation's other packages on the
job's path (the job's own interpreter and libraries are what is traced, whatever their versions), runs the
sitecustomize this file shadows (the interpreter's or the environment's own), then hands a process the traced
program started to the tracer (`xmem.trace.child.main`), with the settings `xmem.trace.child.follow` hands down. First of all,
where the sandbox redirects Python's writes (its fallback, `xmem.trace.sandbox.install_in_child`), this process's
are redirected the same way. Standard library only: it runs in the user's interpreter.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))  # the xmem package directory


def _register_xmem() -> None:
    if "xmem" not in sys.modules:
        spec = importlib.util.spec_from_file_location("xmem", os.path.join(_PACKAGE, "__init__.py"),
                                                      submodule_search_locations=[_PACKAGE])
        sys.modules["xmem"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["xmem"])


def _run_shadowed() -> None:
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_register_xmem()
from xmem.trace import bytecode  # noqa: E402

bytecode.use_in_this_process()  # before the imports below: the tracer's own modules' bytecode is kept too
from xmem.trace import sandbox  # noqa: E402
from xmem.trace.child import follow  # noqa: E402 - xmem is importable from here on

sandbox.install_in_child()  # the fallback sandbox's redirected writes, as in the process that started this one
_run_shadowed()
_traced = follow.child_argv()
if _traced is not None:  # a program of the job: traced here, and the process ends there
    from xmem.trace.child.main import main as _trace

    _trace(_traced)
