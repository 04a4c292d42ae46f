"""The SDPA backend the fake GPU picks (upstream's select_sdp_backend restated in xmem.trace.child.attention), per compute
capability, torch release, cuDNN, dtype, mask, grouped-query heads, head dim and the program's switches, and
whether another GPU generation would pick differently (the trace's arch_sensitive). Each expectation is derived by
hand from upstream's gates, named in the comments."""

import sys

import pytest
import torch

from tests.torch_builds import PYTHONS, SCRIPTS
from xmem.gpus import load_catalog
from xmem.trace import run_trace
from xmem.trace.child.attention import (CUDNN, EFFICIENT, FLASH, MATH, Call, Mask, Runtime, choose_attention_backend,
                                  minimum_gemm_alignment, select_backend)

pytestmark = pytest.mark.usefixtures("warm_tracer")  # traces fork from a warm server: tests/conftest.py

H100, B200, B300, A100, A10, L40S, RTX5090, V100, T4 = (9, 0), (10, 0), (10, 3), (8, 0), (8, 6), (8, 9), (12, 0), \
    (7, 0), (7, 5)
WHEEL = Runtime()  # torch 2.14.1+cu130: cuDNN 9.24.0, every backend enabled, the default order
TORCH_2_13 = Runtime(torch_version=(2, 13))


def llama(b=4, hq=32, hkv=4, t=2048, d=64, dtype=torch.bfloat16, **options):
    """A Llama-style training call: (B, H, T, D) queries, fewer key/value heads, causal, enable_gqa, grads."""
    options = {"is_causal": True, "enable_gqa": hkv != hq, "needs_grad": True} | options
    return Call(q=(b, hq, t, d), k=(b, hkv, t, d), v=(b, hkv, t, d), dtype=dtype, **options)


def pick(call, capability=H100, runtime=WHEEL):
    return select_backend(call, capability, runtime)


# ---- priority order: check_prefer_cudnn_attention ----------------------------------------------------------------
@pytest.mark.parametrize("capability, backend", [
    (H100, CUDNN), (B200, CUDNN), (B300, CUDNN),  # sm9x/sm10x with cuDNN > 9.15.0: cuDNN first
    (A100, FLASH), (A10, FLASH), (L40S, FLASH), (RTX5090, FLASH),  # the default order: flash first
    (T4, MATH), (V100, MATH),  # before sm80: no flash, no cuDNN; efficient takes no bf16 there
])
def test_gqa_training_call_runs_a_fused_kernel_from_ampere_on(capability, backend):
    assert pick(llama(), capability) == backend


def test_the_gqa_choice_depends_on_the_gpu_generation():
    assert choose_attention_backend(llama(), H100) == (CUDNN, True)


def test_cudnn_is_not_preferred_when_deprioritised_or_too_old():
    assert pick(llama(), runtime=Runtime(cudnn_deprioritized=True)) == FLASH
    assert pick(llama(), runtime=Runtime(cudnn_version=91500)) == FLASH  # needs > 9.15.0
    assert pick(llama(), runtime=Runtime(cudnn_version=91501)) == CUDNN


def test_cuda_12_wheels_prefer_cudnn_only_on_minor_0_and_3():
    cuda12 = Runtime(cuda_major=12)
    assert pick(llama(), (10, 3), cuda12) == CUDNN
    assert pick(llama(), (10, 1), cuda12) == FLASH
    assert pick(llama(), (10, 1), WHEEL) == CUDNN


def test_an_order_the_program_set_is_walked_as_set():
    assert pick(llama(), runtime=Runtime(order=(EFFICIENT, FLASH, MATH, CUDNN))) == EFFICIENT


# ---- switches: enable_*_sdp / sdpa_kernel, deterministic algorithms ---------------------------------------------
def test_disabled_backends_are_skipped():
    assert pick(llama(), runtime=Runtime(enabled=frozenset({FLASH, EFFICIENT, MATH}))) == FLASH
    assert pick(llama(), runtime=Runtime(enabled=frozenset({EFFICIENT, MATH}))) == EFFICIENT
    assert pick(llama(), runtime=Runtime(enabled=frozenset({MATH}))) == MATH
    assert pick(llama(dtype=torch.float32), runtime=Runtime(enabled=frozenset({CUDNN}))) is None  # no kernel
    assert pick(llama(), runtime=Runtime(enabled=frozenset())) is None


