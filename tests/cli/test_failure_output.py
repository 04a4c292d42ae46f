"""What a failed estimate shows on the terminal (issue 23): a few lines that name what went wrong, the program's
last output lines where they say why (exit 9 promises them), and no torch-internal log of the fake mode."""

import subprocess
import sys
import textwrap
from pathlib import Path

PYTHON = sys.executable
TORCH_LOG = "torch/_subclasses/fake_tensor.py"  # where torch's fake mode logs an exception it raises on


def estimate(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "prog.py").write_text(textwrap.dedent(body))
    return subprocess.run([PYTHON, "-m", "xmem.cli", "estimate", "--gpu", "a100", "--", PYTHON, "prog.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_an_op_without_a_fake_kernel_is_not_modelled_in_a_few_lines(tmp_path):
    """A custom op registered without register_fake runs on a GPU: exit 11 naming it, not the user's fault (5)."""
    run = estimate(tmp_path, """
        import torch
        @torch.library.custom_op("mylib::twice", mutates_args=())
        def twice(x: torch.Tensor) -> torch.Tensor:
            return x * 2
        print("before the op")
        twice(torch.ones(4, device="cuda"))
    """)
    assert run.returncode == 11, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) <= 8, run.stderr
    assert "not modelled: an op with no fake kernel" in lines[-1] and "mylib::twice" in lines[-1]
    assert "prog.py:7" in lines[-1] and "before the op" in run.stderr and TORCH_LOG not in run.stderr


def test_a_failing_meta_check_shows_the_programs_lines_not_torchs_log(tmp_path):
    """torch's fake mode logged a failed shape check with 25 lines of its own frames before it raised, pushing the
    program's last output lines out of the tail shown: the exception alone is shown now (exit 5: a GPU raises too)."""
    run = estimate(tmp_path, """
        import torch
        a, b = torch.ones(3, 4, device="cuda"), torch.ones(5, 6, device="cuda")
        print("multiplying")
        a @ b
    """)
    assert run.returncode == 5, run.stderr
    assert TORCH_LOG not in run.stderr and "failed while attempting" not in run.stderr
    assert "  | multiplying" in run.stderr and len(run.stderr.splitlines()) <= 8, run.stderr
    assert "must have same reduction dim" in run.stderr.splitlines()[-1]


def test_exit_9_shows_the_programs_last_output_lines(tmp_path):
    run = estimate(tmp_path, """
        for i in range(30):
            print(f"line {i}")
        print("no GPU wanted here")
    """)
    assert run.returncode == 9, run.stderr
    assert "the program's last output lines:" in run.stderr and "its last output lines say why" in run.stderr
    shown = [line for line in run.stderr.splitlines() if line.startswith("  | ")]
    assert shown[-2:] == ["  | line 29", "  | no GPU wanted here"] and "  | line 0" not in shown


def test_exit_9_of_a_silent_program_says_it_printed_nothing(tmp_path):
    """No lines to point at: the message does not promise them."""
    run = estimate(tmp_path, "x = 1\n")
    assert run.returncode == 9, run.stderr
    assert "printed nothing" in run.stderr and "say why" not in run.stderr
