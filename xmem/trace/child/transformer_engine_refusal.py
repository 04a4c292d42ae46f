"""NVIDIA Transformer Engine under fake CUDA: not modelled, said at the program's import of it.

Transformer Engine's layers (te.Linear, te.LayerNormMLP, te.TransformerLayer) and its fp8 autocast run NVIDIA's own
kernels through its C++ extension (transformer_engine_torch over libtransformer_engine), which takes the tensors'
device pointers and allocates its workspaces, fp8 casts and amax histories itself: none of it is an op the fake GPU
sees or sizes. Rather than trace a program whose TE layers cannot run, the import of `transformer_engine` by the
program ends the trace as not modelled, naming it. Only the import itself: a probe of whether it is installed
(importlib.util.find_spec, as accelerate's and transformers' availability checks do) finds it as usual. The error is
no ImportError, so that a program with a fallback for a missing TE is not traced on a path it would not take.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

from xmem.trace.errors import NotModelled

PACKAGE = "transformer_engine"
GAP = ("NVIDIA Transformer Engine (transformer_engine): its layers and fp8 autocast run NVIDIA's kernels through its "
       "own C++ extension, which the fake GPU can neither run nor size")


class _RefuseOnLoad(importlib.abc.MetaPathFinder):
    """Finds `transformer_engine` where the other finders do, with a loader that refuses instead of running it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != PACKAGE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None:
            spec.loader = _Refusal()
        return spec


class _Refusal(importlib.abc.Loader):
    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        raise NotModelled(GAP)


def install() -> None:
    """From now on, the program's first import of Transformer Engine ends the trace as not modelled (module
    docstring). One already imported (a library loaded before the program started) is left as it is."""
    if PACKAGE not in sys.modules:
        sys.meta_path.insert(0, _RefuseOnLoad())


__all__ = ["GAP", "install"]
