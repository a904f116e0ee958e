"""This tree and its dependencies, importable by other Unix users, for tests that run
the ``llmgw`` CLI (and the official ``openai`` client) as them.

Why a copy: the test runner's interpreter and its site-packages live where
only root may look (here /root/.pyenv, mode 0700), and the tree under test may
be a worktree nobody else was meant to read. Other users run the system's
Python (``/usr/bin/python3``, as :mod:`tests.hostile_user` does) with
``PYTHONPATH`` pointing at a world-readable folder under /tmp holding:

- ``llmgw_slurm/``, copied from the tree the tests run (not an installed
  release: what is tested is this checkout);
- every distribution the package needs (its ``install_requires``, and
  ``openai`` for researchers' own code), found from the installed metadata
  and copied file by file from each one's RECORD, byte-compiled files
  included (a user cannot write ``__pycache__`` here, and recompiling
  openai's thousands of modules on every start would cost seconds);
- ``bin/llmgw``: the console script, as pip writes it, for that interpreter.

Compiled extensions (aiohttp, pydantic-core, cryptography) are built for the
runner's CPython minor version: the system Python must have the same one,
else the copy cannot import and :func:`user_site` fails the test saying so.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.hostile_user import SYSTEM_PYTHON, world_dir

__all__ = ["UserSite", "user_site"]

TOP = Path(__file__).resolve().parents[1]
# What other users' processes import: the CLI's dependencies, and the client
# researchers' own code uses.
ROOTS = ("llmgw-slurm", "openai")


@dataclass(frozen=True)
class UserSite:
    folder: Path

    @property
    def llmgw(self) -> str:
        return str(self.folder / "bin" / "llmgw")

    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": str(self.folder / "lib")}


def _closure(roots: tuple[str, ...]) -> list[md.Distribution]:
    seen: dict[str, md.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            pytest.fail(f"{name} is not installed in {sys.prefix} (pip install -e '.[test]')")
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _copy_dist(dist: md.Distribution, lib: Path) -> None:
    base = Path(str(dist.locate_file(""))).resolve()
    if dist.files is None:
        pytest.fail(f"{dist.metadata['Name']} has no RECORD: cannot tell its files to copy")
    for f in dist.files:
        src = Path(str(dist.locate_file(f))).resolve()
        if not src.is_relative_to(base) or not src.is_file():
            continue  # scripts in bin/, data files: not needed to import it
        dst = lib / src.relative_to(base)
        dst.parent.mkdir(parents=True, exist_ok=True)
        _place(src, dst)


def _place(src: str | Path, dst: str | Path) -> None:
    """``src`` at ``dst``, readable by everyone: a hard link where it may be one.

    A link costs nothing (openai alone is 4000 files, 10 s of copying on a busy
    machine) and keeps the mtime the .pyc files are checked against. A file
    others may not read, or on another file system, is copied and opened up
    instead: chmod on a link would change the runner's own install.
    """
    st = os.stat(src)
    if st.st_mode & 0o004:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass  # another file system, or links refused (fs.protected_hardlinks)
    shutil.copy2(src, dst)
    os.chmod(dst, 0o755 if st.st_mode & 0o100 else 0o644)


@contextlib.contextmanager
def user_site() -> Iterator[UserSite]:
    """A world-readable copy of this tree and its dependencies (see the module doc); removed after."""
    probe = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    mine = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if probe.stdout.strip() != mine:
        pytest.fail(
            f"{SYSTEM_PYTHON} is Python {probe.stdout.strip() or '?'} and the tests run {mine}: "
            "the dependencies' compiled extensions are built for the tests' version, so other "
            "users cannot import a copy of them"
        )
    with world_dir("llmgw-usersite-") as folder:
        lib = folder / "lib"
        for dist in _closure(ROOTS):
            if dist.metadata["Name"] != "llmgw-slurm":
                _copy_dist(dist, lib)
        # The checkout under test, not whatever llmgw-slurm is installed.
        shutil.copytree(TOP / "llmgw_slurm", lib / "llmgw_slurm", copy_function=_place)
        (folder / "bin").mkdir()
        (folder / "bin" / "llmgw").write_text(
            f"#!{SYSTEM_PYTHON}\nimport sys\nfrom llmgw_slurm.cli.researcher import main\n"
            "sys.exit(main())\n"
        )
        (folder / "bin" / "llmgw").chmod(0o755)
        for d, _, _ in os.walk(folder):
            os.chmod(d, 0o755)  # whatever the runner's umask made of them
        yield UserSite(folder)
