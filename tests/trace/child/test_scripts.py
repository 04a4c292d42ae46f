"""The tracer on small, real training scripts (tests/scripts/), on both torch builds: the recorded allocations are
the ones each script must make on a GPU, derived by hand from the models' shapes."""

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.torch_builds import PYTHONS, SCRIPTS
from xmem.gpus import load_catalog
from xmem.trace import run_trace
from xmem.trace.child.fakecuda import memory_size_warning
from xmem.trace.runner import DEFAULT_GPU

GPUS = load_catalog(calibration_path=None)
A100, H100, V100 = GPUS["A100-SXM4-80GB"], GPUS["H100-SXM5-80GB"], GPUS["V100-32GB"]

# About twenty traces of small scripts: through the warm tracer (tests/conftest.py), which skips torch's import in each
pytestmark = pytest.mark.usefixtures("warm_tracer")


def trace(python, script, *args, **options):
    return run_trace(["python", str(SCRIPTS / script), *args], python=python, **options)


def allocs(trace, category=None, phase=None):
    return [e for e in trace.events if e.action == "alloc" and category in (None, e.category)
            and phase in (None, e.phase)]


def sizes(events):
    return sorted(e.nbytes for e in events)


# ---- MLP + Adam -------------------------------------------------------------------------------------------------
# nn.Sequential(Linear(100, 300), ReLU(), Linear(300, 10)) in fp32
MLP_PARAM_BYTES = [100 * 300 * 4, 300 * 4, 300 * 10 * 4, 10 * 4]


@pytest.fixture(scope="module", params=PYTHONS)
def mlp(request):
    progress = []
    result = trace(request.param, "mlp_adam.py", "--steps", "10", iterations=3, on_progress=progress.append)
    return result, progress


def test_mlp_stops_after_the_requested_iterations(mlp):
    result, progress = mlp
    assert result.iterations == 3 and result.used_cuda
    assert {e.iteration for e in result.events} == {-1, 0, 1, 2}
    assert progress[-3:] == ["iteration 1/3", "iteration 2/3", "iteration 3/3"]


def test_mlp_parameters_are_the_first_allocations(mlp):
    first = mlp[0].events[:4]
    assert [e.nbytes for e in first] == MLP_PARAM_BYTES
    assert all(e.category == "parameter" and e.iteration == -1 and e.op == "_to_copy" for e in first)


def test_mlp_one_gradient_per_parameter_each_iteration(mlp):
    # zero_grad() sets grads to None, so each of the 3 iterations allocates them again
    assert sizes(allocs(mlp[0], "gradient")) == sorted(MLP_PARAM_BYTES * 3)
    assert {e.phase for e in allocs(mlp[0], "gradient")} == {"backward"}


def test_mlp_adam_keeps_two_moments_per_parameter(mlp):
    # exp_avg + exp_avg_sq, created once in the first step; `step` stays a CPU scalar (not fused/capturable)
    state = allocs(mlp[0], "optimizer_state")
    assert sizes(state) == sorted(MLP_PARAM_BYTES * 2)
    assert {(e.iteration, e.phase) for e in state} == {(0, "optimizer")}


def test_fused_adam_keeps_its_step_counters_on_the_gpu():
    result = trace(sys.executable, "mlp_adam.py", "--fused", iterations=2)
    assert result.op_counts.get("_fused_adam_") == 2
    # exp_avg + exp_avg_sq per parameter, plus one fp32 scalar `step` per parameter (fused/capturable only)
    assert sizes(allocs(result, "optimizer_state")) == sorted(MLP_PARAM_BYTES * 2 + [4] * 4)


def test_mlp_inputs_and_phases(mlp):
    # x: 64x100 fp32 and y: 64 int64, moved to the GPU each iteration
    assert sizes(allocs(mlp[0], "input")) == sorted([64 * 100 * 4, 64 * 8] * 3)
    assert allocs(mlp[0], phase="forward") and allocs(mlp[0], phase="backward")
    assert allocs(mlp[0], phase="optimizer")


