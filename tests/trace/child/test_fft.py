"""cuFFT's path as the trace records it (xmem/trace/child/fft.py): besides each FFT op's output, the work area of
every cuFFT execution and the copies upstream makes (aten/src/ATen/native/cuda/SpectralOps.cpp), each freed before
the op returns. The expected bytes are derived by hand from upstream's rules and the stated work-area approximation
(one complex buffer of the transform: batch x elements, the last dim n/2+1 for real transforms, 8 bytes each in
complex64)."""

import sys
from pathlib import Path

import pytest
import torch

from xmem.trace.child import fft
from xmem.trace.events import Category
from xmem.trace.runner import run_trace

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces of what a program allocates: forked warm

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "peft_fft_adapters.py"
WS, TEMP = Category.WORKSPACE, Category.TEMPORARY


def meta(*shape, dtype=torch.complex64):
    return torch.empty(shape, dtype=dtype, device="meta")


def steps(op, tensor, dims, last, sm=(9, 0)):
    """`fft.scratch` of one call as (action, bytes, category) in order, frees carrying their alloc's bytes."""
    third = {"_fft_c2c": False, "_fft_r2c": last, "_fft_c2r": last}[op]
    sizes, out = {}, []
    for step in fft.scratch(op, (tensor, dims, 0, third), {}, sm):
        if step[0] == fft.ALLOC:
            sizes[step[1]] = step[2], step[3]
            out.append((fft.ALLOC, step[2], step[3]))
        else:
            out.append((fft.FREE, *sizes[step[1]]))
    return out


def test_c2c_2d_takes_one_work_area_of_the_transform():
    # ifft2 of a 256x256 weight (FourierFT): one execution over both dims, batch 1: 256*256 complex64 elements
    assert steps("_fft_c2c", meta(256, 256), [0, 1], None) == [("alloc", 524288, WS), ("free", 524288, WS)]


def test_c2r_clones_its_input_and_frees_it_with_the_work_area():
    # cuFFT's C2R overwrites its input: a contiguous clone (32*33*8), then the work area: batch 32 x (64/2+1) x 8
    assert steps("_fft_c2r", meta(32, 33), [1], 64) == [
        ("alloc", 8448, TEMP), ("alloc", 8448, WS), ("free", 8448, WS), ("free", 8448, TEMP)]


def test_r2c_over_dims_0_1_runs_off_the_optimised_path_with_a_working_buffer():
    # R2C over dim 1 (batch 64 x 33 x 8), then the working tensor (64x33 complex64) for the C2C over dim 0
    # (batch 33 x 64 x 8)
    assert steps("_fft_r2c", meta(64, 64, dtype=torch.float32), [0, 1], True) == [
        ("alloc", 16896, WS), ("free", 16896, WS), ("alloc", 16896, TEMP),
        ("alloc", 16896, WS), ("free", 16896, WS), ("free", 16896, TEMP)]


def test_c2c_over_four_dims_ping_pongs_and_copies_what_no_view_can_batch():
    # (2,3,4,5,6) over dims 1-4: pass 1 over the 3 smallest-strided dims (batch 2*3, 120 elements: 5760 B), then a
    # second buffer of the output's size; pass 2 over dim 1 batches dims 0,2,3,4, which dim 1 separates in memory:
    # `reshape` copies (5760 B) before the work area (5760 B)
    got = steps("_fft_c2c", meta(2, 3, 4, 5, 6), [1, 2, 3, 4], None)
    assert got == [("alloc", 5760, WS), ("free", 5760, WS), ("alloc", 5760, TEMP), ("alloc", 5760, TEMP),
                   ("alloc", 5760, WS), ("free", 5760, WS), ("free", 5760, TEMP), ("free", 5760, TEMP)]


def test_transposed_input_is_copied_before_the_execution():
    x = meta(8, 16, 32).transpose(0, 2)  # (32, 16, 8), strides (1, 32, 512): batch dims 2 and 0 do not collapse
    assert steps("_fft_c2c", x, [1], None) == [
        ("alloc", 32768, TEMP), ("alloc", 32768, WS), ("free", 32768, WS), ("free", 32768, TEMP)]


def test_a_large_prime_factor_pads_the_work_area_as_bluestein_does():
    # 13 has a prime factor above 7: the length counts as 32 (the power of two >= 2*13-1); 4 x 32 x 8
    assert steps("_fft_c2c", meta(4, 13), [1], None) == [("alloc", 1024, WS), ("free", 1024, WS)]
    assert steps("_fft_c2c", meta(4, 12), [1], None) == [("alloc", 384, WS), ("free", 384, WS)]


