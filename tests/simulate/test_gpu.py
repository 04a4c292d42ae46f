"""Parity with the real CUDA caching allocator, op by op. Runs only where torch sees a CUDA GPU (skipped in CI).

A child process (a fresh allocator; settings from PYTORCH_CUDA_ALLOC_CONF, read as torch reads them) replays a
seeded random alloc/free/empty_cache sequence with `torch.empty(n, dtype=uint8)` on two streams and reports
`memory_allocated()` / `memory_reserved()` after every op, the retry and OOM counts, and the OOM message. The
simulator, given the same sequence and settings, must report the same bytes at every op.
"""

import json
import os
import random
import re
import subprocess
import sys

import pytest

from xmem.simulate import ALLOC, EMPTY_CACHE, FREE, AllocatorConfig, simulate
from xmem.simulate.allocator_settings import MiB

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_CHILD = r"""
import json, sys
import torch
request = json.loads(sys.stdin.read())
if request["fraction"] is not None:
    torch.cuda.set_per_process_memory_fraction(request["fraction"])
streams = {0: torch.cuda.current_stream(), 1: torch.cuda.Stream()}
live, points, oom = {}, [], None
for index, (action, block, nbytes, stream) in enumerate(request["ops"]):
    if action == 0:
        with torch.cuda.stream(streams[stream]):
            try:
                live[block] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            except torch.cuda.OutOfMemoryError as error:
                oom = {"index": index, "message": str(error)}
    elif action == 1:
        del live[block]
    else:
        torch.cuda.empty_cache()
    points.append([torch.cuda.memory_allocated(), torch.cuda.memory_reserved()])
    if oom is not None:
        break
stats = torch.cuda.memory_stats()
print(json.dumps({"points": points, "oom": oom, "num_alloc_retries": stats["num_alloc_retries"],
                  "num_ooms": stats["num_ooms"], "total": torch.cuda.get_device_properties(0).total_memory}))
"""


def random_ops(seed, count=600):
    """Sizes across the small pool, the 20 MiB segments and own segments; two streams; a few empty_cache."""
    rng = random.Random(seed)
    ops, live = [], []
    for block in range(count):
        roll = rng.random()
        if roll < 0.01:
            ops.append((EMPTY_CACHE, 0, 0, 0))
        elif live and roll < 0.47:
            ops.append((FREE, live.pop(rng.randrange(len(live))), 0, 0))
        else:
            size = rng.choice([rng.randrange(1, 1 * MiB), rng.randrange(1 * MiB, 10 * MiB),
                               rng.randrange(10 * MiB, 120 * MiB), rng.choice([512, 8_519_680, 12_000_000])])
            ops.append((ALLOC, block, size, rng.randrange(2)))
            live.append(block)
    return ops


def real_replay(ops, conf, fraction):
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
    env.pop("PYTORCH_ALLOC_CONF", None)
    request = json.dumps({"ops": ops, "fraction": fraction})
    done = subprocess.run([sys.executable, "-c", _CHILD], input=request, capture_output=True, text=True, env=env,
                          timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def message_parts(message):
    """The parts of torch's OOM message that depend on the allocator alone (not on other processes)."""
    tried = re.search(r"Tried to allocate (\S+ \S+?)\.", message)
    held = re.search(r"Of the allocated memory (.+?) is allocated by PyTorch, and (.+?) is reserved", message)
    allowed = re.search(r"(\S+ \S+) allowed;", message)
    return (tried and tried.group(1), held and held.groups(), allowed and allowed.group(1))


# With a fraction of 0.01 (about 1.4 GiB on an H200) most of these sequences reach the limit: the release paths,
# garbage collection, the retry and the OOM message are compared too.
CASES = [
    ("", None),
    ("max_split_size_mb:64", None),
    ("expandable_segments:True", None),
    ("roundup_power2_divisions:[1:2,8:4,>:8]", None),
    ("max_non_split_rounding_mb:40,max_split_size_mb:64", None),
    ("", 0.01),
    ("garbage_collection_threshold:0.6", 0.01),
    ("garbage_collection_threshold:0.5,max_split_size_mb:64", 0.01),
    ("expandable_segments:True", 0.01),
    ("expandable_segments:True", 0.008),
]


@pytest.mark.parametrize("conf, fraction", CASES)
def test_simulator_matches_the_real_allocator_op_by_op(conf, fraction):
    ops = random_ops(seed=f"{conf}/{fraction}")
    real = real_replay(ops, conf, fraction)
    config = AllocatorConfig.parse(conf)
    if fraction is not None:
        config = AllocatorConfig.parse(conf + ("," if conf else "") + f"per_process_memory_fraction:{fraction}")
    # the GPU is far larger than these sequences: no cudaMalloc fails, only the fraction of its total can bite
    sim = simulate(ops, config, timeline_points=len(ops), device_total=real["total"])
    simulated = [[allocated, reserved] for _, allocated, reserved in sim.timeline]
    first_difference = next((i for i, (a, b) in enumerate(zip(simulated, real["points"])) if a != b), None)
    assert first_difference is None, (
        f"op {first_difference} {ops[first_difference]}: simulated {simulated[first_difference]}, "
        f"real {real['points'][first_difference]}")
    assert len(simulated) == len(real["points"])
    assert (sim.num_alloc_retries, sim.num_ooms) == (real["num_alloc_retries"], real["num_ooms"])
    assert (sim.oom is None) == (real["oom"] is None)
    if sim.oom is not None:
        assert sim.oom.index == real["oom"]["index"]
        assert message_parts(sim.oom.message) == message_parts(real["oom"]["message"])
