"""scripts/check-structure: each of its rules fails on a small bad package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check-structure"


def _tree(root: Path, files: dict[str, str]) -> Path:
    """A package of ``files``; unless they give its ``__init__.py``, one whose
    docstring agrees to every top-level module among them."""
    pkg = root / "pkg"
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if "__init__.py" not in files:
        top = sorted(n.removesuffix(".py") for n in files if "/" not in n)
        (pkg / "__init__.py").write_text(f'"""A package.\n\nModules: {", ".join(top)}.\n"""\n')
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
            "sub/__init__.py": '"""Sub.\n\nMay import: a, b.\n"""\n\nfrom pkg.sub import c\n',
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


def _rule(names: str) -> str:
    return f'"""A folder.\n\nMay import: {names}.\n"""\n'


def test_a_top_level_module_beyond_the_agreed_list_fails(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {"__init__.py": '"""A package.\n\nModules: a.\n"""\n', "a.py": "", "stray.py": ""},
    )
    result = _run(pkg)
    assert result.returncode == 1
    assert "pkg/stray.py:1: module stray stands at the package's top" in result.stderr
    assert "a.py" not in result.stderr.replace("stray", "")


def test_a_package_that_names_no_top_level_modules_fails(tmp_path: Path) -> None:
    pkg = _tree(tmp_path, {"__init__.py": '"""A package."""\n', "a.py": ""})
    result = _run(pkg)
    assert result.returncode == 1
    assert "pkg/__init__.py:1: the package's docstring names no top-level modules" in result.stderr


def test_more_top_level_modules_than_ten_agreed_fail(tmp_path: Path) -> None:
    pkg = _tree(tmp_path, {f"m{i}.py": "" for i in range(11)})
    result = _run(pkg)
    assert result.returncode == 1
    assert "11 top-level modules agreed (at most 10)" in result.stderr


def test_a_folder_that_does_not_say_what_it_may_import_fails(tmp_path: Path) -> None:
    pkg = _tree(tmp_path, {"low/__init__.py": '"""Low things."""\n', "low/a.py": ""})
    result = _run(pkg)
    assert result.returncode == 1
    assert "pkg/low/__init__.py:1: folder low does not say what it may import" in result.stderr


def test_a_folder_imported_against_its_rule_fails(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "low/__init__.py": _rule("nothing"),
            "low/a.py": "import os\n\nfrom pkg.high import b\n",
            "high/__init__.py": _rule("low"),
            "high/b.py": "",
        },
    )
    result = _run(pkg)
    assert result.returncode == 1
    assert "pkg/low/a.py:3: pkg.low.a imports pkg.high.b, which folder low may not" in result.stderr
    assert "high/b.py" not in result.stderr


def test_a_rule_naming_one_module_of_a_folder_allows_that_module_alone(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "low/__init__.py": _rule("nothing"),
            "low/results.py": "",
            "low/service.py": "",
            "job/__init__.py": _rule("low.results"),
            "job/a.py": "from pkg.low import results\nfrom pkg.low.service import x\n",
        },
    )
    result = _run(pkg)
    assert result.returncode == 1
    assert "pkg/job/a.py:2: pkg.job.a imports pkg.low.service, which folder job may not" in (
        result.stderr
    )
    assert "pkg/job/a.py:1" not in result.stderr


def test_a_rule_naming_what_is_not_there_fails(tmp_path: Path) -> None:
    pkg = _tree(tmp_path, {"low/__init__.py": _rule("nowhere"), "low/a.py": ""})
    result = _run(pkg)
    assert result.returncode == 1
    assert "folder low may import nowhere, which is no other part of the package" in result.stderr


def test_rules_that_go_round_fail(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {"x/__init__.py": _rule("y"), "x/a.py": "", "y/__init__.py": _rule("x"), "y/b.py": ""},
    )
    result = _run(pkg)
    assert result.returncode == 1
    assert "pkg/x/__init__.py:1: the folders' rules go round: x -> y -> x" in result.stderr


def test_a_folder_and_a_top_level_module_importing_each_other_fail(tmp_path: Path) -> None:
    # No module imports itself back (no import cycle), but the folder and the
    # module each depend on the other: the layers no longer run one way.
    pkg = _tree(
        tmp_path,
        {
            "config.py": "from pkg.auth import keys\n",
            "auth/__init__.py": _rule("config"),
            "auth/keys.py": "",
            "auth/login.py": "from pkg import config\n",
        },
    )
    result = _run(pkg)
    assert result.returncode == 1
    assert "import cycle" not in result.stderr
    assert "pkg/auth/login.py:1: the package's parts import each other in a circle: " in (
        result.stderr
    )
    assert "auth -> config -> auth" in result.stderr


def test_the_package_itself_keeps_its_rules() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
