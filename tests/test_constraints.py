"""The constraints files scripts/install.sh installs with (issue 32 item 1): every package the extras pull in is
pinned, torch's per-build pins stay install.sh's, transformers stays below the release that reaches the hub, and
scripts/freeze_constraints.py refuses a freeze it should not write."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def load_freezer():
    spec = importlib.util.spec_from_file_location("freeze_constraints", REPO / "scripts" / "freeze_constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


freezer = load_freezer()


def pinned(name: str) -> dict[str, str]:
    return freezer.pins((REPO / name).read_text())


def requirement_name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


def test_every_requirement_of_the_installed_extras_is_pinned():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in ("test", "bench", "vision"):  # what scripts/install.sh installs
        wanted += project["optional-dependencies"][extra]
    shared = pinned("constraints.txt")
    missing = {requirement_name(r) for r in wanted} - set(shared) - {"torch", "tomli"}  # tomli: Python < 3.11 only
    assert not missing, f"not in constraints.txt: {sorted(missing)}"


def test_torch_is_pinned_per_build_by_install_sh_and_the_cuda_build_has_its_own_file():
    shared, cuda = pinned("constraints.txt"), pinned("constraints-cuda.txt")
    assert not {"torch", "torchvision"} & (set(shared) | set(cuda))
    assert not [name for name in shared if freezer.cuda_build_own(name)]
    assert "triton" in cuda and all(freezer.cuda_build_own(name) for name in cuda)
    install = (REPO / "scripts" / "install.sh").read_text()
    assert "torch==2.14.1 torchvision==0.29.1" in install and "torch==2.13.0" in install


def test_transformers_stays_below_the_release_that_reaches_the_hub():
    version = tuple(int(part) for part in pinned("constraints.txt")["transformers"].split("."))
    assert version < (5, 25)
    assert freezer.HELD["transformers"][0] == pinned("constraints.txt")["transformers"]


def test_the_files_are_what_the_freezer_writes(tmp_path):
    """Written by scripts/freeze_constraints.py, not by hand: the same freeze gives the same files."""
    shared, cuda = pinned("constraints.txt"), pinned("constraints-cuda.txt")
    cuda_env = {**shared, **cuda, "torch": "2.14.1", "torchvision": "0.29.1", "pip": "23.2.1"}
    cpu_env = {**shared, "torch": "2.13.0"}
    assert freezer.split(cuda_env, cpu_env) == (shared, cuda)
    for path in (freezer.SHARED, freezer.CUDA_ONLY):
        assert path.read_text().startswith(freezer.HEADER.splitlines()[0].format(what=freezer.WHAT[path]))


def test_the_freezer_refuses_builds_that_disagree_or_a_release_past_a_hold():
    with pytest.raises(SystemExit, match="different versions of numpy"):
        freezer.split({"numpy": "2.4.6"}, {"numpy": "2.4.5"})
    with pytest.raises(SystemExit, match="transformers 5.25.0 installed, held at"):
        freezer.split({"transformers": "5.25.0"}, {"transformers": "5.25.0"})
    assert freezer.pins("torch==2.13.0+cpu\n-e file:///x\nnvidia_ml_py==13.615.71\n") == \
        {"torch": "2.13.0", "nvidia-ml-py": "13.615.71"}