def test_mlp_every_free_matches_an_earlier_alloc(mlp):
    live = {}
    for e in mlp[0].events:
        if e.action == "alloc":
            assert e.block not in live
            live[e.block] = e.nbytes
        elif e.action == "free":
            assert live.pop(e.block) == e.nbytes


def test_mlp_module_paths_name_the_layers(mlp):
    forward = {e.module for e in allocs(mlp[0], phase="forward")}
    assert {"Sequential.0", "Sequential.1", "Sequential.2"} <= forward


def test_mlp_uses_foreach_adam_and_cublas(mlp):
    result = mlp[0]
    assert result.op_counts.get("_foreach_sqrt", 0) == 3  # the GPU default: foreach, not the for-loop
    assert result.libraries == ["cublas"]
    assert not result.arch_sensitive


def test_mlp_item_gets_a_stand_in_and_one_warning(mlp):
    assert mlp[0].warnings == ["tensor.item()/float()/bool() returned a stand-in value (no real data under fake CUDA)"]


# ---- CNN + BatchNorm + SGD(momentum) ---------------------------------------------------------------------------
CNN_PARAM_ELEMENTS = [16 * 3 * 3 * 3, 16, 16, 16, 32 * 16 * 3 * 3, 32, 32, 32, 10 * 32, 10]
CNN_BUFFER_BYTES = [16 * 4, 16 * 4, 8, 32 * 4, 32 * 4, 8]  # running_mean/var (fp32), num_batches_tracked (int64)


@pytest.fixture(scope="module", params=PYTHONS)
def cnn(request):
    return trace(request.param, "cnn_bn_sgd.py", iterations=2)


def test_cnn_parameters_and_buffers(cnn):
    assert sizes(allocs(cnn, "parameter")) == sorted(4 * n for n in CNN_PARAM_ELEMENTS)
    assert sizes(allocs(cnn, "buffer")) == sorted(CNN_BUFFER_BYTES)


def test_cnn_sgd_momentum_buffer_per_parameter(cnn):
    state = allocs(cnn, "optimizer_state")
    assert sizes(state) == sorted(4 * n for n in CNN_PARAM_ELEMENTS)
    assert {e.iteration for e in state} == {0}


def test_cnn_runs_convolutions_and_batch_norm_through_cudnn(cnn):
    assert cnn.op_counts["convolution"] == 4 and cnn.op_counts["convolution_backward"] == 4
    assert "cudnn" in cnn.libraries and "cublas" in cnn.libraries
    # the CUDA build picks cudnn_batch_norm as on a GPU; the CPU build's stub hooks say "no cuDNN"
    assert cnn.op_counts.get("cudnn_batch_norm", 0) + cnn.op_counts.get("native_batch_norm", 0) == 4


# ---- transformer with F.scaled_dot_product_attention ----------------------------------------------------------
def attention_ops(result):
    return {name: n for name, n in result.op_counts.items() if "attention" in name}


@pytest.mark.parametrize("python", PYTHONS)
def test_sdpa_fp16_on_ampere_uses_flash(python):
    result = trace(python, "transformer_sdpa.py", "--dtype", "fp16", iterations=1, gpu=A100)
    assert attention_ops(result) == {"_scaled_dot_product_flash_attention": 2,
                                     "_scaled_dot_product_flash_attention_backward": 2}
    assert result.arch_sensitive  # a V100 (efficient) or an H100 (cuDNN attention first) would choose differently


@pytest.fixture(scope="module")
def sdpa_fp32():
    """The fp32 transformer on an H100 (the default GPU), this build only: keeps the suite short."""
    return trace(sys.executable, "transformer_sdpa.py", iterations=1, gpu=H100)


def test_sdpa_fp32_uses_memory_efficient_everywhere(sdpa_fp32):
    assert attention_ops(sdpa_fp32) == {"_scaled_dot_product_efficient_attention": 2,
                                        "_scaled_dot_product_efficient_attention_backward": 2}
    assert not sdpa_fp32.arch_sensitive


