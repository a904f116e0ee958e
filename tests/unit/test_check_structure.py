"""scripts/check-structure: each of its rules fails on a small bad package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check-structure"


def _tree(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (pkg / "__init__.py").touch()
    return pkg


def _run(pkg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(pkg)], capture_output=True, text=True, check=False
    )


def _function(name: str, body_lines: int) -> str:
    return f"def {name}():\n" + "    x = 1\n" * (body_lines - 1) + "    return x\n"


def test_a_clean_package_passes(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "a.py": _function("short", 79),  # 80 lines with the def: the limit, allowed
            "b.py": "from pkg import a\n\nclass B:\n    pass\n",
            "sub/__init__.py": "from pkg.sub import c\n",
            "sub/c.py": "from pkg import b\n\nclass C:\n    pass\n",
        },
    )
    result = _run(pkg)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_a_function_over_80_lines_fails_naming_file_and_line(tmp_path: Path) -> None:
    pkg = _tree(tmp_path, {"a.py": "import os\n\n\n" + _function("too_long", 80)})
    result = _run(pkg)
    assert result.returncode == 1
    assert "pkg/a.py:4: function too_long is 81 lines (at most 80)" in result.stderr


def test_a_function_over_60_lines_in_a_router_folder_fails(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {"router/__init__.py": "", "router/a.py": _function("long", 60), "b.py": _function("ok", 60)},
    )
    result = _run(pkg)
    assert result.returncode == 1
    assert "pkg/router/a.py:1: function long is 61 lines (at most 60)" in result.stderr
    assert "b.py" not in result.stderr


def test_a_class_name_defined_twice_fails_naming_both_places(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {"a.py": "class Spec:\n    pass\n", "sub/b.py": "\n\nclass Spec:\n    x = 1\n"},
    )
    result = _run(pkg)
    assert result.returncode == 1
    assert "class Spec is defined 2 times" in result.stderr
    assert "pkg/a.py:1" in result.stderr and "pkg/sub/b.py:3" in result.stderr


def test_an_import_cycle_fails_even_through_a_lazy_import(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "a.py": "from pkg.b import g\n\ndef f():\n    return g()\n",
            "b.py": "def g():\n    from pkg import a\n\n    return a\n",
        },
    )
    result = _run(pkg)
    assert result.returncode == 1
    assert "pkg/a.py:1: import cycle pkg.a -> pkg.b -> pkg.a" in result.stderr


def test_a_missing_folder_is_a_usage_error(tmp_path: Path) -> None:
    result = _run(tmp_path / "nope")
    assert result.returncode == 2
    assert "is not a folder" in result.stderr
