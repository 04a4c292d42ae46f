#!/usr/bin/env python
"""The trial behind docs/libraries.md: constructs batch scripts use, through bashlex (when installed) and through
xmem's own reader (xmem.jobscript.parse_jobscript). One line per construct: bashlex's outcome, then ours.

    python -m venv /tmp/bl && /tmp/bl/bin/pip install bashlex
    PYTHONPATH=/tmp/bl/lib/python3.11/site-packages .venv/bin/python scripts/weigh_bashlex.py
"""

from __future__ import annotations

from xmem.jobscript import parse_jobscript

CONSTRUCTS = {
    "for loop": "for lr in 1e-3 1e-4; do\n  python train.py --lr $lr\ndone\n",
    "case": 'case "$SLURM_ARRAY_TASK_ID" in\n 0) M=a;;\n 1) M=b;;\nesac\npython train.py --m $M\n',
    "arithmetic": "N=$((SLURM_GPUS_ON_NODE * 2))\ntorchrun --nproc_per_node=$N train.py\n",
    "here-document": "cat > cfg.yaml <<EOF\nlr: 1\nEOF\npython train.py cfg.yaml\n",
    "default value": "python train.py --bs ${BS:-32}\n",
    "[[ ]]": 'if [[ -n "$X" && $Y == 1 ]]; then python train.py; fi\n',
    "function": 'run() { python "$@"; }\nrun train.py --x 1\n',
    "array": 'ARGS=(--lr 1 --bs 2)\npython train.py "${ARGS[@]}"\n',
    "srun env": "srun --ntasks=1 env CUDA_LAUNCH_BLOCKING=1 python train.py\n",
    "continuation": "torchrun \\\n  --nproc_per_node 4 \\\n  train.py\n",
    "process substitution": "diff <(echo a) <(echo b)\npython train.py\n",
    "until loop": "until python train.py; do sleep 1; done\n",
}


def bashlex_outcome(text: str) -> str:
    try:
        import bashlex
    except ImportError:
        return "not installed"
    try:
        bashlex.parse(text)
    except Exception as error:  # noqa: BLE001 - what it raises is the finding
        return f"{type(error).__name__}"
    return "parsed"


def our_outcome(text: str) -> str:
    job = parse_jobscript("#!/bin/bash\n" + text, path="/tmp/job.sh", submit_cwd="/tmp", env={})
    if job.commands:
        return f"{len(job.commands)} command(s) named"
    return "run whole: " + (str(job.problems[0]).split(": ", 1)[-1][:60] if job.problems else "nothing named")


if __name__ == "__main__":
    for name, text in CONSTRUCTS.items():
        print(f"{name:22} bashlex: {bashlex_outcome(text):20} xmem: {our_outcome(text)}")
