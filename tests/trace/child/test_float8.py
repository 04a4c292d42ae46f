"""Float8 training (torchao's convert_to_float8_training) traced on fake CUDA (tests/scripts/float8_linear.py,
xmem.trace.child.float8): each operand cast to float8 by the program's own ops, the float8 matmul's layout copies and
scales from torchao's handler (float8_ops.preprocess_addmm, addmm_float8_unwrapped), refused below sm89 as upstream;
and torchao's MXFP8 training (--recipe mxfp8), on Blackwell only, as torchao allows it.

The program: Linear(256, 1024) -> ReLU -> Linear(1024, 256), bias-free, bf16, 512 tokens, AdamW. By hand from
torchao's Float8Linear (matmul_with_hp_or_float8_args) and its casts (tensor_to_scale, hp_tensor_and_scale_to_float8):
- a tensorwise cast of an n-element bf16 tensor allocates, in order: abs (2n), its max (2 B), that amax as float64
  (8), clamped (8), the float8 maximum over it (reciprocal, mul: 8 each), the scale as float32 (4); then the tensor
  as float32 (4n), times the scale (4n), clamped to the float8 range (4n) and the float8 bits (n);
- forward casts the input and the weight (its transpose, column-major), multiplies with `_scaled_mm` after taking the
  reciprocal of both scales (4 B each); the operands are already in the layouts `_scaled_mm` wants: no copy. It saves
  the high-precision input and weight, not their float8 casts: those and the scales die with the forward;
- backward casts grad_output, the weight, grad_output again and the input (tensorwise: four casts) and copies each
  operand into the layout `_scaled_mm` wants where it is not in it: the weight's float8 transpose (grad_input), the
  float8 grad_output transposed and the float8 input made column-major (grad_weight).
"""

import importlib.util
import sys

import pytest

from tests.trace.child.live_storages import by_category, live_before, peak_live_bytes
from tests.trace.child.test_scripts import GPUS, allocs, trace
from xmem.trace import TraceError
from xmem.trace.child.float8 import SCALED_MM_REFUSAL

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed (float8 "
                                 "training is torchao's)"),
              pytest.mark.usefixtures("warm_tracer")]

TOKENS, DIM, HIDDEN = 512, 256, 1024
WEIGHT = DIM * HIDDEN * 2  # each of the two bf16 weights
BATCH = TOKENS * DIM * 2
HIDDEN_ACTIVATION = TOKENS * HIDDEN * 2
LOSS_INPUT = TOKENS * DIM * 4  # the output as float32, saved by pow


def tensorwise_cast(numel: int) -> list[tuple[str, int]]:
    """What casting `numel` bf16 elements to float8 allocates, in order (module docstring)."""
    return [("abs", 2 * numel), ("max", 2), ("_to_copy", 8), ("clamp", 8), ("reciprocal", 8), ("mul", 8),
            ("_to_copy", 4), ("_to_copy", 4 * numel), ("mul", 4 * numel), ("clamp", 4 * numel), ("_to_copy", numel)]


def float8_matmul(out_bytes: int, *layout_copies: int) -> list[tuple[str, int]]:
    return [("clone", n) for n in layout_copies] + [("reciprocal", 4), ("reciprocal", 4), ("_scaled_mm", out_bytes)]


def ops(events) -> list[tuple[str, int]]:
    return [(e.op, e.nbytes) for e in events]


@pytest.fixture(scope="module")
def tensorwise():
    return trace(sys.executable, "float8_linear.py", iterations=3)


def test_float8_training_trains_on_fake_cuda(tensorwise):
    assert tensorwise.iterations == 3


def test_forward_casts_input_and_weight_of_each_layer_and_multiplies_in_float8(tensorwise):
    first, second = TOKENS * DIM, TOKENS * HIDDEN
    expected = (tensorwise_cast(first) + tensorwise_cast(DIM * HIDDEN) + float8_matmul(HIDDEN_ACTIVATION)
                + [("relu", HIDDEN_ACTIVATION)]
                + tensorwise_cast(second) + tensorwise_cast(DIM * HIDDEN) + float8_matmul(BATCH))
    forward = [e for e in allocs(tensorwise, phase="forward") if e.iteration == 1 and e.module]
    assert ops(forward) == expected