def test_bf16_r2c_takes_the_proxy_from_sm80_and_float32_before():
    x = meta(32, 64, dtype=torch.bfloat16)
    # sm80+: ComplexHalf proxy 32x33x4, work area 32x33x4 (16-bit complex), the complex64 conversion 32x33x8
    assert steps("_fft_r2c", x, [1], False, (9, 0)) == [
        ("alloc", 4224, TEMP), ("alloc", 4224, WS), ("free", 4224, WS), ("alloc", 8448, TEMP),
        ("free", 8448, TEMP), ("free", 4224, TEMP)]
    # before sm80: the input promoted to float32 (32x64x4), then the float path's work area (32x33x8)
    assert steps("_fft_r2c", x, [1], False, (7, 5)) == [
        ("alloc", 8192, TEMP), ("alloc", 8448, WS), ("free", 8448, WS), ("free", 8192, TEMP)]


def test_r2c_of_an_input_not_aligned_as_complex_is_cloned():
    base = torch.empty(32 * 64 + 1, dtype=torch.float32, device="meta")
    x = base[1:].view(32, 64)  # storage offset 1: 4 bytes past a complex64 boundary
    assert [s[1:] for s in fft.scratch("_fft_r2c", (x, [1], 0, True), {}, (9, 0))] == [
        (1, 8192, TEMP), (2, 8448, WS), (2,), (1,)]


# ---- one trace: LoRA, FourierFT and C3A on the same tiny model, through peft's public API ---------------------

@pytest.fixture(scope="module")
def trace():
    pytest.importorskip("peft")
    return run_trace([sys.executable, str(SCRIPT)], iterations=1)


def fft_calls(trace, model):
    """Per FFT op call of `model`: (op, output bytes, [(action, bytes, category)] of what followed it under the same
    op until all of that was freed). Its events run from its first forward event (module paths start with its class;
    backward events carry none) to the next model's first."""
    events = [e for e in trace.events if e.iteration == 0]
    start = next(i for i, e in enumerate(events) if e.module.startswith(model))
    end = next((i for i, e in enumerate(events) if i > start and e.module and not e.module.startswith(model)),
               len(events))
    calls, index = [], start
    while index < end:
        e = events[index]
        index += 1
        if e.action != "alloc" or e.op not in fft.FFT_OPS:
            continue
        scratch, live = [], set()
        while index < end and events[index].op == e.op and (live or not scratch):
            step = events[index]
            if step.action == "alloc":
                live.add(step.block)
            elif step.block not in live:
                break
            else:
                live.discard(step.block)
            scratch.append((step.action, step.nbytes, step.category))
            index += 1
        calls.append((e.op, e.nbytes, scratch))
    return calls


def test_lora_runs_no_fft(trace):
    assert fft_calls(trace, "LoraNet") == []


def test_fourierft_ifft2_takes_one_weight_sized_work_area_per_call(trace):
    # get_delta_weight: ifft2 of the dense 256x256 spectrum (complex64, 524288 B) in forward, its C2C in backward;
    # for each of q and v
    calls = fft_calls(trace, "FourierNet")
    assert len(calls) == 4
    for op, out, scratch in calls:
        assert (op, out) == ("_fft_c2c", 256 * 256 * 8)
        assert scratch == [("alloc", 524288, WS), ("free", 524288, WS)]


def test_c3a_blocks_take_work_areas_of_their_batched_transforms(trace):
    # forward, per layer: ifft(x) of x (32, 4 blocks, 64): R2C two-sided, work area 32*4 x 33 x 8; fft(w) of the
    # kernel (4, 4, 64): 4*4 x 33 x 8; fft of the product (32, 4, 64) complex: C2C, 32*4 x 64 x 8
    calls = fft_calls(trace, "C3ANet")
    assert calls[:3] == [
        ("_fft_r2c", 65536, [("alloc", 33792, WS), ("free", 33792, WS)]),
        ("_fft_r2c", 8192, [("alloc", 4224, WS), ("free", 4224, WS)]),
        ("_fft_c2c", 65536, [("alloc", 65536, WS), ("free", 65536, WS)]),
    ]
    assert all(scratch and scratch[0][2] == WS for _, _, scratch in calls)


def test_every_cufft_block_is_freed_within_its_op(trace):
    live = {}
    for e in trace.events:
        if e.op in fft.FFT_OPS and e.category in (WS,):
            if e.action == "alloc":
                live[e.block] = e
            else:
                assert live.pop(e.block).nbytes == e.nbytes
    assert live == {}
    workspaces = [e for e in trace.events if e.category == WS and e.action == "alloc"]
    assert workspaces and all(e.op in fft.FFT_OPS for e in workspaces)
