"""Shared by the tracer's tests: the training scripts they trace and the two torch builds they trace them on."""

import os
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


def _cpu_build_python() -> pytest.param:
    python = os.environ.get("XMEM_TEST_CPU_PYTHON", "")
    reason = ("XMEM_TEST_CPU_PYTHON is unset (path of a Python with the CPU build of torch)" if not python else
              f"XMEM_TEST_CPU_PYTHON={python} is not an executable" if not os.access(python, os.X_OK) else "")
    return pytest.param(python, id="cpu-build", marks=pytest.mark.skipif(bool(reason), reason=reason))


PYTHONS = [pytest.param(sys.executable, id="this-build"), _cpu_build_python()]
