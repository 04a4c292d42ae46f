"""The native shim: torch found from its files, the build kind detected, the .so cached per torch and source,
and a clear error when g++ is missing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from xmem.trace import shim


def test_finds_this_interpreters_torch_without_importing_it():
    code = ("import sys; from xmem.trace import shim; t = shim.find_torch(); "
            "print(t.version, t.build, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    import torch
    assert out[0] == torch.__version__
    assert out[1] == ("cuda" if torch.version.cuda else "cpu")
    assert out[2] == "False"


def test_cache_path_is_keyed_by_version_build_source_and_install(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    install = shim.TorchInstall(tmp_path, "2.14.1+cu130", "cuda")
    path = shim.shim_path(install)
    assert path.parent == tmp_path / "xmem-slurm" / "native"
    assert path.name.startswith("xmem_fake_cuda-2.14.1+cu130-cuda-") and path.suffix == ".so"
    assert shim.shim_path(shim.TorchInstall(tmp_path, "2.13.0+cpu", "cpu")) != path
    # the same torch in another environment: the shim links to each one's libraries by path
    assert shim.shim_path(shim.TorchInstall(tmp_path / "other-venv", "2.14.1+cu130", "cuda")) != path
    assert shim.shim_path(shim.TorchInstall(tmp_path, "2.14.1+cu130", "cuda")) == path


def test_missing_compiler_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-xmem")
    with pytest.raises(shim.ShimError, match="g\\+\\+ not found"):
        shim.build_shim(shim.find_torch())


def test_builds_once_then_reuses_the_cached_library(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    torch_install = shim.find_torch()
    built = shim.build_shim(torch_install)
    assert built.exists() and built == shim.shim_path(torch_install)
    stamp = built.stat().st_mtime_ns
    assert shim.build_shim(torch_install).stat().st_mtime_ns == stamp
    record = Path(str(built) + shim.DIGEST_SUFFIX)  # the builder's digest, checked at every reuse and load
    assert sorted(built.parent.iterdir()) == sorted([built, record])  # no temporary file left behind


def test_loading_after_torch_is_refused():
    code = "import torch; from xmem.trace import shim; shim.load_shim()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0 and "before torch is imported" in done.stderr


def test_unwritable_cache_falls_back_to_the_temporary_directory(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # mkdir under a regular file fails, even for root
    monkeypatch.setattr(shim.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    built = shim.build_shim(shim.find_torch())
    assert built.parent == tmp_path / "tmp" / f"xmem-slurm-native-{os.getuid()}" and built.exists()
