"""Shell completion (issue 32 item 6): typer's --install-completion and --show-completion, and the completion
itself, which must see every verb although `xmem.cli.main` imports only the module of the verb being run."""

from __future__ import annotations

import os
import subprocess
import sys

XMEM_SLURM = [sys.executable, "-c", "import sys; sys.argv[0] = 'xmem-slurm'; from xmem.cli import main; main()"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*XMEM_SLURM, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_show_completion_prints_the_script_for_the_shell():
    """typer finds the shell among the command's parent processes (shellingham; a shell name after the flag is
    ignored): typed in bash, as a user does, whatever started the test run."""
    done = subprocess.run(["bash", "-c", '"$@"; exit $?', "bash", *XMEM_SLURM, "--show-completion"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "_XMEM_SLURM_COMPLETE=complete_bash" in done.stdout and "complete " in done.stdout


def test_completion_offers_every_verb_and_the_admin_commands():
    def completed(words: str) -> list[str]:
        done = run(env={"_XMEM_SLURM_COMPLETE": "complete_bash", "COMP_WORDS": words,
                        "COMP_CWORD": str(len(words.split()) - 1)})
        return done.stdout.split()

    assert completed("xmem-slurm est") == ["estimate"]
    assert completed("xmem-slurm admin in") == ["install-slurm-files"]
    assert {"check", "fit", "gpus", "status", "calibrate", "admin"} <= set(completed("xmem-slurm ''"))