def test_sdpa_fp16_on_volta_uses_memory_efficient():
    result = trace(sys.executable, "transformer_sdpa.py", "--dtype", "fp16", iterations=1, gpu=V100)
    assert attention_ops(result) == {"_scaled_dot_product_efficient_attention": 2,
                                     "_scaled_dot_product_efficient_attention_backward": 2}
    assert result.arch_sensitive


def test_sdpa_bf16_on_volta_falls_back_to_math():
    result = trace(sys.executable, "transformer_sdpa.py", "--dtype", "bf16", iterations=1, gpu=V100)
    assert attention_ops(result) == {}
    assert result.op_counts["bmm"] >= 4 and result.op_counts["_safe_softmax"] == 2


def test_tied_weights_stay_one_parameter(sdpa_fp32):
    # embedding (tied to the head) + 2 blocks x (2 LayerNorms x 2 + 4 Linears x 2) = 1 + 2 * 12
    assert len(allocs(sdpa_fp32, "parameter")) == 25
    assert len(allocs(sdpa_fp32, "gradient")) == 25


# ---- AMP, accumulation, two optimizers ---------------------------------------------------------------------------
@pytest.mark.parametrize("python", PYTHONS)
def test_amp_gradscaler_fp16(python):
    result = trace(python, "amp_gradscaler.py", iterations=3)
    assert result.iterations == 3
    forward_linear = [e.nbytes for e in allocs(result, phase="forward") if e.op == "addmm"]
    assert 32 * 512 * 2 in forward_linear  # autocast: the first Linear's output is fp16
    assert 256 * 512 * 2 in [e.nbytes for e in allocs(result, phase="forward") if e.op == "_to_copy"]  # fp16 weight
    assert sizes(allocs(result, "parameter")) == sorted([256 * 512 * 4, 512 * 4, 512 * 256 * 4, 256 * 4])
    assert "GradScaler assumed finite gradients (no real data under fake CUDA)" in result.warnings


def test_gradient_accumulation_counts_one_iteration_per_step(python=sys.executable):  # this build only: keeps the suite short
    result = trace(python, "grad_accumulation.py", iterations=3)
    assert result.iterations == 3
    seeds = [e for e in allocs(result, phase="backward") if e.op == "ones_like"]
    assert len(seeds) == 6  # two backward passes per iteration
    assert sizes(allocs(result, "gradient")) == sorted([64 * 64 * 4, 64 * 4] * 3)


def test_two_optimizers_step_once_per_iteration(python=sys.executable):  # this build only: keeps the suite short
    result = trace(python, "gan_two_optimizers.py", iterations=3)
    assert result.iterations == 3
    generator, discriminator = [16 * 64, 64, 64 * 32, 32], [32 * 64, 64, 64, 1]
    assert sizes(allocs(result, "optimizer_state")) == sorted(4 * n for n in (generator + discriminator) * 2)
    steps_per_iteration = Counter(e.iteration for e in allocs(result, phase="backward") if e.op == "ones_like")
    assert steps_per_iteration == {0: 2, 1: 2, 2: 2}


# ---- the torch.cuda API around a training loop ------------------------------------------------------------------
@pytest.mark.parametrize("python", PYTHONS)
def test_cuda_api_script_runs_with_stand_ins(python):
    result = trace(python, "cuda_api.py", iterations=3)
    assert result.iterations == 3
    assert result.arch_sensitive  # it asked for the device's properties and bf16 support
    assert result.op_counts.get("_fused_adamw_") == 3
    assert any(e.stream == 1 for e in result.events)  # the side stream's allocation
    assert [e.iteration for e in result.events if e.action == "empty_cache"] == [-1]
    assert sorted(result.warnings) == sorted([
        "nonzero()/boolean-mask selections assumed every element selected (no real data under fake CUDA)",
        "tensor.item()/float()/bool() returned a stand-in value (no real data under fake CUDA)",
        "tensor.tolist() returned ones (no real data under fake CUDA)",  # scores.tolist()
        memory_size_warning(GPUS[DEFAULT_GPU].total_bytes)])  # it sized its batch by props.total_memory
    # scores[scores > 0] with every element assumed selected: 128 fp32 values
    assert 128 * 4 in [e.nbytes for e in allocs(result) if e.op == "index"]
    # an H100 (80 GB) by default: the script picks a batch of 8 (8 x 32 fp32 inputs)
    assert 8 * 32 * 4 in [e.nbytes for e in allocs(result, "input")]


