"""The dev cluster (scripts/slurm-dev-cluster.sh) for the integration tests: up once per session, down at the end.

Each runs on its own LAB directory and ports (by default 6837/6838 inline, 6877/6878 deferred; the first free
such pairs from there, so that two test runs on one machine, or a developer's cluster, are left alone). The cluster runs a site install (scripts/install.sh --prefix, sharing this venv's
packages), so that `submitter`, a throw-away ordinary user, can submit as well as root.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.throwaway_users import User, throwaway_users

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm-dev-cluster.sh"


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def _first_free_ports(start: int = 6837) -> int:
    """The first base port from `start` (in steps of 100) whose four ports (controller and node, of the inline
    and the deferred cluster) are free."""
    for base in range(start, start + 3000, 100):
        if all(_free(base + offset) for offset in (0, 1, 40, 41)):
            return base
    raise RuntimeError(f"no free ports for a dev cluster from {start}")


PORT = _first_free_ports()
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@dataclass
class Submission:
    job_id: str | None
    returncode: int
    stderr: str
    seconds: float


@dataclass
class DevCluster:
    lab: Path
    env: dict[str, str]
    site: Path | None = None  # the site install the cluster runs (None: only root can submit)

    @property
    def config(self) -> Path:
        return self.lab / "etc" / "xmem.toml"

    @contextmanager
    def site_config_text(self, text: str) -> Iterator[Path]:
        """The cluster's site config holding `text` meanwhile, then put back: the filter and deferred mode's steps
        read that file alone (the one cli_filter.lua names), never a user's $XMEM_CONFIG. The slurm tests share one
        worker, so nothing else submits meanwhile."""
        before = self.config.read_text()
        self.config.write_text(text)
        try:
            yield self.config
        finally:
            self.config.write_text(before)

    @property
    def store(self) -> Path:
        return self.lab / "records.jsonl"

    def run(self, *argv: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env={**self.env, **(env or {})})

    def as_user(self, user: User, *argv: str, env: dict[str, str] | None = None, cwd: Path | None = None,
                timeout: float = 30) -> subprocess.CompletedProcess:
        """A command run by `user` in a login shell's environment: theirs, plus the cluster's SLURM_CONF/PATH."""
        assert self.site is not None, "only root can submit to this cluster (no site install)"
        mine = {k: self.env[k] for k in ("SLURM_CONF", "XMEM_CONFIG", "PATH")}
        return subprocess.run(user.argv(*argv), capture_output=True, text=True, timeout=timeout,
                              cwd=cwd or user.home, env=user.env({**mine, **(env or {})}))

    def sbatch(self, script: Path, *options: str, env: dict[str, str] | None = None,
               user: User | None = None) -> Submission:
        """sbatch as a user would run it (root, or `user`), from the script's directory; the job's output goes to
        out-<id>.txt."""
        started = time.monotonic()
        argv = ("sbatch", "--parsable", "-o", str(script.parent / "out-%j.txt"), *options, str(script))
        if user is None:
            done = self.run(*argv, env=env, cwd=script.parent, timeout=400)
        else:
            done = self.as_user(user, *argv, env=env, cwd=script.parent, timeout=400)
        seconds = time.monotonic() - started
        job_id = done.stdout.strip().split(";")[0] if done.returncode == 0 else None
        return Submission(job_id, done.returncode, done.stderr, seconds)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` as a dict. Keys are Slurm's CamelCase words, so a value with spaces (a comment)
        stays whole."""
        line = self.run("scontrol", "show", "job", "-o", job_id).stdout.strip()
        parts = re.split(r" (?=[A-Z][A-Za-z:/]*=)", line)
        return dict(p.split("=", 1) for p in parts if "=" in p)

    def wait(self, job_id: str, timeout: float = 300) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in FINISHED:
                return info
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} did not finish in {timeout} s: {self.job(job_id)}")

    def output(self, workdir: Path, job_id: str) -> str:
        return (workdir / f"out-{job_id}.txt").read_text()

    def user_cache(self, user: str = "root") -> Path:
        """A user's private part of the cluster's shared cache directory (xmem.cache.user_cache_dir)."""
        return self.lab / "cache" / user

    def analyses(self, user: str = "root") -> set[Path]:
        """The entries of a user's analysis cache (the site config puts it under the lab)."""
        return set((self.user_cache(user) / "analyses").glob("*.json"))