def test_backward_casts_four_operands_a_layer_and_copies_them_into_scaled_mms_layouts(tensorwise):
    grad_output_2, grad_output_1 = TOKENS * DIM, TOKENS * HIDDEN
    layer_2 = (tensorwise_cast(grad_output_2) + tensorwise_cast(DIM * HIDDEN)
               + float8_matmul(HIDDEN_ACTIVATION, DIM * HIDDEN)  # grad_input; W2's float8 transpose copied
               + tensorwise_cast(grad_output_2) + tensorwise_cast(TOKENS * HIDDEN)
               + float8_matmul(WEIGHT, grad_output_2, TOKENS * HIDDEN))  # grad_weight
    layer_1 = (tensorwise_cast(grad_output_1) + tensorwise_cast(DIM * HIDDEN)
               + float8_matmul(BATCH, DIM * HIDDEN)
               + tensorwise_cast(grad_output_1) + tensorwise_cast(TOKENS * DIM)
               + float8_matmul(WEIGHT, grad_output_1, TOKENS * DIM))
    backward = [e for e in allocs(tensorwise, phase="backward") if e.iteration == 1]
    matmuls = [i for i, e in enumerate(backward) if e.op == "_to_copy" and e.nbytes == grad_output_2 * 2]
    assert matmuls, "grad_output of the second layer (the loss's float32 gradient cast back to bf16)"
    start = matmuls[0] + 1
    relu = next(i for i, e in enumerate(backward) if e.op == "threshold_backward")
    assert ops(backward[start:relu]) == layer_2
    assert ops(backward[relu + 1:relu + 1 + len(layer_1)]) == layer_1


def test_no_float8_copy_or_scale_outlives_the_forward(tensorwise):
    # saved for backward: the batch and the ReLU's output (also the second layer's saved input), the loss's float32
    # input and the loss; the weights and AdamW's two moments each
    live = live_before(tensorwise, lambda e: e.iteration == 1 and e.phase == "backward")
    held = by_category(live)
    assert held["parameter"] == [WEIGHT] * 2 and held["optimizer_state"] == [WEIGHT] * 4
    assert sorted(e.nbytes for e in live.values() if e.category not in ("parameter", "optimizer_state")) == \
        sorted([BATCH, HIDDEN_ACTIVATION, LOSS_INPUT, 4])


def test_the_peak_is_the_second_layers_input_cast_in_backward(tensorwise):
    # weights 2 x 512 KiB, AdamW's moments 4 x 512 KiB, the batch and the ReLU output (saved), the loss and its
    # backward seed (4 B each), grad_output (bf16) and its two float8 casts with their scales, W2's float8 transpose
    # with its scale, grad_input (1 MiB), and the ReLU output's cast underway: its scale, the float32 copy times the
    # scale and its clamp (2 MiB each) and the float8 bits: grad_output's float32 temporaries are gone by then
    expected = (2 * WEIGHT + 4 * WEIGHT + BATCH + HIDDEN_ACTIVATION + 4 + 4 + BATCH
                + (TOKENS * DIM + 4) + (DIM * HIDDEN + 4) + HIDDEN_ACTIVATION + (TOKENS * DIM + 4)
                + 4 + 2 * (TOKENS * HIDDEN * 4) + TOKENS * HIDDEN)
    assert expected == 11010072
    assert peak_live_bytes(tensorwise) == expected


