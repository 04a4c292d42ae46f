"""The root of a traced job whose command is not a Python program: `python -m xmem.trace.child.launch --out FILE
[options] -- COMMAND...`, for a shell wrapper (`bash train.sh`, `./run.sh`) or a command that starts another (`env
VAR=1 torchrun ...`, `time python ...`), as the batch script runs them.

It runs the command as the job would (its output the job's own) with the tracer's settings handed down
(`xmem.trace.child.follow.hand_down`), so that every Python process the command starts, however deep, is traced
as a directly given program is: the first to reach its iterations ends the job's trace; what the others left is
chosen from when the command ends (`follow.finish`). This process imports no torch and traces nothing itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import xmem.trace.child.follow as follow
from xmem.trace.wire import TraceRequest

ENDED_MESSAGE = ("{command} ended with status {status} before any Python process it started trained on the GPU; "
                 "its last output lines say why")


def main(argv: list[str] | None = None) -> NoReturn:
    request = TraceRequest.from_argv(sys.argv[1:] if argv is None else argv)
    follow.hand_down(request)
    command, out = list(request.command), Path(request.out)
    try:
        status = subprocess.run(command, stdin=subprocess.DEVNULL).returncode
        follow.finish(out, _own_result(command, status))
    except OSError as error:  # the command could not start: as its shell would say
        follow.finish(out, {"error": "not_found", "message": f"{command[0]}: {error.strerror}", "traceback": ""})
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _own_result(command: list[str], status: int) -> dict:
    """What this root says when no process of the command left a trace: the command failed (the job would fail
    the same way on the node), or it ended without using the GPU (an empty trace: the runner says no_cuda)."""
    if status != 0:
        shown = " ".join(command)
        return {"error": "user_error", "message": ENDED_MESSAGE.format(command=shown, status=status),
                "traceback": ""}
    from xmem.trace.events import Trace
    return Trace().to_json()


if __name__ == "__main__":
    main()