@pytest.fixture(scope="session")
def job_dir(tmp_path_factory):
    """Makes a directory for test jobs: `train.py` (the given training script) and `broken.py`, which fails as
    a script needing data that is not here does."""
    def make(name: str, train: str) -> Path:
        d = tmp_path_factory.mktemp(name)
        (d / "train.py").write_text(train)
        (d / "broken.py").write_text("raise RuntimeError('needs /data/imagenet, which is not here')\n")
        return d
    return make


def _slurm_available() -> str | None:
    """None if Slurm is (or could be made) installed, else why not."""
    needed = ("slurmctld", "slurmd", "sbatch", "munged")
    if all(shutil.which(n) for n in needed):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurmctld is not installed and cannot be installed here (needs root and apt-get)"
    subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurmctld", "slurmd",
                    "slurm-client", "slurm-wlm-basic-plugins", "munge"], capture_output=True, timeout=600,
                   env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if all(shutil.which(n) for n in needed):
        return None
    return "slurmctld is not installed and apt-get could not install it"


@pytest.fixture(scope="session")
def site_install():
    """A site install every user can run, sharing this venv's packages (12 s once); None if this venv's packages
    are not readable by other users (then only root submits)."""
    if os.geteuid() != 0:
        yield None
        return
    base = Path(tempfile.mkdtemp(prefix="xmem-site-"))
    base.chmod(0o755)
    done = subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), "--prefix", str(base),
                           "--packages-from", sys.prefix], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        print(f"no site install, only root submits:\n{done.stdout}\n{done.stderr}")
        shutil.rmtree(base, ignore_errors=True)
        yield None
        return
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def submitter(site_install):
    """A throw-away ordinary user who submits to the dev clusters."""
    if site_install is None:
        pytest.skip("no site install: only root can submit to the dev cluster")
    with throwaway_users("submit") as (user,):
        yield user


def _start(tmp_path_factory, name: str, port: int, mode: str = "inline", site: Path | None = None):
    why_not = _slurm_available()
    if why_not:
        pytest.skip(why_not)
    if os.geteuid() != 0:
        pytest.skip("the dev cluster runs slurmctld/slurmd as root (SlurmUser=root); run the tests as root")
    lab = Path(tempfile.mkdtemp(prefix=f"xmem-{name}-"))  # not under pytest's root-only 0700 base
    lab.chmod(0o755)
    bin_dir = site / "venv" / "bin" if site else Path(sys.executable).parent
    xmem_slurm = bin_dir / "xmem-slurm"
    env = {**os.environ, "XMEM_SLURM": str(xmem_slurm)}
    env.pop("SLURM_JOB_ID", None)  # the filter skips submissions from inside a job
    up = subprocess.run(["bash", str(SCRIPT), "up", "--lab", str(lab), "--port", str(port), "--mode", mode],
                        capture_output=True, text=True, timeout=300, env=env)
    if up.returncode != 0:
        subprocess.run(["bash", str(SCRIPT), "down", "--lab", str(lab)], capture_output=True, timeout=120, env=env)
        raise RuntimeError(f"slurm-dev-cluster.sh up failed:\n{up.stdout}\n{up.stderr}")
    exports = dict(re.findall(r"(\w+)=(\S+)", up.stdout.strip().splitlines()[-1].removeprefix("export ")))
    # Jobs and the filter find the install's python (and torch) first on the PATH, as a user's venv would.
    env.update(exports, PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
    yield DevCluster(lab, env, site)
    subprocess.run(["bash", str(SCRIPT), "down", "--lab", str(lab)], capture_output=True, timeout=120, env=env)
    shutil.rmtree(lab, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, site_install) -> DevCluster:
    """Inline mode: the filter estimates during sbatch."""
    yield from _start(tmp_path_factory, "slurm-lab", PORT, site=site_install)


@pytest.fixture(scope="session")
def deferred_cluster(tmp_path_factory, site_install) -> DevCluster:
    """Deferred mode (issue 5): estimates run as jobs on the `cpu` partition. Ports 6877/6878."""
    yield from _start(tmp_path_factory, "slurm-lab-deferred", PORT + 40, "partition", site=site_install)