def test_deterministic_algorithms_rule_out_cudnn():
    assert pick(llama(), runtime=Runtime(deterministic=True)) == FLASH


# ---- grouped-query and multi-query heads: check_batch_size_and_num_heads_dense ----------------------------------
def test_kv_heads_must_divide_query_heads():
    assert pick(llama(hq=32, hkv=5), A100) == MATH
    assert pick(llama(hq=32, hkv=5), H100) == MATH


def test_fewer_kv_heads_without_enable_gqa_take_math():
    assert pick(llama(enable_gqa=False)) == MATH


def test_only_cudnn_takes_key_and_value_with_different_head_counts():
    call = Call(q=(2, 32, 128, 64), k=(2, 4, 128, 64), v=(2, 8, 128, 64), enable_gqa=True)
    assert pick(call, H100) == CUDNN  # requires_same_num_heads = false
    assert pick(call, A100) == MATH  # flash and efficient require k and v heads equal


def test_multi_query_without_enable_gqa_is_fused_from_torch_2_14():
    mqa = llama(hkv=1, enable_gqa=False)
    assert pick(mqa, A100) == FLASH and pick(mqa, H100) == CUDNN
    assert pick(mqa, A100, TORCH_2_13) == MATH  # 2.13's check had no supports_mqa
    assert pick(llama(), H100, TORCH_2_13) == CUDNN  # GQA with enable_gqa is fused on 2.13 too
    assert pick(llama(), A100, TORCH_2_13) == FLASH


def test_memory_efficient_takes_grouped_heads_only_from_torch_2_14():
    fp16 = llama(dtype=torch.float16)
    assert pick(fp16, V100) == EFFICIENT
    assert pick(fp16, V100, TORCH_2_13) == MATH
    assert pick(llama(dtype=torch.float32), H100, TORCH_2_13) == MATH


# ---- dtypes and hardware --------------------------------------------------------------------------------------------
def test_fp32_takes_memory_efficient_on_every_generation():
    assert choose_attention_backend(llama(dtype=torch.float32), H100) == (EFFICIENT, False)


def test_fp16_before_ampere_takes_memory_efficient():
    assert pick(llama(dtype=torch.float16), V100) == EFFICIENT
    assert pick(llama(dtype=torch.float16), T4) == EFFICIENT


def test_memory_efficient_alignment_follows_the_gemm_alignment():
    assert [minimum_gemm_alignment(torch.float32, cap) for cap in (V100, A100)] == [1, 4]
    assert [minimum_gemm_alignment(torch.float16, cap) for cap in ((6, 0), V100, A100)] == [1, 8, 8]
    masked = dict(mask=Mask((4, 1, 2048, 2048)), is_causal=False)
    assert pick(llama(d=60, dtype=torch.float16, **masked), A100) == MATH  # 60 % 8
    assert pick(llama(d=60, dtype=torch.float32, **masked), A100) == EFFICIENT  # 60 % 4 == 0
    misaligned = llama(dtype=torch.float16, storage_offsets=(4, 0, 0), **masked)
    assert pick(misaligned, A100) == MATH and pick(misaligned, V100) == EFFICIENT  # offsets checked from sm80


# ---- masks --------------------------------------------------------------------------------------------------------
def test_a_boolean_padding_mask_rules_out_flash_but_not_cudnn():
    call = llama(mask=Mask((4, 1, 2048, 2048)), is_causal=False)
    assert pick(call, H100) == CUDNN
    assert pick(call, A100) == EFFICIENT


def test_cudnn_refuses_masks_it_cannot_broadcast_or_that_need_grad():
    assert pick(llama(mask=Mask((4, 2048, 2048)), is_causal=False)) == EFFICIENT  # 3-D
    assert pick(llama(mask=Mask((4, 2, 2048, 2048)), is_causal=False)) == EFFICIENT  # 2 heads of 32
    bias = Mask((1, 1, 2048, 2048), torch.bfloat16, requires_grad=True)
    assert pick(llama(mask=bias, is_causal=False)) == EFFICIENT
    assert pick(llama(mask=Mask((2048, 2048)), is_causal=False)) == CUDNN


# ---- head dims, sequence lengths, dropout, layout -----------------------------------------------------------------
def test_cudnn_head_dims_to_256_on_hopper_with_backward_only_for_some():
    assert pick(llama(d=256)) == CUDNN  # (256, 256) has a backward
    assert pick(llama(d=160)) == FLASH  # forward would fit, backward has no kernel (check_cudnn_d256_bprop_head_dim)
    assert pick(llama(d=160, needs_grad=False)) == CUDNN
    assert pick(llama(d=76)) == FLASH  # cuDNN wants multiples of 8; flash pads


