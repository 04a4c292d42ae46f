#!/usr/bin/env python
"""Run a benchmark job (benchmarks/jobs/*.py with a `build_model` and a `main`) with its model compiled, as a user
who adds `model.compile()` after building the model would: every forward of the model is torch.compile'd (Inductor,
the default backend); everything else is the job's own code, unchanged.

    python scripts/compiled_job.py benchmarks/jobs/transformer.py --model EleutherAI/gpt-neo-125M --optimizer Adam \
        --batch-size 8
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable


def compiled_builder(build_model: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(build_model)
    def build_and_compile(*args: Any, **kwargs: Any) -> Any:
        model = build_model(*args, **kwargs)
        model.compile()
        return model
    return build_and_compile


def main(argv: list[str]) -> None:
    if not argv or not argv[0].endswith(".py"):
        raise SystemExit("usage: compiled_job.py JOB.py [JOB ARGUMENTS...]")
    job = Path(argv[0]).resolve()
    spec = importlib.util.spec_from_file_location(job.stem, job)
    module = importlib.util.module_from_spec(spec)
    sys.argv = [str(job), *argv[1:]]
    sys.path.insert(0, str(job.parent))
    spec.loader.exec_module(module)
    if not callable(getattr(module, "build_model", None)) or not callable(getattr(module, "main", None)):
        raise SystemExit(f"compiled_job.py: {job.name} has no build_model and main to compile its model through")
    module.build_model = compiled_builder(module.build_model)
    module.main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
