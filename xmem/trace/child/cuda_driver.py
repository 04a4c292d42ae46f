"""The CUDA driver's door: a library that loads libcuda itself (ctypes) is told, in its own call, that the fake GPU
does not model the driver.

torch reaches the GPU through the fake world; a library with its own ctypes binding of the driver (a kernel
launcher, a profiler, a device probe) would bypass it, and on a login node with a driver installed it would talk to a
real, absent GPU. Its load of libcuda raises DriverNotModelled, an OSError as a failed load is, so that a library
which only probes for a driver (and carries on without one) still does; one that lets it propagate ends the trace as
not modelled, naming the library. Other CUDA libraries (the runtime, cuBLAS, a library's own kernels) load as usual:
they reach the driver only through calls that fail with their own errors.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import Any

from xmem.trace.errors import NotModelled

DRIVER_LIBRARY = "libcuda.so"  # the driver's soname prefix (libcuda.so.1, libcuda.so)
_XMEM_DIR = str(Path(__file__).resolve().parents[2])


class DriverNotModelled(NotModelled, OSError):
    """A load of the CUDA driver by a library: not modelled (an OSError too, as a failed dlopen is)."""


def install() -> None:
    original_init = ctypes.CDLL.__init__

    def init_unless_driver(self: ctypes.CDLL, name: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(name, (str, os.PathLike)) and os.path.basename(os.fspath(name)).startswith(DRIVER_LIBRARY):
            raise DriverNotModelled(f"{caller()} calls the CUDA driver directly (loads {os.path.basename(name)})")
        original_init(self, name, *args, **kwargs)

    ctypes.CDLL.__init__ = init_unless_driver  # type: ignore[method-assign]


def caller() -> str:
    """The package (or the program's own file) whose code is loading: the first frame outside ctypes and xmem."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("ctypes") and not frame.f_code.co_filename.startswith(_XMEM_DIR):
            if module == "__main__":
                return Path(frame.f_code.co_filename).name
            return module.split(".")[0]
        frame = frame.f_back
    return "a library"