def test_flash_backward_head_dim_limit_on_sm86_89_120():
    assert pick(llama(d=200), A10) == EFFICIENT  # (192, 224] has no backward there
    assert pick(llama(d=256), A10) == FLASH  # > 224 without dropout does
    assert pick(llama(d=256, dropout=0.1), A10) == EFFICIENT
    assert pick(llama(d=200, needs_grad=False), A10) == FLASH
    assert pick(llama(d=200), A100) == FLASH


def test_head_dim_over_256_takes_memory_efficient():
    assert pick(llama(d=512), H100) == EFFICIENT


def test_causal_with_unequal_lengths_rules_out_flash():
    call = Call(q=(2, 8, 16, 64), k=(2, 8, 32, 64), v=(2, 8, 32, 64), is_causal=True)
    assert pick(call, A100) == EFFICIENT


def test_cudnn_dropout_only_in_sixteenths():
    assert pick(llama(dropout=0.1)) == FLASH
    assert pick(llama(dropout=0.125)) == CUDNN


def test_cudnn_sequence_length_gates():
    decode = Call(q=(2, 8, 1, 64), k=(2, 8, 64, 64), v=(2, 8, 64, 64))
    assert pick(decode) == CUDNN  # one query is fine on sm90
    assert pick(decode, B200) == FLASH  # decode disabled for cuDNN 9.19-9.25.0 (but 9.24.1) on SM 10.x
    assert pick(decode, B200, Runtime(cudnn_version=92401)) == CUDNN
    one_key = Call(q=(2, 8, 64, 64), k=(2, 8, 1, 64), v=(2, 8, 1, 64))
    assert pick(one_key) == FLASH


def test_cudnn_batch_and_heads_up_to_65535():
    assert pick(llama(b=70000, t=64)) == FLASH


def test_strided_last_dim_or_foreign_device_take_math():
    assert pick(llama(last_strides=(2, 1, 1))) == MATH
    assert pick(llama(on_cuda=False)) == MATH


def test_unbatched_inputs_get_a_batch_of_one_from_2_14():
    call = Call(q=(8, 128, 64), k=(8, 128, 64), v=(8, 128, 64), dtype=torch.bfloat16, needs_grad=True)
    assert pick(call) == CUDNN
    assert pick(call, runtime=TORCH_2_13) == MATH  # 3-D: every fused kernel wants 4-D


# ---- each backend's memory, forward and backward, on fake CUDA (tests/scripts/sdpa_backends.py) -----------------
# q (B, H, T, D) = (2, 8, 64, 32) bf16: 65,536 bytes; k and v (2, 2, 64, 32): 16,384 bytes each (GQA, 4 q per kv head)
Q_BYTES, KV_BYTES, LSE_BYTES = 2 * 8 * 64 * 32 * 2, 2 * 2 * 64 * 32 * 2, 2 * 8 * 64 * 4  # lse/stats: fp32 (B, H, T)


def trace_backend(python, backend, *args):
    script = SCRIPTS / "sdpa_backends.py"
    return run_trace(["python", str(script), "--backend", backend, *args], python=python, iterations=1)


def op_allocs(trace, op):
    return [e.nbytes for e in trace.events if e.action == "alloc" and e.op == op and e.iteration <= 0]


@pytest.mark.parametrize("python", PYTHONS)
def test_cudnn_attention_keeps_output_and_softmax_stats_and_returns_three_gradients(python):
    result = trace_backend(python, "cudnn")
    # output, softmax stats (B, H, T, 1) fp32, philox seed and offset (int64 scalars on the GPU)
    assert op_allocs(result, "_scaled_dot_product_cudnn_attention") == [Q_BYTES, LSE_BYTES, 8, 8]
    # dq, dk, dv with k/v's own (grouped) head count: no repeated keys or values
    assert op_allocs(result, "_scaled_dot_product_cudnn_attention_backward") == [Q_BYTES, KV_BYTES, KV_BYTES]
    assert "_safe_softmax" not in result.op_counts