def test_device_properties_are_the_catalog_types():
    h200 = GPUS["H200-141GB"]
    result = trace(sys.executable, "cuda_api.py", iterations=1, gpu=h200)
    assert 16 * 32 * 4 in [e.nbytes for e in allocs(result, "input")]  # batch 16 on a 141 GB GPU
    assert memory_size_warning(h200.total_bytes) in result.warnings


def test_reading_free_memory_is_said_once_with_the_size_traced(tmp_path):
    """A program that fills what mem_get_info or NVML says is free allocates by the GPU it gets: the trace says
    so (once), and a program that reads only the name and capability is not warned."""
    script = tmp_path / "fill_free.py"
    script.write_text(
        "import pynvml, torch\n"
        "pynvml.nvmlInit()\n"
        "nvml_free = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free\n"
        "model = torch.nn.Linear(64, 64).cuda()\n"
        "optimizer = torch.optim.SGD(model.parameters())\n"
        "for _ in range(2):\n"
        "    free, total = torch.cuda.mem_get_info()\n"
        "    assert free <= nvml_free <= total\n"
        "    cache = torch.empty(int(free * 0.01), dtype=torch.uint8, device='cuda')\n"
        "    model(torch.randn(8, 64, device='cuda')).sum().backward()\n"
        "    optimizer.step()\n")
    a100 = GPUS["A100-SXM4-40GB"]
    result = run_trace(["python", str(script)], python=sys.executable, iterations=2, gpu=a100)
    assert result.warnings.count(memory_size_warning(a100.total_bytes)) == 1
    plain = tmp_path / "names_only.py"
    plain.write_text(
        "import torch\n"
        "print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())\n"
        "model = torch.nn.Linear(64, 64).cuda()\n"
        "optimizer = torch.optim.SGD(model.parameters())\n"
        "for _ in range(2):\n"
        "    model(torch.randn(8, 64, device='cuda')).sum().backward()\n"
        "    optimizer.step()\n")
    assert not any("memory size" in w for w in run_trace(["python", str(plain)], python=sys.executable,
                                                         iterations=2).warnings)


# ---- transformers, activation checkpointing, the program's own SDPA restriction ----------------------------------
@pytest.mark.parametrize("python", PYTHONS)
def test_checkpoint_recomputation_takes_the_same_attention_backend(python):
    # recomputation runs on the autograd thread: it must pick the same fused kernel as the forward did,
    # else torch.utils.checkpoint raises (a different number of saved tensors)
    result = trace(python, "tiny_llama_checkpointing.py", iterations=2)
    assert result.iterations == 2
    fused = {name: n for name, n in attention_ops(result).items() if "_scaled_dot_product_" in name}
    forward = sum(n for name, n in fused.items() if not name.endswith("backward"))
    backward = sum(n for name, n in fused.items() if name.endswith("backward"))
    assert backward == 2 * 2 and forward == 2 * backward  # 2 layers x 2 iterations; forward + recompute


def test_program_restricting_attention_to_math_is_obeyed():
    result = trace(sys.executable, "sdpa_math_only.py", iterations=2)
    assert attention_ops(result) == {}


# ---- torchrun + DistributedDataParallel ---------------------------------------------------------------------------
@pytest.mark.parametrize("python", PYTHONS)
def test_torchrun_ddp_traces_rank_zero_with_gradient_buckets(python):
    command = ["torchrun", "--nproc_per_node=2", str(SCRIPTS / "ddp_train.py")]
    result = run_trace(command, iterations=3, python=python)
    assert result.iterations == 3
    assert "nccl" in result.libraries
    params = [128 * 256 * 4, 256 * 4, 256 * 128 * 4, 128 * 4]
    assert sizes(allocs(result, "parameter")) == sorted(params)
    # one Reducer bucket (all 263,680 bytes fit under the 1 MiB first-bucket cap), allocated at wrap time
    buckets = [e for e in allocs(result, "gradient") if e.iteration == -1]
    assert [e.nbytes for e in buckets] == [sum(params)]
    assert not any("torch.compile" in w for w in result.warnings)  # compiled, and followed (trace/child/compiled.py)


