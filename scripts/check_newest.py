"""Run the tests that use the training libraries against their newest releases, in a throwaway environment.

    python3 scripts/check_newest.py [--build cuda|cpu] [--venv DIR] [--keep] [--list] [PYTEST ARGS...]

scripts/install.sh installs what the tests passed on (constraints.txt); users run whatever was released since. This
makes a venv (a temporary folder, removed at the end unless --keep; --venv DIR: that one, kept) with xmem-slurm's
test extras, torch at install.sh's pin for the build (cuda: torch 2.14.1 + torchvision 0.29.1 and DeepSpeed; cpu:
torch 2.13.0, no DeepSpeed), and the newest releases of LIBRARIES with no constraints on anything but torch; runs
the test files that use them (found by grep: a test module that imports one, or that names a program under tests/
that does); and ends with which libraries it got and which tests failed. PYTEST ARGS go to pytest, e.g.
`-k weights` or `-x`; --list prints the chosen test files and exits. Each library is also imported alone (trl has
no test yet). Exit 0: all passed; 1: a test failed or a library did not import; 2: the environment could not be
made (an install that does not resolve is a finding too).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# The libraries users train with whose releases break things first; import names beside distribution names.
LIBRARIES = {"transformers": "transformers", "accelerate": "accelerate", "peft": "peft", "deepspeed": "deepspeed",
             "lightning": "lightning", "trl": "trl"}
IMPORT_NAMES = ("transformers", "accelerate", "peft", "deepspeed", "lightning", "pytorch_lightning", "trl")
TORCH = {"cuda": ["torch==2.14.1", "torchvision==0.29.1"], "cpu": ["torch==2.13.0"]}  # scripts/install.sh's pins
EXTRAS = {"cuda": "test,bench,vision", "cpu": "test,bench"}
IMPORTS = re.compile(r"^\s*(?:import|from)\s+(?:%s)\b" % "|".join(IMPORT_NAMES), re.MULTILINE)


def library_tests() -> list[str]:
    """Test modules that import one of the libraries, or name a program under tests/ that does."""
    users = [p for p in TESTS.rglob("*.py") if IMPORTS.search(p.read_text(errors="replace"))]
    programs = {p.stem for p in users if not p.name.startswith("test_")}
    chosen = []
    for path in sorted(TESTS.rglob("test_*.py")):
        text = path.read_text(errors="replace")
        if path in users or any(re.search(rf"\b{re.escape(name)}(\.py)?\b", text) for name in programs):
            chosen.append(str(path.relative_to(REPO)))
    return chosen


def find_links() -> list[str]:
    """The local wheel folders pip is told of (as scripts/install.sh passes them to uv)."""
    links = os.environ.get("PIP_FIND_LINKS") or subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True).stdout
    return [arg for link in links.split() for arg in ("--find-links", link)]


def make_env(venv: Path, build: str) -> None:
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    if not (venv / "bin" / "uv").exists():
        subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "uv"], check=True)
    newest = [name for name in LIBRARIES.values() if build == "cuda" or name != "deepspeed"]
    command = [str(venv / "bin" / "uv"), "pip", "install", "-q", "--python", python, "--compile-bytecode",
               *find_links(), "-e", f"{REPO}[{EXTRAS[build]}]", *TORCH[build], *newest,
               *[arg for name in newest for arg in ("--upgrade-package", name)]]
    print(f"check_newest: installing into {venv}: xmem-slurm[{EXTRAS[build]}] {' '.join(TORCH[build])} and the "
          f"newest {', '.join(newest)} (no constraints)", flush=True)
    subprocess.run(command, check=True, cwd=REPO)


def versions(python: str) -> dict[str, str]:
    code = ("import importlib.metadata as m\n"
            f"for name in {list(LIBRARIES.values()) + ['torch']!r}:\n"
            "    try: print(name, m.version(name))\n"
            "    except m.PackageNotFoundError: print(name, '-')\n")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
    return dict(line.split() for line in out.splitlines())


def import_failures(python: str, build: str) -> list[str]:
    """Each library imported alone in the new environment: what fails at import (a release that no longer fits
    another) shows here, also for a library no test uses yet."""
    failures = []
    for name in IMPORT_NAMES:
        if name == "deepspeed" and build != "cuda":
            continue
        done = subprocess.run([python, "-c", f"import {name}"], capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            failures.append(f"{name}: {(done.stderr.strip().splitlines() or ['no message'])[-1]}")
    return failures


def test_id(line: str) -> str:
    """The test's id from pytest's FAILED/ERROR line, without the xdist group (`name[param]@group]`)."""
    return line.split()[1].split("@")[0]


def pinned() -> dict[str, str]:
    text = (REPO / "constraints.txt").read_text()
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r"^([A-Za-z0-9._-]+)==(\S+)", text, re.MULTILINE)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--build", choices=sorted(TORCH), default=os.environ.get("XMEM_TORCH", "cuda"))
    parser.add_argument("--venv", type=Path, help="make (or reuse) the environment here and keep it")
    parser.add_argument("--keep", action="store_true", help="keep the temporary environment (its path is printed)")
    parser.add_argument("--list", action="store_true", help="print the chosen test files and exit")
    args, pytest_args = parser.parse_known_args()
    tests = library_tests()
    if args.list:
        print("\n".join(tests))
        return 0
    venv = args.venv or Path(tempfile.mkdtemp(prefix="xmem-newest-"))
    try:
        try:
            make_env(venv, args.build)
        except subprocess.CalledProcessError as e:
            print(f"check_newest: the newest releases did not install ({e}); that is the finding", file=sys.stderr)
            return 2
        python = str(venv / "bin" / "python")
        got, held = versions(python), pinned()
        broken = import_failures(python, args.build)
        run = subprocess.run([python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-n", "2",
                              "--dist", "loadgroup", *tests, *pytest_args], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        sys.stdout.write(run.stdout)
        failed = sorted({test_id(line) for line in run.stdout.splitlines()
                         if line.startswith(("FAILED ", "ERROR ")) and len(line.split()) > 1})
        print("\ncheck_newest: libraries (newest here; constraints.txt):")
        for name in LIBRARIES.values():
            note = "" if name != "trl" else "  (no test uses it yet)"
            print(f"  {name:<13} {got.get(name, '-'):<12} {held.get(name, '-')}{note}")
        print(f"  {'torch':<13} {got.get('torch', '-')}")
        for failure in broken:
            print(f"check_newest: does not import: {failure}")
        if run.returncode == 5:
            print("check_newest: no test was selected")
            return 1 if broken else 0
        print(f"check_newest: {len(failed)} test(s) failed on the newest releases" + (":" if failed else ""))
        for test in failed:
            print(f"  {test}")
        return 0 if run.returncode == 0 and not broken else 1
    finally:
        if args.venv is None and not args.keep:
            shutil.rmtree(venv, ignore_errors=True)
        elif args.venv is None:
            print(f"check_newest: the environment is kept in {venv}")


if __name__ == "__main__":
    sys.exit(main())
