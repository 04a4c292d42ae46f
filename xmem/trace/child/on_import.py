"""Patch a library right after it is first imported: the hook fakecuda and distributed both install through.

A module of its own so that neither patcher imports the other (no torch import here).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Callable


def patch_on_import(module_name: str, patch: Callable[[Any], None]) -> None:
    """Run `patch(module)` right after `module_name` is first imported (a library the program may import later)."""
    if module_name in sys.modules:  # imported already (the warm tracer preloads the training libraries)
        patch(sys.modules[module_name])
        return

    class PatchAfterLoading(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname != module_name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is not None and spec.loader is not None:
                load = spec.loader.exec_module
                spec.loader.exec_module = lambda module: (load(module), patch(module))  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, PatchAfterLoading())


def rebind_loaded(original: Any, replacement: Any) -> None:
    """Bind `replacement` wherever a module already loaded holds `original` by a name of its own (`from
    torch.nn.parallel import DistributedDataParallel as DDP`). The warm tracer preloads Lightning, whose strategies
    bind torch's DDP at import: patching torch's attribute alone left them the real class, which read the fake
    process group's unwritten buffers (ranks 'disagreed' on the model, or a size overflowed, as the memory had it)."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict):
            for name in [name for name, value in namespace.items() if value is original]:
                namespace[name] = replacement
