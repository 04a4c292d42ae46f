"""The machine the traced program sees: GPUs per node, the launcher's rank variables, the GPU type estimated, and
an error (never a 0-byte answer) for a program that ends before it uses the GPU."""

import sys
import textwrap

import pytest

from xmem.estimate import estimate
from xmem.gpus import find_gpu, load_catalog
from xmem.jobscript import parse_jobscript, slurm_runtime_env
from xmem.trace import TraceError, run_trace
from xmem.launchers import Target, gpus_per_node, launcher_env
from xmem.trace.command import parse_command

# The FSDP2 example pattern: a script that needs two GPUs says so and leaves (exit 0) on a smaller machine.
FSDP2_EXAMPLE = """
    import os, sys
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    if torch.cuda.device_count() < 2 or torch.accelerator.device_count() < 2:
        print(f"this example needs 2 GPUs, found {torch.cuda.device_count()}")
        sys.exit(0)
    # what torchrun gives each rank
    assert os.environ["RANK"] == os.environ["LOCAL_RANK"] == "0", os.environ.get("RANK")
    assert os.environ["WORLD_SIZE"] == os.environ["LOCAL_WORLD_SIZE"] == "2"
    dist.init_process_group("nccl")
    assert dist.get_world_size() == 2 and dist.get_rank() == 0
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)).cuda()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(3):
        model(torch.randn(4, 512, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def target(*command, tmp_path):
    (tmp_path / "train.py").write_text("")
    return parse_command(list(command), cwd=str(tmp_path))


# ---- which machine: GPUs per node -----------------------------------------------------------------------------
def test_gpus_per_node_asked_for_wins_then_slurm_then_the_launcher(tmp_path):
    torchrun = target("torchrun", "--nproc_per_node", "4", "train.py", tmp_path=tmp_path)
    assert gpus_per_node(torchrun, {"SLURM_GPUS_ON_NODE": "8"}, requested=2) == 2
    assert gpus_per_node(torchrun, {"SLURM_GPUS_ON_NODE": "8"}) == 8
    assert gpus_per_node(torchrun, {}) == 4
    assert gpus_per_node(target("python", "train.py", tmp_path=tmp_path), {}) == 1


def test_cuda_visible_devices_counts_inside_a_slurm_job_only(tmp_path):
    plain = target("python", "train.py", tmp_path=tmp_path)
    assert gpus_per_node(plain, {"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1"}) == 2
    assert gpus_per_node(plain, {"CUDA_VISIBLE_DEVICES": "0,1,2"}) == 1  # a login node's setting


# ---- what the launcher puts in rank 0's environment ------------------------------------------------------------
def test_torchrun_on_two_nodes_gives_rank_zero_the_whole_world(tmp_path):
    torchrun = target("torchrun", "--nnodes=2", "--nproc-per-node=4", "train.py", tmp_path=tmp_path)
    env = launcher_env(torchrun, {"MASTER_PORT": "1234"}, gpus=4)
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"]) == ("0", "0", "0")
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == ("8", "4", "2")
    assert env["MASTER_PORT"] == "1234" and env["MASTER_ADDR"] == "127.0.0.1"  # the job's own settings stay
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and env["OMP_NUM_THREADS"] == "1"


def test_torchrun_one_process_per_gpu_follows_the_node(tmp_path):
    every_gpu = target("torchrun", "--nproc_per_node=gpu", "train.py", tmp_path=tmp_path)
    env = launcher_env(every_gpu, {}, gpus=gpus_per_node(every_gpu, {"SLURM_GPUS_ON_NODE": "2"}))
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("2", "2")


def test_accelerate_with_one_process_is_a_plain_python_run(tmp_path):
    one = target("accelerate", "launch", "--mixed_precision=bf16", "train.py", tmp_path=tmp_path)
    env = launcher_env(one, {}, gpus=1)
    assert "RANK" not in env and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    many = target("accelerate", "launch", "--multi_gpu", "train.py", tmp_path=tmp_path)
    assert launcher_env(many, {}, gpus=4)["WORLD_SIZE"] == "4"  # --multi_gpu without a count: every GPU
    assert launcher_env(Target("train.py", None, ()), {"RANK": "3"}, gpus=1)["RANK"] == "3"  # not ours to set


# ---- the batch script's side -----------------------------------------------------------------------------------
@pytest.mark.parametrize("directives, gpus", [("--gres=gpu:a100:4", 4), ("--gpus-per-task=2 --ntasks-per-node=2", 4),
                                              ("--gpus-per-node=2", 2)])
def test_a_job_sees_the_gpus_of_its_node(directives, gpus):
    job = parse_jobscript(f"#!/bin/bash\n#SBATCH {directives}\npython train.py\n", env={})
    env = slurm_runtime_env(job.directives, "/home/u")
    assert env["SLURM_GPUS_ON_NODE"] == str(gpus)
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, range(gpus)))


# ---- traced for real ---------------------------------------------------------------------------------------------
def parameter_bytes(trace):
    return sorted(e.nbytes for e in trace.events if e.action == "alloc" and e.category == "parameter")


def test_torchrun_two_processes_per_node_shards_fsdp_by_two(tmp_path):
    script = write(tmp_path, "fsdp2_example.py", FSDP2_EXAMPLE)
    result = run_trace(["torchrun", "--nproc_per_node", "2", str(script)], iterations=2, cwd=str(tmp_path))
    assert result.iterations == 2
    weight, bias = 512 * 512 * 4 // 2, 512 * 4 // 2  # rank 0 holds half of each parameter
    assert [n for n in parameter_bytes(result) if n in (weight, bias)] == sorted([weight, bias] * 2)


def test_program_that_leaves_before_using_the_gpu_is_an_error_with_its_last_lines(tmp_path):
    script = write(tmp_path, "fsdp2_example.py", FSDP2_EXAMPLE)
    with pytest.raises(TraceError) as caught:
        run_trace([sys.executable, str(script)], iterations=2, cwd=str(tmp_path))
    assert caught.value.kind == "no_cuda"
    assert "this example needs 2 GPUs, found 1" in caught.value.output


def test_estimate_shows_the_program_the_gpus_per_node_and_the_gpu_type(tmp_path):
    a100 = find_gpu("a100-80gb", load_catalog())
    script = write(tmp_path, "machine.py", f"""
        import torch
        assert torch.cuda.device_count() == torch.accelerator.device_count() == 4, torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        assert props.total_memory == {a100.total_bytes} and torch.cuda.get_device_name() == {a100.device_name!r}
        model = torch.nn.Linear(64, 64).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(8, 64, device="cuda")).sum().backward()
            optimizer.step()
    """)
    result = estimate([sys.executable, str(script)], gpus=[a100.name], iterations=2, cwd=str(tmp_path),
                      gpus_per_node=4)
    assert result.used_cuda and result.iterations == 2


def test_a_batch_script_torchrun_gives_the_estimated_rank_its_world():
    job = parse_jobscript("#!/bin/bash\n#SBATCH --nodes=2 --gres=gpu:4\n"
                          "torchrun --nnodes 2 --nproc_per_node gpu train.py\n", env={})
    [command] = job.commands
    assert command.argv == ("python", "train.py")
    assert (command.env["RANK"], command.env["WORLD_SIZE"], command.env["LOCAL_WORLD_SIZE"]) == ("0", "8", "4")
    accelerate = parse_jobscript("#!/bin/bash\n#SBATCH --gres=gpu:1\naccelerate launch train.py\n", env={})
    assert "RANK" not in accelerate.commands[0].env  # one process: a plain python run


def test_tasks_per_node_on_fixed_nodes_make_the_jobs_task_count():
    job = parse_jobscript("#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=4 --gres=gpu:4\nsrun python t.py\n", env={})
    env = slurm_runtime_env(job.directives, "/home/u")
    assert (env["SLURM_NTASKS"], env["SLURM_NTASKS_PER_NODE"], env["SLURM_GPUS_ON_NODE"]) == ("8", "4", "4")


def test_multi_node_counts_of_accelerate_and_deepspeed(tmp_path):
    accelerate = target("accelerate", "launch", "--num_machines", "2", "--num_processes", "16", "train.py",
                        tmp_path=tmp_path)  # accelerate counts the processes of all machines
    assert (accelerate.world_size(gpus_per_node=8), accelerate.local_world_size(gpus_per_node=8)) == (16, 8)
    deepspeed = target("deepspeed", "--num_nodes=2", "--num_gpus=4", "train.py", tmp_path=tmp_path)  # per node
    assert (deepspeed.world_size(gpus_per_node=4), deepspeed.local_world_size(gpus_per_node=4)) == (8, 4)
    job = parse_jobscript("#!/bin/bash\n#SBATCH --gres=gpu:8\n"
                          "accelerate launch --num_machines 2 --num_processes 16 train.py\n", env={})
    env = job.commands[0].env
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("16", "8")
