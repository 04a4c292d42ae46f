"""The simulate stage: replay a GPU-side alloc/free sequence through a model of PyTorch's CUDA caching allocator.

    from xmem.simulate import ALLOC, FREE, EMPTY_CACHE, AllocatorConfig, simulate
    result = simulate(ops, AllocatorConfig.from_environ(job_env), capacity=device_bytes)

`allocator_settings.py` parses the allocator settings, `allocator.py` holds the rules (named as in
c10/cuda/CUDACachingAllocator.cpp), `replay.py` drives a sequence through them and `result.py` holds what comes
out. Everything here is pure: no I/O, no torch.
"""

from xmem.simulate.allocator_settings import AllocatorConfig
from xmem.simulate.replay import (ALLOC, BEGIN_POOL, EMPTY_CACHE, END_POOL, FREE, MANAGED, RELEASE_POOL, simulate,
                                  simulate_limits)
from xmem.simulate.result import OomInfo, SimResult

__all__ = ["ALLOC", "BEGIN_POOL", "EMPTY_CACHE", "END_POOL", "FREE", "MANAGED", "RELEASE_POOL", "AllocatorConfig",
           "OomInfo", "SimResult", "simulate", "simulate_limits"]
