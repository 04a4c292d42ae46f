"""On a real GPU: does xmem's restatement of SDPA's backend choice (xmem.trace.child.attention.select_backend) agree with
upstream's own (`torch._fused_sdp_choice`) on this device, torch and cuDNN? Prints one line per disagreement and a
summary; exit 0 when all agree, 1 when some differ, 2 without a GPU.

    python scripts/check_sdpa_choice.py
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from xmem.trace.child.attention import CUDNN, EFFICIENT, FLASH, MATH, Call, current_runtime, select_backend  # noqa: E402

NAMES = {0: MATH, 1: FLASH, 2: EFFICIENT, 3: CUDNN}
SWITCHES = {FLASH: SDPBackend.FLASH_ATTENTION, EFFICIENT: SDPBackend.EFFICIENT_ATTENTION, MATH: SDPBackend.MATH,
            CUDNN: SDPBackend.CUDNN_ATTENTION}
ENABLED_SETS = [(FLASH, EFFICIENT, MATH, CUDNN), (FLASH, EFFICIENT, MATH), (EFFICIENT, MATH), (CUDNN, MATH)]


def cases():
    """(q, k, v, mask, dropout, causal, enable_gqa) over dtypes, head dims, grouped heads, masks, dropout."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    for dtype, d, (hq, hkv), masked, dropout, grad in itertools.product(
            dtypes, (64, 76, 128, 160, 256, 512), ((8, 8), (8, 2), (8, 1)), (False, True), (0.0, 0.1), (False, True)):
        b, t = 2, 128
        q = torch.randn(b, hq, t, d, device="cuda", dtype=dtype, requires_grad=grad)
        k, v = (torch.randn(b, hkv, t, d, device="cuda", dtype=dtype, requires_grad=grad) for _ in range(2))
        mask = torch.ones(b, 1, t, t, device="cuda", dtype=torch.bool) if masked else None
        for gqa in {hq != hkv, False}:
            yield q, k, v, mask, dropout, not masked, gqa


def main() -> int:
    if not torch.cuda.is_available():
        print("check_sdpa_choice: no CUDA device", file=sys.stderr)
        return 2
    capability = torch.cuda.get_device_capability()
    differ = total = 0
    for enabled in ENABLED_SETS:
        with sdpa_kernel([SWITCHES[name] for name in enabled]):
            for q, k, v, mask, dropout, causal, gqa in cases():
                try:
                    theirs = NAMES.get(torch._fused_sdp_choice(q, k, v, mask, dropout, causal, enable_gqa=gqa))
                except RuntimeError:
                    theirs = None  # no kernel
                ours = select_backend(Call.of(q, k, v, mask, dropout, causal, gqa), capability, current_runtime())
                total += 1
                if ours != theirs:
                    differ += 1
                    print(f"enabled={','.join(enabled)} q={tuple(q.shape)} k={tuple(k.shape)} {q.dtype} "
                          f"mask={mask is not None} dropout={dropout} grad={q.requires_grad} gqa={gqa}: "
                          f"upstream {theirs}, xmem {ours}")
    print(f"sm{capability[0]}{capability[1]} torch {torch.__version__} cuDNN {torch.backends.cudnn.version()}: "
          f"{total - differ}/{total} choices agree")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