# ---- loading saved weights -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    code = ("import sys, torch; from transformers import LlamaConfig, LlamaForCausalLM\n"
            "config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,"
            " intermediate_size=128, vocab_size=100)\n"
            "LlamaForCausalLM(config).save_pretrained(sys.argv[1])\n"
            "torch.save({'bias': torch.zeros(1000)}, sys.argv[1] + '/extra.pt')\n")
    subprocess.run([sys.executable, "-c", code, str(directory)], check=True, capture_output=True)
    return directory


@pytest.mark.parametrize("python", PYTHONS)
def test_optimizer_built_before_the_move_trains_the_moved_model(python, saved_tiny_model):
    result = trace(python, "finetune_pretrained.py", str(saved_tiny_model), iterations=2)
    parameters = allocs(result, "parameter")
    # AdamW's two moments exist for every moved parameter, and gradients are freed by zero_grad each iteration
    assert sizes(allocs(result, "optimizer_state")) == sorted(e.nbytes for e in parameters * 2)
    assert sizes(allocs(result, "gradient")) == sorted(e.nbytes for e in parameters * 2)
    loaded = [e for e in result.events if e.op == "torch.load"]
    assert [(e.nbytes, e.category, e.iteration) for e in loaded] == [(4000, "input", -1)]


def test_mp_spawn_runs_rank_zero_in_process():
    result = trace(sys.executable, "mp_spawn_ddp.py", iterations=3)
    assert result.iterations == 3 and "nccl" in result.libraries
    # gradient_as_bucket_view: the buckets are the gradients, nothing extra at wrap time
    assert sizes(allocs(result, "gradient")) == sorted([64 * 64 * 4, 64 * 4] * 3)


def test_habits_of_real_scripts_get_stand_ins_and_write_no_checkpoint(tmp_path):
    checkpoint = tmp_path / "checkpoint.pt"
    result = trace(sys.executable, "habits.py", str(checkpoint), iterations=3)
    assert result.iterations == 3
    assert not checkpoint.exists()  # saved for real, into the sandbox
    assert {"unique() assumed every value distinct (no real data under fake CUDA)",
            "tensor.numpy() returned ones (no real data under fake CUDA)"} <= set(result.warnings)
    # torch.unique(y) of 16 int64 labels drawn by randint(0, 5): every value of that range assumed present
    assert [e.nbytes for e in allocs(result) if e.op == "_unique2"][:1] == [5 * 8]
    # SGD momentum for the model only: the EMA copy is not optimized
    assert sizes(allocs(result, "optimizer_state")) == sorted([20 * 64 * 4, 64 * 4, 64 * 5 * 4, 5 * 4])


def test_data_parallel_replicates_onto_the_second_gpu():
    result = trace(sys.executable, "data_parallel.py", iterations=2, device_count=2)
    assert result.iterations == 2
    on_gpu1 = [e for e in allocs(result) if e.device == 1 and e.iteration == 0]
    # each iteration: the replica's weight and bias, and half of the batch of 8 (4 x 32 fp32)
    assert {32 * 32 * 4, 32 * 4, 4 * 32 * 4} <= {e.nbytes for e in on_gpu1}
    assert all(e.device == 0 for e in allocs(result, "parameter") + allocs(result, "gradient"))


