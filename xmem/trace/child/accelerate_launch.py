"""The environment `accelerate launch` gives the process it starts, computed by accelerate's own launcher code.

`accelerate launch` turns its flags and its config file (`--config_file`, or the user's default one) into
variables of the launched process (ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_ZERO_STAGE,
ACCELERATE_DEEPSPEED_ZERO3_INIT, ACCELERATE_USE_FSDP, FSDP_*, ACCELERATE_MIXED_PRECISION, ...), which the program's
Accelerator and transformers' `is_deepspeed_zero3_enabled()` read before `from_pretrained`. The tracer runs the
launched program itself as rank 0 (`xmem.launchers`), so the launcher's options are handed down in
`launchers.ACCELERATE_LAUNCH_ENV` and this module asks the job's accelerate what they mean: its
`launch_command_parser`, `_validate_launch_command` (the config file's defaults merged in) and the
`prepare_*_env` function its `launch_command` would pick. Only the variables it adds or changes are taken; the
rank, world, rendezvous, visible devices and thread count stay the tracer's (rank 0 of the world the launcher
makes). Import only in the tracing child, after the fake GPU is installed (the launcher counts the node's GPUs).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from xmem.launchers import ACCELERATE_LAUNCH_ENV

# What the tracer's launcher handling owns (launchers.launcher_env), never the launcher's own choice here
TRACER_OWNED = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PYTHONPATH", ACCELERATE_LAUNCH_ENV})


def apply_launcher_environment(environ: Any = os.environ) -> None:
    """Set in `environ` what `accelerate launch` with the handed-down options would set in its launched process;
    nothing when no options were handed down. Without accelerate in the job's environment the launcher could not
    have run: the variables the tracer read from its flags stay."""
    options = environ.pop(ACCELERATE_LAUNCH_ENV, None)
    if options is None:
        return
    try:
        launched = launcher_environment(json.loads(options))
    except ImportError:
        return
    environ.update({name: value for name, value in launched.items()
                    if name not in TRACER_OWNED and environ.get(name) != value})


def launcher_environment(options: list[str]) -> Mapping[str, str]:
    """The environment accelerate's launcher prepares for its processes, given its own options (the program and
    its arguments left out), as `accelerate.commands.launch.launch_command` chooses the launcher."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as prepare

    args = launch_command_parser().parse_args([*options, "xmem-launched-program.py"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed and not args.cpu:  # launch_command notes which fields the config file gave
        fields = list(defaults.deepspeed_config) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(
            fields + ["mixed_precision"] * bool(mixed_precision_from_config))
        return prepare.prepare_deepspeed_cmd_env(args)[1]
    if (args.use_fsdp or args.use_megatron_lm or args.multi_gpu) and not args.cpu:
        return prepare.prepare_multi_gpu_env(args)
    return prepare.prepare_simple_launcher_cmd_env(args)[1]