def test_rowwise_scales_are_one_per_row_of_the_operand():
    # rowwise: amax over the contracted dimension, keepdim; scales rounded down to a power of two (log2, floor, exp2)
    result = trace(sys.executable, "float8_linear.py", "--recipe", "rowwise", iterations=2)
    forward = [e for e in allocs(result, phase="forward") if e.iteration == 1 and e.module == "Sequential.0"]
    amaxes = [e.nbytes for e in forward if e.op == "amax"]
    assert amaxes == [TOKENS * 2, HIDDEN * 2]  # the input's rows, the weight's output columns (bf16)
    assert ops(forward)[-3:] == [("reciprocal", TOKENS * 4), ("reciprocal", HIDDEN * 4),
                                 ("_scaled_mm", HIDDEN_ACTIVATION)]


def test_compiled_float8_saves_the_first_matmuls_output_and_the_inputs_float8_copy_and_peaks_lower():
    # Inductor's partition (min-cut) keeps the first matmul's output (ReLU and the second layer's input cast are
    # recomputed from it in backward), the batch's float8 copy and its scale; the casts' float32 temporaries live
    # inside fused kernels and are never allocated
    result = trace(sys.executable, "float8_linear.py", "--compile", iterations=2)
    live = live_before(result, lambda e: e.iteration == 1 and e.phase == "backward")
    saved = sorted(e.nbytes for e in live.values() if e.module == "OptimizedModule")
    assert saved == [4, TOKENS * DIM, HIDDEN_ACTIVATION]
    assert not any("torch.compile" in warning for warning in result.warnings)  # no region fell back to eager
    # the peak is in the loss's eager backward: weights, AdamW's moments and the batch, those three saved tensors,
    # the float32 output (saved by pow), the loss and its seed, and pow/mean's four float32 temporaries
    assert peak_live_bytes(result) == (2 * WEIGHT + 4 * WEIGHT + BATCH + 4 + TOKENS * DIM + HIDDEN_ACTIVATION
                                       + LOSS_INPUT + 4 + 4 + 4 * LOSS_INPUT) == 7208972


def mx_matmul(rows: int, inner: int, columns: int, out_bytes: int) -> list[tuple[str, int]]:
    """torchao's MXFP8 matmul (mx_mm's forward) by hand: each operand cast along the contracted dimension by its Triton
    op (float8 bits, one float8_e8m0 scale a block of 32), each scale swizzled by to_blocked (its two reshapes of
    permuted views copy it; no padding at these sizes), then `_scaled_mm`."""
    input_scale, weight_scale = rows * inner // 32, columns * inner // 32
    return [("triton_to_mxfp8_dim0", rows * inner), ("triton_to_mxfp8_dim0", input_scale),
            ("triton_to_mxfp8_dim0", columns * inner), ("triton_to_mxfp8_dim0", weight_scale),
            ("clone", input_scale), ("clone", input_scale), ("clone", weight_scale), ("clone", weight_scale),
            ("_scaled_mm", out_bytes)]


def test_mxfp8_training_casts_each_operand_to_blocks_of_32_on_blackwell():
    result = trace(sys.executable, "float8_linear.py", "--recipe", "mxfp8", iterations=2, gpu=GPUS["B200"])
    forward = [e for e in allocs(result, phase="forward") if e.iteration == 1 and e.module]
    assert ops(forward) == (mx_matmul(TOKENS, DIM, HIDDEN, HIDDEN_ACTIVATION) + [("relu", HIDDEN_ACTIVATION)]
                            + mx_matmul(TOKENS, HIDDEN, DIM, BATCH))


def test_mxfp8_training_below_blackwell_ends_in_torchaos_own_refusal():
    # torchao makes its MX casts available from sm100 only (checked at import): below, its stand-in raises
    with pytest.raises(TraceError) as refused:
        trace(sys.executable, "float8_linear.py", "--recipe", "mxfp8", iterations=2, gpu=GPUS["H100-SXM5-80GB"])
    assert refused.value.kind == "user_error" and "needs triton" in str(refused.value)


def test_float8_matmul_is_refused_below_sm89_in_upstreams_words():
    with pytest.raises(TraceError) as refused:
        trace(sys.executable, "float8_linear.py", iterations=2, gpu=GPUS["A100-SXM4-80GB"])
    assert refused.value.kind == "user_error" and SCALED_MM_REFUSAL in str(refused.value)
