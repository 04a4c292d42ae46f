"""The wait for an estimate that is not cached, on the submitter's terminal (issue 23): cli_filter.lua hands the
filter sbatch's stderr only when it is a terminal, and the filter counts the seconds there on one line
(xmem.slurm.inline.estimate_progress), ended before sbatch goes on. A cached resubmission, a submission whose
stderr is not a terminal (test_cli_filter.py's edited-cache-entry test, a first submission piped) and
`sbatch --quiet` get nothing; sbatch's own output (`Submitted batch job N`, `--parsable`) and what reaches the job
are the same either way.

The first two tests need no Slurm (a pseudo-terminal and a pipe handed to estimate_progress as cli_filter.lua
hands them); the others submit to the dev cluster as an ordinary user, sbatch under a pseudo-terminal made its
controlling terminal with `stty tostop` (a background write to it would stop the filter unless it blocks SIGTTOU)."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest

from xmem.slurm.contract import FilterRequest
from xmem.slurm.inline import PROGRESS_FD_ENV, estimate_progress

TRAIN = """\
import torch
import torch.nn as nn

model = nn.Linear(64, 8).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    loss = model(torch.randn(4, 64, device="cuda")).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
LINE = "xmem-slurm: estimating GPU memory of "


def drain(master: int, until: float = 0.3) -> bytes:
    out = b""
    while select.select([master], [], [], until)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every slave side is closed
            break
        if not chunk:
            break
        out += chunk
    return out


def progress_on(fd: int, request: FilterRequest, seconds: float = 0.0) -> None:
    """One estimate's wait with a copy of `fd` passed as cli_filter.lua passes it: afterwards the copy is closed (no
    process the filter starts holds the user's terminal) and the variable gone (nor sees it)."""
    passed = os.dup(fd)
    os.environ[PROGRESS_FD_ENV] = str(passed)
    try:
        with estimate_progress("/home/ann/jobs/job.sh", request, None):
            time.sleep(seconds)
        assert PROGRESS_FD_ENV not in os.environ
        with pytest.raises(OSError):
            os.fstat(passed)
    finally:
        os.environ.pop(PROGRESS_FD_ENV, None)


def test_the_wait_counts_seconds_on_a_terminal_and_ends_its_line():
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        progress_on(slave, FilterRequest(script="/home/ann/jobs/job.sh"), seconds=1.2)
        text = drain(master).decode()
        quiet = FilterRequest(script="/home/ann/jobs/job.sh", options={"quiet": "set"})
        progress_on(slave, quiet)  # sbatch --quiet: nothing
        assert drain(master) == b""
    finally:
        os.close(master), os.close(slave)
    shown = text.split("\r")
    assert shown[0] == "" and text.endswith("\r\n")  # each repaint from the line's start, one newline at the end
    counts = [int(m[1]) for m in (re.fullmatch(re.escape(LINE) + r"job\.sh \(not cached\)\.\.\. (\d+) s", s)
                                  for s in shown[1:-1]) if m]
    assert len(counts) == len(shown) - 2 and counts[0] == 0 and counts[-1] >= 1 and counts == sorted(counts), text
    assert text.count("\n") == 1


def test_nothing_is_written_when_stderr_is_not_a_terminal():
    read, write = os.pipe()
    try:
        progress_on(write, FilterRequest(script="/home/ann/jobs/job.sh"))
        os.close(write)
        assert os.read(read, 4096) == b""
    finally:
        os.close(read)


# --- on the dev cluster ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(submitter) -> Path:
    d = submitter.home / "progress-jobs"
    d.mkdir()
    (d / "train.py").write_text(TRAIN)
    for p in (d, *d.iterdir()):
        os.chown(p, submitter.uid, submitter.gid)
    return d


def job_script(work: Path, name: str) -> Path:
    path = work / name
    path.write_text(f"#!/bin/bash\n#SBATCH --gres=gpu:1\n# {name}\npython train.py\n")
    os.chown(path, work.stat().st_uid, work.stat().st_gid)
    return path


def sbatch_on_terminal(cluster, user, path: Path, *options: str, stdout_piped: bool = False):
    """sbatch as `user` with a pseudo-terminal as its controlling terminal (`stty tostop`, 120 columns) on stdin and
    stderr, and on stdout unless `stdout_piped`: (exit status, what the terminal got, what the pipe got)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    attrs = termios.tcgetattr(slave)
    attrs[3] |= termios.TOSTOP
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    mine = {k: cluster.env[k] for k in ("SLURM_CONF", "XMEM_CONFIG", "PATH")}
    argv = user.argv("sbatch", "-o", str(path.parent / "out-%j.txt"), "--begin=now+3600", *options, str(path))
    sbatch = subprocess.Popen(argv, stdin=slave, stdout=subprocess.PIPE if stdout_piped else slave, stderr=slave,
                              cwd=path.parent, env=user.env(mine), start_new_session=True,
                              preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    terminal, deadline = b"", time.monotonic() + 150
    try:
        while sbatch.poll() is None and time.monotonic() < deadline:  # a filter stopped by SIGTTOU never returns
            terminal += drain(master, 0.2)
    finally:
        if sbatch.poll() is None:
            sbatch.kill()  # status -9
        status = sbatch.wait()
        stdout = sbatch.stdout.read().decode() if stdout_piped else ""
        terminal += drain(master)
        os.close(master), os.close(slave)
    return status, terminal.decode(), stdout


@pytest.mark.slurm
def test_a_first_submission_on_a_terminal_shows_its_wait_and_a_cached_one_does_not(cluster, submitter, work):
    path = job_script(work, "first.sh")
    entries = cluster.analyses(submitter.name)
    started = time.monotonic()
    status, terminal, stdout = sbatch_on_terminal(cluster, submitter, path, "--parsable", stdout_piped=True)
    print(f"\nfigure: first submission {time.monotonic() - started:.1f} s, its terminal: {terminal!r}")
    assert status == 0, terminal
    assert re.fullmatch(r"\d+\n", stdout), stdout  # --parsable: the job id alone, as without the filter
    assert len(cluster.analyses(submitter.name) - entries) == 1  # it was estimated now, not taken from the cache
    lines = terminal.split("\r\n")
    waits = [i for i, line in enumerate(lines) if LINE + "first.sh (not cached, at most " in line]
    assert len(waits) == 1, terminal
    assert re.search(r"\.\.\. \d+ s$", lines[waits[0]]), terminal  # ended with a newline, after the count
    notice = lines[waits[0] + 1]
    assert notice.startswith("xmem-slurm: ") and LINE not in notice, terminal  # the notice keeps its own line
    job = cluster.job(stdout.strip())
    assert "estimating" not in job["Comment"] and job["TresPerNode"] != "gres:gpu:1"  # rewritten as usual

    started = time.monotonic()
    again, cached, _ = sbatch_on_terminal(cluster, submitter, path)
    print(f"figure: cached resubmission {time.monotonic() - started:.1f} s, its terminal: {cached!r}")
    assert again == 0, cached
    assert "estimating" not in cached and "\r" not in cached.replace("\r\n", ""), cached
    job_id = re.search(r"^Submitted batch job (\d+)\r$", cached, re.M)
    assert job_id and cluster.job(job_id[1])["TresPerNode"] == job["TresPerNode"], cached
    said = [line for line in cached.split("\r\n") if line.startswith("xmem-slurm:")]
    assert said == [notice.replace(" (cached estimate)", "") + " (cached estimate)"], cached
    cluster.run("scancel", stdout.strip(), job_id[1])