@pytest.mark.parametrize("python", PYTHONS)
def test_fsdp2_shards_parameters_gradients_and_optimizer_state(python):
    result = run_trace(["torchrun", "--nproc_per_node=4", str(SCRIPTS / "fsdp2_train.py")], iterations=2,
                       python=python)
    assert result.iterations == 2 and "nccl" in result.libraries
    weight_shard, bias_shard = 256 * 256 * 4 // 4, 256 * 4 // 4  # rank 0 keeps a quarter of each parameter
    assert sizes(allocs(result, "optimizer_state")) == sorted([weight_shard, bias_shard] * 4 * 2)
    shards = [e.nbytes for e in allocs(result, "parameter") if e.nbytes in (weight_shard, bias_shard)]
    assert sorted(shards) == sorted([weight_shard, bias_shard] * 4)
    # all-gathered for forward: weight + bias of one layer at a time, in one flat buffer
    gathered = [e for e in allocs(result, phase="forward") if e.nbytes == 256 * 256 * 4 + 256 * 4]
    assert len(gathered) == 4 * 2  # 4 layers x 2 iterations


def test_frozen_weights_made_on_the_gpu_are_parameters():
    result = trace(sys.executable, "frozen_on_gpu.py", iterations=2)
    backbone = [128 * 128 * 4, 128 * 4, 128 * 4, 128 * 4, 128 * 128 * 4, 128 * 4]  # Linear, LayerNorm, Linear
    head = [2 * 128 * 4, 2 * 4]
    assert sizes(allocs(result, "parameter")) == sorted(backbone + head)
    assert sizes(allocs(result, "optimizer_state")) == sorted(head * 2)


def test_meta_device_model_materialised_on_the_gpu():
    result = trace(sys.executable, "meta_init.py", iterations=2)
    params = [64 * 64 * 4, 64 * 4, 64 * 4, 64 * 4, 8 * 64 * 4, 8 * 4]
    assert sizes(allocs(result, "parameter")) == sorted(params)
    assert all(e.op == "empty_like" and e.iteration == -1 for e in allocs(result, "parameter"))


def test_fsdp1_keeps_a_quarter_of_the_flat_parameter():
    result = run_trace(["torchrun", "--nproc_per_node=4", str(SCRIPTS / "fsdp1_train.py")], iterations=2)
    assert result.iterations == 2
    layer = 256 * 256 * 4 + 256 * 4
    # the flat parameter of 4 layers, sharded 4 ways: rank 0 holds exactly the first layer
    assert layer in [e.nbytes for e in allocs(result, "parameter")]
    assert sizes(allocs(result, "optimizer_state")) == sorted([256 * 256 * 4, 256 * 4] * 2)


def test_the_allocator_setting_is_the_one_in_force_at_the_first_allocation(tmp_path):
    loop = ("p = torch.nn.Parameter(torch.ones(4, device='cuda'))\nopt = torch.optim.SGD([p], lr=0.1)\n"
            "for _ in range(2):\n    p.sum().backward(); opt.step()\n")
    sets_it = tmp_path / "sets_conf.py"  # the script sets it itself, before it allocates
    sets_it.write_text("import os, torch\nos.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'\n" + loop)
    assert run_trace([sys.executable, str(sets_it)], iterations=1).alloc_conf == "expandable_segments:True"
    plain = tmp_path / "plain.py"  # PYTORCH_CUDA_ALLOC_CONF wins even when empty, as in torch
    plain.write_text("import torch\n" + loop)
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}
    assert run_trace([sys.executable, str(plain)], iterations=1, env=env).alloc_conf == ""


# ---- what only the cyclic collector frees -------------------------------------------------------------------
def test_tensors_in_reference_cycles_are_freed_by_the_collector_during_the_trace():
    # the tracer loads torch with the collector off and freezes what it loaded; the program's objects are collected
    result = trace(sys.executable, "cyclic_garbage.py", iterations=3)
    freed = [e for e in result.events if e.action == "free" and e.nbytes == 123_457]
    assert len(allocs(result)) and freed, "cyclic garbage was never collected"


# ---- the interpreter the command names -------------------------------------------------------------------------
def test_a_command_naming_its_interpreter_by_path_runs_on_it(tmp_path):
    import sysconfig
    venv = tmp_path / "env"  # a venv that sees this one's libraries (a .pth), as a user's venv would have its own
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    (Path(own) / "parent.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    result = run_trace([python, str(SCRIPTS / "which_python.py"), python], iterations=1)
    assert result.iterations == 1
