"""Capability classes traced side by side (xmem.estimate.trace_per_capability_class): an architecture-sensitive
program's traces for two classes, the second started beside the first, are the traces each class gets alone."""

import sys
from pathlib import Path

from tests.trace.child.test_shortcuts import canonical
from xmem.estimate import estimate
from xmem.gpus import load_catalog
from xmem.trace import run_trace

SCRIPT = Path(__file__).parent / "scripts" / "layer_caches.py"  # SDPA in bf16 autocast: the kernel depends on the GPU


def test_classes_traced_side_by_side_equal_their_own_traces():
    kept = {}
    estimate([sys.executable, str(SCRIPT)], gpus=["h100", "t4"], keep_traces=kept)
    assert set(kept) == {"sm80+", "pre-sm80"} and kept["sm80+"].arch_sensitive
    catalog = load_catalog()
    for cls, name in [("sm80+", "H100-SXM5-80GB"), ("pre-sm80", "T4")]:
        gpu = catalog[name]
        alone = run_trace([sys.executable, str(SCRIPT)], gpu=gpu)
        assert kept[cls].capability == alone.capability == tuple(gpu.capability)
        assert canonical(kept[cls].events) == canonical(alone.events), cls
        assert kept[cls].op_counts == alone.op_counts, cls
    assert kept["sm80+"].op_counts != kept["pre-sm80"].op_counts  # the classes did choose differently
