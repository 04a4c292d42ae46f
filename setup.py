"""Build hook (the rest of the metadata is pyproject.toml): the wheel carries the Slurm files and the example site
config as package data, `xmem/_site/slurm/*` and `xmem/_site/etc/xmem.toml`, copied at build time from their one
place in the repository (slurm/, etc/), where the docs, the dev cluster and the tests use them.
`xmem.slurm.site_files` finds them in a wheel's install or in a checkout; `xmem-slurm admin install-slurm-files`
writes them for a site."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SITE_FILES = {"slurm": sorted(p.name for p in (ROOT / "slurm").iterdir() if p.is_file()), "etc": ["xmem.toml"]}


class BuildPyWithSiteFiles(build_py):
    def run(self) -> None:
        super().run()
        for folder, names in SITE_FILES.items():
            target = Path(self.build_lib) / "xmem" / "_site" / folder
            target.mkdir(parents=True, exist_ok=True)
            for name in names:
                shutil.copy2(ROOT / folder / name, target / name)


setup(cmdclass={"build_py": BuildPyWithSiteFiles})
