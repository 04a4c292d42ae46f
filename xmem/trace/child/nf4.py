"""torchao's NF4 weights (QLoRA: `to_nf4`, `NF4Tensor`, torchtune's `FrozenNF4Linear`) under fake CUDA.

Owns which ops the recorder leaves to NF4Tensor's own `__torch_dispatch__` (`dispatches_itself`). NF4Tensor is a
wrapper subclass whose handler runs plain ops on its inner tensors (quantized data, scalers, the NF4 table): a
`load_state_dict` copy into an NF4 weight moves the checkpoint tensor to the weight's device, quantizes it there
(`NF4Tensor.from_tensor`) and copies the result into the weight's inner tensors; a forward dequantizes the weight to
the input's dtype (`linear_nf4`: `weight.to(dtype)`). When the recorder took those ops itself, NF4's handler ran
below it with no mode active: the move of a host checkpoint tensor reached the real CUDA runtime. Left to NF4's
handler first (as DTensor's are, xmem.trace.child.distributed), its inner ops come back to the recorder one by one:
the moved copy, the quantization's temporaries and the dequantized weight are recorded as a GPU allocates them.
"""

from __future__ import annotations

import sys
from typing import Any

# Where torchao defines NF4Tensor: its current module, and the one it had before (torchao.dtypes.nf4tensor).
_MODULES = ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor")


def dispatches_itself(types: Any) -> bool:
    """Whether an op on tensors of `types` (its __torch_dispatch__ argument) is NF4Tensor's to dispatch first."""
    classes = _nf4_classes()
    return bool(classes) and any(issubclass(kind, classes) for kind in types)


def _nf4_classes() -> tuple[type, ...]:
    """NF4Tensor of each torchao module the program has imported (none: torchao's NF4 is not in use)."""
    found = []
    for name in _MODULES:
        module = sys.modules.get(name)
        kind = getattr(module, "NF4Tensor", None) if module is not None else None
        if isinstance(kind, type):
            found.append(kind)
    return tuple(found)


__all__ = ["dispatches_itself"]
