"""The files a site installs into Slurm (slurm/: cli_filter.lua, the Prolog, TaskProlog and Epilog scripts, config
snippets) and the example site config (etc/xmem.toml): where they are, and how they are filled in and written.

They are found beside the package: `xmem/_site/` in an installed wheel (setup.py copies them there at build time),
else the checkout's own slurm/ and etc/ (an editable install, the dev cluster). Their `@NAME@` settings are
slurm/README.md's table; `install` fills every one of them or refuses. I/O: reads the shipped files, writes the
target folder; never touches a site config already there (the example goes beside it as xmem.toml.example).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

# The files Slurm runs or reads, filled in, with their modes (Slurm runs the shell scripts; it reads the Lua file).
FILLED = {"cli_filter.lua": 0o644, "prolog.sh": 0o755, "task_prolog.sh": 0o755, "epilog.sh": 0o755}
# Copied as they are: snippets to merge, and the page that explains them (its `@NAME@` are the settings' names).
COPIED = ("slurm.conf.example", "gres.conf.example", "README.md")
CONFIG_EXAMPLE = "xmem.toml.example"
SETTINGS = ("XMEM_PYTHON", "XMEM_SLURM", "XMEM_CONFIG", "TIMEOUT_S", "FAILURE", "XMEM_STORE", "XMEM_MEASURE_DIR")
_PLACEHOLDER = re.compile(r"@([A-Z][A-Z0-9_]*)@")
# A value goes inside a Lua string and shell double quotes: none of what would end or expand them.
_UNSAFE_VALUE = re.compile(r"[\"'\\$`\n\r\x00]")


class SiteFilesError(ValueError):
    """A setting that cannot be filled in, or shipped files that cannot be found."""


def shipped_dir() -> Path:
    """The folder holding slurm/ and etc/: the wheel's xmem/_site, else the checkout's root."""
    package = Path(__file__).resolve().parents[1]
    for root in (package / "_site", package.parent):
        if (root / "slurm" / "cli_filter.lua").is_file() and (root / "etc" / "xmem.toml").is_file():
            return root
    raise SiteFilesError(f"the Slurm files are not installed with xmem ({package / '_site'}): reinstall the wheel")


def filled(text: str, settings: Mapping[str, str]) -> str:
    """`text` with every `@NAME@` replaced by its setting; SiteFilesError for one without a setting."""
    missing = sorted({name for name in _PLACEHOLDER.findall(text) if name not in settings})
    if missing:
        raise SiteFilesError(f"no value for {', '.join('@' + m + '@' for m in missing)}")
    return _PLACEHOLDER.sub(lambda m: settings[m.group(1)], text)


def check_settings(settings: Mapping[str, str]) -> None:
    for name, value in settings.items():
        if _UNSAFE_VALUE.search(value):
            raise SiteFilesError(f"{name}: {value!r} holds a quote, backslash, $, ` or a line break")
    if settings.get("FAILURE") not in ("open", "closed"):
        raise SiteFilesError(f"FAILURE: open or closed, not {settings.get('FAILURE')!r}")


def install(target: Path, settings: Mapping[str, str], replace: bool = False) -> list[Path]:
    """Write the Slurm files, filled in, into `target` (made if missing), and the example config as
    xmem.toml.example. A file already there (a site's own cli_filter.lua or prolog.sh, or an older install) is
    replaced only with `replace` (an upgrade): SiteFilesError names them otherwise. Returns what was written."""
    check_settings(settings)
    source = shipped_dir()
    there = [name for name in (*FILLED, *COPIED, CONFIG_EXAMPLE) if (target / name).exists()]
    if there and not replace:
        raise SiteFilesError(f"{target} already has {', '.join(there)}: replace them (an upgrade) with --replace")
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, mode in FILLED.items():
        written.append(_write(target / name, filled((source / "slurm" / name).read_text(), settings), mode))
    for name in COPIED:
        written.append(_write(target / name, (source / "slurm" / name).read_text(), 0o644))
    written.append(_write(target / CONFIG_EXAMPLE, (source / "etc" / "xmem.toml").read_text(), 0o644))
    return written


def _write(path: Path, text: str, mode: int) -> Path:
    """Replace `path` whole (a sbatch reading cli_filter.lua meanwhile sees the old file or the new one)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.chmod(partial, mode)
    os.replace(partial, path)
    return path


__all__ = ["CONFIG_EXAMPLE", "COPIED", "FILLED", "SETTINGS", "SiteFilesError", "check_settings", "filled", "install",
           "shipped_dir"]
