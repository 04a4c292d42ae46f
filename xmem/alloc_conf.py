"""Where a CUDA job's caching-allocator setting comes from: the environment variable PyTorch reads, and which one
wins. Both sides use it: the traced program's recorder notes the setting at the job's first allocation
(`xmem.trace.child.recorder`), and the simulator parses it (`xmem.simulate.allocator_settings`). It lives below
both, since neither may import the other (docs/architecture.md).

Must not: import anything of xmem, or torch.
"""

from __future__ import annotations

from collections.abc import Mapping

# CUDAAllocatorConfig::instance() reads PYTORCH_CUDA_ALLOC_CONF first; checked on torch 2.13 and 2.14.
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def alloc_conf_setting(env: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable, text) of the allocator setting: PYTORCH_CUDA_ALLOC_CONF if set (even empty), else
    PYTORCH_ALLOC_CONF; None if neither is set."""
    for name in ALLOC_CONF_VARIABLES:
        if name in env:
            return name, env[name]
    return None