@pytest.mark.parametrize("python", PYTHONS)
def test_flash_attention_keeps_output_logsumexp_and_rng_state(python):
    result = trace_backend(python, "flash")
    # output, logsumexp (B, H, T) fp32, rng state (2 x uint64) and offset (the debug mask is empty: no storage)
    assert op_allocs(result, "_scaled_dot_product_flash_attention") == [Q_BYTES, LSE_BYTES, 16, 8]
    assert op_allocs(result, "_scaled_dot_product_flash_attention_backward") == [Q_BYTES, KV_BYTES, KV_BYTES]


@pytest.mark.parametrize("python", PYTHONS)
def test_memory_efficient_logsumexp_is_padded_to_32_queries(python):
    # grouped k/v heads on 2.14 (this build); 2.13 (the CPU build) has the efficient kernel take equal heads only
    heads = ["2", "8", "2"] if python == sys.executable else ["2", "8", "8"]
    result = trace_backend(python, "efficient", "--shape", *heads, "48", "32")
    q, kv = 2 * 8 * 48 * 32 * 2, 2 * int(heads[2]) * 48 * 32 * 2
    # logsumexp (B, H, ceil(48 / 32) * 32) fp32: 64 rows, not 48
    assert op_allocs(result, "_scaled_dot_product_efficient_attention") == [q, 2 * 8 * 64 * 4, 8, 8]
    assert op_allocs(result, "_scaled_dot_product_efficient_attention_backward") == [q, kv, kv]


def test_efficient_attention_takes_a_boolean_mask_as_an_additive_bias():
    result = trace_backend(sys.executable, "efficient", "--mask")
    assert result.op_counts["_scaled_dot_product_efficient_attention"] == 1
    # the (2, 1, 64, 64) bool mask becomes a bf16 bias of -inf where False (convert_boolean_attn_mask)
    assert 2 * 64 * 64 * 2 in op_allocs(result, "zeros_like")


def test_math_attention_repeats_keys_and_values_and_keeps_the_scores():
    result = trace_backend(sys.executable, "math")
    assert not [op for op in result.op_counts if op.startswith("_scaled_dot_product")]
    # computed in fp32: k and v repeated to 8 heads (2, 8, 64, 32) and the (2, 8, 64, 64) scores and softmax
    forward = [(e.op, e.nbytes) for e in result.events if e.action == "alloc" and e.iteration < 0]
    assert forward.count(("clone", 2 * 8 * 64 * 32 * 4)) == 2
    assert ("bmm", 2 * 8 * 64 * 64 * 4) in forward and ("_safe_softmax", 2 * 8 * 64 * 64 * 4) in forward


def test_unrestricted_gqa_call_on_hopper_takes_cudnn_and_is_arch_sensitive():
    result = trace_backend(sys.executable, "any")
    assert result.op_counts.get("_scaled_dot_product_cudnn_attention") == 1 and result.arch_sensitive


# ---- a Llama-style GQA job (benchmarks/jobs/llama_gqa.py, 2 layers): fused kernels, no B x H x T x T scores ------
def trace_llama_gqa(python, capability):
    job = SCRIPTS.parent.parent / "benchmarks" / "jobs" / "llama_gqa.py"
    command = ["python", str(job), "--layers", "2", "--batch-size", "1", "--seq", "256", "--steps", "2"]
    gpu = next(gpu for gpu in load_catalog(calibration_path=None).values() if gpu.capability == capability)
    return run_trace(command, python=python, iterations=1, gpu=gpu)


@pytest.mark.parametrize("python", PYTHONS)
def test_llama_gqa_on_hopper_runs_cudnn_attention_with_grouped_gradients(python):
    result = trace_llama_gqa(python, H100)
    q, kv = 32 * 256 * 64 * 2, 4 * 256 * 64 * 2  # (1, 32, 256, 64) and (1, 4, 256, 64) bf16
    assert op_allocs(result, "_scaled_dot_product_cudnn_attention") == [q, 32 * 256 * 4, 8, 8] * 2
    assert op_allocs(result, "_scaled_dot_product_cudnn_attention_backward") == [q, kv, kv] * 2
    assert not {"bmm", "_safe_softmax", "_softmax"} & set(result.op_counts)  # no scores anywhere
    assert result.arch_sensitive


def test_llama_gqa_on_ampere_runs_flash_attention():
    result = trace_llama_gqa(sys.executable, A100)
    assert result.op_counts.get("_scaled_dot_product_flash_attention") == 2
    assert "_scaled_dot_product_cudnn_attention" not in result.op_counts
