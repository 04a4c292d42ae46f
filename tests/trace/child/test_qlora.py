"""QLoRA with torchao's NF4 weights traced on fake CUDA (tests/scripts/qlora_nf4.py, xmem.trace.child.nf4): built on
the GPU, a bf16 checkpoint loaded from the host into the NF4 weights, dequantized in forward, LoRA trained on top.

By hand from torchao's NF4Tensor (from_tensor, double_quantize_scalers, get_original_weight, LinearNF4), for a
1024 x 1024 bf16 weight, block 64, scaler block 256: the quantized data holds two 4-bit values a byte (524288 B),
one int8 scaler per block (16384 blocks: 16384 B), one bf16 quantization factor per scaler block (64: 128 B), the
scalers' bf16 mean (2 B) and the 16-value bf16 NF4 table (32 B). load_state_dict's copy into an NF4 weight moves the
checkpoint tensor to the weight's device (2 MiB), quantizes it there and copies the result into the weight's own
inner tensors: afterwards the model holds what it held before. linear_nf4 dequantizes the weight to the input's
dtype (a 2 MiB bf16 weight, made by its final stack) in forward and again in backward, where autograd asks for the
input's gradient: only the second layer's (the first one's input and weight need none). The adapters (rank 8:
8 x 1024 bf16, 16384 B each, four of them) alone get gradients and AdamW's two moments.
"""

import importlib.util
import sys

import pytest

from tests.trace.child.live_storages import by_category, live_before
from tests.trace.child.test_scripts import allocs, sizes, trace

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed"),
              pytest.mark.usefixtures("warm_tracer")]

NF4_WEIGHT = [524288, 16384, 128, 2, 32]
ADAPTER = 8 * 1024 * 2
DENSE = 1024 * 1024 * 2
BATCH = 8 * 1024 * 2  # the first batch, made before the first forward


@pytest.fixture(scope="module")
def qlora():
    return trace(sys.executable, "qlora_nf4.py", iterations=3)


def first_forward(e):
    return e.phase == "forward"


def test_qlora_trains_on_fake_cuda(qlora):
    assert qlora.iterations == 3


def test_loading_the_checkpoint_quantizes_each_tensor_on_the_gpu_and_keeps_only_the_nf4_weights(qlora):
    moved = [e for e in allocs(qlora) if e.op == "_to_copy" and e.nbytes == DENSE and e.iteration == -1]
    assert len(moved) == 2 and {e.category for e in moved} == {"input"}
    live = live_before(qlora, first_forward)
    assert sizes(live.values()) == sorted(NF4_WEIGHT * 2 + [ADAPTER] * 4 + [BATCH])
    assert not any(block in live for block in (e.block for e in moved))


def test_forward_dequantizes_each_nf4_weight_and_backward_the_one_whose_input_needs_a_gradient(qlora):
    dequantized = [(e.iteration, e.phase) for e in allocs(qlora) if e.op == "stack" and e.nbytes == DENSE]
    assert dequantized == [(i, phase) for i in range(3) for phase in ("forward", "forward", "backward")]


def test_only_the_adapters_get_gradients_and_optimizer_state(qlora):
    first = [e for e in allocs(qlora) if e.iteration == 0]
    assert sizes([e for e in first if e.category == "gradient"]) == [ADAPTER] * 4
    assert sizes([e for e in first if e.category == "optimizer_state"]) == [ADAPTER] * 8
    held = by_category(live_before(qlora, lambda e: e.iteration == 1 and e.phase == "forward"))
    assert held["optimizer_state"] == [ADAPTER] * 8


def test_a_checkpoint_loaded_onto_the_gpu_loads_into_the_nf4_weights_as_well():
    result = trace(sys.executable, "qlora_nf4.py", "--checkpoint-file", iterations=3)
    assert result.iterations == 3
    # torch.load(map_location="cuda") made the two dense tensors on the GPU, which the script keeps alive
    live = live_before(result, first_forward)
    assert sizes(live.values()) == sorted(NF4_WEIGHT * 2 + [ADAPTER] * 4 + [BATCH] + [DENSE] * 2)
