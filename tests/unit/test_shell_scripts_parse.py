"""Every bash script the README and CI run parses (``bash -n``).

A slip in one of them (a ``case`` branch without its ``;;`` after a merge) is
found by CI only after the demo ran, minutes in; here it is found in the unit
level, in a second.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bash_scripts() -> list[Path]:
    candidates = [*sorted((ROOT / "scripts").iterdir()), ROOT / ".ci" / "run"]
    found = []
    for path in candidates:
        if not path.is_file():
            continue
        first = path.read_text(errors="replace").split("\n", 1)[0]
        if first.startswith("#!") and "bash" in first:
            found.append(path)
    return found


def test_the_scripts_the_readme_runs_are_found() -> None:
    names = {p.name for p in _bash_scripts()}
    assert {"test", "demo", "dev-cluster", "install-deps", "run"} <= names


@pytest.mark.parametrize("script", _bash_scripts(), ids=lambda p: p.name)
def test_a_bash_script_parses(script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, f"{script.relative_to(ROOT)}: {done.stderr}"
