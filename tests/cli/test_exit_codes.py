"""One exit-code table (issue 32 item 3): `xmem/cli/exit_codes.py` is the table; README.md holds the same one,
`xmem-slurm --help` prints it, every error kind of the tracer has its row, and the two failures that used to end as
"internal error" with exit 1 (--plot without matplotlib, after the whole trace; a job interpreter without torch)
have documented codes."""

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import typer

from xmem.cli.common import fail_on_error
from xmem.cli.exit_codes import EXIT_CODES, KIND_EXIT_CODES, code_of, markdown_table
from xmem.trace import TraceError
from xmem.trace.errors import KINDS
from xmem.trace.runner import fake_gpu
from xmem.trace.wire import TraceRequest

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[2]
README_START = "<!-- exit codes: xmem/cli/exit_codes.py, markdown_table() -->\n"
README_END = "<!-- end of exit codes -->\n"
SLOW_PROGRAM = """
    import time
    time.sleep(120)  # never reached: the option is refused before the trace
"""


def words(text: str) -> str:
    return " ".join(text.split())


def test_readme_holds_the_table_of_the_code():
    readme = (REPO / "README.md").read_text()
    assert readme.count(README_START) == 1 and readme.count(README_END) == 1
    shown = readme[readme.index(README_START) + len(README_START):readme.index(README_END)]
    assert shown == markdown_table(), "README.md's exit-code table differs from xmem/cli/exit_codes.py's"


def test_the_table_is_one_row_per_code_and_one_code_per_kind():
    codes = [row.code for row in EXIT_CODES]
    assert codes == sorted(set(codes)) and codes[0] == 0
    kinds = [kind for row in EXIT_CODES for kind in row.kinds]
    assert len(kinds) == len(set(kinds))
    assert all(row.meaning and "|" not in row.meaning for row in EXIT_CODES)  # a markdown cell each


@pytest.mark.parametrize("kind", KINDS)
def test_every_error_of_the_tracer_exits_with_its_documented_code(kind):
    assert kind in KIND_EXIT_CODES, f"the tracer's error kind {kind!r} is missing from the exit-code table"
    with pytest.raises(typer.Exit) as exited:
        fail_on_error(False, TraceError(kind, "what went wrong"))
    assert exited.value.exit_code == code_of(kind)
    assert kind == "internal" or exited.value.exit_code != 1  # 1 is only xmem-slurm's own bug


def test_help_prints_the_table():
    run = subprocess.run([PYTHON, "-m", "xmem.cli", "--help"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "100"})
    assert run.returncode == 0, run.stderr
    shown = words(run.stdout)
    assert "Exit codes" in shown
    for row in EXIT_CODES:
        assert f" {row.code} {words(row.meaning)}" in shown, f"--help lacks exit {row.code}"


def test_exit_codes_named_elsewhere_agree():
    """`"kind" (exit N)` in the example site config and README says the table's code (it once said 9 for 10)."""
    named = []
    for path in (REPO / "etc" / "xmem.toml", REPO / "README.md"):
        named += [(path.name, kind, int(code))
                  for kind, code in re.findall(r'"(\w+)" \(exit (\d+)\)', path.read_text())]
    assert ("xmem.toml", "memory_limit", code_of("memory_limit")) in named
    assert all(code == code_of(kind) for _, kind, code in named), named


def without_matplotlib(tmp_path: Path) -> dict:
    """An environment whose Python cannot import matplotlib (a plain install: it is the `bench` extra's)."""
    hide = tmp_path / "hide"
    (hide / "matplotlib").mkdir(parents=True)
    (hide / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("verb", ["estimate", "check"])
def test_plot_without_matplotlib_fails_before_the_trace(tmp_path, verb):
    (tmp_path / "prog.py").write_text(textwrap.dedent(SLOW_PROGRAM))
    command = [PYTHON, "prog.py"]
    args = ["--gpu", "a100", "--", *command] if verb == "estimate" else ["--wrap", " ".join(command)]
    started = time.monotonic()
    run = subprocess.run([PYTHON, "-m", "xmem.cli", verb, "--json", "--plot", str(tmp_path / "m.png"), *args],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, env=without_matplotlib(tmp_path))
    assert run.returncode == 2, run.stderr
    assert time.monotonic() - started < 30  # the 120 s program never ran
    error = json.loads(run.stdout)
    assert error["error"] == "bad_option" and error["exit_code"] == 2
    assert "--plot needs matplotlib" in error["message"] and "pip install matplotlib" in error["message"]
    assert run.stderr.splitlines()[-1].startswith(f"xmem-slurm {verb}: --plot needs matplotlib")
    assert not (tmp_path / "m.png").exists()


def python_without_torch() -> str | None:
    """An interpreter here that cannot import torch (the one this venv was made from, usually)."""
    for candidate in (getattr(sys, "_base_executable", ""), "/usr/bin/python3"):
        if candidate and os.path.exists(candidate) and subprocess.run(
                [candidate, "-c", "import torch"], capture_output=True, timeout=60).returncode != 0:
            return candidate
    return None


def test_a_job_interpreter_without_torch_is_the_jobs_error_not_ours(tmp_path):
    """Where the runner's own look-up misses it, the traced process itself says so: user_error (exit 5), not the
    internal error (exit 1) of a shim that cannot find torch."""
    bare = python_without_torch()
    if bare is None:
        pytest.skip("every interpreter here has torch")
    (tmp_path / "prog.py").write_text("import torch\n")
    out = tmp_path / "out.json"
    request = TraceRequest(("prog.py",), str(out), fake_gpu())
    run = subprocess.run([bare, "-m", "xmem.trace", *request.argv()], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr
    error = json.loads(out.read_text())
    assert error["error"] == "user_error" and code_of(error["error"]) == 5
    assert "cannot import torch" in error["message"] and bare in error["message"]


def test_estimate_with_an_interpreter_without_torch_exits_with_the_documented_code(tmp_path):
    bare = python_without_torch()
    if bare is None:
        pytest.skip("every interpreter here has torch")
    (tmp_path / "prog.py").write_text("import torch\n")
    run = subprocess.run([PYTHON, "-m", "xmem.cli", "estimate", "--json", "--gpu", "a100", "--", bare, "prog.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    error = json.loads(run.stdout)
    assert run.returncode == error["exit_code"] == code_of(error["error"]) != 1, run.stderr
    assert "torch" in error["message"]
