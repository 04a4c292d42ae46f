"""`accelerate launch`'s flags reach the traced program as accelerate's own launcher hands them to the process it
starts (xmem.trace.child.accelerate_launch): the tracer runs that process itself, so its variables are made from
the launcher's options by the job's accelerate. Without them, `--use_deepspeed --zero_stage 3 --zero3_init_flag
true` was lost: transformers' is_deepspeed_zero3_enabled() said no, from_pretrained built the whole model on the
GPU, and a 7B ZeRO-3 offload job 'did not fit' an 80 GB GPU (exit 14)."""

import json

from tests.torch_builds import SCRIPTS
from xmem.launchers import ACCELERATE_LAUNCH_ENV, parse_launch
from xmem.trace import run_trace
from xmem.trace.child.accelerate_launch import apply_launcher_environment

ZERO3_OFFLOAD = ["--num_processes", "2", "--use_deepspeed", "--zero_stage", "3", "--offload_optimizer_device", "cpu",
                 "--offload_param_device", "cpu", "--zero3_init_flag", "true", "--mixed_precision", "bf16"]


def test_the_launchers_options_are_handed_to_the_traced_program():
    target = parse_launch(["accelerate", "launch", *ZERO3_OFFLOAD, "-m", "trl.scripts.sft", "--bf16", "true"])
    settings = dict(target.settings)
    assert (target.module, target.args) == ("trl.scripts.sft", ("--bf16", "true"))
    assert json.loads(settings[ACCELERATE_LAUNCH_ENV]) == ZERO3_OFFLOAD
    assert settings["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert ACCELERATE_LAUNCH_ENV not in dict(parse_launch(["deepspeed", "--num_gpus", "2", "train.py"]).settings)


def test_zero3_flags_become_accelerates_deepspeed_variables():
    environ = {ACCELERATE_LAUNCH_ENV: json.dumps(ZERO3_OFFLOAD), "RANK": "0", "WORLD_SIZE": "2"}
    apply_launcher_environment(environ)
    assert {name: environ.get(name) for name in (
        "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_DEEPSPEED_ZERO3_INIT",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
        "ACCELERATE_MIXED_PRECISION")} == {
        "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_MIXED_PRECISION": "bf16"}
    assert ACCELERATE_LAUNCH_ENV not in environ  # read once, by the traced process only


def test_fsdp_flags_become_accelerates_fsdp_variables_and_the_rank_stays_the_tracers():
    options = ["--num_processes", "8", "--use_fsdp", "--fsdp_version", "2", "--mixed_precision", "bf16"]
    environ = {ACCELERATE_LAUNCH_ENV: json.dumps(options), "RANK": "0", "WORLD_SIZE": "8", "OMP_NUM_THREADS": "4"}
    apply_launcher_environment(environ)
    assert (environ["ACCELERATE_USE_FSDP"], environ["FSDP_VERSION"]) == ("true", "2")
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["OMP_NUM_THREADS"]) == ("0", "8", "4")


def test_nothing_handed_down_changes_nothing():
    environ = {"RANK": "0"}
    apply_launcher_environment(environ)
    assert environ == {"RANK": "0"}


def test_a_program_launched_with_zero3_flags_is_partitioned_by_zero3():
    # tests/scripts/accelerate_zero.py's MLP (Linear(256, 512), Linear(512, 16)) with the Accelerator its launcher's
    # flags make: ZeRO-3 over 2 keeps exp_avg and exp_avg_sq of rank 0's fp32 partition, NUMEL / 2 elements each
    # (as test_deepspeed_ops pins for the plugin made in code); without the flags it would be DDP, whole moments
    numel = 256 * 512 + 512 + 512 * 16 + 16
    trace = run_trace(["accelerate", "launch", "--num_processes", "2", "--use_deepspeed", "--zero_stage", "3",
                       "--gradient_accumulation_steps", "1", "--mixed_precision", "bf16",
                       str(SCRIPTS / "accelerate_zero.py"), "--from-launcher"], iterations=2)
    state = sorted(e.nbytes for e in trace.events if e.action == "alloc" and e.category == "optimizer_state")
    assert state == [numel // 2 * 4] * 2
