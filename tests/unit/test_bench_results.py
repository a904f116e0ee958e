"""bench/results holds one file per benchmark (and named configuration), each
saying what produced it, and docs/performance.md tells today's figures from them:
no dated copies, no file the README does not list, a page that stays short."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

import pytest

from bench import common

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
README = RESULTS / "README.md"
PERFORMANCE = ROOT / "docs" / "performance.md"
# The page tells today's figure for each benchmark; the history is in git.
MOST_LINES = 450
# A copy named by the time of day of its run (gateway_keyed-1652.json, .txt).
DATED = re.compile(r"-\d{4}\.[a-z]+$")


def _listed() -> set[str]:
    """The files README.md lists: each as `NAME` in the first column of its table."""
    return set(re.findall(r"^\|\s*`([^`]+)`", README.read_text(), re.MULTILINE))


def _kept() -> set[str]:
    # .keep and the like hold the folder in git, not figures.
    return {
        p.name for p in RESULTS.iterdir() if p.name != "README.md" and not p.name.startswith(".")
    }


def test_results_hold_no_dated_copy() -> None:
    assert sorted(n for n in _kept() if DATED.search(n)) == []


def test_every_results_file_is_listed_in_the_readme_and_every_listed_one_exists() -> None:
    assert sorted(_kept() - _listed()) == [], "not listed in bench/results/README.md"
    assert sorted(_listed() - _kept()) == [], "listed in bench/results/README.md, not there"


def test_every_results_file_the_performance_page_names_is_kept() -> None:
    named = set(re.findall(r"bench/results/([\w.-]+\.json)", PERFORMANCE.read_text()))
    assert named, "docs/performance.md names no results file"
    assert sorted(named - _kept()) == []


def test_the_performance_page_stays_short() -> None:
    lines = len(PERFORMANCE.read_text().splitlines())
    assert lines <= MOST_LINES, f"docs/performance.md has {lines} lines (at most {MOST_LINES})"


def _git(repo: Path, *argv: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *argv],
        check=True,
        capture_output=True,
    )


def test_a_results_file_records_settings_commit_and_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = [common.result("x", 2.0, "s", "ref", 4.0)]
    path = common.write("demo", rows, {"repeats": 3, "engine": "test"})
    doc = json.loads(path.read_text())
    assert path == tmp_path / "demo.json"
    assert doc["settings"] == {"repeats": 3, "engine": "test"}
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert doc["commit"]["sha"] == head
    assert isinstance(doc["commit"]["dirty"], bool)
    for when in ("start", "end"):
        assert len(doc["load_average"][when]) == 3
        assert all(x >= 0 for x in doc["load_average"][when])
    assert doc["results"] == rows
    # Overwritten by the next run, never kept beside it.
    common.write("demo", [], {"repeats": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["demo.json"]
    assert json.loads(path.read_text())["settings"] == {"repeats": 1}


def test_settings_are_required(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    with pytest.raises(TypeError):
        common.write("demo", [])  # type: ignore[call-arg]


def test_the_tree_is_dirty_when_code_changed_not_when_a_results_file_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "x.py").write_text("A = 1\n")
    (tmp_path / "bench" / "results" / "x.json").write_text("{}\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "start")
    monkeypatch.setattr(common, "ROOT", tmp_path)
    assert common.commit()["dirty"] is False
    (tmp_path / "bench" / "results" / "x.json").write_text('{"run": 2}\n')
    assert common.commit()["dirty"] is False
    (tmp_path / "bench" / "x.py").write_text("A = 2\n")
    assert common.commit()["dirty"] is True


def _write_calls(tree: ast.AST) -> list[ast.Call]:
    def is_write(f: ast.expr) -> bool:
        return (isinstance(f, ast.Name) and f.id == "write") or (
            isinstance(f, ast.Attribute)
            and f.attr == "write"
            and getattr(f.value, "id", "") == "common"
        )

    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and is_write(n.func)]


def test_every_benchmark_passes_its_settings_to_write() -> None:
    # write() would refuse at the end of a run; this says so before one is started.
    missing, found = [], 0
    for path in sorted((ROOT / "bench").glob("*.py")):
        for call in _write_calls(ast.parse(path.read_text())):
            found += 1
            if len(call.args) + len(call.keywords) < 3:
                missing.append(f"{path.name}:{call.lineno}")
    assert found >= 10
    assert missing == []
