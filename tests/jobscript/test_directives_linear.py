"""B1: directive parsing is linear in the line's length, so one huge `#SBATCH` line cannot block sbatch.

The 2 s bound is a complexity bound, not a benchmark: the quadratic parser took 330 s on a 1 MB line (150 KB: 32 s);
a linear one takes well under a second.
"""

import time

import pytest

from xmem.jobscript import parse_jobscript
from xmem.jobscript.directives import directive_arguments

MB = 1 << 20
BOUND_S = 2.0


def timed(fn, *args, **kw):
    started = time.perf_counter()
    result = fn(*args, **kw)
    return result, time.perf_counter() - started


@pytest.mark.parametrize("value", ["x" * MB, '"' + "a b\\c " * (MB // 6) + '"', "\\y" * (MB // 2)],
                         ids=["plain", "quoted-with-escapes", "all-escapes"])
def test_one_megabyte_argument_splits_in_linear_time(value):
    args, seconds = timed(directive_arguments, f" --export={value} --gres=gpu:1")
    assert seconds < BOUND_S, f"{seconds:.1f} s for a 1 MB directive"
    assert args[-1] == "--gres=gpu:1" and len(args) == 2 and len(args[0]) > MB // 2


def test_one_megabyte_sbatch_line_parses_whole_script_in_linear_time():
    text = f"#!/bin/bash\n#SBATCH --comment={'c' * MB}\n#SBATCH --gres=gpu:a100:1\npython train.py\n"
    job, seconds = timed(parse_jobscript, text, env={})
    assert seconds < BOUND_S, f"{seconds:.1f} s for a script with a 1 MB #SBATCH line"
    assert job.directives.explicit_type == "a100"
