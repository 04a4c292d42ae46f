"""What a site's administrator installs (issue 32 item 6): the wheel carries the Slurm files and the example config,
`xmem-slurm admin install-slurm-files` writes them filled in, and the filter's own faults reach the site's log."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from xmem.slurm import filter as slurm_filter
from xmem.slurm import site_log
from xmem.slurm.site_files import FILLED, SiteFilesError, install

REPO = Path(__file__).resolve().parents[2]
PLACEHOLDER = re.compile(r"@[A-Z][A-Z0-9_]*@")
SETTINGS = {"XMEM_PYTHON": "/opt/xmem/venv/bin/python", "XMEM_SLURM": "/opt/xmem/venv/bin/xmem-slurm",
            "XMEM_CONFIG": "/etc/xmem/xmem.toml", "TIMEOUT_S": "330", "FAILURE": "open",
            "XMEM_STORE": "/var/lib/xmem/records.jsonl", "XMEM_MEASURE_DIR": "/var/lib/xmem/measure"}


def test_install_fills_every_setting_and_sets_the_modes_slurm_needs(tmp_path):
    install(tmp_path, SETTINGS)
    for name in FILLED:
        text = (tmp_path / name).read_text()
        assert not PLACEHOLDER.search(text), f"{name}: {PLACEHOLDER.search(text).group()} left"
    assert 'local XMEM_PYTHON = "/opt/xmem/venv/bin/python"' in (tmp_path / "cli_filter.lua").read_text()
    assert '"/opt/xmem/venv/bin/xmem-slurm" prolog' in (tmp_path / "task_prolog.sh").read_text()
    assert all(os.stat(tmp_path / n).st_mode & 0o777 == 0o755 for n in ("prolog.sh", "task_prolog.sh", "epilog.sh"))
    assert (tmp_path / "xmem.toml.example").read_text() == (REPO / "etc" / "xmem.toml").read_text()


def test_install_never_replaces_a_sites_own_files_unless_asked(tmp_path):
    (tmp_path / "cli_filter.lua").write_text("-- the site's own filter\n")
    with pytest.raises(SiteFilesError, match="already has cli_filter.lua"):
        install(tmp_path, SETTINGS)
    assert (tmp_path / "cli_filter.lua").read_text() == "-- the site's own filter\n"
    install(tmp_path, SETTINGS, replace=True)
    assert "XMEM_PYTHON" in (tmp_path / "cli_filter.lua").read_text()


@pytest.mark.parametrize("name, value", [("XMEM_PYTHON", '/opt/x"y/python'), ("XMEM_SLURM", "/opt/$HOME/x"),
                                         ("FAILURE", "maybe")])
def test_install_refuses_a_setting_that_would_break_the_lua_string_or_the_shell(tmp_path, name, value):
    with pytest.raises(SiteFilesError, match=name):
        install(tmp_path, {**SETTINGS, name: value})
    assert not any(tmp_path.iterdir())


def test_the_admin_command_fills_the_timeout_from_the_sites_config(tmp_path):
    config = tmp_path / "xmem.toml"
    config.write_text("[estimate]\ntimeout_s = 100\n")
    done = subprocess.run([sys.executable, "-m", "xmem.cli", "admin", "install-slurm-files", "--to",
                           str(tmp_path / "slurm"), "--config", str(config)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lua = (tmp_path / "slurm" / "cli_filter.lua").read_text()
    assert 'local TIMEOUT_S = "130"' in lua and f'local XMEM_CONFIG = "{config}"' in lua
    assert f"Prolog={tmp_path / 'slurm'}/prolog.sh" in done.stdout


def test_the_wheel_carries_the_slurm_files_and_installs_a_site_from_them(tmp_path):
    """Built as `python -m build` builds it (setup.py's build_py), from a copy of the tracked files."""
    source = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split("\n")
    for name in filter(None, tracked):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("xmem_slurm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"xmem/_site/slurm/{n}" for n in FILLED} | {"xmem/_site/etc/xmem.toml"} <= names
    target = tmp_path / "site-packages"
    zipfile.ZipFile(wheel).extractall(target)  # what pip puts in site-packages
    done = subprocess.run([sys.executable, "-m", "xmem.cli", "admin", "install-slurm-files", "--to",
                           str(tmp_path / "etc-slurm")], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(target)})
    assert done.returncode == 0, done.stderr
    where = subprocess.run([sys.executable, "-c", "import xmem.slurm.site_files as s; print(s.shipped_dir())"],
                           capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(target)})
    assert where.stdout.strip() == str(target / "xmem" / "_site")
    assert (tmp_path / "etc-slurm" / "epilog.sh").is_file()


# ---- the filter's own faults ---------------------------------------------------------------------------------------

@pytest.fixture
def syslog(tmp_path, monkeypatch):
    """A stand-in for /dev/log: the datagrams the syslog daemon would get."""
    address = str(tmp_path / "log")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(address)
    server.settimeout(5)
    monkeypatch.setattr(site_log, "SYSLOG_ADDRESS", address)
    yield server
    server.close()


def test_an_unreadable_site_config_is_logged_to_syslog(tmp_path, syslog):
    out = io.StringIO()
    assert slurm_filter.filter_main(config_path=str(tmp_path / "missing.toml"), stdin=io.StringIO("{}"),
                                    stdout=out) == 0
    assert json.loads(out.getvalue())["fault"].startswith("site config:")
    line = syslog.recv(4096).decode()
    assert line.startswith("<11>xmem-slurm[") and "site config:" in line and "missing.toml" in line  # user.err


def test_an_internal_error_of_the_filter_goes_to_the_sites_log_file(tmp_path, monkeypatch):
    log, config = tmp_path / "filter.log", tmp_path / "xmem.toml"
    config.write_text(f'[filter]\nlog = "{log}"\n')

    def broken(request, site, **_):  # run_filter also takes when sbatch started
        raise RuntimeError("a bug of ours\nover two lines")

    monkeypatch.setattr(slurm_filter, "run_filter", broken)
    request = {"script": "/home/ann/job.sh", "argv": ["/home/ann/job.sh"], "options": {"gres": "gpu:1"},
               "user": "ann", "env": {}}
    out = io.StringIO()
    slurm_filter.filter_main(config_path=str(config), stdin=io.StringIO(json.dumps(request)), stdout=out)
    assert "submitted unchanged" in json.loads(out.getvalue())["message"]  # fail-open: the user goes on
    (line,) = log.read_text().splitlines()
    assert "internal error: RuntimeError: a bug of ours over two lines" in line
    assert "test_site_install.py:" in line and "script /home/ann/job.sh" in line


def test_a_log_file_the_user_cannot_open_falls_back_to_syslog(tmp_path, syslog):
    assert site_log.log_fault("boom", str(tmp_path / "no" / "such" / "dir.log"))
    assert "boom" in syslog.recv(4096).decode()
    assert not site_log.log_fault("quiet", site_log.NONE)


def test_the_filter_log_setting_is_syslog_none_or_an_absolute_path():
    from xmem.config import ConfigError, config_from_dict

    assert config_from_dict({}).filter.log == "syslog"
    assert config_from_dict({"filter": {"log": "/var/log/xmem-filter.log"}}).filter.log == "/var/log/xmem-filter.log"
    with pytest.raises(ConfigError, match="filter.log"):
        config_from_dict({"filter": {"log": "filter.log"}})
